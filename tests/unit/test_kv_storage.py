"""The KV cache's storage: CPU tensors of zeros in anonymous memory maps (`attention.zeroed`)."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from helios.engine.attention import KVCache, zeroed


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
