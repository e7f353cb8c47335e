"""POST /v1/systemone and POST /v1/decisions (spec: System One decisions, Decisions).

Both routes score with the one `helios.serving.decisions.DecisionScorer`; authentication and
operational errors use the Chat Completions error shape, System One schema failures its own 422
``{"detail": [...]}``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from helios.asgi.request import parse_content_encoding
from helios.domain.conversation import ImagePart
from helios.domain.decisions import DecisionQuestion, QuestionScore
from helios.errors import BadRequest, UnsupportedMediaType
from helios.frontends.decisions import decisions, multipart, systemone
from helios.http.context import RequestContext
from helios.http.dispatch import Route
from helios.serving.decisions import DecisionScorer


async def system_one(ctx: RequestContext) -> None:
    """JSON, or (image assets) uncompressed multipart/form-data whose first part is the JSON request
    and whose other parts are the assets' images."""
    ctx.auth()
    headers = ctx.req.headers
    is_multipart = _is_multipart(ctx)
    body = await ctx.read_body(identity_only=is_multipart)
    info = ctx.svc.info
    danger = (headers.get(systemone.DANGER_ZONE_HEADER) or "").strip().lower() == "true"

    def decode() -> systemone.SystemOnePlan:
        # A JSON body is a multipart body's first part alone.
        parts = (multipart.parse_form_data(body, headers.get("content-type") or "") if is_multipart
                 else [multipart.FormPart("", "application/json", body)])
        if not parts or parts[0].content_type != "application/json":
            raise BadRequest("the first part of a multipart System One request must be the application/json request")
        return systemone.decode_systemone(systemone.parse_body(parts[0].data), model=info.public_id,
                                          vision=info.has_vision, danger_zone=danger, parts=parts[1:])

    plan = await ctx.offload(decode)  # a SchemaErrors is rendered as its own 422 body (`dispatch`)
    await _score(ctx, plan.state, [q.question for q in plan.questions], partial(systemone.encode_systemone, plan),
                 dict(plan.images))


async def decide(ctx: RequestContext) -> None:
    ctx.auth()
    if _is_multipart(ctx):
        raise BadRequest("multipart bodies are not supported on this text-only route")
    plan = await ctx.offload(decisions.decode_decisions, await ctx.read_json())
    await _score(ctx, plan.input, [q.question for q in plan.questions], partial(decisions.encode_decisions, plan))


ROUTES: list[Route] = [
    ("POST", "/v1/systemone", system_one),
    ("POST", "/v1/decisions", decide),
]


async def _score(ctx: RequestContext, state: str, questions: Sequence[DecisionQuestion],
                 encode: Callable[[Sequence[QuestionScore], str], dict[str, Any]],
                 images: Mapping[str, ImagePart] | None = None) -> None:
    scorer = DecisionScorer(ctx.svc)
    ctx.admit(1)

    async def run() -> dict[str, Any]:
        return encode(await scorer.score(state, questions, images), scorer.svc.info.public_id)

    await ctx.reply(run)


def _is_multipart(ctx: RequestContext) -> bool:
    """Whether the body is multipart, which must not be content-encoded (415)."""
    is_multipart = (ctx.req.headers.get("content-type") or "").strip().lower().startswith("multipart/")
    if is_multipart and parse_content_encoding(ctx.req.headers.get_list("content-encoding")):
        raise UnsupportedMediaType("multipart request bodies must use identity Content-Encoding")
    return is_multipart
