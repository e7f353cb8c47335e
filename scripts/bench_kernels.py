"""Microbenchmarks of the decode step's big operators, on random data of the default model's shapes.

    .venv/bin/python scripts/bench_kernels.py [--repeats 10]

- ``paged_decode``: Helios's decode attention over all 30 layers, bf16 caches with shuffled 16-position
  pages, 9 query heads over 3 kv heads of 64: 32 rows x 300 positions and 1 row x 4,000 positions.
- ``paged_prefill``: Helios's prefill attention of one layer (same heads), a chunk of 511, 512, 513, 600
  and 1,000 tokens from position 0 and one of 512 over 1,500 cached positions (AVX512-BF16 only).
- dense bf16 / float32 projections of all 30 layers (qkv 960x576, o 576x576, gate/up 3072x576, down
  576x1536) through ``F.linear`` and through the oneDNN-packed weights `quant.pack_onednn` gives them,
  at 1, 13, 32 and 512 rows.

Prints the best of ``--repeats`` runs in ms, and the CPU flags it ran on.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from helios.models import cpu_kernels
from helios.models.quant import DenseLinear, best_time, dense_matmul, onednn_linear_works, pack_onednn
from helios.runtime import cpu_flags

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    return best_time(fn, repeats) * 1e3


def decode_attention(rows: int, context: int, repeats: int) -> None:
    page, kv_heads, heads, dim = 16, 3, 9, 64
    pages_per_row = -(-context // page)
    num_pages = rows * pages_per_row + 4
    gen = torch.Generator().manual_seed(0)
    ks = [torch.randn(kv_heads, num_pages * page, dim, generator=gen).bfloat16() for _ in range(LAYERS)]
    vs = [torch.randn(kv_heads, num_pages * page, dim, generator=gen).bfloat16() for _ in range(LAYERS)]
    table = torch.randperm(num_pages, generator=gen)[: rows * pages_per_row].view(rows, pages_per_row).contiguous()
    q = torch.randn(rows, heads, dim, generator=gen).bfloat16()
    batch_rows, lens = torch.arange(rows), torch.full((rows,), context)

    def run() -> None:
        for k, v in zip(ks, vs, strict=True):
            cpu_kernels.paged_decode(q, k, v, table, batch_rows, lens, page, dim**-0.5)

    kv_bytes = LAYERS * rows * context * kv_heads * dim * 2 * 2
    ms = best_ms(run, repeats)
    print(f"paged_decode {rows:>2} rows x {context:>4} positions x {LAYERS} layers: {ms:6.2f} ms "
          f"({kv_bytes / 1e6:.0f} MB of K/V, {kv_bytes / ms / 1e6:.1f} GB/s)")


def prefill_attention(length: int, start: int, repeats: int) -> None:
    kv_heads, heads, dim = 3, 9, 64
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(kv_heads, 4096, dim, generator=gen).bfloat16()
    v = torch.randn(kv_heads, 4096, dim, generator=gen).bfloat16()
    slots = torch.randperm(4096, generator=gen)[: start + length].contiguous()
    q = torch.randn(length, heads, dim, generator=gen).bfloat16()
    ms = best_ms(lambda: cpu_kernels.paged_prefill(q, k, v, slots, start, dim**-0.5), repeats)
    print(f"paged_prefill {length:>4} tokens after {start:>4} positions, one layer: {ms:6.3f} ms")


def projections(dtype: torch.dtype, rows: int, repeats: int) -> None:
    gen = torch.Generator().manual_seed(1)
    layers = [[DenseLinear(torch.randn(n, k, generator=gen).to(dtype)) for n, k in SHAPES] for _ in range(LAYERS)]
    xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for _, k in SHAPES}

    def plain() -> None:
        for layer in layers:
            for m in layer:
                F.linear(xs[m.weight.shape[1]], m.weight)

    def packed() -> None:
        for layer in layers:
            for m in layer:
                dense_matmul(xs[m.weight.shape[1]], m.weight, m.onednn)

    with torch.inference_mode():
        a = best_ms(plain, repeats)
        if not all(pack_onednn(m) for layer in layers for m in layer):
            print(f"{dtype} x {rows:>3} rows: F.linear {a:7.2f} ms; oneDNN prepacked linear not used here")
            return
        b = best_ms(packed, repeats)
    name = str(dtype).removeprefix("torch.")
    print(f"projections {name:>8} x {rows:>3} rows, {LAYERS} layers: F.linear {a:7.2f} ms, oneDNN-packed {b:7.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    print(f"CPU flags: {cpu_flags()}; torch {torch.__version__}; threads {torch.get_num_threads()}")
    if cpu_kernels.available():
        decode_attention(32, 300, args.repeats)
        decode_attention(1, 4000, args.repeats)
        if cpu_kernels.bf16_kernels_supported():
            for length, start in ((511, 0), (512, 0), (513, 0), (600, 0), (1000, 0), (512, 1500)):
                prefill_attention(length, start, 2 * args.repeats)
    else:
        print(f"Helios's CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    for dtype in (torch.bfloat16, torch.float32):
        if not onednn_linear_works(dtype):
            print(f"{dtype}: oneDNN's prepacked linear is not used on this machine")
        for rows in (1, 13, 32, 512):
            projections(dtype, rows, max(2, args.repeats // (4 if rows == 512 else 1)))


if __name__ == "__main__":
    main()
