"""Anthropic routes: POST /v1/messages and POST /v1/messages/count_tokens.

Each handler authenticates (x-api-key or bearer), requires ``anthropic-version: 2023-06-01``, reads
the body, decodes with the Messages frontend, admits, runs. Errors on these paths are rendered in
the Anthropic shape by the app (paths under /v1/messages), as terminal ``error`` events once a
stream has started.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from helios.frontends.anthropic import messages

if TYPE_CHECKING:
    from helios.app import Ctx, HeliosApp


def register(app: HeliosApp) -> None:
    async def create_message(ctx: Ctx) -> None:
        app.auth(ctx, anthropic=True)
        messages.check_version(ctx.req.headers.get("anthropic-version"))
        obj = await app.read_json(ctx)
        svc = ctx.svc
        plan = messages.decode_request(obj, svc.info)
        ctx.admit(1)
        prepared = await messages.prepare(plan, svc)
        await app.respond(
            ctx,
            stream=plan.stream,
            run_stream=lambda out: messages.run_stream(plan, prepared, svc, out),
            run_buffered=lambda: messages.run_buffered(plan, prepared, svc),
        )

    async def count_tokens(ctx: Ctx) -> None:
        app.auth(ctx, anthropic=True)
        messages.check_version(ctx.req.headers.get("anthropic-version"))
        obj = await app.read_json(ctx)
        svc = ctx.svc
        plan = messages.decode_count_tokens(obj, svc.info)
        await ctx.json(await messages.count_tokens(plan, svc))

    app.router.add("POST", "/v1/messages", create_message)
    app.router.add("POST", "/v1/messages/count_tokens", count_tokens)
