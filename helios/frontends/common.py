"""Protocol-neutral helpers shared by the frontends: merging child streams, accumulation, writers."""

from __future__ import annotations

import time
import uuid
from typing import Any, Protocol

import attrs

from helios.domain.events import Finish, FinishCause, OutputEvent, ReasoningDelta, TextDelta, ToolCall
from helios.errors import BadRequest
from helios.serving.output import ChildUpdate
from helios.serving.pipeline import merged as merged


class EventWriter(Protocol):
    """What a streaming frontend writes to (the asgi SSE writer satisfies it)."""

    async def start(self) -> None:
        """Send the HTTP status and SSE headers now (idempotent; the first event also sends them).

        Streams call it right after their children are enqueued, so a client sees 200 and the
        spec's keepalive comments while a long prefill runs, not silence until the first token."""
        ...

    async def event(self, data: str | dict[str, Any], event: str | None = None) -> None: ...
    async def done_marker(self) -> None: ...


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


@attrs.define
class Accumulated:
    """The ordered output of one child: what buffered responses encode."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = attrs.field(factory=list)
    blocks: list[OutputEvent] = attrs.field(factory=list)  # ordered, adjacent deltas merged
    token_ids: list[int] = attrs.field(factory=list)
    logprobs: list[Any] = attrs.field(factory=list)
    logprob_offsets: list[int] = attrs.field(factory=list)
    prompt_logprobs: list[Any] | None = None  # prompt scores in position order, when requested
    finish: Finish | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_reasoning_tokens: int = 0

    def add(self, u: ChildUpdate) -> None:
        for e in u.events:
            if isinstance(e, TextDelta):
                self.text += e.text
            elif isinstance(e, ReasoningDelta):
                self.reasoning += e.text
            elif isinstance(e, ToolCall):
                self.tool_calls.append(e)
            if self.blocks and type(self.blocks[-1]) is type(e) and isinstance(e, TextDelta | ReasoningDelta):
                last = self.blocks[-1]
                self.blocks[-1] = type(e)(last.text + e.text)  # type: ignore[union-attr]
            elif not isinstance(e, Finish):
                self.blocks.append(e)
        self.num_reasoning_tokens = u.num_reasoning_tokens
        self.token_ids.extend(u.token_ids)
        if u.logprobs:
            self.logprobs.extend(u.logprobs)
            self.logprob_offsets.extend(u.logprob_offsets)
        if u.prompt_logprobs is not None:
            if self.prompt_logprobs is None:
                self.prompt_logprobs = []
            self.prompt_logprobs.extend(u.prompt_logprobs)
        self.num_prompt_tokens = u.num_prompt_tokens
        self.num_output_tokens = u.num_output_tokens
        self.num_cached_tokens = u.num_cached_tokens
        if u.finish is not None:
            self.finish = u.finish


def validate_stops(stop: Any, param: str = "stop") -> tuple[str, ...]:
    """At most four nonempty strings totalling at most 4096 UTF-8 bytes."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise BadRequest(f"'{param}' must be a string or an array of strings", param=param)
    if len(stops) > 4:
        raise BadRequest(f"'{param}' accepts at most 4 sequences", param=param)
    if any(s == "" for s in stops):
        raise BadRequest(f"'{param}' sequences must be nonempty", param=param)
    if sum(len(s.encode()) for s in stops) > 4096:
        raise BadRequest(f"'{param}' sequences total more than 4096 UTF-8 bytes", param=param)
    return tuple(stops)


def validate_stop_token_ids(ids: Any, vocab_size: int, param: str = "stop_token_ids") -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise BadRequest(f"'{param}' must be an array of token ids", param=param)
    if len(ids) > 16:
        raise BadRequest(f"'{param}' accepts at most 16 token ids", param=param)
    for i in ids:
        if not 0 <= i < vocab_size:
            raise BadRequest(f"'{param}' contains {i}, outside the vocabulary (0..{vocab_size - 1})", param=param)
    return tuple(ids)


def is_error_finish(f: Finish | None) -> bool:
    return f is not None and f.cause is FinishCause.ERROR
