"""Where an engine step's time goes: the default model, N concurrent streams in steady decode.

    .venv/bin/python scripts/profile_step.py --streams 1 32 [--steps 40] [--dtype auto]

Builds the engine in process (no HTTP), admits N requests with 64-token prompts, runs until all
are decoding, then times `--steps` decode steps and prints ms/step and the functions that took the
most cumulative time (cProfile). Prints the CPU flags it ran on, and the step split into the model
forward, the logits, the sampler and the rest (scheduler, input batch, attention metadata): the
engine's own overhead, which other processes on the machine disturb less than the whole step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.records import EngineRequest
from helios.loaders.checkpoint import load_checkpoint
from helios.loaders.default_model import ensure_default_model
from helios.models.llama import LlamaForCausalLM
from helios.runtime import choose_dtype, cpu_flags


def split(stats: pstats.Stats, steps: int) -> str:
    """ms/step (cumulative, under cProfile) of the step's parts, from the profile's own entries."""
    wanted = {"step": ("engine/core.py", "step"), "forward": ("models/llama.py", "forward"),
              "logits": ("models/llama.py", "compute_logits"), "sample": ("engine/sampler.py", "sample")}
    found = dict.fromkeys(wanted, 0.0)
    entries = stats.stats  # type: ignore[attr-defined]
    for (filename, _line, func), (_cc, _nc, _tt, ct, _callers) in entries.items():
        for part, (suffix, name) in wanted.items():
            if func == name and filename.endswith(suffix):
                # The model's forward holds its decoder layers' forwards (same file and name): the largest.
                found[part] = max(found[part], ct) if part == "forward" else found[part] + ct
    ms = {k: v * 1e3 / steps for k, v in found.items()}
    rest = ms["step"] - ms["forward"] - ms["logits"] - ms["sample"]
    return (f"   split ms/step: forward {ms['forward']:.2f}, logits {ms['logits']:.2f}, sample {ms['sample']:.2f}, "
            f"rest (scheduler, input batch, attention metadata) {rest:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    dtype = choose_dtype(args.dtype, args.device)
    ckpt = load_checkpoint(str(ensure_default_model()), dtype)
    model = LlamaForCausalLM(ckpt.config, dtype=dtype, device=args.device)
    model.load_weights(ckpt.tensors)
    model.eval()
    print(f"CPU flags: {cpu_flags()}; torch {torch.__version__}; threads {torch.get_num_threads()}; dtype {dtype}")
    for n in args.streams:
        core = EngineCore(model, ckpt.config, EngineConfig(page_size=16, num_pages=2048, max_active=64,
                                                            prefill_chunk_size=512, max_model_len=2048),
                          dtype, args.device)
        for i in range(n):
            prompt = tuple((17 * i + 31 * j) % 40000 + 100 for j in range(64))
            core.add(EngineRequest(f"s{i}", prompt, SamplingParams(temperature=1.0, seed=i),
                                   max_tokens=args.steps + 64, ignore_eos=True))
        while any(s.is_prefilling or s.num_computed == 0 for s in core.scheduler.running) or core.scheduler.waiting:
            core.step()
        for _ in range(3):
            core.step()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(args.steps):
            core.step()
        if args.device != "cpu":
            torch.cuda.synchronize()
        prof.disable()
        ms = (time.perf_counter() - t0) * 1e3 / args.steps
        print(f"\n== {n} stream(s): {ms:.1f} ms/step, {n * 1e3 / ms:.1f} tok/s (under cProfile)")
        buf = io.StringIO()
        stats = pstats.Stats(prof, stream=buf)
        print(split(stats, args.steps))
        stats.sort_stats("cumulative").print_stats(args.top)
        print("\n".join(line for line in buf.getvalue().splitlines()[6:] if line.strip()))


if __name__ == "__main__":
    main()
