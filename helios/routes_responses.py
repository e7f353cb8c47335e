"""Routes for POST /v1/responses and Ollama discovery (GET /api/tags, POST /api/show).

`helios.routes.register()` imports this module when present and calls `register(app)`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from helios.frontends.ollama import discovery
from helios.frontends.openai import responses

if TYPE_CHECKING:
    from helios.app import Ctx, HeliosApp


def register(app: HeliosApp) -> None:
    async def create_response(ctx: Ctx) -> None:
        app.auth(ctx)
        obj = await app.read_json(ctx)
        svc = ctx.svc
        plan = responses.decode_responses(obj, svc)
        ctx.admit(1)
        spec = await responses.prepare_responses(plan, svc)
        await app.respond(
            ctx,
            stream=plan.stream,
            run_stream=lambda out: responses.run_responses_stream(plan, spec, svc, out),
            run_buffered=lambda: responses.run_responses_buffered(plan, spec, svc),
        )

    async def ollama_tags(ctx: Ctx) -> None:
        app.auth(ctx)
        await ctx.json(discovery.tags(ctx.svc.info))

    async def ollama_show(ctx: Ctx) -> None:
        app.auth(ctx)
        body = await app.read_json(ctx, identity_only=True)
        await ctx.json(discovery.show(ctx.svc.info, body))

    app.router.add("POST", "/v1/responses", create_response)
    app.router.add("GET", "/api/tags", ollama_tags)
    app.router.add("POST", "/api/show", ollama_show)
