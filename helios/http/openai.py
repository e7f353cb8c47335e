"""OpenAI routes: GET /v1/models, GET /v1/models/{model}, POST /v1/chat/completions,
POST /v1/completions and POST /v1/responses. The generating routes are `Generation`s: one slot per
choice (Completions: per prompt and choice), their frontend's decoder and encoder."""

from __future__ import annotations

from helios.frontends import limits
from helios.frontends.openai import chat, completions, models, responses, responses_encoder
from helios.http.context import RequestContext
from helios.http.dispatch import Route
from helios.http.endpoint import Endpoint, Generation
from helios.serving.pipeline import Prepared, Service


async def list_models(ctx: RequestContext) -> None:
    ctx.auth()
    await ctx.json(models.list_models(ctx.svc.info, ctx.state.created))


async def get_model(ctx: RequestContext) -> None:
    ctx.auth()
    await ctx.json(models.get_model(ctx.svc.info, ctx.state.created, ctx.params["model"]))


def chat_encoder(plan: chat.ChatPlan, prepared: Prepared, svc: Service) -> chat.ChatEncoder:
    return chat.ChatEncoder(plan, prepared.prompts, model=svc.info.public_id, vocab=svc)


def completion_encoder(plan: completions.CompletionPlan, prepared: Prepared,
                       svc: Service) -> completions.CompletionEncoder:
    return completions.CompletionEncoder(plan, prepared.prompts, model=svc.info.public_id, vocab=svc)


def response_encoder(plan: responses.ResponsesPlan, prepared: Prepared,
                     svc: Service) -> responses_encoder.ResponseEncoder:
    return responses_encoder.make_encoder(plan, prepared.prompts, prepared.children[0].sampling,
                                          model=svc.info.public_id, vocab=svc)


CHAT = Endpoint(limits.CHAT, chat.decode_chat, slots=lambda plan: plan.options.n)
COMPLETIONS = Endpoint(limits.COMPLETIONS, completions.decode_completion,
                       slots=lambda plan: len(plan.generation.prompts) * plan.options.n)
RESPONSES = Endpoint(limits.RESPONSES, responses.decode_responses)

ROUTES: list[Route] = [
    ("GET", "/v1/models", list_models),
    ("GET", "/v1/models/{model:path}", get_model),
    ("POST", "/v1/chat/completions", Generation(CHAT, chat_encoder)),
    ("POST", "/v1/completions", Generation(COMPLETIONS, completion_encoder)),
    ("POST", "/v1/responses", Generation(RESPONSES, response_encoder)),
]
