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
from typing import Any

from helios.domain.events import FinishCause, ReasoningDelta, TextDelta, ToolCall
from helios.domain.generation import Accumulated, ChildUpdate, PreparedPrompt, StreamEvent, usage_of
from helios.domain.shapes import to_json
from helios.errors import HeliosError
from helios.frontends.anthropic import shapes
from helios.frontends.anthropic.messages import MessagesPlan, thinking_signature


def tool_use_id(call_id: str) -> str:
    """Anthropic-style ids for generated calls; a model's own id (Kimi's, or one already ``toolu_``)
    is kept as it is."""
    if call_id.startswith("call_"):
        return "toolu_" + call_id[len("call_"):]
    return call_id or "toolu_" + uuid.uuid4().hex


_STOP_REASONS = {FinishCause.LENGTH: "max_tokens", FinishCause.STOP_STRING: "stop_sequence"}


def stop_reason(cause: FinishCause, has_calls: bool) -> str:
    """Spec, "Conversation and tool semantics": the terminal cause → Messages stop_reason."""
    return _STOP_REASONS.get(cause) or ("tool_use" if has_calls else "end_turn")


def _event(shape: Any) -> StreamEvent:
    """A named Messages event: its name is its type."""
    return StreamEvent(shape, shape.type)


class MessagesEncoder:
    """One child's screened updates → ordered Anthropic content blocks and the named SSE events that
    build them; the buffered Message is the same blocks (`body`). The tool-choice output rules are
    the drivers' (`helios.serving.drive`): a call that breaks one never reaches the encoder, and the
    stream ends with `fail`'s `error` event."""

    def __init__(self, plan: MessagesPlan, prompts: Sequence[PreparedPrompt], *, model: str,
                 message_id: str | None = None, vocab: object = None, sampling: object = None) -> None:
        self.id = message_id or "msg_" + uuid.uuid4().hex
        self.model = model
        self.hide_thinking = plan.hide_thinking
        self.content: list[shapes.ContentBlock] = []
        self.stop = shapes.StopDetails(stop_reason=None, stop_sequence=None)  # the terminal update's
        self.prompts = tuple(prompts)
        self.acc = Accumulated()  # the counts usage is built from
        self._open: shapes.TextBlock | shapes.ThinkingBlock | None = None  # the block deltas extend

    @property
    def done(self) -> bool:
        return self.stop.stop_reason is not None

    def start(self) -> list[StreamEvent]:
        return [_event(shapes.MessageStart(message=self._message([])))]

    def feed(self, index: int, u: ChildUpdate) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        if self.done:
            return out
        self.acc.add_counts(u)  # the blocks are built here; the accumulator only counts
        for e in u.events:
            if isinstance(e, TextDelta) and e.text:
                out += self._delta(shapes.TextBlock, e.text)
            elif isinstance(e, ReasoningDelta) and e.text:  # omitted thinking: the block without its text
                out += self._delta(shapes.ThinkingBlock, "" if self.hide_thinking else e.text)
            elif isinstance(e, ToolCall):
                out += self._tool_use(e)
        f = u.finish
        if f is None:
            return out
        out += self._close()
        matched = f.matched_stop if f.cause is FinishCause.STOP_STRING else None
        has_calls = any(type(b) is shapes.ToolUseBlock for b in self.content)
        self.stop = shapes.StopDetails(stop_reason=stop_reason(f.cause, has_calls),
                                       stop_sequence=matched if isinstance(matched, str) else None)
        return [*out, _event(shapes.MessageDelta(delta=self.stop, usage=self.usage())), _event(shapes.MessageStop())]

    def finish(self) -> list[StreamEvent]:
        return []  # message_stop went out with the terminal update

    def fail(self, error: HeliosError) -> list[StreamEvent]:
        return [StreamEvent(error.to_anthropic(), "error")]

    def body(self) -> dict[str, Any]:
        """The buffered Message (after the terminal update)."""
        return to_json(self._message(self.content))  # type: ignore[no-any-return]

    def usage(self) -> shapes.Usage:
        """Messages usage: input_tokens excludes what was read from the cache (cache_read_input_tokens)."""
        usage = usage_of(self.prompts, [self.acc], 1)
        cached = min(usage.cached_tokens, usage.prompt_tokens)
        return shapes.Usage(input_tokens=usage.prompt_tokens - cached, output_tokens=usage.completion_tokens,
                            cache_creation_input_tokens=0, cache_read_input_tokens=cached)

    # -- helpers ----------------------------------------------------------------------------------

    def _message(self, content: list[shapes.ContentBlock]) -> shapes.Message:
        return shapes.Message(id=self.id, model=self.model, content=content, stop=self.stop, usage=self.usage())

    def _delta(self, kind: type[shapes.TextBlock | shapes.ThinkingBlock], text: str) -> list[StreamEvent]:
        """`text` appended to the open block, a `kind` block opened first where the open one is not
        (an empty `text` only opens it)."""
        out: list[StreamEvent] = []
        block = self._open
        if type(block) is not kind:
            block = kind()
            out = self._close() + self._start(kind(), block)
            self._open = block
        if not text:
            return out
        if isinstance(block, shapes.TextBlock):
            block.text += text
            delta: shapes.TextDelta | shapes.ThinkingDelta = shapes.TextDelta(text=text)
        else:
            block.thinking += text
            delta = shapes.ThinkingDelta(thinking=text)
        out.append(_event(shapes.ContentBlockDelta(index=len(self.content) - 1, delta=delta)))
        return out

    def _tool_use(self, call: ToolCall) -> list[StreamEvent]:
        """A whole tool_use block: its start, its input as one delta, its stop."""
        args = call.arguments if call.arguments.strip() else "{}"
        tid = tool_use_id(call.id)
        out = self._close() + self._start(shapes.ToolUseBlock(id=tid, name=call.name, input={}),
                                          shapes.ToolUseBlock(id=tid, name=call.name, input=json.loads(args)))
        index = len(self.content) - 1
        delta = shapes.InputJSONDelta(partial_json=args)
        return [*out, _event(shapes.ContentBlockDelta(index=index, delta=delta)),
                _event(shapes.ContentBlockStop(index=index))]

    def _start(self, block: shapes.ContentBlock, content: shapes.ContentBlock) -> list[StreamEvent]:
        """`block` as it starts on the wire; `content` the message's own block, which deltas extend."""
        self.content.append(content)
        return [_event(shapes.ContentBlockStart(index=len(self.content) - 1, content_block=block))]

    def _close(self) -> list[StreamEvent]:
        """The open block's end (a thinking block's signature first)."""
        block, self._open = self._open, None
        if block is None:
            return []
        index = len(self.content) - 1
        stop = _event(shapes.ContentBlockStop(index=index))
        if not isinstance(block, shapes.ThinkingBlock):
            return [stop]
        block.signature = thinking_signature(block.thinking)
        signature = shapes.SignatureDelta(signature=block.signature)
        return [_event(shapes.ContentBlockDelta(index=index, delta=signature)), stop]
