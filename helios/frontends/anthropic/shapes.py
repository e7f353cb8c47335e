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


@shape(tag="text")
class TextBlock:
    text: str = ""


@shape(tag="thinking")
class ThinkingBlock:
    thinking: str = ""
    signature: str = ""


@shape(tag="tool_use")
class ToolUseBlock:
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


@shape(tag="text_delta")
class TextDelta:
    text: str


@shape(tag="thinking_delta")
class ThinkingDelta:
    thinking: str


@shape(tag="signature_delta")
class SignatureDelta:
    signature: str


@shape(tag="input_json_delta")
class InputJSONDelta:
    partial_json: str


@shape(tag="message_start")
class MessageStart:
    message: Message


@shape(tag="content_block_start")
class ContentBlockStart:
    index: int
    content_block: ContentBlock


@shape(tag="content_block_delta")
class ContentBlockDelta:
    index: int
    delta: TextDelta | ThinkingDelta | SignatureDelta | InputJSONDelta


@shape(tag="content_block_stop")
class ContentBlockStop:
    index: int


@shape(tag="message_delta")
class MessageDelta:
    delta: StopDetails
    usage: Usage


@shape(tag="message_stop")
class MessageStop:
    """The stream's last event: its type alone."""

