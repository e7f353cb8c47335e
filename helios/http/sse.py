"""The SSE stream a streamed response writes to: headers on `start()` (the drivers call it right
after enqueue), one event per `StreamEvent`, and a keepalive comment after every 15 s without an
event while the stream is open (the spec's keepalive during long waits); a lock keeps a keepalive
from interleaving with an event."""

from __future__ import annotations

from collections.abc import Iterable

import trio

from helios.asgi.responses import SSEWriter
from helios.asgi.types import Send
from helios.domain.generation import StreamEvent
from helios.obs import access

Header = tuple[bytes, bytes]


class EventStream:
    KEEPALIVE_S = 15.0

    def __init__(self, send: Send, headers: Iterable[Header] = ()) -> None:
        self.sse = SSEWriter(send)
        self._headers = list(headers)
        self._lock = trio.Lock()
        self._last = trio.current_time()

    @property
    def started(self) -> bool:
        return self.sse.started

    @property
    def closed(self) -> bool:
        return self.sse.closed

    async def start(self) -> None:
        async with self._lock:
            if not self.sse.started:
                await self.sse.start(self._headers)
                self._last = trio.current_time()

    async def send(self, event: StreamEvent) -> None:
        data = event.data  # written once, here
        access.note_stream_event(data, event.event)  # a terminal error event is the access log's `error=`
        await self.start()
        async with self._lock:
            await self.sse.event(data, event.event)
            self._last = trio.current_time()

    async def close(self) -> None:
        async with self._lock:
            if self.sse.started and not self.sse.closed:
                await self.sse.close()

    async def keepalive(self) -> None:
        while not self.sse.closed:
            await trio.sleep_until(self._last + self.KEEPALIVE_S)
            if trio.current_time() - self._last < self.KEEPALIVE_S:
                continue  # an event went out meanwhile
            async with self._lock:
                if self.sse.started and not self.sse.closed:
                    await self.sse.comment("keepalive")
                self._last = trio.current_time()
