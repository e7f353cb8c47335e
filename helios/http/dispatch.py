"""The HTTP entry: every request gets an access/metrics record and a request context, is routed, and
ends in its handler's response or an error in its protocol's shape (before a stream starts: a JSON
error body with the error's status; after: the protocol's terminal error event)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

from helios.asgi.request import ClientDisconnected, Request
from helios.asgi.responses import JSON_CONTENT_TYPE, dumps, send_bytes
from helios.asgi.routing import Router
from helios.domain.generation import StreamEvent
from helios.errors import BadRequest, HeliosError, InternalError, ServiceUnavailable
from helios.frontends.decisions.systemone import SchemaErrors
from helios.frontends.openai.shapes import ErrorEvent
from helios.http.context import Handler, RequestContext
from helios.http.state import ServerState
from helios.obs import access

log = logging.getLogger("helios")

Route = tuple[str, str, Handler]


class Dispatcher:
    def __init__(self, state: ServerState, routes: Sequence[Route]) -> None:
        self.state = state
        self.router: Router[Handler] = Router()
        for method, path, handler in routes:
            self.router.add(method, path, handler)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        # Every request gets a stats record: the serving metrics count from it, the access log
        # (when on) writes it.
        state = self.state
        stats = access.RequestStats(sink=state.metrics)

        async def logged_send(message: dict[str, Any]) -> None:
            stats.sent(message)
            await send(message)

        async def logged_receive() -> dict[str, Any]:
            message: dict[str, Any] = await receive()
            stats.received(message)
            return message

        token = access.activate(stats)
        try:
            await self._serve(scope, logged_receive, logged_send)
        finally:
            access.deactivate(token)
            state.metrics.finish_request(stats)
            if state.config.server.access_log:
                access.log.info("%s", access.format_line(stats, scope))

    async def serve_websocket(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """A WebSocket handshake: refused with the same 400 an HTTP request gets (`transport_problem`),
        sent as the ASGI WebSocket denial response; a server without that extension closes it (403)."""
        if "websocket.http.response" not in (scope.get("extensions") or {}):
            log.warning("refused a WebSocket connection to %s", scope.get("path", "/"))
            await send({"type": "websocket.close", "code": 1008})
            return

        async def as_denial(message: dict[str, Any]) -> None:
            kind = message.get("type", "")
            if kind.startswith("http.response."):
                message = {**message, "type": "websocket." + kind}
            await send(message)

        await self(scope, receive, as_denial)

    async def _serve(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        req = Request.from_scope(scope)
        method = req.method
        if method == "HEAD":
            # Every GET route answers HEAD with the same status and headers and no body
            # (RFC 9110 9.3.2); Claude Code probes its base URL this way.
            method, send = "GET", _without_body(send)
        ctx = RequestContext(req, {}, receive, send, self.state, "req-" + uuid.uuid4().hex)
        try:
            refused = transport_problem(scope, req)
            if refused is not None:
                log.warning("refused %s %s from %s: %s", req.method, req.path,
                            req.client[0] if req.client else "-", refused.message)
                raise refused
            handler, ctx.params = self.router.match(method, req.path)
            with ctx.cancel_scope:
                await handler(ctx)
            if ctx.cancel_scope.cancelled_caught:  # aborted by a graceful shutdown (drain)
                if ctx.started:
                    return  # the stream could not take its terminal event in time
                raise ServiceUnavailable("the server shut down before the request completed")
        except ClientDisconnected:
            return
        except HeliosError as exc:
            await render_error(ctx, exc)
        except Exception as exc:
            log.exception("unhandled error on %s %s", req.method, req.path)
            await render_error(ctx, InternalError(f"internal error: {type(exc).__name__}"))
        finally:
            self.state.in_flight.pop(id(ctx), None)
            if ctx.slots:
                self.state.slots.release(ctx.slots)


async def render_error(ctx: RequestContext, exc: HeliosError) -> None:
    """An error in the shape of the path's protocol: a JSON body before the response started; on a
    stream that started, the generation encoder's own terminal error events (`Encoder.fail`: the
    drivers write those for failures they see; this covers failures outside them).

    It never fails itself: a body that cannot be built or serialized is replaced by a fixed
    server error in the same shape, so no request ends in a bare 500 without a body."""
    path, stream = ctx.req.path, ctx.stream
    if stream is not None and stream.started:
        if stream.closed:
            return
        try:
            for event in ctx.encoder.fail(exc) if ctx.encoder is not None else [_error_event(path, exc)]:
                await stream.send(event)
        except Exception:
            log.exception("could not end the stream of %s with its encoder's error events", path)
            try:  # the protocol's plain terminal error event, which cannot fail to serialize
                await stream.send(_error_event(path, InternalError("internal error")))
            except Exception:
                log.exception("could not end the stream of %s with an error event", path)
        try:
            await stream.close()
        except Exception:
            log.exception("could not close the stream of %s", path)
        return
    if ctx.responded:
        return
    ctx.responded = True
    status, headers = exc.status, [*ctx.headers(), *exc.headers]
    try:
        body = dumps(_error_body(path, exc)).encode("utf-8")
    except Exception:
        log.exception("could not render a %d error on %s; answering 500", exc.status, path)
        status, headers = 500, ctx.headers()
        body = dumps(_error_body(path, InternalError("internal error: the error could not be rendered")))\
            .encode("utf-8")
    await send_bytes(ctx.send, status, body, JSON_CONTENT_TYPE, headers)


SUPPORTED_HTTP_VERSIONS = frozenset({"1.0", "1.1", "2", "3"})
CLOSE = ((b"connection", b"close"),)


def transport_problem(scope: dict[str, Any], req: Request) -> HeliosError | None:
    """What the transport asks that Helios does not do (spec, Transport: generation is HTTP JSON or
    SSE; WebSockets are unsupported): a 400 in the path's protocol shape, answered before routing.

    - a WebSocket upgrade (answered through the ASGI WebSocket denial response, `serve_websocket`);
    - an HTTP version hypercorn's parser let through but no client speaks (HTTP/9.9): closed after;
    - both Content-Length and Transfer-Encoding (RFC 9112 6.3: possible request smuggling; a server
      may reject it and must close the connection after responding).
    """
    if scope.get("type") == "websocket":
        return BadRequest("WebSocket connections are not supported; generation uses HTTP JSON, or SSE with "
                          "stream: true")
    version = str(scope.get("http_version", "1.1"))
    if version not in SUPPORTED_HTTP_VERSIONS:
        return BadRequest(f"HTTP/{version} is not supported; use HTTP/1.1 or HTTP/2", headers=CLOSE)
    if "transfer-encoding" in req.headers and "content-length" in req.headers:
        return BadRequest("a request must not carry both Content-Length and Transfer-Encoding (RFC 9112 6.3)",
                          headers=CLOSE)
    return None


def _error_event(path: str, exc: HeliosError) -> StreamEvent:
    """A terminal stream error in the path's protocol shape, for a stream without a generation encoder
    (or one whose own failure events could not be sent): Messages' `error` event, the Responses
    streaming `error` event, or the Chat-style error object."""
    if path.startswith("/v1/messages"):
        return StreamEvent(exc.to_anthropic(), "error")
    if path.startswith("/v1/responses"):
        return StreamEvent(ErrorEvent(code=exc.code or exc.type, message=exc.message, param=exc.param), "error")
    return StreamEvent(exc.to_openai())


def _error_body(path: str, exc: HeliosError) -> dict[str, Any]:
    """A JSON error body in the path's protocol shape: Anthropic's under /v1/messages, Ollama's under
    /api/ (but a 401, which keeps the OpenAI shape), System One's schema failures as their own body
    (``{"detail": [...]}``), else OpenAI's."""
    if isinstance(exc, SchemaErrors):
        return exc.body()
    if path.startswith("/v1/messages"):
        return exc.to_anthropic()
    if path.startswith("/api/") and exc.status != 401:
        return exc.to_ollama()
    return exc.to_openai()


def _without_body(send: Any) -> Any:
    """An ASGI send for a HEAD request: the response start as is, every body chunk emptied."""

    async def send_head(message: dict[str, Any]) -> None:
        if message.get("type") == "http.response.body":
            message = {**message, "body": b""}
        await send(message)

    return send_head
