"""What every request handler shares: configuration, the model service, HTTP admission slots, the
frontend worker pool, serving metrics, and the graceful-shutdown drain."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import trio

from helios.asgi.admission import AdmissionSlots
from helios.config import HeliosConfig
from helios.obs import metrics
from helios.serving.pipeline import Service

log = logging.getLogger("helios")


class InFlight(Protocol):
    """What the drain needs of an admitted generation request (`http.context.RequestContext`)."""

    @property
    def started(self) -> bool:
        """Its response started (a stream's headers went out)."""
        ...

    @property
    def cancel_scope(self) -> trio.CancelScope: ...


class ServerState:
    SHUTDOWN_ABORT_WAIT_S = 5.0  # for aborted requests to send their terminal events
    SHUTDOWN_ENGINE_WAIT_S = 5.0  # for the engine to retire the aborted children

    def __init__(self, config: HeliosConfig) -> None:
        self.service: Service | None = None
        self.runtime: Any = None
        self.created = int(time.time())
        self.metrics = metrics.ServingMetrics(self._metrics_source)
        self.metrics.input_stats = self._input_stats
        # Graceful shutdown (drain): admitted generation requests by id(ctx), until they finish.
        self.in_flight: dict[int, InFlight] = {}
        self.draining = False
        self.drained = 0  # in flight when the drain began and finished within the grace period
        self.aborted = 0  # still in flight at the deadline, ended by the server
        self._drain_done: trio.Event | None = None
        self._abort_now = trio.Event()
        self.configure(config)

    def configure(self, config: HeliosConfig) -> None:
        """Take a configuration (the lifespan loads $HELIOS_CONFIG when the app was built without)."""
        self.config = config
        self.slots = AdmissionSlots(config.server.max_concurrency)
        # Decompression, template rendering and tokenization share this one bounded pool (spec).
        self.frontend_limiter = trio.CapacityLimiter(config.server.frontend_workers)

    # -- graceful shutdown ------------------------------------------------------------------
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
            await _poll(lambda: not self.in_flight or self._abort_now.is_set(), grace)
            left = list(self.in_flight.values())
            self.aborted = len(left)
            self.drained = max(0, started - self.aborted)
            if left:
                log.warning("shutdown: aborting %d request(s) still in flight", len(left))
                for ctx in left:
                    if not ctx.started:
                        ctx.cancel_scope.cancel()  # the dispatcher answers 503
                svc = self.service
                if svc is not None:
                    svc.engine.paused = True
                    # Started streams read an ERROR finish after what was generated, and end the way
                    # their protocol ends a failed stream; every child is aborted in the engine.
                    svc.engine.fail_all("the server shut down before generation finished")
                await _poll(lambda: not self.in_flight, self.SHUTDOWN_ABORT_WAIT_S)
                for ctx in self.in_flight.values():  # stuck writing to a client that stopped reading
                    ctx.cancel_scope.cancel()
            svc = self.service
            if svc is not None:
                await _poll(lambda: _engine_idle(svc), self.SHUTDOWN_ENGINE_WAIT_S)
        finally:
            self._drain_done.set()

    def abort_now(self) -> None:
        """End the drain's grace period now (a second SIGINT/SIGTERM on `helios serve`)."""
        self._abort_now.set()

    def _input_stats(self) -> dict[str, int] | None:
        """The image-input caches' counters while the loaded model takes images (else None)."""
        images = getattr(self.service, "images", None)
        if images is None or not images.accepts_images:
            return None
        return dict(images.store.stats())

    def _metrics_source(self) -> tuple[Any, Any]:
        """What the serving metrics read at scrape time: engine stats (None before start-up) and
        the HTTP admission slots."""
        svc = self.service
        return (svc.engine.stats() if svc is not None else None), self.slots


async def _poll(done: Callable[[], bool], seconds: float) -> None:
    """Until `done()` (checked every 50 ms), for at most `seconds`."""
    with trio.move_on_after(seconds):
        while not done():
            await trio.sleep(0.05)


def _engine_idle(svc: Service) -> bool:
    """The engine holds no request (or cannot make progress on one)."""
    stats = svc.engine.stats()
    return stats is None or (stats.active == 0 and stats.pending == 0) or not svc.engine.healthy
