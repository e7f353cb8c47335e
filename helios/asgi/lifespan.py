"""ASGI lifespan: start-up and shutdown around the server's lifetime.

The lifespan call runs for the whole life of the server, so an async context manager fits it
best: it can own a nursery (engine wake-ups, metric sampling) that lives until shutdown. Plain
start-up/shutdown callbacks are offered on top of it.
"""

from __future__ import annotations

import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from helios.asgi.types import Receive, Send

LifespanContext = Callable[[], AbstractAsyncContextManager[None]]


async def run_lifespan(receive: Receive, send: Send, lifespan: LifespanContext) -> None:
    """Serve one ``lifespan`` scope: enter ``lifespan()`` at start-up, leave it at shutdown.

    A start-up failure is reported as ``lifespan.startup.failed`` and re-raised (the server then
    refuses to start); a shutdown failure as ``lifespan.shutdown.failed``, also re-raised.
    Cancellation is never caught.
    """
    message = await receive()
    if message.get("type") != "lifespan.startup":
        return
    context = lifespan()
    try:
        await context.__aenter__()
    except Exception as exc:
        await send({"type": "lifespan.startup.failed", "message": _describe(exc)})
        raise
    await send({"type": "lifespan.startup.complete"})
    try:
        while (await receive()).get("type") != "lifespan.shutdown":
            pass
    except BaseException as exc:
        # Cancelled while waiting (the server is going away without a shutdown message).
        if not await context.__aexit__(type(exc), exc, exc.__traceback__):
            raise
        return
    try:
        await context.__aexit__(None, None, None)
    except Exception as exc:
        await send({"type": "lifespan.shutdown.failed", "message": _describe(exc)})
        raise
    await send({"type": "lifespan.shutdown.complete"})


async def run_lifespan_callbacks(
    receive: Receive,
    send: Send,
    startup: Callable[[], Awaitable[None]] | None = None,
    shutdown: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """The same protocol with separate start-up and shutdown callbacks."""

    @asynccontextmanager
    async def context() -> AsyncIterator[None]:
        if startup is not None:
            await startup()
        yield
        if shutdown is not None:
            await shutdown()

    await run_lifespan(receive, send, context)


def _describe(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(exc)).strip()
