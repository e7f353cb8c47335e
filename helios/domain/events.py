"""Output events: what the output pipeline publishes and every protocol encoder consumes.

Parsers turn model text into these events; the accumulator orders them; encoders map them to
wire shapes. No torch, no trio.
"""

from __future__ import annotations

import enum

import attrs


class FinishCause(enum.Enum):
    """Why a generation ended, decided at the terminal token (spec: Conversation and tool semantics)."""

    EOS = "eos"  # an honored end-of-sequence token
    STOP_STRING = "stop_string"  # a matched user string stop
    STOP_TOKEN = "stop_token"  # a matched stop_token_ids entry
    LENGTH = "length"  # max_tokens, context limit, or KV page capacity
    ABORTED = "aborted"  # the client went away or the request was cancelled
    ERROR = "error"  # execution or output-validation failure


class FailureKind(enum.Enum):
    """What failed a request the engine ended with an error (``RequestOutput.failure``, set with
    every ERROR finish). The metrics' failure stage comes from it: GRAMMAR is the ``grammar`` stage,
    every other kind ``execution``."""

    GRAMMAR = "grammar"  # its structured-output grammar rejected a committed token
    UNPRODUCIBLE = "unproducible"  # its grammar requires text no token of the vocabulary can give (a 400)
    IMAGE = "image"  # one of its images could not be loaded or encoded
    ENGINE = "engine"  # an engine step raised, or the engine stopped before the request ended
    SHUTDOWN = "shutdown"  # the server's drain ended it (graceful shutdown's abort phase)


@attrs.frozen
class TextDelta:
    text: str


@attrs.frozen
class ReasoningDelta:
    text: str


@attrs.frozen
class ToolCall:
    """One complete client-executed tool call. Published only once its envelope is complete."""

    id: str
    name: str
    arguments: str  # a JSON object, serialized
    index: int = 0


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    image_tokens: int = 0
    """Image feature tokens included in ``prompt_tokens`` (``multimodal_tokens.image``); framing
    tokens around images count in ``prompt_tokens`` only."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen
class Finish:
    cause: FinishCause
    matched_stop: str | int | None = None  # the matched string stop or stop token id
    has_tool_calls: bool = False
    error: str | None = None
    client_error: bool = False
    """An ERROR caused by the request itself (a grammar this model cannot follow): the client's 400."""


OutputEvent = TextDelta | ReasoningDelta | ToolCall | Finish
