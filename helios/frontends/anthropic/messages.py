"""POST /v1/messages and /v1/messages/count_tokens: decode Anthropic Messages requests into the
neutral conversation model and a generation plan.

Spec: api.md, "Transport and admission", "Conversation and tool semantics", "Reasoning, sampling,
and usage". Sans-IO.

This module is the request side (`decode_request`, `decode_count_tokens` → `MessagesPlan`); the
output side, the encoder and its event order, is `helios.frontends.anthropic.messages_encoder`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal, NewType, cast

import attrs

from helios.domain.conversation import (
    ConversationRequest,
    ImagePart,
    Message,
    ReasoningPart,
    TextPart,
    Tool,
    ToolCallPart,
    ToolChoice,
    ToolResultPart,
)
from helios.domain.generation import GenerationOptions, GenerationRequest, OutputConstraint
from helios.domain.model import ModelInfo
from helios.domain.sampling import SamplingRequest
from helios.errors import BadRequest
from helios.frontends.common import MAX_THINKING_BUDGET, decide_tool_choice, thinking_budget, validate_stops
from helios.frontends.fields import field_table, honoured, ignored, one_of, refused, screen_fields, wire_field
from helios.frontends.structured import decode_output_format
from helios.frontends.wire import Base64Bytes, From, Invalid, NonEmptyStr, all_built, register_leaf, structure
from helios.recipes import RECIPES, resolve_effort

ANTHROPIC_VERSION = "2023-06-01"
THINKING_MARKER_PREFIX = "flare-thinking-v1:"


def thinking_signature(text: str) -> str:
    """The local round-trip marker of a thinking block: a digest of its visible text.

    A consistency check for replayed history, not provider authentication."""
    return THINKING_MARKER_PREFIX + hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_version(value: str | None) -> None:
    """Messages routes require ``anthropic-version``: the 2023-06-01 wire format.

    Current Anthropic SDKs send a later dated version by default while speaking the same wire
    format for everything Helios serves, so a dated version from 2023-06-01 on is accepted (the
    spec's rule, widened where the client would otherwise fail out of the box)."""
    if value is None:
        raise BadRequest(f"the anthropic-version header is required; this server supports {ANTHROPIC_VERSION}")
    v = value.strip()
    if not (re.fullmatch(r"\d{4}-\d{2}-\d{2}", v) and v >= ANTHROPIC_VERSION):
        raise BadRequest(f"unsupported anthropic-version '{value}'; this server supports {ANTHROPIC_VERSION}")


# -- the request's shapes (the SDK's MessageParam, its content blocks, ToolParam and ToolChoiceParam) -----


@attrs.define(kw_only=True)
class CacheControl:
    """Advisory: a candidate prefix-checkpoint boundary (`cache_breakpoints`); only the shape is checked."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


# Blocks build their domain part where it is complete; a block that needs its message's context stays
# a wire block: an image (its place), a user block marked with cache_control (a breakpoint), a tool
# result holding either (their builders return None). A message whose blocks all built builds its
# Message; `decode_messages` completes the others with their place (`part(where)`).


@attrs.define(kw_only=True)
class TextBlock:
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: Any = wire_field(refused("citations of documents are not implemented", inert=one_of([]),
                                        message="citations are not supported"))

    @staticmethod
    def __wire_build__(*, text: str, cache_control: CacheControl | None) -> TextPart | None:
        return TextPart(text) if cache_control is None else None

    def part(self, where: str) -> TextPart:
        return TextPart(self.text)


@attrs.define(kw_only=True)
class Base64Source:
    type: Literal["base64"]
    media_type: Literal["image/png", "image/jpeg", "image/webp"]  # wire.IMAGE_MEDIA_TYPES
    data: Base64Bytes


@attrs.define(kw_only=True)
class RemoteSource:
    __wire_refused__: ClassVar[str] = ("image sources of type {value!r} are unsupported; images must be base64 data "
                                       "(remote image downloads are unsupported)")
    type: Literal["url", "file"]


@attrs.define(kw_only=True)
class ImageBlock:
    type: Literal["image"]
    source: Base64Source | RemoteSource
    cache_control: CacheControl | None = None
    transformations: Any = wire_field(refused("image transformations are not implemented", inert=one_of({}),
                                              message="transformations are not supported"))

    def part(self, where: str) -> ImagePart:
        """The image; `where` (the block's path) is its place in later messages."""
        source = cast("Base64Source", self.source)  # the other member is refused
        return ImagePart(source.media_type, source.data, where)


TOOLSET_NAME = refused("toolsets are not implemented", message="toolsets are not supported")
BuiltText = Annotated[TextPart | TextBlock, From(TextBlock)]
"""A text block as structured: its part, or the block where it carries cache_control."""


Content = str | Sequence[TextPart | TextBlock | ImageBlock] | None


def _content_parts(content: Content, where: str) -> tuple[TextPart | ImagePart, ...]:
    """A tool result's or system's content as parts: a string's one text part, or its blocks' (an
    image's place is below `where`, the holder's path)."""
    if isinstance(content, str):
        return (TextPart(content),)
    return tuple([b if isinstance(b, TextPart) else b.part(f"{where}.content[{k}]")
                  for k, b in enumerate(content or ())])


@attrs.define(kw_only=True)
class ToolResultBlock:
    type: Literal["tool_result"]
    tool_use_id: NonEmptyStr
    content: str | list[Annotated[TextPart | TextBlock | ImageBlock, From(TextBlock | ImageBlock)]] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    toolset_name: Any = wire_field(TOOLSET_NAME)

    @staticmethod
    def __wire_build__(*, tool_use_id: NonEmptyStr, content: Content, is_error: bool | None,
                       cache_control: CacheControl | None) -> ToolResultPart | None:
        parts = all_built(content, (TextPart,)) if type(content) is list else _content_parts(content, "")
        if parts is None or cache_control is not None:
            return None  # content with a block that is not built (an image, a marked text), or a breakpoint
        return ToolResultPart(tool_use_id, parts, is_error=bool(is_error))

    def part(self, where: str) -> ToolResultPart:
        return ToolResultPart(self.tool_use_id, _content_parts(self.content, where), is_error=bool(self.is_error))


@attrs.define(kw_only=True)
class ToolUseBlock:
    type: Literal["tool_use"]
    id: NonEmptyStr
    name: NonEmptyStr
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: Any = wire_field(refused("programmatic (code-execution) callers are not implemented",
                                     inert=one_of({"type": "direct"}), message="only direct tool calls are supported"))
    toolset_name: Any = wire_field(TOOLSET_NAME)

    @staticmethod
    def __wire_build__(*, id: str, name: str, input: dict[str, Any]) -> ToolCallPart:
        return ToolCallPart(id, name, input)


@attrs.define(kw_only=True)
class ThinkingBlock:
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: CacheControl | None = None

    @staticmethod
    def __wire_build__(*, thinking: str, signature: str | None) -> ReasoningPart:
        if (signature or "").startswith(THINKING_MARKER_PREFIX) and signature != thinking_signature(thinking):
            raise Invalid(f"the thinking block does not match its {THINKING_MARKER_PREFIX} signature", at="signature")
        return ReasoningPart(thinking)


@attrs.define(kw_only=True)
class RedactedThinkingBlock:
    """Opaque provider reasoning: nothing readable to present to this model, so it is dropped."""

    type: Literal["redacted_thinking"]
    data: str

    def part(self, where: str) -> None:
        return None


@attrs.define(kw_only=True)
class AssistantOnlyBlock:
    __wire_refused__: ClassVar[str] = "{value!r} blocks belong in assistant messages"
    type: Literal["thinking", "redacted_thinking", "tool_use"]


@attrs.define(kw_only=True)
class UserOnlyBlock:
    __wire_refused__: ClassVar[str] = "{value!r} blocks belong in user messages"
    type: Literal["image", "tool_result"]


UserBlock = TextBlock | ImageBlock | ToolResultBlock | AssistantOnlyBlock
AssistantBlock = TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | UserOnlyBlock
UserContent = str | list[Annotated[TextPart | ToolResultPart | TextBlock | ImageBlock | ToolResultBlock,
                                   From(UserBlock)]]
AssistantContent = str | list[Annotated[TextPart | ReasoningPart | ToolCallPart | TextBlock | RedactedThinkingBlock,
                                        From(AssistantBlock)]]

# api.md: message-level control metadata (output_config.effort and the like) is ignored; the
# request's top-level controls apply.
MESSAGE_CONTROL = ignored("message-level control metadata; the request's top-level controls apply")


PARTS = (TextPart, ToolResultPart, ToolCallPart, ReasoningPart, ImagePart)
"""The built values of blocks (the other blocks stay wire instances)."""


def _built_message(*, role: Literal["user", "assistant", "system"],
                   content: UserContent | AssistantContent | list[BuiltText]) -> Message | None:
    """The message, where its blocks all built (a string is one text part); else None, which keeps the
    wire message for `decode_messages` (an image, a marked block, redacted thinking, which has no part)."""
    parts = (TextPart(content),) if isinstance(content, str) else all_built(content, PARTS)
    return None if parts is None else Message(role, parts)


@attrs.define(kw_only=True)
class MessageControls:
    """Keys a message may carry that steer a hosted service, not the conversation; and the builder
    every message (user, assistant or system) shares."""

    output_config: Any = wire_field(MESSAGE_CONTROL)
    cache_control: Any = wire_field(MESSAGE_CONTROL)
    metadata: Any = wire_field(MESSAGE_CONTROL)
    context_management: Any = wire_field(MESSAGE_CONTROL)
    __wire_build__ = staticmethod(_built_message)


@attrs.define(kw_only=True)
class UserMessage(MessageControls):
    role: Literal["user"]
    content: UserContent


@attrs.define(kw_only=True)
class AssistantMessage(MessageControls):
    role: Literal["assistant"]
    content: AssistantContent


@attrs.define(kw_only=True)
class SystemMessage(MessageControls):
    role: Literal["system"]
    content: str | list[BuiltText]


MessageWire = UserMessage | AssistantMessage | SystemMessage
BuiltMessage = Annotated[Message | MessageWire, From(MessageWire)]
"""A message as structured: its domain Message, or the wire message whose blocks need their place."""


def _client_tool_type(v: str, _t: Any) -> str:
    """A string's check (null and other kinds are the field's union's)."""
    if v != "custom":
        raise Invalid(f"tool type {v!r} is not supported; hosted and server tools are unsupported, use "
                      "client tools with an input_schema")
    return v


ClientToolType = NewType("ClientToolType", str)
"""A client tool's ``type``: absent or ``custom``; a hosted or server tool's type is refused."""
register_leaf(ClientToolType, _client_tool_type)


@attrs.define(kw_only=True)
class ClientTool:
    type: ClientToolType | None = None  # first: a hosted tool is named as such before its other keys
    name: NonEmptyStr
    input_schema: dict[str, Any]
    description: str | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = wire_field(refused("strict tool schemas are not implemented", inert=one_of(False),
                                             message="strict tool schemas (strict: true) are not supported"))
    allowed_callers: Any = wire_field(refused("programmatic (code-execution) callers are not implemented",
                                              inert=one_of(["direct"]), message="only direct calls are supported"))
    defer_loading: bool | None = wire_field(refused("tool search is not implemented", inert=one_of(False),
                                                    message="tool search is not supported"))
    eager_input_streaming: bool | None = wire_field(ignored("a streaming hint; a call's input is streamed whole"))
    input_examples: list[dict[str, Any]] | None = wire_field(
        ignored("examples for the provider's tool prompt; the chat template renders the schema"))


@attrs.define(kw_only=True)
class AutoChoice:
    type: Literal["auto", "any"]  # any: a call is required
    disable_parallel_tool_use: bool | None = None


@attrs.define(kw_only=True)
class NamedChoice:
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


@attrs.define(kw_only=True)
class NoneChoice:
    type: Literal["none"]
    disable_parallel_tool_use: ClassVar[None] = None


ToolChoiceWire = AutoChoice | NamedChoice | NoneChoice
CHOICE_MODES: dict[str, Literal["required", "none"] | None] = {"auto": None, "any": "required", "none": "none"}
"""The neutral mode of each tool_choice (`decide_tool_choice`'s; "auto" is its default: "auto" where a
tool is declared, else "none"; a named tool has none: its name)."""


@attrs.define(kw_only=True)
class ThinkingWire:
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None

    def budget(self) -> int | None:
        """budget_tokens, checked against the type and display."""
        if self.display is not None and self.type == "disabled":
            raise BadRequest("thinking.display must be 'summarized' or 'omitted' with thinking on",
                             param="thinking.display")
        if self.type == "enabled" and self.budget_tokens is None:
            raise BadRequest("thinking.budget_tokens is required when thinking is enabled",
                             param="thinking.budget_tokens")
        if self.type in ("disabled", "between_tools") and self.budget_tokens is not None:
            raise BadRequest(f"thinking.budget_tokens is not allowed with thinking type '{self.type}'",
                             param="thinking.budget_tokens")
        if self.budget_tokens is not None and self.budget_tokens < 1:
            raise BadRequest("thinking.budget_tokens must be positive", param="thinking.budget_tokens")
        return self.budget_tokens


@attrs.define(kw_only=True)
class OutputConfigWire:
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: Any = None


@attrs.define(kw_only=True)
class CountTokensWire:
    """The honoured fields of `COUNT_TOKENS_FIELDS`, each with its row; a generation request adds
    `MessagesWire`'s."""

    messages: list[BuiltMessage] = wire_field(
        honoured("the conversation: text, image, thinking, tool_use and tool_result blocks"), required=True)
    system: str | list[BuiltText] | None = wire_field(
        honoured("leading system text blocks (block cache_control is a prefix-checkpoint hint)"))
    tools: list[ClientTool] | None = wire_field(
        honoured("client tools with an input_schema; hosted and server tool types are refused"))
    tool_choice: ToolChoiceWire | None = wire_field(
        honoured("auto, any, tool or none; disable_parallel_tool_use allows one call"))
    thinking: ThinkingWire | None = wire_field(honoured(
        "enabled, adaptive, disabled or between_tools; budget_tokens caps reasoning and selects effort; display "
        "'omitted' returns thinking blocks without their text"))
    output_config: OutputConfigWire | None = wire_field(honoured(
        "effort selects the template's level; format json_schema constrains the answer (reasoning and tool calls "
        "stay free)"))
    thinking_token_budget: int | None = wire_field(honoured(
        "Helios extension: hard cap on reasoning tokens; at the cap the reasoning close token is forced (400 where "
        "the model cannot close it)"))


@attrs.define(kw_only=True)
class MessagesWire(CountTokensWire):
    """The honoured fields of `MESSAGES_FIELDS`; ignored and refused ones never reach it."""

    max_tokens: int = wire_field(honoured("output limit, reasoning included"), required=True)
    stop_sequences: list[str] | None = wire_field(honoured("string stops: at most 4, 4096 UTF-8 bytes in all"))
    stream: bool | None = wire_field(honoured("named SSE events"))
    temperature: float | None = wire_field(honoured("sampling temperature (clamped to the recipe's range)"))
    top_p: float | None = wire_field(honoured("nucleus filter (clamped to the recipe's range)"))
    top_k: int | None = wire_field(honoured("top-k filter (clamped to the recipe's range)"))


def _check_cache_control(value: Any) -> None:
    structure(value, CacheControl, at="cache_control")


def _check_context_management(cm: Any) -> None:
    """Only preserving every thinking block is accepted; active context edits are rejected."""
    if not isinstance(cm, dict) or set(cm) - {"edits"}:
        raise BadRequest("context_management must be an object with an edits array", param="context_management")
    edits = cm.get("edits")
    if edits is not None and not isinstance(edits, list):
        raise BadRequest("context_management.edits must be an array", param="context_management.edits")
    for i, edit in enumerate(edits or ()):
        if edit != {"type": "clear_thinking_20251015", "keep": "all"}:
            where = f"context_management.edits[{i}]"
            raise BadRequest(f"{where}: active context edits are not supported; only clear_thinking_20251015 "
                             "with keep: \"all\" is accepted", param=where)


MESSAGES_FIELDS = field_table(
    MessagesWire,
    model=ignored("one model is served: every name reaches it and responses report its own id", str),
    metadata=ignored("user_id for the provider's abuse monitoring; nothing to monitor locally", dict),
    service_tier=ignored("one local tier: 'auto' and 'standard_only' both hold; other tiers are refused", str,
                         allows=one_of("auto", "standard_only"),
                         message="service_tier '{value}' is not supported; use 'auto' or 'standard_only'"),
    cache_control=ignored("automatic prompt caching: local prefix reuse is automatic; only the shape is checked",
                          check=_check_cache_control),
    speed=ignored("one serving speed; 'standard' and 'fast' are both accepted", str,
                  allows=one_of("standard", "fast"), message="speed must be 'standard' or 'fast'"),
    context_management=ignored("clear_thinking_20251015 with keep: 'all' asks for what Helios does anyway "
                               "(every thinking block kept); active context edits are refused",
                               check=_check_context_management),
    inference_geo=ignored("local inference: every geography is satisfied", str),
    diagnostics=ignored("cache-miss diagnostics are not reported",
                        allows=lambda v: isinstance(v, dict) and set(v) <= {"previous_message_id"},
                        message="diagnostics must be an object with previous_message_id"),
    user_profile_id=ignored("provider account attribution (the SDK sends it as a header)", str),
    workspace_id=ignored("provider workspace selection (the SDK sends it as a header)", str),
    betas=ignored("beta opt-ins (the SDK sends them as the anthropic-beta header); Helios gates nothing on them",
                  list),
    billing_policy=ignored("provider billing; nobody is billed locally", dict),
    fallback_credit_token=ignored("provider billing credit for a retried refusal; nothing is billed", str, dict),
    fallbacks=ignored("substitute models for provider policy refusals; Helios makes none", list, str),
    safeguards=ignored("Claude Code's provider-side classifier context (dangerous_tool_use); not in the public "
                       "SDK types, no classifier runs locally", list),
    container=refused("code-execution containers are not available on a local server",
                      message="container is not supported: code-execution containers are not available"),
    mcp_servers=refused("Helios does not connect to MCP servers; give the client the tools instead",
                        inert=one_of([]), message="mcp_servers is not supported: MCP servers are not available"),
    # The Anthropic SDK's tool runner and message threads send `thread` and, on this error_code,
    # go on without it (anthropic.lib.threads: "continue_unthreaded").
    thread=refused("server-held conversation state: Helios keeps no messages, so send the whole conversation",
                   details={"error_code": "thread_unsupported_request"}),
    compaction=refused("compaction requests (summarize the conversation) are not implemented"),
    # The spec: /v1/messages rejects these fields; present at all (null included) is a 400.
    **{name: refused("an OpenAI/vLLM logprob option; Messages has no logprobs",
                     message=f"{name} is not supported on /v1/messages", refuse_null=True)
       for name in ("logprobs", "top_logprobs", "return_tokens_as_token_ids", "logprob_token_ids", "prompt_logprobs")},
)
"""Every top-level Messages field Helios knows (see `helios.frontends.fields`)."""

COUNT_TOKENS_FIELDS = {
    **{name: row for name, row in MESSAGES_FIELDS.items() if name not in (
        "max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k", "metadata", "service_tier",
        "container", "inference_geo", "diagnostics", "fallbacks", "fallback_credit_token", "thread")},
    "compaction": ignored("count_tokens ignores it by definition: the count is of the messages as sent", dict),
}
"""Every top-level count_tokens field Helios knows: Messages' minus the generation-only ones."""


@attrs.frozen
class MessagesPlan:
    """A decoded request: the neutral conversation plus the Messages-only options."""

    conversation: ConversationRequest
    max_tokens: int | None  # None for count_tokens
    stream: bool
    stops: tuple[str, ...]
    thinking_token_budget: int | None  # effective hard reasoning cap (request, else server default)
    effort: str | None  # neutral effort level selected by the request, if any
    hide_thinking: bool = False  # thinking.display "omitted": blocks keep their place and marker, no text
    constraint: OutputConstraint | None = None  # output_config.format: the answer's JSON schema
    thinking_token_budget_param: str | None = None
    """``thinking_token_budget`` when the request gave that field (an unsupported format is a 400);
    None when the cap came from ``thinking.budget_tokens`` or the server default (advisory there)."""

    @property
    def generation(self) -> GenerationRequest:
        options = GenerationOptions(max_tokens=self.max_tokens, stop=self.stops, constraint=self.constraint,
                                    thinking_token_budget=self.thinking_token_budget,
                                    thinking_token_budget_param=self.thinking_token_budget_param)
        return GenerationRequest(sampling=self.conversation.sampling, options=options,
                                 conversation=self.conversation, id_prefix="msg", stop_param="stop_sequences")


# -- decoding -------------------------------------------------------------------------------------


def decode_request(obj: dict[str, Any], info: ModelInfo) -> MessagesPlan:
    """A POST /v1/messages body → MessagesPlan (BadRequest on anything malformed or unsupported)."""
    w = structure(screen_fields(obj, MESSAGES_FIELDS), MessagesWire)
    if w.max_tokens < 1:
        raise BadRequest("max_tokens must be at least 1", param="max_tokens")
    stops = validate_stops(w.stop_sequences, param="stop_sequences")
    sampling = SamplingRequest(temperature=w.temperature, top_p=w.top_p, top_k=w.top_k)
    return _plan(w, info, sampling=sampling, max_tokens=w.max_tokens, stream=bool(w.stream), stops=stops)


def decode_count_tokens(obj: dict[str, Any], info: ModelInfo) -> MessagesPlan:
    """A POST /v1/messages/count_tokens body: the same decoding, without generation fields."""
    w = structure(screen_fields(obj, COUNT_TOKENS_FIELDS), CountTokensWire)
    return _plan(w, info, sampling=SamplingRequest(), max_tokens=None, stream=False, stops=())


def _plan(w: CountTokensWire, info: ModelInfo, *, sampling: SamplingRequest, max_tokens: int | None,
          stream: bool, stops: tuple[str, ...]) -> MessagesPlan:
    constraint = decode_output_format(w.output_config.format) if w.output_config is not None else None
    messages, breakpoints = decode_messages(w.system, w.messages)
    tools, choice, parallel = decode_tools(w.tools, w.tool_choice)
    budget, effort, kwargs, budget_param = _decode_thinking(w, info)
    continuation = messages[-1].role == "assistant"
    conv = ConversationRequest(messages=messages, tools=tools, tool_choice=choice, sampling=sampling,
                               parallel_tool_calls=parallel, add_generation_prompt=not continuation,
                               continue_final_message=continuation, chat_template_kwargs=kwargs,
                               cache_breakpoints=breakpoints)
    hide = w.thinking is not None and w.thinking.display == "omitted"
    return MessagesPlan(conv, max_tokens, stream, stops, budget, effort, hide, constraint,
                        thinking_token_budget_param=budget_param)


MAX_BREAKPOINTS = 4


def decode_messages(system: str | list[TextPart | TextBlock] | None,
                    messages: list[Message | MessageWire]) -> tuple[tuple[Message, ...], tuple[str, ...]]:
    """System text and structured messages → neutral messages (the system, if any, first), and the
    conversation's cache breakpoints.

    api.md: cache_control on a user message's text, image or tool_result block marks the end of
    that block as a candidate prefix-checkpoint boundary, for the first four such blocks (elsewhere
    it is ignored). A breakpoint is the text that ends its boundary (an image's is the text before it)."""
    out: list[Message] = []
    if type(system) is str or system:  # an empty string is a system message, an empty list none
        out.append(Message("system", _content_parts(system, "system")))
    if not messages:
        raise BadRequest("messages must contain at least one message", param="messages")
    breakpoints: list[str] = []
    for i, m in enumerate(messages):
        if type(m) is Message:
            out.append(m)
            continue
        blocks = cast("list[Any]", cast("MessageWire", m).content)  # a string's is built
        parts = [b if type(b) in PARTS else b.part(f"messages[{i}].content[{j}]")
                 for j, b in enumerate(blocks)]
        if type(m) is UserMessage:
            _breakpoints(blocks, parts, breakpoints)
        out.append(Message(m.role, tuple([p for p in parts if p is not None])))  # redacted thinking has none
    return tuple(out), tuple(breakpoints)


def _breakpoints(blocks: list[Any], parts: list[Any], out: list[str]) -> None:
    """A user message's marked blocks' breakpoints, appended to `out` (up to MAX_BREAKPOINTS in all):
    the last text of the message's parts (its blocks', one each) up to each, a tool result's content
    included (an image's breakpoint is the text before it); none where that text is empty."""
    for j, b in enumerate(blocks):
        if type(b) not in PARTS and b.cache_control is not None and len(out) < MAX_BREAKPOINTS:
            # A user part is text, an image or a tool result, whose content is text and images.
            texts = [t.text for p in parts[:j + 1] for t in getattr(p, "content", (p,)) if type(t) is TextPart]
            if texts and texts[-1]:
                out.append(texts[-1])


def cache_breakpoints(messages: list[Any]) -> tuple[str, ...]:
    """The cache breakpoints of messages as sent (`decode_messages`)."""
    return decode_messages(None, structure(messages, list[BuiltMessage], at="messages"))[1]


def decode_tools(tools: list[ClientTool] | None,
                 tool_choice: ToolChoiceWire | None) -> tuple[tuple[Tool, ...], ToolChoice, bool]:
    """Client tools and tool_choice → (tools, choice, parallel calls allowed)."""
    decoded: dict[str, Tool] = {}
    for i, t in enumerate(tools or ()):
        if t.name in decoded:
            raise BadRequest(f"tool names must be unique; '{t.name}' is declared twice", param=f"tools[{i}].name")
        decoded[t.name] = Tool(t.name, t.description, t.input_schema)
    parallel = tool_choice is None or not tool_choice.disable_parallel_tool_use
    name = tool_choice.name if isinstance(tool_choice, NamedChoice) else None
    mode = None if tool_choice is None else CHOICE_MODES.get(tool_choice.type)
    return tuple(decoded.values()), decide_tool_choice("messages", decoded, mode, name), parallel


def _decode_thinking(w: CountTokensWire,
                     info: ModelInfo) -> tuple[int | None, str | None, dict[str, Any], str | None]:
    """thinking, thinking_token_budget and output_config.effort → (hard budget, effort, template kwargs,
    ``thinking_token_budget`` where that field gave the budget)."""
    th = w.thinking
    requested = None if th is None else th.budget()
    # thinking_token_budget where given (then it must be thinking.budget_tokens, if that is given too)
    budget, budget_param = thinking_budget(w.thinking_token_budget, requested)
    if budget_param is not None:
        if not info.has_reasoning:
            raise BadRequest("thinking_token_budget is not supported: this model has no reasoning syntax",
                             param="thinking_token_budget")
        if requested is not None and requested != budget:
            raise BadRequest("thinking_token_budget and thinking.budget_tokens must match when both are given",
                             param="thinking_token_budget")
    level = None if w.output_config is None else w.output_config.effort
    if level is None and budget is not None:
        level = "low" if budget <= 5000 else "high" if budget <= 20000 else "max"
    disabled = th is not None and th.type == "disabled"
    kwargs: dict[str, Any] = {"enable_thinking": not disabled} if th is not None and info.has_reasoning else {}
    if disabled:
        return None, level, kwargs, None
    recipe = RECIPES.get(info.recipe)
    # Every level here is a neutral one (OutputConfigWire.effort's, or one named above), which
    # resolve_effort maps to the template's nearest.
    native = None if level is None or recipe is None else resolve_effort(recipe, level)
    if native is not None:
        kwargs["reasoning_effort"] = native
    # No budget: the server's default; budgets above the 32-bit output limit are accepted and never cut.
    cap = info.thinking_token_budget if budget is None else budget if budget <= MAX_THINKING_BUDGET else None
    return cap, level, kwargs, budget_param
