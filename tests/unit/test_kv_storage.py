"""The KV cache's storage: CPU tensors of zeros in anonymous memory maps (`attention.zeroed`), and
int8 K/V (`[engine] kv_dtype = "int8"`): the row quantizer, pages with their scales, the pool's size."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from helios.engine.attention import KVCache, dequantize_rows, quantize_rows, zeroed
from helios.engine.kv.layout import KV_SCALE_DTYPE, CacheLayout
from helios.models.interface import FullAttentionSpec, LatentAttentionSpec, SlidingWindowSpec


def test_zeroed_is_zeros_aligned_and_writable() -> None:
    t = zeroed((4, 1 << 16, 8), torch.bfloat16)
    assert t.shape == (4, 1 << 16, 8) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % 4096 == 0
    assert not t.any()
    t[1, 5] = 2.5
    view = t[1]
    del t
    gc.collect()  # the view keeps the mapping alive
    assert float(view[5, 0]) == 2.5 and float(view.float().sum()) == 2.5 * 8


def test_zeroed_small_or_odd_sizes_are_plain_zeros() -> None:
    small = zeroed((3, 5), torch.float32)
    assert small.shape == (3, 5) and not small.any()
    odd = zeroed((3, 100_003), torch.float32)  # not a whole number of pages
    assert odd.shape == (3, 100_003) and not odd.any()
    odd[-1, -1] = 1.0
    assert float(odd.sum()) == 1.0


def test_kv_cache_pages_start_zero_and_round_trip() -> None:
    kv = KVCache(num_layers=2, num_pages=600, page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    assert kv.k[0].numel() * 4 >= 1 << 20  # large enough to be mapped
    assert all(not t.any() for t in (*kv.k.values(), *kv.v.values()))
    kv.k[1][:, 16:32] = 1.0
    data = kv.read_page(1, 16)
    assert kv.write_page(7, 16, data)
    assert torch.equal(kv.k[1][:, 112:128], kv.k[1][:, 16:32])
    assert not kv.k[0].any()


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon line")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc/self/status (Linux)")
def test_prefault_makes_the_whole_pool_resident() -> None:
    # 2 layers x K and V x 2 heads x 8192 slots x 128 dims x 4 bytes = 32 MiB.
    before = _rss_anon()
    kv = KVCache(num_layers=2, num_pages=512, page_size=16, num_kv_heads=2, head_dim=128, dtype=torch.float32)
    pool = sum(t.numel() * t.element_size() for t in (*kv.k.values(), *kv.v.values()))
    assert pool == 32 << 20
    made = _rss_anon()
    assert made - before < pool // 10  # nothing touched yet
    kv.prefault()
    assert _rss_anon() - made > pool * 9 // 10
    assert all(not t.any() for t in (*kv.k.values(), *kv.v.values()))


# -- int8 K/V ------------------------------------------------------------------------------------------


def _rows(seed: int) -> torch.Tensor:
    """Rows of very different magnitudes (1e-30 .. 1e30), one of zeros, one with a single nonzero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 64, generator=g, dtype=torch.float64)
    x *= torch.logspace(-30, 30, 64, dtype=torch.float64)[:, None]
    x[5] = 0.0
    x[6] = 0.0
    x[6, 3] = -2.5
    return x.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_round_trip_is_within_half_a_scale(dtype: torch.dtype) -> None:
    x = _rows(1).to(dtype)
    codes, scales = quantize_rows(x)
    assert codes.dtype == torch.int8 and scales.dtype == KV_SCALE_DTYPE and scales.shape == (64,)
    xd, sd = x.double(), scales.double()
    amax = xd.abs().amax(dim=-1)
    # The scale is max|x| / 127 rounded up to bfloat16: never below it, at most one bfloat16 step above.
    assert (sd * 127 >= amax).all() and (sd * 127 <= amax * (1 + 2**-7)).all()
    assert codes.abs().max() <= 127
    assert codes.abs().amax(dim=-1)[amax > 0].min() >= 126  # the largest element uses the range
    err = (xd - dequantize_rows(codes, scales).double()).abs()
    # Half a step per element, plus the float32 division's rounding (127 * 2**-24 of a step).
    assert (err <= sd[:, None] * (0.5 + 127 * 2**-24)).all()
    assert not codes[5].any() and scales[5] == 0 and torch.equal(dequantize_rows(codes[5], scales[5]), x[5].float())
    assert dequantize_rows(codes[6], scales[6])[3].item() == pytest.approx(-2.5, rel=2**-8)


def test_dequantized_rows_are_exact_products() -> None:
    """code * scale is exact in float32 (8 + 7 significant bits), so the float32 dequantized rows are
    the float64 products."""
    codes, scales = quantize_rows(_rows(2))
    assert torch.equal(dequantize_rows(codes, scales).double(), codes.double() * scales.double()[:, None])


def test_int8_pages_round_trip_with_their_scales() -> None:
    kv = KVCache(num_layers=2, num_pages=40, page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                 kv_dtype="int8")
    assert kv.k[0].dtype == torch.int8 and kv.k_scale[1].shape == (2, 640) and kv.is_quantized(1)
    g = torch.Generator().manual_seed(4)
    slots = torch.arange(16, 32)
    for layer in (0, 1):
        kv.write(layer, torch.randn(16, 2, 64, generator=g), torch.randn(16, 2, 64, generator=g) * 7, slots)
    data = kv.read_page(1, 16)
    # Per layer: K and V codes (2 heads x 16 slots x 64 dims), then their bfloat16 scales.
    assert len(data) == 2 * (2 * 2 * 16 * 64 + 2 * 2 * 16 * 2)
    assert kv.write_page(7, 16, data)
    for layer in (0, 1):
        for t in (kv.k, kv.v, kv.k_scale, kv.v_scale):
            assert torch.equal(t[layer][:, 112:128], t[layer][:, 16:32]) and t[layer][:, 16:32].any()
        k, v = kv.gather(layer, torch.arange(112, 128))
        assert k.dtype == v.dtype == torch.float32 and torch.equal(k, kv.gather(layer, slots)[0])
    plain = KVCache(num_layers=2, num_pages=40, page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    assert not plain.write_page(3, 16, data)  # another KV dtype's bytes do not fit
    assert not kv.write_page(3, 16, plain.read_page(1, 16))


def test_int8_writes_store_the_quantized_rows() -> None:
    kv = KVCache(num_layers=1, num_pages=4, page_size=16, num_kv_heads=3, head_dim=32, dtype=torch.float32,
                 kv_dtype="int8")
    g = torch.Generator().manual_seed(8)
    k, v = torch.randn(5, 3, 32, generator=g), torch.randn(5, 3, 32, generator=g)
    slots = torch.tensor([3, 17, 40, 41, 63])
    kv.write(0, k, v, slots)
    for x, codes, scales in ((k, kv.k[0], kv.k_scale[0]), (v, kv.v[0], kv.v_scale[0])):
        want_codes, want_scales = quantize_rows(x.transpose(0, 1))
        assert torch.equal(codes[:, slots], want_codes) and torch.equal(scales[:, slots], want_scales)
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots] = False
    assert not kv.k[0][:, untouched].any() and not kv.v_scale[0][:, untouched].any()


def test_the_int8_pool_holds_at_least_1_9x_the_tokens_of_bfloat16() -> None:
    """The default model's shapes (SmolLM2-135M: 30 layers, 3 kv heads of 64): the same memory gives
    int8 K/V 1.94x the pages of a bfloat16 cache (66 bytes a row against 128), and the pool that
    `KVCache` allocates for those pages takes exactly the bytes the count assumed."""
    layout = CacheLayout.from_specs([FullAttentionSpec(3, 64)] * 30)
    budget = 2 * 2**30
    bf16 = layout.pages_for(budget, 16, torch.bfloat16)
    int8 = layout.pages_for(budget, 16, torch.bfloat16, "int8")
    assert layout.bytes_per_token(torch.bfloat16) == 2 * 30 * 3 * 64 * 2
    assert layout.bytes_per_token(torch.bfloat16, "int8") == 2 * 30 * 3 * (64 + 2)
    assert int8 >= 1.9 * bf16 and int8 / bf16 == pytest.approx(128 / 66, rel=1e-3)
    kv = KVCache.for_layout(layout, 64, 16, torch.bfloat16, kv_dtype="int8")
    held = sum(t.numel() * t.element_size() for d in (kv.k, kv.v, kv.k_scale, kv.v_scale) for t in d.values())
    assert held == 64 * 16 * layout.bytes_per_token(torch.bfloat16, "int8")


def test_int8_keeps_latent_rows_in_the_model_dtype() -> None:
    """Only full-attention and sliding-window K/V are quantized: latent rows keep the model's dtype
    (and their bytes), a sliding group's K/V are int8."""
    layout = CacheLayout.from_specs([FullAttentionSpec(2, 32), SlidingWindowSpec(2, 32, 64), LatentAttentionSpec(48)])
    kv = KVCache.for_layout(layout, 8, 16, torch.bfloat16, kv_dtype="int8")
    assert kv.k[0].dtype == kv.k[1].dtype == torch.int8 and 1 in kv.v_scale
    assert kv.rows[2].dtype == torch.bfloat16 and not kv.is_quantized(2)
    assert layout.bytes_per_token(torch.bfloat16, "int8") == 2 * 2 * (32 + 2) * 2 + 48 * 2


def test_the_layout_description_names_the_kv_dtype() -> None:
    """The layout fingerprint (prefix-cache chains, host-store records) differs with int8 K/V; the
    default's description is what it always was."""
    single = CacheLayout.from_specs([FullAttentionSpec(3, 64)] * 30)
    assert single.describe(torch.bfloat16) == "30:3:64:torch.bfloat16"
    assert single.describe(torch.bfloat16, "int8") == "30:3:64:torch.bfloat16:kv=int8+torch.bfloat16"
    hybrid = CacheLayout.from_specs([FullAttentionSpec(2, 32), SlidingWindowSpec(2, 32, 64)])
    assert hybrid.describe(torch.float32, "int8") == hybrid.describe(torch.float32) + ":kv=int8+torch.bfloat16"
    with pytest.raises(ValueError, match="kv_dtype must be one of auto, int8"):
        single.describe(torch.float32, "fp8")
