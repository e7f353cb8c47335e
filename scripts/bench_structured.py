"""Structured output's cost in decode: N streams with a JSON schema against the same N unconstrained.

    .venv/bin/python scripts/bench_structured.py [--streams 8] [--steps 48] [--rounds 3] [--no-forced]

Loads the default model as `helios serve` does (`runtime.load_model`), builds the engine in process
(no HTTP) and, for each round, runs the same N seeded requests twice, unconstrained and under a
JSON schema (an array of 40 small records: long enough that no stream ends within the timed steps),
alternating which goes first. After every stream is decoding it times ``--steps`` decode steps and
reports per run: ms per step, committed tokens per step (grammar-forced tokens add to it), decode
tokens/s, and for the constrained run the mask fill time per step on the helper thread (overlapped
with the forward) and the exposed mask time per step (waiting for the fill plus unpacking it).
Medians over the rounds. ``--no-forced`` disables forced-token fast-forwarding (every token sampled).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import trio

import helios.engine.output_tracker as output_tracker
from helios.domain.generation import OutputConstraint
from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.records import EngineRequest
from helios.engine.structured import GrammarBatch
from helios.loaders.default_model import default_cache_dir, ensure_default_model
from helios.runtime import cpu_flags, load_model
from helios.serving.structured import GrammarCompiler

SCHEMA = {"type": "array", "minItems": 40, "maxItems": 40, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "ok"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                   "name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}}}}
PROMPT = "<|im_start|>user\nList forty people as JSON records with id, name and ok.<|im_end|>\n<|im_start|>assistant\n"


def run(core: EngineCore, tok, streams: int, steps: int, constraint) -> dict[str, float]:
    prompt = tuple(tok.encode(PROMPT, add_special_tokens=False))
    for i in range(streams):
        core.add(EngineRequest(f"r{i}-{time.perf_counter_ns()}", prompt, SamplingParams(temperature=0.7, seed=i),
                               600, eos_token_ids=frozenset(tok.eos_token_ids), constraint=constraint))
    sched = core.scheduler
    while sched.waiting or any(s.is_prefilling for s in sched.running):
        core.step()
    grammar = core.runner.grammar
    fills0, fill0, result0 = grammar.num_fills, grammar.fill_ns, grammar.result_ns
    tokens = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        for out in core.step():
            tokens += len(out.new_token_ids)
    elapsed = time.perf_counter() - t0
    assert len(sched.running) == streams, "a stream ended inside the timed steps"
    for s in list(sched.running):
        sched.finish(s)
    core.step()  # frees the rows
    fills = grammar.num_fills - fills0
    return {"ms_step": elapsed / steps * 1e3, "tok_step": tokens / steps, "tok_s": tokens / elapsed,
            "fill_ms": (grammar.fill_ns - fill0) / max(fills, 1) / 1e6,
            "exposed_ms": (grammar.result_ns - result0) / max(fills, 1) / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--no-forced", action="store_true")
    ap.add_argument("--no-overlap", action="store_true", help="fill masks on the engine thread before the forward")
    ap.add_argument("--llg-threads", type=int, default=None, help="llguidance executor threads (default: its own)")
    args = ap.parse_args()
    if args.no_forced:
        output_tracker.MAX_FORCED = 0
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(ensure_default_model(quiet=True), weights=args.weights, cache_dir=default_cache_dir() / "packed")
    tok = loaded.checkpoint.tokenizer
    core = EngineCore(loaded.model,
                      EngineConfig(num_pages=1024, max_active=max(16, args.streams), prefill_chunk_size=2048,
                                   max_model_len=2048, prefix_caching=False), loaded.choice.dtype)
    core.runner.grammar = GrammarBatch(core.sampler.vocab_size, num_threads=args.llg_threads,
                                       overlap=not args.no_overlap)
    constraint = trio.run(GrammarCompiler(tok).constraint, OutputConstraint("json_schema", SCHEMA))
    print(f"{loaded.choice.describe()}; torch threads {torch.get_num_threads()}; cpu {cpu_flags()}; "
          f"grammar fill {'before' if args.no_overlap else 'during'} the forward")
    run(core, tok, args.streams, 4, None)  # warm-up
    run(core, tok, args.streams, 4, constraint)
    results: dict[str, list[dict[str, float]]] = {"free": [], "json": []}
    for r in range(args.rounds):
        order = [("free", None), ("json", constraint)]
        for name, c in order if r % 2 == 0 else reversed(order):
            results[name].append(run(core, tok, args.streams, args.steps, c))
    med = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in results.items()}
    best = {name: min(rs, key=lambda x: x["ms_step"]) for name, rs in results.items()}
    for label, table in (("median", med), ("best", best)):
        for name, m in table.items():
            print(f"{label:6s} {name:5s} {m['ms_step']:7.2f} ms/step  {m['tok_step']:5.2f} tok/step  "
                  f"{m['tok_s']:7.1f} tok/s" + (f"  fill {m['fill_ms']:.3f} ms/step  exposed {m['exposed_ms']:.3f} "
                                                 "ms/step" if name == "json" else ""))
    step_cost = med["json"]["ms_step"] / med["free"]["ms_step"] - 1
    tput = med["json"]["tok_s"] / med["free"]["tok_s"] - 1
    best_cost = best["json"]["ms_step"] / best["free"]["ms_step"] - 1
    best_tput = best["json"]["tok_s"] / best["free"]["tok_s"] - 1
    print(f"best: step time {best_cost:+.1%}, decode tokens/s {best_tput:+.1%}")
    print(f"median: json vs free: step time {step_cost:+.1%}, decode tokens/s {tput:+.1%} ({args.streams} streams, "
          f"{args.rounds} rounds, {args.steps} steps{', no forced tokens' if args.no_forced else ''}"
          f"{', fill before the forward' if args.no_overlap else ''})")


if __name__ == "__main__":
    main()
