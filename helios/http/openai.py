"""OpenAI routes: GET /v1/models, GET /v1/models/{model}, POST /v1/chat/completions,
POST /v1/completions and POST /v1/responses. The generating routes are `Generation`s: one slot per
choice (Completions: per prompt and choice), their frontend's decoder and encoder."""

from __future__ import annotations

from helios.frontends import limits
from helios.frontends.openai import chat, completions, models, responses, responses_encoder
from helios.http.context import RequestContext
from helios.http.dispatch import Route
from helios.http.endpoint import Endpoint, Generation


async def list_models(ctx: RequestContext) -> None:
    ctx.auth()
    await ctx.json(models.list_models(ctx.svc.info, ctx.state.created))


async def get_model(ctx: RequestContext) -> None:
    ctx.auth()
    await ctx.json(models.get_model(ctx.svc.info, ctx.state.created, ctx.params["model"]))


CHAT = Endpoint(limits.CHAT, chat.decode_chat, slots=lambda plan: plan.options.n)
COMPLETIONS = Endpoint(limits.COMPLETIONS, completions.decode_completion,
                       slots=lambda plan: len(plan.generation.prompts) * plan.options.n)
RESPONSES = Endpoint(limits.RESPONSES, responses.decode_responses)

ROUTES: list[Route] = [
    ("GET", "/v1/models", list_models),
    ("GET", "/v1/models/{model:path}", get_model),
    ("POST", "/v1/chat/completions", Generation(CHAT, chat.ChatEncoder)),
    ("POST", "/v1/completions", Generation(COMPLETIONS, completions.CompletionEncoder)),
    ("POST", "/v1/responses", Generation(RESPONSES, responses_encoder.make_encoder)),
]
