"""Anthropic routes: POST /v1/messages and POST /v1/messages/count_tokens.

Each handler authenticates (x-api-key or bearer), requires ``anthropic-version: 2023-06-01``, reads
the body, decodes with the Messages frontend, admits, runs. Errors on these paths are rendered in
the Anthropic shape by the app (paths under /v1/messages), as terminal ``error`` events once a
stream has started.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from helios.errors import HeliosError
from helios.frontends.anthropic import messages

if TYPE_CHECKING:
    from helios.app import Ctx, HeliosApp


def register(app: HeliosApp) -> None:
    from helios.app import StreamOut

    async def create_message(ctx: Ctx) -> None:
        app.auth(ctx, anthropic=True)
        messages.check_version(ctx.req.headers.get("anthropic-version"))
        obj = await app.read_json(ctx)
        svc = ctx.svc
        plan = messages.decode_request(obj, svc.info)
        ctx.admit(1)
        prepared = await messages.prepare(plan, svc)
        if plan.stream:
            out = StreamOut(ctx)

            async def stream() -> None:
                await messages.run_stream(plan, prepared, svc, out)
                await out.close()

            await _run(app, ctx, stream)
            return
        result: dict[str, Any] = {}

        async def buffered() -> None:
            result.update(await messages.run_buffered(plan, prepared, svc))

        await _run(app, ctx, buffered)
        if result:
            await ctx.json(result)

    async def count_tokens(ctx: Ctx) -> None:
        app.auth(ctx, anthropic=True)
        messages.check_version(ctx.req.headers.get("anthropic-version"))
        obj = await app.read_json(ctx)
        svc = ctx.svc
        plan = messages.decode_count_tokens(obj, svc.info)
        await ctx.json(await messages.count_tokens(plan, svc))

    app.router.add("POST", "/v1/messages", create_message)
    app.router.add("POST", "/v1/messages/count_tokens", count_tokens)


async def _run(app: HeliosApp, ctx: Ctx, body: Callable[[], Awaitable[None]]) -> None:
    """`app.run_cancellable`, re-raising a HeliosError from the body as itself.

    Trio wraps exceptions leaving a nursery in an ExceptionGroup, which the app would render as an
    anonymous 500; the frontend's own errors (500 tool-choice failures, 503 admission) keep their
    status and message this way."""
    failures: list[HeliosError] = []

    async def guarded() -> None:
        try:
            await body()
        except HeliosError as exc:
            failures.append(exc)

    await app.run_cancellable(ctx, guarded)
    if failures:
        raise failures[0]
