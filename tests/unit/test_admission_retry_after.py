"""The 429 the app sends for exhausted HTTP admission slots carries `Retry-After` (spec: transport
and admission; issue 10). Driven through the real ASGI app and its `Ctx.admit`, with no model: a
test route only asks for admission, and the pool is filled beforehand."""

from __future__ import annotations

import json
from typing import Any

import trio

from helios.app import HeliosApp
from helios.config import HeliosConfig, ServerConfig
from helios.http.context import RequestContext as Ctx


def _call(app: HeliosApp, path: str) -> tuple[int, dict[bytes, bytes], Any]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    path, _, query = path.partition("?")
    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "query_string": query.encode()}
    trio.run(app, scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), json.loads(body) if body else None


def _app() -> HeliosApp:
    app = HeliosApp(HeliosConfig(server=ServerConfig(max_concurrency=2, access_log=False)))
    admitted: list[int] = []

    async def take(ctx: Ctx) -> None:
        ctx.admit(int(ctx.req.query.get("n", ["1"])[0]))
        admitted.append(ctx.slots)
        await ctx.json({"ok": True})

    app.router.add("POST", "/test/admit", take)
    return app


def test_exhausted_slots_429_carries_retry_after() -> None:
    app = _app()
    assert app.slots.try_acquire(2)  # every slot held by other requests
    status, headers, body = _call(app, "/test/admit")
    assert status == 429
    assert headers[b"retry-after"] == b"1"
    assert body["error"]["type"] == "rate_limit_error"
    assert app.slots.in_use == 2  # the refused request took nothing


def test_partial_pool_refuses_group_with_retry_after_and_admits_when_free() -> None:
    app = _app()
    assert app.slots.try_acquire(1)
    status, headers, _ = _call(app, "/test/admit?n=2")  # two choices, one slot free: no partial grant
    assert status == 429 and headers[b"retry-after"] == b"1"
    app.slots.release(1)
    status, headers, body = _call(app, "/test/admit?n=2")
    assert status == 200 and body == {"ok": True} and b"retry-after" not in headers
    assert app.slots.in_use == 0  # released once the response was delivered


def test_oversized_group_is_400_without_retry_after() -> None:
    status, headers, body = _call(_app(), "/test/admit?n=3")
    assert status == 400 and b"retry-after" not in headers
    assert body["error"]["type"] == "invalid_request_error"
