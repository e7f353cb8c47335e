"""The Messages output shapes, declared once (the anthropic SDK's `types.Message` and
`RawMessageStreamEvent` are the reference): the Message, its content blocks, usage, and each stream
event. The encoder builds these; `helios.domain.shapes.to_json` writes them. (The terminal `error`
event is the error's own rendering, `HeliosError.to_anthropic`, as for an error body.)"""

from __future__ import annotations

from typing import Any, Literal

from helios.domain.shapes import flat, shape


@shape
class Usage:
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int


@shape
class TextBlock:
    type: Literal["text"] = "text"
    text: str = ""


@shape
class ThinkingBlock:
    type: Literal["thinking"] = "thinking"
    thinking: str = ""
    signature: str = ""


@shape
class ToolUseBlock:
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock


@shape
class StopDetails:
    stop_reason: str | None
    stop_sequence: str | None


@shape
class Message:
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop: StopDetails = flat()  # stop_reason and stop_sequence
    usage: Usage


@shape
class TextDelta:
    type: Literal["text_delta"] = "text_delta"
    text: str


@shape
class ThinkingDelta:
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


@shape
class SignatureDelta:
    type: Literal["signature_delta"] = "signature_delta"
    signature: str


@shape
class InputJSONDelta:
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


@shape
class MessageStart:
    type: Literal["message_start"] = "message_start"
    message: Message


@shape
class ContentBlockStart:
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentBlock


@shape
class ContentBlockDelta:
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | ThinkingDelta | SignatureDelta | InputJSONDelta


@shape
class ContentBlockStop:
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


@shape
class MessageDelta:
    type: Literal["message_delta"] = "message_delta"
    delta: StopDetails
    usage: Usage


@shape
class MessageStop:
    type: Literal["message_stop"] = "message_stop"

