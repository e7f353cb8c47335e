"""GGUF block weights (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, Q8_0) used in their file form: Helios's
dequantization against ``gguf.quants.dequantize`` (bit for bit), ``kquant_linear`` against float64
matmuls of the dequantized weights, `KQuantLinear`'s paths, and the AVX2 and scalar builds.

Tolerance of ``kquant_linear`` (float32 accumulation, the order in the `cpu_kernels` docstring): each
output's 32 lanes take K / 32 fused multiply-adds each, then 5 tree additions, so every product goes
through at most K / 32 + 5 roundings (one more, the product's, in the scalar build without FMA). With
u = 2**-24 the error is below (K / 32 + 6) u times the sum of |x w| (the standard bound for recursive
summation, n u / (1 - n u), is within 1% of n u here). bfloat16 results add one rounding: 2**-8 of |y|.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helios.models import cpu_kernels
from helios.models.dense import dense_matmul
from helios.models.kquant import BlockQuantized, KQuantLinear, concat_rows
from helios.models.quant import DenseLinear, WeightFormat, build_linear, dense_of, pack_onednn

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason=f"Helios's CPU kernels are not built here: {cpu_kernels.unavailable_reason()}")

TYPES = sorted(cpu_kernels.KQUANT_LAYOUTS)
NAMES = [cpu_kernels.KQUANT_NAMES[t] for t in TYPES]
# byte offsets of each type's float16 fields within a block (d, and dmin / m where the type has one)
FP16_FIELDS = {6: (0,), 7: (0, 2), 8: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}
U = 2.0**-24


def random_blocks(ggml_type: int, rows: int, cols: int, seed: int, *, full_range: bool = False) -> np.ndarray:
    """uint8 [rows, row bytes] of valid blocks: random codes and sub-block scales (every byte pattern
    is valid there), finite float16 scales: anything finite (subnormals, zeros of both signs, 65504)
    with ``full_range``, else about N(0, 0.01)."""
    per, nbytes = cpu_kernels.KQUANT_LAYOUTS[ggml_type]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // per, nbytes), dtype=np.uint8)
    for off in FP16_FIELDS[ggml_type]:
        if full_range:
            bits = rng.integers(0, 1 << 16, size=blocks.shape[0], dtype=np.uint16)
            bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits).astype(np.uint16)  # no inf / nan
            half = bits.view(np.float16)
        else:
            half = (rng.standard_normal(blocks.shape[0]) * 0.01).astype(np.float16)
        blocks[:, off:off + 2] = half.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def gguf_dequantize(blocks: np.ndarray, ggml_type: int) -> np.ndarray:
    out = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(ggml_type))
    return np.ascontiguousarray(out, dtype=np.float32)


def bits(t: torch.Tensor | np.ndarray) -> np.ndarray:
    a = t.numpy() if isinstance(t, torch.Tensor) else t
    return a.view(np.uint32)


def error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(K / 32 + 6) u times the sum of |x w| per output (module docstring)."""
    k = x.shape[1]
    return (k / 32 + 6) * U * (x.double().abs() @ w.double().abs().t())


# -- dequantization --------------------------------------------------------------------------------------


@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES)
@pytest.mark.parametrize(("rows", "cols"), [(5, 512), (33, 256), (1, 1024)])
def test_dequantize_equals_gguf_bit_for_bit(ggml_type: int, rows: int, cols: int) -> None:
    blocks = random_blocks(ggml_type, rows, cols, seed=ggml_type * 100 + rows, full_range=True)
    want = gguf_dequantize(blocks, ggml_type)
    got = cpu_kernels.kquant_dequantize(torch.from_numpy(blocks), ggml_type, rows, cols)
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert np.array_equal(bits(got), bits(want))  # signed zeros included


@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES)
def test_dequantize_to_bfloat16_is_the_float32_values_rounded_bit_for_bit(ggml_type: int) -> None:
    """The bfloat16 output (a prefill's dequantize-then-GEMM) is ``.to(torch.bfloat16)`` of the exact
    float32 values: rounded to nearest even, ties included (values halfway between two bfloat16
    numbers are planted below)."""
    rows, cols = 17, 512
    blocks = torch.from_numpy(random_blocks(ggml_type, rows, cols, seed=ggml_type * 7 + 1, full_range=True))
    exact = cpu_kernels.kquant_dequantize(blocks, ggml_type, rows, cols)
    got = cpu_kernels.kquant_dequantize(blocks, ggml_type, rows, cols, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, cols)
    assert torch.equal(got.view(torch.int16), exact.to(torch.bfloat16).view(torch.int16))
    low16 = exact.view(torch.int32) & 0xFFFF
    assert bool((low16 == 0x8000).any()) or ggml_type in (6, 8, 14)  # ties occur where an offset is added
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_kernels.kquant_dequantize(blocks, ggml_type, rows, cols, torch.float16)


@pytest.mark.parametrize("ggml_type", [6, 7, 8], ids=["Q5_0", "Q5_1", "Q8_0"])
def test_dequantize_equals_gguf_on_quantized_weights(ggml_type: int) -> None:
    """Blocks as gguf.quants.quantize writes them (the types it can quantize), from weights with outliers."""
    rng = np.random.default_rng(ggml_type)
    weight = (rng.standard_normal((9, 256)) * rng.choice([0.01, 1.0, 30.0], size=(9, 1))).astype(np.float32)
    blocks = gguf.quants.quantize(weight, gguf.GGMLQuantizationType(ggml_type))
    got = cpu_kernels.kquant_dequantize(torch.from_numpy(blocks), ggml_type, 9, 256)
    assert np.array_equal(bits(got), bits(gguf_dequantize(blocks, ggml_type)))


def test_dequantize_rejects_bad_operands() -> None:
    blocks = torch.from_numpy(random_blocks(12, 2, 256, seed=0))
    with pytest.raises(RuntimeError, match="not one of"):
        cpu_kernels.kquant_dequantize(blocks, 2, 2, 256)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        cpu_kernels.kquant_dequantize(blocks, 12, 2, 128)
    with pytest.raises(RuntimeError, match="bytes of blocks"):
        cpu_kernels.kquant_dequantize(blocks, 12, 3, 256)
    with pytest.raises(RuntimeError, match="uint8"):
        cpu_kernels.kquant_dequantize(blocks.to(torch.int16), 12, 2, 256)


# -- kquant_linear ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES)
@pytest.mark.parametrize("m", [1, 3, 8, 33])
@pytest.mark.parametrize(("out", "k"), [(37, 512), (33, 768)])
def test_kquant_linear_against_float64(ggml_type: int, m: int, out: int, k: int) -> None:
    blocks = random_blocks(ggml_type, out, k, seed=ggml_type + m + out)
    w = torch.from_numpy(gguf_dequantize(blocks, ggml_type))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k))
    got = cpu_kernels.kquant_linear(x, torch.from_numpy(blocks), ggml_type, out)
    assert got.dtype == torch.float32 and got.shape == (m, out)
    err = (got.double() - x.double() @ w.double().t()).abs()
    assert (err <= error_bound(x, w)).all()


@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES)
@pytest.mark.parametrize("m", [1, 3, 8, 33])
def test_kquant_linear_bfloat16_activations(ggml_type: int, m: int) -> None:
    """bfloat16 x is widened exactly: the float32 result rounded to nearest even, within one bf16
    rounding of the float64 reference."""
    out, k = 41, 512
    blocks = torch.from_numpy(random_blocks(ggml_type, out, k, seed=7 * ggml_type + m))
    w = torch.from_numpy(gguf_dequantize(blocks.numpy(), ggml_type))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    got = cpu_kernels.kquant_linear(x, blocks, ggml_type, out)
    assert got.dtype == torch.bfloat16 and got.shape == (m, out)
    want = x.double() @ w.double().t()
    if pair_dot(ggml_type):  # the pair dot path's float32 sums, rounded once
        sums = cpu_kernels.kquant_linear(x, blocks, ggml_type, out, float_out=True)
        assert sums.dtype == torch.float32 and torch.equal(got, sums.to(torch.bfloat16))
        bound = pair_dot_bound(x, blocks.numpy(), ggml_type)
    else:
        assert torch.equal(got, cpu_kernels.kquant_linear(x.float(), blocks, ggml_type, out).to(torch.bfloat16))
        bound = error_bound(x, w)
    assert ((got.double() - want).abs() <= bound * (1 + 2.0**-8) + 2.0**-8 * want.abs()).all()


def pair_dot(ggml_type: int) -> bool:
    """Whether bfloat16 x against this type takes the pair dot path here (Q6_K; Q4_K, Q5_K and Q5_0 too where
    rows take ``vdpbf16ps``, `cpu_kernels.kquant_bf16_dot_rows`)."""
    return cpu_kernels.kquant_bf16_dot_supported() and (
        ggml_type == 14 or (ggml_type in (6, 12, 13) and cpu_kernels.kquant_bf16_dot_rows()))


def pair_dot_bound(x: torch.Tensor, blocks: np.ndarray, ggml_type: int) -> torch.Tensor:
    """The pair dot path's float32 error (module docstring): (K / 32 + K / 256 + 10) u times the sum over
    k of (|a q| + |b|) |x| per output: the 16 lanes' chains of K / 32 FMAs (Q4_K, Q5_K, Q5_0: K / 64, with
    three roundings in each pair of sub-blocks' sums; Q4_K, Q5_K: and the K / 256
    of their mins, whose products b X_c are summed apart from a q, so the bound is in their magnitudes, not in
    |w| = |a q + b|), the pair sum's rounding, a sub-block sum X_c's five and the tree's."""
    if ggml_type in (12, 13):  # Q4_K, Q5_K: a q alone (dmin zeroed) and b alone (d zeroed)
        nbytes = cpu_kernels.KQUANT_LAYOUTS[ggml_type][1]
        scaled = blocks.reshape(blocks.shape[0], -1, nbytes).copy()
        mins = scaled.copy()
        scaled[..., 2:4], mins[..., 0:2] = 0, 0
        mag = (torch.from_numpy(gguf_dequantize(scaled.reshape(blocks.shape), ggml_type)).double().abs()
               + torch.from_numpy(gguf_dequantize(mins.reshape(blocks.shape), ggml_type)).double().abs())
    else:
        mag = torch.from_numpy(gguf_dequantize(blocks, ggml_type)).double().abs()
    k = x.shape[1]
    return (k / 32 + k / 256 + 10) * U * (x.double().abs() @ mag.t())


PAIR_DOT_TYPES = (6, 12, 13, 14)  # Q5_0, Q4_K, Q5_K (where rows take vdpbf16ps), Q6_K; the others keep float32


@pytest.mark.skipif(not cpu_kernels.kquant_bf16_dot_supported(), reason="built without AVX512-BF16")
@pytest.mark.parametrize("ggml_type", PAIR_DOT_TYPES, ids=[cpu_kernels.KQUANT_NAMES[t] for t in PAIR_DOT_TYPES])
@pytest.mark.parametrize("full_range", [False, True], ids=["scales_normal", "scales_full_range"])
def test_the_pair_dot_path_is_within_its_bound_and_the_same_bits_at_any_rows(ggml_type: int,
                                                                            full_range: bool) -> None:
    """bfloat16 x by pair dot products (every row by vdpbf16ps, `kquant_bf16_dot_rows` forced on): float32
    sums within `pair_dot_bound` of float64, each row the same bits alone, in any batch of 1-11 rows, on
    one thread and in a grouped call. Rows past the first on float32 lanes: Q6_K's same bits, the other
    types' the float32 path's; the pair dot path turned off, the float32 path's bits."""
    out, k = 67, 2304  # nine Q4_K / Q6_K blocks a row
    blocks = random_blocks(ggml_type, out, k, seed=ggml_type, full_range=full_range)
    bt = torch.from_numpy(blocks)
    w = torch.from_numpy(gguf_dequantize(blocks, ggml_type)).double()
    x = torch.randn(12, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    rows, threads = cpu_kernels.kquant_bf16_dot_rows(), torch.get_num_threads()
    try:
        cpu_kernels.set_kquant_bf16_dot_rows(True)  # Q4_K, Q5_K, Q5_0 take the pair dot path only so (Q6_K always)
        batch = cpu_kernels.kquant_linear(x, bt, ggml_type, out, float_out=True)
        assert ((batch.double() - x.double() @ w.t()).abs() <= pair_dot_bound(x, blocks, ggml_type)).all()
        assert not torch.equal(batch, cpu_kernels.kquant_linear(x.float(), bt, ggml_type, out))  # not the float32 path
        for i in range(12):
            assert torch.equal(cpu_kernels.kquant_linear(x[i:i + 1], bt, ggml_type, out, float_out=True),
                               batch[i:i + 1])
        for m in range(2, 12):
            assert torch.equal(cpu_kernels.kquant_linear(x[:m], bt, ggml_type, out, float_out=True), batch[:m]), m
        grouped = cpu_kernels.kquant_linear_grouped(x, [0, 1, 1, 6, 12], [bt] * 4, ggml_type, out)
        assert torch.equal(grouped, batch.to(torch.bfloat16))
        torch.set_num_threads(1)
        assert torch.equal(cpu_kernels.kquant_linear(x, bt, ggml_type, out, float_out=True), batch)
        # rows past the first on float32 lanes: Q6_K the same bits; the others leave the pair dot path
        cpu_kernels.set_kquant_bf16_dot_rows(False)
        lanes = cpu_kernels.kquant_linear(x, bt, ggml_type, out, float_out=True)
        float_path = cpu_kernels.kquant_linear(x.float(), bt, ggml_type, out)
        assert torch.equal(lanes, batch if ggml_type == 14 else float_path)
        for m in (2, 5, 6, 9):
            assert torch.equal(cpu_kernels.kquant_linear(x[:m], bt, ggml_type, out, float_out=True), lanes[:m]), m
        cpu_kernels.set_kquant_bf16_dot_rows(True)
        assert cpu_kernels.set_kquant_bf16_dot(False) is False
        assert torch.equal(cpu_kernels.kquant_linear(x, bt, ggml_type, out, float_out=True), float_path)
    finally:
        cpu_kernels.set_kquant_bf16_dot(True)
        cpu_kernels.set_kquant_bf16_dot_rows(rows)
        torch.set_num_threads(threads)

@pytest.mark.skipif(not cpu_kernels.kquant_bf16_dot_supported(), reason="built without AVX512-BF16")
@pytest.mark.parametrize("k", [32, 96, 160, 2240])
def test_the_pair_dot_path_takes_q5_0_blocks_in_pairs_and_an_odd_last_one_alone(k: int) -> None:
    """Q5_0 by pair dot products takes two blocks a product (x's columns reordered per 64) and an odd last
    block by itself, its columns as they are: within the bound at 1, 5 and 7 rows, each row the same bits
    alone, for odd and even block counts."""
    out = 37
    blocks = random_blocks(6, out, k, seed=k)
    bt = torch.from_numpy(blocks)
    w = torch.from_numpy(gguf_dequantize(blocks, 6)).double()
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    rows = cpu_kernels.kquant_bf16_dot_rows()
    try:
        cpu_kernels.set_kquant_bf16_dot_rows(True)
        batch = cpu_kernels.kquant_linear(x, bt, 6, out, float_out=True)
        assert ((batch.double() - x.double() @ w.t()).abs() <= pair_dot_bound(x, blocks, 6)).all()
        for m in (1, 5):
            assert torch.equal(cpu_kernels.kquant_linear(x[:m], bt, 6, out, float_out=True), batch[:m]), m
        assert torch.equal(cpu_kernels.kquant_linear(x[6:], bt, 6, out, float_out=True), batch[6:])
    finally:
        cpu_kernels.set_kquant_bf16_dot_rows(rows)



@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES)
def test_kquant_linear_rows_do_not_depend_on_the_batch_or_threads(ggml_type: int) -> None:
    """The summation order is per output: a row's result is the same bits alone, in any batch, on
    any number of threads."""
    out, k = 67, 512
    blocks = torch.from_numpy(random_blocks(ggml_type, out, k, seed=ggml_type))
    x = torch.randn(33, k, generator=torch.Generator().manual_seed(3))
    batch = cpu_kernels.kquant_linear(x, blocks, ggml_type, out)
    for i in (0, 5, 32):
        assert torch.equal(cpu_kernels.kquant_linear(x[i:i + 1], blocks, ggml_type, out), batch[i:i + 1])
    for m in range(2, 12):  # every tile shape: one tile of 2-5 rows, one wide tile of 6-8, tiles and a tail
        assert torch.equal(cpu_kernels.kquant_linear(x[:m], blocks, ggml_type, out), batch[:m]), m
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_kernels.kquant_linear(x, blocks, ggml_type, out), batch)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES)
def test_kquant_linear_long_rows_against_float64(ggml_type: int) -> None:
    """Rows long enough (16,640 columns) that a tile of rows takes the columns in chunks, parking its
    lane sums between them: within the bound, and the same bits as each row alone (whole rows)."""
    out, k = 7, 16640
    blocks = torch.from_numpy(random_blocks(ggml_type, out, k, seed=ggml_type))
    w = torch.from_numpy(gguf_dequantize(blocks.numpy(), ggml_type))
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(5))
    got = cpu_kernels.kquant_linear(x, blocks, ggml_type, out)
    assert ((got.double() - x.double() @ w.double().t()).abs() <= error_bound(x, w)).all()
    for i in range(5):
        assert torch.equal(cpu_kernels.kquant_linear(x[i:i + 1], blocks, ggml_type, out), got[i:i + 1])


def test_kquant_linear_rejects_bad_operands() -> None:
    blocks = torch.from_numpy(random_blocks(14, 4, 256, seed=0))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_kernels.kquant_linear(torch.randn(2, 256).double(), blocks, 14, 4)
    with pytest.raises(RuntimeError, match="bytes of blocks"):
        cpu_kernels.kquant_linear(torch.randn(2, 256), blocks, 14, 5)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        cpu_kernels.kquant_linear(torch.randn(2, 128), blocks, 14, 4)
    assert cpu_kernels.kquant_linear(torch.randn(0, 256), blocks, 14, 4).shape == (0, 4)


@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kquant_linear_grouped_is_each_group_alone(ggml_type: int, dtype: torch.dtype) -> None:
    """Groups of rows against their own weights in one call: the same bits as `kquant_linear` on each
    group (empty groups, one row, and more rows than a tile), on any number of threads."""
    out, k = 45, 512
    weights = [torch.from_numpy(random_blocks(ggml_type, out, k, seed=10 * ggml_type + g)) for g in range(5)]
    sizes = [1, 0, 13, 3, 1]
    offsets = np.cumsum([0, *sizes]).tolist()
    x = torch.randn(sum(sizes), k, generator=torch.Generator().manual_seed(7)).to(dtype)
    got = cpu_kernels.kquant_linear_grouped(x, offsets, weights, ggml_type, out)
    assert got.dtype == dtype and got.shape == (sum(sizes), out)
    want = torch.cat([cpu_kernels.kquant_linear(x[a:b], w, ggml_type, out)
                      for a, b, w in zip(offsets, offsets[1:], weights, strict=False)])
    assert torch.equal(got, want)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_kernels.kquant_linear_grouped(x, offsets, weights, ggml_type, out), got)
    finally:
        torch.set_num_threads(threads)


def test_kquant_linear_grouped_rejects_bad_operands() -> None:
    w = [torch.from_numpy(random_blocks(14, 4, 256, seed=g)) for g in range(2)]
    x = torch.randn(3, 256)
    with pytest.raises(RuntimeError, match="one more offset"):
        cpu_kernels.kquant_linear_grouped(x, [0, 3], w, 14, 4)
    with pytest.raises(RuntimeError, match="from 0 to the rows"):
        cpu_kernels.kquant_linear_grouped(x, [0, 1, 2], w, 14, 4)
    with pytest.raises(RuntimeError, match="do not decrease"):
        cpu_kernels.kquant_linear_grouped(x, [0, 4, 3], w, 14, 4)
    with pytest.raises(RuntimeError, match="bytes of blocks"):
        cpu_kernels.kquant_linear_grouped(x, [0, 1, 3], w, 14, 5)


# -- the fused mixture-of-experts operator -----------------------------------------------------------------

MIX_EXPERTS, MIX_TOP_K, MIX_HIDDEN, MIX_INTER = 8, 3, 512, 256


def _mix_experts(gu_type: int, down_type: int, unpack_above: int | None = None) -> tuple[list[KQuantLinear],
                                                                                          list[KQuantLinear]]:
    """Random GGUF-block experts as the loader builds them: gate and up joined into one segment, off
    the AMX tiles (as `MoELayer.routed_experts` sets them)."""
    def part(t: int, rows: int, cols: int, seed: int) -> BlockQuantized:
        return BlockQuantized(torch.from_numpy(random_blocks(t, rows, cols, seed=seed)), t, (rows, cols))

    gate_up = [KQuantLinear([part(gu_type, MIX_INTER, MIX_HIDDEN, 3 * e), part(gu_type, MIX_INTER, MIX_HIDDEN, 3 * e + 1)],
                            unpack_above=unpack_above) for e in range(MIX_EXPERTS)]
    down = [KQuantLinear([part(down_type, MIX_HIDDEN, MIX_INTER, 3 * e + 2)], unpack_above=unpack_above)
            for e in range(MIX_EXPERTS)]
    for module in (*gate_up, *down):
        module.tiles = False
    return gate_up, down


def _mix_routing(tokens: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [tokens, hidden], weights, ids [tokens, top_k]: expert 0 chosen by every token, expert 7 by none."""
    g = torch.Generator().manual_seed(seed)
    x = (4 * torch.randn(tokens, MIX_HIDDEN, generator=g)).to(dtype)
    scores = torch.randn(tokens, MIX_EXPERTS, generator=g)
    scores[:, 0] += 100
    scores[:, 7] -= 100
    top, ids = torch.topk(torch.softmax(scores, dim=-1), MIX_TOP_K, dim=-1, sorted=False)
    return x, top, ids


@pytest.mark.parametrize(("gu_type", "down_type"), [(12, 14), (6, 8), (13, 7)], ids=["Q4_K-Q6_K", "Q5_0-Q8_0",
                                                                                   "Q5_K-Q5_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weights_fp32", [False, True], ids=["weights_in_dtype", "weights_fp32"])
def test_moe_kquant_mix_equals_expert_mix_bit_for_bit(gu_type: int, down_type: int, dtype: torch.dtype,
                                                      weights_fp32: bool) -> None:
    """The fused operator (grouping, gate/up, SiLU, down, weighted sum) against `moe.expert_mix`'s
    steps over the same `KQuantLinear` experts: the same bits at 1, 3, 8 and 33 tokens (an expert
    chosen by every token, one by none), on one thread too; and within the float32 summation bound
    of a float64 mix of the dequantized weights."""
    from helios.models.kquant import BlockExperts
    from helios.models.moe import expert_mix

    gate_up, down = _mix_experts(gu_type, down_type)
    blocks = BlockExperts.of(gate_up, down)
    assert blocks is not None and blocks.max_rows is None
    dense_gu = [m.dequantize().double() for m in gate_up]
    dense_down = [m.dequantize().double() for m in down]
    for tokens in (1, 3, 8, 33):
        x, top, ids = _mix_routing(tokens, dtype, seed=tokens)
        weights = top if weights_fp32 else top.to(dtype)
        got = blocks.mix(x, weights, ids)
        assert got is not None and got.dtype == dtype and got.shape == x.shape
        want = expert_mix(x, weights, ids, gate_up, down)  # the per-step path (no blocks)
        assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), tokens
        assert torch.equal(expert_mix(x, weights, ids, gate_up, down, blocks=blocks), got)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(blocks.mix(x, weights, ids), got)
        finally:
            torch.set_num_threads(threads)
        if dtype == torch.float32:  # independent: float64 of the same exact weights
            ref = torch.zeros(tokens, MIX_HIDDEN, dtype=torch.float64)
            for t in range(tokens):
                for slot in range(MIX_TOP_K):
                    e = int(ids[t, slot])
                    gu = dense_gu[e] @ x[t].double()
                    ref[t] += float(weights[t, slot]) * (dense_down[e] @ (F.silu(gu[:MIX_INTER]) * gu[MIX_INTER:]))
            assert (got.double() - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_moe_kquant_mix_applies_only_where_the_modules_would_take_the_kernel() -> None:
    """No fused mix for more tokens than ``unpack_above`` (an expert may then be dequantized for the
    call), for modules of more than one segment or of other types; an expert given more rows than
    ``max_rows`` raises."""
    from helios.models.kquant import BlockExperts
    from helios.models.moe import expert_mix

    gate_up, down = _mix_experts(12, 14, unpack_above=4)
    blocks = BlockExperts.of(gate_up, down)
    assert blocks is not None and blocks.max_rows == 4
    x, top, ids = _mix_routing(5, torch.float32, seed=1)
    assert blocks.mix(x, top, ids) is None
    assert torch.equal(expert_mix(x, top, ids, gate_up, down, blocks=blocks), expert_mix(x, top, ids, gate_up, down))
    x, top, ids = _mix_routing(4, torch.float32, seed=1)
    assert blocks.mix(x, top, ids) is not None
    assert blocks.mix(x.double(), top, ids) is None
    with pytest.raises(RuntimeError, match="more rows than max_rows"):
        cpu_kernels.moe_kquant_mix(x, top, torch.zeros_like(ids), blocks.gate_up, 12, blocks.down, 14, 3)
    with pytest.raises(RuntimeError, match="outside"):
        cpu_kernels.moe_kquant_mix(x, top, ids + MIX_EXPERTS, blocks.gate_up, 12, blocks.down, 14, None)
    two = BlockQuantized(torch.from_numpy(random_blocks(14, MIX_INTER, MIX_HIDDEN, seed=0)), 14, (MIX_INTER, MIX_HIDDEN))
    mixed_types = [KQuantLinear([gate_up[0].weights()[0].take_rows(torch.arange(MIX_INTER)), two]), *gate_up[1:]]
    assert BlockExperts.of(mixed_types, down) is None
    assert BlockExperts.of([DenseLinear(torch.randn(2 * MIX_INTER, MIX_HIDDEN))] * MIX_EXPERTS, down) is None


# -- BlockQuantized and KQuantLinear ---------------------------------------------------------------------


def _weight(ggml_type: int, rows: int, cols: int, seed: int) -> BlockQuantized:
    return BlockQuantized(torch.from_numpy(random_blocks(ggml_type, rows, cols, seed)), ggml_type, (rows, cols))


def test_block_quantized_checks_its_layout_and_takes_rows() -> None:
    w = _weight(13, 6, 512, seed=1)
    assert w.name == "Q5_K" and torch.equal(dense_of(w), torch.from_numpy(gguf_dequantize(w.blocks.numpy(), 13)))
    index = torch.tensor([4, 0, 2])
    assert torch.equal(w.take_rows(index).dequantize(), w.dequantize()[index])
    assert torch.equal(w.dequantize_rows(index), w.dequantize()[index])
    again = BlockQuantized.from_bytes(w.blocks.flatten(), 13, (6, 512))
    assert torch.equal(again.blocks, w.blocks)
    with pytest.raises(ValueError, match="multiples of 256"):
        BlockQuantized(w.blocks, 13, (6, 500))
    with pytest.raises(ValueError, match="uint8"):
        BlockQuantized(w.blocks[:, :-1], 13, (6, 512))
    with pytest.raises(ValueError, match="not one of"):
        BlockQuantized(w.blocks, 2, (6, 512))


def test_block_quantized_dequantizes_through_gguf_without_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _weight(14, 3, 256, seed=2)
    want = w.dequantize()
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    assert torch.equal(w.dequantize(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kquant_linear_module_segments_and_paths(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fused projection of mixed types (Q4_K q, k and Q6_K v, as a Q4_K_M file has): each segment
    through the kernel, outputs concatenated; same-type neighbours share one segment."""
    parts = [_weight(12, 32, 512, 1), _weight(12, 16, 512, 2), _weight(14, 16, 512, 3)]
    module = KQuantLinear(parts)
    assert module.types == (12, 14) and module.outs == (48, 16) and module.out_features == 64
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0)).to(dtype)
    y = module(x)
    assert y.dtype == dtype and y.shape == (5, 64)
    each = [cpu_kernels.kquant_linear(x, p.blocks, p.ggml_type, p.shape[0]) for p in parts]
    assert torch.equal(y, torch.cat(each, dim=1))
    w = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(module.dequantize(), w)
    # unpack-then-GEMM past `unpack_above` rows: the exact weights in a float32 F.linear
    module.unpack_above = 4
    assert torch.equal(module(x), F.linear(x.float(), w).to(dtype))
    assert torch.equal(module(x[:4]), y[:4])
    # without the kernels: the same F.linear on every call
    module.unpack_above = None
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    assert torch.equal(module(x), F.linear(x.float(), w).to(dtype))


@pytest.mark.parametrize("dense_dtype", [torch.float32, torch.bfloat16])
def test_the_dense_copy_serves_steps_past_the_crossover(dense_dtype: torch.dtype) -> None:
    weight = _weight(12, 40, 512, seed=4)
    dense = weight.dequantize().to(dense_dtype)
    module = KQuantLinear([weight], dense, dense_above=8)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(1))
    assert torch.equal(module(x), dense_matmul(x, dense))  # 9 rows > 8: the dense matmul
    assert torch.equal(module(x[:8]), cpu_kernels.kquant_linear(x[:8], weight.blocks, 12, 40))


def test_build_linear_keeps_block_parts_under_a_quantized_format() -> None:
    parts = [_weight(12, 64, 256, 5), _weight(14, 32, 256, 6)]
    fmt = WeightFormat(kind="int4", dense_dtype=torch.bfloat16, dense_above=16)
    module = build_linear(parts, fmt, torch.bfloat16)
    assert isinstance(module, KQuantLinear) and module.dense_above == 16
    assert module.dense is not None and module.dense.dtype == torch.bfloat16
    w = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(module.dense, w.to(torch.bfloat16))
    dense = build_linear(parts, WeightFormat(kind="dense", dtype=torch.float32), torch.bfloat16)
    assert isinstance(dense, DenseLinear) and torch.equal(dense.weight, w)
    # a part that is not blocks: the existing paths, from the dequantized values
    mixed = build_linear([parts[0], torch.zeros(8, 256)], WeightFormat(kind="int8"), torch.bfloat16)
    assert not isinstance(mixed, KQuantLinear)


def test_pack_onednn_replaces_the_dense_copy() -> None:
    weight = _weight(12, 48, 256, seed=8)
    module = KQuantLinear([weight], weight.dequantize(), dense_above=4)
    if not pack_onednn(module):
        pytest.skip("oneDNN's prepacked linear is not used on this machine")
    assert module.dense is None and module.onednn is not None
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(2))
    assert torch.allclose(module(x), F.linear(x, weight.dequantize()), rtol=1e-5, atol=1e-5)
    assert torch.equal(module(x[:4]), cpu_kernels.kquant_linear(x[:4], weight.blocks, 12, 48))


def test_concat_rows_joins_neighbours_of_one_type() -> None:
    a, b, c = _weight(8, 3, 64, 1), _weight(8, 2, 64, 2), _weight(6, 4, 64, 3)
    joined = concat_rows([a, b, c, a])
    assert [(j.ggml_type, j.shape) for j in joined] == [(8, (5, 64)), (6, (4, 64)), (8, (3, 64))]


# -- the other instruction-set builds --------------------------------------------------------------------


def _arch_operands(ggml_type: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = torch.from_numpy(random_blocks(ggml_type, 29, 768, seed=ggml_type))
    return blocks, torch.randn(5, 768, generator=torch.Generator().manual_seed(ggml_type))


def _arch_cases() -> dict[str, torch.Tensor]:
    """Fixed operands' kquant_linear results (float32 and bfloat16 activations) for every type."""
    out: dict[str, torch.Tensor] = {}
    for t in TYPES:
        blocks, x = _arch_operands(t)
        out[f"{t}:f32"] = cpu_kernels.kquant_linear(x, blocks, t, 29)
        out[f"{t}:bf16"] = cpu_kernels.kquant_linear(x.to(torch.bfloat16), blocks, t, 29)
    return out


def _dump_arch_cases(path: str) -> None:
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
    torch.save(_arch_cases(), path)


@pytest.mark.parametrize("arch", ["haswell", "x86-64"], ids=["avx2_fma", "scalar"])
def test_the_other_instruction_set_builds(arch: str, tmp_path: Path) -> None:
    """-march=native builds one of the AVX-512, AVX2+FMA and scalar paths; build the others
    (HELIOS_CPU_KERNELS_ARCH) in child processes, run the exactness and float64 tests there, and
    compare their results with this build's: the AVX2 and AVX-512 paths sum in the same order (the
    same bits); the scalar one rounds each product first (within the error bound)."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, **{cpu_kernels.ARCH_ENV: arch})
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", __file__,
         "-k", "bit_for_bit or against_float64 or bfloat16_activations or do_not_depend or long_rows"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout
    dump = tmp_path / "cases.pt"
    code = f"from tests.unit.test_kquant import _dump_arch_cases; _dump_arch_cases({str(dump)!r})"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=dict(env, PYTHONPATH=str(root)),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs, ours = torch.load(dump), _arch_cases()
    flags = set(cpu_kernels._cpu_flags().split())
    same_order = arch == "haswell" and {"avx2", "fma"} <= flags  # this build is AVX2 or AVX-512 too
    for t in TYPES:
        blocks, x = _arch_operands(t)
        w = torch.from_numpy(gguf_dequantize(blocks.numpy(), t))
        want, bound = x.double() @ w.double().t(), error_bound(x, w)
        for key in (f"{t}:f32", f"{t}:bf16"):
            if key.endswith("bf16") and pair_dot(t):  # this build's pair dot path: both within their bounds
                xb = x.to(torch.bfloat16)
                want_b = xb.double() @ w.double().t()
                bound_b = torch.maximum(error_bound(xb, w), pair_dot_bound(xb, blocks.numpy(), t))
                for got in (theirs[key], ours[key]):
                    assert ((got.double() - want_b).abs() <= bound_b + 2.0**-8 * (want_b.abs() + bound_b)).all(), key
            elif same_order:
                assert torch.equal(theirs[key], ours[key]), key
            elif key.endswith("f32"):
                assert ((theirs[key].double() - want).abs() <= bound).all(), key
            else:  # the float32 sum's error, then one bfloat16 rounding of a value at most |want| + bound
                xb = x.to(torch.bfloat16)
                want_b, bound_b = xb.double() @ w.double().t(), error_bound(xb, w)
                err = (theirs[key].double() - want_b).abs()
                assert (err <= bound_b + 2.0**-8 * (want_b.abs() + bound_b)).all(), key


# -- The tiles path (bfloat16 steps of kquant.TILE_ROWS rows): AMX tiles or AVX512-BF16 dot products --------

def _tiles_backends() -> list[str]:
    """The backends of `kquant_linear_tiles` that run here: where AMX is granted both (the dot products
    forced by `set_kquant_tiles_dp`), else the default one, or none."""
    default = cpu_kernels.kquant_tiles_backend()
    return ["amx", "avx512_bf16"] if default == "amx" else [default] if default else []


amx = pytest.mark.skipif(cpu_kernels.kquant_tiles_backend() != "amx",
                         reason="no AMX tiles here (built without AMX-TILE/AMX-BF16, or Linux refused the tile state)")


@pytest.fixture(params=_tiles_backends() or [pytest.param("", marks=pytest.mark.skip(
    reason="no tiles path here (the kernels built without AVX512-BF16)"))])
def tiles_backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each backend of the tiles path that runs here, made current for the test."""
    forced = request.param == "avx512_bf16" and cpu_kernels.kquant_tiles_backend() == "amx"
    if forced:
        assert cpu_kernels.set_kquant_tiles_dp(True) == "avx512_bf16"
    try:
        assert cpu_kernels.kquant_tiles_backend() == request.param
        yield str(request.param)
    finally:
        if forced:
            assert cpu_kernels.set_kquant_tiles_dp(False) == "amx"


@pytest.fixture
def dot_products() -> Iterator[None]:
    """The AVX512-BF16 dot products as `kquant_linear_tiles`'s backend for the test (forced where AMX runs;
    a skip where the build has no AVX512-BF16)."""
    if "avx512_bf16" not in _tiles_backends():
        pytest.skip("no AVX512-BF16 here")
    forced = cpu_kernels.kquant_tiles_backend() == "amx"
    if forced:
        cpu_kernels.set_kquant_tiles_dp(True)
    try:
        yield
    finally:
        if forced:
            cpu_kernels.set_kquant_tiles_dp(False)


def amx_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The tiles path's float32 error: products of bfloat16 values are exact, and each output is at most
    K additions of products or partial sums (AMX: a chain of K / 2 pair sums, plus the two chains'
    final addition; AVX512-BF16: 16 lane chains of K / 16 additions and a 4-level tree):
    (K + 2) u times the sum of |x w|, ``w`` the bfloat16-rounded weights."""
    return (x.shape[1] + 2) * U * (x.double().abs() @ w.double().abs().t())


@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES)
@pytest.mark.parametrize("m", [1, 8, 16, 17, 32, 33, 70])
def test_kquant_linear_tiles_is_within_its_bound_of_float64(ggml_type: int, m: int, tiles_backend: str) -> None:
    """The weights rounded to bfloat16 as `kquant_dequantize(..., bf16)` rounds them, exact products,
    float32 sums: within `amx_bound` of float64 (float32 out), and the bfloat16 result is that float32
    result rounded once. Shapes: weight rows in a partial unit of 32, an odd number of 32-column chunks
    (the 32-weight types), one and two row tiles (the sliced path) and more (the whole-row path)."""
    per = cpu_kernels.KQUANT_LAYOUTS[ggml_type][0]
    for out, k in ((37, 768), (70, 96 if per == 32 else 256)):
        blocks = torch.from_numpy(random_blocks(ggml_type, out, k, seed=ggml_type + m + out))
        w = cpu_kernels.kquant_dequantize(blocks, ggml_type, out, k, torch.bfloat16)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m + k)).to(torch.bfloat16)
        want = x.double() @ w.double().t()
        got = cpu_kernels.kquant_linear_tiles(x, blocks, ggml_type, out, float_out=True)
        assert got.dtype == torch.float32 and got.shape == (m, out)
        assert ((got.double() - want).abs() <= amx_bound(x, w)).all()
        rounded = cpu_kernels.kquant_linear_tiles(x, blocks, ggml_type, out)
        assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, got.to(torch.bfloat16))


@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES)
@pytest.mark.parametrize("m", [1, 8, 32, 48])
def test_kquant_linear_tiles_decodes_every_weight_to_its_bfloat16_bits(ggml_type: int, m: int, tiles_backend: str) -> None:
    """One-hot rows pick single weights out (every product but one is zero, so the sum is exact):
    each column the tiles see is `kquant_dequantize(..., bf16)`'s, bit for bit, for every column of
    two blocks of 256, through the sliced (1, 8, 32 rows) and the whole-row (48) paths."""
    out, k = 37, 512
    blocks = torch.from_numpy(random_blocks(ggml_type, out, k, seed=ggml_type + 7 * m))
    w = cpu_kernels.kquant_dequantize(blocks, ggml_type, out, k, torch.bfloat16)
    for c0 in range(0, k, m):
        cols = torch.arange(c0, min(c0 + m, k))
        x = torch.zeros(len(cols), k, dtype=torch.bfloat16)
        x[torch.arange(len(cols)), cols] = 1
        got = cpu_kernels.kquant_linear_tiles(x, blocks, ggml_type, out, float_out=True)
        assert torch.equal(got, w[:, cols].t().float()), (c0, m)


def _dot_products_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The AVX512-BF16 backend's documented order in float32 (products of bfloat16 values are exact): lane
    j of each output the chain over the 32-column chunks of + x[2j+1] w[2j+1], then + x[2j] w[2j] (each
    addition rounded, as VDPBF16PS adds them), then the lanes summed l + 8, + 4, + 2, + 1."""
    xf, wf = x.float(), w.float()
    lanes = torch.zeros(x.shape[0], w.shape[0], 16)
    for c in range(0, x.shape[1], 32):
        xo, xe = xf[:, c + 1:c + 32:2], xf[:, c:c + 32:2]
        wo, we = wf[:, c + 1:c + 32:2], wf[:, c:c + 32:2]
        lanes = lanes + xo[:, None, :] * wo[None, :, :]
        lanes = lanes + xe[:, None, :] * we[None, :, :]
    for half in (8, 4, 2, 1):
        lanes = lanes[..., :half] + lanes[..., half:2 * half]
    return lanes[..., 0]


@pytest.mark.parametrize("k", [1536, 4352])
def test_the_dot_products_sum_in_their_documented_order(k: int, dot_products: None) -> None:
    """The AVX512-BF16 backend's bits equal `_dot_products_reference` (an independent float32 emulation of
    its order) for 8 weight rows a group (1,536 columns: blocks of 1-3 activation rows) and 4 (4,352
    columns: blocks of 1-6), at 1, 5, 9 and 40 rows."""
    out = 45
    blocks = torch.from_numpy(random_blocks(12, out, k, seed=k))
    w = cpu_kernels.kquant_dequantize(blocks, 12, out, k, torch.bfloat16)
    for m in (1, 5, 9, 40):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        got = cpu_kernels.kquant_linear_tiles(x, blocks, 12, out, float_out=True)
        assert torch.equal(got, _dot_products_reference(x, w)), m


@pytest.mark.parametrize("ggml_type", TYPES, ids=NAMES)
def test_the_dot_products_give_a_row_the_same_bits_in_any_batch_and_team(ggml_type: int, dot_products: None) -> None:
    """The AVX512-BF16 backend sums each output in an order that depends on K alone: a row's result is
    the same bits alone, in a batch of 37 rows at any position, and on one thread or two; a long K
    (more than 2,048 columns) too."""
    threads = torch.get_num_threads()
    try:
        per = cpu_kernels.KQUANT_LAYOUTS[ggml_type][0]
        out, k = 70, 2048 + 2 * per if per == 256 else 2048 + 96
        blocks = torch.from_numpy(random_blocks(ggml_type, out, k, seed=ggml_type + 3))
        x = torch.randn(37, k, generator=torch.Generator().manual_seed(ggml_type)).to(torch.bfloat16)
        batch = cpu_kernels.kquant_linear_tiles(x, blocks, ggml_type, out, float_out=True)
        for i in (0, 5, 17, 36):
            alone = cpu_kernels.kquant_linear_tiles(x[i:i + 1], blocks, ggml_type, out, float_out=True)
            assert torch.equal(alone[0], batch[i]), i
        assert torch.equal(cpu_kernels.kquant_linear_tiles(x[3:11], blocks, ggml_type, out, float_out=True), batch[3:11])
        torch.set_num_threads(1)
        assert torch.equal(cpu_kernels.kquant_linear_tiles(x, blocks, ggml_type, out, float_out=True), batch)
        w = cpu_kernels.kquant_dequantize(blocks, ggml_type, out, k, torch.bfloat16)
        assert ((batch.double() - x.double() @ w.double().t()).abs() <= amx_bound(x, w)).all()
    finally:
        torch.set_num_threads(threads)


def test_the_exact_q8_mode_is_refused_off_the_amx_tiles(dot_products: None) -> None:
    """``q8_linear_tiles(exact=True)`` runs on the AMX backend only; on the dot products it is a clear
    error, not a rounded result."""
    codes, scales = _q8_codes(16, 64, seed=1)
    with pytest.raises(RuntimeError, match="AMX tiles only"):
        cpu_kernels.q8_linear_tiles(torch.ones(8, 64, dtype=torch.bfloat16), codes, scales, exact=True)


def test_kquant_linear_tiles_rejects_bad_operands(tiles_backend: str) -> None:
    blocks = torch.from_numpy(random_blocks(14, 4, 256, seed=0))
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu_kernels.kquant_linear_tiles(torch.randn(2, 256), blocks, 14, 4)
    with pytest.raises(RuntimeError, match="bytes of blocks"):
        cpu_kernels.kquant_linear_tiles(torch.randn(2, 256).bfloat16(), blocks, 14, 5)
    assert cpu_kernels.kquant_linear_tiles(torch.randn(0, 256).bfloat16(), blocks, 14, 4).shape == (0, 4)


def test_the_module_takes_the_tiles_for_bfloat16_steps_in_tile_rows(monkeypatch: pytest.MonkeyPatch, tiles_backend: str) -> None:
    """`KQuantLinear`: bfloat16 steps of TILE_ROWS rows on the tiles (each segment; at 8 rows the pair dot
    path's types where `kquant_pair_before_tiles`), fewer rows on the exact kernel, more on the unpack path, except a weight of TILE_LARGE_WEIGHTS or more up to
    TILE_LARGE_ROWS rows (TILE_LARGE_ROWS_DP on the AVX512-BF16 backend); float32 steps never;
    `set_kquant_tiles(False)` turns it off."""
    from helios.models import kquant

    parts = [_weight(12, 32, 512, 1), _weight(14, 16, 512, 3)]
    module = KQuantLinear(parts, unpack_above=32, unpack_dtype=torch.bfloat16)
    lo, hi = kquant.TILE_ROWS
    x = torch.randn(hi + 1, 512, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)

    def tiles(rows: torch.Tensor) -> torch.Tensor:
        return torch.cat([cpu_kernels.kquant_linear_tiles(rows, p.blocks, p.ggml_type, p.shape[0]) for p in parts], dim=1)

    def kernel(rows: torch.Tensor) -> torch.Tensor:
        return torch.cat([cpu_kernels.kquant_linear(rows, p.blocks, p.ggml_type, p.shape[0]) for p in parts], dim=1)

    assert torch.equal(module(x[:lo - 1]), kernel(x[:lo - 1]))
    for m in (33, hi):
        assert torch.equal(module(x[:m]), tiles(x[:m])), m
    # lo rows: the tiles, but for the pair dot path's types where every row takes vdpbf16ps (per segment)
    dp_rows = cpu_kernels.kquant_bf16_dot_rows()
    try:
        for on in (False, True):
            cpu_kernels.set_kquant_bf16_dot_rows(on)
            pair = on and cpu_kernels.kquant_bf16_dot_supported()
            assert [cpu_kernels.kquant_pair_before_tiles(lo, p.ggml_type) for p in parts] == [pair, pair]
            assert not cpu_kernels.kquant_pair_before_tiles(lo + 1, 12) and not cpu_kernels.kquant_pair_before_tiles(lo, 8)
            assert torch.equal(module(x[:lo]), (kernel if pair else tiles)(x[:lo])), on
    finally:
        cpu_kernels.set_kquant_bf16_dot_rows(dp_rows)
    assert torch.equal(module(x), F.linear(x, module.dequantize(torch.bfloat16)))
    large = kquant.TILE_LARGE_ROWS if tiles_backend == "amx" else kquant.TILE_LARGE_ROWS_DP
    assert large > hi and 48 * 512 < kquant.TILE_LARGE_WEIGHTS
    monkeypatch.setattr(kquant, "TILE_LARGE_WEIGHTS", 48 * 512)  # this module's weights: a large one
    big = torch.randn(large + 1, 512, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    for m in (hi + 1, large):
        assert torch.equal(module(big[:m]), tiles(big[:m])), m
    assert torch.equal(module(big), F.linear(big, module.dequantize(torch.bfloat16)))
    assert torch.equal(module(x[:lo].float()), kernel(x[:lo].float()))
    try:
        assert not cpu_kernels.set_kquant_tiles(False)
        assert torch.equal(module(x[:lo + 1]), kernel(x[:lo + 1]))
    finally:
        assert cpu_kernels.set_kquant_tiles(True)


def test_a_wide_weight_leaves_the_tiles_for_the_unpack_path_past_tile_wide_rows(
        monkeypatch: pytest.MonkeyPatch, tiles_backend: str) -> None:
    """On the AVX512-BF16 backend a weight of more than `TILE_WIDE_IN` columns whose module unpacks past
    ``unpack_above`` takes the unpack path (``F.linear`` of the bfloat16 dequantized weight) for steps of
    more than `TILE_WIDE_ROWS` rows and the tiles up to it; a narrow one keeps the tiles to `TILE_ROWS`' end,
    and so does the wide one without ``unpack_above`` (and on AMX tiles, where it was not measured)."""
    from helios.models import kquant

    calls: list[int] = []
    real = cpu_kernels.kquant_linear_tiles

    def spy(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kquant.cpu_kernels, "kquant_linear_tiles", spy)
    wide_in, rows = kquant.TILE_WIDE_IN + 256, kquant.TILE_WIDE_ROWS
    assert 32 < rows < kquant.TILE_ROWS[1]
    wide = KQuantLinear([_weight(12, 24, wide_in, 5)], unpack_above=32, unpack_dtype=torch.bfloat16)
    narrow = KQuantLinear([_weight(12, 24, 512, 6)], unpack_above=32, unpack_dtype=torch.bfloat16)
    kept = KQuantLinear([_weight(12, 24, wide_in, 5)])
    for module in (wide, narrow, kept):
        x = torch.randn(rows + 1, module.in_features, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
        calls.clear()
        assert torch.equal(module(x[:rows]), real(x[:rows], module.blocks[0], 12, 24)) and calls == [rows]
        calls.clear()
        out = module(x)
        if module is wide and tiles_backend != "amx":
            assert calls == [] and torch.equal(out, F.linear(x, module.dequantize(torch.bfloat16)))
        else:
            assert calls == [rows + 1] and torch.equal(out, real(x, module.blocks[0], 12, 24))


def _q8_codes(out: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks' codes [out, k] and float16 scales widened to float32 [out, k / 32] (random valid blocks,
    scales from tiny subnormal-free values to 65504)."""
    raw = random_blocks(8, out, k, seed=seed, full_range=True).reshape(out, k // 32, 34)
    scales = torch.from_numpy(raw[:, :, :2].copy().view(np.float16).astype(np.float32).reshape(out, k // 32))
    scales = torch.where(scales.abs() < 2.0 ** -14, torch.full_like(scales, 0.5), scales)  # no float16 subnormals
    return torch.from_numpy(raw[:, :, 2:].copy().view(np.int8).reshape(out, k)), scales


@amx
@pytest.mark.parametrize("m", [1, 16, 24, 32, 33, 70])
def test_q8_linear_tiles_exact_reads_every_weight_exactly(m: int) -> None:
    """`q8_linear_tiles` with ``exact`` splits each weight ``scale * code`` (a float16 scale) into three bfloat16
    terms that add up to it exactly: one-hot activation rows read every weight back bit for bit
    (with two of the three terms it fails), at one and two row tiles and the whole-row path."""
    out, k = 45, 96
    codes, scales = _q8_codes(out, k, seed=m)
    w = (codes.double().view(out, k // 32, 32) * scales.double()[:, :, None]).view(out, k)
    assert torch.equal(w.float().double(), w)  # every weight is a float32 value
    for start in range(0, k, m):
        cols = torch.arange(start, min(start + m, k))
        x = torch.zeros(m, k, dtype=torch.bfloat16)
        x[torch.arange(len(cols)), cols] = 1
        got = cpu_kernels.q8_linear_tiles(x, codes, scales, exact=True)
        assert got.dtype == torch.float32 and got.shape == (m, out)
        assert torch.equal(got[: len(cols)].double(), w[:, cols].t()), start


@amx
@pytest.mark.parametrize("m", [8, 32, 33])
def test_q8_linear_tiles_exact_is_within_its_bound_of_float64(m: int) -> None:
    """The exact weights' products summed in float32 by the tile unit: within (3K + 2) u of the sum of
    |x w| from float64 (`amx_bound` over the three terms), and within float32 summation of the int8
    kernel's (`q8_linear`) result."""
    out, k = 70, 576
    codes, scales = _q8_codes(out, k, seed=100 + m)
    scales = scales / scales.abs().amax()  # a head's scale: every logit finite
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    w = (codes.double().view(out, k // 32, 32) * scales.double()[:, :, None]).view(out, k)
    got = cpu_kernels.q8_linear_tiles(x, codes, scales, exact=True).double()
    bound = (3 * k + 2) * U * (x.double().abs() @ w.abs().t())
    assert ((got - x.double() @ w.t()).abs() <= bound).all()
    assert ((got - cpu_kernels.q8_linear(x, codes, scales).double()).abs() <= 2 * bound).all()


@pytest.mark.parametrize("m", [8, 33])
def test_q8_linear_tiles_is_within_its_bound_of_float64(m: int, tiles_backend: str) -> None:
    """`q8_linear`'s codes and scales on the tiles: each weight ``scale * code`` rounded to bfloat16, then
    `kquant_linear_tiles`'s sums (the same bits as the Q8_0 blocks of the same weight through it)."""
    out, k = 45, 96
    blocks = random_blocks(8, out, k, seed=m)
    raw = blocks.reshape(out, k // 32, 34)
    scales = torch.from_numpy(raw[:, :, :2].copy().view(np.float16).astype(np.float32).reshape(out, k // 32))
    codes = torch.from_numpy(raw[:, :, 2:].copy().view(np.int8).reshape(out, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    got = cpu_kernels.q8_linear_tiles(x, codes, scales)
    assert got.dtype == torch.float32 and got.shape == (m, out)
    assert torch.equal(got, cpu_kernels.kquant_linear_tiles(x, torch.from_numpy(blocks), 8, out, float_out=True))
    w = (codes.double() * scales.repeat_interleave(32, dim=1).double()).float().to(torch.bfloat16)
    assert ((got.double() - x.double() @ w.double().t()).abs() <= amx_bound(x, w)).all()
