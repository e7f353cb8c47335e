"""Composition root: configuration → model runtime → serving pipeline → HTTP dispatcher.

`hypercorn helios.app:app --worker-class trio` imports `app` (configured by $HELIOS_CONFIG);
`helios serve` builds the same app with CLI overrides. The ASGI lifespan loads the model and starts
the engine thread, and stops both after a graceful drain. Everything else lives where it belongs:
routes in `helios.http` (one module per protocol), protocol decoding and encoding in
`helios.frontends`, preparation and the drivers in `helios.serving`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import trio

from helios.asgi.admission import AdmissionSlots
from helios.asgi.routing import Router
from helios.config import HeliosConfig, load_config
from helios.http import anthropic, decisions, kv_events, ollama, openai, ops, webui
from helios.http.context import Handler
from helios.http.dispatch import Dispatcher
from helios.http.state import ServerState
from helios.obs import access, metrics
from helios.serving.pipeline import Service

log = logging.getLogger("helios")

ROUTES = [*ops.ROUTES, *webui.ROUTES, *openai.ROUTES, *anthropic.ROUTES, *ollama.ROUTES, *decisions.ROUTES,
          *kv_events.ROUTES]


class HeliosApp:
    def __init__(self, config: HeliosConfig | None = None, *, runtime_factory: Callable[..., Any] | None = None) -> None:
        self._config_given = config is not None
        self._runtime_factory = runtime_factory
        self.state = ServerState(config or HeliosConfig())
        self.dispatcher = Dispatcher(self.state, ROUTES)

    # -- what tests, the CLI and the bench read -----------------------------------------------
    @property
    def config(self) -> HeliosConfig:
        return self.state.config

    @property
    def service(self) -> Service | None:
        return self.state.service

    @property
    def runtime(self) -> Any:
        return self.state.runtime

    @property
    def slots(self) -> AdmissionSlots:
        return self.state.slots

    @property
    def frontend_limiter(self) -> trio.CapacityLimiter:
        return self.state.frontend_limiter

    @property
    def metrics(self) -> metrics.ServingMetrics:
        return self.state.metrics

    @property
    def router(self) -> Router[Handler]:
        return self.dispatcher.router

    async def drain(self, grace: float | None = None) -> None:
        await self.state.drain(grace)

    def engine_failure(self) -> str | None:
        """Why the engine thread died (an exception escaped its loop), once it has ended; None while
        it runs, before it starts and after a normal stop."""
        thread = getattr(self.state.runtime, "thread", None)
        error = getattr(thread, "error", None)
        if thread is None or error is None or thread.is_alive():
            return None
        return str(error)

    def abort_now(self) -> None:
        self.state.abort_now()

    # -- lifespan ---------------------------------------------------------------------------
    async def startup(self) -> None:
        state = self.state
        if not self._config_given:
            state.configure(load_config())
        access.configure(state.config.server.log_level)
        if state.config.server.api_key:
            log.info("authentication: on (every route but /, /health and /metrics needs the serving key)")
        else:
            log.warning("authentication: off (no [server] api_key or --api-key-file): anyone who can reach "
                        "this port can use the model")
        from helios.runtime import build_server_runtime  # torch-heavy; imported on start only

        factory = self._runtime_factory or build_server_runtime
        state.runtime = await trio.to_thread.run_sync(lambda: factory(state.config))
        state.service = state.runtime.start(trio.lowlevel.current_trio_token(), state.frontend_limiter)
        state.created = int(time.time())

    async def shutdown(self) -> None:
        """Lifespan shutdown: drain (a no-op when `helios serve` drained on the signal already),
        stop the engine thread, and log what the drain did and how many KV pages are free."""
        state = self.state
        try:
            await state.drain()
        finally:
            runtime = state.runtime
            if runtime is not None:
                await trio.to_thread.run_sync(runtime.stop)
                self._log_shutdown(runtime)
            state.service = None

    def _log_shutdown(self, runtime: Any) -> None:
        state = self.state
        counts = runtime.page_counts() if callable(getattr(runtime, "page_counts", None)) else None
        if counts is None:
            log.error("shutdown: drained %d, aborted %d, free pages unknown (the engine did not stop)",
                      state.drained, state.aborted)
            return
        free, total = counts
        log.log(logging.INFO if free == total else logging.ERROR,
                "shutdown: drained %d, aborted %d, free pages %d/%d", state.drained, state.aborted, free, total)

    # -- ASGI -------------------------------------------------------------------------------
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(receive, send)
        elif kind == "http":
            await self.dispatcher(scope, receive, send)
        elif kind == "websocket":
            await self.dispatcher.serve_websocket(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    if isinstance(exc, (ValueError, OSError)):
                        # What the model or its files say is wrong (an unsupported architecture, a
                        # missing or malformed file): its one line, the traceback only at debug level.
                        log.error("start-up failed: %s", exc)
                        log.debug("start-up failure", exc_info=True)
                    else:
                        log.exception("start-up failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return


app = HeliosApp()
