"""The two drivers every generating protocol runs on: one streamed, one buffered.

A protocol contributes a `decode()` (wire → `GenerationRequest`) and an encoder; the serving path
contributes everything between: `Service.prepare` once, then one of these drivers, which submit the
children, merge their updates in arrival order, apply the tool-choice output rules
(`helios.serving.toolcheck`) and a failed child's error, and hand each screened update to the
encoder. An encoder is one function from update to events (`feed`), so a buffered response is
exactly what its stream would have built.

Failures: an update that breaks a tool-choice rule, an engine ERROR finish or an ABORTED one fails
the request. Buffered, the driver raises `InternalError` (HTTP 500 in the protocol's shape), or
`BadRequest` where the finish marks the failure as the request's own (`Finish.client_error`: a grammar
that needs text this model's vocabulary cannot give); streamed, the encoder's `fail()` events end the
stream (the events that preceded the failure went out first).
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs

from helios.domain.events import FinishCause
from helios.domain.generation import ChildUpdate, StreamEvent
from helios.errors import BadRequest, HeliosError, InternalError
from helios.serving.pipeline import Prepared, Service, merged
from helios.serving.toolcheck import ToolCallCheck


class Encoder(Protocol):
    """A protocol's encoder: sans-IO, from screened updates to wire events and a final body."""

    @property
    def done(self) -> bool:
        """Every child reached its terminal event (the driver stops reading)."""
        ...

    def start(self) -> list[StreamEvent]:
        """Events that open a stream, written right after the children are enqueued."""
        ...

    def feed(self, index: int, update: ChildUpdate) -> list[StreamEvent]:
        """One child's update (tool rules applied; a failing update arrives without its finish)."""
        ...

    def finish(self) -> list[StreamEvent]:
        """Events that close a stream after every child finished (usage chunks, `[DONE]`)."""
        ...

    def fail(self, error: HeliosError) -> list[StreamEvent]:
        """The protocol's terminal error events for a stream that cannot complete."""
        ...

    def body(self) -> dict[str, Any]:
        """The buffered response, after every child finished."""
        ...


class EventSink(Protocol):
    """Where a streamed response goes (the HTTP layer's SSE writer)."""

    async def start(self) -> None:
        """Send the HTTP status and stream headers now (idempotent)."""
        ...

    async def send(self, event: StreamEvent) -> None: ...


async def run_buffered(svc: Service, prepared: Prepared, encoder: Encoder) -> dict[str, Any]:
    """Generate every child to its end and return the encoder's body; a failure raises."""
    if prepared.children:
        rules = OutputRules.per_child(prepared)
        async with svc.generate(prepared.children, prepared.request.options, prepared.parser_factory) as streams:
            async for i, u in merged(streams):
                screened, failure = rules[i].screen(u)
                encoder.feed(i, screened)
                if failure is not None:
                    raise failure_error(u, failure)
                if encoder.done:
                    break
        if not encoder.done:
            raise InternalError("generation ended without a terminal event")
    encoder.finish()
    return encoder.body()


async def run_streamed(svc: Service, prepared: Prepared, encoder: Encoder, sink: EventSink) -> None:
    """Stream the encoder's events: headers right after enqueue (keepalives are the sink's), each
    update's events as they come, and the closing events or the protocol's terminal error."""

    async def write(events: list[StreamEvent]) -> None:
        for event in events:
            await sink.send(event)

    if not prepared.children:
        await sink.start()
        await write(encoder.start())
        await write(encoder.finish())
        return
    rules = OutputRules.per_child(prepared)
    async with svc.generate(prepared.children, prepared.request.options, prepared.parser_factory) as streams:
        await sink.start()
        await write(encoder.start())
        async for i, u in merged(streams):
            screened, failure = rules[i].screen(u)
            await write(encoder.feed(i, screened))
            if failure is not None:
                await write(encoder.fail(failure_error(u, failure)))
                return
            if encoder.done:
                break
    if not encoder.done:
        await write(encoder.fail(InternalError("generation ended without a terminal event")))
        return
    await write(encoder.finish())


@attrs.define
class OutputRules:
    """One child's output rules: the tool-choice rules of a conversation, and failed finishes."""

    check: ToolCallCheck | None = None

    @classmethod
    def per_child(cls, prepared: Prepared) -> list[OutputRules]:
        conv = prepared.request.conversation
        return [cls(ToolCallCheck.for_conversation(conv, validators=prepared.tool_validators) if conv is not None
                    else None) for _ in prepared.children]

    def screen(self, u: ChildUpdate) -> tuple[ChildUpdate, str | None]:
        """The update as the encoder may emit it, and why the request fails (None: it does not)."""
        events, failure = self.check.screen(u.events) if self.check is not None else (u.events, None)
        finish = u.finish
        if failure is None and finish is not None:
            if finish.cause is FinishCause.ERROR:
                failure = finish.error or "generation failed"
            elif finish.cause is FinishCause.ABORTED:
                failure = "generation was aborted"
            elif self.check is not None:
                failure = self.check.check_finish(finish.cause)
        if failure is not None:
            return attrs.evolve(u, events=events, finish=None), failure
        return (u if events is u.events else attrs.evolve(u, events=events)), None


def failure_error(u: ChildUpdate, failure: str) -> HeliosError:
    """The error a failed update's request ends with: the client's 400 where the engine's failure is
    the request's own (`Finish.client_error`) and is the one `OutputRules.screen` reported, else a 500."""
    finish = u.finish
    if finish is not None and finish.client_error and failure == finish.error:
        return BadRequest(failure)
    return InternalError(failure)
