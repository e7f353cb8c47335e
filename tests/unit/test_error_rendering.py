"""Error rendering can never itself fail (issue 17): an error message that echoes request text with a
lone surrogate, or a body that cannot be serialized, still ends in a JSON body in the path's protocol
shape with an x-request-id; before, the encoder's exception escaped and hypercorn sent a bare 500."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from helios.config import HeliosConfig
from helios.errors import BadRequest, HeliosError, NotFound
from helios.http.context import RequestContext
from helios.http.dispatch import Dispatcher
from helios.http.state import ServerState


def call(handler: Any, path: str) -> tuple[int, dict[bytes, bytes], Any]:
    """One request through the real Dispatcher with `handler` as the route; the response as sent."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    config = HeliosConfig()
    dispatcher = Dispatcher(ServerState(config), [("POST", path, handler)])
    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "http_version": "1.1"}
    trio.run(dispatcher, scope, receive, send)
    start, body = sent[0], sent[1]
    assert start["type"] == "http.response.start" and body["type"] == "http.response.body"
    return start["status"], dict(start["headers"]), json.loads(body["body"].decode("utf-8"))


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/api/show"])
def test_an_echoed_lone_surrogate_renders(path: str) -> None:
    async def handler(ctx: RequestContext) -> None:
        raise NotFound("The model '\ud800x' does not exist", param="model\udc00")

    status, headers, body = call(handler, path)
    assert status == 404 and headers[b"x-request-id"].startswith(b"req-")
    text = json.dumps(body, ensure_ascii=False)
    assert "\ufffd" in text and "x' does not exist" in text


def test_an_unserializable_error_body_becomes_a_500_in_the_protocols_shape() -> None:
    class Broken(HeliosError):
        status = 400

        def to_anthropic(self) -> dict[str, Any]:
            return {"type": "error", "error": {"type": "invalid_request_error", "message": float("nan")}}

    async def handler(ctx: RequestContext) -> None:
        raise Broken("cannot be written")

    status, headers, body = call(handler, "/v1/messages")
    assert status == 500 and headers[b"x-request-id"].startswith(b"req-")
    assert body["type"] == "error" and body["error"]["type"] == "api_error"


def test_messages_and_params_are_always_utf8() -> None:
    exc = BadRequest("bad \ud800 value é", param="a\udfff")
    exc.message.encode("utf-8")
    assert exc.param is not None
    exc.param.encode("utf-8")
    assert exc.message.endswith("value é")


class BrokenEncoder:
    """An encoder whose failure events cannot be serialized (as a Responses echo of a lone surrogate
    could not be before decode refused them)."""

    def fail(self, error: HeliosError) -> list[Any]:
        from helios.domain.generation import StreamEvent

        return [StreamEvent({"type": "response.failed", "response": {"metadata": {"k": float("nan")}}},
                            "response.failed")]


@pytest.mark.parametrize(("path", "shape"), [("/v1/responses", '"type":"error"'), ("/v1/messages", '"api_error"'),
                                             ("/v1/chat/completions", '"server_error"')])
def test_a_started_stream_always_ends_with_a_terminal_error_in_its_protocols_shape(path: str, shape: str) -> None:
    from helios.errors import InternalError
    from helios.http.sse import EventStream

    async def handler(ctx: RequestContext) -> None:
        ctx.stream = EventStream(ctx.send, ctx.headers())
        ctx.encoder = BrokenEncoder()  # type: ignore[assignment]
        await ctx.stream.start()
        raise InternalError("the generation failed")

    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    dispatcher = Dispatcher(ServerState(HeliosConfig()), [("POST", path, handler)])
    trio.run(dispatcher, {"type": "http", "method": "POST", "path": path, "headers": []}, receive, send)
    assert sent[0]["status"] == 200
    text = b"".join(m.get("body", b"") for m in sent[1:]).decode()
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}  # closed
    assert "response.failed" not in text and shape in text, text
    if path != "/v1/chat/completions":
        assert "event: error" in text
