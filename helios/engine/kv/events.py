"""KV cache events: what a page pool's prefix cache gained and lost, for a router outside the engine.

The shape is vLLM's (``vllm/distributed/kv_events.py``), so a router written for vLLM's events reads
Helios's: a ``KVEventBatch`` of ``ts`` (seconds since the epoch), ``events`` and
``data_parallel_rank``; each event tagged by ``type``:

- ``BlockStored``: full pages registered in the prefix cache, as one chain run: ``block_hashes`` (the
  pages' chain hashes, in position order), ``parent_block_hash`` (the chain hash of the page before the
  first one; null at the start of a prompt), ``token_ids`` (every token of those pages, in order),
  ``block_size`` (tokens per page), ``lora_id`` and ``lora_name`` (always null: no adapters),
  ``medium`` (the pool's device kind: "CPU" or "GPU").
- ``BlockRemoved``: registered pages evicted (their hashes no longer hit): ``block_hashes``, ``medium``.
- ``AllBlocksCleared``: the pool's cache is empty (a rank that started or restarted).

Hashes are the 128-bit integers of `kv.manager.chain_hashes` (blake2b-128 over the parent hash, the
model and layout fingerprint and the page's token ids): a router that recomputes them needs the
fingerprint, which `GET /v1/kv_events` does not publish, so an outside router matches on the
published hashes and chains (vLLM's own routers do the same).

The manager collects events only while someone listens (`KVCacheManager.events` is a list, not None):
otherwise the cost is one ``is None`` test per registration and eviction.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs


@attrs.frozen
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None


@attrs.frozen
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None


@attrs.frozen
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@attrs.frozen
class KVEventBatch:
    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


def make_batch(events: Iterable[KVEvent], rank: int | None, ts: float | None = None) -> KVEventBatch:
    return KVEventBatch(time.time() if ts is None else ts, tuple(events), rank)


def event_json(event: KVEvent) -> dict[str, Any]:
    """One event as vLLM's msgspec JSON writes it: its fields plus the ``type`` tag."""
    if isinstance(event, BlockStored):
        return {"type": "BlockStored", "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
                "block_size": event.block_size, "lora_id": None, "medium": event.medium, "lora_name": None}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": event.medium}
    return {"type": "AllBlocksCleared"}


def batch_json(batch: KVEventBatch) -> dict[str, Any]:
    return {"ts": batch.ts, "events": [event_json(e) for e in batch.events],
            "data_parallel_rank": batch.data_parallel_rank}


def event_from_json(obj: Mapping[str, Any]) -> KVEvent:
    """The inverse of `event_json` (an outside router's reader; the tests read the stream with it)."""
    kind = obj.get("type")
    if kind == "BlockStored":
        return BlockStored(tuple(obj["block_hashes"]), obj["parent_block_hash"], tuple(obj["token_ids"]),
                           int(obj["block_size"]), obj.get("medium"))
    if kind == "BlockRemoved":
        return BlockRemoved(tuple(obj["block_hashes"]), obj.get("medium"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event type {kind!r}")


class CachedBlocks:
    """A mirror of one pool's registered chain hashes, kept from its events (the front's router keeps
    one per rank; an outside router would keep the same)."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()

    def __len__(self) -> int:
        return len(self.hashes)

    def apply(self, events: Sequence[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self.hashes.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.hashes.difference_update(event.block_hashes)
            else:
                self.hashes.clear()

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.hashes
