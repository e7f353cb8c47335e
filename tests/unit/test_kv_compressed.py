"""The compressed group's page pool (`engine/kv/compressed.py`): one entry row per ``rate``
positions, pages of entries in position-aligned tables; allocation, freeing, speculative trim,
prefix-cache reuse and eviction, preemption (free and re-admit), the coordinator's hits and the
layout's bytes per page."""

from __future__ import annotations

import pytest
import torch

from helios.engine.attention import KVCache
from helios.engine.kv.compressed import CompressedPool, entries_per_page, entry_pages
from helios.engine.kv.coordinator import KVCacheCoordinator
from helios.engine.kv.layout import CacheLayout
from helios.models.interface import CompressedSpec, LatentAttentionSpec, SlidingWindowSpec

PS = 4


def _entry_positions(length: int, rate: int) -> list[int]:
    """Positions < ``length`` that complete an entry, the independent definition."""
    return [p for p in range(length) if (p + 1) % rate == 0]


@pytest.mark.parametrize(("rate", "page_size"), [(8, 4), (4, 4), (2, 4), (3, 4), (6, 4), (4, 16), (128, 16)])
def test_geometry_matches_the_entry_positions(rate: int, page_size: int) -> None:
    """Where each entry lives (page index and offset) against the entry positions counted one by one."""
    pool = CompressedPool(64, page_size, rate=rate)
    positions = _entry_positions(40 * page_size, rate)
    per_page: dict[int, list[int]] = {}
    for w, p in enumerate(positions):
        per_page.setdefault(p // page_size, []).append(w)
    for i in range(40):
        assert pool.holds_entry(i) == (i in per_page)
        assert pool.holding(0, i) == sum(1 for j in per_page if j < i)
    assert max(len(v) for v in per_page.values()) <= entries_per_page(page_size, rate)
    assert pool.slots_per_page == entries_per_page(page_size, rate)
    assert entry_pages(40, page_size, rate) == len(per_page)
    assert pool.allocate_slots("a", 0, 40 * page_size) is not None
    table = pool.block_table("a")
    slots = pool.entry_slots("a", len(positions))
    assert len(set(slots)) == len(slots)  # no two entries share a slot
    for w, p in enumerate(positions):  # each in its page, in order
        assert slots[w] // pool.slots_per_page == table[p // page_size]
        assert slots[w] % pool.slots_per_page == per_page[p // page_size].index(w)
    pool.check_integrity()


def test_allocation_takes_pages_only_where_entries_complete() -> None:
    pool = CompressedPool(entry_pages(16, PS, 8), PS, rate=8)  # one entry page per two position pages
    assert pool.num_pages == 8
    null = pool.null_page
    assert pool.allocate_slots("a", 0, 13) == [null, 0, null, 1]  # positions 7 and 15 complete entries
    assert pool.block_table("a") == [null, 0, null, 1]
    assert pool.pages_needed("a", 24) == 1 and pool.pages_needed("a", 17) == 0
    assert pool.allocate_slots("a", 13, 4) == [null]  # index 4: positions 16..19, none
    assert pool.num_free == 6 * 8 // PS  # in position pages
    pool.check_integrity()
    # All or nothing: 6 entry pages are left, so 12 more position pages fit, 14 do not.
    assert pool.can_allocate("b", 12 * PS) and not pool.can_allocate("b", 14 * PS)
    assert pool.allocate_slots("b", 0, 14 * PS) is None and pool.block_table("b") == []
    pool.check_integrity()
    pool.free("a")
    pool.check_integrity()
    assert pool.num_free == 16


def test_trim_releases_lookahead_entry_pages() -> None:
    pool = CompressedPool(8, PS, rate=8)
    null = pool.null_page
    pool.allocate_slots("a", 10, 1, 6)  # speculative lookahead to position 16: indices 0..4
    assert pool.block_table("a") == [null, 0, null, 1, null]
    assert pool.trim("a", 11) == 1  # back to 3 position pages: the entry page of index 3 goes
    assert pool.block_table("a") == [null, 0, null]
    pool.check_integrity()
    assert pool.allocate_slots("a", 11, 5) == [1]  # reused first
    pool.check_integrity()


def test_prefix_reuse_eviction_and_preemption() -> None:
    pool = CompressedPool(4, PS, enable_caching=True, rate=8)
    null = pool.null_page
    tokens = list(range(40))
    pool.allocate_slots("a", 0, 33)
    pool.cache_full_pages("a", tokens, 32)  # 8 full position pages: entry pages at 1, 3, 5, 7
    pool.check_integrity()
    assert pool.num_cached == 4
    hashes = pool.chain(tokens, 9)
    # Index 8 (positions 32..35) completes no entry: this group serves it with a placeholder (the
    # position groups bound the hit); index 9 would need the unregistered entry of position 39.
    assert pool.hit_length(hashes, 9) == 9
    assert pool.hit_length(pool.chain(tokens, 10), 10) == 9
    pages = pool.hit_pages(hashes, 8)
    hashes = hashes[:8]
    assert pages == [null, 0, null, 1, null, 2, null, 3]
    # Preemption: the request gives its pages back (registered ones stay evictable) and is
    # admitted again from its own cached pages.
    pool.free("a")
    pool.check_integrity()
    assert pool.num_free == 4 * 8 // PS and pool.num_cached == 4
    assert pool.can_admit(33, pages)
    pool.allocate_cached("a", pages, hashes, retain_pages=4)
    assert pool.block_table("a") == pages and pool._retained == {0, 1}
    assert pool.allocate_slots("a", 32, 1) == [null]
    pool.check_integrity()
    pool.free("a")
    # Eviction: a new request takes the least recently used entry pages: the chain's tail first,
    # the retained head last; the hit then ends before the first missing entry page.
    pool.allocate_slots("x", 0, 16)  # two entry pages
    pool.check_integrity()
    assert pool.hit_length(hashes, 8) == 5 and pool.num_cached == 2  # index 5 is gone; 4 is a placeholder
    pool.allocate_slots("y", 0, 8)  # one more: only retained pages are left to evict
    assert pool.hit_length(hashes, 8) == 3
    pool.free("x")
    pool.free("y")
    pool.check_integrity()


def test_check_integrity_catches_a_misplaced_page() -> None:
    pool = CompressedPool(4, PS, rate=8)
    pool.allocate_slots("a", 0, 8)
    pool._tables["a"][0], pool._tables["a"][1] = pool._tables["a"][1], pool._tables["a"][0]
    with pytest.raises(AssertionError, match="not where its entries are"):
        pool.check_integrity()


def _v4_like_layout() -> CacheLayout:
    """A sliding group, raw rows per token, and a compressed group of rate 8."""
    return CacheLayout.from_specs([SlidingWindowSpec(1, 4, 6), LatentAttentionSpec(8), CompressedSpec(4, 8)])


def test_coordinator_hits_and_allocates_over_a_compressed_group() -> None:
    layout = _v4_like_layout()
    kv = KVCacheCoordinator(layout, 16, PS, enable_caching=True)
    comp = kv.groups[2]
    assert isinstance(comp, CompressedPool) and comp.num_pages == 8
    tokens = list(range(30))
    kv.allocate_slots("a", 0, 25)
    kv.cache_full_pages("a", tokens, 24)
    kv.check_integrity()
    hits, hashes = kv.lookup(tokens[:26])
    assert len(hits) == 6
    assert [h[2] for h in hits] == comp.block_table("a")[:6]
    kv.allocate_cached("b", hits, hashes)
    assert kv.allocate_slots("b", 24, 2) is not None
    assert comp.block_table("b") == [*comp.block_table("a")[:6], comp.null_page]
    kv.check_integrity()
    # The compressed group alone loses its least recently used entry page (the chain's tail,
    # index 5: positions 20..23): hits now end there, though the other groups have every page.
    kv.free("a")
    kv.free("b")
    comp.allocate_slots("z", 0, 6 * 8)  # six entry pages: the five free ones and one evicted
    hits, _ = kv.lookup(tokens[:26])
    assert len(hits) == 5 and comp.hit_length(hashes, 6) == 5
    comp.free("z")
    kv.check_integrity()
    assert kv.num_free == 16  # every group free: 16 position pages (the compressed one: 8 entry pages * 8 / 4)


def test_layout_bytes_follow_the_rate() -> None:
    layout = _v4_like_layout()
    f32 = torch.float32
    # Per token: the sliding layer's K and V, the raw row, and an eighth of the 4-element entry.
    assert layout.bytes_per_token(f32) == (2 * 4 + 8 + 4 / 8) * 4
    # A page of 4 positions holds half an entry page of one row (rate 8 > page size 4).
    assert layout.bytes_per_page(PS, f32) == (2 * 4 + 8) * 4 * PS + 4 * 4 * 0.5
    assert layout.pages_for(264 * 10, PS, f32) == 10 and layout.pages_for(264 * 10 - 1, PS, f32) == 9
    cache = KVCache.for_layout(layout, 16, PS, f32)
    assert tuple(cache.rows[2].shape) == ((8 + 1) * 1, 4)  # 8 entry pages of one slot, and the spare
    # A rate below the page size: pages of ceil(4 / 3) = 2 entries, one per position page.
    small = CacheLayout.from_specs([LatentAttentionSpec(8), CompressedSpec(4, 3)])
    assert small.bytes_per_page(PS, f32) == 8 * 4 * PS + 2 * 4 * 4
    assert tuple(KVCache.for_layout(small, 16, PS, f32).rows[1].shape) == ((16 + 1) * 2, 4)
    # Host-store bytes of an entry page: its slots' rows.
    cache.rows[2][3] = torch.randn(4)
    data = cache.read_page(3, PS, group=2)
    assert len(data) == 4 * 4
    assert cache.write_page(5, PS, data, group=2) and torch.equal(cache.rows[2][5], cache.rows[2][3])
