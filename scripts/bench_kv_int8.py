"""The int8 KV cache (``[engine] kv_dtype = "int8"``) against the default cache on the default model.

    .venv/bin/python scripts/bench_kv_int8.py [--weights auto] [--tokens 64] [--speed-tokens 128]
                                              [--repeats 2] [--threads 1]

Prompts: the parity prompt of tests/parity (the chat-templated "What is the capital of France?") and
three more chat prompts (`PROMPTS`). For each, with the model loaded as ``helios serve`` loads it
(``--weights``):

- greedy: ``--tokens`` greedy tokens (EOS ignored) from an engine with the default cache and from one
  with int8 K/V; whether they are identical, where they first differ, and |Δ logprob| of the chosen
  tokens before that point (the same history on both sides: decode steps through each cache's own
  decode kernel);
- teacher-forced: the prompt followed by the default cache's continuation, scored by both engines
  as prompt logprobs (one prefill each), |Δ logprob| of every continuation token: the int8 cache's
  drift on identical inputs.

Then decode speed at one stream: ``--speed-tokens`` greedy tokens after the parity prompt, each cache
``--repeats`` times alternated, with torch on ``--threads`` threads; tokens per second of wall time
and of the process's CPU time (on a busy machine the CPU-time figure is the steadier one).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.records import EngineRequest
from helios.loaders.chat_template import ChatTemplate
from helios.loaders.default_model import ensure_default_model
from helios.runtime import LoadedModel, load_model

PROMPTS = (
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give me three tips for sleeping better.",
)


def _engine(loaded: LoadedModel, kv_dtype: str) -> EngineCore:
    cfg = EngineConfig(page_size=16, num_pages=128, max_active=1, prefill_chunk_size=512, max_model_len=2048,
                       prefix_caching=False, kv_dtype=kv_dtype)
    return EngineCore(loaded.model, cfg, loaded.choice.dtype)


def _drain(core: EngineCore, request: EngineRequest) -> list:  # type: ignore[type-arg]
    core.add(request)
    outs = []
    while core.scheduler.has_work:
        outs.extend(core.step())
    return outs


def _greedy(core: EngineCore, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    outs = _drain(core, EngineRequest("g", tuple(ids), SamplingParams(temperature=0.0), max_tokens=n, ignore_eos=True,
                                      num_top_logprobs=0))
    return ([t for o in outs for t in o.new_token_ids], [lp.logprob for o in outs for lp in (o.logprobs or ())])


def _scored(core: EngineCore, ids: list[int]) -> list[float]:
    """Prompt logprobs of positions 1 .. len(ids) - 1 (one prefill)."""
    outs = _drain(core, EngineRequest("s", tuple(ids), SamplingParams(temperature=0.0), max_tokens=1,
                                      prompt_logprobs=0))
    scores = [p for o in outs for p in (o.prompt_logprobs or ())]
    return [p.logprob for p in scores if p is not None]


def _speed(loaded: LoadedModel, kv_dtype: str, ids: list[int], n: int) -> tuple[float, float]:
    core = _engine(loaded, kv_dtype)
    core.add(EngineRequest("v", tuple(ids), SamplingParams(temperature=0.0), max_tokens=n, ignore_eos=True))
    core.step()  # the prefill (and first token)
    produced = 0
    wall, cpu = time.perf_counter(), time.process_time()
    while core.scheduler.has_work:
        produced += sum(len(o.new_token_ids) for o in core.step())
    return produced / (time.perf_counter() - wall), produced / (time.process_time() - cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--speed-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded = load_model(ensure_default_model(quiet=True), weights=args.weights)
    print(loaded.choice.describe())
    ckpt = loaded.checkpoint
    assert ckpt.chat_template is not None
    template = ChatTemplate(ckpt.chat_template)
    prompts = [ckpt.tokenizer.encode(template.render([{"role": "user", "content": p}]), add_special_tokens=False)
               for p in PROMPTS]
    auto, int8 = _engine(loaded, "auto"), _engine(loaded, "int8")
    all_greedy: list[float] = []
    all_forced: list[float] = []
    identical = 0
    for text, ids in zip(PROMPTS, prompts, strict=True):
        tok_a, lp_a = _greedy(auto, ids, args.tokens)
        tok_q, lp_q = _greedy(int8, ids, args.tokens)
        first = next((i for i, (a, q) in enumerate(zip(tok_a, tok_q, strict=True)) if a != q), None)
        same = first if first is not None else len(tok_a)
        identical += first is None
        greedy = [abs(a - q) for a, q in zip(lp_a[:same], lp_q[:same], strict=True)]
        forced_a = _scored(auto, ids + tok_a)[len(ids) - 1:]
        forced_q = _scored(int8, ids + tok_a)[len(ids) - 1:]
        forced = [abs(a - q) for a, q in zip(forced_a, forced_q, strict=True)]
        all_greedy += greedy
        all_forced += forced
        print(f"{text!r}: greedy {'identical' if first is None else f'first differs at token {first}'}; "
              f"greedy |dlogprob| max {max(greedy, default=0):.4f} mean {statistics.fmean(greedy or [0]):.4f} "
              f"over {len(greedy)}; teacher-forced max {max(forced):.4f} mean {statistics.fmean(forced):.4f} "
              f"over {len(forced)}")
    print(f"all: {identical}/{len(PROMPTS)} greedy continuations identical; greedy |dlogprob| max "
          f"{max(all_greedy):.4f} mean {statistics.fmean(all_greedy):.4f}; teacher-forced max {max(all_forced):.4f} "
          f"mean {statistics.fmean(all_forced):.4f}")
    for kv_dtype in ["auto", "int8"] * args.repeats:
        wall, cpu = _speed(loaded, kv_dtype, prompts[0], args.speed_tokens)
        print(f"decode, 1 stream, kv_dtype={kv_dtype}: {wall:.1f} tok/s wall, {cpu:.1f} tok/s of CPU time")


if __name__ == "__main__":
    main()
