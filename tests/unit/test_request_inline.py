"""A JSON body under `http.context.INLINE_BODY_BYTES` is parsed and decoded on the event loop's
thread; a larger one on the frontend pool's worker threads (`RequestContext.offload`). A route that
reads no JSON body (multipart, raw bodies) keeps the pool."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import trio

from helios.asgi.request import Request
from helios.config import load_config
from helios.errors import BadRequest
from helios.http.context import INLINE_BODY_BYTES, RequestContext
from helios.http.state import ServerState


def _context(body: bytes) -> RequestContext:
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if delivered:
            return {"type": "http.disconnect"}
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        raise AssertionError("nothing is sent")

    return RequestContext(Request.from_scope(scope), {}, receive, send, ServerState(load_config()), "req-inline")


def _body(size: int) -> bytes:
    """A JSON object of exactly ``size`` bytes."""
    body = json.dumps({"pad": "x" * (size - len(b'{"pad": ""}'))}).encode()
    assert len(body) == size
    return body


@pytest.mark.parametrize(("size", "inline"), [(64, True), (INLINE_BODY_BYTES - 1, True), (INLINE_BODY_BYTES, False),
                                              (256 * 1024, False)])
def test_small_json_bodies_are_worked_on_the_event_loop(size: int, inline: bool) -> None:
    async def main() -> None:
        ctx = _context(_body(size))
        loop = threading.get_ident()
        assert not ctx.inline  # nothing read yet: the pool
        assert await ctx.offload(threading.get_ident) != loop
        obj = await ctx.read_json()
        assert len(obj["pad"]) == size - len(b'{"pad": ""}')
        assert ctx.inline is inline
        assert (await ctx.offload(threading.get_ident) == loop) is inline

    trio.run(main)


def test_inline_work_raises_as_the_pool_does() -> None:
    def refuse(_: object) -> None:
        raise BadRequest("refused", param="x")

    async def main() -> None:
        for size in (64, INLINE_BODY_BYTES * 2):
            ctx = _context(_body(size))
            await ctx.read_json()
            with pytest.raises(BadRequest, match="refused"):
                await ctx.offload(refuse, None)

    trio.run(main)


def test_an_invalid_small_body_is_a_400_either_way() -> None:
    async def main() -> None:
        for body in (b'{"a": ', b'{"a": ' + b" " * INLINE_BODY_BYTES):
            ctx = _context(body)
            with pytest.raises(BadRequest):
                await ctx.read_json()

    trio.run(main)
