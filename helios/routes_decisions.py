"""Routes for POST /v1/systemone and POST /v1/decisions (spec: System One decisions, Decisions).

`helios.routes.register()` imports this module when present and calls `register(app)`. Both routes
score with the one `helios.serving.decisions.DecisionScorer`; authentication and operational errors
use the Chat Completions error shape, System One schema failures its own 422 ``{"detail": [...]}``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from helios.asgi.request import parse_content_encoding, read_body
from helios.errors import BadRequest, UnsupportedMediaType
from helios.frontends.decisions import decisions, systemone
from helios.frontends.wire import parse_json_object
from helios.serving.decisions import DecisionScorer

if TYPE_CHECKING:
    from helios.app import Ctx, HeliosApp


def register(app: HeliosApp) -> None:
    def reject_multipart(ctx: Ctx, *, text_only_route: bool) -> None:
        content_type = (ctx.req.headers.get("content-type") or "").strip().lower()
        if not content_type.startswith("multipart/"):
            return
        if parse_content_encoding(ctx.req.headers.get_list("content-encoding")):
            raise UnsupportedMediaType("multipart request bodies must use identity Content-Encoding")
        if text_only_route:
            raise BadRequest("multipart bodies are not supported on this text-only route")
        raise BadRequest("multipart image assets need TypeSafe-Danger-Zone-Images: true and a vision core; this "
                         "model is text-only")

    async def score(ctx: Ctx, run: Callable[[DecisionScorer], Awaitable[dict[str, Any]]]) -> None:
        scorer = DecisionScorer(ctx.svc)
        ctx.admit(1)
        result: dict[str, Any] = {}

        async def body() -> None:
            result.update(await run(scorer))

        await app.run_cancellable(ctx, body)
        if result:
            await ctx.json(result)

    async def system_one(ctx: Ctx) -> None:
        app.auth(ctx)
        reject_multipart(ctx, text_only_route=False)
        ctx.body = await read_body(ctx.receive, ctx.req.headers, app.config.server.max_body_bytes,
                                   limiter=app.frontend_limiter)
        svc = ctx.svc
        try:
            plan = systemone.decode_systemone(systemone.parse_body(ctx.body))
        except systemone.SchemaErrors as exc:
            await ctx.json(exc.body(), status=exc.status)
            return
        await score(ctx, lambda scorer: systemone.run_systemone(plan, scorer, svc))

    async def decide(ctx: Ctx) -> None:
        app.auth(ctx)
        reject_multipart(ctx, text_only_route=True)
        ctx.body = await read_body(ctx.receive, ctx.req.headers, app.config.server.max_body_bytes,
                                   limiter=app.frontend_limiter)
        svc = ctx.svc
        plan = decisions.decode_decisions(parse_json_object(ctx.body))
        await score(ctx, lambda scorer: decisions.run_decisions(plan, scorer, svc))

    app.router.add("POST", "/v1/systemone", system_one)
    app.router.add("POST", "/v1/decisions", decide)
