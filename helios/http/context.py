"""One HTTP request as a route handler sees it, and the handler's building blocks: authentication,
a bounded JSON body, HTTP admission, a JSON reply, and running a reply or a stream with a sibling
task that cancels it when the client disconnects."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import attrs
import trio

from helios.asgi.auth import check_anthropic, check_bearer
from helios.asgi.request import Request, read_body
from helios.asgi.responses import send_json
from helios.errors import BadRequest, ServiceUnavailable, TooManyRequests
from helios.frontends.wire import CountLimit, parse_json_object
from helios.http.sse import EventStream
from helios.http.state import ServerState
from helios.obs import access
from helios.serving.drive import Encoder
from helios.serving.pipeline import Service, exception_leaves

# On every 429 for exhausted HTTP admission slots: a slot frees as soon as any response is delivered.
RETRY_AFTER = ((b"retry-after", b"1"),)

# A JSON body smaller than this is parsed, decoded, rendered and tokenized on the event loop, not on
# the frontend pool: its work is a fraction of a millisecond (a 4,096-character prompt tokenizes in
# ~0.7 ms, its JSON parses in ~5 us; docs/benchmarks.md, "Small requests inline"), less than the three
# worker-thread round trips it would take, which queue behind every other request's when many arrive
# at once. The bound matches `asgi.request.OFFLOAD_MIN_BYTES` for decoding a compressed body.
INLINE_BODY_BYTES = 4096

T = TypeVar("T")


@attrs.define
class RequestContext:
    req: Request
    params: dict[str, str]
    receive: Any
    send: Any
    state: ServerState
    request_id: str
    responded: bool = False
    disconnected: bool = False
    slots: int = 0
    stream: EventStream | None = None
    encoder: Encoder | None = None  # a generation's, so errors outside its driver end it its own way
    # Cancelled only by a graceful shutdown's abort phase (ServerState.drain).
    cancel_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    # Set by `read_json`: the body is under INLINE_BODY_BYTES, so `offload` and the Service's
    # preparation run its work inline.
    inline: bool = False

    @property
    def started(self) -> bool:
        return self.responded or (self.stream is not None and self.stream.started)

    @property
    def svc(self) -> Service:
        svc = self.state.service
        if svc is None:
            raise ServiceUnavailable("the model runtime is not loaded")
        return svc

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"x-request-id", self.request_id.encode())]

    # -- request ----------------------------------------------------------------------------
    def auth(self, *, anthropic: bool = False) -> None:
        (check_anthropic if anthropic else check_bearer)(self.req.headers, self.state.config.server.api_key)

    async def read_body(self, *, identity_only: bool = False) -> bytes:
        """The body, bounded by [server] max_body_bytes and decoded per Content-Encoding on the
        frontend worker pool."""
        return await read_body(self.receive, self.req.headers, self.state.config.server.max_body_bytes,
                               limiter=self.state.frontend_limiter, identity_only=identity_only)

    async def read_json(self, limits: Sequence[CountLimit] = (), *, identity_only: bool = False) -> dict[str, Any]:
        """The body as a JSON object: parsed and checked (nesting, text, the route's item `limits`)
        on the frontend pool (on the event loop for a body under INLINE_BODY_BYTES, which also sets
        `inline`), before the request is decoded or admitted."""
        body = await self.read_body(identity_only=identity_only)
        self.inline = len(body) < INLINE_BODY_BYTES
        return await self.offload(parse_json_object, body, limits)

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """Run pure CPU work (parsing, decoding) on the bounded frontend pool: a worker thread the
        interpreter preempts every few milliseconds, so the event loop and the engine keep running.
        For a small JSON body (`inline`) the work runs here, on the event loop."""
        if self.inline:
            return fn(*args)
        return await trio.to_thread.run_sync(fn, *args, limiter=self.state.frontend_limiter)

    def admit(self, n: int) -> None:
        """Take one HTTP admission slot per generated choice (429 with `Retry-After: 1` when
        exhausted; 503 while the server drains for shutdown: the spec's paused admission)."""
        access.note_admission(granted=False)  # from here on the request counts as completed or failed
        state = self.state
        if state.draining:
            raise ServiceUnavailable("the server is shutting down; admission is paused")
        slots = state.slots
        if n > slots.total:
            raise BadRequest(f"the request asks for {n} choices; this server admits at most {slots.total} at once")
        if not slots.try_acquire(n):
            raise TooManyRequests("all HTTP admission slots are in use; retry later", headers=RETRY_AFTER)
        self.slots += n
        access.note_admission(granted=True)
        state.in_flight[id(self)] = self

    # -- response ---------------------------------------------------------------------------
    async def json(self, obj: Any, status: int = 200) -> None:
        self.responded = True
        await send_json(self.send, status, obj, self.headers())

    async def reply(self, produce: Callable[[], Awaitable[Any]]) -> None:
        """Reply with the JSON body `produce` returns, unless the client disconnects first."""
        result: list[Any] = []

        async def run() -> None:
            result.append(await produce())

        await self.run_cancellable(run)
        if result:  # empty when the client went away first
            await self.json(result[0])

    async def run_cancellable(self, body: Callable[[], Awaitable[None]], stream: EventStream | None = None) -> None:
        """Run `body` with a sibling task that cancels it when the client disconnects (noted in
        `disconnected`) and, for a `stream`, one that sends its keepalives. Leaving the scope for any
        reason aborts the request's engine children (serving's open_children does that in its finally)."""
        try:
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    while (await self.receive()).get("type") != "http.disconnect":
                        pass
                    self.disconnected = True
                    nursery.cancel_scope.cancel()

                nursery.start_soon(watch)
                if stream is not None:
                    nursery.start_soon(stream.keepalive)
                try:
                    await body()
                finally:
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # Re-raise the single application error trio wrapped, so it keeps its status.
            leaves = exception_leaves(group)
            if len(leaves) == 1 and isinstance(leaves[0], Exception):
                raise leaves[0] from None
            raise


Handler = Callable[[RequestContext], Awaitable[None]]
