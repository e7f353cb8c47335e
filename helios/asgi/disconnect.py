"""Client-disconnect watching: the sibling task of every response producer.

Usage (one nursery per request; the producer's ``finally`` aborts the engine children)::

    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_disconnect, receive, scope)
            await produce_response()
            nursery.cancel_scope.cancel()  # stop watching once the response is complete

Call it only after the request body has been read: it consumes ``receive()``.
"""

from __future__ import annotations

import trio

from helios.asgi.types import Receive


async def watch_disconnect(receive: Receive, cancel_scope: trio.CancelScope) -> None:
    """Await ``receive()`` until ``http.disconnect``, then cancel ``cancel_scope`` and return.

    Other messages (stray ``http.request`` chunks) are ignored.
    """
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            cancel_scope.cancel()
            return
