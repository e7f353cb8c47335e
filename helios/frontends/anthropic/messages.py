"""POST /v1/messages and /v1/messages/count_tokens: decode Anthropic Messages requests into the
neutral conversation model, run them, and encode buffered Messages or named SSE events.

Spec: api.md, "Transport and admission", "Conversation and tool semantics", "Reasoning, sampling,
and usage". Sans-IO apart from the two `run_*` coroutines, which only talk to `serving`.

Streamed events, in order (each SSE ``data`` object carries ``"type"`` equal to the event name)::

    message_start                      message with empty content; usage input = the full prompt
    (content_block_start                  per block, in output order: thinking, text or tool_use
     content_block_delta*                 thinking_delta / text_delta / input_json_delta
     [content_block_delta]                signature_delta, thinking blocks only, just before stop
     content_block_stop)*
    message_delta                      stop_reason, stop_sequence, final usage
    message_stop

A failure after the stream started ends it with ``event: error`` (rendered by the app).
Buffered responses are assembled by the same `MessageAssembler`, so the two never disagree.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import uuid
from collections.abc import Sequence
from typing import Any, Literal

import attrs

from helios.domain.conversation import (
    ConversationRequest,
    ImagePart,
    Message,
    Part,
    ReasoningPart,
    TextPart,
    Tool,
    ToolCallPart,
    ToolChoice,
    ToolResultPart,
)
from helios.domain.events import FinishCause, ReasoningDelta, TextDelta, ToolCall
from helios.domain.generation import (
    Accumulated,
    ChildUpdate,
    GenerationOptions,
    GenerationRequest,
    OutputConstraint,
    PreparedPrompt,
    StreamEvent,
    usage_of,
)
from helios.domain.model import ModelInfo
from helios.domain.sampling import SamplingRequest
from helios.errors import BadRequest, HeliosError
from helios.frontends.common import validate_stops
from helios.frontends.fields import FieldTable, honoured, ignored, one_of, refused, screen_fields
from helios.frontends.structured import decode_output_format
from helios.frontends.wire import structure
from helios.recipes import NEUTRAL_EFFORT_LEVELS, RECIPES, EffortError, resolve_effort

ANTHROPIC_VERSION = "2023-06-01"
THINKING_MARKER_PREFIX = "flare-thinking-v1:"
# Keys a message object may carry that steer a hosted service, not the conversation: ignored.
MESSAGE_CONTROL_METADATA = frozenset({"output_config", "cache_control", "metadata", "context_management"})

REJECTED_FIELDS = ("logprobs", "top_logprobs", "return_tokens_as_token_ids", "logprob_token_ids",
                   "prompt_logprobs")
IMAGE_MEDIA_TYPES = ("image/png", "image/jpeg", "image/webp")
MAX_BUDGET = 2**31 - 1


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


# -- wire classes ---------------------------------------------------------------------------------


@attrs.frozen
class ThinkingWire:
    type: str
    budget_tokens: int | None = None
    display: str | None = None


@attrs.frozen
class OutputConfigWire:
    effort: str | None = None
    format: Any = None


@attrs.frozen(kw_only=True)
class CountTokensWire:
    """The honoured fields of `COUNT_TOKENS_FIELDS`; a generation request adds `MessagesWire`'s."""

    messages: list[Any]
    system: Any = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    thinking: ThinkingWire | None = None
    output_config: OutputConfigWire | None = None
    thinking_token_budget: int | None = None


@attrs.frozen(kw_only=True)
class MessagesWire(CountTokensWire):
    """The honoured fields of `MESSAGES_FIELDS`; ignored and refused ones never reach it."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None


def _check_diagnostics(value: Any) -> None:
    if not isinstance(value, dict) or set(value) - {"previous_message_id"}:
        raise BadRequest("diagnostics must be an object with previous_message_id", param="diagnostics")


MESSAGES_FIELDS: FieldTable = {
    "messages": honoured("the conversation: text, image, thinking, tool_use and tool_result blocks"),
    "system": honoured("leading system text blocks (block cache_control is a prefix-checkpoint hint)"),
    "tools": honoured("client tools with an input_schema; hosted and server tool types are refused"),
    "tool_choice": honoured("auto, any, tool or none; disable_parallel_tool_use allows one call"),
    "thinking": honoured("enabled, adaptive, disabled or between_tools; budget_tokens caps reasoning and "
                         "selects effort; display 'omitted' returns thinking blocks without their text"),
    "output_config": honoured("effort selects the template's level; format json_schema constrains the answer "
                              "(reasoning and tool calls stay free)"),
    "thinking_token_budget": honoured("Helios extension: hard cap on reasoning tokens; at the cap the "
                                      "reasoning close token is forced (400 where the model cannot close it)"),
    "max_tokens": honoured("output limit, reasoning included"),
    "stop_sequences": honoured("string stops: at most 4, 4096 UTF-8 bytes in all"),
    "stream": honoured("named SSE events"),
    "temperature": honoured("sampling temperature (clamped to the recipe's range)"),
    "top_p": honoured("nucleus filter (clamped to the recipe's range)"),
    "top_k": honoured("top-k filter (clamped to the recipe's range)"),
    "model": ignored("one model is served: every name reaches it and responses report its own id", str),
    "metadata": ignored("user_id for the provider's abuse monitoring; nothing to monitor locally", dict),
    "service_tier": ignored("one local tier: 'auto' and 'standard_only' both hold; other tiers are refused", str,
                            allows=one_of("auto", "standard_only"),
                            message="service_tier '{value}' is not supported; use 'auto' or 'standard_only'"),
    "cache_control": ignored("automatic prompt caching: local prefix reuse is automatic; only the shape is "
                             "checked", check=lambda v: _check_cache_control(v, "cache_control")),
    "speed": ignored("one serving speed; 'standard' and 'fast' are both accepted", str,
                     allows=one_of("standard", "fast"), message="speed must be 'standard' or 'fast'"),
    "context_management": ignored("clear_thinking_20251015 with keep: 'all' asks for what Helios does anyway "
                                  "(every thinking block kept); active context edits are refused",
                                  check=lambda v: _check_context_management(v)),
    "inference_geo": ignored("local inference: every geography is satisfied", str),
    "diagnostics": ignored("cache-miss diagnostics are not reported", check=_check_diagnostics),
    "user_profile_id": ignored("provider account attribution (the SDK sends it as a header)", str),
    "workspace_id": ignored("provider workspace selection (the SDK sends it as a header)", str),
    "betas": ignored("beta opt-ins (the SDK sends them as the anthropic-beta header); Helios gates nothing on "
                     "them", list),
    "billing_policy": ignored("provider billing; nobody is billed locally", dict),
    "fallback_credit_token": ignored("provider billing credit for a retried refusal; nothing is billed", str, dict),
    "fallbacks": ignored("substitute models for provider policy refusals; Helios makes none", list, str),
    "safeguards": ignored("Claude Code's provider-side classifier context (dangerous_tool_use); not in the public "
                          "SDK types, no classifier runs locally", list),
    "container": refused("code-execution containers are not available on a local server",
                         message="container is not supported: code-execution containers are not available"),
    "mcp_servers": refused("Helios does not connect to MCP servers; give the client the tools instead",
                           inert=one_of([]), message="mcp_servers is not supported: MCP servers are not available"),
    # The Anthropic SDK's tool runner and message threads send `thread` and, on this error_code,
    # go on without it (anthropic.lib.threads: "continue_unthreaded").
    "thread": refused("server-held conversation state: Helios keeps no messages, so send the whole conversation",
                      details={"error_code": "thread_unsupported_request"}),
    "compaction": refused("compaction requests (summarize the conversation) are not implemented"),
    # The spec: /v1/messages rejects these fields; present at all (null included) is a 400.
    **{name: refused("an OpenAI/vLLM logprob option; Messages has no logprobs",
                     message=f"{name} is not supported on /v1/messages", refuse_null=True)
       for name in REJECTED_FIELDS},
}
"""Every top-level Messages field Helios knows (see `helios.frontends.fields`)."""

COUNT_TOKENS_FIELDS: FieldTable = {
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
        return GenerationRequest(sampling=self.conversation.sampling,
                                 options=GenerationOptions(max_tokens=self.max_tokens, stop=self.stops,
                                                           constraint=self.constraint,
                                                           thinking_token_budget=self.thinking_token_budget,
                                                           thinking_token_budget_param=self.thinking_token_budget_param),
                                 conversation=self.conversation, id_prefix="msg", stop_param="stop_sequences")


# -- decoding -------------------------------------------------------------------------------------


def decode_request(obj: dict[str, Any], info: ModelInfo) -> MessagesPlan:
    """A POST /v1/messages body → MessagesPlan (BadRequest on anything malformed or unsupported)."""
    obj = screen_fields(obj, MESSAGES_FIELDS)
    for name in ("stop_sequences", "messages", "tools"):
        # cattrs would structure a string into a list of characters
        if obj.get(name) is not None and not isinstance(obj[name], list):
            raise BadRequest(f"{name} must be an array", param=name)
    w = structure(obj, MessagesWire)
    if w.max_tokens < 1:
        raise BadRequest("max_tokens must be at least 1", param="max_tokens")
    stops = validate_stops(w.stop_sequences, param="stop_sequences")
    sampling = SamplingRequest(temperature=w.temperature, top_p=w.top_p, top_k=w.top_k)
    return _plan(w, info, sampling=sampling, max_tokens=w.max_tokens, stream=bool(w.stream), stops=stops)


def decode_count_tokens(obj: dict[str, Any], info: ModelInfo) -> MessagesPlan:
    """A POST /v1/messages/count_tokens body: the same decoding, without generation fields."""
    obj = screen_fields(obj, COUNT_TOKENS_FIELDS)
    for name in ("messages", "tools"):
        if obj.get(name) is not None and not isinstance(obj[name], list):
            raise BadRequest(f"{name} must be an array", param=name)
    w = structure(obj, CountTokensWire)
    return _plan(w, info, sampling=SamplingRequest(), max_tokens=None, stream=False, stops=())


def _plan(w: CountTokensWire, info: ModelInfo, *, sampling: SamplingRequest, max_tokens: int | None,
          stream: bool, stops: tuple[str, ...]) -> MessagesPlan:
    constraint = decode_output_format(w.output_config.format) if w.output_config is not None else None
    messages = decode_messages(w.system, w.messages)
    tools, choice, parallel = decode_tools(w.tools, w.tool_choice)
    budget, effort, kwargs = _decode_thinking(w, info)
    continuation = messages[-1].role == "assistant"
    conv = ConversationRequest(
        messages=messages,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        sampling=sampling,
        add_generation_prompt=not continuation,
        continue_final_message=continuation,
        chat_template_kwargs=kwargs,
        cache_breakpoints=cache_breakpoints(w.messages),
    )
    hide = w.thinking is not None and w.thinking.display == "omitted"
    budget_param = "thinking_token_budget" if w.thinking_token_budget is not None and budget is not None else None
    return MessagesPlan(conv, max_tokens, stream, stops, budget, effort, hide, constraint,
                        thinking_token_budget_param=budget_param)


def decode_messages(system: Any, messages: list[Any]) -> tuple[Message, ...]:
    """System text and Anthropic messages → neutral messages (the system, if any, first)."""
    out: list[Message] = []
    if system is not None:
        parts = _system_parts(system, "system")
        if parts:
            out.append(Message("system", parts))
    if not messages:
        raise BadRequest("messages must contain at least one message", param="messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object", param=where)
        # api.md: message-level control metadata (output_config.effort and the like) is ignored;
        # the request's top-level controls apply.
        extra = set(m) - {"role", "content"} - MESSAGE_CONTROL_METADATA
        if extra:
            raise BadRequest(f"unrecognized field(s) in {where}: {', '.join(sorted(extra))}", param=where)
        role = m.get("role")
        if "content" not in m:
            raise BadRequest(f"{where}.content is required", param=f"{where}.content")
        content = m["content"]
        if role == "user":
            out.append(Message("user", _user_parts(content, where)))
        elif role == "assistant":
            out.append(Message("assistant", _assistant_parts(content, where)))
        elif role == "system":
            out.append(Message("system", _system_parts(content, f"{where}.content")))
        else:
            raise BadRequest(f"{where}.role must be 'user' or 'assistant'", param=f"{where}.role")
    return tuple(out)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    """Content as a list of typed blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or an array of content blocks", param=where)
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise BadRequest(f"{where}[{j}] must be an object with a string type", param=f"{where}[{j}]")
    return content


def _system_parts(content: Any, where: str) -> tuple[Part, ...]:
    parts: list[Part] = []
    for j, b in enumerate(_blocks(content, where)):
        if b["type"] != "text":
            raise BadRequest(f"{where}[{j}]: system content must be text blocks", param=f"{where}[{j}]")
        parts.append(_text_block(b, f"{where}[{j}]"))
    return tuple(parts)


def cache_breakpoints(messages: list[Any]) -> tuple[str, ...]:
    """api.md: cache_control on a user message's text, image or tool_result block marks the end of
    that block as a candidate prefix-checkpoint boundary, for the first four such blocks (elsewhere
    it is ignored). Returns the text that ends each boundary (an image's is the text before it)."""
    out: list[str] = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") != "user" or not isinstance(m.get("content"), list):
            continue
        last_text = ""
        for b in m["content"]:
            if not isinstance(b, dict):
                continue
            if b.get("type") == "text" and isinstance(b.get("text"), str):
                last_text = b["text"]
            elif b.get("type") == "tool_result":
                content = b.get("content")
                texts: list[str] = [content] if isinstance(content, str) else [
                    str(c["text"]) for c in content or [] if isinstance(c, dict) and isinstance(c.get("text"), str)]
                last_text = texts[-1] if texts else last_text
            if b.get("type") in ("text", "image", "tool_result") and b.get("cache_control") is not None:
                if last_text:
                    out.append(last_text)
                if len(out) == 4:
                    return tuple(out)
    return tuple(out)


def _user_parts(content: Any, where: str) -> tuple[Part, ...]:
    parts: list[Part] = []
    for j, b in enumerate(_blocks(content, f"{where}.content")):
        at = f"{where}.content[{j}]"
        t = b["type"]
        if t == "text":
            parts.append(_text_block(b, at))
        elif t == "image":
            parts.append(_image_block(b, at))
        elif t == "tool_result":
            parts.append(_tool_result_block(b, at))
        elif t in ("thinking", "redacted_thinking", "tool_use"):
            raise BadRequest(f"{at}: '{t}' blocks belong in assistant messages", param=at)
        else:
            raise BadRequest(f"{at}: content block type '{t}' is not supported", param=at)
    return tuple(parts)


def _assistant_parts(content: Any, where: str) -> tuple[Part, ...]:
    parts: list[Part] = []
    for j, b in enumerate(_blocks(content, f"{where}.content")):
        at = f"{where}.content[{j}]"
        t = b["type"]
        if t == "text":
            parts.append(_text_block(b, at))
        elif t == "thinking":
            parts.append(_thinking_block(b, at))
        elif t == "redacted_thinking":
            _keys(b, at, {"type", "data"})
            if not isinstance(b.get("data"), str):
                raise BadRequest(f"{at}.data must be a string", param=at)
            # Opaque provider reasoning: nothing readable to present to this model.
        elif t == "tool_use":
            parts.append(_tool_use_block(b, at))
        elif t in ("image", "tool_result"):
            raise BadRequest(f"{at}: '{t}' blocks belong in user messages", param=at)
        else:
            raise BadRequest(f"{at}: content block type '{t}' is not supported", param=at)
    return tuple(parts)


def _keys(block: dict[str, Any], where: str, allowed: set[str]) -> None:
    extra = set(block) - allowed
    if extra:
        raise BadRequest(f"unrecognized field(s) in {where}: {', '.join(sorted(extra))}", param=where)
    _check_cache_control(block.get("cache_control"), f"{where}.cache_control")
    if block.get("toolset_name") is not None:
        raise BadRequest(f"{where}.toolset_name: toolsets are not supported", param=f"{where}.toolset_name")


def _check_cache_control(cc: Any, where: str) -> None:
    """cache_control is advisory (a candidate prefix-checkpoint hint); only its shape is checked."""
    if cc is not None and (not isinstance(cc, dict) or cc.get("type") != "ephemeral"
                           or set(cc) - {"type", "ttl"} or cc.get("ttl") not in (None, "5m", "1h")):
        raise BadRequest(f"{where} must be {{\"type\": \"ephemeral\"}} with an optional ttl", param=where)


def _text_block(b: dict[str, Any], where: str) -> TextPart:
    _keys(b, where, {"type", "text", "cache_control", "citations"})
    if not isinstance(b.get("text"), str):
        raise BadRequest(f"{where}.text must be a string", param=f"{where}.text")
    if b.get("citations") not in (None, []):
        raise BadRequest(f"{where}.citations are not supported", param=f"{where}.citations")
    return TextPart(b["text"])


def _image_block(b: dict[str, Any], where: str) -> ImagePart:
    _keys(b, where, {"type", "source", "cache_control", "transformations"})
    if b.get("transformations") not in (None, {}):
        raise BadRequest(f"{where}.transformations are not supported", param=f"{where}.transformations")
    src = b.get("source")
    if not isinstance(src, dict) or not isinstance(src.get("type"), str):
        raise BadRequest(f"{where}.source must be an object with a type", param=f"{where}.source")
    if src["type"] != "base64":
        raise BadRequest(f"{where}: image sources of type '{src['type']}' are unsupported; images must be "
                         "base64 data (remote image downloads are unsupported)", param=f"{where}.source")
    if set(src) - {"type", "media_type", "data"}:
        raise BadRequest(f"unrecognized field(s) in {where}.source", param=f"{where}.source")
    media, data = src.get("media_type"), src.get("data")
    if media not in IMAGE_MEDIA_TYPES:
        raise BadRequest(f"{where}: unsupported image media_type {media!r}; use PNG, JPEG or static WebP",
                         param=f"{where}.source.media_type")
    if not isinstance(data, str):
        raise BadRequest(f"{where}.source.data must be a base64 string", param=f"{where}.source.data")
    try:
        raw = base64.b64decode(data, validate=True)
    except (ValueError, binascii.Error):
        raise BadRequest(f"{where}: invalid base64 image data", param=f"{where}.source.data") from None
    return ImagePart(str(media), raw, where)


def _tool_result_block(b: dict[str, Any], where: str) -> ToolResultPart:
    _keys(b, where, {"type", "tool_use_id", "content", "is_error", "cache_control", "toolset_name"})
    tid = b.get("tool_use_id")
    if not isinstance(tid, str) or not tid:
        raise BadRequest(f"{where}.tool_use_id must be a nonempty string", param=f"{where}.tool_use_id")
    is_error = b.get("is_error", False)
    if is_error is None:
        is_error = False
    if not isinstance(is_error, bool):
        raise BadRequest(f"{where}.is_error must be a boolean", param=f"{where}.is_error")
    content: list[TextPart | ImagePart] = []
    raw = b.get("content")
    if raw is not None:
        for k, c in enumerate(_blocks(raw, f"{where}.content")):
            at = f"{where}.content[{k}]"
            if c["type"] == "text":
                content.append(_text_block(c, at))
            elif c["type"] == "image":
                content.append(_image_block(c, at))
            else:
                raise BadRequest(f"{at}: tool results may contain text and image blocks only", param=at)
    return ToolResultPart(tid, tuple(content), is_error=is_error)


def _tool_use_block(b: dict[str, Any], where: str) -> ToolCallPart:
    _keys(b, where, {"type", "id", "name", "input", "cache_control", "caller", "toolset_name"})
    if b.get("caller") not in (None, {"type": "direct"}):
        raise BadRequest(f"{where}.caller: only direct tool calls are supported", param=f"{where}.caller")
    tid, name, args = b.get("id"), b.get("name"), b.get("input")
    if not isinstance(tid, str) or not tid:
        raise BadRequest(f"{where}.id must be a nonempty string", param=f"{where}.id")
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{where}.name must be a nonempty string", param=f"{where}.name")
    if not isinstance(args, dict):
        raise BadRequest(f"{where}.input must be an object", param=f"{where}.input")
    return ToolCallPart(tid, name, args)


def _thinking_block(b: dict[str, Any], where: str) -> ReasoningPart:
    _keys(b, where, {"type", "thinking", "signature", "cache_control"})
    text, sig = b.get("thinking"), b.get("signature")
    if not isinstance(text, str):
        raise BadRequest(f"{where}.thinking must be a string", param=f"{where}.thinking")
    if sig is not None and not isinstance(sig, str):
        raise BadRequest(f"{where}.signature must be a string", param=f"{where}.signature")
    if sig is not None and sig.startswith(THINKING_MARKER_PREFIX) and sig != thinking_signature(text):
        raise BadRequest(f"{where}: the thinking block does not match its {THINKING_MARKER_PREFIX} signature",
                         param=f"{where}.signature")
    return ReasoningPart(text)


def decode_tools(tools: list[Any] | None, tool_choice: Any) -> tuple[tuple[Tool, ...], ToolChoice, bool]:
    """Client tools and tool_choice → (tools, choice, parallel calls allowed)."""
    decoded: list[Tool] = []
    for i, t in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise BadRequest(f"{where} must be an object", param=where)
        kind = t.get("type")
        if kind not in (None, "custom"):
            raise BadRequest(f"{where}: tool type '{kind}' is not supported; hosted and server tools are "
                             "unsupported, use client tools with an input_schema", param=f"{where}.type")
        _keys(t, where, {"type", "name", "description", "input_schema", "cache_control", "strict",
                         "allowed_callers", "defer_loading", "eager_input_streaming", "input_examples"})
        if t.get("allowed_callers") not in (None, ["direct"]):
            raise BadRequest(f"{where}.allowed_callers: only direct calls are supported",
                             param=f"{where}.allowed_callers")
        if t.get("defer_loading") not in (None, False):
            raise BadRequest(f"{where}.defer_loading: tool search is not supported", param=f"{where}.defer_loading")
        if t.get("eager_input_streaming") not in (None, True, False):
            raise BadRequest(f"{where}.eager_input_streaming must be a boolean",
                             param=f"{where}.eager_input_streaming")
        examples = t.get("input_examples")
        if examples is not None and not (isinstance(examples, list) and all(isinstance(x, dict) for x in examples)):
            raise BadRequest(f"{where}.input_examples must be an array of objects", param=f"{where}.input_examples")
        name, desc, schema = t.get("name"), t.get("description"), t.get("input_schema")
        if not isinstance(name, str) or not name:
            raise BadRequest(f"{where}.name must be a nonempty string", param=f"{where}.name")
        if t.get("strict") is True:
            raise BadRequest("strict tool schemas (strict: true) are not supported", param=f"{where}.strict")
        if t.get("strict") not in (None, False):
            raise BadRequest(f"{where}.strict must be a boolean", param=f"{where}.strict")
        if desc is not None and not isinstance(desc, str):
            raise BadRequest(f"{where}.description must be a string", param=f"{where}.description")
        if not isinstance(schema, dict):
            raise BadRequest(f"{where}.input_schema must be a JSON schema object", param=f"{where}.input_schema")
        if any(d.name == name for d in decoded):
            raise BadRequest(f"tool names must be unique; '{name}' is declared twice", param=f"{where}.name")
        decoded.append(Tool(name, desc, schema))
    names = {t.name for t in decoded}
    if tool_choice is None:
        return tuple(decoded), ToolChoice("auto" if decoded else "none"), True
    if not isinstance(tool_choice, dict) or not isinstance(tool_choice.get("type"), str):
        raise BadRequest("tool_choice must be an object with a type", param="tool_choice")
    kind = tool_choice["type"]
    allowed = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    if kind == "none":
        allowed = {"type"}
    extra = set(tool_choice) - allowed
    if extra:
        raise BadRequest(f"unrecognized field(s) in tool_choice: {', '.join(sorted(extra))}", param="tool_choice")
    disable = tool_choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise BadRequest("tool_choice.disable_parallel_tool_use must be a boolean",
                         param="tool_choice.disable_parallel_tool_use")
    parallel = not disable
    if kind == "auto":
        choice = ToolChoice("auto" if decoded else "none")
    elif kind == "none":
        choice = ToolChoice("none")
    elif kind == "any":
        if not decoded:
            raise BadRequest("tool_choice 'any' needs at least one declared tool", param="tool_choice")
        choice = ToolChoice("required")
    elif kind == "tool":
        name = tool_choice.get("name")
        if not isinstance(name, str) or name not in names:
            raise BadRequest(f"tool_choice names {name!r}, which is not a declared tool", param="tool_choice.name")
        choice = ToolChoice("named", name)
    else:
        raise BadRequest("tool_choice.type must be 'auto', 'any', 'tool' or 'none'", param="tool_choice.type")
    return tuple(decoded), choice, parallel


def _check_context_management(cm: Any) -> None:
    """Only preserving every thinking block is accepted; active context edits are rejected."""
    if cm is None:
        return
    if not isinstance(cm, dict) or set(cm) - {"edits"}:
        raise BadRequest("context_management must be an object with an edits array", param="context_management")
    edits = cm.get("edits")
    if edits is None:
        return
    if not isinstance(edits, list):
        raise BadRequest("context_management.edits must be an array", param="context_management.edits")
    for i, e in enumerate(edits):
        where = f"context_management.edits[{i}]"
        if not (isinstance(e, dict) and e.get("type") == "clear_thinking_20251015" and e.get("keep") == "all"
                and set(e) == {"type", "keep"}):
            raise BadRequest(f"{where}: active context edits are not supported; only clear_thinking_20251015 "
                             "with keep: \"all\" is accepted", param=where)


def _decode_thinking(w: CountTokensWire, info: ModelInfo) -> tuple[int | None, str | None, dict[str, Any]]:
    """thinking, thinking_token_budget and output_config.effort → (hard budget, effort, template kwargs)."""
    th = w.thinking
    requested: int | None = None
    if th is not None:
        if th.type not in ("enabled", "disabled", "adaptive", "between_tools"):
            raise BadRequest("thinking.type must be 'enabled', 'disabled', 'adaptive' or 'between_tools'",
                             param="thinking.type")
        if th.display not in (None, "summarized", "omitted") or (th.display and th.type == "disabled"):
            raise BadRequest("thinking.display must be 'summarized' or 'omitted' with thinking on",
                             param="thinking.display")
        if th.type == "enabled" and th.budget_tokens is None:
            raise BadRequest("thinking.budget_tokens is required when thinking is enabled",
                             param="thinking.budget_tokens")
        if th.type in ("disabled", "between_tools") and th.budget_tokens is not None:
            raise BadRequest(f"thinking.budget_tokens is not allowed with thinking type '{th.type}'",
                             param="thinking.budget_tokens")
        if th.budget_tokens is not None and th.budget_tokens < 1:
            raise BadRequest("thinking.budget_tokens must be positive", param="thinking.budget_tokens")
        requested = th.budget_tokens
    explicit = w.thinking_token_budget
    if explicit is not None:
        if not 0 < explicit <= MAX_BUDGET:
            raise BadRequest("thinking_token_budget must be a positive 32-bit integer", param="thinking_token_budget")
        if not info.has_reasoning:
            raise BadRequest("thinking_token_budget is not supported: this model has no reasoning syntax",
                             param="thinking_token_budget")
        if requested is not None and requested != explicit:
            raise BadRequest("thinking_token_budget and thinking.budget_tokens must match when both are given",
                             param="thinking_token_budget")
        requested = explicit
    disabled = th is not None and th.type == "disabled"
    level: str | None = None
    oc = w.output_config
    if oc is not None and oc.effort is not None:
        if oc.effort not in NEUTRAL_EFFORT_LEVELS or oc.effort == "minimal":
            raise BadRequest("output_config.effort must be one of low, medium, high, xhigh, max",
                             param="output_config.effort")
        level = oc.effort
    elif requested is not None:
        level = "low" if requested <= 5000 else "high" if requested <= 20000 else "max"
    # Budgets above the 32-bit output limit are accepted and never cut.
    budget = requested if requested is not None and requested <= MAX_BUDGET else None
    if budget is None and requested is None and not disabled:
        budget = info.thinking_token_budget
    kwargs: dict[str, Any] = {}
    if th is not None and info.has_reasoning:
        kwargs["enable_thinking"] = not disabled
    recipe = RECIPES.get(info.recipe)
    if level is not None and not disabled and recipe is not None:
        try:
            native = resolve_effort(recipe, level)
        except EffortError as exc:
            raise BadRequest(str(exc), param="output_config.effort") from None
        if native is not None:
            kwargs["reasoning_effort"] = native
    return (None if disabled else budget), level, kwargs


# -- encoding -------------------------------------------------------------------------------------


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


def _event(name: str, data: dict[str, Any]) -> StreamEvent:
    """A named Messages event; its data's type is its name."""
    return StreamEvent(data, name)


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
        self.content: list[dict[str, Any]] = []
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
        message = self._message_json([], None, None, self.usage())
        return [StreamEvent({"type": "message_start", "message": message}, "message_start")]

    def feed(self, index: int, u: ChildUpdate) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        if self.done:
            return out
        self.acc.add_counts(u)  # the blocks are built here; the accumulator only counts
        for e in u.events:
            if isinstance(e, TextDelta):
                if e.text:
                    out += self._delta("text", {"type": "text_delta", "text": e.text})
            elif isinstance(e, ReasoningDelta):
                if e.text and self.hide_thinking:
                    out += self._ensure_open("thinking")
                elif e.text:
                    out += self._delta("thinking", {"type": "thinking_delta", "thinking": e.text})
            elif isinstance(e, ToolCall):
                out += self._tool_use(e)
        f = u.finish
        if f is None:
            return out
        out += self._close()
        self.stop_reason = stop_reason(f.cause, self.num_calls > 0)
        self.stop_sequence = f.matched_stop if isinstance(f.matched_stop, str) and f.cause is FinishCause.STOP_STRING else None
        out.append(StreamEvent({
            "type": "message_delta",
            "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
            "usage": self.usage(),
        }, "message_delta"))
        out.append(StreamEvent({"type": "message_stop"}, "message_stop"))
        return out

    def finish(self) -> list[StreamEvent]:
        return []  # message_stop went out with the terminal update

    def fail(self, error: HeliosError) -> list[StreamEvent]:
        return [StreamEvent(error.to_anthropic(), "error")]

    def body(self) -> dict[str, Any]:
        """The buffered Message (after the terminal update)."""
        return self._message_json(self.content, self.stop_reason, self.stop_sequence, self.usage())

    def usage(self) -> dict[str, Any]:
        """Messages usage: input_tokens excludes what was read from the cache (cache_read_input_tokens)."""
        usage = usage_of(self.prompts, [self.acc], 1)
        cached = min(usage.cached_tokens, usage.prompt_tokens)
        return {"input_tokens": usage.prompt_tokens - cached, "output_tokens": usage.completion_tokens,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}

    # -- helpers ----------------------------------------------------------------------------------

    def _message_json(self, content: list[dict[str, Any]], reason: str | None, sequence: str | None,
                      usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence, "usage": usage}

    def _ensure_open(self, kind: Literal["text", "thinking"]) -> list[StreamEvent]:
        if self._open == kind:
            return []
        block: dict[str, Any] = {"type": "text", "text": ""} if kind == "text" else {
            "type": "thinking", "thinking": "", "signature": ""}
        return self._close() + self._open_block(kind, block)

    def _delta(self, kind: Literal["text", "thinking"], delta: dict[str, Any]) -> list[StreamEvent]:
        out = self._ensure_open(kind)
        cur = self.content[-1]
        if kind == "text":
            cur["text"] += delta["text"]
        else:
            cur["thinking"] += delta["thinking"]
        out.append(_event("content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1,
                                                    "delta": delta}))
        return out

    def _tool_use(self, call: ToolCall) -> list[StreamEvent]:
        out = self._close()
        self.num_calls += 1
        args = call.arguments if call.arguments.strip() else "{}"
        tid = tool_use_id(call.id)
        out += self._open_block("tool_use", {"type": "tool_use", "id": tid, "name": call.name, "input": {}})
        index = len(self.content) - 1
        self.content[index] = {"type": "tool_use", "id": tid, "name": call.name, "input": json.loads(args)}
        out.append(_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                    "delta": {"type": "input_json_delta", "partial_json": args}}))
        out += self._close()
        return out

    def _open_block(self, kind: BlockKind, block: dict[str, Any]) -> list[StreamEvent]:
        self.content.append(dict(block))
        self._open = kind
        return [_event("content_block_start", {"type": "content_block_start", "index": len(self.content) - 1,
                                                 "content_block": block})]

    def _close(self) -> list[StreamEvent]:
        if self._open is None:
            return []
        out: list[StreamEvent] = []
        index = len(self.content) - 1
        if self._open == "thinking":
            sig = thinking_signature(self.content[index]["thinking"])
            self.content[index]["signature"] = sig
            out.append(_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                        "delta": {"type": "signature_delta", "signature": sig}}))
        out.append(_event("content_block_stop", {"type": "content_block_stop", "index": index}))
        self._open = None
        return out
