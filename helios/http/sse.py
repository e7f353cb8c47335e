"""The SSE stream a streamed response writes to: headers on `start()` (the drivers call it right
after enqueue), one event per `StreamEvent`, and a keepalive comment after every 15 s without an
event while the stream is open (the spec's keepalive during long waits); a lock keeps a keepalive
from interleaving with an event. It is the ASGI `SSEWriter` (asgi.responses) with those additions."""

from __future__ import annotations

from collections.abc import Iterable

import trio

from helios.asgi.responses import Header, SSEWriter
from helios.asgi.types import Send
from helios.domain.generation import StreamEvent
from helios.obs import access


class EventStream(SSEWriter):
    KEEPALIVE_S = 15.0

    def __init__(self, send: Send, headers: Iterable[Header] = ()) -> None:
        super().__init__(send)
        self._headers = list(headers)
        self._lock = trio.Lock()
        self._last = trio.current_time()

    async def start(self, headers: Iterable[Header] = (), status: int = 200) -> None:
        """Send the response's start (the stream's headers, then `headers`) unless it went out."""
        async with self._lock:
            if not self.started:
                await super().start([*self._headers, *headers], status)
                self._last = trio.current_time()

    async def send(self, event: StreamEvent) -> None:
        data = event.data  # written once, here
        access.note_stream_event(data, event.event)  # a terminal error event is the access log's `error=`
        await self.start()
        async with self._lock:
            await self.event(data, event.event)
            self._last = trio.current_time()

    async def close(self) -> None:
        async with self._lock:
            if self.started and not self.closed:
                await super().close()

    async def keepalive(self) -> None:
        while not self.closed:
            await trio.sleep_until(self._last + self.KEEPALIVE_S)
            if trio.current_time() - self._last < self.KEEPALIVE_S:
                continue  # an event went out meanwhile
            async with self._lock:
                if self.started and not self.closed:
                    await self.comment("keepalive")
                self._last = trio.current_time()
