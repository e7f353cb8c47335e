"""Operational routes, unauthenticated: GET / and GET /api/hello (reachability), GET /health, GET /metrics."""

from __future__ import annotations

from helios.asgi.accept import prefers_json
from helios.asgi.responses import send_text
from helios.errors import BadRequest, ServiceUnavailable
from helios.http.context import RequestContext
from helios.http.dispatch import Route
from helios.obs import metrics


async def root(ctx: RequestContext) -> None:
    """The base URL: clients probe it for reachability."""
    await ctx.json({"name": "helios", "status": "ok" if ctx.state.service is not None else "loading"})


async def health(ctx: RequestContext) -> None:
    state = ctx.state
    if state.draining:  # graceful shutdown: tell load balancers to stop sending requests here
        raise ServiceUnavailable("the server is shutting down")
    svc = ctx.svc
    # The engine thread died, stopped, failed, or is wedged: no step progress for
    # [server] health_stall_seconds while it has work.
    thread = getattr(state.runtime, "thread", None)
    check = getattr(thread, "problem", None)
    problem = check(state.config.server.health_stall_seconds) if callable(check) else None
    if problem is None and not svc.engine.healthy:
        problem = "the engine reported a failure"
    if problem is not None:
        raise ServiceUnavailable(f"the model runtime is not healthy: {problem}")
    await ctx.json({"status": "ok"})


async def serving_metrics(ctx: RequestContext) -> None:
    if wants_json(ctx.req.query_value("format"), ctx.req.headers.get("accept")):
        await ctx.json(ctx.state.metrics.snapshot())
    else:
        ctx.responded = True
        await send_text(ctx.send, 200, ctx.state.metrics.prometheus(), content_type=metrics.CONTENT_TYPE)


def wants_json(fmt: str | None, accept: str | None) -> bool:
    """GET /metrics' format: ``?format=json|prometheus``, else the Accept header's preference."""
    if fmt is None:
        return prefers_json(accept)
    if fmt not in ("json", "prometheus"):
        raise BadRequest(f"unknown metrics format '{fmt}'; use json or prometheus", param="format")
    return fmt == "json"


ROUTES: list[Route] = [
    ("GET", "/", root),
    # Claude Code probes ANTHROPIC_BASE_URL with HEAD /api/hello (preconnect) before its first request.
    ("GET", "/api/hello", root),
    ("GET", "/health", health),
    ("GET", "/metrics", serving_metrics),
]
