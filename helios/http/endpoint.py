"""The one runner behind every generating route, and the request half it shares with count_tokens.

An `Endpoint` declares how a POST route's JSON request is accepted: the protocol's authentication
(bearer, or Anthropic's x-api-key with its `anthropic-version` header), the body's item limits, the
frontend decoder (run on the frontend pool) and the HTTP admission slots a decoded request takes.
A `Generation` is a route handler: it accepts its endpoint's request, prepares the generation once,
builds the protocol's encoder and runs it through the one driver, buffered or streamed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import attrs

from helios.domain.generation import GenerationRequest
from helios.domain.model import ModelInfo
from helios.frontends.anthropic.messages import check_version
from helios.frontends.wire import CountLimit
from helios.http.context import RequestContext
from helios.serving.drive import Encoder
from helios.serving.pipeline import Prepared, Service


class GenerationPlan(Protocol):
    """What every protocol's decoder returns for a generating request."""

    @property
    def generation(self) -> GenerationRequest: ...

    @property
    def stream(self) -> bool: ...


P = TypeVar("P")
G = TypeVar("G", bound=GenerationPlan)


def one_slot(plan: object) -> int:
    return 1


@attrs.frozen
class Endpoint(Generic[P]):
    limits: Sequence[CountLimit]
    decode: Callable[[dict[str, Any], ModelInfo], P]
    slots: Callable[[P], int] = one_slot
    """Admission slots, from the decoded request (before any prompt is tokenized)."""
    anthropic: bool = False

    async def accept(self, ctx: RequestContext) -> P:
        ctx.auth(anthropic=self.anthropic)
        if self.anthropic:
            check_version(ctx.req.headers.get("anthropic-version"))
        obj = await ctx.read_json(self.limits)
        plan = await ctx.offload(self.decode, obj, ctx.svc.info)
        ctx.admit(self.slots(plan))
        return plan


@attrs.frozen
class Generation(Generic[G]):
    endpoint: Endpoint[G]
    encoder: Callable[[G, Prepared, Service], Encoder]

    async def __call__(self, ctx: RequestContext) -> None:
        plan = await self.endpoint.accept(ctx)
        svc = ctx.svc
        prepared = await svc.prepare(plan.generation)
        await ctx.generate(prepared, self.encoder(plan, prepared, svc), stream=plan.stream)
