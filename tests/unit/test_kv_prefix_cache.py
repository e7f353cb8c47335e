"""The KV cache manager's prefix cache: hash chains, lookup, reuse, LRU eviction into the host
store's hook, and integrity under random use (exact page bookkeeping; numerics are in the engine
tests)."""

from __future__ import annotations

import random

import pytest

from helios.engine.kv.manager import KVCacheManager


def kv(num_pages: int = 8, page_size: int = 4, **kw: object) -> KVCacheManager:
    return KVCacheManager(num_pages=num_pages, page_size=page_size, enable_caching=True,
                          fingerprint=b"model", **kw)  # type: ignore[arg-type]


def run(m: KVCacheManager, rid: str, tokens: list[int]) -> list[int]:
    """Admit `tokens` the way the scheduler does, compute them all, and return the cached pages hit."""
    pages, hashes = m.lookup(tokens)
    m.allocate_cached(rid, pages, hashes)
    assert m.allocate_slots(rid, len(pages) * m.page_size, len(tokens) - len(pages) * m.page_size) is not None
    m.cache_full_pages(rid, tokens, len(tokens))
    m.check_integrity()
    return pages


def test_the_chain_depends_on_every_earlier_token_and_the_fingerprint() -> None:
    m = kv()
    a = m.chain(list(range(12)), 3)
    b = m.chain([99, *range(1, 12)], 3)
    assert len(set(a)) == 3 and all(x != y for x, y in zip(a, b, strict=True))  # a changed first token changes all
    assert m.chain(list(range(12)), 2, a[0], 1) == a[1:]  # resumable from a parent
    other = KVCacheManager(num_pages=8, page_size=4, enable_caching=True, fingerprint=b"other")
    assert other.chain(list(range(12)), 3) != a


def test_a_repeat_reuses_full_pages_but_computes_the_last_token() -> None:
    m = kv()
    prompt = list(range(10))  # two full pages and two tokens
    assert run(m, "a", prompt) == []
    m.free("a")
    assert run(m, "b", prompt) == [0, 1]  # a's pages, now b's
    m.free("b")
    exact = list(range(8))  # exactly two pages: the last token must still be computed
    assert run(m, "c", exact) == [0]


def test_a_branch_shares_the_common_head_only() -> None:
    m = kv()
    run(m, "a", list(range(12)))
    assert run(m, "b", [*range(6), 50, 51, 52, 53, 54, 55, 56]) == [0]  # page 1 differs at token 6
    assert m.ref_counts[0] == 2


def test_lookup_is_off_when_caching_is() -> None:
    m = KVCacheManager(num_pages=8, page_size=4)
    m.allocate_slots("a", 0, 12)
    m.cache_full_pages("a", list(range(12)), 12)
    m.free("a")
    assert m.lookup(list(range(12))) == ([], []) and m.num_cached == 0
    m.check_integrity()


def test_eviction_takes_free_pages_first_then_the_least_recent_chain_tail() -> None:
    evicted: list[tuple[int, int]] = []
    m = kv(num_pages=6, on_evict=lambda h, p: evicted.append((h, p)))
    run(m, "a", list(range(13)))  # pages 0..3, three full
    m.free("a")
    assert m.num_cached == 3 and m.num_free == 6
    assert m.allocate_slots("x", 0, 5 * 4) is not None  # the 3 free pages (3, 4, 5), then two evictions
    assert [p for _, p in evicted] == [2, 1]  # the chain's tail goes first
    assert m.num_cached == 1 and m.lookup(list(range(13)))[0] == [0]
    m.check_integrity()


def test_a_page_registered_twice_keeps_the_first() -> None:
    m = kv()
    m.allocate_slots("a", 0, 8)
    m.allocate_slots("b", 0, 8)  # the same tokens computed twice, concurrently
    m.cache_full_pages("a", list(range(8)), 8)
    m.cache_full_pages("b", list(range(8)), 8)
    assert m.num_cached == 2 and m.block_table("a") != m.block_table("b")
    m.free("a")
    m.free("b")
    assert m.num_free == 8 and m.num_cached == 2
    m.check_integrity()


@pytest.mark.parametrize("seed", range(30))
def test_random_use_keeps_integrity(seed: int) -> None:
    rng = random.Random(seed)
    m = kv(num_pages=24, page_size=4)
    heads = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    live: dict[str, list[int]] = {}
    for step in range(200):
        if live and (rng.random() < 0.4 or m.num_free < 8):
            rid = rng.choice(sorted(live))
            m.free(rid)
            del live[rid]
        else:
            tokens = rng.choice(heads) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
            pages, hashes = m.lookup(tokens)
            if not m.can_admit(len(tokens) + 1, pages):
                continue
            rid = f"r{step}"
            m.allocate_cached(rid, pages, hashes)
            assert m.allocate_slots(rid, len(pages) * 4, len(tokens) - len(pages) * 4 + 1) is not None
            m.cache_full_pages(rid, tokens, len(tokens))
            live[rid] = tokens
            # Every hit page holds exactly the tokens it is registered for.
            expect = m.chain(tokens, len(pages))
            assert [m.block_hash[p] for p in pages] == expect
        m.check_integrity()
    for rid in list(live):
        m.free(rid)
    m.check_integrity()
    assert m.num_free == 24


def test_retained_pages_are_evicted_last() -> None:
    evicted: list[int] = []
    m = kv(num_pages=8, on_evict=lambda h, p: evicted.append(p))
    m.allocate_slots("marked", 0, 12)
    m.cache_full_pages("marked", list(range(12)), 12, retain_pages=2)  # pages 0, 1 before a marker
    m.allocate_slots("plain", 0, 12)
    m.cache_full_pages("plain", list(range(100, 112)), 12)  # pages 3, 4, 5
    m.free("marked")
    m.free("plain")  # freed later: more recently used than the marked chain
    m.check_integrity()
    assert m.allocate_slots("x", 0, 4 * 6) is not None  # 2 free pages, then four evictions
    assert evicted == [2, 5, 4, 3]  # every unmarked page, least recently used first, before a retained one
    assert m.lookup(list(range(13)))[0] == [0, 1]
    m.check_integrity()


def test_anthropic_cache_control_markers_become_breakpoints() -> None:
    from helios.frontends.anthropic.messages import cache_breakpoints

    marked = {"type": "ephemeral"}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "one", "cache_control": marked},
                                     {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "ignored", "cache_control": marked}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "result",
                                      "cache_control": marked}]},
        {"role": "user", "content": "a string has no markers"},
        *({"role": "user", "content": [{"type": "text", "text": f"m{i}", "cache_control": marked}]}
          for i in range(5)),
    ]
    assert cache_breakpoints(messages) == ("one", "result", "m0", "m1")  # the first four on user blocks
