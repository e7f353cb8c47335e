"""The k-quant matmul paths side by side on one weight: the exact kernel (`kquant_linear`), the AMX
tiles (`kquant_linear_tiles`, where the CPU has them) and dequantize-then-GEMM (the unpack path), in ms
a call and ps a weight, for bfloat16 activations of each row count.

    .venv/bin/python scripts/bench_kquant_tiles.py [--type 12] [--shape 17920 1536] [--rows 1 8 32 128]
        [--threads 1] [--runs 5] [--pair-ab] [--keep-buffers]

Weights are random valid blocks (`tests.unit.test_kquant.random_blocks`), large enough to come from
memory; each figure is the minimum of ``--runs`` calls. Prints the CPU flags it ran on. ``--pair-ab``
instead times the exact kernel with `cpu_kernels.kquant_bf16_dot_rows` off and on (the float32 path, or
Q6_K's float32 lanes, against the pair dot products of every row; where the build has AVX512-BF16).
``--keep-buffers`` keeps large freed buffers in the heap first, as the server does for a k-quant model
(`runtime.keep_large_buffers`), so the unpack column is the server's (without it each call faults a fresh
dense copy in).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helios.models import cpu_kernels
from helios.runtime import cpu_flags, keep_large_buffers
from tests.unit.test_kquant import random_blocks


def best(call: object, runs: int) -> float:
    fastest = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        call()  # type: ignore[operator]
        fastest = min(fastest, time.perf_counter() - start)
    return fastest * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--type", type=int, default=12, help="ggml type id (12 Q4_K, 14 Q6_K, 6 Q5_0, 8 Q8_0, ...)")
    ap.add_argument("--shape", type=int, nargs=2, default=[17920, 1536], metavar=("OUT", "IN"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--pair-ab", action="store_true", help="the exact kernel with kquant_bf16_dot_rows off / on")
    ap.add_argument("--keep-buffers", action="store_true",
                    help="keep large freed buffers in the heap first, as the server does for k-quant models "
                         "(runtime.keep_large_buffers): the unpack column without a fresh mapping per call")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.keep_buffers:
        keep_large_buffers()
    if not cpu_kernels.available():
        sys.exit(f"Helios's CPU kernels are not available: {cpu_kernels.unavailable_reason()}")
    tiles = cpu_kernels.kquant_tiles_supported()
    out, k = args.shape
    t = args.type
    blocks = torch.from_numpy(random_blocks(t, out, k, seed=1))
    print(f"CPU flags: {cpu_flags()}; threads {args.threads}; {cpu_kernels.KQUANT_NAMES[t]} {out} x {k}; "
          f"tiles {'yes' if tiles else 'no (not built or not permitted here)'}"
          f"{'; large buffers kept in the heap' if args.keep_buffers else ''}")
    per = 1e9 / (out * k)
    if args.pair_ab:
        if not cpu_kernels.kquant_bf16_dot_supported():
            sys.exit("the pair dot path is not built here (no AVX512-BF16)")
        default = cpu_kernels.kquant_bf16_dot_rows()
        print(f"{'rows':>5} {'float32 ps/w':>13} {'pair ps/w':>10}  (kquant_bf16_dot_rows off / on; default {default})")
        for m in args.rows:
            x = torch.randn(m, k).to(torch.bfloat16)
            ps = {}
            for on in (False, True, False, True):  # alternating, the best of each
                cpu_kernels.set_kquant_bf16_dot_rows(on)
                ms = best(lambda x=x: cpu_kernels.kquant_linear(x, blocks, t, out), args.runs)
                ps[on] = min(ps.get(on, float("inf")), ms * per)
            print(f"{m:>5} {ps[False]:>13.1f} {ps[True]:>10.1f}")
        cpu_kernels.set_kquant_bf16_dot_rows(default)
        return
    print(f"{'rows':>5} {'kernel ms':>10} {'ps/w':>7} {'tiles ms':>9} {'ps/w':>7} {'unpack ms':>10} {'ps/w':>7}")
    for m in args.rows:
        x = torch.randn(m, k).to(torch.bfloat16)
        kern = best(lambda x=x: cpu_kernels.kquant_linear(x, blocks, t, out), args.runs)
        tile = best(lambda x=x: cpu_kernels.kquant_linear_tiles(x, blocks, t, out), args.runs) if tiles else float("nan")
        unpack = best(lambda x=x: torch.nn.functional.linear(x, cpu_kernels.kquant_dequantize(blocks, t, out, k,
                                                                                              torch.bfloat16)), args.runs)
        print(f"{m:>5} {kern:>10.3f} {kern * per:>7.1f} {tile:>9.3f} {tile * per:>7.1f} {unpack:>10.3f} {unpack * per:>7.1f}")


if __name__ == "__main__":
    main()
