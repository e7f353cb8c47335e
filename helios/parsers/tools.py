"""Tool-call syntaxes, one class per markup family. Each turns a buffered envelope into calls.

Decision rules (spec, "Conversation and tool semantics"):
- Qwen function tags: `<tool_call>` or `<function=` starts a call only when followed by a
  `<function=NAME>` header and then a `<parameter=` or `</function>` tag; a call completes at
  `</function>`; outer tags may be omitted; a missing `</parameter>` is closed by the next parameter
  or function boundary; one wrapping newline is trimmed from each end of a value (MiMo: verbatim).
- GLM: `<tool_call>` starts a call only when followed by a function name and `<arg_key>` or
  `</tool_call>`.
- Hermes JSON (and Nemotron's `<TOOLCALL>`): `<tool_call>` starts a call only when followed by a JSON
  object or list (Helios's analogue of the rule above; prose mentions stay text).
- Gemma 4's `<|tool_call>`, MiniMax's `<minimax:tool_call>`, DSML, Kimi and DeepSeek V3.1 section
  openers, XTML and harmony headers always start a call.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
from typing import Any

from helios.parsers.arguments import (
    ToolSchemas,
    add_argument,
    convert_typed,
    convert_value,
    loads_arguments,
    loads_json,
    parameter_schema,
)
from helios.parsers.base import (
    LEAVE_BLOCK,
    NOT_CALL,
    UNDECIDED,
    Parsed,
    ParsedCall,
    Region,
    Step,
    ToolSyntax,
    Waiting,
    prefix_state,
    skip_ws,
)
from helios.parsers.errors import ToolParseError

MAX_NAME_CHARS = 256
"""A header whose tool name runs past this many characters without closing is prose, not a call."""


class FunctionTagSyntax(ToolSyntax):
    """Qwen3-Coder / Qwen3.5 / Nemotron 3 / Step / MiMo function tags.

    `<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call>`
    """

    openers = ("<tool_call>", "<function=")
    trailing = ("</tool_call>",)

    def __init__(self, tools: ToolSchemas, *, trim_newlines: bool = True) -> None:
        self._tools = tools
        self._trim = trim_newlines

    def parse(self, text: str, final: bool) -> Step:
        pos = 0
        if text.startswith("<tool_call>"):
            pos = skip_ws(text, len("<tool_call>"))
            state = prefix_state(text, pos, ("<function=",))
            if state != "match":
                return UNDECIDED if state == "partial" else NOT_CALL
        head = pos + len("<function=")
        close = text.find(">", head, head + MAX_NAME_CHARS + 1)
        if close < 0:
            window = text[head : head + MAX_NAME_CHARS + 1]
            if len(window) > MAX_NAME_CHARS or "<" in window or "\n" in window:
                return NOT_CALL
            return UNDECIDED
        name = text[head:close]
        if "<" in name or "\n" in name:
            return NOT_CALL
        body = skip_ws(text, close + 1)
        state = prefix_state(text, body, ("<parameter=", "</function>"))
        if state != "match":
            return UNDECIDED if state == "partial" else NOT_CALL
        end = text.find("</function>", body)
        if end < 0:
            return Waiting("</function>", body)
        name = name.strip()
        arguments: dict[str, Any] = {}
        for key, raw in _named_values(text, body, end, "<parameter=", "</parameter>"):
            if self._trim:
                raw = _trim_wrapping_newline(raw)
            add_argument(
                arguments, key.strip(), convert_value(raw, parameter_schema(self._tools, name, key.strip()))
            )
        return Parsed(end + len("</function>"), (ParsedCall(name, arguments),))


class JsonEnvelopeSyntax(ToolSyntax):
    """Hermes `<tool_call>{"name": …, "arguments": {…}}</tool_call>`; also a JSON list of calls
    (SmolLM2) and Nemotron Nano 2's `<TOOLCALL>[…]</TOOLCALL>`.

    The body ends at the first closing tag. At the natural end of output a body that is complete
    JSON is accepted without its closing tag.
    """

    def __init__(self, *, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>") -> None:
        self._open = open_tag
        self._close = close_tag
        self.openers = (open_tag,)

    def parse(self, text: str, final: bool) -> Step:
        pos = skip_ws(text, len(self._open))
        if pos == len(text):
            return UNDECIDED
        if text[pos] not in "{[":
            return NOT_CALL
        end = text.find(self._close, pos)
        if end < 0:
            if final:
                try:
                    calls = _json_calls(text[pos:])
                except ToolParseError:
                    return Waiting(self._close, pos)
                return Parsed(len(text), calls)
            return Waiting(self._close, pos)
        return Parsed(end + len(self._close), _json_calls(text[pos:end]))


class Qwen25Syntax(JsonEnvelopeSyntax):
    """Qwen2.5 / Qwen2.5-Coder: Hermes `<tool_call>` JSON, and the bare forms the small Coder models
    write instead although their template asks for the tags (as llama.cpp's Hermes parser accepts).

    - A fenced object: "```json\\n{"name": …, "arguments": {…}}\\n```" (the language tag is optional;
      a fenced list of such objects is several calls; at the natural end of output the closing
      fence may be missing).
    - A bare object: `{"name": …, "arguments": {…}}`, complete when its braces balance.

    The bare forms count only before any answer text (`leading`), only when the JSON's first key is
    `"name"`, and only when it is a call object through and through: keys `name` and `arguments` (or
    `parameters`), nothing else, and a declared tool's name. Anything else stays text, so a code
    block or a JSON answer is never taken for a call.
    """

    leading = ("```", "{")

    def __init__(self, tools: ToolSchemas) -> None:
        super().__init__()
        self._tools = tools

    def parse(self, text: str, final: bool) -> Step:
        if text.startswith("```"):
            return self._fenced(text, final)
        if text.startswith("{"):
            return self._bare(text, final)
        return super().parse(text, final)

    def _fenced(self, text: str, final: bool) -> Step:
        pos = 3
        state = prefix_state(text, pos, ("json",))
        if state == "partial" and len(text) > pos:
            return NOT_CALL if final else UNDECIDED
        if state == "match":
            pos += len("json")
        pos = skip_ws(text, pos)
        if pos == len(text):
            return NOT_CALL if final else UNDECIDED
        head = self._head(text, pos + 1 if text[pos] == "[" else pos, final)
        if head is not None:
            return head
        end = text.find("```", pos)
        if end < 0 and not final:
            return Waiting("```", pos)
        calls = _declared_calls(text[pos:end] if end >= 0 else text[pos:], self._tools)
        if end < 0:  # the output ended inside the fence: a complete call object is still a call
            return NOT_CALL if calls is None else Parsed(len(text), calls)
        return NOT_CALL if calls is None else Parsed(end + 3, calls)

    def _bare(self, text: str, final: bool) -> Step:
        head = self._head(text, 0, final)
        if head is not None:
            return head
        end = _object_end(text)
        if end < 0:
            return NOT_CALL if final else Waiting("}", len(text))
        calls = _declared_calls(text[:end], self._tools)
        return NOT_CALL if calls is None else Parsed(end, calls)

    @staticmethod
    def _head(text: str, pos: int, final: bool) -> Step | None:
        """None when text[pos:] opens an object whose first key is "name"; else the Step to return."""
        pos = skip_ws(text, pos)
        if pos == len(text):
            return NOT_CALL if final else UNDECIDED
        if text[pos] != "{":
            return NOT_CALL
        state = prefix_state(text, skip_ws(text, pos + 1), ('"name"',))
        if state == "partial":
            return NOT_CALL if final else UNDECIDED
        return None if state == "match" else NOT_CALL


def _object_end(text: str) -> int:
    """Index just past the JSON object starting at text[0] (strings and escapes respected), or -1."""
    depth = 0
    in_string = False
    escaped = False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return -1


def _declared_calls(body: str, tools: ToolSchemas) -> tuple[ParsedCall, ...] | None:
    """The calls a bare JSON body spells, or None when it is not strictly call objects naming
    declared tools."""
    try:
        value = loads_json(body.strip())
    except ToolParseError:
        return None
    items = value if isinstance(value, list) and value else [value]
    for item in items:
        if not isinstance(item, dict) or not set(item) <= {"name", "arguments", "parameters"}:
            return None
        if item.get("name") not in tools:
            return None
    try:
        return _json_calls(body)
    except ToolParseError:
        return None


class GlmSyntax(ToolSyntax):
    """GLM 4.5-5.x: `<tool_call>NAME<arg_key>k</arg_key><arg_value>v</arg_value>…</tool_call>`."""

    openers = ("<tool_call>",)

    def __init__(self, tools: ToolSchemas) -> None:
        self._tools = tools

    def parse(self, text: str, final: bool) -> Step:
        head = len("<tool_call>")
        tag = text.find("<", head, head + MAX_NAME_CHARS + 1)
        if tag < 0:
            window = text[head : head + MAX_NAME_CHARS + 1]
            if len(window) > MAX_NAME_CHARS or _has_inner_space(window.strip()):
                return NOT_CALL
            return UNDECIDED
        name = text[head:tag].strip()
        if not name or _has_inner_space(name):
            return NOT_CALL
        state = prefix_state(text, tag, ("<arg_key>", "</tool_call>"))
        if state != "match":
            return UNDECIDED if state == "partial" else NOT_CALL
        end = text.find("</tool_call>", tag)
        if end < 0:
            return Waiting("</tool_call>", tag)
        arguments: dict[str, Any] = {}
        pos = tag
        while True:
            pos = skip_ws(text, pos, end)
            if pos >= end:
                break
            if not text.startswith("<arg_key>", pos):
                pos = text.find("<arg_key>", pos, end)
                if pos < 0:
                    break
            key_start = pos + len("<arg_key>")
            key_end = _earliest(text, key_start, end, ("</arg_key>", "<arg_value>"))
            key = text[key_start:key_end].strip()
            pos = _after(text, key_end, "</arg_key>")
            pos = skip_ws(text, pos, end)
            if not text.startswith("<arg_value>", pos):
                raise ToolParseError(f"GLM tool call argument {key!r} has no <arg_value>")
            value_start = pos + len("<arg_value>")
            value_end = _earliest(text, value_start, end, ("</arg_value>", "<arg_key>"))
            raw = text[value_start:value_end]
            pos = _after(text, value_end, "</arg_value>")
            add_argument(arguments, key, convert_value(raw, parameter_schema(self._tools, name, key)))
        return Parsed(end + len("</tool_call>"), (ParsedCall(name, arguments),))


class Gemma4Syntax(ToolSyntax):
    """Gemma 4: `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:5}<tool_call|>`."""

    openers = ("<|tool_call>",)
    trailing = ("<|tool_response>",)  # end-of-generation marker, if the pipeline passes it on

    def parse(self, text: str, final: bool) -> Step:
        start = len("<|tool_call>")
        end = text.find("<tool_call|>", start)
        if end < 0:
            return Waiting("<tool_call|>", start)
        body = text[start:end].strip()
        if not body.startswith("call:"):
            raise ToolParseError("Gemma tool call without 'call:'")
        brace = body.find("{")
        if brace < 0:
            raise ToolParseError("Gemma tool call without arguments")
        name = body[len("call:") : brace].strip()
        reader = _GemmaReader(body)
        arguments, pos = reader.object(brace, 0)
        if skip_ws(body, pos) != len(body):
            raise ToolParseError("unexpected text after Gemma tool call arguments")
        return Parsed(end + len("<tool_call|>"), (ParsedCall(name, arguments),))


class MiniMaxSyntax(ToolSyntax):
    """MiniMax M2/M3: `<minimax:tool_call><invoke name="f"><parameter name="k">v</parameter>
    </invoke>…</minimax:tool_call>`. Values are verbatim text, converted by schema."""

    openers = ("<minimax:tool_call>",)
    _close = "</minimax:tool_call>"

    def __init__(self, tools: ToolSchemas) -> None:
        self._tools = tools

    def parse(self, text: str, final: bool) -> Step:
        return Parsed(len(self.openers[0]), (), Region.BLOCK)

    def parse_block(self, text: str, final: bool) -> Step:
        if text.startswith(self._close):
            return Parsed(len(self._close), (), Region.CONTENT)
        if not text.startswith("<invoke"):
            state = prefix_state(text, 0, ("<invoke", self._close))
            return UNDECIDED if state == "partial" else LEAVE_BLOCK
        end = text.find("</invoke>")
        if end < 0:
            return Waiting("</invoke>", 0)
        header_end = text.find(">", 0, end)
        name = _attr(text[len("<invoke") : header_end], "name") if header_end >= 0 else None
        if name is None:
            raise ToolParseError("MiniMax <invoke> without a name")
        arguments: dict[str, Any] = {}
        for header, raw in _named_values(text, header_end + 1, end, "<parameter", "</parameter>"):
            key = _attr(header, "name")
            if key is None:
                raise ToolParseError("MiniMax <parameter> without a name")
            add_argument(arguments, key, convert_value(raw, parameter_schema(self._tools, name, key)))
        return Parsed(end + len("</invoke>"), (ParsedCall(name, arguments),), Region.BLOCK)


class DsmlSyntax(ToolSyntax):
    """DeepSeek V3.2 (`function_calls`) and V4 (`tool_calls`) DSML blocks.

    `<｜DSML｜tool_calls><｜DSML｜invoke name="f"><｜DSML｜parameter name="k" string="true">v
    </｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>`. string="true" values are verbatim,
    string="false" values are JSON. Each call is published when its invoke closes; closing the outer
    block ends parsed output (later text is discarded).
    """

    _invoke = "<｜DSML｜invoke"
    _invoke_close = "</｜DSML｜invoke>"
    _param = "<｜DSML｜parameter"
    _param_close = "</｜DSML｜parameter>"

    def __init__(self, tools: ToolSchemas, *, block: str) -> None:
        self._tools = tools
        self._open = f"<｜DSML｜{block}>"
        self._close = f"</｜DSML｜{block}>"
        self.openers = (self._open,)

    def parse(self, text: str, final: bool) -> Step:
        return Parsed(len(self._open), (), Region.BLOCK)

    def parse_block(self, text: str, final: bool) -> Step:
        if text.startswith(self._close):
            return Parsed(len(self._close), (), Region.DONE)
        if not text.startswith(self._invoke):
            state = prefix_state(text, 0, (self._invoke, self._close))
            return UNDECIDED if state == "partial" else LEAVE_BLOCK
        end = text.find(self._invoke_close)
        if end < 0:
            return Waiting(self._invoke_close, 0)
        header_end = text.find(">", 0, end)
        name = _attr(text[len(self._invoke) : header_end], "name") if header_end >= 0 else None
        if name is None:
            raise ToolParseError("DSML invoke without a name")
        arguments: dict[str, Any] = {}
        for header, raw in _named_values(text, header_end + 1, end, self._param, self._param_close):
            key = _attr(header, "name")
            if key is None:
                raise ToolParseError("DSML parameter without a name")
            is_string = _attr(header, "string")
            if is_string == "true":
                value: Any = raw
            elif is_string == "false":
                value = loads_json(raw.strip())
            else:
                value = convert_value(raw, parameter_schema(self._tools, name, key))
            add_argument(arguments, key, value)
        return Parsed(end + len(self._invoke_close), (ParsedCall(name, arguments),), Region.BLOCK)


class SectionSyntax(ToolSyntax):
    """Token-delimited JSON calls inside a section: DeepSeek V3.1 and Kimi K2.

    `SECTION_OPEN CALL_OPEN head SEP {json} CALL_CLOSE … SECTION_CLOSE`; for Kimi the head is the
    call id `functions.NAME:IDX`, kept as the ToolCall id.
    """

    def __init__(
        self,
        *,
        section_open: str,
        section_close: str,
        call_open: str,
        separator: str,
        call_close: str,
        head_is_id: bool,
    ) -> None:
        self._section_open = section_open
        self._section_close = section_close
        self._call_open = call_open
        self._separator = separator
        self._call_close = call_close
        self._head_is_id = head_is_id
        self.openers = (section_open, call_open)

    def parse(self, text: str, final: bool) -> Step:
        if text.startswith(self._section_open):
            return Parsed(len(self._section_open), (), Region.BLOCK)
        return self._call(text)

    def parse_block(self, text: str, final: bool) -> Step:
        if text.startswith(self._section_close):
            return Parsed(len(self._section_close), (), Region.CONTENT)
        if text.startswith(self._call_open):
            return self._call(text)
        state = prefix_state(text, 0, (self._call_open, self._section_close))
        return UNDECIDED if state == "partial" else LEAVE_BLOCK

    def _call(self, text: str) -> Step:
        start = len(self._call_open)
        end = text.find(self._call_close, start)
        if end < 0:
            return Waiting(self._call_close, start)
        separator = text.find(self._separator, start, end)
        if separator < 0:
            raise ToolParseError("tool call without an argument separator")
        head = text[start:separator].strip()
        arguments = loads_arguments(text[separator + len(self._separator) : end])
        call_id: str | None = None
        name = head
        if self._head_is_id:
            call_id = head or None
            if name.startswith("functions."):
                name = name[len("functions.") :]
            colon = name.rfind(":")
            if colon > 0 and name[colon + 1 :].isdigit():
                name = name[:colon]
        return Parsed(end + len(self._call_close), (ParsedCall(name, arguments, call_id),), Region.BLOCK)


class XtmlSyntax(ToolSyntax):
    """Kimi K3 XTML: `<|open|>tools<|sep|><|open|>call tool="f" index="1"<|sep|>
    <|open|>argument key="k" type="string"<|sep|>v<|close|>argument<|sep|>…<|close|>call<|sep|>
    <|close|>tools<|sep|>`; a call may carry `<|open|>json type="object"<|sep|>{…}<|close|>json<|sep|>`.
    """

    _tools_open = "<|open|>tools<|sep|>"
    _tools_close = "<|close|>tools<|sep|>"
    _call_open = "<|open|>call"
    _call_close = "<|close|>call<|sep|>"
    openers = (_tools_open, _call_open)

    def __init__(self, tools: ToolSchemas) -> None:
        self._tools = tools

    def parse(self, text: str, final: bool) -> Step:
        if text.startswith(self._tools_open):
            return Parsed(len(self._tools_open), (), Region.BLOCK)
        return self._call(text, Region.CONTENT)

    def parse_block(self, text: str, final: bool) -> Step:
        if text.startswith(self._tools_close):
            return Parsed(len(self._tools_close), (), Region.CONTENT)
        if text.startswith(self._call_open):
            return self._call(text, Region.BLOCK)
        state = prefix_state(text, 0, (self._call_open, self._tools_close))
        return UNDECIDED if state == "partial" else LEAVE_BLOCK

    def _call(self, text: str, region: Region) -> Step:
        start = len(self._call_open)
        end = text.find(self._call_close, start)
        if end < 0:
            return Waiting(self._call_close, start)
        sep = text.find("<|sep|>", start, end)
        if sep < 0:
            raise ToolParseError("XTML call tag without <|sep|>")
        name = _attr(text[start:sep], "tool")
        if name is None:
            raise ToolParseError("XTML call without a tool name")
        arguments: dict[str, Any] = {}
        pos = sep + len("<|sep|>")
        while True:
            pos = skip_ws(text, pos, end)
            if pos >= end:
                break
            if text.startswith("<|open|>argument", pos):
                head_end = text.find("<|sep|>", pos, end)
                if head_end < 0:
                    raise ToolParseError("malformed XTML argument tag")
                header = text[pos + len("<|open|>argument") : head_end]
                value_start = head_end + len("<|sep|>")
                value_end = _earliest(
                    text, value_start, end, ("<|close|>argument<|sep|>", "<|open|>argument")
                )
                raw = text[value_start:value_end]
                pos = _after(text, value_end, "<|close|>argument<|sep|>")
                key = _attr(header, "key")
                if key is None:
                    raise ToolParseError("XTML argument without a key")
                kind = _attr(header, "type")
                if kind is None:
                    value = convert_value(raw, parameter_schema(self._tools, name, key))
                else:
                    value = convert_typed(raw, kind)
                add_argument(arguments, key, value)
            elif text.startswith("<|open|>json", pos):
                head_end = text.find("<|sep|>", pos, end)
                if head_end < 0:
                    raise ToolParseError("malformed XTML json tag")
                value_start = head_end + len("<|sep|>")
                value_end = _earliest(text, value_start, end, ("<|close|>json<|sep|>",))
                for key, value in loads_arguments(text[value_start:value_end]).items():
                    add_argument(arguments, key, value)
                pos = _after(text, value_end, "<|close|>json<|sep|>")
            else:
                nxt = text.find("<|open|>", pos + 1, end)
                if nxt < 0:
                    break
                pos = nxt
        return Parsed(end + len(self._call_close), (ParsedCall(name, arguments),), region)


class HarmonySyntax(ToolSyntax):
    """gpt-oss harmony message headers: `[<|start|>ROLE][ to=R]<|channel|>CHANNEL[ to=R]
    [<|constrain|>T]<|message|>`. A header addressed `to=functions.NAME` starts a call whose JSON body
    ends at `<|call|>`; an `analysis` header opens reasoning; any other header opens answer text.
    """

    openers = ("<|start|>", "<|channel|>")
    _recipient = re.compile(r"to=([^\s<]+)")

    def parse(self, text: str, final: bool) -> Step:
        header_end = text.find("<|message|>")
        if header_end < 0:
            return UNDECIDED
        header = text[:header_end]
        body = header_end + len("<|message|>")
        match = self._recipient.search(header)
        if match is None:
            channel_at = header.find("<|channel|>")
            channel = (
                header[channel_at + len("<|channel|>") :].split("<|", 1)[0].strip() if channel_at >= 0 else ""
            )
            region = Region.REASONING if channel.split(" ", 1)[0] == "analysis" else Region.CONTENT
            return Parsed(body, (), region)
        recipient = match.group(1)
        end = text.find("<|call|>", body)
        if end < 0:
            if final:
                stop = text.find("<|end|>", body)
                try:
                    arguments = loads_arguments(text[body : stop if stop >= 0 else len(text)])
                except ToolParseError:
                    return Waiting("<|call|>", body)
                name = recipient.removeprefix("functions.")
                return Parsed(len(text), (ParsedCall(name, arguments),))
            return Waiting("<|call|>", body)
        name = recipient.removeprefix("functions.")
        return Parsed(end + len("<|call|>"), (ParsedCall(name, loads_arguments(text[body:end])),))


# --- private helpers -------------------------------------------------------------------------------

_ATTR_CACHE: dict[str, re.Pattern[str]] = {}


def _attr(header: str, name: str) -> str | None:
    """An attribute value from a tag header: name="v", name='v' or name=v; XML entities decoded."""
    pattern = _ATTR_CACHE.get(name)
    if pattern is None:
        pattern = re.compile(
            r"(?:^|\s)" + re.escape(name) + r"""\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'>]+))"""
        )
        _ATTR_CACHE[name] = pattern
    match = pattern.search(header)
    if match is None:
        return None
    value = next(group for group in match.groups() if group is not None)
    return html.unescape(value) if "&" in value else value


def _named_values(text: str, pos: int, end: int, open_tag: str, close_tag: str) -> Iterator[tuple[str, str]]:
    """(header, value) pairs of `OPEN_TAG header>value CLOSE_TAG` in [pos, end). A missing close tag
    is closed by the next open tag or by `end`; stray text between tags is ignored."""
    while True:
        pos = skip_ws(text, pos, end)
        if pos >= end:
            return
        if not text.startswith(open_tag, pos):
            pos = text.find(open_tag, pos, end)
            if pos < 0:
                return
        head_end = text.find(">", pos + len(open_tag), end)
        if head_end < 0:
            raise ToolParseError(f"malformed {open_tag} tag")
        header = text[pos + len(open_tag) : head_end]
        value_start = head_end + 1
        value_end = _earliest(text, value_start, end, (close_tag, open_tag))
        yield header, text[value_start:value_end]
        pos = _after(text, value_end, close_tag)


def _earliest(text: str, start: int, end: int, literals: tuple[str, ...]) -> int:
    best = end
    for literal in literals:
        found = text.find(literal, start, best)
        if found >= 0:
            best = found
    return best


def _after(text: str, pos: int, literal: str) -> int:
    return pos + len(literal) if text.startswith(literal, pos) else pos


def _trim_wrapping_newline(raw: str) -> str:
    if raw.startswith("\r\n"):
        raw = raw[2:]
    elif raw.startswith("\n"):
        raw = raw[1:]
    if raw.endswith("\r\n"):
        raw = raw[:-2]
    elif raw.endswith("\n"):
        raw = raw[:-1]
    return raw


def _has_inner_space(text: str) -> bool:
    return any(ch.isspace() for ch in text)


def _json_calls(body: str) -> tuple[ParsedCall, ...]:
    value = loads_json(body.strip())
    items = value if isinstance(value, list) else [value]
    calls: list[ParsedCall] = []
    for item in items:
        if not isinstance(item, dict):
            raise ToolParseError("tool call JSON must be an object with a name")
        name = item.get("name")
        if not isinstance(name, str):
            raise ToolParseError("tool call JSON without a string name")
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):
            arguments = loads_arguments(arguments)
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise ToolParseError("tool call arguments must be a JSON object")
        calls.append(ParsedCall(name, arguments))
    return tuple(calls)


class _GemmaReader:
    """Gemma 4 argument values: bare keys, `<|"|>`-quoted strings, JSON-like scalars and nesting."""

    _quote = '<|"|>'
    _max_depth = 64

    def __init__(self, text: str) -> None:
        self._s = text

    def value(self, pos: int, depth: int) -> tuple[Any, int]:
        s = self._s
        pos = skip_ws(s, pos)
        if depth > self._max_depth:
            raise ToolParseError("Gemma tool call arguments nest too deeply")
        if pos >= len(s):
            raise ToolParseError("truncated Gemma tool call arguments")
        if s.startswith(self._quote, pos):
            return self._quoted(pos)
        ch = s[pos]
        if ch == "{":
            return self.object(pos, depth + 1)
        if ch == "[":
            return self._array(pos, depth + 1)
        if ch == '"':
            return self._json_string(pos)
        stop = pos
        while stop < len(s) and s[stop] not in ",}]":
            if s.startswith(self._quote, stop):
                raise ToolParseError("malformed Gemma tool call value")
            stop += 1
        return _bare_scalar(s[pos:stop].strip()), stop

    def object(self, pos: int, depth: int) -> tuple[dict[str, Any], int]:
        s = self._s
        result: dict[str, Any] = {}
        pos = skip_ws(s, pos + 1)
        if pos < len(s) and s[pos] == "}":
            return result, pos + 1
        while True:
            key, pos = self._key(pos)
            pos = skip_ws(s, pos)
            if pos >= len(s) or s[pos] != ":":
                raise ToolParseError("expected ':' in Gemma tool call arguments")
            value, pos = self.value(pos + 1, depth)
            add_argument(result, key, value)
            pos = skip_ws(s, pos)
            if pos < len(s) and s[pos] == ",":
                pos = skip_ws(s, pos + 1)
                continue
            if pos < len(s) and s[pos] == "}":
                return result, pos + 1
            raise ToolParseError("expected ',' or '}' in Gemma tool call arguments")

    def _array(self, pos: int, depth: int) -> tuple[list[Any], int]:
        s = self._s
        result: list[Any] = []
        pos = skip_ws(s, pos + 1)
        if pos < len(s) and s[pos] == "]":
            return result, pos + 1
        while True:
            value, pos = self.value(pos, depth)
            result.append(value)
            pos = skip_ws(s, pos)
            if pos < len(s) and s[pos] == ",":
                pos += 1
                continue
            if pos < len(s) and s[pos] == "]":
                return result, pos + 1
            raise ToolParseError("expected ',' or ']' in Gemma tool call arguments")

    def _key(self, pos: int) -> tuple[str, int]:
        s = self._s
        pos = skip_ws(s, pos)
        if s.startswith(self._quote, pos):
            return self._quoted(pos)
        if pos < len(s) and s[pos] == '"':
            return self._json_string(pos)
        stop = s.find(":", pos)
        if stop < 0:
            raise ToolParseError("expected ':' in Gemma tool call arguments")
        key = s[pos:stop].strip()
        if not key or any(ch in key for ch in "{}[],<>") or _has_inner_space(key):
            raise ToolParseError("malformed key in Gemma tool call arguments")
        return key, stop

    def _quoted(self, pos: int) -> tuple[str, int]:
        start = pos + len(self._quote)
        stop = self._s.find(self._quote, start)
        if stop < 0:
            raise ToolParseError("unterminated Gemma string")
        return self._s[start:stop], stop + len(self._quote)

    def _json_string(self, pos: int) -> tuple[str, int]:
        stop = pos + 1
        s = self._s
        while stop < len(s) and s[stop] != '"':
            stop += 2 if s[stop] == "\\" else 1
        if stop >= len(s):
            raise ToolParseError("unterminated string in Gemma tool call arguments")
        value = loads_json(s[pos : stop + 1])
        assert isinstance(value, str)
        return value, stop + 1


def _bare_scalar(token: str) -> Any:
    if not token:
        raise ToolParseError("empty value in Gemma tool call arguments")
    lowered = token.lower()
    if lowered == "true":
        return True
    if lowered == "false":
        return False
    if lowered in ("null", "none"):
        return None
    try:
        return int(token, 10)
    except ValueError:
        pass
    try:
        number = float(token)
    except ValueError:
        return token
    if number != number or number in (float("inf"), float("-inf")):
        return token
    return number
