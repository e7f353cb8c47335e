"""GET /v1/kv_events: the engine's KV events as server-sent events (docs/parallel.md).

One ``data:`` line per `KVEventBatch` in vLLM's JSON field names (`engine/kv/events.py`), from the
moment of connecting (no replay of what was cached before), a keepalive comment every 15 s without
a batch; the stream ends when the server starts draining for shutdown. Authenticated like every /v1
route, and 404 unless ``[parallel] kv_events = true``: the events carry cached prompts' token ids.
A subscriber that falls behind is dropped (its stream ends).
"""

from __future__ import annotations

import trio

from helios.asgi.responses import SSEWriter
from helios.engine.kv.events import KVEventBatch, batch_json
from helios.errors import NotFound
from helios.http.context import RequestContext
from helios.http.dispatch import Route
from helios.serving.kv_events import KVEventHub

KEEPALIVE_S = 15.0
POLL_S = 0.5  # how often an idle stream looks at the server's drain


async def kv_events(ctx: RequestContext) -> None:
    ctx.auth()
    hub = getattr(ctx.state.runtime, "kv_events", None)
    if not isinstance(hub, KVEventHub):
        raise NotFound("KV events are off on this server; set [parallel] kv_events = true")
    sse = SSEWriter(ctx.send)
    async with hub.subscribe() as batches:
        ctx.responded = True
        await sse.start(ctx.headers())
        gone = False
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                nonlocal gone
                while True:
                    msg = await ctx.receive()
                    if msg.get("type") == "http.disconnect":
                        gone = True
                        nursery.cancel_scope.cancel()
                        return

            nursery.start_soon(watch)
            last = trio.current_time()
            while not ctx.state.draining:  # a shutdown ends the stream (it never blocks the drain)
                batch: KVEventBatch | None = None
                with trio.move_on_after(POLL_S):
                    try:
                        batch = await batches.receive()
                    except trio.EndOfChannel:  # dropped for falling behind
                        break
                now = trio.current_time()
                if batch is not None:
                    await sse.event(batch_json(batch))
                    last = now
                elif now - last >= KEEPALIVE_S:
                    await sse.comment("keepalive")
                    last = now
            nursery.cancel_scope.cancel()
        if not gone:
            await sse.close()


ROUTES: list[Route] = [
    ("GET", "/v1/kv_events", kv_events),
]
