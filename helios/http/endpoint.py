"""The one runner behind every generating route, and the request half it shares with count_tokens.

An `Endpoint` declares how a POST route's JSON request is accepted: the protocol's authentication
(bearer, or Anthropic's x-api-key with its `anthropic-version` header), the body's item limits, the
frontend decoder (run on the frontend pool) and the HTTP admission slots a decoded request takes.
A `Generation` is a route handler: it accepts its endpoint's request, prepares the generation once,
makes the protocol's encoder (every encoder takes the same arguments, `MakeEncoder`) and runs it
through the one driver, buffered (`RequestContext.reply`) or streamed (an `EventStream`, under
`RequestContext.run_cancellable`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import attrs

from helios.domain.generation import GenerationRequest, PreparedPrompt
from helios.domain.model import ModelInfo, TokenVocabulary
from helios.domain.sampling import SamplingParams
from helios.frontends.anthropic.messages import check_version
from helios.frontends.wire import CountLimit
from helios.http.context import RequestContext
from helios.http.sse import EventStream
from helios.serving.drive import Encoder, run_buffered, run_streamed


class GenerationPlan(Protocol):
    """What every protocol's decoder returns for a generating request."""

    @property
    def generation(self) -> GenerationRequest: ...

    @property
    def stream(self) -> bool: ...


P = TypeVar("P")
G = TypeVar("G", bound=GenerationPlan)
G_contra = TypeVar("G_contra", bound=GenerationPlan, contravariant=True)


class MakeEncoder(Protocol[G_contra]):
    """A protocol's encoder for a prepared request: its plan, the prompts as tokenized, the served
    model's name, the vocabulary and the first child's resolved sampling (an encoder ignores what it
    does not use: only Responses echoes the sampling, and Messages reads no tokens)."""

    def __call__(self, plan: G_contra, prompts: Sequence[PreparedPrompt], *, model: str,
                 vocab: TokenVocabulary, sampling: SamplingParams) -> Encoder: ...


@attrs.frozen
class Endpoint(Generic[P]):
    limits: Sequence[CountLimit]
    decode: Callable[[dict[str, Any], ModelInfo], P]
    slots: Callable[[P], int] = lambda plan: 1
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
    encoder: MakeEncoder[G]

    async def __call__(self, ctx: RequestContext) -> None:
        plan = await self.endpoint.accept(ctx)
        svc = ctx.svc
        prepared = await svc.prepare(plan.generation, inline=ctx.inline)
        # The first child's sampling (a request that submits nothing reads none: Completions' max_tokens 0)
        sampling = prepared.children[0].sampling if prepared.children else SamplingParams()
        encoder = ctx.encoder = self.encoder(plan, prepared.prompts, model=svc.info.public_id, vocab=svc,
                                             sampling=sampling)
        if not plan.stream:
            await ctx.reply(lambda: run_buffered(svc, prepared, encoder))
            return
        out = ctx.stream = EventStream(ctx.send, ctx.headers())

        async def streamed() -> None:
            await run_streamed(svc, prepared, encoder, out)
            await out.close()

        await ctx.run_cancellable(streamed, out)
