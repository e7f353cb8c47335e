"""Microbenchmarks of the decode step's big operators, on random data of the default model's shapes.

    .venv/bin/python scripts/bench_kernels.py [--repeats 10] [--only kquant|q8] [--threads N] [--cpu-time]

- ``paged_decode``: Helios's decode attention over all 30 layers, bf16 caches with shuffled 16-position
  pages, 9 query heads over 3 kv heads of 64: 32 rows x 300 positions and 1 row x 4,000 positions.
- ``paged_prefill``: Helios's prefill attention of one layer (same heads), a chunk of 511, 512, 513, 600
  and 1,000 tokens from position 0 and one of 512 over 1,500 cached positions (AVX512-BF16 only).
- dense bf16 / float32 projections of all 30 layers (qkv 960x576, o 576x576, gate/up 3072x576, down
  576x1536) through ``F.linear`` and through the oneDNN-packed weights `quant.pack_onednn` gives them,
  at 1, 13, 32 and 512 rows.
- ``kquant_linear``: Helios's GGUF block matmul (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, Q8_0, random valid
  blocks) on Qwen2.5-0.5B's MLP shapes, gate/up 4864x896 (the 32-weight block types only: 896 is not a
  multiple of 256, so K-quant files store it in Q5_0 / Q8_0) and down 896x4864, at 1, 8 and 32 rows,
  with float32 and bfloat16 activations, against the dense matmul of the dequantized weight (float32
  and bfloat16 ``F.linear``) and against dequantize-then-float32-GEMM (`KQuantLinear`'s unpack path).
  Each figure is per weight, over a pass through enough distinct copies of it (96 MB) that the
  weights come from memory, not from the L3 cache, as a whole model's do in a decode step.
- ``q8_linear``: the Qwen2.5-0.5B tied Q8_0 head (151936 x 896 codes, 136 MB) at 1, 8 and 32 rows.

``--cpu-time`` times with the calling thread's CPU time instead of the wall clock (with ``--threads 1``:
figures that other processes on a busy machine disturb much less).

Prints the best of ``--repeats`` runs in ms, and the CPU flags it ran on.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from helios.models import cpu_kernels
from helios.models.dense import dense_matmul
from helios.models.kquant import BlockQuantized
from helios.models.quant import DenseLinear, best_time, onednn_linear_works, pack_onednn
from helios.runtime import cpu_flags

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


CPU_TIME = False  # --cpu-time: time.thread_time instead of the wall clock


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    if not CPU_TIME:
        return best_time(fn, repeats) * 1e3
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best * 1e3


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


KQUANT_SHAPES = [(4864, 896), (896, 4864)]  # Qwen2.5-0.5B's gate/up (one of the two) and down: [out, in]


def random_blocks(ggml_type: int, rows: int, cols: int, gen: torch.Generator) -> BlockQuantized:
    """Random codes and sub-block scales, float16 scales of about 0.01 (valid blocks of any type)."""
    per, nbytes = cpu_kernels.KQUANT_LAYOUTS[ggml_type]
    count = rows * cols // per
    blocks = torch.randint(0, 256, (count, nbytes), generator=gen, dtype=torch.uint8)
    halves = {6: (0,), 7: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}[ggml_type]
    for off in halves:
        blocks[:, off:off + 2] = (torch.randn(count, generator=gen) * 0.01).half().view(torch.uint8).view(count, 2)
    return BlockQuantized(blocks.view(rows, -1), ggml_type, (rows, cols))


def kquant(ggml_type: int, out: int, k: int, repeats: int) -> None:
    gen = torch.Generator().manual_seed(ggml_type)
    weight = random_blocks(ggml_type, out, k, gen)
    for rows in (1, 8, 32):
        kquant_rows(weight, torch.randn(rows, k, generator=gen), repeats)


STREAM_BYTES = 96e6  # more than this machine's L3: each timed pass streams its weights from memory


def copies_of(t: torch.Tensor) -> list[torch.Tensor]:
    """Enough distinct copies of ``t`` that one pass over them all does not fit in the caches."""
    return [t.clone() for _ in range(max(1, math.ceil(STREAM_BYTES / (t.numel() * t.element_size()))))]


def per_copy_ms(fn: Callable[[torch.Tensor], object], copies: list[torch.Tensor], repeats: int) -> float:
    return best_ms(lambda: [fn(c) for c in copies], repeats) / len(copies)


def kquant_rows(weight: BlockQuantized, x: torch.Tensor, repeats: int) -> None:
    (out, k), t = weight.shape, weight.ggml_type
    w32 = weight.dequantize()
    xb = x.to(torch.bfloat16)
    mb = weight.blocks.numel() / 1e6
    blocks, dense32, dense16 = copies_of(weight.blocks), copies_of(w32), copies_of(w32.to(torch.bfloat16))
    with torch.inference_mode():
        f32 = per_copy_ms(lambda b: cpu_kernels.kquant_linear(x, b, t, out), blocks, repeats)
        bf16 = per_copy_ms(lambda b: cpu_kernels.kquant_linear(xb, b, t, out), blocks, repeats)
        d32 = per_copy_ms(lambda w: F.linear(x, w), dense32, repeats)
        d16 = per_copy_ms(lambda w: F.linear(xb, w), dense16, repeats)
        unpack = per_copy_ms(lambda b: F.linear(x, cpu_kernels.kquant_dequantize(b, t, out, k)), blocks[:4], repeats)
    print(f"kquant {weight.name} {out}x{k} ({mb:.2f} MB) x {x.shape[0]:>2} rows: kquant_linear f32 {f32:6.3f} ms "
          f"({mb / f32:4.1f} GB/s), bf16 {bf16:6.3f} ms | dense F.linear f32 {d32:6.3f} ms, bf16 {d16:6.3f} ms "
          f"| dequantize + f32 GEMM {unpack:6.3f} ms")


def q8_head(repeats: int) -> None:
    gen = torch.Generator().manual_seed(8)
    codes = torch.randint(-128, 128, (151936, 896), generator=gen, dtype=torch.int8)
    scales = (torch.randn(151936, 28, generator=gen) * 0.01).half().float()
    for rows in (1, 8, 32):
        x = torch.randn(rows, 896, generator=gen)
        ms = best_ms(lambda x=x: cpu_kernels.q8_linear(x, codes, scales), repeats)
        print(f"q8_linear head 151936x896 (136 MB) x {rows:>2} rows: {ms:7.2f} ms ({codes.numel() / ms / 1e6:4.1f} GB/s)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--only", choices=["kquant", "q8"], help="run one section")
    ap.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's own)")
    ap.add_argument("--cpu-time", action="store_true", help="time by the thread's CPU time (use with --threads 1)")
    args = ap.parse_args()
    global CPU_TIME
    CPU_TIME = args.cpu_time
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"CPU flags: {cpu_flags()}; torch {torch.__version__}; threads {torch.get_num_threads()}")
    if args.only in ("kquant", "q8"):
        if not cpu_kernels.available():
            print(f"Helios's CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
            return
        if args.only == "q8":
            q8_head(args.repeats)
            return
        for ggml_type in sorted(cpu_kernels.KQUANT_LAYOUTS):
            per = cpu_kernels.KQUANT_LAYOUTS[ggml_type][0]
            for out, k in KQUANT_SHAPES:
                if k % per == 0:
                    kquant(ggml_type, out, k, args.repeats)
        return
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
    if cpu_kernels.available():
        q8_head(args.repeats)
        for ggml_type in sorted(cpu_kernels.KQUANT_LAYOUTS):
            per = cpu_kernels.KQUANT_LAYOUTS[ggml_type][0]
            for out, k in KQUANT_SHAPES:
                if k % per == 0:
                    kquant(ggml_type, out, k, args.repeats)


if __name__ == "__main__":
    main()
