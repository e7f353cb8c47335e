"""POST /v1/responses, stateless: decode Responses input items into the neutral conversation model,
to run as one child.

Spec: api.md, "Stateless Responses", "Conversation and tool semantics", "Generation log
probabilities" and "Reasoning, sampling, and usage". Every request carries its whole conversation;
store, previous_response_id, conversation, background and automatic truncation are rejected.

This module is the request side (`decode_responses` → `ResponsesPlan`): the request's shapes are
declared below (`ResponsesWire` and its items, parts and tools) and structured by
`helios.frontends.wire`, so a bad value anywhere is a 400 naming its path. The output side, the
encoder and its event order, is `helios.frontends.openai.responses_encoder`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any, ClassVar, Literal, NewType, cast

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
from helios.domain.generation import GenerationOptions, GenerationRequest, OutputConstraint
from helios.domain.model import ModelInfo
from helios.errors import BadRequest
from helios.frontends.common import decide_tool_choice, thinking_budget
from helios.frontends.fields import (
    PROVIDER_ROWS,
    FieldTable,
    field_table,
    honoured,
    ignored,
    one_of,
    refused,
    screen_fields,
    wire_field,
)
from helios.frontends.openai.chat import decode_sampling, output_options
from helios.frontends.openai.logprobs import validate_logprob_options
from helios.frontends.structured import (
    decode_format,
    decode_structured_outputs,
    one_constraint,
    tool_contract,
)
from helios.frontends.wire import (
    From,
    Invalid,
    JSONObjectString,
    NativeGenerationFields,
    NonEmptyStr,
    all_built,
    data_url_image,
    register_leaf,
    structure,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"

NAMESPACE_SEPARATOR = "__"


NonBlankStr = NewType("NonBlankStr", str)
"""A string with a character other than whitespace (grammar definitions)."""


def _nonblank_str(v: Any, _t: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise Invalid("must be a nonempty string")
    return v


register_leaf(NonBlankStr, _nonblank_str)


# -- the request's shapes (the SDK's ResponseInputItemParam, its content parts, ToolParam, ToolChoice) ----


@attrs.define(kw_only=True)
class _Lenient:
    """Items, parts and tools (its subclasses) ignore keys Helios does not read (ids, statuses,
    annotations, hints, an image's detail): replayed output items carry them, and a client may send
    newer ones."""

    __wire_lenient__: ClassVar[bool] = True


@attrs.define(kw_only=True)
class InputText(_Lenient):
    type: Literal["input_text", "output_text"]
    text: str

    __wire_build__: ClassVar[Callable[..., TextPart]] = TextPart


@attrs.define(kw_only=True)
class RefusalText(_Lenient):
    """An assistant's replayed refusal: its text is the turn's text (other roles refuse it)."""

    type: Literal["refusal"]
    refusal: str


@attrs.define(kw_only=True)
class InputImage(_Lenient):
    """A base64 data URL's image; the serving side checks its bytes, the limits and that the model
    takes images (a text-only model's 400 names the model, as on every route). It is built without
    its place; the item that holds it gives it one (`_part`)."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None

    @staticmethod
    def __wire_build__(*, image_url: str | None, file_id: str | None) -> ImagePart:
        if file_id is not None:
            raise Invalid("file_id images are unsupported (there is no file store); send the image as a base64 "
                          "data URL in image_url", param_at="file_id")
        return ImagePart(*data_url_image(image_url or "", param_at="image_url"))


@attrs.define(kw_only=True)
class InputFile:
    __wire_refused__: ClassVar[str] = "file inputs are not supported"
    type: Literal["input_file"]


MessageContent = str | list[Annotated[TextPart | ImagePart | RefusalText,
                                      From(InputText | RefusalText | InputImage | InputFile)]]
OutputContent = str | list[Annotated[TextPart | ImagePart, From(InputText | InputImage)]]


def _parts(role: str, parts: Sequence[TextPart | ImagePart | RefusalText],
           where: str) -> tuple[TextPart | ImagePart, ...]:
    """The built parts of a `role` message at `where` (``input[2].content``; role tool: a tool
    output's)."""
    return tuple([_part(role, p, f"{where}[{j}]") for j, p in enumerate(parts)])


def _part(role: str, p: TextPart | ImagePart | RefusalText, where: str) -> TextPart | ImagePart:
    """A built part at `where` (``input[2].content[1]``): an image placed there, for later messages (only
    a user's or a tool output's), a refusal read as its text (only an assistant's)."""
    if isinstance(p, TextPart):
        return p
    if isinstance(p, RefusalText):
        if role != "assistant":
            raise BadRequest(f"{where}: refusal parts belong in assistant messages", param=f"{where}.type")
        return TextPart(p.refusal)
    if role not in ("user", "tool"):
        raise BadRequest(f"{where}: images are accepted in user messages and tool outputs only",
                         param=f"{where}.type")
    return ImagePart(p.media_type, p.data, where)


# Items build their domain value where they are complete: a message its Message, a call its
# ToolCallPart, an output its tool Message, reasoning its ReasoningPart. An item holding an image or a
# refusal stays a wire item (its builder returns None), which `decode_input` completes with its place.


@attrs.define(kw_only=True)
class MessageItem(_Lenient):
    """A message; an easy message has no ``type`` (the default member)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: MessageContent

    @staticmethod
    def __wire_build__(*, role: Literal["user", "system", "developer", "assistant"],
                       content: MessageContent) -> Message | None:
        texts = (TextPart(content),) if isinstance(content, str) else all_built(content, (TextPart,))
        return None if texts is None else Message(role, texts)

    def message(self, where: str) -> Message:
        """The message, its images placed (only a user's) and its refusals read (only an assistant's)."""
        parts = cast("list[TextPart | ImagePart | RefusalText]", self.content)  # a string's is built
        return Message(self.role, _parts(self.role, parts, f"{where}.content"))


def _flat(namespace: str | None, name: str) -> str:
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


@attrs.define(kw_only=True)
class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: NonEmptyStr
    namespace: str | None = None
    arguments: JSONObjectString = attrs.field(factory=lambda: JSONObjectString({}))

    @staticmethod
    def __wire_build__(*, call_id: str, name: str, namespace: str | None,
                       arguments: dict[str, Any]) -> ToolCallPart:  # absent: the default's fresh {}
        return ToolCallPart(call_id, _flat(namespace, name), arguments)


@attrs.define(kw_only=True)
class CustomToolCallItem(_Lenient):
    type: Literal["custom_tool_call"]
    call_id: NonEmptyStr
    name: NonEmptyStr
    namespace: str | None = None
    input: str

    @staticmethod
    def __wire_build__(*, call_id: str, name: str, namespace: str | None, input: str) -> ToolCallPart:
        return ToolCallPart(call_id, _flat(namespace, name), {"input": input})


@attrs.define(kw_only=True)
class ToolOutputItem(_Lenient):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: NonEmptyStr
    output: OutputContent

    @staticmethod
    def __wire_build__(*, call_id: NonEmptyStr, output: OutputContent) -> Message | None:
        texts = (TextPart(output),) if isinstance(output, str) else all_built(output, (TextPart,))
        return None if texts is None else Message("tool", (ToolResultPart(call_id, texts),))

    def message(self, where: str) -> Message:
        """The tool message, its images placed."""
        parts = cast("list[TextPart | ImagePart]", self.output)  # a string's is built
        return Message("tool", (ToolResultPart(self.call_id, _parts("tool", parts, f"{where}.output")),))


@attrs.define(kw_only=True)
class ReasoningText(_Lenient):
    type: Literal["reasoning_text"]
    text: str


@attrs.define(kw_only=True)
class SummaryText(_Lenient):
    type: Literal["summary_text"]
    text: str


@attrs.define(kw_only=True)
class ReasoningItem(_Lenient):
    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None
    summary: list[SummaryText] | None = None
    encrypted_content: Any = None

    @staticmethod
    def __wire_build__(*, content: list[ReasoningText] | None, summary: list[SummaryText] | None,
                       encrypted_content: Any) -> ReasoningPart:
        """Readable content, else the summary, joined; opaque encrypted reasoning alone is refused."""
        texts = [p.text for p in content or ()] or [p.text for p in summary or ()]
        if not texts and encrypted_content:
            raise Invalid("opaque encrypted reasoning is not supported; replay reasoning items with readable "
                          "reasoning_text content", param_at="encrypted_content")
        return ReasoningPart("\n\n".join(t for t in texts if t))


@attrs.define(kw_only=True)
class ItemReference:
    __wire_refused__: ClassVar[str] = ("item references need stored responses, which Helios does not keep; send the "
                                       "complete items")
    type: Literal["item_reference"]


InputItem = MessageItem | FunctionCallItem | CustomToolCallItem | ToolOutputItem | ReasoningItem | ItemReference
BuiltItem = Annotated[Message | ToolCallPart | ReasoningPart | MessageItem | ToolOutputItem, From(InputItem)]
"""An input item as structured: its domain value, or the wire item where an image or refusal needs more."""


@attrs.define(kw_only=True)
class GrammarFormat:
    """A custom tool's ``{"type": "grammar", "syntax": "lark" | "regex", "definition": ...}``."""

    type: Literal["grammar"]
    syntax: Literal["lark", "regex"]
    definition: NonBlankStr


@attrs.define(kw_only=True)
class PlainTextFormat(_Lenient):
    type: Literal["text"]


@attrs.define(kw_only=True)
class FunctionToolWire(_Lenient):
    type: Literal["function"]
    name: NonEmptyStr
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = wire_field(refused("strict function schemas are not implemented", inert=one_of(False),
                                             message="strict function schemas (strict: true) are not supported"))

    def tool(self, flat: str) -> Tool:
        params = {"type": "object", "properties": {}} if self.parameters is None else self.parameters
        return Tool(flat, self.description, params)


@attrs.define(kw_only=True)
class CustomToolWire(_Lenient):
    type: Literal["custom"]
    name: NonEmptyStr
    description: str | None = None
    format: GrammarFormat | PlainTextFormat | None = None

    def tool(self, flat: str) -> Tool:
        if type(self.format) is not GrammarFormat:
            return Tool(flat, self.description, {}, kind="custom")
        grammar = ToolGrammar(self.format.syntax, self.format.definition)
        # The contract goes into the model's tool description; the completed input is validated
        # against the grammar before the call is emitted (serving.structured), never constrained.
        return Tool(flat, tool_contract(self.description, grammar), {}, kind="custom", grammar=grammar)


@attrs.define(kw_only=True)
class NamespaceTool(_Lenient):
    type: Literal["namespace"]
    name: NonEmptyStr
    tools: list[FunctionToolWire | CustomToolWire]


def _hosted_tool(kind: str) -> Invalid:
    """Names the hosted tool and how to stop the client from sending it (param ``tools``, which
    clients key on)."""
    head = (f"hosted tool type '{kind}' is not supported; Helios serves client-executed function and custom "
            "tools only")
    advice = ("disable web search in the client, e.g. Codex `web_search = \"disabled\"` in config.toml"
              if kind.startswith("web_search") else f"disable the '{kind}' tool in the client or remove it from "
              "the request")
    return Invalid(f"{head}; {advice}", at="type", param="tools")


@attrs.define(kw_only=True)
class HostedTool:
    __wire_refused__: ClassVar[Callable[[str], Invalid]] = _hosted_tool
    type: Literal["web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11",
                  "file_search", "computer", "computer_use", "computer_use_preview", "code_interpreter",
                  "image_generation", "mcp", "local_shell", "shell", "apply_patch", "tool_search",
                  "programmatic_tool_calling"]


ToolWire = Annotated[FunctionToolWire | CustomToolWire | NamespaceTool,
                     From(FunctionToolWire | CustomToolWire | NamespaceTool | HostedTool)]
"""A tool as structured (hosted tools are refused)."""


@attrs.define(kw_only=True)
class NamedToolChoice(_Lenient):
    type: Literal["function", "custom"]
    name: NonEmptyStr


ToolChoiceWire = Literal["auto", "none", "required"] | NamedToolChoice


@attrs.define(kw_only=True)
class TextWire:
    format: Any = None  # `structured.decode_format`
    verbosity: Literal["low", "medium", "high"] | None = None


@attrs.define(kw_only=True)
class ReasoningWire:
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the deprecated name of summary
    context: Any = None  # inert
    mode: Any = None  # inert


@attrs.define(kw_only=True)
class ResponsesWire(NativeGenerationFields):
    """The honoured fields of `RESPONSES_FIELDS`, each with its row; ignored and refused ones never reach it."""

    input: str | list[BuiltItem] = wire_field(honoured("the conversation as input items"), required=True)
    instructions: str | None = wire_field(honoured("leading system instructions"))
    tools: list[ToolWire] | None = wire_field(
        honoured("function, custom and namespace tools; hosted tool types are refused"))
    tool_choice: ToolChoiceWire | None = wire_field(
        honoured("auto, none, required or a named function or custom tool"))
    parallel_tool_calls: bool | None = wire_field(honoured("false allows at most one call per response"))
    max_output_tokens: int | None = wire_field(honoured("output limit, reasoning included"))
    temperature: float | None = wire_field(honoured("sampling temperature (clamped to the recipe's range)"))
    top_p: float | None = wire_field(honoured("nucleus filter (clamped to the recipe's range)"))
    top_logprobs: int | None = wire_field(
        honoured("alternatives per token, with include message.output_text.logprobs"))
    reasoning: ReasoningWire | None = wire_field(honoured(
        "effort selects the template's level; summary is accepted and echoed, but readable reasoning comes back "
        "as reasoning_text with an empty summary"))
    text: TextWire | None = wire_field(honoured(
        "format text, json_object or json_schema (the answer is constrained; reasoning and tool calls stay free); "
        "verbosity is echoed"))
    include: list[str] | None = wire_field(honoured(
        f"{LOGPROBS_INCLUDE} fills logprobs; values Helios cannot fill, such as reasoning.encrypted_content, are "
        "accepted and produce nothing"))
    stream: bool | None = wire_field(honoured("named SSE events"))
    chat_template_kwargs: dict[str, Any] | None = wire_field(honoured("vLLM extension: chat-template variables"))
    thinking_token_budget: int | None = wire_field(honoured(
        "Helios extension: hard cap on reasoning tokens; at the cap the reasoning close token is forced (400 where "
        "the model cannot close it)"))


ECHOED_FIELDS = ("metadata", "user", "safety_identifier", "prompt_cache_key", "max_tool_calls")
"""Ignored fields the Response object reports back as sent."""

_ECHOED = "; echoed on the Response object"
_STATELESS = "Helios keeps no responses, so every request carries its complete conversation"

RESPONSES_FIELDS: FieldTable = field_table(
    ResponsesWire,
    PROVIDER_ROWS,
    {name: attrs.evolve(PROVIDER_ROWS[name], reason=PROVIDER_ROWS[name].reason + _ECHOED)
     for name in ECHOED_FIELDS if name in PROVIDER_ROWS},
    service_tier=ignored("one local tier serves every request; the Response reports 'default'", str),
    max_tool_calls=ignored("limits hosted tool calls, of which Helios has none" + _ECHOED, int),
    stream_options=ignored("include_obfuscation: Helios adds no obfuscation padding to events", dict),
    access_programs=ignored("provider account access programs; nothing to select locally", dict),
    client_metadata=ignored("Codex client hints (installation and session ids); not in the public SDK "
                            "types, nothing to report them to", dict),
    store=ignored("store: false is what Helios does anyway; store: true is refused (" + _STATELESS + ")", bool,
                  allows=one_of(False),
                  message="store: true is not supported; Helios keeps no responses (send store: false and the "
                          "complete conversation)"),
    image=ignored("image context compression: Helios never compresses image context, which 'auto' and "
                  "'disabled' allow; 'enabled' is refused", dict,
                  allows=lambda v: v.get("context_compression") in (None, "auto", "disabled"),
                  message="image.context_compression 'enabled' is not supported; Helios does not compress "
                          "image context"),
    previous_response_id=refused(_STATELESS, message="previous_response_id is not supported; Helios keeps no "
                                                     "responses, so send the complete conversation as input"),
    conversation=refused(_STATELESS, message="conversation is not supported; send the complete conversation "
                                             "as input"),
    background=refused("background responses need stored responses", inert=one_of(False),
                       message="background responses are not supported (background: true)"),
    background_options=refused("background execution is not supported"),
    truncation=refused("Helios rejects over-context requests instead of dropping input",
                       inert=one_of("disabled"),
                       message="truncation: 'auto' is not supported; Helios rejects over-context requests"),
    prompt=refused("stored prompt templates live on the provider",
                   message="prompt (a stored prompt template) is not supported"),
    context_management=refused("server-side compaction is not implemented", inert=lambda v: not v,
                               message="context_management is not supported"),
    moderation=refused("moderation of input and output is not available on a local server"),
    prompt_logprobs=refused("prompt scoring is offered on Chat Completions and Completions",
                            message="prompt_logprobs is not supported on /v1/responses"),
)
"""Every top-level Responses field Helios knows (see `helios.frontends.fields`)."""


# -- tools ----------------------------------------------------------------------------------------


@attrs.frozen
class DeclaredTool:
    """One declared tool's wire identity, under the name the model sees (`namespace__name` inside a
    namespace)."""

    name: str
    kind: Literal["function", "custom"]
    namespace: str | None = None


@attrs.frozen
class ToolSet:
    tools: tuple[Tool, ...] = ()
    declared: dict[str, DeclaredTool] = attrs.field(factory=dict)

    def restore(self, flat_name: str) -> DeclaredTool:
        """The wire identity of a generated call; undeclared names come back as generated."""
        return self.declared.get(flat_name) or DeclaredTool(flat_name, "function")


def toolset_of(tools: list[ToolWire] | None, choice: ToolChoiceWire | None) -> tuple[ToolSet, ToolChoice]:
    """Declared tools (namespaced ones flattened to ``namespace__name``) and the choice among them."""
    declared: dict[str, DeclaredTool] = {}
    built: list[Tool] = []
    for i, t in enumerate(tools or ()):
        namespace, subs = (t.name, t.tools) if isinstance(t, NamespaceTool) else (None, [t])
        if not subs:  # an empty namespace
            raise BadRequest(f"tools[{i}].tools must be a nonempty array of function or custom tools",
                             param=f"tools[{i}].tools")
        for j, sub in enumerate(subs):
            flat = _flat(namespace, sub.name)
            if flat in declared:
                where = f"tools[{i}]" if namespace is None else f"tools[{i}].tools[{j}]"
                raise BadRequest(f"tool name '{flat}' is ambiguous: it is declared more than once "
                                 f"(namespaced tools are named namespace{NAMESPACE_SEPARATOR}name)",
                                 param=f"{where}.name")
            declared[flat] = DeclaredTool(sub.name, sub.type, namespace)
            built.append(sub.tool(flat))
    if not isinstance(choice, NamedToolChoice):
        return ToolSet(tuple(built), declared), decide_tool_choice("responses", declared, choice)
    chosen = decide_tool_choice("responses", declared, name=choice.name)
    if (kind := declared[choice.name].kind) != choice.type:
        raise BadRequest(f"tool_choice selects a {choice.type} tool, but '{choice.name}' is a {kind} tool",
                         param="tool_choice.type")
    return ToolSet(tuple(built), declared), chosen


# -- input items ----------------------------------------------------------------------------------

_RANK = {ReasoningPart: 0, TextPart: 1, ImagePart: 1, ToolCallPart: 2}


def decode_input(raw: str | list[BuiltItem], instructions: str | None) -> tuple[Message, ...]:
    """Responses input (a string: one user message, or built items) → neutral messages, `instructions`
    leading as a system message. Consecutive assistant-side items (reasoning, assistant messages,
    function and custom calls) form one assistant turn while they keep the order reasoning → text →
    calls; each tool output is its own tool message."""
    if isinstance(raw, str):
        raw = [Message("user", (TextPart(raw),))]
    elif not raw:
        raise BadRequest("'input' must contain at least one item", param="input")
    out: list[Message | list[Part]] = [Message("system", (TextPart(instructions),))] if instructions else []
    for i, item in enumerate(raw):  # an assistant turn in `out` is the list of its parts
        if type(item) is MessageItem or type(item) is ToolOutputItem:
            item = item.message(f"input[{i}]")
        if type(item) is Message and item.role != "assistant":
            out.append(item)
            continue
        parts = item.parts if type(item) is Message else (cast("ToolCallPart | ReasoningPart", item),)
        for part in parts:
            if type(part) is ReasoningPart and not part.text:
                continue  # empty reasoning replays nothing
            if out and isinstance(turn := out[-1], list) and _RANK[type(turn[-1])] <= _RANK[type(part)]:
                turn.append(part)
            else:
                out.append([part])
    return tuple([Message("assistant", tuple(m)) if isinstance(m, list) else m for m in out])


# -- the request ----------------------------------------------------------------------------------


@attrs.frozen
class ResponsesPlan:
    """A decoded Responses request: what to generate, and what the Response object echoes."""

    wire: ResponsesWire
    generation: GenerationRequest
    toolset: ToolSet
    stream: bool
    effort: str | None
    summary: str | None
    text_config: dict[str, Any]
    echo: dict[str, Any] = attrs.field(factory=dict, eq=False)
    """`ECHOED_FIELDS` as sent: reported on the Response object, no effect on generation."""
    tools_as_sent: list[Any] = attrs.field(factory=list, eq=False)
    """``tools`` as sent, which the Response object echoes (`wire` holds them typed)."""
    tool_choice_echo: Any = attrs.field(default=None, eq=False)
    """``tool_choice`` as sent, which the Response object echoes; where absent, the mode taken (auto with
    tools, else none)."""

    @property
    def conversation(self) -> ConversationRequest:
        assert self.generation.conversation is not None
        return self.generation.conversation

    @property
    def num_top_logprobs(self) -> int | None:
        return self.generation.options.num_top_logprobs


def decode_responses(obj: dict[str, Any], info: ModelInfo) -> ResponsesPlan:
    w = structure(screen_fields(obj, RESPONSES_FIELDS), ResponsesWire)
    if w.max_output_tokens is not None and w.max_output_tokens < 1:
        raise BadRequest("max_output_tokens must be at least 1", param="max_output_tokens")
    budget, budget_param = thinking_budget(w.thinking_token_budget, info.thinking_token_budget)
    fmt = decode_format(w.text.format, "text.format") if w.text is not None else None
    wants_logprobs = LOGPROBS_INCLUDE in (w.include or [])
    if w.top_logprobs and not wants_logprobs:
        raise BadRequest(f"top_logprobs requires include: [\"{LOGPROBS_INCLUDE}\"]", param="top_logprobs")
    num_top, explicit = validate_logprob_options(logprobs=wants_logprobs, top_logprobs=w.top_logprobs,
                                                 logprob_token_ids=w.logprob_token_ids, info=info)
    output = output_options(w, info.vocab_size)
    toolset, choice = toolset_of(w.tools, w.tool_choice)
    reasoning = w.reasoning or ReasoningWire()
    conv = ConversationRequest(
        messages=decode_input(w.input, w.instructions), tools=toolset.tools, tool_choice=choice,
        parallel_tool_calls=w.parallel_tool_calls is not False, sampling=decode_sampling(w),
        chat_template_kwargs={**_effort_kwargs(reasoning.effort, info), **(w.chat_template_kwargs or {})})
    options = GenerationOptions(
        max_tokens=w.max_output_tokens, num_top_logprobs=num_top, logprob_token_ids=explicit,
        thinking_token_budget=budget, thinking_token_budget_param=budget_param,
        constraint=one_constraint(fmt, decode_structured_outputs(w.structured_outputs)), **output)
    generation = GenerationRequest(sampling=conv.sampling, options=options, conversation=conv,
                                   input_param="input", output_param="max_output_tokens", id_prefix="resp")
    summary = reasoning.summary if reasoning.summary is not None else reasoning.generate_summary
    echo = {name: obj[name] for name in ECHOED_FIELDS if obj.get(name) is not None}
    return ResponsesPlan(w, generation, toolset, bool(w.stream), reasoning.effort, summary,
                         _text_config(w.text, fmt), echo, tools_as_sent=list(obj.get("tools") or []),
                         tool_choice_echo=obj.get("tool_choice") or choice.mode)


def _text_config(text: TextWire | None, fmt: OutputConstraint | None) -> dict[str, Any]:
    """``text`` as the Response object echoes it: the format as given where it constrains, else text."""
    verbosity = {} if text is None or text.verbosity is None else {"verbosity": text.verbosity}
    return {"format": {"type": "text"} if text is None or fmt is None else dict(text.format), **verbosity}


def _effort_kwargs(effort: str | None, info: ModelInfo) -> dict[str, Any]:
    """The chat-template kwargs a reasoning effort selects."""
    if effort is None:
        return {}
    if effort == "none":
        return {"enable_thinking": False}
    from helios.recipes import EffortError, UnknownRecipeError, get_recipe, resolve_effort

    try:
        level = resolve_effort(get_recipe(info.recipe), effort)
    except UnknownRecipeError:
        return {}
    except EffortError as exc:
        raise BadRequest(str(exc), param="reasoning.effort") from None
    return {"reasoning_effort": level} if level else {}
