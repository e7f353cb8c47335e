"""HTTP routes: each handler authenticates, reads the body, decodes with its frontend, admits, runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from helios.frontends.openai import chat, completions, models

if TYPE_CHECKING:
    from helios.app import Ctx, HeliosApp


def register(app: HeliosApp) -> None:
    async def list_models(ctx: Ctx) -> None:
        app.auth(ctx)
        await ctx.json(models.list_models(ctx.svc.info, app.created))

    async def get_model(ctx: Ctx) -> None:
        app.auth(ctx)
        await ctx.json(models.get_model(ctx.svc.info, app.created, ctx.params["model"]))

    async def chat_completions(ctx: Ctx) -> None:
        app.auth(ctx)
        obj = await app.read_json(ctx)
        svc = ctx.svc
        plan = chat.decode_chat(obj, svc)
        ctx.admit(plan.n)
        specs = await chat.prepare_chat(plan, svc)
        await app.respond(
            ctx,
            stream=plan.stream,
            run_stream=lambda out: chat.run_chat_stream(plan, specs, svc, out),
            run_buffered=lambda: chat.run_chat_buffered(plan, specs, svc),
        )

    async def text_completions(ctx: Ctx) -> None:
        app.auth(ctx)
        obj = await app.read_json(ctx)
        svc = ctx.svc
        plan = completions.decode_completion(obj, svc)
        prepared, specs = await completions.prepare_completion(plan, svc)
        ctx.admit(len(specs))
        await app.respond(
            ctx,
            stream=plan.stream,
            run_stream=lambda out: completions.run_completion_stream(plan, prepared, specs, svc, out),
            run_buffered=lambda: completions.run_completion_buffered(plan, prepared, specs, svc),
        )

    app.router.add("GET", "/v1/models", list_models)
    app.router.add("GET", "/v1/models/{model:path}", get_model)
    app.router.add("POST", "/v1/chat/completions", chat_completions)
    app.router.add("POST", "/v1/completions", text_completions)

    # Protocol families that live in their own route modules.
    import importlib

    for name in ("helios.routes_anthropic", "helios.routes_responses", "helios.routes_decisions"):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(app)
