"""Composition root: configuration → model → engine thread → serving pipeline → ASGI app.

`hypercorn helios.app:app --worker-class trio` imports `app` (configured by $HELIOS_CONFIG);
`helios serve` builds the same app with CLI overrides. The ASGI lifespan loads the model and starts
the engine thread, and stops both.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from helios.asgi.admission import AdmissionSlots
from helios.asgi.auth import check_anthropic, check_bearer
from helios.asgi.request import ClientDisconnected, Request, read_body
from helios.asgi.responses import SSEWriter, send_json, send_text
from helios.asgi.routing import Router
from helios.config import HeliosConfig, load_config
from helios.errors import (
    BadRequest,
    HeliosError,
    InternalError,
    NotFound,
    ServiceUnavailable,
    TooManyRequests,
)
from helios.obs import access, metrics
from helios.serving.pipeline import Service

log = logging.getLogger("helios")

Handler = Callable[["Ctx"], Awaitable[None]]


@attrs.define
class Ctx:
    """One HTTP request as a handler sees it."""

    req: Request
    params: dict[str, str]
    receive: Any
    send: Any
    app: HeliosApp
    request_id: str
    body: bytes = b""
    responded: bool = False
    slots: int = 0
    writer: SSEWriter | None = None
    stream: Any = None  # the StreamOut of a streaming response

    @property
    def started(self) -> bool:
        return self.responded or (self.writer is not None and self.writer.started)

    @property
    def svc(self) -> Service:
        svc = self.app.service
        if svc is None:
            raise ServiceUnavailable("the model runtime is not loaded")
        return svc

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"x-request-id", self.request_id.encode())]

    async def json(self, obj: Any, status: int = 200) -> None:
        self.responded = True
        await send_json(self.send, status, obj, self.headers())

    def admit(self, n: int) -> None:
        """Take one HTTP admission slot per generated choice (429 when exhausted)."""
        slots = self.app.slots
        if n > slots.total:
            raise BadRequest(f"the request asks for {n} choices; this server admits at most {slots.total} at once")
        if not slots.try_acquire(n):
            raise TooManyRequests("all HTTP admission slots are in use; retry later")
        self.slots += n


class HeliosApp:
    def __init__(self, config: HeliosConfig | None = None, *, runtime_factory: Callable[..., Any] | None = None) -> None:
        self._config = config
        self._runtime_factory = runtime_factory
        self.config: HeliosConfig = config or HeliosConfig()
        self.service: Service | None = None
        self.runtime: Any = None
        self.slots = AdmissionSlots(self.config.server.max_concurrency)
        self.frontend_limiter = trio.CapacityLimiter(self.config.server.frontend_workers)
        self.created = int(time.time())
        self.access_log = self.config.server.access_log
        self.router: Router[Handler] = Router()
        self._register_routes()

    # -- lifespan ---------------------------------------------------------------------------
    async def startup(self) -> None:
        if self._config is None:
            self.config = load_config()
            self.slots = AdmissionSlots(self.config.server.max_concurrency)
            self.frontend_limiter = trio.CapacityLimiter(self.config.server.frontend_workers)
            self.access_log = self.config.server.access_log
        access.configure(self.config.server.log_level)
        from helios.runtime import build_runtime  # torch-heavy; imported on start only

        factory = self._runtime_factory or build_runtime
        self.runtime = await trio.to_thread.run_sync(lambda: factory(self.config))
        self.service = self.runtime.start(trio.lowlevel.current_trio_token())
        self.created = int(time.time())

    async def shutdown(self) -> None:
        if self.runtime is not None:
            await trio.to_thread.run_sync(self.runtime.stop)
        self.service = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(receive, send)
        elif kind == "http":
            await self._http(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    log.exception("start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- HTTP -------------------------------------------------------------------------------
    async def _http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not self.access_log:
            await self._serve_http(scope, receive, send)
            return
        stats = access.RequestStats()

        async def logged_send(message: dict[str, Any]) -> None:
            stats.sent(message)
            await send(message)

        async def logged_receive() -> dict[str, Any]:
            message: dict[str, Any] = await receive()
            stats.received(message)
            return message

        token = access.activate(stats)
        try:
            await self._serve_http(scope, logged_receive, logged_send)
        finally:
            access.deactivate(token)
            access.log.info("%s", access.format_line(stats, scope))

    async def _serve_http(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        req = Request.from_scope(scope)
        protocol = _protocol_of(req.path)
        method = req.method
        if method == "HEAD":
            # Every GET route answers HEAD with the same status and headers and no body
            # (RFC 9110 9.3.2); Claude Code probes its base URL this way.
            method, send = "GET", _without_body(send)
        ctx = Ctx(req, {}, receive, send, self, "req-" + uuid.uuid4().hex)
        try:
            handler, ctx.params = self.router.match(method, req.path)
            await handler(ctx)
        except ClientDisconnected:
            return
        except HeliosError as exc:
            await self._error(ctx, exc, protocol)
        except Exception as exc:
            log.exception("unhandled error on %s %s", req.method, req.path)
            await self._error(ctx, InternalError(f"internal error: {type(exc).__name__}"), protocol)
        finally:
            if ctx.slots:
                self.slots.release(ctx.slots)

    async def _error(self, ctx: Ctx, exc: HeliosError, protocol: str) -> None:
        if ctx.writer is not None and ctx.writer.started:
            # Failures after streaming began become a terminal error event in the protocol's shape.
            if not ctx.writer.closed:
                try:
                    if protocol == "anthropic":
                        access.note_stream_event(exc.to_anthropic(), "error")
                        await ctx.writer.event(exc.to_anthropic(), event="error")
                    else:
                        access.note_stream_event(exc.to_openai())
                        await ctx.writer.event(exc.to_openai())
                    await ctx.writer.close()
                except Exception:
                    pass
            return
        if ctx.responded:
            return
        ctx.responded = True
        if protocol == "anthropic":
            body = exc.to_anthropic()
        elif protocol == "ollama" and exc.status not in (401,):
            body = exc.to_ollama()
        else:
            body = exc.to_openai()
        await send_json(ctx.send, exc.status, body, [*ctx.headers(), *exc.headers])

    async def read_json(self, ctx: Ctx, *, identity_only: bool = False) -> dict[str, Any]:
        from helios.frontends.wire import parse_json_object

        ctx.body = await read_body(ctx.receive, ctx.req.headers, self.config.server.max_body_bytes,
                                   limiter=self.frontend_limiter, identity_only=identity_only)
        return parse_json_object(ctx.body)

    def auth(self, ctx: Ctx, anthropic: bool = False) -> None:
        key = self.config.server.api_key
        if anthropic:
            check_anthropic(ctx.req.headers, key)
        else:
            check_bearer(ctx.req.headers, key)

    async def run_cancellable(self, ctx: Ctx, body: Callable[[], Awaitable[None]]) -> None:
        """Run a generation with a sibling task that cancels it when the client disconnects.

        Leaving the scope for any reason aborts the request's engine children (serving's
        open_children does that in its finally)."""
        try:
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    while True:
                        msg = await ctx.receive()
                        if msg.get("type") == "http.disconnect":
                            nursery.cancel_scope.cancel()
                            return

                nursery.start_soon(watch)
                if isinstance(ctx.stream, StreamOut):
                    nursery.start_soon(ctx.stream.keepalive)
                try:
                    await body()
                finally:
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # Re-raise the single application error trio wrapped, so it keeps its status.
            leaves = list(_leaves(group))
            if len(leaves) == 1 and isinstance(leaves[0], Exception):
                raise leaves[0] from None
            raise

    async def respond(
        self,
        ctx: Ctx,
        *,
        stream: bool,
        run_stream: Callable[[StreamOut], Awaitable[None]],
        run_buffered: Callable[[], Awaitable[dict[str, Any]]],
    ) -> None:
        """Run a generation as SSE (headers after enqueue) or as one JSON body, cancellable either way."""
        if stream:
            out = StreamOut(ctx)

            async def streamed() -> None:
                await run_stream(out)
                await out.close()

            await self.run_cancellable(ctx, streamed)
            return
        result: dict[str, Any] = {}

        async def buffered() -> None:
            result.update(await run_buffered())

        await self.run_cancellable(ctx, buffered)
        if result:  # empty when the client went away first
            await ctx.json(result)

    # -- routes -----------------------------------------------------------------------------
    def _register_routes(self) -> None:
        from helios.routes import register

        self.router.add("GET", "/", self._root)
        self.router.add("GET", "/health", self._health)
        self.router.add("GET", "/metrics", self._metrics)
        register(self)

    async def _root(self, ctx: Ctx) -> None:
        """The base URL: unauthenticated, like /health; clients probe it for reachability."""
        await ctx.json({"name": "helios", "status": "ok" if self.service is not None else "loading"})

    async def _health(self, ctx: Ctx) -> None:
        svc = self.service
        if svc is None or not svc.engine.healthy:
            raise ServiceUnavailable("the model runtime is not healthy")
        await ctx.json({"status": "ok"})

    async def _metrics(self, ctx: Ctx) -> None:
        fmt = ctx.req.query_value("format")
        stats = self.service.engine.stats() if self.service else None
        snap = metrics.snapshot(stats, self.slots, self.created)
        if metrics.wants_json(fmt, ctx.req.headers.get("accept")):
            await ctx.json(snap)
        else:
            ctx.responded = True
            await send_text(ctx.send, 200, metrics.prometheus(snap), content_type=b"text/plain; version=0.0.4; charset=utf-8")


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:  # type: ignore[type-arg]
    out: list[BaseException] = []
    for e in group.exceptions:
        out.extend(_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


def _protocol_of(path: str) -> str:
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith("/api/"):
        return "ollama"
    return "openai"


async def not_found(ctx: Ctx) -> None:
    raise NotFound(f"no route for {ctx.req.method} {ctx.req.path}")


class StreamOut:
    """The EventWriter a streaming frontend gets: SSE headers go out on `start()`, after enqueue.

    While the stream is open, a comment line goes out after every 15 s without an event (the
    spec's keepalive during long waits); a lock keeps it from interleaving with events."""

    KEEPALIVE_S = 15.0

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        ctx.writer = self.sse = SSEWriter(ctx.send)
        ctx.stream = self
        self._lock = trio.Lock()
        self._last = trio.current_time()

    async def start(self) -> None:
        async with self._lock:
            if not self.sse.started:
                await self.sse.start(self.ctx.headers())
                self._last = trio.current_time()

    async def event(self, data: str | dict[str, Any], event: str | None = None) -> None:
        access.note_stream_event(data, event)  # a terminal error event is the access log's `error=`
        await self.start()
        async with self._lock:
            await self.sse.event(data, event)
            self._last = trio.current_time()

    async def done_marker(self) -> None:
        await self.start()
        async with self._lock:
            await self.sse.done_marker()

    async def close(self) -> None:
        async with self._lock:
            if self.sse.started and not self.sse.closed:
                await self.sse.close()

    async def keepalive(self) -> None:
        while not self.sse.closed:
            await trio.sleep_until(self._last + self.KEEPALIVE_S)
            if trio.current_time() - self._last < self.KEEPALIVE_S:
                continue  # an event went out meanwhile
            async with self._lock:
                if self.sse.started and not self.sse.closed:
                    await self.sse.comment("keepalive")
                self._last = trio.current_time()


app = HeliosApp()


def _without_body(send: Any) -> Any:
    """An ASGI send for a HEAD request: the response start as is, every body chunk emptied."""

    async def send_head(message: dict[str, Any]) -> None:
        if message.get("type") == "http.response.body":
            message = {**message, "body": b""}
        await send(message)

    return send_head
