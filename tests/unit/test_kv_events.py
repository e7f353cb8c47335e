"""KV events (engine/kv/events.py): what the manager reports when its prefix cache gains and loses
pages, in vLLM's KVEventBatch field names; the mirror a router keeps from them."""

from __future__ import annotations

import json

from helios.engine.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CachedBlocks,
    batch_json,
    event_from_json,
    event_json,
    make_batch,
)
from helios.engine.kv.manager import KVCacheManager, chain_hashes

PS = 4
FP = b"fingerprint"


def manager(num_pages: int = 8, *, events: bool = True) -> KVCacheManager:
    m = KVCacheManager(num_pages, PS, enable_caching=True, fingerprint=FP)
    if events:
        m.events = []
    return m


def test_full_pages_stored_as_one_chain_run_then_extended() -> None:
    m = manager()
    tokens = list(range(100, 114))  # 3 full pages and 2 tokens
    assert m.allocate_slots("a", 0, 10) is not None
    m.cache_full_pages("a", tokens, 10)
    hashes = chain_hashes(tokens, 3, page_size=PS, fingerprint=FP)
    assert m.events == [BlockStored(tuple(hashes[:2]), None, tuple(tokens[:8]), PS, "CPU")]
    # The manager's own lookup hashes the same way (one implementation).
    assert m.chain(tokens, 3) == hashes
    m.events.clear()
    assert m.allocate_slots("a", 10, 4) is not None
    m.cache_full_pages("a", tokens, 14)
    assert m.events == [BlockStored((hashes[2],), hashes[1], tuple(tokens[8:12]), PS, "CPU")]
    m.check_integrity()


def test_a_page_already_registered_elsewhere_is_not_stored_again() -> None:
    m = manager()
    tokens = list(range(8))
    for rid in ("a", "b"):  # two requests computing the same two pages, neither a hit
        assert m.allocate_slots(rid, 0, 8) is not None
    m.cache_full_pages("a", tokens, 8)
    m.cache_full_pages("b", tokens, 8)
    assert len(m.events or []) == 1 and isinstance(m.events[0], BlockStored)
    m.check_integrity()


def test_eviction_removes_what_was_stored() -> None:
    m = manager(num_pages=4)
    tokens = list(range(16))
    assert m.allocate_slots("a", 0, 16) is not None
    m.cache_full_pages("a", tokens, 16)
    stored = m.events[0]
    assert isinstance(stored, BlockStored) and len(stored.block_hashes) == 4
    m.free("a")  # freeing keeps the pages cached (evictable): no event
    assert len(m.events) == 1
    assert m.allocate_slots("b", 0, 8) is not None  # takes two evictable pages: the chain's tail first
    removed = m.events[1:]
    assert all(isinstance(e, BlockRemoved) for e in removed) and len(removed) == 2
    gone = {h for e in removed for h in e.block_hashes}
    assert gone == set(stored.block_hashes[2:])
    mirror = CachedBlocks()
    mirror.apply(m.events)
    assert mirror.hashes == set(stored.block_hashes[:2])
    m.check_integrity()


def test_host_restore_registration_is_stored_with_its_parent() -> None:
    m = manager()
    tokens = list(range(12))
    hashes = chain_hashes(tokens, 2, page_size=PS, fingerprint=FP)
    m.allocate_cached("r", [], list(hashes))
    for j, h in enumerate(hashes):
        new = m.allocate_slots("r", j * PS, PS)
        assert new is not None
        m.register("r", new[0], h, tokens)
    assert m.events == [BlockStored((hashes[0],), None, tuple(tokens[:4]), PS, "CPU"),
                        BlockStored((hashes[1],), hashes[0], tuple(tokens[4:8]), PS, "CPU")]
    m.check_integrity()


def test_nothing_is_collected_without_a_listener() -> None:
    m = manager(events=False)
    assert m.allocate_slots("a", 0, 16) is not None
    m.cache_full_pages("a", list(range(16)), 16)
    m.free("a")
    assert m.allocate_slots("b", 0, 32) is not None
    assert m.events is None
    m.check_integrity()


def test_json_shape_has_vllm_field_names_and_round_trips() -> None:
    stored = BlockStored((1, 2), None, tuple(range(8)), 4, "CPU")
    removed = BlockRemoved((2,), "CPU")
    batch = make_batch([stored, removed, AllBlocksCleared()], rank=1, ts=12.5)
    obj = json.loads(json.dumps(batch_json(batch)))
    assert set(obj) == {"ts", "events", "data_parallel_rank"}
    assert obj["ts"] == 12.5 and obj["data_parallel_rank"] == 1
    assert obj["events"][0] == {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
                                "token_ids": list(range(8)), "block_size": 4, "lora_id": None, "medium": "CPU",
                                "lora_name": None}
    assert obj["events"][1] == {"type": "BlockRemoved", "block_hashes": [2], "medium": "CPU"}
    assert obj["events"][2] == {"type": "AllBlocksCleared"}
    assert [event_from_json(e) for e in obj["events"]] == list(batch.events)
    assert event_json(stored)["type"] == "BlockStored"


def test_mirror_clears_on_all_blocks_cleared() -> None:
    mirror = CachedBlocks()
    mirror.apply([BlockStored((1, 2, 3), None, tuple(range(12)), 4)])
    assert 2 in mirror and len(mirror) == 3
    mirror.apply([BlockRemoved((2,))])
    assert 2 not in mirror and len(mirror) == 2
    mirror.apply([AllBlocksCleared()])
    assert len(mirror) == 0
