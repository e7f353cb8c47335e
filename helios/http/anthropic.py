"""Anthropic routes: POST /v1/messages and POST /v1/messages/count_tokens.

Both accept their request the Anthropic way (x-api-key or bearer, `anthropic-version: 2023-06-01`)
and decode it with the Messages frontend. Errors on these paths take the Anthropic shape
(`helios.http.dispatch.render_error`), as terminal ``error`` events once a stream has started.
"""

from __future__ import annotations

from helios.frontends import limits
from helios.frontends.anthropic import messages, messages_encoder
from helios.http.context import RequestContext
from helios.http.dispatch import Route
from helios.http.endpoint import Endpoint, Generation

MESSAGES = Endpoint(limits.MESSAGES, messages.decode_request, anthropic=True)
# Rendering and tokenizing take a slot like a generation's preparation.
COUNT_TOKENS = Endpoint(limits.MESSAGES, messages.decode_count_tokens, anthropic=True)


async def count_tokens(ctx: RequestContext) -> None:
    """The exact prompt a generation request would submit: input_tokens + cache_read_input_tokens."""
    plan = await COUNT_TOKENS.accept(ctx)
    await ctx.json({"input_tokens": await ctx.svc.count_prompt_tokens(plan.conversation)})


ROUTES: list[Route] = [
    ("POST", "/v1/messages", Generation(MESSAGES, messages_encoder.MessagesEncoder)),
    ("POST", "/v1/messages/count_tokens", count_tokens),
]
