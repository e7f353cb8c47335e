"""The prefill attention kernel alone, on its AMX and AVX512-BF16 paths (docs/benchmarks.md, "AMX").

    .venv/bin/python scripts/bench_prefill_attention.py [--threads 2] [--runs 5]

Times `cpu_kernels.paged_prefill` for chunks of 512 tokens over 0, 1,500 and 3,000 cached positions
and of 1,500 tokens from the start (9 query / 3 kv heads of 64, bfloat16 K/V at shuffled slots),
alternating the two paths (`cpu_kernels.set_prefill_amx`), and prints the minimum of ``--runs`` calls
each with its GFLOP/s (4 flops per query-key pair and head dimension). Without AMX tiles (not built
or not granted) only the AVX512-BF16 path is timed. Prints the CPU flags it ran on.
"""

from __future__ import annotations

import argparse
import time

import torch

from helios.models import cpu_kernels
from helios.runtime import cpu_flags


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    if not (cpu_kernels.available() and cpu_kernels.bf16_kernels_supported()):
        raise SystemExit("the prefill kernel is not built here (it needs AVX512-BF16)")
    torch.set_num_threads(args.threads)
    paths = [False, True] if cpu_kernels.amx_permitted() else [False]
    print(f"CPU flags: {cpu_flags()}; torch {torch.__version__}; threads {args.threads}")
    heads, kv_heads, d, slots_total = 9, 3, 64, 8192
    try:
        for length, start in [(512, 0), (512, 1500), (512, 3000), (1500, 0)]:
            g = torch.Generator().manual_seed(0)
            k = torch.randn(kv_heads, slots_total, d, generator=g).to(torch.bfloat16)
            v = torch.randn(kv_heads, slots_total, d, generator=g).to(torch.bfloat16)
            slots = torch.randperm(slots_total, generator=g)[: length + start].contiguous()
            q = torch.randn(length, heads, d, generator=g).to(torch.bfloat16)
            times: dict[bool, list[float]] = {amx: [] for amx in paths}
            for _ in range(args.runs):
                for amx in paths:
                    cpu_kernels.set_prefill_amx(amx)
                    t = time.perf_counter()
                    cpu_kernels.paged_prefill(q, k, v, slots, start, d**-0.5)
                    times[amx].append(time.perf_counter() - t)
            flops = (length * start + length * (length + 1) / 2) * heads * d * 4
            cells = [f"{'AMX' if amx else 'AVX512-BF16'} {min(ts) * 1e3:.2f} ms ({flops / min(ts) / 1e9:.0f} GFLOP/s)"
                     for amx, ts in times.items()]
            print(f"{length} tokens over {start} cached: " + ", ".join(cells))
    finally:
        cpu_kernels.set_prefill_amx(True)


if __name__ == "__main__":
    main()
