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

# On every 429 for exhausted HTTP admission slots: a slot frees as soon as any response is delivered.
RETRY_AFTER = ((b"retry-after", b"1"),)


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
    # Cancelled only by a graceful shutdown's abort phase (HeliosApp.drain).
    cancel_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)

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
        """Take one HTTP admission slot per generated choice (429 with `Retry-After: 1` when
        exhausted; 503 while the server drains for shutdown: the spec's paused admission)."""
        access.note_admission(granted=False)  # from here on the request counts as completed or failed
        if self.app.draining:
            raise ServiceUnavailable("the server is shutting down; admission is paused")
        slots = self.app.slots
        if n > slots.total:
            raise BadRequest(f"the request asks for {n} choices; this server admits at most {slots.total} at once")
        if not slots.try_acquire(n):
            raise TooManyRequests("all HTTP admission slots are in use; retry later", headers=RETRY_AFTER)
        self.slots += n
        access.note_admission(granted=True)
        self.app.in_flight[id(self)] = self


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
        self.metrics = metrics.ServingMetrics(self._metrics_source)
        self.router: Router[Handler] = Router()
        self._register_routes()
        # Graceful shutdown (drain): admitted generation requests by id(ctx), until they finish.
        self.in_flight: dict[int, Ctx] = {}
        self.draining = False
        self.drained = 0  # in flight when the drain began and finished within the grace period
        self.aborted = 0  # still in flight at the deadline, ended by the server
        self._drain_done: trio.Event | None = None
        self._abort_now = trio.Event()

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
        self.service = self.runtime.start(trio.lowlevel.current_trio_token(), self.frontend_limiter)
        self.created = int(time.time())

    async def shutdown(self) -> None:
        """Lifespan shutdown: drain (a no-op when `helios serve` drained on the signal already),
        stop the engine thread, and log what the drain did and how many KV pages are free."""
        try:
            await self.drain()
        finally:
            runtime = self.runtime
            if runtime is not None:
                await trio.to_thread.run_sync(runtime.stop)
                self._log_shutdown(runtime)
            self.service = None

    # -- graceful shutdown ------------------------------------------------------------------
    SHUTDOWN_ABORT_WAIT_S = 5.0  # for aborted requests to send their terminal events
    SHUTDOWN_ENGINE_WAIT_S = 5.0  # for the engine to retire the aborted children

    async def drain(self, grace: float | None = None) -> None:
        """Stop admission (503, and /health 503), let admitted generation requests finish for up to
        `grace` seconds ([server] shutdown_grace_seconds), then abort the rest: a response not yet
        started gets 503, a started stream ends with its protocol's terminal error event. Returns
        once no generation request is left and the engine holds no request. Idempotent: a second
        call waits for the first. `abort_now()` ends the grace period early."""
        if self._drain_done is not None:
            await self._drain_done.wait()
            return
        self._drain_done = trio.Event()
        self.draining = True
        grace = self.config.server.shutdown_grace_seconds if grace is None else grace
        try:
            started = len(self.in_flight)
            if started:
                log.info("shutdown: admission paused; draining %d in-flight request(s) for up to %g s", started, grace)
            with trio.move_on_after(grace):
                while self.in_flight and not self._abort_now.is_set():
                    await trio.sleep(0.05)
            left = list(self.in_flight.values())
            self.aborted = len(left)
            self.drained = max(0, started - self.aborted)
            if left:
                log.warning("shutdown: aborting %d request(s) still in flight", len(left))
                self._abort(left)
                with trio.move_on_after(self.SHUTDOWN_ABORT_WAIT_S):
                    while self.in_flight:
                        await trio.sleep(0.05)
                for ctx in self.in_flight.values():  # stuck writing to a client that stopped reading
                    ctx.cancel_scope.cancel()
            await self._wait_engine_idle()
        finally:
            self._drain_done.set()

    def abort_now(self) -> None:
        """End the drain's grace period now (a second SIGINT/SIGTERM on `helios serve`)."""
        self._abort_now.set()

    def _abort(self, ctxs: list[Ctx]) -> None:
        for ctx in ctxs:
            if not ctx.started:
                ctx.cancel_scope.cancel()  # _serve_http answers 503
        svc = self.service
        if svc is not None:
            svc.engine.paused = True
            # Started streams read an ERROR finish after what was generated, and end the way their
            # protocol ends a failed stream; every child is aborted in the engine.
            svc.engine.fail_all("the server shut down before generation finished")

    async def _wait_engine_idle(self) -> None:
        svc = self.service
        if svc is None:
            return
        with trio.move_on_after(self.SHUTDOWN_ENGINE_WAIT_S):
            while True:
                stats = svc.engine.stats()
                if stats is None or (stats.active == 0 and stats.pending == 0) or not svc.engine.healthy:
                    return
                await trio.sleep(0.05)

    def _log_shutdown(self, runtime: Any) -> None:
        thread, core = getattr(runtime, "thread", None), getattr(runtime, "core", None)
        if core is None or (thread is not None and thread.is_alive()):
            log.error("shutdown: drained %d, aborted %d, free pages unknown (the engine thread did not stop)",
                      self.drained, self.aborted)
            return
        kv = core.kv_manager
        free, total = kv.num_free, kv.num_pages
        log.log(logging.INFO if free == total else logging.ERROR,
                "shutdown: drained %d, aborted %d, free pages %d/%d", self.drained, self.aborted, free, total)

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
        # Every request gets a stats record: the serving metrics count from it, the access log
        # (when on) writes it.
        stats = access.RequestStats(sink=self.metrics)

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
            self.metrics.finish_request(stats)
            if self.access_log:
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
            with ctx.cancel_scope:
                await handler(ctx)
            if ctx.cancel_scope.cancelled_caught:  # aborted by a graceful shutdown (drain)
                if ctx.started:
                    return  # the stream could not take its terminal event in time
                raise ServiceUnavailable("the server shut down before the request completed")
        except ClientDisconnected:
            return
        except HeliosError as exc:
            await self._error(ctx, exc, protocol)
        except Exception as exc:
            log.exception("unhandled error on %s %s", req.method, req.path)
            await self._error(ctx, InternalError(f"internal error: {type(exc).__name__}"), protocol)
        finally:
            self.in_flight.pop(id(ctx), None)
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
        if self.draining:  # graceful shutdown: tell load balancers to stop sending requests here
            raise ServiceUnavailable("the server is shutting down")
        svc = self.service
        if svc is None:
            raise ServiceUnavailable("the model runtime is not loaded")
        # The engine thread died, stopped, failed, or is wedged: no step progress for
        # [server] health_stall_seconds while it has work.
        thread = getattr(self.runtime, "thread", None)
        check = getattr(thread, "problem", None)
        problem = check(self.config.server.health_stall_seconds) if callable(check) else None
        if problem is None and not svc.engine.healthy:
            problem = "the engine reported a failure"
        if problem is not None:
            raise ServiceUnavailable(f"the model runtime is not healthy: {problem}")
        await ctx.json({"status": "ok"})

    def _metrics_source(self) -> tuple[Any, Any]:
        """What the serving metrics read at scrape time: engine stats (None before start-up) and
        the HTTP admission slots."""
        svc = self.service
        return (svc.engine.stats() if svc is not None else None), self.slots

    async def _metrics(self, ctx: Ctx) -> None:
        fmt = ctx.req.query_value("format")
        if metrics.wants_json(fmt, ctx.req.headers.get("accept")):
            await ctx.json(self.metrics.snapshot())
        else:
            ctx.responded = True
            await send_text(ctx.send, 200, self.metrics.prometheus(), content_type=metrics.CONTENT_TYPE)


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
