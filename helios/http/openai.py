"""OpenAI routes: GET /v1/models, GET /v1/models/{model}, POST /v1/chat/completions,
POST /v1/completions and POST /v1/responses. Each generating handler authenticates, reads the body,
decodes it with its frontend, admits one slot per choice, prepares it once and runs it through the
one driver, buffered or streamed."""

from __future__ import annotations

from helios.frontends import limits
from helios.frontends.openai import chat, completions, models, responses, responses_encoder
from helios.http.context import RequestContext
from helios.http.dispatch import Route


async def list_models(ctx: RequestContext) -> None:
    ctx.auth()
    await ctx.json(models.list_models(ctx.svc.info, ctx.state.created))


async def get_model(ctx: RequestContext) -> None:
    ctx.auth()
    await ctx.json(models.get_model(ctx.svc.info, ctx.state.created, ctx.params["model"]))


async def chat_completions(ctx: RequestContext) -> None:
    ctx.auth()
    obj = await ctx.read_json(limits.CHAT)
    svc = ctx.svc
    plan = await ctx.offload(chat.decode_chat, obj, svc.info)
    ctx.admit(plan.options.n)
    prepared = await svc.prepare(plan.generation)
    encoder = chat.ChatEncoder(plan, prepared.prompts, model=svc.info.public_id, vocab=svc)
    await ctx.generate(prepared, encoder, stream=plan.stream)


async def text_completions(ctx: RequestContext) -> None:
    ctx.auth()
    obj = await ctx.read_json(limits.COMPLETIONS)
    svc = ctx.svc
    plan = await ctx.offload(completions.decode_completion, obj, svc.info)
    ctx.admit(len(plan.generation.prompts) * plan.options.n)  # before any prompt is tokenized
    prepared = await svc.prepare(plan.generation)
    encoder = completions.CompletionEncoder(plan, prepared.prompts, model=svc.info.public_id, vocab=svc)
    await ctx.generate(prepared, encoder, stream=plan.stream)


async def create_response(ctx: RequestContext) -> None:
    ctx.auth()
    obj = await ctx.read_json(limits.RESPONSES)
    svc = ctx.svc
    plan = await ctx.offload(responses.decode_responses, obj, svc.info)
    ctx.admit(1)
    prepared = await svc.prepare(plan.generation)
    encoder = responses_encoder.make_encoder(plan, prepared.prompts, prepared.children[0].sampling, model=svc.info.public_id,
                                     vocab=svc)
    await ctx.generate(prepared, encoder, stream=plan.stream)


ROUTES: list[Route] = [
    ("GET", "/v1/models", list_models),
    ("GET", "/v1/models/{model:path}", get_model),
    ("POST", "/v1/chat/completions", chat_completions),
    ("POST", "/v1/completions", text_completions),
    ("POST", "/v1/responses", create_response),
]
