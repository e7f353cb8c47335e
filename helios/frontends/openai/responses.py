"""POST /v1/responses, stateless: decode Responses input items into the neutral conversation model,
to run as one child.

Spec: api.md, "Stateless Responses", "Conversation and tool semantics", "Generation log
probabilities" and "Reasoning, sampling, and usage". Every request carries its whole conversation;
store, previous_response_id, conversation, background and automatic truncation are rejected.

This module is the request side (`decode_responses` → `ResponsesPlan`); the output side, the
encoder and its event order, is `helios.frontends.openai.responses_encoder`.
"""

from __future__ import annotations

import base64
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
    ToolGrammar,
    ToolResultPart,
)
from helios.domain.generation import (
    GenerationOptions,
    GenerationRequest,
    OutputConstraint,
    TokenStops,
)
from helios.domain.model import ModelInfo
from helios.errors import BadRequest
from helios.frontends.common import thinking_budget, validate_stops, validate_token_stops
from helios.frontends.fields import (
    NATIVE_GENERATION_ROWS,
    PROVIDER_ROWS,
    FieldTable,
    honoured,
    ignored,
    one_of,
    refused,
    screen_fields,
)
from helios.frontends.openai.chat import decode_sampling
from helios.frontends.openai.logprobs import validate_logprob_options
from helios.frontends.structured import (
    decode_structured_outputs,
    decode_text_format,
    one_constraint,
    tool_contract,
)
from helios.frontends.wire import NativeGenerationFields, loads_strict, structure

LOGPROBS_INCLUDE = "message.output_text.logprobs"

NAMESPACE_SEPARATOR = "__"

HOSTED_TOOL_TYPES = frozenset({
    "web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11",
    "file_search", "computer", "computer_use", "computer_use_preview", "code_interpreter",
    "image_generation", "mcp", "local_shell", "shell", "apply_patch", "tool_search",
    "programmatic_tool_calling",
})

EFFORT_NAMES = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


@attrs.frozen
class ResponsesWire(NativeGenerationFields):
    """The honoured fields of `RESPONSES_FIELDS`; ignored and refused ones never reach it."""

    input: Any
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    reasoning: Any = None
    text: Any = None
    include: list[str] | None = None
    stream: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    thinking_token_budget: int | None = None


_ECHOED = "; echoed on the Response object"
_STATELESS = "Helios keeps no responses, so every request carries its complete conversation"

RESPONSES_FIELDS: FieldTable = {
    "input": honoured("the conversation as input items"),
    "instructions": honoured("leading system instructions"),
    "tools": honoured("function, custom and namespace tools; hosted tool types are refused"),
    "tool_choice": honoured("auto, none, required or a named function or custom tool"),
    "parallel_tool_calls": honoured("false allows at most one call per response"),
    "max_output_tokens": honoured("output limit, reasoning included"),
    "temperature": honoured("sampling temperature (clamped to the recipe's range)"),
    "top_p": honoured("nucleus filter (clamped to the recipe's range)"),
    "top_logprobs": honoured("alternatives per token, with include message.output_text.logprobs"),
    "reasoning": honoured("effort selects the template's level; summary is accepted and echoed, but readable "
                          "reasoning comes back as reasoning_text with an empty summary"),
    "text": honoured("format text, json_object or json_schema (the answer is constrained; reasoning and tool "
                     "calls stay free); verbosity is echoed"),
    "include": honoured(f"{LOGPROBS_INCLUDE} fills logprobs; values Helios cannot fill, such as "
                        "reasoning.encrypted_content, are accepted and produce nothing"),
    "stream": honoured("named SSE events"),
    "chat_template_kwargs": honoured("vLLM extension: chat-template variables"),
    "thinking_token_budget": honoured("Helios extension: hard cap on reasoning tokens; at the cap the "
                                      "reasoning close token is forced (400 where the model cannot close it)"),
    **NATIVE_GENERATION_ROWS,
    "model": PROVIDER_ROWS["model"],
    "user": ignored(PROVIDER_ROWS["user"].reason + _ECHOED, str),
    "metadata": ignored(PROVIDER_ROWS["metadata"].reason + _ECHOED, dict),
    "safety_identifier": ignored(PROVIDER_ROWS["safety_identifier"].reason + _ECHOED, str),
    "prompt_cache_key": ignored(PROVIDER_ROWS["prompt_cache_key"].reason + _ECHOED, str),
    "service_tier": ignored("one local tier serves every request; the Response reports 'default'", str),
    "prompt_cache_retention": PROVIDER_ROWS["prompt_cache_retention"],
    "prompt_cache_options": PROVIDER_ROWS["prompt_cache_options"],
    "max_tool_calls": ignored("limits hosted tool calls, of which Helios has none" + _ECHOED, int),
    "stream_options": ignored("include_obfuscation: Helios adds no obfuscation padding to events", dict),
    "access_programs": ignored("provider account access programs; nothing to select locally", dict),
    "client_metadata": ignored("Codex client hints (installation and session ids); not in the public SDK "
                               "types, nothing to report them to", dict),
    "store": ignored("store: false is what Helios does anyway; store: true is refused (" + _STATELESS + ")", bool,
                     allows=one_of(False),
                     message="store: true is not supported; Helios keeps no responses (send store: false and the "
                             "complete conversation)"),
    "image": ignored("image context compression: Helios never compresses image context, which 'auto' and "
                     "'disabled' allow; 'enabled' is refused", dict,
                     allows=lambda v: v.get("context_compression") in (None, "auto", "disabled"),
                     message="image.context_compression 'enabled' is not supported; Helios does not compress "
                             "image context"),
    "previous_response_id": refused(_STATELESS, message="previous_response_id is not supported; Helios keeps no "
                                    "responses, so send the complete conversation as input"),
    "conversation": refused(_STATELESS, message="conversation is not supported; send the complete conversation "
                            "as input"),
    "background": refused("background responses need stored responses", inert=one_of(False),
                          message="background responses are not supported (background: true)"),
    "background_options": refused("background execution is not supported"),
    "truncation": refused("Helios rejects over-context requests instead of dropping input",
                          inert=one_of("disabled"),
                          message="truncation: 'auto' is not supported; Helios rejects over-context requests"),
    "prompt": refused("stored prompt templates live on the provider",
                      message="prompt (a stored prompt template) is not supported"),
    "context_management": refused("server-side compaction is not implemented", inert=lambda v: not v,
                                  message="context_management is not supported"),
    "moderation": refused("moderation of input and output is not available on a local server"),
    "prompt_logprobs": refused("prompt scoring is offered on Chat Completions and Completions",
                               message="prompt_logprobs is not supported on /v1/responses"),
}
"""Every top-level Responses field Helios knows (see `helios.frontends.fields`)."""

ECHOED_FIELDS = ("metadata", "user", "safety_identifier", "prompt_cache_key", "max_tool_calls")
"""Ignored fields the Response object reports back as sent."""


# -- tools ----------------------------------------------------------------------------------------


@attrs.frozen
class DeclaredTool:
    """One declared tool under the name the model sees (`namespace__name` inside a namespace)."""

    flat_name: str
    name: str
    kind: Literal["function", "custom"]
    namespace: str | None = None


@attrs.frozen
class ToolSet:
    tools: tuple[Tool, ...] = ()
    declared: dict[str, DeclaredTool] = attrs.field(factory=dict)

    def restore(self, flat_name: str) -> DeclaredTool:
        """The wire identity of a generated call; undeclared names come back as generated."""
        return self.declared.get(flat_name) or DeclaredTool(flat_name, flat_name, "function")


def decode_tools(raw: list[Any] | None, tool_choice: Any) -> tuple[ToolSet, ToolChoice]:
    tools: list[Tool] = []
    declared: dict[str, DeclaredTool] = {}

    def add(tool: Tool, entry: DeclaredTool) -> None:
        if entry.flat_name in declared:
            raise BadRequest(f"tool name '{entry.flat_name}' is ambiguous: it is declared more than once "
                             f"(namespaced tools are named namespace{NAMESPACE_SEPARATOR}name)", param="tools")
        declared[entry.flat_name] = entry
        tools.append(tool)

    for i, t in enumerate(raw or []):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or not isinstance(t.get("type"), str):
            raise BadRequest(f"{where} must be an object with a type", param="tools")
        kind = t["type"]
        if kind in ("function", "custom"):
            add(*_decode_tool(t, where, None))
        elif kind == "namespace":
            ns = t.get("name")
            if not isinstance(ns, str) or not ns:
                raise BadRequest(f"{where}.name must be a nonempty string", param="tools")
            inner = t.get("tools")
            if not isinstance(inner, list) or not inner:
                raise BadRequest(f"{where}.tools must be a nonempty array of function or custom tools", param="tools")
            for j, sub in enumerate(inner):
                sub_where = f"{where}.tools[{j}]"
                if not isinstance(sub, dict) or sub.get("type") not in ("function", "custom"):
                    raise BadRequest(f"{sub_where} must be a function or custom tool", param="tools")
                add(*_decode_tool(sub, sub_where, ns))
        elif kind in HOSTED_TOOL_TYPES:
            raise BadRequest(_hosted_tool_message(kind, where), param="tools")
        else:
            raise BadRequest(f"unsupported tool type '{kind}' in {where}", param="tools")
    return ToolSet(tuple(tools), declared), _decode_tool_choice(tool_choice, declared)


def _hosted_tool_message(kind: str, where: str) -> str:
    """Names the hosted tool and how to stop the client from sending it."""
    head = (f"hosted tool type '{kind}' in {where} is not supported; Helios serves client-executed function and "
            "custom tools only")
    if kind.startswith("web_search"):
        return head + "; disable web search in the client, e.g. Codex `web_search = \"disabled\"` in config.toml"
    return head + f"; disable the '{kind}' tool in the client or remove it from the request"


def _decode_tool(t: dict[str, Any], where: str, namespace: str | None) -> tuple[Tool, DeclaredTool]:
    name = t.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{where}.name must be a nonempty string", param="tools")
    desc = t.get("description")
    if desc is not None and not isinstance(desc, str):
        raise BadRequest(f"{where}.description must be a string", param="tools")
    flat = f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name
    if t["type"] == "function":
        if t.get("strict") is True:
            raise BadRequest("strict function schemas (strict: true) are not supported", param="tools")
        params = t.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise BadRequest(f"{where}.parameters must be an object", param="tools")
        return Tool(flat, desc, params), DeclaredTool(flat, name, "function", namespace)
    fmt = t.get("format")
    grammar = None
    if fmt is not None:
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise BadRequest(f"{where}.format must be an object with a type", param="tools")
        if fmt["type"] == "grammar":
            grammar = _tool_grammar(fmt, f"{where}.format")
        elif fmt["type"] != "text":
            raise BadRequest(f"unsupported custom tool format '{fmt['type']}'", param="tools")
    if grammar is not None:
        # The contract goes into the model's tool description; the completed input is validated
        # against the grammar before the call is emitted (serving.structured), never constrained.
        desc = tool_contract(desc, grammar)
    return (Tool(flat, desc, {}, kind="custom", grammar=grammar),
            DeclaredTool(flat, name, "custom", namespace))


def _tool_grammar(fmt: dict[str, Any], where: str) -> ToolGrammar:
    """A custom tool's ``{"type": "grammar", "syntax": "lark" | "regex", "definition": ...}``."""
    extra = sorted(set(fmt) - {"type", "syntax", "definition"})
    if extra:
        raise BadRequest(f"unrecognized field(s) in {where}: {', '.join(extra)}", param="tools")
    syntax, definition = fmt.get("syntax"), fmt.get("definition")
    if syntax not in ("lark", "regex"):
        raise BadRequest(f"{where}.syntax must be 'lark' or 'regex'", param="tools")
    if not isinstance(definition, str) or not definition.strip():
        raise BadRequest(f"{where}.definition must be a nonempty string", param="tools")
    return ToolGrammar(syntax, definition)


def _decode_tool_choice(choice: Any, declared: dict[str, DeclaredTool]) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto" if declared else "none")
    if choice in ("auto", "none"):
        return ToolChoice(choice)
    if choice == "required":
        if not declared:
            raise BadRequest("tool_choice 'required' needs at least one declared tool", param="tool_choice")
        return ToolChoice("required")
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        kind, name = choice["type"], choice.get("name")
        if not isinstance(name, str) or not name:
            raise BadRequest("tool_choice.name must be a nonempty string", param="tool_choice")
        entry = declared.get(name)
        if entry is None:
            raise BadRequest(f"tool_choice names '{name}', which is not a declared tool", param="tool_choice")
        if entry.kind != kind:
            raise BadRequest(f"tool_choice selects a {kind} tool, but '{name}' is a {entry.kind} tool",
                             param="tool_choice")
        return ToolChoice("named", name)
    if isinstance(choice, dict) and isinstance(choice.get("type"), str):
        raise BadRequest(f"tool_choice type '{choice['type']}' is not supported", param="tool_choice")
    raise BadRequest("tool_choice must be 'auto', 'none', 'required', {\"type\": \"function\", \"name\"} or "
                     "{\"type\": \"custom\", \"name\"}", param="tool_choice")


# -- input items ----------------------------------------------------------------------------------

_RANK = {ReasoningPart: 0, TextPart: 1, ImagePart: 1, ToolCallPart: 2}


def decode_input(raw: Any, instructions: str | None) -> tuple[Message, ...]:
    """Responses input (a string or items) → neutral messages. `instructions` lead as a system message.

    Consecutive assistant-side items (reasoning, assistant messages, function and custom calls) form
    one assistant turn while they keep the order reasoning → text → calls; each tool output is its
    own tool message."""
    out: list[Message] = []
    if instructions:
        out.append(Message("system", (TextPart(instructions),)))
    if isinstance(raw, str):
        out.append(Message("user", (TextPart(raw),)))
        return tuple(out)
    if not isinstance(raw, list):
        raise BadRequest("'input' must be a string or an array of input items", param="input")
    if not raw:
        raise BadRequest("'input' must contain at least one item", param="input")
    turn: list[Part] = []

    def flush() -> None:
        if turn:
            out.append(Message("assistant", tuple(turn)))
            turn.clear()

    def assistant(part: Part) -> None:
        if turn and _RANK[type(part)] < _RANK[type(turn[-1])]:
            flush()
        turn.append(part)

    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"{where} must be an object", param="input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise BadRequest(f"{where}.role must be one of user, system, developer, assistant", param="input")
            parts = _message_content(item.get("content"), where, role)
            if role == "assistant":
                for p in parts:
                    assistant(p)
            else:
                flush()
                out.append(Message(role, parts))
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            if text:
                assistant(ReasoningPart(text))
        elif kind == "function_call":
            call_id = _nonempty_str(item, "call_id", where)
            name = _flat_call_name(item, where)
            args = item.get("arguments", "{}")
            if not isinstance(args, str):
                raise BadRequest(f"{where}.arguments must be a JSON string", param="input")
            try:
                parsed = loads_strict(args) if args.strip() else {}
            except ValueError:
                raise BadRequest(f"{where}.arguments must be a JSON object", param="input") from None
            if not isinstance(parsed, dict):
                raise BadRequest(f"{where}.arguments must be a JSON object", param="input")
            assistant(ToolCallPart(call_id, name, parsed))
        elif kind == "custom_tool_call":
            call_id = _nonempty_str(item, "call_id", where)
            name = _flat_call_name(item, where)
            text_input = item.get("input")
            if not isinstance(text_input, str):
                raise BadRequest(f"{where}.input must be a string", param="input")
            assistant(ToolCallPart(call_id, name, {"input": text_input}))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            flush()
            call_id = _nonempty_str(item, "call_id", where)
            content = _tool_output(item.get("output"), where)
            out.append(Message("tool", (ToolResultPart(call_id, content),)))
        elif kind == "item_reference":
            raise BadRequest(f"{where}: item references need stored responses, which Helios does not keep; "
                             "send the complete items", param="input")
        elif isinstance(kind, str):
            raise BadRequest(f"unsupported input item type '{kind}' in {where}", param="input")
        else:
            raise BadRequest(f"{where} must have a type or a role", param="input")
    flush()
    return tuple(out)


def _nonempty_str(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{where}.{key} must be a nonempty string", param="input")
    return value


def _flat_call_name(item: dict[str, Any], where: str) -> str:
    name = _nonempty_str(item, "name", where)
    ns = item.get("namespace")
    if ns is None:
        return name
    if not isinstance(ns, str):
        raise BadRequest(f"{where}.namespace must be a string", param="input")
    return f"{ns}{NAMESPACE_SEPARATOR}{name}" if ns else name


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    texts: list[str] = []
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list):
            raise BadRequest(f"{where}.{key} must be an array", param="input")
        for j, p in enumerate(parts):
            if not isinstance(p, dict) or p.get("type") != part_type or not isinstance(p.get("text"), str):
                raise BadRequest(f"{where}.{key}[{j}] must be a {part_type} part with text", param="input")
            texts.append(p["text"])
        if texts:
            break  # readable content wins over a summary
    if not texts and item.get("encrypted_content"):
        raise BadRequest(f"{where}: opaque encrypted reasoning is not supported; replay reasoning items with "
                         "readable reasoning_text content", param="input")
    return "\n\n".join(t for t in texts if t)


def _message_content(content: Any, where: str, role: str) -> tuple[Part, ...]:
    if isinstance(content, str):
        return (TextPart(content),)
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or an array of content parts", param="input")
    parts: list[Part] = []
    for j, p in enumerate(content):
        pw = f"{where}.content[{j}]"
        if not isinstance(p, dict) or not isinstance(p.get("type"), str):
            raise BadRequest(f"{pw} must be an object with a type", param="input")
        t = p["type"]
        if t in ("input_text", "output_text"):
            if not isinstance(p.get("text"), str):
                raise BadRequest(f"{pw}.text must be a string", param="input")
            parts.append(TextPart(p["text"]))
        elif t == "refusal" and role == "assistant":
            if not isinstance(p.get("refusal"), str):
                raise BadRequest(f"{pw}.refusal must be a string", param="input")
            parts.append(TextPart(p["refusal"]))
        elif t == "input_image":
            if role != "user":
                raise BadRequest(f"{pw}: images are accepted in user messages and tool outputs only", param="input")
            parts.append(_image(p, pw))
        elif t == "input_file":
            raise BadRequest(f"{pw}: file inputs are not supported", param="input")
        else:
            raise BadRequest(f"unsupported content part type '{t}' in {where}", param="input")
    return tuple(parts)


def _tool_output(output: Any, where: str) -> tuple[TextPart | ImagePart, ...]:
    if isinstance(output, str):
        return (TextPart(output),)
    if not isinstance(output, list):
        raise BadRequest(f"{where}.output must be a string or an array of content parts", param="input")
    parts: list[TextPart | ImagePart] = []
    for j, p in enumerate(output):
        pw = f"{where}.output[{j}]"
        if not isinstance(p, dict) or not isinstance(p.get("type"), str):
            raise BadRequest(f"{pw} must be an object with a type", param="input")
        if p["type"] in ("input_text", "output_text"):
            if not isinstance(p.get("text"), str):
                raise BadRequest(f"{pw}.text must be a string", param="input")
            parts.append(TextPart(p["text"]))
        elif p["type"] == "input_image":
            parts.append(_image(p, pw))
        else:
            raise BadRequest(f"unsupported tool output part type '{p['type']}' in {where}", param="input")
    return tuple(parts)


def _image(p: dict[str, Any], where: str) -> ImagePart:
    """A base64 data URL's image; the serving side checks its bytes, the limits and that the model
    takes images (a text-only model's 400 names the model, as on every route)."""
    url = p.get("image_url")
    if p.get("file_id") is not None:
        raise BadRequest(f"{where}: file_id images are unsupported (there is no file store); send the image "
                         "as a base64 data URL in image_url", param="input")
    if not isinstance(url, str) or not url.startswith("data:"):
        raise BadRequest(f"{where}: images must be base64 data URLs; remote image downloads are unsupported",
                         param="input")
    head, _, data = url.partition(",")
    media = head[5:].split(";")[0]
    if media not in ("image/png", "image/jpeg", "image/webp") or ";base64" not in head:
        raise BadRequest(f"{where}: images must be base64 PNG, JPEG or WebP data URLs", param="input")
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError:
        raise BadRequest(f"{where}: invalid base64 image data", param="input") from None
    return ImagePart(media, raw, where)


# -- the request ----------------------------------------------------------------------------------


@attrs.frozen
class ResponsesPlan:
    wire: ResponsesWire
    conversation: ConversationRequest
    toolset: ToolSet
    stream: bool
    stops: tuple[str, ...]
    token_stops: TokenStops
    num_top_logprobs: int | None
    logprob_token_ids: tuple[int, ...] | None
    effort: str | None
    summary: str | None
    text_config: dict[str, Any]
    echo: dict[str, Any] = attrs.field(factory=dict, eq=False)
    """`ECHOED_FIELDS` as sent: reported on the Response object, no effect on generation."""
    constraint: OutputConstraint | None = None
    """Structured output: ``text.format`` json_object / json_schema or ``structured_outputs``."""
    thinking_token_budget: int | None = None
    """The hard reasoning cap (the request's, else the server default)."""
    thinking_token_budget_param: str | None = None
    """``thinking_token_budget`` when the request gave it (an unsupported format is then a 400)."""

    @property
    def generation(self) -> GenerationRequest:
        w = self.wire
        options = GenerationOptions(
            max_tokens=w.max_output_tokens,
            stop=self.stops,
            token_stops=self.token_stops,
            ignore_eos=bool(w.ignore_eos),
            include_stop_str_in_output=bool(w.include_stop_str_in_output),
            skip_special_tokens=True if w.skip_special_tokens is None else w.skip_special_tokens,
            num_top_logprobs=self.num_top_logprobs,
            logprob_token_ids=self.logprob_token_ids,
            thinking_token_budget=self.thinking_token_budget,
            thinking_token_budget_param=self.thinking_token_budget_param,
            constraint=self.constraint,
        )
        return GenerationRequest(sampling=self.conversation.sampling, options=options,
                                 conversation=self.conversation, input_param="input",
                                 output_param="max_output_tokens", id_prefix="resp")


def decode_responses(obj: dict[str, Any], info: ModelInfo) -> ResponsesPlan:
    if "input" not in obj:
        raise BadRequest("missing required parameter: input", param="input")
    w = structure(screen_fields(obj, RESPONSES_FIELDS), ResponsesWire)
    if w.max_output_tokens is not None and w.max_output_tokens < 1:
        raise BadRequest("max_output_tokens must be at least 1", param="max_output_tokens")
    budget, budget_param = thinking_budget(w.thinking_token_budget, info.thinking_token_budget)
    text_config = _decode_text(w.text)
    include = w.include or []
    wants_logprobs = LOGPROBS_INCLUDE in include
    if w.top_logprobs and not wants_logprobs:
        raise BadRequest(f"top_logprobs requires include: [\"{LOGPROBS_INCLUDE}\"]", param="top_logprobs")
    num_top, explicit = validate_logprob_options(
        logprobs=wants_logprobs, top_logprobs=w.top_logprobs, logprob_token_ids=w.logprob_token_ids,
        info=info,
    )
    stops = validate_stops(w.stop)
    token_stops = validate_token_stops(w.stop_token_ids, w.stop_token_sequences, info.vocab_size,
                                       string_stops=stops)
    toolset, choice = decode_tools(w.tools, w.tool_choice)
    effort, summary, effort_kwargs = _decode_reasoning(w.reasoning, info)
    messages = decode_input(w.input, w.instructions)
    conv = ConversationRequest(
        messages=messages,
        tools=toolset.tools,
        tool_choice=choice,
        parallel_tool_calls=True if w.parallel_tool_calls is None else w.parallel_tool_calls,
        sampling=decode_sampling(w),
        chat_template_kwargs={**effort_kwargs, **(w.chat_template_kwargs or {})},
    )
    echo = {name: obj[name] for name in ECHOED_FIELDS if obj.get(name) is not None}
    constraint = one_constraint(decode_text_format((w.text or {}).get("format") if isinstance(w.text, dict) else None),
                                decode_structured_outputs(w.structured_outputs))
    return ResponsesPlan(w, conv, toolset, bool(w.stream), stops, token_stops, num_top, explicit, effort, summary,
                         text_config, echo, constraint, thinking_token_budget=budget,
                         thinking_token_budget_param=budget_param)


def _decode_text(text: Any) -> dict[str, Any]:
    if text is None:
        return {"format": {"type": "text"}}
    if not isinstance(text, dict):
        raise BadRequest("text must be an object", param="text")
    extra = set(text) - {"format", "verbosity"}
    if extra:
        raise BadRequest(f"unrecognized field(s) in text: {', '.join(sorted(extra))}", param="text")
    fmt = text.get("format")
    out: dict[str, Any] = {"format": {"type": "text"}}
    if isinstance(fmt, dict) and decode_text_format(fmt) is not None:  # the Response echoes it as given
        out["format"] = dict(fmt)
    verbosity = text.get("verbosity")
    if verbosity is not None:
        if verbosity not in ("low", "medium", "high"):
            raise BadRequest("text.verbosity must be 'low', 'medium' or 'high'", param="text.verbosity")
        out["verbosity"] = verbosity
    return out


def _decode_reasoning(reasoning: Any, info: ModelInfo) -> tuple[str | None, str | None, dict[str, Any]]:
    """(effort as given, summary as given, chat-template kwargs the effort selects)."""
    if reasoning is None:
        return None, None, {}
    if not isinstance(reasoning, dict):
        raise BadRequest("reasoning must be an object", param="reasoning")
    extra = set(reasoning) - {"effort", "summary", "generate_summary", "context", "mode"}  # the last two are inert
    if extra:
        raise BadRequest(f"unrecognized field(s) in reasoning: {', '.join(sorted(extra))}", param="reasoning")
    summary = reasoning.get("summary", reasoning.get("generate_summary"))
    if summary is not None and summary not in ("auto", "concise", "detailed"):
        raise BadRequest("reasoning.summary must be 'auto', 'concise' or 'detailed'", param="reasoning.summary")
    effort = reasoning.get("effort")
    if effort is None:
        return None, summary, {}
    if not isinstance(effort, str) or effort not in EFFORT_NAMES:
        raise BadRequest(f"reasoning.effort must be one of {', '.join(EFFORT_NAMES)}; numeric efforts are not "
                         "accepted here", param="reasoning.effort")
    if effort == "none":
        return effort, summary, {"enable_thinking": False}
    from helios.recipes import EffortError, UnknownRecipeError, get_recipe, resolve_effort

    try:
        level = resolve_effort(get_recipe(info.recipe), effort)
    except UnknownRecipeError:
        level = None
    except EffortError as exc:
        raise BadRequest(str(exc), param="reasoning.effort") from None
    return effort, summary, ({"reasoning_effort": level} if level else {})
