"""POST /v1/messages, the output side: the sans-IO encoder that turns one child's screened updates
into ordered content blocks and named SSE events, and the buffered Message (the request side is
`helios.frontends.anthropic.messages`).

Streamed events, in order (each SSE ``data`` object carries ``"type"`` equal to the event name)::

    message_start                      message with empty content; usage input = the full prompt
    (content_block_start                  per block, in output order: thinking, text or tool_use
     content_block_delta*                 thinking_delta / text_delta / input_json_delta
     [content_block_delta]                signature_delta, thinking blocks only, just before stop
     content_block_stop)*
    message_delta                      stop_reason, stop_sequence, final usage
    message_stop

A failure after the stream started ends it with ``event: error`` (rendered by the app).
Buffered responses are the same encoder's blocks (`MessagesEncoder.body`), so the two never disagree.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from typing import Any, Literal

from helios.domain.events import FinishCause, ReasoningDelta, TextDelta, ToolCall
from helios.domain.generation import (
    Accumulated,
    ChildUpdate,
    PreparedPrompt,
    StreamEvent,
    usage_of,
)
from helios.domain.shapes import to_json
from helios.errors import HeliosError
from helios.frontends.anthropic import shapes
from helios.frontends.anthropic.messages import MessagesPlan, thinking_signature


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def tool_use_id(call_id: str) -> str:
    """Anthropic-style ids for generated calls; a model's own id (Kimi) is kept as it is."""
    if call_id.startswith("toolu_"):
        return call_id
    if call_id.startswith("call_"):
        return "toolu_" + call_id[len("call_"):]
    return call_id or "toolu_" + uuid.uuid4().hex


def stop_reason(cause: FinishCause, has_calls: bool) -> str:
    """Spec, "Conversation and tool semantics": the terminal cause → Messages stop_reason."""
    if cause is FinishCause.LENGTH:
        return "max_tokens"
    if cause is FinishCause.STOP_STRING:
        return "stop_sequence"
    if has_calls:
        return "tool_use"
    return "end_turn"


BlockKind = Literal["text", "thinking", "tool_use"]


def _event(shape: Any) -> StreamEvent:
    """A named Messages event: its name is its type."""
    return StreamEvent(shape, shape.type)


class MessagesEncoder:
    """One child's screened updates → ordered Anthropic content blocks and the named SSE events that
    build them; the buffered Message is the same blocks (`body`). The tool-choice output rules are
    the drivers' (`helios.serving.drive`): a call that breaks one never reaches the encoder, and the
    stream ends with `fail`'s `error` event."""

    def __init__(self, plan: MessagesPlan, prompts: Sequence[PreparedPrompt], *, model: str,
                 message_id: str | None = None) -> None:
        self.id = message_id or new_message_id()
        self.model = model
        self.hide_thinking = plan.hide_thinking
        self.content: list[shapes.ContentBlock] = []
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.prompts = tuple(prompts)
        self.acc = Accumulated()  # the counts usage is built from
        self.num_calls = 0
        self._open: BlockKind | None = None

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def start(self) -> list[StreamEvent]:
        return [_event(shapes.MessageStart(message=self._message([], None, None)))]

    def feed(self, index: int, u: ChildUpdate) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        if self.done:
            return out
        self.acc.add_counts(u)  # the blocks are built here; the accumulator only counts
        for e in u.events:
            if isinstance(e, TextDelta):
                if e.text:
                    out += self._delta("text", e.text)
            elif isinstance(e, ReasoningDelta):
                if e.text and self.hide_thinking:
                    out += self._ensure_open("thinking")
                elif e.text:
                    out += self._delta("thinking", e.text)
            elif isinstance(e, ToolCall):
                out += self._tool_use(e)
        f = u.finish
        if f is None:
            return out
        out += self._close()
        self.stop_reason = stop_reason(f.cause, self.num_calls > 0)
        self.stop_sequence = f.matched_stop if isinstance(f.matched_stop, str) and f.cause is FinishCause.STOP_STRING else None
        stop = shapes.StopDetails(stop_reason=self.stop_reason, stop_sequence=self.stop_sequence)
        out.append(_event(shapes.MessageDelta(delta=stop,
                                       usage=self.usage())))
        out.append(_event(shapes.MessageStop()))
        return out

    def finish(self) -> list[StreamEvent]:
        return []  # message_stop went out with the terminal update

    def fail(self, error: HeliosError) -> list[StreamEvent]:
        return [StreamEvent(error.to_anthropic(), "error")]

    def body(self) -> dict[str, Any]:
        """The buffered Message (after the terminal update)."""
        message = self._message(self.content, self.stop_reason, self.stop_sequence)
        return to_json(message)  # type: ignore[no-any-return]

    def usage(self) -> shapes.Usage:
        """Messages usage: input_tokens excludes what was read from the cache (cache_read_input_tokens)."""
        usage = usage_of(self.prompts, [self.acc], 1)
        cached = min(usage.cached_tokens, usage.prompt_tokens)
        return shapes.Usage(input_tokens=usage.prompt_tokens - cached, output_tokens=usage.completion_tokens,
                     cache_creation_input_tokens=0, cache_read_input_tokens=cached)

    # -- helpers ----------------------------------------------------------------------------------

    def _message(self, content: list[shapes.ContentBlock], reason: str | None,
                 sequence: str | None) -> shapes.Message:
        return shapes.Message(id=self.id, model=self.model, content=content, stop_reason=reason,
                              stop_sequence=sequence,
                       usage=self.usage())

    def _ensure_open(self, kind: Literal["text", "thinking"]) -> list[StreamEvent]:
        if self._open == kind:
            return []
        new = shapes.TextBlock if kind == "text" else shapes.ThinkingBlock
        return self._close() + self._open_block(kind, new(), new())

    def _delta(self, kind: Literal["text", "thinking"], text: str) -> list[StreamEvent]:
        out = self._ensure_open(kind)
        cur = self.content[-1]
        delta: shapes.TextDelta | shapes.ThinkingDelta
        if isinstance(cur, shapes.TextBlock):
            cur.text += text
            delta = shapes.TextDelta(text=text)
        else:
            assert isinstance(cur, shapes.ThinkingBlock)
            cur.thinking += text
            delta = shapes.ThinkingDelta(thinking=text)
        out.append(_event(shapes.ContentBlockDelta(index=len(self.content) - 1, delta=delta)))
        return out

    def _tool_use(self, call: ToolCall) -> list[StreamEvent]:
        out = self._close()
        self.num_calls += 1
        args = call.arguments if call.arguments.strip() else "{}"
        tid = tool_use_id(call.id)
        out += self._open_block("tool_use", shapes.ToolUseBlock(id=tid, name=call.name, input={}),
                                shapes.ToolUseBlock(id=tid, name=call.name, input=json.loads(args)))
        index = len(self.content) - 1
        out.append(_event(shapes.ContentBlockDelta(index=index, delta=shapes.InputJSONDelta(partial_json=args))))
        out += self._close()
        return out

    def _open_block(self, kind: BlockKind, block: shapes.ContentBlock,
                    content: shapes.ContentBlock) -> list[StreamEvent]:
        """`block` as it starts on the wire; `content` the message's own block, which deltas extend."""
        self.content.append(content)
        self._open = kind
        return [_event(shapes.ContentBlockStart(index=len(self.content) - 1, content_block=block))]

    def _close(self) -> list[StreamEvent]:
        if self._open is None:
            return []
        out: list[StreamEvent] = []
        index = len(self.content) - 1
        block = self.content[index]
        if isinstance(block, shapes.ThinkingBlock):
            block.signature = thinking_signature(block.thinking)
            signature = shapes.SignatureDelta(signature=block.signature)
            out.append(_event(shapes.ContentBlockDelta(index=index, delta=signature)))
        out.append(_event(shapes.ContentBlockStop(index=index)))
        self._open = None
        return out
