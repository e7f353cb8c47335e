"""Routes for POST /v1/responses and Ollama discovery (GET /api/tags, POST /api/show).

`helios.routes.register()` imports this module when present and calls `register(app)`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from helios.errors import HeliosError
from helios.frontends.ollama import discovery
from helios.frontends.openai import responses

if TYPE_CHECKING:
    from helios.app import Ctx, HeliosApp


def register(app: HeliosApp) -> None:
    from helios.app import StreamOut

    async def guarded(ctx: Ctx, body: Callable[[], Awaitable[None]]) -> None:
        """app.run_cancellable, re-raising a HeliosError from the body as itself.

        trio nurseries wrap whatever leaves them in an ExceptionGroup; catching the error inside
        keeps its HTTP status (503 for a full queue, 500 for a failed generation)."""
        errors: list[HeliosError] = []

        async def body_keeping_errors() -> None:
            try:
                await body()
            except HeliosError as exc:
                errors.append(exc)

        await app.run_cancellable(ctx, body_keeping_errors)
        if errors:
            raise errors[0]

    async def create_response(ctx: Ctx) -> None:
        app.auth(ctx)
        obj = await app.read_json(ctx)
        svc = ctx.svc
        plan = responses.decode_responses(obj, svc)
        ctx.admit(1)
        spec = await responses.prepare_responses(plan, svc)
        if plan.stream:
            out = StreamOut(ctx)

            async def stream() -> None:
                await responses.run_responses_stream(plan, spec, svc, out)
                await out.close()

            await guarded(ctx, stream)
            return
        result: dict[str, Any] = {}

        async def buffered() -> None:
            result.update(await responses.run_responses_buffered(plan, spec, svc))

        await guarded(ctx, buffered)
        if result:
            await ctx.json(result)

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
