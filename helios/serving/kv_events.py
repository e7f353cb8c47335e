"""KV event fan-out to `GET /v1/kv_events` subscribers (docs/parallel.md).

`publish(rank, events)` is called from engine-side threads (the engine thread, or a data-parallel
reader thread); it hops onto trio with one `run_sync_soon` and puts the batch into every
subscriber's bounded channel. A subscriber that falls `BUFFER` batches behind is dropped (its
stream ends; it reconnects and starts over, as a router must after a gap). With no subscriber,
nothing crosses to trio at all.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

import trio

from helios.engine.kv.events import KVEvent, KVEventBatch, make_batch

log = logging.getLogger("helios.serving")


class KVEventHub:
    BUFFER = 1024

    def __init__(self, rank: int | None = None) -> None:
        """``rank``: the data-parallel rank batches name when the publisher does not (external mode)."""
        self.rank = rank
        self._token: trio.lowlevel.TrioToken | None = None
        self._subscribers: set[trio.MemorySendChannel[KVEventBatch]] = set()
        self.dropped_subscribers = 0

    def attach(self, token: trio.lowlevel.TrioToken) -> None:
        self._token = token

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def publish(self, rank: int | None, events: Sequence[KVEvent]) -> None:
        """Any thread. ``rank`` None: this hub's own rank."""
        token = self._token
        if token is None or not self._subscribers or not events:
            return
        batch = make_batch(events, self.rank if rank is None else rank)
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(self._deliver, batch)

    def _deliver(self, batch: KVEventBatch) -> None:
        for ch in list(self._subscribers):
            try:
                ch.send_nowait(batch)
            except trio.WouldBlock:
                log.warning("a KV event subscriber fell %d batches behind; dropping it", self.BUFFER)
                self._subscribers.discard(ch)
                self.dropped_subscribers += 1
                ch.close()
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                self._subscribers.discard(ch)

    @contextlib.asynccontextmanager
    async def subscribe(self) -> AsyncIterator[trio.MemoryReceiveChannel[KVEventBatch]]:
        send, recv = trio.open_memory_channel[KVEventBatch](self.BUFFER)
        self._subscribers.add(send)
        try:
            yield recv
        finally:
            self._subscribers.discard(send)
            send.close()
