"""Where a prompt's prefill time goes: the default model (or ``--model PATH``), one request at a time,
in process.

    .venv/bin/python scripts/profile_prefill.py [--tokens 512 513] [--runs 7] [--profile] [--ab-keep]
        [--ab-amx] [--ab-tiles] [--model PATH]

Loads the default model as `helios serve` does, builds the engine in process (no HTTP) and times the
prefill of one ``--tokens``-token prompt (``max_tokens=1``, distinct prompts, so no prefix cache hit):
the median of ``--runs`` after two warm-ups. ``--profile`` adds torch.profiler's operator table of
one more. ``--ab-keep`` alternates the runs with the model's whole-batch path (``keep`` not passed:
the last layer computes every row) and prints both medians; ``--ab-amx`` alternates the prefill
attention kernel's AMX and AVX512-BF16 paths (`cpu_kernels.set_prefill_amx`); ``--ab-tiles`` a
k-quant model's projections with and without the tiles path (`cpu_kernels.set_kquant_tiles`). Prints
the CPU flags it ran on.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.records import EngineRequest
from helios.loaders.default_model import default_cache_dir, ensure_default_model
from helios.runtime import cpu_flags, load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[512])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--ab-keep", action="store_true")
    ap.add_argument("--ab-amx", action="store_true")
    ap.add_argument("--ab-tiles", action="store_true")
    ap.add_argument("--model", default=None, metavar="PATH",
                    help="a GGUF file or model directory (default: the default model)")
    args = ap.parse_args()
    loaded = load_model(args.model or ensure_default_model(), cache_dir=default_cache_dir() / "packed")
    print(f"CPU flags: {cpu_flags()}; torch {torch.__version__}; threads {torch.get_num_threads()}; "
          f"{loaded.choice.describe()}")
    model = loaded.model
    core = EngineCore(model,
                      EngineConfig(page_size=16, num_pages=2000, max_active=8, prefill_chunk_size=max(args.tokens),
                                   max_model_len=max(args.tokens) + 16), loaded.choice.dtype)
    serial = itertools.count()
    use_keep = {"on": True}
    real = model.forward

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, attn: Any, *, embeds: Any = None,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        if use_keep["on"] or keep is None:
            return real(input_ids, positions, attn, embeds=embeds, keep=keep)
        return real(input_ids, positions, attn, embeds=embeds).index_select(0, keep)  # the whole-batch path

    model.forward = forward  # type: ignore[method-assign]

    def prefill(tokens: int) -> float:
        i = next(serial)
        prompt = tuple((7919 * i + 31 * j) % 40000 + 100 for j in range(tokens))
        core.add(EngineRequest(f"r{i}", prompt, SamplingParams(temperature=0.0), max_tokens=1, ignore_eos=True))
        t = time.perf_counter()
        while core.scheduler.has_work:
            core.step()
        return (time.perf_counter() - t) * 1e3

    def alternate(tokens: int, switch: Callable[[bool], bool], missing: str) -> tuple[float, float]:
        """Medians of ``--runs`` prefills with ``switch(True)`` and with ``switch(False)``, alternating
        (``switch`` returns whether the setting took; ``missing``: the exit message where it did not)."""
        runs: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.runs):
            for on in (True, False):
                if switch(on) is not on:
                    raise SystemExit(missing)
                runs[on].append(prefill(tokens))
        switch(True)
        return statistics.median(runs[True]), statistics.median(runs[False])

    def keep_switch(on: bool) -> bool:
        use_keep["on"] = on
        return on

    for tokens in args.tokens:
        for _ in range(2):
            prefill(tokens)
        if args.ab_keep:
            on, off = alternate(tokens, keep_switch, "")
            print(f"{tokens} tokens: median {on:.1f} ms with keep, {off:.1f} ms without ({args.runs} runs each, "
                  "alternating)")
        elif args.ab_amx:
            from helios.models import cpu_kernels

            on, off = alternate(tokens, cpu_kernels.set_prefill_amx, "AMX tiles are not built or not permitted here")
            print(f"{tokens} tokens: median {on:.1f} ms with the AMX prefill attention, {off:.1f} ms with "
                  f"AVX512-BF16 ({args.runs} runs each, alternating)")
        elif args.ab_tiles:
            from helios.models import cpu_kernels

            on, off = alternate(tokens, cpu_kernels.set_kquant_tiles, "the k-quant tiles path does not run here")
            print(f"{tokens} tokens: median {on:.1f} ms with the k-quant tiles path "
                  f"({cpu_kernels.kquant_tiles_backend()}), {off:.1f} ms without ({args.runs} runs each, alternating)")
        else:
            ms = [prefill(tokens) for _ in range(args.runs)]
            print(f"{tokens} tokens: median {statistics.median(ms):.1f} ms (min {min(ms):.1f}, {args.runs} runs)")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                prefill(tokens)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
