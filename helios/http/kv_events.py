"""GET /v1/kv_events: the engine's KV events as server-sent events (docs/parallel.md).

One ``data:`` line per `KVEventBatch` in vLLM's JSON field names (`engine/kv/events.py`), from the
moment of connecting (no replay of what was cached before), a keepalive comment every 15 s without
a batch (the `EventStream`'s); the stream ends when the server starts draining for shutdown.
Authenticated like every /v1 route, and 404 unless ``[parallel] kv_events = true``: the events carry
cached prompts' token ids. A subscriber that falls behind is dropped (its stream ends).
"""

from __future__ import annotations

import trio

from helios.domain.generation import StreamEvent
from helios.engine.kv.events import batch_json
from helios.errors import NotFound
from helios.http.context import RequestContext
from helios.http.dispatch import Route
from helios.http.sse import EventStream
from helios.serving.kv_events import KVEventHub

POLL_S = 0.5  # how often an idle stream looks at the server's drain


async def kv_events(ctx: RequestContext) -> None:
    ctx.auth()
    hub = getattr(ctx.state.runtime, "kv_events", None)
    if not isinstance(hub, KVEventHub):
        raise NotFound("KV events are off on this server; set [parallel] kv_events = true")
    out = EventStream(ctx.send, ctx.headers())
    async with hub.subscribe() as batches:
        ctx.responded = True
        await out.start()

        async def pump() -> None:
            while not ctx.state.draining:  # a shutdown ends the stream (it never blocks the drain)
                with trio.move_on_after(POLL_S) as idle:
                    try:
                        batch = await batches.receive()
                    except trio.EndOfChannel:  # dropped for falling behind
                        return
                if not idle.cancelled_caught:
                    await out.send(StreamEvent(batch_json(batch)))

        await ctx.run_cancellable(pump, out)
        if not ctx.disconnected:
            await out.close()


ROUTES: list[Route] = [
    ("GET", "/v1/kv_events", kv_events),
]
