"""Where an engine step's time goes: the default model (or ``--model PATH``), N concurrent streams in
steady decode.

    .venv/bin/python scripts/profile_step.py --streams 1 32 [--steps 40] [--weights auto] [--context 64]
        [--model PATH]

Loads the default model as `helios serve` does (`runtime.load_model`: weight format, packed-weight
cache, Helios's CPU kernels unless HELIOS_CPU_KERNELS=0), builds the engine in process (no HTTP),
admits N requests with ``--context``-token prompts, runs until all are decoding, then times `--steps` decode steps and prints ms/step and the functions that took the
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
from helios.loaders.default_model import default_cache_dir, ensure_default_model
from helios.runtime import cpu_flags, load_model


def split(stats: pstats.Stats, steps: int) -> str:
    """ms/step (cumulative, under cProfile) of the step's parts, from the profile's own entries."""
    wanted = {"step": ("engine/core.py", "step"), "logits": ("models/decoder.py", "compute_logits"),
              "sample": ("engine/sampling/sampler.py", "sample")}
    found = dict.fromkeys([*wanted, "forward"], 0.0)
    entries = stats.stats  # type: ignore[attr-defined]
    for (filename, _line, func), (_cc, _nc, _tt, ct, _callers) in entries.items():
        if func == "forward" and "/helios/models/" in filename.replace("\\", "/"):
            # Any family's model forward holds its modules' forwards (layers, projections): the largest.
            found["forward"] = max(found["forward"], ct)
        for part, (suffix, name) in wanted.items():
            if func == name and filename.endswith(suffix):
                found[part] += ct
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
    ap.add_argument("--sort", default="cumulative", help="the profile's order (cumulative, tottime, ...)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--context", type=int, default=64, help="prompt tokens per stream")
    ap.add_argument("--plain", action="store_true", help="also time the steps without cProfile first")
    ap.add_argument("--model", default=None, metavar="PATH",
                    help="a GGUF file or model directory (default: the default model)")
    args = ap.parse_args()
    loaded = load_model(args.model or ensure_default_model(), weights=args.weights, dtype=args.dtype, device=args.device,
                        cache_dir=default_cache_dir() / "packed")
    model, dtype = loaded.model, loaded.choice.dtype
    print(f"CPU flags: {cpu_flags()}; torch {torch.__version__}; threads {torch.get_num_threads()}; "
          f"{loaded.choice.describe()}; logits: {model.head_format}")
    for n in args.streams:
        tokens = args.context + 2 * args.steps + 64
        core = EngineCore(model, EngineConfig(page_size=16, num_pages=n * (-(-tokens // 16)) + 16,
                                                            max_active=64, prefill_chunk_size=512,
                                                            max_model_len=tokens + 16),
                          dtype, args.device)
        print(f"attention backend: {core.attention.name}")
        for i in range(n):
            prompt = tuple((17 * i + 31 * j) % 40000 + 100 for j in range(args.context))
            core.add(EngineRequest(f"s{i}", prompt, SamplingParams(temperature=1.0, seed=i),
                                   max_tokens=2 * args.steps + 64, ignore_eos=True))
        while any(s.is_prefilling or s.num_computed == 0 for s in core.scheduler.running) or core.scheduler.waiting:
            core.step()
        for _ in range(3):
            core.step()
        if args.plain:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                core.step()
            plain = (time.perf_counter() - t0) * 1e3 / args.steps
            print(f"\n== {n} stream(s), no profiler: {plain:.1f} ms/step, {n * 1e3 / plain:.1f} tok/s")
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
        stats.sort_stats(args.sort).print_stats(args.top)
        print("\n".join(line for line in buf.getvalue().splitlines()[6:] if line.strip()))


if __name__ == "__main__":
    main()
