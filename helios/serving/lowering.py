"""One lowering for every chat protocol: ConversationRequest → template messages → prompt text.

Spec: api.md, "Conversation and tool semantics". The rules, in the order they are applied:

1. Messages become the dicts Hugging Face templates expect. Text parts join with blank lines;
   a message with images gets a content list (`{"type": "image"}` / `{"type": "text", ...}`)
   instead of a string. Assistant reasoning parts become `reasoning_content`, tool-call parts
   become OpenAI-style `tool_calls` (arguments as objects, or as JSON text for templates that
   only concatenate strings, see `ChatTemplate.accepts_dict_tool_arguments`). Each tool-result
   part becomes its own `{"role": "tool", "tool_call_id", "content"}` message, in place; other
   parts of the same message follow it as a user message. Empty system and developer messages
   produce nothing.
2. Instructions. With a non-empty developer message, every system and developer message is
   removed from its position and all of them become ONE leading system message: one section per
   message, in request order, each labelled with its role (`System:` / `Developer:` on its own
   line, then the text; sections separated by a blank line). Without developer messages, system
   messages stay where they are and the template's own system rules apply.
3. `tool_choice: "required"` adds `REQUIRED_TOOL_INSTRUCTION` (or its single-call variant when
   parallel calls are off) to the leading system message as its last paragraph (a `System:`
   section when sections are labelled), creating a leading system message when there is none.
4. Inline system messages: when the template does not render a non-initial system message
   (`ChatTemplate.supports_inline_system`, probed once), each system message after the first
   message becomes a user message at the same position whose text is `<system>TEXT</system>`.
   The leading system message and everything before it are unchanged.
5. Parallel tool results that follow an assistant message with tool calls, up to the next
   assistant message, are put in call order when their ids are present, unique and all among
   that assistant's call ids. Only the tool messages move (each with its whole content); other
   messages between them keep their positions. Anything else leaves the group as supplied.
6. Tools are presented as an OpenAI-style function list. `tool_choice: "none"` presents no tools
   (unless `present_tools_when_none`; vLLM presents them by default, which can make a model
   write calls that the request forbids); a named choice presents only the selected tool.
   Responses custom tools without a schema are presented as a function taking `{"input": string}`.
7. `add_generation_prompt`, `continue_final_message` and the template kwargs (the server's
   `extra_kwargs`, overridden by the request's `chat_template_kwargs`) pass through to the
   template.
8. Text tools (`text_tools=True`, for a template that cannot present tools, such as SmolLM2's):
   Helios presents the tools itself. `tool_prompt(tools)` (the tool list as one JSON object per
   line inside `<tools>`, and how to call one: a `<tool_call>` block holding
   `{"name": ..., "arguments": {...}}`) becomes the last paragraph of the leading system message,
   before rule 3's instruction; the template receives no `tools`. History follows the same
   convention, after rule 5: an assistant's tool calls become `<tool_call>` blocks after its text,
   and each run of tool results becomes one user message of `<tool_response>` blocks in order. The
   Hermes JSON parser reads the model's calls back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from helios.domain.conversation import (
    ConversationRequest,
    ImagePart,
    Message,
    ReasoningPart,
    TextPart,
    Tool,
    ToolCallPart,
    ToolResultPart,
)
from helios.loaders.chat_template import ChatTemplate

REQUIRED_TOOL_INSTRUCTION = (
    "You must respond by calling at least one of the provided tools. Do not answer without a tool call."
)
REQUIRED_SINGLE_TOOL_INSTRUCTION = (
    "You must respond by calling exactly one of the provided tools. Do not answer without a tool call."
)

SYSTEM_LABEL = "System"
DEVELOPER_LABEL = "Developer"

# Template variables the lowering itself sets; chat_template_kwargs cannot replace them.
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "bos_token",
        "eos_token",
    }
)

_CUSTOM_TOOL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"input": {"type": "string"}},
    "required": ["input"],
}


class LoweringError(ValueError):
    """The conversation cannot be lowered as given (the client's fault: HTTP 400)."""

    http_status = 400


@attrs.frozen
class LoweredPrompt:
    text: str
    """The rendered prompt."""
    messages: list[dict[str, Any]]
    """The template-ready messages that produced `text`."""
    tools: list[dict[str, Any]] | None = None
    """The OpenAI-style function list presented to the template (None: no tools presented)."""
    images: tuple[ImagePart, ...] = ()
    """Every image in prompt order, matching the `{"type": "image"}` blocks in `messages`."""


def lower_conversation(
    req: ConversationRequest,
    template: ChatTemplate,
    *,
    bos_token: str = "",
    eos_token: str = "",
    extra_kwargs: Mapping[str, Any] | None = None,
    present_tools_when_none: bool = False,
    text_tools: bool = False,
) -> LoweredPrompt:
    """Lower `req` into template messages and render them (raises LoweringError / ChatTemplateError)."""
    tools = presented_tools(req, present_tools_when_none=present_tools_when_none)
    kwargs = _template_kwargs(extra_kwargs, req.chat_template_kwargs)
    messages, images = _lower(req, template, text_tools=tools if text_tools else None)
    if text_tools:
        messages = tools_as_text(messages)
    text = template.render(
        messages,
        tools=None if text_tools else tools,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        bos_token=bos_token,
        eos_token=eos_token,
        **kwargs,
    )
    return LoweredPrompt(text=text, messages=messages, tools=tools, images=images)


def lower_messages(req: ConversationRequest, template: ChatTemplate) -> list[dict[str, Any]]:
    """Rules 1-5 of the module docstring: the messages the template receives."""
    return _lower(req, template)[0]


def _lower(
    req: ConversationRequest, template: ChatTemplate, *, text_tools: list[dict[str, Any]] | None = None
) -> tuple[list[dict[str, Any]], tuple[ImagePart, ...]]:
    string_arguments = _has_tool_calls(req.messages) and not template.accepts_dict_tool_arguments()
    lowered: list[dict[str, Any]] = []
    # id(lowered dict) -> (that dict, its images in block order); the dict is kept for an identity check
    images_of: dict[int, tuple[dict[str, Any], list[ImagePart]]] = {}
    for message in req.messages:
        for out, images in _lower_message(message, string_arguments=string_arguments):
            lowered.append(out)
            images_of[id(out)] = (out, images)

    # The steps below move these dicts, or drop and add system dicts, which carry no images.
    labelled = any(m["role"] == "developer" for m in lowered)
    if labelled:
        lowered = _merge_instructions(lowered)
    if text_tools:
        lowered = _add_instruction(lowered, tool_prompt(text_tools), labelled=labelled)
    if req.tool_choice.mode == "required":
        instruction = (
            REQUIRED_TOOL_INSTRUCTION if req.parallel_tool_calls else REQUIRED_SINGLE_TOOL_INSTRUCTION
        )
        lowered = _add_instruction(lowered, instruction, labelled=labelled)
    if any(m["role"] == "system" for m in lowered[1:]) and not template.supports_inline_system():
        lowered = lowered[:1] + [_system_as_user(m) for m in lowered[1:]]
    lowered = reorder_tool_results(lowered)
    in_order = tuple(
        image for m in lowered if (entry := images_of.get(id(m))) and entry[0] is m for image in entry[1]
    )
    return lowered, in_order


def presented_tools(
    req: ConversationRequest, *, present_tools_when_none: bool = False
) -> list[dict[str, Any]] | None:
    """Rule 6: the function list the template receives, or None when no tools are presented."""
    choice = req.tool_choice
    if choice.mode == "required" and not req.tools:
        raise LoweringError('tool_choice "required" needs at least one declared tool')
    if choice.mode == "none" and not present_tools_when_none:
        return None
    selected: Sequence[Tool] = req.tools
    if choice.mode == "named":
        selected = [t for t in req.tools if t.name == choice.name]
        if not selected:
            raise LoweringError(f"tool_choice names {choice.name!r}, which is not a declared tool")
    return [_tool_dict(t) for t in selected] or None


TOOL_PROMPT_HEAD = (
    "# Tools\n\n"
    "You can call the functions listed below to help with the request. Each line inside "
    "<tools></tools> describes one function as JSON: its name, what it does, and the JSON schema "
    "of its arguments.\n<tools>"
)
TOOL_PROMPT_TAIL = (
    "</tools>\n\n"
    "To call a function, write a <tool_call></tool_call> block holding one JSON object with the "
    "function's name and its arguments, then stop and wait for the result:\n"
    '<tool_call>\n{"name": "function_name", "arguments": {"argument_name": "value"}}\n</tool_call>\n'
    "Write one block per call to call several functions. Results come back inside "
    "<tool_response></tool_response> blocks. Answer normally when no function is needed."
)


def tool_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """Rule 8: the tool section Helios writes for a template that cannot present tools."""
    lines = [
        json.dumps(t.get("function", t), ensure_ascii=False, separators=(",", ":")) for t in tools
    ]
    return "\n".join([TOOL_PROMPT_HEAD, *lines, TOOL_PROMPT_TAIL])


def tools_as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rule 8's history: tool calls as `<tool_call>` blocks, tool results as `<tool_response>` user turns."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            blocks = "\n".join(_call_block(c) for c in m["tool_calls"])
            rest = {k: v for k, v in m.items() if k != "tool_calls"}
            rest["content"] = _append_text(m.get("content"), blocks)
            out.append(rest)
        elif m["role"] == "tool":
            block = _wrap_text(m.get("content"), "<tool_response>\n", "\n</tool_response>")
            previous = out[-1] if out else None
            if previous is not None and previous.get("_tool_results"):
                previous["content"] = _append_text(previous["content"], block)
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append(m)
    for m in out:
        m.pop("_tool_results", None)
    return out


def _call_block(call: Mapping[str, Any]) -> str:
    function = call["function"]
    arguments = function["arguments"]
    if isinstance(arguments, str):  # a template that takes JSON text was probed
        arguments = json.loads(arguments)
    body = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _append_text(content: Any, more: Any) -> Any:
    """`content` followed by `more` on its own line; each is a string or a list of content blocks."""
    if isinstance(content, list) or isinstance(more, list):
        return [*_blocks(content), *_blocks("\n"), *_blocks(more)] if content else _blocks(more)
    return f"{content}\n{more}" if content else more


def _blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, list):
        return list(content)
    return [{"type": "text", "text": content}] if content else []


def _wrap_text(content: Any, head: str, tail: str) -> Any:
    if isinstance(content, list):
        return [{"type": "text", "text": head}, *content, {"type": "text", "text": tail}]
    return f"{head}{content or ''}{tail}"


def reorder_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rule 5: put each assistant's parallel tool results in call order where that is unambiguous."""
    out = list(messages)
    for at, message in enumerate(messages):
        calls = message.get("tool_calls") if message["role"] == "assistant" else None
        if not calls:
            continue
        call_ids = [c.get("id") for c in calls]
        if len(set(call_ids)) != len(call_ids):
            continue
        rank = {cid: k for k, cid in enumerate(call_ids) if cid}
        end = next(
            (j for j in range(at + 1, len(messages)) if messages[j]["role"] == "assistant"), len(messages)
        )
        slots = [j for j in range(at + 1, end) if messages[j]["role"] == "tool"]
        ids = [messages[j].get("tool_call_id") for j in slots]
        if len(slots) < 2 or len(set(ids)) != len(ids) or not all(i in rank for i in ids):
            continue
        ordered = sorted(slots, key=lambda j: rank[messages[j]["tool_call_id"]])
        for slot, source in zip(slots, ordered, strict=True):
            out[slot] = messages[source]
    return out


# -- helpers --------------------------------------------------------------------------------------


def _lower_message(
    message: Message, *, string_arguments: bool
) -> list[tuple[dict[str, Any], list[ImagePart]]]:
    """One domain message → template dicts, each with the images of its content blocks."""
    role = message.role
    if role in ("system", "developer"):
        text = message.text  # images in instructions are not presented
        return [({"role": role, "content": text}, [])] if text.strip() else []
    if role == "assistant":
        visible = [p for p in message.parts if isinstance(p, TextPart | ImagePart)]
        return [(_assistant_dict(message, visible, string_arguments=string_arguments), _only_images(visible))]
    # user and tool messages: each tool result in place, the other parts as a user message
    out: list[tuple[dict[str, Any], list[ImagePart]]] = []
    pending: list[TextPart | ImagePart] = []
    for part in message.parts:
        if isinstance(part, ToolResultPart):
            if pending:
                user = _with_name({"role": "user", "content": _content(pending)}, message.name)
                out.append((user, _only_images(pending)))
                pending = []
            result = {"role": "tool", "tool_call_id": part.tool_call_id, "content": _content(part.content)}
            out.append((result, _only_images(part.content)))
        elif isinstance(part, TextPart | ImagePart):
            pending.append(part)
    if pending or not out:
        # A tool message without a result part (so without an id) stays a tool message.
        rest = _with_name({"role": role, "content": _content(pending)}, message.name)
        out.append((rest, _only_images(pending)))
    return out


def _assistant_dict(
    message: Message, visible: Sequence[TextPart | ImagePart], *, string_arguments: bool
) -> dict[str, Any]:
    out: dict[str, Any] = _with_name({"role": "assistant", "content": _content(visible)}, message.name)
    reasoning = [p.text for p in message.parts if isinstance(p, ReasoningPart)]
    if reasoning:
        out["reasoning_content"] = "\n\n".join(reasoning)
    calls = [p for p in message.parts if isinstance(p, ToolCallPart)]
    if calls:
        out["tool_calls"] = [_tool_call_dict(c, string_arguments=string_arguments) for c in calls]
    return out


def _tool_call_dict(call: ToolCallPart, *, string_arguments: bool) -> dict[str, Any]:
    arguments: Any = (
        json.dumps(call.arguments, ensure_ascii=False) if string_arguments else dict(call.arguments)
    )
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def _content(parts: Sequence[TextPart | ImagePart]) -> str | list[dict[str, Any]]:
    """A string for text only (parts joined with blank lines), else a list of content blocks."""
    if not any(isinstance(p, ImagePart) for p in parts):
        return "\n\n".join(p.text for p in parts if isinstance(p, TextPart))
    return [
        {"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text} for p in parts
    ]


def _with_name(message: dict[str, Any], name: str | None) -> dict[str, Any]:
    if name:
        message["name"] = name
    return message


def _merge_instructions(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rule 2: every system/developer message becomes a labelled section of one leading system message."""
    sections = [
        _section(SYSTEM_LABEL if m["role"] == "system" else DEVELOPER_LABEL, m["content"])
        for m in messages
        if m["role"] in ("system", "developer")
    ]
    rest = [m for m in messages if m["role"] not in ("system", "developer")]
    return [{"role": "system", "content": "\n\n".join(sections)}, *rest]


def _section(label: str, text: str) -> str:
    return f"{label}:\n{text}"


def _add_instruction(
    messages: list[dict[str, Any]], instruction: str, *, labelled: bool
) -> list[dict[str, Any]]:
    """Rule 3: append a paragraph (or a labelled section) to the leading system message."""
    paragraph = _section(SYSTEM_LABEL, instruction) if labelled else instruction
    if messages and messages[0]["role"] == "system" and isinstance(messages[0]["content"], str):
        leading = {**messages[0], "content": f"{messages[0]['content']}\n\n{paragraph}"}
        return [leading, *messages[1:]]
    return [{"role": "system", "content": paragraph}, *messages]


def _system_as_user(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] != "system":
        return message
    return {"role": "user", "content": f"<system>{message['content']}</system>"}


def _tool_dict(tool: Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.parameters:
        function["parameters"] = dict(tool.parameters)
    elif tool.kind == "custom":
        function["parameters"] = json.loads(json.dumps(_CUSTOM_TOOL_PARAMETERS))
    else:
        function["parameters"] = {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def _template_kwargs(extra: Mapping[str, Any] | None, request: Mapping[str, Any]) -> dict[str, Any]:
    kwargs = {**(extra or {}), **request}
    reserved = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(kwargs))
    if reserved:
        raise LoweringError(f"chat_template_kwargs cannot set {', '.join(reserved)}")
    return kwargs


def _has_tool_calls(messages: Sequence[Message]) -> bool:
    return any(isinstance(p, ToolCallPart) for m in messages if m.role == "assistant" for p in m.parts)


def _only_images(parts: Sequence[TextPart | ImagePart]) -> list[ImagePart]:
    return [p for p in parts if isinstance(p, ImagePart)]


# -- images in the rendered prompt ----------------------------------------------------------------


def expand_image_markers(text: str, marker: str, expansions: Sequence[str]) -> str:
    """The rendered prompt with its k-th image marker (the template's ``{"type": "image"}`` block,
    the profile's image token text) replaced by ``expansions[k]`` (the image's `ImageCost.prompt_text`).

    Raises LoweringError when the markers and the images do not pair up one to one: the template
    dropped an image block, or the conversation's text contains the literal marker."""
    pieces = text.split(marker)
    if len(pieces) - 1 != len(expansions):
        raise LoweringError(
            f"the rendered prompt has {len(pieces) - 1} image markers ({marker}) for {len(expansions)} "
            f"image{'s' if len(expansions) != 1 else ''}: the chat template did not present every image, or the "
            f"text contains the literal image marker {marker}")
    out = [pieces[0]]
    for expansion, piece in zip(expansions, pieces[1:], strict=True):
        out.append(expansion)
        out.append(piece)
    return "".join(out)


def image_spans(token_ids: Sequence[int], image_token_id: int, tokens: Sequence[int],
                marker: str = "") -> list[tuple[int, int]]:
    """(offset, length) of each image's span in the tokenized prompt: the k-th image owns the next
    ``tokens[k]`` placeholder tokens; its span runs from its first placeholder to its last (framing
    tokens between its tiles included).

    Raises LoweringError when the prompt's placeholder tokens are not exactly ``sum(tokens)`` (the
    text contains the image token, or an expansion did not tokenize to its placeholders): never a
    silent mismatch between features and positions."""
    positions = [i for i, t in enumerate(token_ids) if t == image_token_id]
    want = sum(tokens)
    if len(positions) != want:
        what = f" ({marker})" if marker else ""
        raise LoweringError(
            f"the prompt has {len(positions)} image placeholder tokens{what} where its {len(tokens)} "
            f"image{'s' if len(tokens) != 1 else ''} need {want}: the text must not contain the image token")
    spans: list[tuple[int, int]] = []
    at = 0
    for n in tokens:
        if n <= 0:
            raise LoweringError("an image costs no image tokens under this model's profile")
        first, last = positions[at], positions[at + n - 1]
        spans.append((first, last - first + 1))
        at += n
    return spans
