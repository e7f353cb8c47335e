"""Helios's CPU kernels (helios/models/cpu_kernels.py) against float64 references, and their wiring:
the engine's decode attention and the model's output projection use them where they apply, and
turning them off (or a machine without a compiler) keeps the torch paths."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from helios.domain.sampling import SamplingParams
from helios.engine.attention import AttentionInputs, TorchPagedBackend, dequantize_rows, quantize_rows
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.kv.layout import CacheLayout
from helios.engine.records import EngineRequest
from helios.models import cpu_kernels
from helios.models.config import ModelConfig
from helios.models.interface import FullAttentionSpec, SlidingWindowSpec
from helios.models.llama import LlamaForCausalLM
from helios.models.quant import GroupQuantized
from helios.runtime import AUTO_DENSE_ABOVE, effective_cpu_capability, load_model
from tests.numerics import FP32_TOLERANCE, unit_roundoff
from tests.unit.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.skipif(not cpu_kernels.available(),
                                reason=f"Helios's CPU kernels are not built here: {cpu_kernels.unavailable_reason()}")


# -- q8_linear -----------------------------------------------------------------------------------------


def _q8_weight(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (rows, cols), generator=g, dtype=torch.int8)
    scales = (torch.rand(rows, cols // 32, generator=g) * 0.02).half().float()  # ggml stores float16 scales
    return codes, scales


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 33])
def test_q8_linear_against_float64(m: int) -> None:
    codes, scales = _q8_weight(1000, 576, seed=m)
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(100 + m))
    w64 = (codes.double().view(1000, 18, 32) * scales.double()[:, :, None]).view(1000, 576)
    expected = x.double() @ w64.t()
    got = cpu_kernels.q8_linear(x, codes, scales)
    assert got.dtype == torch.float32 and got.shape == (m, 1000)
    # float32 accumulation of 576 products: relative to the sum of |products|, a few float32 ulps.
    magnitude = (x.double().abs() @ w64.abs().t())
    assert ((got.double() - expected).abs() / magnitude).max().item() < 1e-5


def test_q8_linear_takes_bfloat16_activations_exactly() -> None:
    """bfloat16 hidden states are widened (exactly) to float32 first: the same result as float32 input."""
    codes, scales = _q8_weight(64, 64, seed=7)
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert torch.equal(cpu_kernels.q8_linear(x, codes, scales), cpu_kernels.q8_linear(x.float(), codes, scales))


def test_q8_linear_rejects_bad_operands() -> None:
    codes, scales = _q8_weight(8, 64, seed=1)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_kernels.q8_linear(torch.randn(1, 48), codes[:, :48].contiguous(), scales)
    with pytest.raises(RuntimeError, match="int8 codes"):
        cpu_kernels.q8_linear(torch.randn(1, 64), codes.to(torch.int16), scales)


needs_bf16_kernels = pytest.mark.skipif(
    not cpu_kernels.bf16_kernels_supported(), reason="the bfloat16 kernels are built only with AVX512-BF16")


@needs_bf16_kernels
@pytest.mark.parametrize(("m", "n"), [(1, 1000), (4, 1000), (5, 1000), (8, 37), (33, 1000), (12, 48)])
def test_q8_linear_bf16_matches_float64(m: int, n: int) -> None:
    """bfloat16 activations against the checkpoint's Q8_0 values: exact products, float32 sums; output
    counts that do not fill the last 16-output tile (37, 1000) read the zero padding and drop it."""
    codes, scales = _q8_weight(n, 576, seed=m)
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(200 + m)).to(torch.bfloat16)
    w64 = (codes.double().view(n, 18, 32) * scales.double()[:, :, None]).view(n, 576)
    packed = cpu_kernels.pack_q8_bf16(codes, scales)
    assert packed[0].shape == (-(-n // 16), 288, 16, 2) and packed[2] == n
    got = cpu_kernels.q8_linear_bf16(x, *packed)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    magnitude = x.double().abs() @ w64.abs().t()
    assert ((got.double() - x.double() @ w64.t()).abs() / magnitude).max().item() < 1e-5
    # The int8 kernel on the same operands: the same values up to float32 summation order.
    assert ((got.double() - cpu_kernels.q8_linear(x, codes, scales).double()).abs() / magnitude).max().item() < 2e-6


@needs_bf16_kernels
def test_q8_linear_bf16_rejects_bad_operands() -> None:
    codes, scales = _q8_weight(32, 64, seed=1)
    packed = cpu_kernels.pack_q8_bf16(codes, scales)
    with pytest.raises(RuntimeError, match="bfloat16 x"):
        cpu_kernels.q8_linear_bf16(torch.randn(2, 64), *packed)
    with pytest.raises(RuntimeError, match="fill the last tile"):
        cpu_kernels.q8_linear_bf16(torch.randn(2, 64).to(torch.bfloat16), packed[0], packed[1], 40)


# -- paged_decode --------------------------------------------------------------------------------------


def _paged_case(lens: list[int], dtype: torch.dtype, page_size: int = 16, kv_heads: int = 3, heads: int = 9,
                head_dim: int = 64, seed: int = 0) -> dict[str, torch.Tensor]:
    """A cache whose pages are handed out in shuffled order, a block table with one spare row (rows
    are addressed through ``rows``, as the engine's persistent batch does), and queries."""
    g = torch.Generator().manual_seed(seed)
    per_row = [-(-n // page_size) for n in lens]
    max_pages = max(per_row) + 2
    num_pages = sum(per_row) + 5
    order = torch.randperm(num_pages, generator=g)
    table = torch.zeros(len(lens) + 1, max_pages, dtype=torch.int64)
    rows = torch.randperm(len(lens) + 1, generator=g)[: len(lens)]
    at = 0
    for i, count in enumerate(per_row):
        table[rows[i], :count] = order[at:at + count]
        table[rows[i], count:] = order[-1]  # stale entries past a row's pages are never read
        at += count
    slots = num_pages * page_size
    k = torch.randn(kv_heads, slots, head_dim, generator=g).to(dtype)
    v = torch.randn(kv_heads, slots, head_dim, generator=g).to(dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    return {"q": q, "k": k, "v": v, "table": table, "rows": rows, "lens": torch.tensor(lens, dtype=torch.int64),
            "page_size": torch.tensor(page_size)}


def _reference(case: dict[str, torch.Tensor]) -> torch.Tensor:
    q, k, v, table = case["q"].double(), case["k"].double(), case["v"].double(), case["table"]
    ps = int(case["page_size"])
    kv_heads, heads, d = k.shape[0], q.shape[1], q.shape[2]
    out = []
    for i, n in enumerate(case["lens"].tolist()):
        slots = (table[case["rows"][i]][:, None] * ps + torch.arange(ps)).flatten()[:n]
        kk, vv = k[:, slots], v[:, slots]  # [kv, n, d]
        qq = q[i].view(kv_heads, heads // kv_heads, d)
        p = torch.softmax(qq @ kk.transpose(1, 2) / d**0.5, dim=-1)
        out.append((p @ vv).reshape(heads, d))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[1], [255, 256, 257], [1000, 3, 513, 17], [4000]], ids=str)
def test_paged_decode_against_float64(dtype: torch.dtype, lens: list[int]) -> None:
    case = _paged_case(lens, dtype, seed=len(lens))
    got = cpu_kernels.paged_decode(case["q"], case["k"], case["v"], case["table"], case["rows"], case["lens"],
                                   int(case["page_size"]), case["q"].shape[-1] ** -0.5)
    expected = _reference(case)
    assert got.dtype == dtype and got.shape == case["q"].shape
    # float32 math inside; a bfloat16 result is rounded once at the end (|outputs| < 4).
    bound = 1e-5 if dtype == torch.float32 else 2 * unit_roundoff(dtype) * 4
    assert (got.double() - expected).abs().max().item() < bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"),
                         [(4, 4, 64), (8, 2, 64), (12, 2, 64), (6, 2, 128), (8, 2, 128), (16, 2, 64), (8, 1, 128),
                          (8, 1, 256), (32, 1, 576), (14, 2, 64), (12, 2, 128), (18, 2, 64)],
                         ids=str)
def test_paged_decode_shapes_against_float64(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    """Query groups of 1-8 heads and head sizes 64 and 128: the weighted sum of V is specialised for
    the (group, head size) pairs whose accumulators fit in registers, generic for the others; many
    queries of a wide head (latent attention's absorbed decode: 32 heads on one 576-wide row) and
    groups of more than 6 queries or 8 vectors (Qwen2.5-0.5B's 7 x 64, Qwen2.5-1.5B's 6 x 128, 9 x 64:
    tiles of 4 queries and a partial one) take the register tiles."""
    case = _paged_case([7, 300, 1], dtype, kv_heads=kv_heads, heads=heads, head_dim=head_dim, seed=heads + head_dim)
    got = cpu_kernels.paged_decode(case["q"], case["k"], case["v"], case["table"], case["rows"], case["lens"],
                                   int(case["page_size"]), head_dim ** -0.5)
    bound = 1e-5 if dtype == torch.float32 else 2 * unit_roundoff(dtype) * 4
    assert (got.double() - _reference(case)).abs().max().item() < bound


@pytest.mark.parametrize(("lens", "heads", "kv_heads", "head_dim"),
                         [([150] * 8, 12, 2, 128), ([60] * 8, 12, 2, 128), ([150] * 8, 9, 3, 64), ([2000, 5], 9, 3, 64)],
                         ids=str)
def test_paged_decode_gives_the_same_bits_on_any_number_of_threads(lens: list[int], heads: int, kv_heads: int,
                                                                   head_dim: int) -> None:
    """A step's rows go parallel by the work they hold (query heads x positions x head size), so the
    1.5B's 8 rows of 150 positions run on the team where the default model's stay on one thread; each
    (row, kv head, chunk) item is computed alone and merged in a fixed order: the same bits at 1-3
    threads, and within float64's reference."""
    case = _paged_case(lens, torch.bfloat16, kv_heads=kv_heads, heads=heads, head_dim=head_dim, seed=len(lens))
    args = (case["q"], case["k"], case["v"], case["table"], case["rows"], case["lens"], int(case["page_size"]),
            head_dim ** -0.5)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(cpu_kernels.paged_decode(*args))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])
    assert (results[0].double() - _reference(case)).abs().max().item() < 2 * unit_roundoff(torch.bfloat16) * 4


def test_paged_decode_handles_large_scores_without_overflow() -> None:
    """Scores near float32's exp limit: the per-chunk max is subtracted before exponentiating."""
    case = _paged_case([300, 40], torch.float32, seed=3)
    case["q"] = case["q"] * 40
    got = cpu_kernels.paged_decode(case["q"], case["k"], case["v"], case["table"], case["rows"], case["lens"],
                                   int(case["page_size"]), case["q"].shape[-1] ** -0.5)
    assert torch.isfinite(got).all()
    # Scores of magnitude ~300 carry float32 rounding of ~1e-5 relative into the weights.
    assert (got.double() - _reference(case)).abs().max().item() < FP32_TOLERANCE


def test_paged_decode_refuses_pages_outside_the_cache() -> None:
    case = _paged_case([40], torch.float32)
    case["table"][case["rows"][0], 0] = 10_000
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernels.paged_decode(case["q"], case["k"], case["v"], case["table"], case["rows"], case["lens"],
                                 int(case["page_size"]), 0.125)


def _int8_case(case: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The case's K/V quantized (`quantize_rows`, a bfloat16 scale per row), and for the reference
    their dequantized float32 values (exact products) in place of the originals."""
    out = dict(case)
    for name in ("k", "v"):
        codes, scales = quantize_rows(case[name].float() * 3)
        out[f"{name}_codes"], out[f"{name}_scale"] = codes, scales
        out[name] = dequantize_rows(codes, scales)
    return out


def _decode_int8(case: dict[str, torch.Tensor], scale: float) -> torch.Tensor:
    return cpu_kernels.paged_decode_int8(case["q"], case["k_codes"], case["k_scale"], case["v_codes"], case["v_scale"],
                                         case["table"], case["rows"], case["lens"], int(case["page_size"]), scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("lens", "heads", "kv_heads", "head_dim"),
                         [([1], 9, 3, 64), ([255, 256, 257], 9, 3, 64), ([1000, 3, 513, 17], 9, 3, 64),
                          ([4000], 9, 3, 64), ([7, 300, 1], 8, 2, 128), ([7, 300], 12, 2, 64),
                          ([40, 300], 32, 1, 256), ([33], 4, 4, 32)],
                         ids=str)
def test_paged_decode_int8_against_float64(dtype: torch.dtype, lens: list[int], heads: int, kv_heads: int,
                                           head_dim: int) -> None:
    """int8 K/V with a scale per row, read in place and dequantized on the fly: against float64
    attention over the dequantized values, to float32 rounding (a bfloat16 query, the values the
    reference gets too; a bfloat16 output rounded once). Query groups and head sizes take the
    specialised, tiled and generic weighted sums, histories the 16-position blocks and the tail."""
    case = _int8_case(_paged_case(lens, dtype, kv_heads=kv_heads, heads=heads, head_dim=head_dim,
                                  seed=len(lens) + heads))
    got = _decode_int8(case, head_dim**-0.5)
    expected = _reference(case)
    assert got.dtype == dtype and got.shape == case["q"].shape
    # |outputs| < 12 (V rows of 3 x standard normal values).
    bound = 4e-5 if dtype == torch.float32 else 2 * unit_roundoff(dtype) * 12
    assert (got.double() - expected).abs().max().item() < bound


def test_paged_decode_int8_refuses_bad_operands() -> None:
    case = _int8_case(_paged_case([40], torch.float32))
    with pytest.raises(RuntimeError, match="int8 caches, bfloat16 scales"):
        cpu_kernels.paged_decode_int8(case["q"], case["k"], case["k_scale"], case["v"], case["v_scale"], case["table"],
                                      case["rows"], case["lens"], 16, 0.125)
    with pytest.raises(RuntimeError, match="shapes"):
        _decode_int8({**case, "k_scale": case["k_scale"][:, :-1].contiguous()}, 0.125)
    case["table"][case["rows"][0], 0] = 10_000
    with pytest.raises(RuntimeError, match="outside the cache"):
        _decode_int8(case, 0.125)


# -- paged_prefill -------------------------------------------------------------------------------------

needs_prefill_kernel = pytest.mark.skipif(
    not cpu_kernels.bf16_kernels_supported(), reason="paged_prefill is built only with AVX512-BF16")


def _prefill_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                       start: int) -> torch.Tensor:
    length, heads, d = q.shape
    kv_heads = k.shape[0]
    kk = k[:, slots[: start + length]].double().repeat_interleave(heads // kv_heads, 0)
    vv = v[:, slots[: start + length]].double().repeat_interleave(heads // kv_heads, 0)
    scores = torch.einsum("lhd,hpd->hlp", q.double(), kk) / d**0.5
    causal = torch.arange(start + length)[None, :] <= (start + torch.arange(length))[:, None]
    return torch.einsum("hlp,hpd->lhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), vv)


# The prefill kernel's two paths: AMX tiles (where built and permitted) and AVX512-BF16 pair dot products.
PREFILL_PATHS = [pytest.param(False, id="avx512_bf16"),
                 pytest.param(True, id="amx", marks=pytest.mark.skipif(
                     not (cpu_kernels.available() and cpu_kernels.amx_permitted()),
                     reason="AMX tiles are not built or not permitted on this machine"))]


@pytest.fixture
def prefill_path(request: pytest.FixtureRequest) -> Iterator[bool]:
    """Runs the test with `paged_prefill` on the given path, then restores the default (tiles where
    permitted)."""
    amx = bool(request.param)
    assert cpu_kernels.set_prefill_amx(amx) is amx
    try:
        yield amx
    finally:
        cpu_kernels.set_prefill_amx(True)


@needs_prefill_kernel
@pytest.mark.parametrize("prefill_path", PREFILL_PATHS, indirect=True)
@pytest.mark.parametrize(("length", "start"), [(1, 0), (5, 0), (64, 0), (65, 0), (37, 3), (130, 250), (16, 1000),
                                               (321, 0)])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
def test_paged_prefill_matches_float64(length: int, start: int, head_dim: int, prefill_path: bool) -> None:
    """Chunks from the first position and over cached context, across query-tile (64) and key-block
    (64) boundaries, GQA 9/3 heads, K/V at shuffled slots; on both paths."""
    g = torch.Generator().manual_seed(length + start)
    k = torch.randn(3, 2048, head_dim, generator=g).to(torch.bfloat16)
    v = torch.randn(3, 2048, head_dim, generator=g).to(torch.bfloat16)
    slots = torch.randperm(2048, generator=g)[: start + length].contiguous()
    q = torch.randn(length, 9, head_dim, generator=g).to(torch.bfloat16)
    got = cpu_kernels.paged_prefill(q, k, v, slots, start, head_dim**-0.5)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    # bfloat16 inputs, float32 scores and probabilities (on tiles: two bfloat16 terms, about 17 bits),
    # one rounding of the result: a few bfloat16 roundings of the values' magnitude (|v| < 5).
    bound = 4 * unit_roundoff(torch.bfloat16) * 5
    assert (got.double() - _prefill_reference(q, k, v, slots, start)).abs().max().item() < bound


@needs_prefill_kernel
@pytest.mark.skipif(not (cpu_kernels.available() and cpu_kernels.amx_permitted()),
                    reason="AMX tiles are not built or not permitted on this machine")
def test_the_amx_prefill_keeps_the_probabilities_to_float32_precision() -> None:
    """Every query's first key scores 0.1 and every other 0, so all other probabilities are
    exp(-0.1), which one bfloat16 rounds up by 2**-9.4 relative: the same way for every key, so the
    weighted sum of values in [1, 2) would be biased by ~0.002 (not averaged away), and the result
    would miss its correct bfloat16 rounding. With the probabilities as hi + lo (AMX) or in float32
    (AVX512-BF16), every output is within half a bfloat16 step (2**-8 on [1, 2)) of float64, and the
    paths agree to within one step."""
    g = torch.Generator().manual_seed(5)
    length, start, d = 200, 300, 64
    slots = torch.randperm(1024, generator=g)[: start + length].contiguous()
    k = torch.zeros(3, 1024, d)
    k[:, slots[0], 0] = 0.8  # score (q . k) / 8 = 0.1 for the first position, 0 for the rest
    k = k.to(torch.bfloat16)
    v = (1 + torch.rand(3, 1024, d, generator=g)).to(torch.bfloat16)
    q = torch.zeros(length, 9, d)
    q[:, :, 0] = 1.0
    q = q.to(torch.bfloat16)
    expected = _prefill_reference(q, k, v, slots, start)
    outs = []
    try:
        for amx in (False, True):
            cpu_kernels.set_prefill_amx(amx)
            outs.append(cpu_kernels.paged_prefill(q, k, v, slots, start, d**-0.5).double())
    finally:
        cpu_kernels.set_prefill_amx(True)
    for out in outs:
        assert (out - expected).abs().max().item() <= 2**-8 * 1.01
    assert (outs[0] - outs[1]).abs().max().item() <= 2**-7


@needs_prefill_kernel
@pytest.mark.parametrize("prefill_path", PREFILL_PATHS, indirect=True)
@pytest.mark.parametrize(("length", "start"), [(513, 0), (200, 77)])
def test_paged_prefill_gives_the_same_bits_on_any_number_of_threads(length: int, start: int,
                                                                    prefill_path: bool) -> None:
    """The threads take (query tile, kv head) items from a shared counter, costliest first: which
    thread computes an item, and in what order, must not change a bit of it."""
    g = torch.Generator().manual_seed(length)
    k = torch.randn(3, 1024, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(3, 1024, 64, generator=g).to(torch.bfloat16)
    slots = torch.randperm(1024, generator=g)[: start + length].contiguous()
    q = torch.randn(length, 9, 64, generator=g).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(cpu_kernels.paged_prefill(q, k, v, slots, start, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert bool(outs[0].isfinite().all()) and outs[0].abs().sum().item() > 0


@needs_prefill_kernel
def test_paged_prefill_refuses_bad_operands() -> None:
    k = torch.zeros(3, 64, 64, dtype=torch.bfloat16)
    q = torch.zeros(4, 9, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernels.paged_prefill(q, k, k, torch.tensor([0, 1, 2, 640]), 0, 0.125)
    with pytest.raises(RuntimeError, match="a slot per position"):
        cpu_kernels.paged_prefill(q, k, k, torch.tensor([0, 1, 2]), 0, 0.125)
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu_kernels.paged_prefill(q.float(), k.float(), k.float(), torch.arange(4), 0, 0.125)


@needs_prefill_kernel
def test_the_engine_backend_prefills_over_cached_context_with_the_kernel() -> None:
    """A prefill chunk of 70 tokens after 150 cached positions: the kernel's output against float64
    and against the SDPA path of the same backend with the kernel turned off."""
    ps, kv_heads, heads, d = 16, 3, 9, 64
    outs = []
    for use_kernel in (True, False):
        backend = TorchPagedBackend(1, 64, ps, kv_heads, d, torch.bfloat16, torch.device("cpu"),
                                    prefill_kernel=use_kernel)
        assert backend.prefill_kernel is use_kernel
        g = torch.Generator().manual_seed(9)
        table = torch.randperm(64, generator=g)[:20].view(1, 20).contiguous()
        slots = (table[0][:, None] * ps + torch.arange(ps)).flatten()
        backend.kv.k[0][:, slots[:150]] = torch.randn(kv_heads, 150, d, generator=g).to(torch.bfloat16)
        backend.kv.v[0][:, slots[:150]] = torch.randn(kv_heads, 150, d, generator=g).to(torch.bfloat16)
        inputs = AttentionInputs(block_table=table, slot_mapping=slots[150:220].contiguous(), num_tokens=70,
                                 decode_tokens=None, decode_rows=None, decode_lens=None, decode_max_len=0,
                                 num_decode=0, prefills=((0, 70, 0, 150),))
        q = torch.randn(70, heads, d, generator=g).to(torch.bfloat16)
        k = torch.randn(70, kv_heads, d, generator=g).to(torch.bfloat16)
        v = torch.randn(70, kv_heads, d, generator=g).to(torch.bfloat16)
        out = backend.build(inputs)(0, q, k, v)
        expected = _prefill_reference(q, backend.kv.k[0], backend.kv.v[0], slots, 150)
        assert (out.double() - expected).abs().max().item() < 4 * unit_roundoff(torch.bfloat16) * 5
        outs.append(out)
    assert (outs[0].double() - outs[1].double()).abs().max().item() < 8 * unit_roundoff(torch.bfloat16) * 5


# -- wiring --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engine_backend_decodes_through_the_kernel(dtype: torch.dtype) -> None:
    """A step mixing decode rows and a prefill chunk: decode rows come from the kernel, the prefill
    from SDPA; both against float64 over what the step wrote into the cache."""
    ps, kv_heads, heads, d = 16, 3, 9, 64
    backend = TorchPagedBackend(1, 64, ps, kv_heads, d, dtype, torch.device("cpu"))
    assert backend.decode_kernel and backend.name == "cpu_paged_kernel"
    g = torch.Generator().manual_seed(5)
    table = torch.randperm(64, generator=g)[:60].view(3, 20).contiguous()
    lens = [37, 300]  # two decode rows (rows 0 and 2) at these context lengths; row 1 prefills 20 tokens
    for row, n in ((0, 36), (2, 299)):  # their histories, already in the cache
        slots = (table[row][:, None] * ps + torch.arange(ps)).flatten()[:n]
        backend.kv.k[0][:, slots] = torch.randn(kv_heads, n, d, generator=g).to(dtype)
        backend.kv.v[0][:, slots] = torch.randn(kv_heads, n, d, generator=g).to(dtype)
    positions = [36, *range(20), 299]
    token_rows = [0, *[1] * 20, 2]
    slot_mapping = torch.tensor([int(table[r, p // ps]) * ps + p % ps for r, p in zip(token_rows, positions, strict=True)])
    inputs = AttentionInputs(block_table=table, slot_mapping=slot_mapping, num_tokens=22,
                             decode_tokens=torch.tensor([0, 21]), decode_rows=torch.tensor([0, 2]),
                             decode_lens=torch.tensor(lens), decode_max_len=300, num_decode=2,
                             prefills=((1, 20, 1, 0),))
    q = torch.randn(22, heads, d, generator=g).to(dtype)
    k = torch.randn(22, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(22, kv_heads, d, generator=g).to(dtype)
    out = backend.build(inputs)(0, q, k, v)
    kc, vc = backend.kv.k[0].double(), backend.kv.v[0].double()

    def attend(qi: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        qq = qi.double().view(kv_heads, heads // kv_heads, d)
        p = torch.softmax(qq @ kc[:, slots].transpose(1, 2) / d**0.5, dim=-1)
        return (p @ vc[:, slots]).reshape(heads, d)

    expected = []
    for t, (row, pos) in enumerate(zip(token_rows, positions, strict=True)):
        slots = (table[row][:, None] * ps + torch.arange(ps)).flatten()[:pos + 1]
        expected.append(attend(q[t], slots))
    bound = FP32_TOLERANCE if dtype == torch.float32 else 8 * unit_roundoff(dtype) * 4
    assert (out.double() - torch.stack(expected)).abs().max().item() < bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "gathered"])
def test_the_engine_backend_attends_over_int8_kv_against_float64(dtype: torch.dtype, kernel: bool) -> None:
    """`kv_dtype = "int8"`, a step mixing two decode rows (the int8 decode kernel, or the gathered
    dequantized path) and a prefill chunk over cached context (dequantized gather and SDPA in
    float32): the step's K/V are stored quantized, and every output matches float64 attention over
    the dequantized cache."""
    ps, kv_heads, heads, d = 16, 3, 9, 64
    backend = TorchPagedBackend(1, 64, ps, kv_heads, d, dtype, torch.device("cpu"), kv_dtype="int8",
                                decode_kernel=kernel)
    assert backend.decode_kernel is kernel and not backend.prefill_kernel
    kv = backend.kv
    g = torch.Generator().manual_seed(5)
    table = torch.randperm(64, generator=g)[:60].view(3, 20).contiguous()
    lens = [37, 300]  # decode rows 0 and 2; row 1 prefills 20 tokens after 30 cached positions
    for row, n in ((0, 36), (1, 30), (2, 299)):
        slots = (table[row][:, None] * ps + torch.arange(ps)).flatten()[:n]
        kv.write(0, torch.randn(n, kv_heads, d, generator=g).to(dtype), torch.randn(n, kv_heads, d, generator=g).to(dtype),
                 slots)
    positions = [36, *range(30, 50), 299]
    token_rows = [0, *[1] * 20, 2]
    slot_mapping = torch.tensor([int(table[r, p // ps]) * ps + p % ps for r, p in zip(token_rows, positions, strict=True)])
    inputs = AttentionInputs(block_table=table, slot_mapping=slot_mapping, num_tokens=22,
                             decode_tokens=torch.tensor([0, 21]), decode_rows=torch.tensor([0, 2]),
                             decode_lens=torch.tensor(lens), decode_max_len=300, num_decode=2,
                             prefills=((1, 20, 1, 30),))
    q = torch.randn(22, heads, d, generator=g).to(dtype)
    k = torch.randn(22, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(22, kv_heads, d, generator=g).to(dtype)
    out = backend.build(inputs)(0, q, k, v)
    assert out.dtype == dtype
    codes, scales = quantize_rows(k.transpose(0, 1))
    assert torch.equal(kv.k[0][:, slot_mapping], codes) and torch.equal(kv.k_scale[0][:, slot_mapping], scales)
    kc = dequantize_rows(kv.k[0], kv.k_scale[0]).double()
    vc = dequantize_rows(kv.v[0], kv.v_scale[0]).double()
    expected = []
    for t, (row, pos) in enumerate(zip(token_rows, positions, strict=True)):
        slots = (table[row][:, None] * ps + torch.arange(ps)).flatten()[:pos + 1]
        qq = q[t].double().view(kv_heads, heads // kv_heads, d)
        p = torch.softmax(qq @ kc[:, slots].transpose(1, 2) / d**0.5, dim=-1)
        expected.append((p @ vc[:, slots]).reshape(heads, d))
    bound = FP32_TOLERANCE if dtype == torch.float32 else 2 * unit_roundoff(dtype) * 4
    assert (out.double() - torch.stack(expected)).abs().max().item() < bound


@pytest.mark.parametrize("context", [20, 90], ids=["within_window", "past_window"])
def test_int8_sliding_window_decode_and_prefill_against_float64(context: int) -> None:
    """A sliding-window group (window 32) with int8 K/V: within the window the decode kernel reads the
    rows in place, past it decode rows gather their last 32 positions; a prefill chunk attends to
    the window before each of its tokens. Against float64 over the dequantized cache."""
    ps, kv_heads, heads, d, window = 16, 2, 4, 32, 32
    layout = CacheLayout.from_specs([FullAttentionSpec(kv_heads, d), SlidingWindowSpec(kv_heads, d, window)])
    backend = TorchPagedBackend.for_layout(layout, 32, ps, torch.float32, torch.device("cpu"), kv_dtype="int8")
    kv = backend.kv
    assert kv.is_quantized(1) and backend.group_kernels[1][0]
    g = torch.Generator().manual_seed(context)
    table = torch.randperm(32, generator=g)[:16].view(2, 8).contiguous()
    chunk = 5  # row 1 prefills positions context .. context + 4; row 0 decodes position context
    for row in (0, 1):
        slots = (table[row][:, None] * ps + torch.arange(ps)).flatten()[:context]
        kv.write(1, torch.randn(context, kv_heads, d, generator=g), torch.randn(context, kv_heads, d, generator=g), slots)
    positions = [context, *range(context, context + chunk)]
    token_rows = [0, *[1] * chunk]
    slot_mapping = torch.tensor([int(table[r, p // ps]) * ps + p % ps for r, p in zip(token_rows, positions, strict=True)])
    inputs = AttentionInputs(block_table=table, slot_mapping=slot_mapping, num_tokens=1 + chunk,
                             decode_tokens=torch.tensor([0]), decode_rows=torch.tensor([0]),
                             decode_lens=torch.tensor([context + 1]), decode_max_len=context + 1, num_decode=1,
                             prefills=((1, chunk, 1, context),), group_tables=((table, slot_mapping),))
    q = torch.randn(1 + chunk, heads, d, generator=g)
    k, v = torch.randn(1 + chunk, kv_heads, d, generator=g), torch.randn(1 + chunk, kv_heads, d, generator=g)
    out = backend.build(inputs)(1, q, k, v)
    kc = dequantize_rows(kv.k[1], kv.k_scale[1]).double()
    vc = dequantize_rows(kv.v[1], kv.v_scale[1]).double()
    expected = []
    for t, (row, pos) in enumerate(zip(token_rows, positions, strict=True)):
        slots = (table[row][:, None] * ps + torch.arange(ps)).flatten()[max(0, pos - window + 1):pos + 1]
        qq = q[t].double().view(kv_heads, heads // kv_heads, d)
        p = torch.softmax(qq @ kc[:, slots].transpose(1, 2) / d**0.5, dim=-1)
        expected.append((p @ vc[:, slots]).reshape(heads, d))
    assert (out.double() - torch.stack(expected)).abs().max().item() < FP32_TOLERANCE


@pytest.mark.parametrize(("dtype", "cache_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                   (torch.float32, torch.bfloat16)])
def test_write_kv_puts_strided_rows_at_their_slots(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """A prefill or mixed step's K/V (strided views of one fused qkv tensor) land at their slots, and
    nowhere else: row copies, or index_copy_ with the conversion when the dtypes differ."""
    kv_heads, d, slots_total = 3, 64, 80
    g = torch.Generator().manual_seed(5)
    k_cache = torch.randn(kv_heads, slots_total, d, generator=g).to(cache_dtype)
    v_cache = torch.randn(kv_heads, slots_total, d, generator=g).to(cache_dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(slots_total, generator=g)[:37].contiguous()
    qkv = torch.randn(37, (9 + 2 * kv_heads) * d, generator=g).to(dtype)
    k = qkv[:, 9 * d : (9 + kv_heads) * d].view(37, kv_heads, d)
    v = qkv[:, (9 + kv_heads) * d :].view(37, kv_heads, d)
    cpu_kernels.write_kv(k, v, k_cache, v_cache, slots)
    want_k[:, slots] = k.transpose(0, 1).to(cache_dtype)
    want_v[:, slots] = v.transpose(0, 1).to(cache_dtype)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    if dtype == cache_dtype:
        with pytest.raises(RuntimeError, match="outside the cache"):
            cpu_kernels.write_kv(k[:1], v[:1], k_cache, v_cache, torch.tensor([slots_total]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_int8_gives_the_row_quantizers_bits(dtype: torch.dtype) -> None:
    """`write_kv_int8` (the CPU kernels' write of int8 K/V) stores exactly `quantize_rows`'s codes and
    scales at the slots, and nothing elsewhere: rows of magnitudes 1e-30 .. 1e30, zero rows, a row of
    exact halves (ties to even), strided views of one fused tensor."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(50, 3, 64, generator=g, dtype=torch.float64)
    x *= torch.logspace(-30, 30, 50, dtype=torch.float64)[:, None, None]
    x[3] = 0.0
    x[5, 2] = 0.0
    x[5, 2, 7] = 1.0
    x[6, 0] = (torch.arange(64) - 31.5) * 127 / 31.5
    kv = x.to(dtype)
    fused = torch.cat([kv, kv * 3], dim=1)
    k, v = fused[:, :3], fused[:, 3:]
    caches = [torch.zeros(3, 100, 64, dtype=torch.int8), torch.zeros(3, 100, dtype=torch.bfloat16)]
    caches += [torch.zeros(3, 100, 64, dtype=torch.int8), torch.zeros(3, 100, dtype=torch.bfloat16)]
    slots = torch.randperm(100, generator=g)[:50].contiguous()
    cpu_kernels.write_kv_int8(k, v, *caches, slots)
    for rows, codes, scales in ((k, caches[0], caches[1]), (v, caches[2], caches[3])):
        want_codes, want_scales = quantize_rows(rows.transpose(0, 1))
        assert torch.equal(codes[:, slots], want_codes)
        assert torch.equal(scales[:, slots].view(torch.int16), want_scales.view(torch.int16))
        rest = torch.ones(100, dtype=torch.bool)
        rest[slots] = False
        assert not codes[:, rest].any() and not scales[:, rest].any()
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernels.write_kv_int8(k[:1], v[:1], *caches, torch.tensor([100]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_all_decode_step_writes_and_attends_in_one_operator(dtype: torch.dtype) -> None:
    """Every token a decode row: `write_paged_decode` stores the step's K/V (strided views of one
    fused qkv tensor, as the model hands them over) at their slots and attends over the cache; the
    cache must hold exactly those values and the output match float64 over it."""
    ps, kv_heads, heads, d = 16, 3, 9, 64
    backend = TorchPagedBackend(1, 64, ps, kv_heads, d, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(11)
    table = torch.randperm(64, generator=g)[:40].view(2, 20).contiguous()
    lens = [45, 300]
    for row, n in enumerate(lens):
        slots = (table[row][:, None] * ps + torch.arange(ps)).flatten()[: n - 1]
        backend.kv.k[0][:, slots] = torch.randn(kv_heads, n - 1, d, generator=g).to(dtype)
        backend.kv.v[0][:, slots] = torch.randn(kv_heads, n - 1, d, generator=g).to(dtype)
    slot_mapping = torch.tensor([int(table[r, (n - 1) // ps]) * ps + (n - 1) % ps for r, n in enumerate(lens)])
    inputs = AttentionInputs(block_table=table, slot_mapping=slot_mapping, num_tokens=2,
                             decode_tokens=torch.tensor([0, 1]), decode_rows=torch.tensor([0, 1]),
                             decode_lens=torch.tensor(lens), decode_max_len=300, num_decode=2, prefills=())
    qkv = torch.randn(2, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    q = qkv[:, : heads * d].view(2, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(2, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(2, kv_heads, d)
    out = backend.build(inputs)(0, q, k, v)
    assert torch.equal(backend.kv.k[0][:, slot_mapping], k.transpose(0, 1))
    assert torch.equal(backend.kv.v[0][:, slot_mapping], v.transpose(0, 1))
    kc, vc = backend.kv.k[0].double(), backend.kv.v[0].double()
    expected = []
    for row, n in enumerate(lens):
        slots = (table[row][:, None] * ps + torch.arange(ps)).flatten()[:n]
        qq = q[row].double().view(kv_heads, heads // kv_heads, d)
        p = torch.softmax(qq @ kc[:, slots].transpose(1, 2) / d**0.5, dim=-1)
        expected.append((p @ vc[:, slots]).reshape(heads, d))
    bound = FP32_TOLERANCE if dtype == torch.float32 else 8 * unit_roundoff(dtype) * 4
    assert (out.double() - torch.stack(expected)).abs().max().item() < bound


def test_turned_off_the_backend_gathers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernels.ENV, "0")
    backend = TorchPagedBackend(1, 8, 16, 3, 64, torch.float32, torch.device("cpu"))
    assert not backend.decode_kernel and backend.name == "torch_paged"
    assert cpu_kernels.unavailable_reason() == "turned off"


def test_float64_keeps_the_torch_path() -> None:
    backend = TorchPagedBackend(1, 8, 16, 3, 64, torch.float64, torch.device("cpu"))
    assert not backend.decode_kernel


def _tiny_q8_model(q8_head: bool) -> LlamaForCausalLM:
    cfg = ModelConfig(arch="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16, tie_word_embeddings=True)
    g = torch.Generator().manual_seed(11)
    codes, scales = _q8_weight(96, 64, seed=11)
    tensors: dict[str, object] = {
        "model.embed_tokens.weight": GroupQuantized(codes, scales, torch.zeros_like(scales), 8, 32),
        "model.norm.weight": torch.ones(64),
    }
    for name, shape in (("self_attn.q_proj", (64, 64)), ("self_attn.k_proj", (32, 64)), ("self_attn.v_proj", (32, 64)),
                        ("self_attn.o_proj", (64, 64)), ("mlp.gate_proj", (128, 64)), ("mlp.up_proj", (128, 64)),
                        ("mlp.down_proj", (64, 128))):
        tensors[f"model.layers.0.{name}.weight"] = torch.randn(*shape, generator=g) * 0.05
    tensors["model.layers.0.input_layernorm.weight"] = torch.ones(64)
    tensors["model.layers.0.post_attention_layernorm.weight"] = torch.ones(64)
    model = LlamaForCausalLM(cfg, dtype=torch.bfloat16, q8_head=q8_head)
    model.load_weights(tensors)  # type: ignore[arg-type]
    return model


def test_a_q8_0_head_computes_logits_from_its_codes() -> None:
    model = _tiny_q8_model(q8_head=True)
    assert model.head_format == "q8_0"
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    codes, scales = _q8_weight(96, 64, seed=11)
    w64 = (codes.double().view(96, 2, 32) * scales.double()[:, :, None]).view(96, 64)
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    # float32 accumulation: a few ulps of the sum of |products| (logits reach ~25 here).
    magnitude = hidden.double().abs() @ w64.abs().t()
    assert ((logits.double() - hidden.double() @ w64.t()).abs() / magnitude).max().item() < 1e-6
    # The same weights as the float32 copy the model keeps without the kernel (another summation order).
    plain = _tiny_q8_model(q8_head=False)
    assert plain.head_format == "float32"
    assert ((plain.compute_logits(hidden).double() - logits.double()).abs() / magnitude).max().item() < 2e-6
    # And the packed-weight cache round trip keeps the codes.
    state, kinds = model.packed_state()
    assert state["lm_head_q8.codes"].dtype == torch.int8 and "lm_head_fp32" not in state
    again = LlamaForCausalLM(model.config, dtype=torch.bfloat16, q8_head=True)
    again.load_packed_state(state, kinds)
    assert again.head_format == "q8_0" and torch.equal(again.compute_logits(hidden), logits)


@needs_bf16_kernels
def test_a_packed_q8_0_head_takes_the_bfloat16_kernel_from_q8_bf16_rows() -> None:
    """After `pack_cpu_weights` a bfloat16 model's Q8_0 head runs `q8_linear_bf16` for batches of
    Q8_BF16_ROWS rows or more and `q8_linear` below: the same logits either way (float32 sums)."""
    from helios.models.llama import Q8_BF16_ROWS

    model = _tiny_q8_model(q8_head=True)
    hidden = torch.randn(Q8_BF16_ROWS + 3, 64, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16)
    before = model.compute_logits(hidden)
    assert model.head_bf16_rows is None
    assert model.pack_cpu_weights() >= 1
    assert model.head_bf16_rows == Q8_BF16_ROWS
    calls: list[int] = []
    original = cpu_kernels.q8_linear_bf16

    def counted(x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return original(x, *args)  # type: ignore[arg-type]

    cpu_kernels.q8_linear_bf16 = counted  # type: ignore[assignment]
    try:
        after = model.compute_logits(hidden)
        small = model.compute_logits(hidden[: Q8_BF16_ROWS - 1])
    finally:
        cpu_kernels.q8_linear_bf16 = original  # type: ignore[assignment]
    assert calls == [Q8_BF16_ROWS + 3]
    assert torch.equal(small, before[: Q8_BF16_ROWS - 1])
    assert torch.allclose(after, before, rtol=0, atol=2e-6 * float(before.abs().max()))
    model.load_packed_state(*model.packed_state())  # loading weights again drops the packed copy
    assert model._lm_head_q8_bf16 is None


@needs_bf16_kernels
def test_a_packed_q8_0_head_takes_the_exact_tiles_from_q8_exact_amx_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """From Q8_EXACT_AMX_ROWS bfloat16 rows, where the tiles path is active on AMX, a packed Q8_0 head
    runs `q8_linear_tiles` with ``exact`` (the exact weights as three bfloat16 terms): the int8 kernel's
    logits up to float32 summation; below it, with the tiles off, or on the AVX512-BF16 backend (no
    exact mode there), `q8_linear_bf16` as before."""
    from helios.models.packing import Q8_EXACT_AMX_ROWS

    model = _tiny_q8_model(q8_head=True)
    hidden = torch.randn(Q8_EXACT_AMX_ROWS + 5, 64, generator=torch.Generator().manual_seed(17)).to(torch.bfloat16)
    before = model.compute_logits(hidden)  # q8_linear, the int8 codes
    assert model.pack_cpu_weights() >= 1
    calls: list[tuple[str, int]] = []
    amx, bf16 = cpu_kernels.q8_linear_tiles, cpu_kernels.q8_linear_bf16

    def counted_amx(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *, exact: bool = False) -> torch.Tensor:
        calls.append(("exact" if exact else "rounded", x.shape[0]))
        return amx(x, codes, scales, exact=exact)

    def counted_bf16(x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(("bf16", x.shape[0]))
        return bf16(x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_kernels, "q8_linear_tiles", counted_amx)
    monkeypatch.setattr(cpu_kernels, "q8_linear_bf16", counted_bf16)
    after = model.compute_logits(hidden)
    model.compute_logits(hidden[: Q8_EXACT_AMX_ROWS - 1])
    tiles = cpu_kernels.kquant_tiles_active() and cpu_kernels.kquant_tiles_backend() == "amx"
    assert calls == [("exact" if tiles else "bf16", Q8_EXACT_AMX_ROWS + 5), ("bf16", Q8_EXACT_AMX_ROWS - 1)]
    assert torch.allclose(after, before, rtol=0, atol=2e-6 * float(before.abs().max()))
    if tiles:
        calls.clear()
        try:
            assert not cpu_kernels.set_kquant_tiles(False)
            model.compute_logits(hidden)
        finally:
            assert cpu_kernels.set_kquant_tiles(True)
        assert calls == [("bf16", Q8_EXACT_AMX_ROWS + 5)]


# -- the decoder layer's elementwise kernels ---------------------------------------------------------------


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs() / want.abs().clamp_min(1e-3)).max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 70])  # 70 rows split across threads
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_against_float64(dtype: torch.dtype, rows: int, with_delta: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    h = (torch.randn(rows, 200, generator=g) * 3).to(dtype)  # 200: not a multiple of the vector width
    delta = torch.randn(rows, 200, generator=g).to(dtype) if with_delta else None
    w = torch.randn(200, generator=g)
    s, y = cpu_kernels.add_rms_norm(h, delta, w, 1e-5)
    expected_s = h if delta is None else h + delta  # torch's add rounds once to the dtype, as the kernel does
    assert torch.equal(s, expected_s) and s.dtype == dtype
    s64 = s.double()
    want = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    # float32 math, then one rounding to the dtype.
    bound = 4 * FP32_TOLERANCE / 100 if dtype == torch.float32 else 2 * unit_roundoff(dtype)
    assert y.dtype == dtype and _rel_error(y, want) < bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_on_a_strided_view_against_float64(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, d = 40, 6, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    before = qkv.clone()
    qk = qkv[:, : (heads + kv_heads) * d].view(tokens, heads + kv_heads, d)  # rows strided, as in the layer
    angles = torch.rand(tokens, d // 2, generator=g, dtype=torch.float64) * 50
    cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None, :]
    sin = torch.cat((-angles.sin(), angles.sin()), -1)[:, None, :]
    x = qk.double()
    want = x * cos + x.roll(d // 2, dims=-1) * sin
    out = cpu_kernels.rope_(qk, cos.to(dtype).contiguous(), sin.to(dtype).contiguous())
    assert out.data_ptr() == qk.data_ptr()
    magnitude = x.abs().sum(-1, keepdim=True) / d
    err = ((qk.double() - want).abs() / magnitude).max().item()
    assert err < (1e-5 if dtype == torch.float32 else 8 * unit_roundoff(dtype))  # tables rounded too
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], before[:, (heads + kv_heads) * d :])  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 40])
def test_qk_norm_rope_is_add_rms_norm_then_rope_in_place(dtype: torch.dtype, tokens: int) -> None:
    """The per-head q/k norm and the rotation in one pass on the strided q/k view: the same bits as
    `add_rms_norm` of each head row (its weight row) followed by `rope_`, v untouched; and within
    float32 / one-rounding bounds of float64."""
    g = torch.Generator().manual_seed(tokens)
    heads, kv_heads, d = 6, 2, 64
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g) * 3).to(dtype)
    before = qkv.clone()
    qk = qkv[:, : (heads + kv_heads) * d].view(tokens, heads + kv_heads, d)
    w = torch.randn(heads + kv_heads, d, generator=g)
    angles = torch.rand(tokens, d // 2, generator=g) * 50
    cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None, :].contiguous()
    sin = torch.cat((-angles.sin(), angles.sin()), -1)[:, None, :].contiguous()
    rows = qk.reshape(-1, d).clone()
    normed = torch.stack([cpu_kernels.add_rms_norm(rows[i:i + 1], None, w[i % (heads + kv_heads)], 1e-6)[1][0]
                          for i in range(rows.shape[0])]).view(tokens, heads + kv_heads, d)
    want = cpu_kernels.rope_(normed.clone(), cos, sin)
    out = cpu_kernels.qk_norm_rope_(qk, w, 1e-6, cos, sin)
    assert out.data_ptr() == qk.data_ptr() and torch.equal(qk, want)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], before[:, (heads + kv_heads) * d :])
    x = before[:, : (heads + kv_heads) * d].view(tokens, heads + kv_heads, d).double()
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    ref = n * cos.double() + n.roll(d // 2, dims=-1) * sin.double()
    magnitude = n.abs().amax(-1, keepdim=True)  # each output: two products of normed values, rounded twice
    bound = 1e-5 if dtype == torch.float32 else 8 * unit_roundoff(dtype)
    assert ((qk.double() - ref).abs() / magnitude).max().item() < bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_against_float64(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(4)
    gu = (torch.randn(37, 2 * 200, generator=g) * 8).to(dtype)
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # far tails and zero
    x = gu.double()
    want = torch.nn.functional.silu(x[:, :200]) * x[:, 200:]
    got = cpu_kernels.silu_mul(gu)
    assert got.shape == (37, 200) and got.dtype == dtype
    scale = x[:, :200].abs() * x[:, 200:].abs() + 1e-30
    bound = 1e-6 if dtype == torch.float32 else 2 * unit_roundoff(dtype)
    assert ((got.double() - want).abs() / scale).max().item() < bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "width"), [(1, 8960), (2, 8960), (8, 4864), (8, 1000), (5, 17), (40, 3000)])
def test_silu_mul_gives_the_same_bits_on_any_number_of_threads(rows: int, width: int, dtype: torch.dtype) -> None:
    """A decode step's few rows are split into column spans for the team (whole rows from 32 rows on):
    every element takes the vector or scalar path it takes in a whole row, so the same bits at 1-3
    threads and in any batch, within float64's reference."""
    g = torch.Generator().manual_seed(rows + width)
    gu = (torch.randn(rows, 2 * width, generator=g) * 4).to(dtype)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(cpu_kernels.silu_mul(gu))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])
    # a row's bits do not depend on its batch: the same rows among 40 (whole rows per item)
    among = cpu_kernels.silu_mul(torch.cat([gu, (torch.randn(40, 2 * width, generator=g) * 4).to(dtype)]))
    assert torch.equal(among[:rows], results[0])
    x = gu.double()
    want = torch.nn.functional.silu(x[:, :width]) * x[:, width:]
    scale = x[:, :width].abs() * x[:, width:].abs() + 1e-30
    bound = 1e-6 if dtype == torch.float32 else 2 * unit_roundoff(dtype)
    assert ((results[0].double() - want).abs() / scale).max().item() < bound


def test_the_fused_layer_path_matches_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole model forward with the kernels equals the torch ops' forward within float32 rounding."""
    calls: dict[str, int] = {}
    for name in ("add_rms_norm", "rope_", "silu_mul"):
        def counted(*args: object, _name: str = name, _f: object = getattr(cpu_kernels, name)) -> object:
            calls[_name] = calls.get(_name, 0) + 1
            return _f(*args)  # type: ignore[operator]
        monkeypatch.setattr(cpu_kernels, name, counted)
    cfg = ModelConfig(arch="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, tie_word_embeddings=True)
    torch.manual_seed(5)
    model = LlamaForCausalLM(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    ids = torch.randint(0, 96, (9,))
    positions = torch.arange(9)

    def dense(_layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k = k.repeat_interleave(2, dim=1)
        v = v.repeat_interleave(2, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / 4.0
        scores = scores.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)

    with torch.inference_mode():
        fused = model(ids, positions, dense)
        cpu_kernels.set_enabled(False)
        try:
            plain = model(ids, positions, dense)
        finally:
            cpu_kernels.set_enabled(True)
    assert (fused - plain).abs().max().item() < FP32_TOLERANCE
    assert calls == {"add_rms_norm": 5, "rope_": 2, "silu_mul": 2}  # 2 per layer + the final norm; 1; 1


@pytest.mark.parametrize(("weights", "dtype", "dense_above", "kind"), [
    ("int4", "auto", None, "int4"), ("int4", "float32", None, "int4"), ("auto", "auto", None, "int4"),
    ("auto", "auto", 1, "onednn"), ("bfloat16", "auto", None, "onednn"), ("float32", "auto", None, "onednn")])
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_the_one_operator_decode_layers_give_the_layer_by_layer_tokens_exactly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, weights: str, dtype: str, dense_above: int | None,
        kind: str, kv_dtype: str) -> None:
    """An all-decode step runs its decoder layers as one operator (`decode_layers`): int4 projections
    where they are int4 for that many rows, oneDNN's prepacked linear where they multiply through
    oneDNN-packed weights (a dense format, or auto's dense copy above its threshold, here lowered to
    1 row). The same operators in the same order as `_DecoderLayer.forward`, so the greedy tokens and
    their logprobs are equal to the layer-by-layer path's, not just close. Three streams, so rows of
    one step sit at different positions and pages; prefill steps keep the layer-by-layer path. With
    int8 K/V the operator quantizes and reads the rows as the layer-by-layer path does."""
    if dense_above is not None:
        monkeypatch.setitem(AUTO_DENSE_ABOVE, effective_cpu_capability()[0], dense_above)
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    loaded = load_model(path, weights=weights, dtype=dtype)
    model = loaded.model
    layers = list(model.layers)
    if kind == "onednn" and not all(layer._onednn is not None for layer in layers):
        pytest.skip("oneDNN's prepacked linear is not used for this dtype on this machine")
    calls: list[tuple[int, int, bool]] = []  # (rows, layers, int4) per call
    real = cpu_kernels.decode_layers

    def counted(h: torch.Tensor, delta: torch.Tensor | None, fused: list[cpu_kernels.FusedLayer],
                *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append((h.shape[0], len(fused), fused[0].group > 0))
        return real(h, delta, fused, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_kernels, "decode_layers", counted)

    def generate() -> dict[str, tuple[list[int], list[float]]]:
        core = EngineCore(model,
                          EngineConfig(page_size=4, num_pages=64, max_active=4, prefill_chunk_size=64,
                                       max_model_len=128, kv_dtype=kv_dtype), loaded.choice.dtype, "cpu")
        assert core.kv.is_quantized(0) is (kv_dtype == "int8")
        for i, length in enumerate((5, 11, 3)):
            prompt = tuple((7 * i + 3 * j) % 90 + 1 for j in range(length))
            core.add(EngineRequest(f"r{i}", prompt, SamplingParams(temperature=0.0), max_tokens=12,
                                   ignore_eos=True, num_top_logprobs=0))
        out: dict[str, tuple[list[int], list[float]]] = {}
        while core.scheduler.has_work:
            for o in core.step():
                ids, lps = out.setdefault(o.request_id, ([], []))
                ids.extend(o.new_token_ids)
                lps.extend(lp.logprob for lp in (o.logprobs or ()))
        return out

    with torch.inference_mode():
        fused = generate()
        # One call per all-decode step, covering every layer, of the expected kind.
        assert calls and max(rows for rows, _, _ in calls) == 3
        assert {(n, int4) for _, n, int4 in calls} == {(len(layers), kind == "int4")}
        # A layer without the fused form splits the run: the layers around it are runs of their own.
        monkeypatch.setattr(layers[1], "_int4", None)
        monkeypatch.setattr(layers[1], "_onednn", None)
        calls.clear()
        split = generate()
        assert calls and {n for _, n, _ in calls} == {1, len(layers) - 2} - {0}
        for layer in layers:
            monkeypatch.setattr(layer, "_int4", None)
            monkeypatch.setattr(layer, "_onednn", None)
        calls.clear()
        plain = generate()
    assert calls == []
    assert fused == plain == split and all(len(ids) == 12 for ids, _ in fused.values())


def test_kernels_without_a_compiler_fall_back_with_one_warning(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(cpu_kernels, "_state", {"loaded": None, "enabled": True, "why": ""})
    monkeypatch.setattr(cpu_kernels, "_compiler", lambda: None)
    with caplog.at_level(logging.WARNING, logger="helios.kernels"):
        assert not cpu_kernels.available()
        assert not cpu_kernels.available()
    assert [r.message for r in caplog.records].count(
        "CPU kernels unavailable (no C++ compiler (set CXX or install g++)); using the torch paths") == 1
    assert not TorchPagedBackend(1, 8, 16, 3, 64, torch.float32, torch.device("cpu")).decode_kernel


@pytest.mark.parametrize("arch", ["haswell", "x86-64"], ids=["avx2_fma", "scalar"])
def test_the_other_instruction_set_paths_against_float64(arch: str) -> None:
    """The kernels have AVX-512, AVX2+FMA and scalar paths; -march=native builds only one of them here.
    Build the others (HELIOS_CPU_KERNELS_ARCH) in a child process and run the float64 comparisons there."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", __file__,
         "-k", "against_float64 and not other_instruction_set or through_the_kernel or overflow"],
        cwd=root, env=dict(os.environ, **{cpu_kernels.ARCH_ENV: arch}), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout
