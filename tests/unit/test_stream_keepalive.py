"""SSE keepalive comments during long waits, never interleaved with events."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from helios.domain.generation import StreamEvent
from helios.http.sse import EventStream


class Sent:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def __call__(self, message: dict[str, Any]) -> None:
        self.sent.append(message)


def test_keepalive_comments_only_after_quiet_periods() -> None:
    async def main() -> list[bytes]:
        ctx = Sent()
        out = EventStream(ctx, [(b"x-request-id", b"req-1")])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(out.keepalive)
            await trio.sleep(40)  # nothing started yet: no comment before the headers
            await out.start()
            await trio.sleep(16)  # one quiet period → one comment
            await out.send(StreamEvent({"a": 1}))
            await trio.sleep(10)  # an event went out recently → no comment
            await out.send(StreamEvent({"b": 2}))
            await out.close()
        return [m.get("body", b"") for m in ctx.sent if m["type"] == "http.response.body"]

    bodies = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert bodies[0].startswith(b":") and b"keepalive" in bodies[0]
    assert bodies[1].startswith(b"data: {")
    assert sum(1 for b in bodies if b.startswith(b":")) == 1
