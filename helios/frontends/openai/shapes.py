"""The OpenAI output shapes, declared once (field names, order and presence as the wire has them;
the openai SDK's `types.chat`, `types.completion*` and `types.responses` are the reference): Chat
Completions bodies and chunks, Completions, logprob entries, usage, and the Responses object, its
output items, content parts and every stream event. The encoders build these;
`helios.domain.shapes.to_json` writes them. `Opt` fields are absent from the wire unless set."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import attrs

from helios.domain.shapes import OMIT, Opt, flat, shape

# -- logprobs and usage (Chat, Completions; Responses reuses the Chat entry) ------------------------


@shape
class TopLogprob:
    token: str
    logprob: float
    bytes: Sequence[int]  # the token's bytes object: written as its list of byte values


@shape
class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


LogprobEntries = Sequence[ChatLogprob | dict[str, Any]]
"""Responses logprob entries: built by the encoder's `logprob_content` (Chat entries, or their JSON)."""


@shape
class ChoiceLogprobs:
    content: list[ChatLogprob]


@shape
class CompletionLogprobs:
    tokens: list[str] = attrs.field(factory=list)
    token_logprobs: list[float | None] = attrs.field(factory=list)
    top_logprobs: list[dict[str, float] | None] = attrs.field(factory=list)
    text_offset: list[int] = attrs.field(factory=list)


@shape
class PromptScore:
    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptScore] | None]


@shape
class ModalityTokens:
    image: int


@shape
class PromptTokensDetails:
    cached_tokens: int
    multimodal_tokens: Opt[ModalityTokens] = OMIT


@shape
class CompletionTokensDetails:
    reasoning_tokens: int


@shape
class CompletionUsage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: Opt[CompletionTokensDetails] = OMIT


# -- Chat Completions -----------------------------------------------------------------------------------


@shape
class Function:
    name: str
    arguments: str


@shape
class ToolCall:
    id: str
    type: Literal["function"] = "function"
    index: Opt[int] = OMIT  # chunks only
    function: Function


@shape
class Delta:
    role: Opt[Literal["assistant"]] = OMIT
    content: Opt[str] = OMIT
    reasoning_content: Opt[str] = OMIT
    reasoning: Opt[str] = OMIT
    tool_calls: Opt[list[ToolCall]] = OMIT


@shape
class ChatCompletionMessage:
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: Opt[str] = OMIT
    reasoning: Opt[str] = OMIT
    tool_calls: Opt[list[ToolCall]] = OMIT


@shape
class ChunkChoice:
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: Opt[str | int | list[int] | None] = OMIT  # on the finish chunk
    token_ids: Opt[Sequence[int]] = OMIT
    token_timestamps: Opt[Sequence[float]] = OMIT


@shape
class ChatChoice:
    index: int
    message: ChatCompletionMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: str
    stop_reason: str | int | list[int] | None
    token_ids: Opt[Sequence[int]] = OMIT
    token_timestamps: Opt[Sequence[float]] = OMIT


@shape
class ChatCompletionChunk:
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    prompt_token_ids: Opt[Sequence[int]] = OMIT
    usage: Opt[CompletionUsage] = OMIT


@shape
class ChatCompletion:
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage
    prompt_logprobs: PromptLogprobs | None
    prompt_token_ids: Opt[Sequence[int]] = OMIT


# -- Completions ------------------------------------------------------------------------------------------


@shape
class CompletionChoice:
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | list[int] | None = None
    prompt_logprobs: Opt[PromptLogprobs | None] = OMIT  # buffered bodies only
    prompt_token_ids: Opt[Sequence[int]] = OMIT
    token_ids: Opt[Sequence[int]] = OMIT
    token_timestamps: Opt[Sequence[float]] = OMIT


@shape
class Completion:
    """A buffered body, or one chunk of a stream (the same object type on the wire)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Opt[CompletionUsage] = OMIT


# -- Responses: the Response object ----------------------------------------------------------------------


@shape
class ResponseParams:
    """The request parameters a Response echoes (tools, tool_choice, text and metadata as sent;
    background, store and truncation are what Helios does)."""

    background: bool = False
    instructions: Any
    max_output_tokens: int | None
    max_tool_calls: Opt[int | None] = OMIT
    metadata: dict[str, Any]
    model: str
    parallel_tool_calls: bool
    previous_response_id: Opt[None] = OMIT
    prompt_cache_key: Opt[str | None] = OMIT
    reasoning: dict[str, Any]
    safety_identifier: Opt[str | None] = OMIT
    service_tier: Opt[str] = OMIT
    store: bool = False
    temperature: float | None
    text: Any
    tool_choice: Any
    tools: list[Any]
    top_logprobs: Opt[int] = OMIT
    top_p: float | None
    truncation: str = "disabled"
    user: Opt[str | None] = OMIT


@shape(tag="reasoning_text")
class ReasoningText:
    text: str


@shape(tag="output_text")
class OutputText:
    text: str
    annotations: list[Any]
    logprobs: LogprobEntries


@shape(tag="reasoning")
class ReasoningItem:
    id: str
    summary: list[Any]
    content: list[ReasoningText]


@shape(tag="message")
class MessageItem:
    id: str
    status: str
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


@shape(tag="function_call")
class FunctionCallItem:
    id: str
    call_id: str
    name: str
    arguments: str
    status: str
    namespace: Opt[str] = OMIT


@shape(tag="custom_tool_call")
class CustomToolCallItem:
    id: str
    call_id: str
    name: str
    input: str
    namespace: Opt[str] = OMIT


OutputItem = ReasoningItem | MessageItem | FunctionCallItem | CustomToolCallItem
ContentPart = OutputText | ReasoningText


@shape
class ResponseError:
    code: str
    message: str


@shape
class IncompleteDetails:
    reason: str


@shape
class InputTokensDetails:
    cached_tokens: int
    cache_write_tokens: int


@shape
class OutputTokensDetails:
    reasoning_tokens: int


@shape
class ResponseUsage:
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


@shape
class Response:
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: str = "in_progress"
    completed_at: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    params: ResponseParams = flat()
    output: list[OutputItem] = attrs.field(factory=list)
    usage: ResponseUsage | None = None  # set at the end


# -- Responses: the stream events ------------------------------------------------------------------------


@shape
class ResponseStreamEvent:
    """What every event the encoder makes begins with (the HTTP layer's `ErrorEvent` has no
    sequence_number). The events about one item, and about one of its content parts, share their
    next fields through the bases below, which keep the wire's field order."""

    type: str
    sequence_number: int


@shape
class ResponseEvent(ResponseStreamEvent):
    """response.created, response.in_progress, then response.completed, .incomplete or .failed."""

    response: Response


@shape
class OutputItemEvent(ResponseStreamEvent):
    """response.output_item.added and response.output_item.done."""

    output_index: int
    item: OutputItem


@shape
class ItemEventFields(ResponseStreamEvent):
    item_id: str
    output_index: int


@shape
class CallDeltaEvent(ItemEventFields):
    """response.function_call_arguments.delta and response.custom_tool_call_input.delta."""

    delta: str


@shape
class FunctionCallDoneEvent(ItemEventFields):
    """response.function_call_arguments.done."""

    name: str
    arguments: str


@shape
class CustomToolCallDoneEvent(ItemEventFields):
    """response.custom_tool_call_input.done."""

    input: str


@shape
class PartEventFields(ItemEventFields):
    content_index: int = 0  # a text item's one part


@shape
class ContentPartEvent(PartEventFields):
    """response.content_part.added and response.content_part.done."""

    part: ContentPart


@shape
class TextDeltaEvent(PartEventFields):
    """response.output_text.delta and response.reasoning_text.delta."""

    delta: str
    logprobs: Opt[LogprobEntries] = OMIT  # output text only


@shape
class TextDoneEvent(PartEventFields):
    """response.output_text.done and response.reasoning_text.done."""

    text: str
    logprobs: Opt[LogprobEntries] = OMIT  # output text only


@shape(tag="error")
class ErrorEvent:
    """The Responses stream's terminal error for a failure outside a generation (HTTP layer)."""

    code: str | None
    message: str
    param: str | None

