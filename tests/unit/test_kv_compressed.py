"""The compressed group's page pool (`engine/kv/compressed.py`): one entry row per ``rate``
positions, pages of entries in position-aligned tables; allocation, freeing, speculative trim,
prefix-cache reuse and eviction, preemption (free and re-admit), the coordinator's hits and the
layout's bytes per page."""

from __future__ import annotations

import pytest
import torch

from helios.engine.attention import KVCache
from helios.engine.kv.compressed import CompressedPool, entries_per_page, entry_pages
from helios.engine.kv.coordinator import KVCacheCoordinator, RowWindowPool
from helios.engine.kv.layout import CacheLayout, step_tokens, window_pool_pages
from helios.models.interface import CompressedSpec, LatentAttentionSpec, RowWindowSpec, SlidingWindowSpec

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


# -- row windows (a compressor's raw rows) ---------------------------------------------------------------


def _prefill(kv: KVCacheCoordinator | RowWindowPool, rid: str, length: int, chunk: int, tokens: list[int],
             held: list[int] | None = None) -> None:
    """What the scheduler does for a prompt of ``length`` (whole-prompt allocation at admission,
    then chunk by chunk: release, materialize, compute, register); ``held`` collects the pool's
    held pages after each chunk."""
    kv.allocate_slots(rid, 0, length)
    done = 0
    while done < length:
        n = min(chunk, length - done)
        kv.allocate_slots(rid, done, length - done)
        assert kv.materialize(rid, done, done + n)
        done += n
        kv.cache_full_pages(rid, tokens, done)
        if held is not None:
            pool = kv if isinstance(kv, RowWindowPool) else next(
                s for s in kv.sliding if isinstance(s, RowWindowPool))
            held.append(pool.num_held())
        kv.check_integrity()


def test_a_lazy_row_window_holds_its_window_and_chunk_only() -> None:
    pool = RowWindowPool(64, PS, enable_caching=True, window=6, lazy=True)
    null = pool.null_page
    assert pool.allocate_slots("a", 0, 40) == [null] * 10  # no page before a step writes there
    assert pool.can_allocate("a", 4000) and pool.num_held() == 0
    assert pool.materialize("a", 0, 7) and pool.block_table("a")[:3] == [0, 1, null]
    assert pool.take_changed("a") == 0 and pool.take_changed("a") is None
    pool.check_integrity()
    held: list[int] = []
    tokens = list(range(200))
    _prefill(pool, "b", 200, 7, tokens, held)
    # Window 6 and chunks of 7: at most (6 - 1) // 4 + 3 pages besides the chunk's own 2.
    assert max(held) <= (6 - 1) // PS + 3 + 2
    table = pool.block_table("b")
    assert table[:-3] == [null] * 47 and null not in table[-3:]  # 200 computed: the pages of 195..199
    pool.free("a")
    pool.free("b")
    pool.check_integrity()


def test_row_window_pool_bound_is_what_the_layout_sizes() -> None:
    """Four requests prefilled in chunks of 5 and decoding, side by side, never need more pages
    than `window_pool_pages` gives four requests (the pool is exactly that large here)."""
    window, active, chunk = 9, 4, 5
    size = window_pool_pages(window, PS, active, step_tokens(chunk, active, 0))
    pool = RowWindowPool(size, PS, window=window, lazy=True)
    lengths = {f"r{i}": 23 + 5 * i for i in range(active)}
    done = dict.fromkeys(lengths, 0)
    for rid, n in lengths.items():
        pool.allocate_slots(rid, 0, n + 1)
    for _ in range(60):  # steps: each request one chunk (prefill) or one token (decode)
        for rid, n in lengths.items():
            length = min(chunk, n - done[rid]) if done[rid] < n else 1
            pool.allocate_slots(rid, done[rid], max(n - done[rid], 0) + length)
            assert pool.materialize(rid, done[rid], done[rid] + length)
            done[rid] += length
        pool.check_integrity()
    assert pool.num_held() <= size - active * -(-window // PS)


def test_check_integrity_catches_a_gap_in_a_row_window() -> None:
    pool = RowWindowPool(8, PS, window=4, lazy=True)
    pool.allocate_slots("a", 0, 12)
    pool.materialize("a", 0, 12)
    pool._drop(pool._tables["a"][1])
    pool._tables["a"][1] = pool.null_page
    with pytest.raises(AssertionError, match="placeholder between"):
        pool.check_integrity()


def _raw_and_entries(step: int = 8) -> KVCacheCoordinator:
    """An HCA-like layer of rate 8: raw rows for a window of 8, its entries; two running requests."""
    layout = CacheLayout.from_specs([RowWindowSpec(8, 8), CompressedSpec(4, 8)])
    return KVCacheCoordinator(layout, 32, PS, enable_caching=True, max_active=2, step_tokens=step)


def test_a_hit_inside_a_window_needs_the_window_raw_rows() -> None:
    """Hits need the entries before them and the raw rows of their window (8 positions): an
    18-page hit (72 positions) the raw rows of 65..71 (pages 16, 17) and the entries 0..8. The raw
    pages stay cached after the request ends; as another request takes them, hits shorten to
    where the window's raw rows are still registered, including to one that ends inside a window."""
    kv = _raw_and_entries()
    raw, entries = kv.sliding[0], kv.groups[1]
    assert isinstance(raw, RowWindowPool) and raw.lazy and isinstance(entries, CompressedPool)
    tokens = list(range(100))
    _prefill(kv, "a", 80, 8, tokens)
    kv.free("a")
    kv.check_integrity()
    hits, hashes = kv.lookup(tokens[:73])
    assert len(hits) == 18
    assert [h[0] for h in hits[:15]] == [raw.null_page] * 15  # positions before 65: not needed
    assert [h[1] for h in hits] == [entries._cached[hashes[i]] if i % 2 else entries.null_page for i in range(18)]
    kv.allocate_cached("b", hits, hashes)
    kv.allocate_slots("b", 72, 1)
    assert kv.materialize("b", 72, 73)
    kv.check_integrity()
    kv.free("b")
    # Another request takes raw pages: the free one, then cached ones, least recently used first
    # (positions 28..63, then 76..79, 72..75, 68..71: "b" used 64..71 last).
    hashes = kv.primary.chain(tokens, 20)

    takers: list[str] = []

    def take(n: int) -> None:  # a request of its own writing n pages at once (so none is released)
        rid = f"x{len(takers)}"
        takers.append(rid)
        raw.allocate_slots(rid, 0, n * PS)
        assert raw.materialize(rid, 0, n * PS)

    assert len(kv.lookup(tokens[:81])[0]) == 20  # 80 positions: entries 0..9, raw rows 73..79
    take(11)
    # Positions 76..79 are gone: the 20-page hit is shortened to 19 pages (76 positions, inside
    # the window of entry 9), whose raw rows 69..75 (pages 17, 18) are still cached.
    assert hashes[19] not in raw._cached and len(kv.lookup(tokens[:81])[0]) == 19
    take(1)  # 72..75 gone: 18 pages (a window boundary), raw rows 65..71
    assert len(kv.lookup(tokens[:81])[0]) == 18
    take(1)  # 68..71 gone: every shorter hit's window is gone too
    assert kv.lookup(tokens[:81])[0] == []
    assert all(h in entries._cached for h in hashes[1:20:2])  # the entries are all still there
    for rid in takers:
        raw.free(rid)
    kv.check_integrity()


def test_preemption_frees_a_lazy_window_and_readmits() -> None:
    kv = _raw_and_entries()
    tokens = list(range(60))
    kv.allocate_slots("a", 0, 41)
    assert kv.materialize("a", 0, 20)
    kv.cache_full_pages("a", tokens, 20)
    kv.free("a")  # preempted: recomputed from its cached prefix
    kv.check_integrity()
    hits, hashes = kv.lookup(tokens[:41])
    assert len(hits) == 5  # pages of 0..19: the raw window of position 20 (13..19) is cached
    kv.allocate_cached("a", hits, hashes)
    kv.allocate_slots("a", 20, 21)
    assert kv.materialize("a", 20, 28)
    assert kv.take_changed("a") == 5
    kv.check_integrity()
    kv.free("a")
    kv.check_integrity()


# -- DeepSeek V4's accounting ------------------------------------------------------------------------------


def test_deepseek_v4_per_token_bytes_follow_the_compressed_sizes() -> None:
    """transformers' default DeepSeek V4 config (43 layers: 23 HCA, 20 CSA; head_dim 512,
    index_head_dim 128, rates 4 / 128, window 128) in bfloat16: per token, the entries only
    (512 / 128 and (512 + 128) / 4 elements), the raw rows a fixed pool for the running requests;
    a 2 GiB budget then holds 27x the tokens of one full row per token."""
    from helios.models.deepseek_v4 import CSA, HCA, cache_specs, config_from_hf

    cfg = config_from_hf({})
    assert (cfg.layer_types.count(HCA), cfg.layer_types.count(CSA)) == (23, 20)
    layout = CacheLayout.from_specs(cache_specs(cfg))
    bf16, ps = torch.bfloat16, 16
    entries = {g.spec: g for g in layout.paged_groups if isinstance(g.spec, CompressedSpec)}
    assert set(entries) == {CompressedSpec(512, 128), CompressedSpec(640, 4)}
    steps = step_tokens(512, 8, 0)
    per_token = 23 * 512 * 2 / 128 + 20 * 640 * 2 / 4
    assert layout.bytes_per_token(bf16, step_tokens=steps) == per_token == 6584
    assert layout.bytes_per_page(ps, bf16, step_tokens=steps) == per_token * ps
    raw = {g.spec: len(g.layers) for g in layout.bounded(steps)}
    assert raw == {RowWindowSpec(3 * 512, 128): 23, RowWindowSpec(5 * 512 + 4 * 128, 128): 20}
    # Unbounded (no running-request bound), the raw rows count per token as before the entries moved.
    assert layout.bytes_per_token(bf16) == per_token + (23 * 3 * 512 + 20 * (5 * 512 + 4 * 128)) * 2
    # Before: one row per token of every compressed layer (HCA 4 x 512, CSA 6 x 512 + 5 x 128).
    before = (23 * 4 * 512 + 20 * (6 * 512 + 5 * 128)) * 2
    gib2 = 2 * 2**30
    pages = layout.pages_for(gib2, ps, bf16, max_active=8, step_tokens=steps)
    # 8 requests x (127 // 16 + 3) pages, 512 / 16 for the step, 8 x 8 cached: 176 pages + the spare.
    pool = window_pool_pages(128, ps, 8, steps)
    assert pool == 176
    raw_bytes = sum((pool + 1) * ps * spec.row_dim * 2 * n for spec, n in raw.items())
    assert raw_bytes == layout.bounded_bytes(ps, bf16, max_active=8, step_tokens=steps)
    assert pages == int((gib2 - raw_bytes) // (per_token * ps))
    assert gib2 // before == 8848 and pages * ps // (gib2 // before) >= 27
    # What the engine's storage takes for those pages fits the budget.
    entry_bytes = sum((g.num_pages(pages, ps) + 1) * -(-ps // g.spec.rate) * g.spec.row_dim * 2 * len(g.layers)
                      for g in entries.values())
    assert raw_bytes + entry_bytes <= gib2 + 2 * 640 * 2 * 20 * 4
