"""The data-parallel router's scoring (engine/dp.py's Router), without processes: the longest cached
prefix by the prefix cache's own chain hashes, against the in-flight load; new prompts spread."""

from __future__ import annotations

import pytest

from helios.engine.dp import Candidate, Router
from helios.engine.kv.events import BlockStored, CachedBlocks
from helios.engine.kv.manager import KVCacheManager, chain_hashes

PS = 4
FP = b"model+layout"


def mirror(tokens: list[int], pages: int, *, skip: int | None = None) -> CachedBlocks:
    hashes = chain_hashes(tokens, pages, page_size=PS, fingerprint=FP)
    m = CachedBlocks()
    m.apply([BlockStored(tuple(h for i, h in enumerate(hashes) if i != skip), None, (), PS)])
    return m


def router(policy: str = "cache_aware", weight: int = 8, threshold: float = 0.25) -> Router:
    return Router(policy, page_size=PS, fingerprint=FP, load_weight_tokens=weight, cache_threshold=threshold)


PROMPT = list(range(1000, 1017))  # 17 tokens: 4 full pages before the last token


def test_longest_cached_prefix_wins() -> None:
    r = router()
    ranks = [Candidate(0, mirror(PROMPT, 2), 0), Candidate(1, mirror(PROMPT, 4), 0), Candidate(2, CachedBlocks(), 0)]
    assert r.cached_pages(PROMPT, ranks) == [2, 4, 0]
    choice = r.choose(PROMPT, ranks)
    assert (choice.rank, choice.hit_tokens) == (1, 16)


def test_hits_stop_at_the_first_missing_page_and_never_cover_the_last_token() -> None:
    r = router()
    exact = list(range(16))  # 4 full pages: the last page holds the last token, so 3 count
    ranks = [Candidate(0, mirror(PROMPT, 4, skip=1), 0), Candidate(1, mirror(exact, 4), 0)]
    assert r.cached_pages(PROMPT, ranks[:1]) == [1]
    assert r.cached_pages(exact, ranks[1:]) == [3]


def test_the_hash_is_the_managers() -> None:
    m = KVCacheManager(8, PS, enable_caching=True, fingerprint=FP)
    m.events = []
    assert m.allocate_slots("a", 0, 17) is not None
    m.cache_full_pages("a", PROMPT, 17)
    cached = CachedBlocks()
    cached.apply(m.events)
    assert router().cached_pages(PROMPT, [Candidate(0, cached, 0)]) == [4]


def test_load_outweighs_a_short_prefix() -> None:
    r = router(weight=8)
    # rank 0: 16 cached tokens but 3 in flight (16 - 24 < 0); rank 1: nothing cached, idle.
    ranks = [Candidate(0, mirror(PROMPT, 4), 3), Candidate(1, mirror(PROMPT, 1), 0)]
    assert r.choose(PROMPT, ranks).rank == 1
    # One in flight: 16 - 8 = 8 beats 4 - 0.
    ranks = [Candidate(0, mirror(PROMPT, 4), 1), Candidate(1, mirror(PROMPT, 1), 0)]
    assert r.choose(PROMPT, ranks).rank == 0


def test_below_the_threshold_the_least_loaded_rank_takes_it_and_new_prompts_spread() -> None:
    r = router(threshold=0.5)
    # 1 page of 17 tokens cached on rank 0 is below half the prompt: least loaded wins.
    ranks = [Candidate(0, mirror(PROMPT, 1), 0), Candidate(1, CachedBlocks(), 1)]
    assert r.choose(PROMPT, ranks).rank == 0  # fewer in flight
    # Equal load: the rank with fewer cached pages (a new conversation goes where the cache is emptier).
    other = list(range(5000, 5040))
    ranks = [Candidate(0, mirror(PROMPT, 4), 0), Candidate(1, CachedBlocks(), 0)]
    assert r.choose(other, ranks).rank == 1
    # Nothing cached anywhere, equal load: in turn.
    empty = [Candidate(0, CachedBlocks(), 0), Candidate(1, CachedBlocks(), 0)]
    picks = {r.choose(other, empty).rank for _ in range(4)}
    assert picks == {0, 1}


def test_round_robin_ignores_the_cache() -> None:
    r = router("round_robin")
    ranks = [Candidate(0, mirror(PROMPT, 4), 0), Candidate(1, CachedBlocks(), 0)]
    picks = [r.choose(PROMPT, ranks) for _ in range(4)]
    assert [p.rank for p in picks] == [0, 1, 0, 1]
    assert [p.hit_tokens for p in picks] == [16, 0, 16, 0]  # the hits it would have had


def test_unknown_policy_and_no_rank() -> None:
    with pytest.raises(ValueError):
        router("random")
    with pytest.raises(ValueError):
        router().choose(PROMPT, [])
