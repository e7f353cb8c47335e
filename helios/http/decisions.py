"""POST /v1/systemone and POST /v1/decisions (spec: System One decisions, Decisions).

Both routes score with the one `helios.serving.decisions.DecisionScorer`; authentication and
operational errors use the Chat Completions error shape, System One schema failures its own 422
``{"detail": [...]}``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from helios.asgi.request import parse_content_encoding
from helios.domain.decisions import DecisionQuestion, QuestionScore
from helios.errors import BadRequest, UnsupportedMediaType
from helios.frontends.decisions import decisions, systemone
from helios.http.context import RequestContext
from helios.http.dispatch import Route
from helios.serving.decisions import DecisionScorer


async def system_one(ctx: RequestContext) -> None:
    ctx.auth()
    _reject_multipart(ctx, text_only_route=False)
    body = await ctx.read_body()
    try:
        plan = await ctx.offload(lambda: systemone.decode_systemone(systemone.parse_body(body)))
    except systemone.SchemaErrors as exc:
        await ctx.json(exc.body(), status=exc.status)
        return
    await _score(ctx, plan.state, [q.question for q in plan.questions],
                 lambda scores, model: systemone.encode_systemone(plan, scores, model))


async def decide(ctx: RequestContext) -> None:
    ctx.auth()
    _reject_multipart(ctx, text_only_route=True)
    plan = await ctx.offload(decisions.decode_decisions, await ctx.read_json())
    await _score(ctx, plan.input, [q.question for q in plan.questions],
                 lambda scores, model: decisions.encode_decisions(plan, scores, model))


ROUTES: list[Route] = [
    ("POST", "/v1/systemone", system_one),
    ("POST", "/v1/decisions", decide),
]


async def _score(ctx: RequestContext, state: str, questions: Sequence[DecisionQuestion],
                 encode: Callable[[Sequence[QuestionScore], str], dict[str, Any]]) -> None:
    svc = ctx.svc
    scorer = DecisionScorer(svc)
    ctx.admit(1)
    result: dict[str, Any] = {}

    async def run() -> None:
        result.update(encode(await scorer.score(state, questions), svc.info.public_id))

    await ctx.run_cancellable(run)
    if result:
        await ctx.json(result)


def _reject_multipart(ctx: RequestContext, *, text_only_route: bool) -> None:
    content_type = (ctx.req.headers.get("content-type") or "").strip().lower()
    if not content_type.startswith("multipart/"):
        return
    if parse_content_encoding(ctx.req.headers.get_list("content-encoding")):
        raise UnsupportedMediaType("multipart request bodies must use identity Content-Encoding")
    if text_only_route:
        raise BadRequest("multipart bodies are not supported on this text-only route")
    raise BadRequest("multipart image assets need TypeSafe-Danger-Zone-Images: true and a vision core; this "
                     "model is text-only")


