"""Helios's own CPU kernels (``csrc/cpu_kernels.cpp``), compiled on first use and cached on disk.

Operators that torch does not have in the form decode needs, among them:

- ``q8_linear``: a matmul straight from a ggml Q8_0 weight's int8 codes and block scales (exactly the
  checkpoint's float32 values), a quarter of the bytes a float32 copy streams. The default model's
  output projection is its tied Q8_0 embedding: 113 MB in float32, the largest read of a decode step.
  The codes are read from memory once per call whatever the rows: output rows in blocks of 16 KB of
  codes that every tile of activation rows passes over from L1 (AVX-512 register tiles of 4 activation
  x 2 weight rows, each block widened once per tile), not once per tile of 4 rows as before.
- ``gated_delta_step``: Gated DeltaNet's decode update (`helios.models.gated_delta`), in place on
  each token's state slot: two passes over the state instead of torch's gather, four elementwise
  passes and a scatter.
- ``paged_prefill``: a prefill chunk's causal attention over its context read in place (AVX512-BF16
  pair dot products; on AMX tiles where the build has them and Linux grants the tile state:
  ``amx_permitted``, ``set_prefill_amx``; docs/architecture.md has both paths' numerics).
- ``paged_decode``: decode attention that reads each row's K/V in place from the paged cache instead
  of gathering its whole history into a contiguous copy every layer of every step;
  ``paged_decode_int8`` the same over int8 K/V with a bfloat16 scale per row (``[engine] kv_dtype``).
- ``kquant_linear`` / ``kquant_dequantize``: matmul and dequantization straight from a GGUF weight's
  blocks (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, Q8_0; `kquant.BlockQuantized` holds them), 4.5 to 8.5 bits a
  weight where float32 is 32: decode GEMV for one to a few rows, a small GEMM for more: register tiles
  of 5 activation x 2 weight rows on AVX-512 (6 to 8 rows: one tile of them x 1 weight row; 2 x 1 on
  AVX2; 1 to 3 rows: single weight rows, but two for Q4_K and Q6_K), each
  weight sub-block decoded once per tile; weight rows in blocks of 16 read from memory once for all
  the step's tiles (activation rows in groups of up to 768 KB of x, kept in L2; rows of more than 16 KB
  a tile, in column chunks that keep a tile's activations in L1); `kquant.KQuantLinear` hands larger
  steps to a dense copy or to a dequantize-then-GEMM past its crossovers. Output rows are split
  evenly over torch's threads. Measured 2026-12-02 (AMD EPYC, 2 cores, avx2 avx512f avx512bw
  avx512_bf16 avx512_vnni, no AMX; a busy machine, so one thread and its CPU time:
  ``scripts/bench_kernels.py --only kquant --threads 1 --cpu-time``) against the previous kernels (a pass over
  the weight per tile of 4 rows, one weight row a tile), ms at 8 / 32 rows, two alternated runs: the
  down projection's shape (896 x 4864) Q4_K 1.2-1.4 / 4.7-5.2 (was 1.6-1.8 / 6.3-6.8), Q6_K 1.3-1.5 /
  5.2-6.5 (2.6 / 8.0-9.7), Q8_0 1.2-1.4 / 4.2 (2.1-2.4 / 6.6-7.7); gate/up's (4864 x 896) Q5_0 1.7 /
  5.4-6.4 (1.3-1.7 / 5.3-5.7: unchanged, bound by decoding the blocks, not by memory); one row
  unchanged. ``q8_linear`` on the 151936 x 896 head (``--only q8 --threads 1 --cpu-time``): 11-13 /
  30-32 / 112 ms at 1 / 8 / 32 rows (was 12-13 / 48-50 / 182-184). Both threads' figures on that
  machine were too disturbed by other processes to compare. The outputs are bit for bit the previous
  kernels' (the tiling changes no output's operations).

K-quant numerics contract. Weights: every block is read as sub-blocks of 32 weights and each weight
is computed in float32 exactly as ``gguf.quants.dequantize`` computes it (bit for bit, signed zeros
included; the tests compare), per type (d, dmin, m: the block's float16 fields, widened exactly):

- Q8_0 (32 weights, 34 bytes): ``w = d * q``, q int8. Exact (an 11-bit by 8-bit product).
- Q5_0 (32, 22): ``w = d * (q - 16)``, q the 5-bit code (a nibble and one bit of ``qh``). Exact.
- Q5_1 (32, 24): ``w = d * q + m``, q 5-bit. The product is exact; one rounding, the addition's.
- Q4_K (256, 144): 8 sub-blocks j of 32, 6-bit scale sc_j and min m_j (12 packed bytes):
  ``w = (d * sc_j) * q - dmin * m_j``, q 4-bit. All products are exact (at most 21 bits); one rounding,
  the subtraction's (computed as an FMA with ``-(dmin * m_j)``: the same bits, the product being exact).
- Q5_K (256, 176): as Q4_K with q 5-bit (a nibble and one bit of ``qh``). One rounding.
- Q6_K (256, 210): 16 groups j of 16, int8 scale sc_j: ``w = (d * sc_j) * (q - 32)``, q 6-bit.
  Exact (at most 24 bits).

Products and sums (every type alike): y[m, n] = sum over k of x[m, k] * w[n, k], x float32 or
bfloat16 widened exactly (no rounding of activations: not to 8 bits, not at all), float32
accumulation in a fixed order: 32 lanes, each a chain of fused multiply-adds in increasing k over one
position of every 32-weight sub-block, then the lanes summed by a tree (l + 16, + 8, + 4, + 2, + 1).
Lane l takes position l, except in Q4_K (position 4 (l % 8) + l / 8) and Q5_0 (16 (l / 16) + 4 (l % 4)
+ (l % 16) / 4): the orders in which their packed codes come out of 32-bit lanes by shifts, the
activations permuted to match once per call (AVX-512 then looks the codes up in a table of the
sub-block's 16 or 32 values instead of converting each). The order depends on
nothing else: the AVX-512 and AVX2 builds give the same bits, a row gives the same bits alone or in
any batch and on any number of threads. The scalar build (no FMA) rounds each product before adding
it. Error: at most (K / 32 + 6) * 2**-24 times the sum of |x * w| over k. bfloat16 activations give a
bfloat16 result: the float32 sum rounded to nearest even (one more rounding, 2**-8 relative).

Q6_K with bfloat16 activations where the build has AVX512-BF16 (`kquant_bf16_dot_supported`; off with
`set_kquant_bf16_dot`): the codes q - 32 (exact in bfloat16) are multiplied with x in pairs and each
16-weight group's scale a = d * sc_j applied once to the pair sums, y = sum over sub-blocks c and lanes
i of a_c(i) * S[c, i], S[c, i] = x[2i+1] (q - 32)[2i+1] + x[2i] (q - 32)[2i] (positions within the
sub-block), in float32: S rounded once (both products are exact), then 16 lanes, lane i a chain of
fused multiply-adds ``A_i = fma(S[c, i], a_c(i), A_i)`` in increasing c, then the tree (l + 8, + 4, + 2,
+ 1); subnormal inputs and results flushed to zero (``vdpbf16ps``'s rule; the kernel sets DAZ/FTZ for
the rest). One row computes S with ``vdpbf16ps``, more rows too on AMD CPUs (`kquant_bf16_dot_rows`)
and with float32 FMAs elsewhere (the same values: S is rounded once either way), so a row's bits are
the same alone, in any batch and on any number of threads. Error: at most
(K / 32 + 10) * 2**-24 times the sum of |x * w| over k (the tests' bound). ``float_out`` returns the
float32 sums (logits).

Q4_K and Q5_K with bfloat16 activations where rows take ``vdpbf16ps`` (`kquant_bf16_dot_rows`: AMD CPUs
by default): sub-block c's weights are a_c q + b_c (q = 0..15, Q5_K's 0..31; a_c = d sc_c, b_c = -dmin
m_c, exact), its codes multiplied with x in pairs, two sub-blocks (2g, 2g + 1, which share their 32
bytes) a product: lanes 0-7 take sub-block 2g's weights, lanes 8-15 sub-block 2g + 1's, Z_i =
``vdpbf16ps(vdpbf16ps(0, first halves, x), second halves, x)`` (lane i of a lane group h = i mod 8 sums the
products of its sub-block's positions 2h + 1, 2h, then 16 + 2h + 1, 16 + 2h, each addition rounded;
the products are exact), then A_i = fma(Z_i, a(i), A_i) with a(i) the scale of lane i's sub-block, over the
block's four pairs in order, then lanes 0-7 A_i = fma(b_i, X_i, A_i) with the block's mins and its
sub-blocks' sums of x, X_c = the 32 bfloat16 values summed in float32 (the even positions' lanes plus
the odd ones', then a fixed reduction), then the tree. The same bits for a row alone, in any batch and on
any number of threads. Error: at most (K / 32 + K / 256 + 10) * 2**-24 times the sum over k of
(|a q| + |b|) |x| (a q x and b x are summed apart, so the bound is in their magnitudes). Q5_0 there
too: each block's codes q - 16 (exact in bfloat16) in pairs with x, two blocks (b, b + 1) a product as
the K-quants' two sub-blocks (lanes 0-7 block b's, 8-15 block b + 1's, each Z_i over positions 2h + 1, 2h,
16 + 2h + 1, 16 + 2h), A_i = fma(Z_i, d(i), A_i) over the pairs in order, an odd last block alone as Q6_K's
S with its scale, then the tree (the same bound). The activations are reordered once per call to match
(each 64 columns as 0-15, 32-47, 16-31, 48-63).
Elsewhere (Intel, where the Q4_K form gained at one row and lost 10-20% at 2-7) Q4_K, Q5_K and Q5_0
keep the float32 path, as do the other types; builds without AVX512-BF16 keep it for Q6_K too (their
bfloat16 results differ in the last float32 bits from this build's).

Tiles path (``kquant_linear_tiles``, bfloat16 activations only; `kquant.KQuantLinear` uses it for steps
of `kquant.TILE_ROWS` rows where `kquant_tiles_supported`): the weights are rounded to bfloat16 first
(``kquant_dequantize(..., torch.bfloat16)``'s bits, as the dequantize-then-GEMM path rounds them), the
products of two bfloat16 values are exact in float32 and the sums float32; denormal inputs and sums
are flushed to zero, as ``TDPBF16PS`` and ``VDPBF16PS`` do. Two backends (`kquant_tiles_backend`):
``"amx"`` (the tile unit where the build has AMX and Linux grants the tile state; each output a chain
over 32-column chunks of pair sums, with one tile of activation rows the even and odd chunks in two
chains added at the end) and ``"avx512_bf16"`` (AVX512-BF16 without tiles: AMD Zen 4/5, or an Intel
machine that refuses the tile state; each output 16 float32 lanes, lane j the chain over the
32-column chunks of the pair (2 j, 2 j + 1) over the whole row, then the 16 lanes summed by a fixed
tree). Error either way: at most (K + 2) *
2**-24 times the sum of |x * w_bf16|, plus the bfloat16 result's rounding. On ``"avx512_bf16"`` a
row's bits depend on nothing but the row (not the batch, not the threads); on ``"amx"`` also on
whether its 16-row tile is paired with another (the one-tile chains). Either way they differ from the
exact kernel's, so a step's path (by its row count) shows; the two backends differ from each other
by float32 roundings.

The library is built with the machine's C++ compiler (``$CXX`` or ``c++``) against the installed torch,
with ``-O3 -march=native -fopenmp`` (torch's own OpenMP runtime serves it: same soname; the tests
also build it for ``HELIOS_CPU_KERNELS_ARCH=haswell`` and ``x86-64``, the AVX2 and scalar paths), into
``<cache dir>/kernels/<hash>/`` where the hash covers the source, the torch version, the compiler and
the CPU's flags, so a second start only loads it (milliseconds). The build is atomic (a temporary
file renamed into place), so processes racing to build it are safe. Without a compiler, or when the
build fails, `available()` is False, one warning says why, and callers keep their torch paths.
``HELIOS_CPU_KERNELS=0`` (or ``[model] cpu_kernels = false``) turns the kernels off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
import torch
from torch import Tensor

from helios.models.interface import DecodeArgs

log = logging.getLogger("helios.kernels")

ENV = "HELIOS_CPU_KERNELS"
ARCH_ENV = "HELIOS_CPU_KERNELS_ARCH"  # the -march the kernels are built for (default: native)
SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
Q8_GROUP = 32

_lock = threading.Lock()
_state: dict[str, object] = {"loaded": None, "enabled": True, "why": ""}


def set_enabled(enabled: bool) -> None:
    """The configuration's switch (``[model] cpu_kernels``); the environment variable still wins."""
    _state["enabled"] = enabled


def enabled() -> bool:
    env = os.environ.get(ENV, "").strip().lower()
    if env in ("0", "false", "no", "off"):
        return False
    return bool(_state["enabled"])


def available() -> bool:
    """Whether the kernels can be used now (enabled, built and loaded); builds them on first call."""
    if not enabled():
        return False
    loaded = _state["loaded"]
    if loaded is None:
        with _lock:
            if _state["loaded"] is None:
                _state["loaded"] = _load()
            loaded = _state["loaded"]
    return bool(loaded)


def unavailable_reason() -> str:
    return "turned off" if not enabled() else str(_state["why"])


def q8_linear(x: Tensor, codes: Tensor, scales: Tensor) -> Tensor:
    """``x @ W.T`` (float32) for ``W = codes * scales`` per 32-column block; ``codes`` int8 [N, K],
    ``scales`` float32 [N, K / 32]."""
    return torch.ops.helios.q8_linear(x.float().contiguous(), codes, scales)


def pack_q8_bf16(codes: Tensor, scales: Tensor) -> tuple[Tensor, Tensor, int]:
    """A Q8_0 weight's codes (int8 [N, K]) and block scales (float32 [N, K / 32]) in `q8_linear_bf16`'s
    layout: codes as bfloat16 pairs in 16-output tiles [ceil(N/16), K/2, 16, 2] (exact: each code is a
    small integer), scales [ceil(N/16), K/32, 16]; the padding outputs have zero codes and scales."""
    n, k = codes.shape
    tiles = -(-n // 16)
    pad = tiles * 16 - n
    c = torch.nn.functional.pad(codes.to(torch.bfloat16), (0, 0, 0, pad))
    s = torch.nn.functional.pad(scales.to(torch.float32), (0, 0, 0, pad))
    packed = c.view(tiles, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return packed, s.view(tiles, 16, k // 32).permute(0, 2, 1).contiguous(), n


def q8_linear_bf16(x: Tensor, codes: Tensor, scales: Tensor, n: int) -> Tensor:
    """`q8_linear` for bfloat16 ``x`` [M, K] from `pack_q8_bf16`'s tensors: float32 [M, n], the same
    values (exact products of codes and activations, float32 sums, each block's sum scaled once).
    Needs AVX512-BF16 (`bf16_kernels_supported`)."""
    out: Tensor = torch.ops.helios.q8_linear_bf16(x.contiguous(), codes, scales, n)
    return out


# ggml type ids of the block formats `kquant_linear` and `kquant_dequantize` read, and their layouts
# (weights per block, bytes per block), as gguf.GGML_QUANT_SIZES has them.
KQUANT_LAYOUTS: dict[int, tuple[int, int]] = {6: (32, 22), 7: (32, 24), 8: (32, 34), 12: (256, 144), 13: (256, 176),
                                              14: (256, 210)}
KQUANT_NAMES: dict[int, str] = {6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


def kquant_linear(x: Tensor, blocks: Tensor, ggml_type: int, out_features: int, float_out: bool = False) -> Tensor:
    """``x @ W.T`` for ``x`` [M, K] float32 or bfloat16 and ``W`` [out_features, K] held as its GGUF
    blocks of ``ggml_type`` (contiguous uint8, ``out_features * K / per * bytes`` of them, any shape):
    [M, out_features] in ``x``'s dtype (float32 with ``float_out``). Each weight is decoded in registers
    to its exact float32 value (`kquant_dequantize`'s), bfloat16 ``x`` is widened exactly (Q6_K on an
    AVX512-BF16 build, and Q4_K, Q5_K and Q5_0 where `kquant_bf16_dot_rows`: multiplied in pairs with
    the codes), and the products are summed in float32 in a fixed order (the module docstring's
    numerics contract); bfloat16 results are the float32 sums rounded to nearest even."""
    out: Tensor = torch.ops.helios.kquant_linear(x, blocks, ggml_type, out_features, float_out)
    return out


def kquant_linear_grouped(x: Tensor, offsets: Sequence[int], blocks: Sequence[Tensor], ggml_type: int,
                          out_features: int) -> Tensor:
    """`kquant_linear` for groups of rows with a weight each, in one operator: rows ``offsets[g] ..
    offsets[g + 1]`` of ``x`` [R, K] times ``blocks[g]``'s weight (all of ``ggml_type``, [out_features,
    K]) into the same rows of the [R, out_features] result, each output the same bits as
    `kquant_linear` gives for its group alone (the experts a step chose, mixture-of-experts decode)."""
    out: Tensor = torch.ops.helios.kquant_linear_grouped(x, list(offsets), list(blocks), ggml_type, out_features)
    return out


def kquant_linear_tiles(x: Tensor, blocks: Tensor, ggml_type: int, out_features: int, *,
                        float_out: bool = False) -> Tensor:
    """`kquant_linear` on the tiles path for bfloat16 ``x`` [M, K] -> [M, out_features] in bfloat16 (or
    float32 with ``float_out``: an output projection's logits), where `kquant_tiles_supported`: the
    weights as `kquant_dequantize(..., torch.bfloat16)` rounds them (the unpack path's weights, without
    writing the dense copy), exact products, float32 sums in the backend's order, a bfloat16 result
    rounded once (the numerics contract's "Tiles path" paragraph)."""
    out: Tensor = torch.ops.helios.kquant_linear_tiles(x, blocks, ggml_type, out_features, float_out)
    return out


def q8_linear_tiles(x: Tensor, codes: Tensor, scales: Tensor, *, exact: bool = False) -> Tensor:
    """`q8_linear` on the tiles path for bfloat16 ``x`` [M, K] (`q8_linear`'s codes and scales): float32
    [M, N], each weight ``scale * code`` rounded to bfloat16 first (`kquant_linear_tiles`'s contract);
    with ``exact`` (the ``"amx"`` backend only) the weights kept exact: each split into three bfloat16
    terms that add up to it (a float16 scale, as GGUF Q8_0 blocks hold; a float32 scale of more bits:
    within 2^-24 of it), every product exact and the sums float32 in the tile unit's order."""
    out: Tensor = torch.ops.helios.q8_linear_tiles(x, codes, scales, exact)
    return out


def kquant_tiles_supported() -> bool:
    """Whether `kquant_linear_tiles` can run here: the kernels built with AVX512-BF16 (the
    ``"avx512_bf16"`` backend), and with AMX where the tile state is granted (`amx_permitted`)."""
    return available() and bool(torch.ops.helios.kquant_tiles_supported())


_TILES_BACKENDS = {0: "", 1: "avx512_bf16", 2: "amx"}


def kquant_tiles_backend() -> str:
    """The backend `kquant_linear_tiles` runs on now: ``"amx"`` (the tile unit), ``"avx512_bf16"``
    (VDPBF16PS dot products), or ``""`` (neither: not supported here). Asked once, then kept (a
    decode step's logits ask it)."""
    backend = _state.get("tiles_backend")
    if backend is None:
        backend = _state["tiles_backend"] = (_TILES_BACKENDS[int(torch.ops.helios.kquant_tiles_backend())]
                                             if available() else "")
    return str(backend)


def set_kquant_tiles_dp(dp: bool) -> str:
    """Forces the ``"avx512_bf16"`` backend even where AMX tiles are granted (``dp``; tests compare the
    two there), or restores the default choice; returns the backend now."""
    if not available():
        return ""
    backend = _state["tiles_backend"] = _TILES_BACKENDS[int(torch.ops.helios.set_kquant_tiles_dp(dp))]
    return backend


def kquant_tiles_active() -> bool:
    """Whether `kquant.KQuantLinear` hands its bfloat16 steps of `kquant.TILE_ROWS` rows to
    `kquant_linear_tiles`: supported here and not turned off (`set_kquant_tiles`)."""
    active = _state.get("kquant_tiles")
    if active is None:
        active = _state["kquant_tiles"] = kquant_tiles_supported()
    return bool(active)


def set_kquant_tiles(on: bool) -> bool:
    """Turns the k-quant tiles path on (where supported) or off (the exact kernel and the unpack path
    serve every step); returns whether it is now active."""
    _state["kquant_tiles"] = on and kquant_tiles_supported()
    return bool(_state["kquant_tiles"])


def kquant_bf16_dot_supported() -> bool:
    """Whether the kernels were built with AVX512-BF16, where `kquant_linear` multiplies bfloat16 ``x``
    with Q6_K blocks by pair dot products (the module docstring's contract for them)."""
    return available() and bool(torch.ops.helios.kquant_bf16_dot_supported())


def set_kquant_bf16_dot(on: bool) -> bool:
    """Turns the pair dot path on (where built) or off (bfloat16 ``x`` then takes the float32 path, widened
    exactly, as float32 ``x`` does); returns whether it is now on. For measurements and tests."""
    return available() and bool(torch.ops.helios.set_kquant_bf16_dot(on))


def kquant_pair_before_tiles(rows: int, ggml_type: int) -> bool:
    """Whether a bfloat16 step of ``rows`` rows against a weight of ``ggml_type`` takes `kquant_linear`'s
    pair dot path (the exact weights) where the tiles' row counts would take `kquant_linear_tiles`: the
    pair dot path's types up to one tile of 8 rows where `kquant_bf16_dot_rows`, where it leads the
    tiles. The decode plan's projections decide per segment by the same rule."""
    return available() and bool(torch.ops.helios.kquant_pair_before_tiles(rows, ggml_type))


def kquant_bf16_dot_rows() -> bool:
    """Whether the pair dot path computes the pair sums of rows past the first with ``vdpbf16ps`` too
    (else with float32 FMAs: Q6_K's same bits) and takes Q4_K, Q5_K and Q5_0 as well (else they keep the
    float32 path). On by default on AMD CPUs, which issue ``vdpbf16ps`` at an FMA's rate; off on Intel's,
    at half of it."""
    return available() and bool(torch.ops.helios.kquant_bf16_dot_rows())


def set_kquant_bf16_dot_rows(on: bool) -> bool:
    """Sets `kquant_bf16_dot_rows` (where the pair dot path is built); returns it. For measurements and
    tests."""
    return available() and bool(torch.ops.helios.set_kquant_bf16_dot_rows(on))


def moe_kquant_mix(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Sequence[Tensor], gate_up_type: int,
                   down: Sequence[Tensor], down_type: int, max_rows: int | None = None) -> Tensor:
    """`helios.models.moe.expert_mix` with SiLU for experts held as GGUF blocks, in one operator: ``x``
    [T, H] float32 or bfloat16, ``weights`` / ``ids`` [T, top_k] (float32 or ``x``'s dtype / int64),
    ``gate_up[e]`` expert e's [2I, H] blocks of ``gate_up_type`` (gate rows first), ``down[e]`` its
    [H, I] blocks of ``down_type`` -> [T, H] in ``x``'s dtype, the same bits as ``expert_mix`` over
    `kquant.KQuantLinear` experts (every expert product is `kquant_linear_grouped`'s; SiLU and the
    weight multiply are the same torch operators; each token's rows are added in the pairs' order
    sorted stably by expert, as ``index_add_`` adds them). ``max_rows``: an expert given more rows
    raises (its module would dequantize for the call, which this operator does not)."""
    out: Tensor = torch.ops.helios.moe_kquant_mix(x, weights, ids, gate_up, gate_up_type, down, down_type,
                                                  -1 if max_rows is None else max_rows)
    return out


def kquant_dequantize(blocks: Tensor, ggml_type: int, out_features: int, in_features: int,
                      dtype: torch.dtype = torch.float32) -> Tensor:
    """The float32 [out_features, in_features] values of a weight held as GGUF blocks of ``ggml_type``
    (contiguous uint8): ``gguf.quants.dequantize``'s, bit for bit. ``dtype=torch.bfloat16``: those
    values rounded to bfloat16 as ``.to(torch.bfloat16)`` rounds them, written directly (a prefill's
    dequantize-then-GEMM writes and reads half the bytes, and no float32 copy)."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"kquant_dequantize: float32 or bfloat16, not {dtype}")
    out: Tensor = torch.ops.helios.kquant_dequantize(blocks, ggml_type, out_features, in_features,
                                                     dtype == torch.bfloat16)
    return out


def paged_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, rows: Tensor,
                 lens: Tensor, page_size: int, scale: float) -> Tensor:
    """Attention of one query token per row [D, heads, d] over its history in the paged cache
    ([kv_heads, slots, d] each); row i reads block-table row ``rows[i]`` and its first ``lens[i]``
    positions. Query head h uses kv head h // (heads / kv_heads)."""
    return torch.ops.helios.paged_decode(q.contiguous(), k_cache, v_cache, block_table, rows, lens, page_size, scale)


def paged_decode_int8(q: Tensor, k_cache: Tensor, k_scale: Tensor, v_cache: Tensor, v_scale: Tensor,
                      block_table: Tensor, rows: Tensor, lens: Tensor, page_size: int, scale: float) -> Tensor:
    """`paged_decode` over int8 caches: codes [kv_heads, slots, d] with one bfloat16 scale per
    (kv head, slot) row [kv_heads, slots]; each K/V element is read as ``code * scale`` (exact in
    float32) and scores, softmax and sums are float32 as in `paged_decode`. ``q`` float32 or
    bfloat16; the output in its dtype."""
    out: Tensor = torch.ops.helios.paged_decode_int8(q.contiguous(), k_cache, k_scale, v_cache, v_scale, block_table,
                                                     rows, lens, page_size, scale)
    return out


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """``k``, ``v`` ([T, kv_heads, d], any strides between tokens and heads) into the caches
    ([kv_heads, slots, d]) at ``slot_mapping`` [T]: row copies (other dtypes or layouts: index_copy_)."""
    torch.ops.helios.write_kv(k, v, k_cache, v_cache, slot_mapping)


def write_kv_int8(k: Tensor, v: Tensor, k_cache: Tensor, k_scale: Tensor, v_cache: Tensor, v_scale: Tensor,
                  slot_mapping: Tensor) -> None:
    """``k``, ``v`` ([T, kv_heads, d] float32 or bfloat16, the head dimension contiguous) quantized
    into int8 caches ([kv_heads, slots, d]) and their bfloat16 scales ([kv_heads, slots]) at
    ``slot_mapping`` [T]: `helios.engine.attention.quantize_rows`'s codes and scales, bit for bit,
    without its dozen tensor operations per layer."""
    torch.ops.helios.write_kv_int8(k, v, k_cache, k_scale, v_cache, v_scale, slot_mapping)


def write_paged_decode(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                       block_table: Tensor, rows: Tensor, lens: Tensor, page_size: int, k_scale: Tensor | None,
                       v_scale: Tensor | None, scale: float) -> Tensor:
    """`paged_decode` after writing this step's ``k``, ``v`` ([D, kv_heads, d], any strides) into the
    caches at ``slot_mapping`` [D]: a whole all-decode layer's attention in one operator. With
    ``k_scale``/``v_scale`` (int8 caches) the rows are quantized (`write_kv_int8`) and read by
    `paged_decode_int8`."""
    if k_scale is not None and v_scale is not None:
        out: Tensor = torch.ops.helios.write_paged_decode_int8(q, k, v, k_cache, k_scale, v_cache, v_scale,
                                                               slot_mapping, block_table, rows, lens, page_size, scale)
        return out
    out = torch.ops.helios.write_paged_decode(q, k, v, k_cache, v_cache, slot_mapping, block_table, rows, lens,
                                              page_size, scale)
    return out




@attrs.frozen
class FusedLayer:
    """A decoder layer's weights for `decode_layers`: its two RMSNorm weights and its projections,
    int4 ((packed, scales_and_zeros) of qkv, o, gate/up and down, flattened; ``group`` their group size)
    or oneDNN-packed (the four weights as `quant.pack_onednn` packed them; ``group`` 0)."""

    input_norm: Tensor
    post_norm: Tensor
    weights: tuple[Tensor, ...]
    group: int


def decode_layers(h: Tensor, delta: Tensor | None, layers: Sequence[FusedLayer], decode: Sequence[DecodeArgs],
                  cos: Tensor, sin: Tensor, eps: float, heads: int, kv_heads: int) -> tuple[Tensor, Tensor]:
    """Consecutive decoder layers of an all-decode step (`_DecoderLayer.forward` with the fused
    kernels) as one operator: per layer RMSNorm, the qkv projection, RoPE, the K/V write and paged
    attention (``decode[i]`` = layer i's k_cache, v_cache and the step's slot_mapping, block_table,
    rows, lens, page_size; with int8 K/V, their scales), the o projection, the second norm and the
    SwiGLU MLP. The layers share one projection kind (``group``) and one KV kind (float or int8).
    Returns (stream, MLP output) of the last layer, like the layer."""
    group = layers[0].group
    if any(layer.group != group for layer in layers) or len(decode) != len(layers):
        raise ValueError("decode_layers: one projection kind and one set of decode arguments per layer")
    _, _, slot_mapping, table, rows, lens, page_size, _, _ = decode[0]
    k_scales = [d[7] for d in decode if d[7] is not None]
    v_scales = [d[8] for d in decode if d[8] is not None]
    if len(k_scales) not in (0, len(decode)) or len(v_scales) != len(k_scales):
        raise ValueError("decode_layers: every layer's K/V int8 (with scales) or none")
    out: tuple[Tensor, Tensor] = torch.ops.helios.decode_layers(
        h, delta, [layer.input_norm for layer in layers], [layer.post_norm for layer in layers],
        [w for layer in layers for w in layer.weights], group, cos, sin, [d[0] for d in decode],
        [d[1] for d in decode], k_scales, v_scales, slot_mapping, table, rows, lens, page_size,
        decode[0][0].shape[-1] ** -0.5, eps, heads, kv_heads)
    return out


Segments = Sequence[tuple[Tensor, int, int]]
"""A k-quant projection as `KqDecodePlan` takes it: its row segments as (GGUF blocks, type, rows)."""


class KqDecodePlan:
    """The layers of a k-quant decoder for an all-decode step in one call (``csrc``'s ``KqDecodePlan``,
    a torch custom class holding the layers' weights, so a step passes no per-expert lists): per layer
    `add_rms_norm`, the q/k/v projection (`kquant_linear` per segment, `kquant_linear_tiles` with
    ``tiles``), the optional bias, `qk_norm_rope_` (or `rope_`), `write_paged_decode`, the o
    projection, the second norm, then the SwiGLU MLP (gate/up, `silu_mul`, down) or the router, softmax
    top-k routing and `moe_kquant_mix`: the operators the layers' fused paths call
    (`llama._DecoderLayer`, `moe_decoder.MoELayer`), in their order, so the same bits. ``max_rows``:
    the most rows a step may give it (set by the builder: `llama.build_decode_plan`,
    `moe_decoder.build_decode_plan`)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, eps: float, *, top_k: int = 0,
                 norm_topk: bool = False, router_fp32: bool = False) -> None:
        self._plan = torch.classes.helios.KqDecodePlan(heads, kv_heads, head_dim, eps, top_k, norm_topk, router_fp32)
        self.max_rows = 0

    def add_layer(self, input_norm: Tensor, post_norm: Tensor, qkv_bias: Tensor | None, qk_norm: Tensor | None,
                  qkv: Segments, o: Segments, *, mlp: tuple[Segments, Segments] | None = None,
                  experts: tuple[Sequence[Tensor], int, Sequence[Tensor], int, int | None] | None = None) -> None:
        """One more layer: its norm weights (``qk_norm`` per head: float32 [heads + kv_heads, head_dim]),
        q/k/v bias, the q/k/v and o projections, and either ``mlp`` (its gate/up and down projections)
        or ``experts`` (every expert's [2I, H] gate/up blocks and their type, its [H, I] down blocks
        and their type, the most rows an expert may get or None: `kquant.BlockExperts`)."""
        if (mlp is None) == (experts is None):
            raise ValueError("KqDecodePlan.add_layer: an MLP or routed experts")
        gate_up, down = mlp if mlp is not None else ((), ())
        segments = [*qkv, *o, *gate_up, *down]
        gu, gu_type, dn, dn_type, max_rows = experts if experts is not None else ((), 0, (), 0, None)
        self._plan.add_layer(input_norm, post_norm, qkv_bias, qk_norm, [b for b, _, _ in segments],
                             [t for _, t, _ in segments], [n for _, _, n in segments],
                             [len(qkv), len(o), len(gate_up), len(down)], list(gu), list(dn), gu_type, dn_type,
                             -1 if max_rows is None else max_rows)

    def run(self, h: Tensor, cos: Tensor, sin: Tensor, routers: Sequence[Tensor], decode: Sequence[DecodeArgs],
            scale: float, tiles: bool) -> tuple[Tensor, Tensor]:
        """Every layer on the embeddings ``h``: the last layer's (stream, feed-forward output).
        ``routers[i]``: layer i's router weight as its rows multiply it (any tensor in an MLP layer);
        ``decode[i]``: its `write_paged_decode` arguments; ``tiles``: the projections on the tiles path."""
        _, _, slot_mapping, table, rows, lens, page_size, _, _ = decode[0]
        k_scales = [d[7] for d in decode if d[7] is not None]
        v_scales = [d[8] for d in decode if d[8] is not None]
        stream, delta = self._plan.run(h, cos, sin, list(routers), [d[0] for d in decode], [d[1] for d in decode],
                                       k_scales, v_scales, slot_mapping, table, rows, lens, page_size, scale, tiles)
        return stream, delta


def add_rms_norm(h: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(s, rms_norm(s) * weight)`` for ``s = h + delta`` (``s = h`` without delta); ``h`` [N, D]
    contiguous float32 or bfloat16, ``weight`` float32 [D]. Math in float32; ``s`` is rounded to the
    dtype before it is normalized, as the separate torch ops round it."""
    out: tuple[Tensor, Tensor] = torch.ops.helios.add_rms_norm(h, delta, weight, eps)
    return out


def rope_(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE in place on ``x`` [T, heads, d] (last dim contiguous) with ``cos`` and the
    sign-folded ``sin`` tables of T x d values: ``x * cos + roll(x, d/2) * sin``."""
    out: Tensor = torch.ops.helios.rope_(x, cos, sin)
    return out


def qk_norm_rope_(x: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor) -> Tensor:
    """The per-head q/k RMSNorm then `rope_`, in place on ``x`` [T, heads, d] (last dim contiguous):
    each head row normalized with its row of ``weight`` (float32 [heads, d]), rounded to x's dtype as
    `add_rms_norm`'s result is, then rotated."""
    out: Tensor = torch.ops.helios.qk_norm_rope_(x, weight, eps, cos, sin)
    return out


def silu_mul(gate_up: Tensor) -> Tensor:
    """``silu(g) * u`` for ``gate_up = [g | u]`` ([N, 2I] contiguous) -> [N, I]."""
    out: Tensor = torch.ops.helios.silu_mul(gate_up)
    return out


def paged_prefill(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, ctx_start: int,
                  scale: float) -> Tensor:
    """bfloat16 causal attention of a prefill chunk ``q`` [L, heads, d] (positions ``ctx_start`` ..
    ``ctx_start + L - 1``) over its context, read in place from the cache ([kv_heads, slots, d]
    each): position p's K/V are at ``slots[p]``. Query head h uses kv head h // (heads / kv_heads)."""
    out: Tensor = torch.ops.helios.paged_prefill(q.contiguous(), k_cache, v_cache, slots, ctx_start, scale)
    return out


def gated_delta_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, slots: Tensor,
                     fresh: Tensor) -> Tensor:
    """One gated delta rule update per token and head, in place on ``state`` [slots, H, dk, dv] at
    each token's slot (``fresh``: uint8, 1 where the slot starts from zeros): q, k [N, H, dk]
    (normalised, q scaled), v [N, H, dv], g, beta [N, H], float32. Returns the output [N, H, dv]
    (`helios.models.gated_delta.recurrent_step`'s, summed in another order)."""
    out: Tensor = torch.ops.helios.gated_delta_step(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
                                                    beta.contiguous(), state, slots, fresh)
    return out


def amx_permitted() -> bool:
    """Whether the kernels were built with AMX (AMX-TILE and AMX-BF16 in the -march) and this process may
    use the tiles (Linux granted the tile data state: some virtual machines advertise AMX and refuse it)."""
    return bool(torch.ops.helios.amx_permitted())


def set_prefill_amx(on: bool) -> bool:
    """`paged_prefill` on AMX tiles (on, the default) or on the AVX512-BF16 path (off); returns whether
    it now runs on tiles (only where `amx_permitted`). Both paths keep the kernel's contract."""
    return bool(torch.ops.helios.set_prefill_amx(on))


def bf16_kernels_supported() -> bool:
    """Whether the bfloat16 pair-dot-product kernels were built (AVX512-BF16): `paged_prefill` (without
    it torch's SDPA is the faster prefill attention) and `q8_linear_bf16`."""
    return bool(torch.ops.helios.bf16_kernels_supported())


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "helios" / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _load() -> bool:
    if not SOURCE.is_file():
        return _fail(f"{SOURCE.name} is not installed")
    cxx = _compiler()
    if cxx is None:
        return _fail("no C++ compiler (set CXX or install g++)")
    from torch.utils import cpp_extension

    source = SOURCE.read_bytes()
    arch = os.environ.get(ARCH_ENV) or "native"
    key = hashlib.sha256(b"\0".join([source, torch.__version__.encode(), cxx.encode(), _cpu_flags().encode(),
                                     sys.version.encode(), arch.encode()])).hexdigest()[:20]
    target = cache_dir() / key / "helios_cpu_kernels.so"
    if not target.is_file():
        started = time.perf_counter()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            _build(cxx, cpp_extension, target, arch)
        except (OSError, subprocess.SubprocessError) as exc:
            return _fail(f"the build failed: {exc}")
        log.info("built the CPU kernels in %.1f s: %s", time.perf_counter() - started, target)
    try:
        torch.ops.load_library(str(target))
    except (OSError, RuntimeError) as exc:
        return _fail(f"loading {target} failed: {exc}")
    return True


def _build(cxx: str, cpp_extension: object, target: Path, arch: str) -> None:
    includes = cpp_extension.include_paths()  # type: ignore[attr-defined]
    libdir = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cxx, "-O3", f"-march={arch}", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-w",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-I{p}" for p in includes), str(SOURCE), "-o", tmp,
           f"-L{libdir}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{libdir}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise subprocess.SubprocessError(done.stderr.strip()[-2000:] or f"exit {done.returncode}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _fail(why: str) -> bool:
    _state["why"] = why
    log.warning("CPU kernels unavailable (%s); using the torch paths", why)
    return False
