"""Anthropic routes: POST /v1/messages and POST /v1/messages/count_tokens.

Each handler authenticates (x-api-key or bearer), requires ``anthropic-version: 2023-06-01``, reads
the body and decodes it with the Messages frontend. Errors on these paths take the Anthropic shape
(`helios.http.dispatch.protocol_of`), as terminal ``error`` events once a stream has started.
"""

from __future__ import annotations

from helios.frontends import limits
from helios.frontends.anthropic import messages, messages_encoder
from helios.http.context import RequestContext
from helios.http.dispatch import Route


async def create_message(ctx: RequestContext) -> None:
    ctx.auth(anthropic=True)
    messages.check_version(ctx.req.headers.get("anthropic-version"))
    obj = await ctx.read_json(limits.MESSAGES)
    svc = ctx.svc
    plan = await ctx.offload(messages.decode_request, obj, svc.info)
    ctx.admit(1)
    prepared = await svc.prepare(plan.generation)
    encoder = messages_encoder.MessagesEncoder(plan, prepared.prompts, model=svc.info.public_id)
    await ctx.generate(prepared, encoder, stream=plan.stream)


async def count_tokens(ctx: RequestContext) -> None:
    """The exact prompt a generation request would submit: input_tokens + cache_read_input_tokens."""
    ctx.auth(anthropic=True)
    messages.check_version(ctx.req.headers.get("anthropic-version"))
    obj = await ctx.read_json(limits.MESSAGES)
    svc = ctx.svc
    plan = await ctx.offload(messages.decode_count_tokens, obj, svc.info)
    ctx.admit(1)  # rendering and tokenizing take a slot like a generation's preparation
    await ctx.json({"input_tokens": await svc.count_prompt_tokens(plan.conversation)})


ROUTES: list[Route] = [
    ("POST", "/v1/messages", create_message),
    ("POST", "/v1/messages/count_tokens", count_tokens),
]
