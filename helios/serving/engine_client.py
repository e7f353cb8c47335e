"""The async side of the engine boundary.

Outputs cross from the engine thread through `_sink` (a deque append plus one
`TrioToken.run_sync_soon(wake, idempotent=True)`); `_wake` runs in trio, never raises, and routes
each RequestOutput to its request's memory channel. Channels are sized by what the request may
produce, so the engine never blocks and no token is lost while a reader is paused.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

import trio

from helios.domain.events import FailureKind
from helios.engine.records import EngineFinish, EngineRequest, EngineStats, RequestOutput
from helios.errors import ServiceUnavailable

log = logging.getLogger("helios.serving")


class EngineHandle(Protocol):
    """What the client drives: `engine.core.EngineThread`, or `engine.dp.DataParallelEngine` (N
    engine processes behind one handle)."""

    @property
    def healthy(self) -> bool: ...

    def submit(self, request: EngineRequest) -> None: ...
    def abort(self, request_ids: Sequence[str]) -> None: ...
    def stats(self) -> EngineStats: ...


class EngineClient:
    def __init__(self, *, max_in_flight: int) -> None:
        self._engine: EngineHandle | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._outbox: collections.deque[list[RequestOutput]] = collections.deque()
        self._channels: dict[str, trio.MemorySendChannel[RequestOutput]] = {}
        self._ids = itertools.count()
        self.max_in_flight = max_in_flight
        self.paused = False

    # -- wiring -----------------------------------------------------------------------------
    def attach(self, engine: EngineHandle, token: trio.lowlevel.TrioToken) -> None:
        self._engine = engine
        self._token = token

    def sink(self, outputs: list[RequestOutput]) -> None:
        """Called from the engine thread."""
        self._outbox.append(outputs)
        token = self._token
        if token is not None:
            try:
                token.run_sync_soon(self._wake, idempotent=True)
            except trio.RunFinishedError:
                pass

    def _wake(self) -> None:
        try:
            while self._outbox:
                for out in self._outbox.popleft():
                    ch = self._channels.get(out.request_id)
                    if ch is None:
                        continue
                    try:
                        ch.send_nowait(out)
                    except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                        log.warning("dropped output for %s", out.request_id)
                    if out.finish is not None:
                        self._channels.pop(out.request_id, None)
                        ch.close()
        except Exception:  # never raise into trio's run_sync_soon
            log.exception("output routing failed")

    # -- state ------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self._engine is not None and self._engine.healthy

    @property
    def num_in_flight(self) -> int:
        return len(self._channels)

    def stats(self) -> EngineStats | None:
        return self._engine.stats() if self._engine is not None else None

    def abort_one(self, request_id: str) -> None:
        """Stop one child early (a string stop matched); its channel closes now."""
        ch = self._channels.pop(request_id, None)
        if ch is not None:
            ch.close()
            if self._engine is not None:
                self._engine.abort([request_id])

    def fail_all(self, message: str) -> int:
        """End every open child now (graceful shutdown's abort phase): its reader gets what was
        already generated, then an ERROR finish carrying `message`, then the end of its channel;
        the engine aborts them all and frees their pages. Returns how many children were open."""
        rids = list(self._channels)
        for rid in rids:
            ch = self._channels.pop(rid)
            try:
                ch.send_nowait(RequestOutput(rid, (), finish=EngineFinish.ERROR, error=message,
                                             failure=FailureKind.SHUTDOWN))
            except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
                pass  # the reader still ends: its channel closes below
            ch.close()
        if rids and self._engine is not None:
            self._engine.abort(rids)
        return len(rids)

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    # -- a request's children ---------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def open_children(
        self, requests: Sequence[EngineRequest]
    ) -> AsyncIterator[list[trio.MemoryReceiveChannel[RequestOutput]]]:
        """Submit a group of children; leaving the block for any reason aborts the unfinished ones."""
        engine = self._engine
        if engine is None or not engine.healthy:
            raise ServiceUnavailable("the model runtime is unavailable")
        if self.paused:
            raise ServiceUnavailable("admission is paused")
        if self.num_in_flight + len(requests) > self.max_in_flight:
            raise ServiceUnavailable("the model request queue is full; retry later")
        receivers = []
        for r in requests:
            # A prompt-scoring child also gets one output per prefill chunk that scored positions.
            scored = len(r.prompt_token_ids) if r.prompt_logprobs is not None else 0
            send, recv = trio.open_memory_channel[RequestOutput](r.max_tokens + scored + 8)
            self._channels[r.request_id] = send
            receivers.append(recv)
        for r in requests:
            engine.submit(r)
        try:
            yield receivers
        finally:
            unfinished = [r.request_id for r in requests if r.request_id in self._channels]
            for rid in unfinished:
                ch = self._channels.pop(rid)
                ch.close()
            if unfinished:
                engine.abort(unfinished)
