"""Hugging Face chat templates, compiled once and rendered in a Jinja sandbox.

A `ChatTemplate` reproduces what `transformers` gives a template: the same Jinja options
(`trim_blocks`, `lstrip_blocks`, loop controls, the `{% generation %}` tag), the same globals and
filters (`raise_exception`, `tojson` with `ensure_ascii=False`, `strftime_now`, `namespace`), and the
same variables (`messages`, `tools`, `documents`, `add_generation_prompt`, `bos_token`,
`eos_token`, plus caller keyword arguments such as `enable_thinking`).

The environment is `ImmutableSandboxedEnvironment` with one relaxation: lists, dicts and sets that
the template builds itself may be mutated (`ids.append(x)`, `queue.pop(0)`), as the Kimi K2
templates do. Everything passed in is a fresh plain-JSON copy, and mutating methods on those
copies stay forbidden, so a template can never change what the caller sees.

Every failure while rendering (a template's own `raise_exception`, a type error inside the
template, a bad continuation request) surfaces as `ChatTemplateError`, which the server maps to
HTTP 400. A template that does not compile raises `ChatTemplateError` from the constructor.
"""

from __future__ import annotations

import contextvars
import json
import threading
from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.runtime
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment


class ChatTemplateError(jinja2.exceptions.TemplateError):
    """A conversation the prepared template cannot render (the client's fault: HTTP 400)."""

    http_status = 400


class TemplateRaisedError(ChatTemplateError):
    """The template rejected the conversation itself, through `raise_exception(message)`."""


# Appended to the final message's content for `continue_final_message`; the rendered text is cut at
# it. The trailing space shows whether the template trimmed the content (then the cut is rstripped).
_CONTINUE_MARK = "<|helios:continue-final-message|>"
_CONTINUE_TAIL = " "

_INLINE_SYSTEM_PROBE = "Y-probe"
_ARGUMENTS_PROBE_KEY = "helios_probe_key"
_ARGUMENTS_PROBE_VALUE = "helios_probe_value"


class ChatTemplate:
    """One compiled chat template. Thread-safe: rendering shares no mutable state."""

    def __init__(self, source: str) -> None:
        self.source = source
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc
        self._probe_lock = threading.Lock()
        self._inline_system: bool | None = None
        self._dict_arguments: bool | None = None
        self._tools: bool | None = None

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        bos_token: str = "",
        eos_token: str = "",
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` as Hugging Face's `apply_chat_template(..., tokenize=False)` would.

        `continue_final_message` renders the final assistant message and cuts the text right after
        its content, so generation continues that message (assistant prefill). It cannot be
        combined with `add_generation_prompt`.
        """
        chat = [_with_reasoning_aliases(_plain_message(m)) for m in messages]
        if continue_final_message:
            _mark_final_message(chat, add_generation_prompt)
        variables: dict[str, Any] = {
            **_plain(template_kwargs),
            "messages": chat,
            "tools": _plain(tools) if tools else None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": bos_token,
            "eos_token": eos_token,
        }
        text = self._render(variables)
        if continue_final_message:
            text = _cut_at_mark(text)
        return text

    def supports_inline_system(self) -> bool:
        """Whether a system message after the first renders its text (probed once, cached).

        The probe renders [system, user, assistant, system, user]. A template that raises, or
        whose output lacks the second system text, does not support inline system messages.
        """
        if self._inline_system is None:
            probe = [
                {"role": "system", "content": "X-probe"},
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a"},
                {"role": "system", "content": _INLINE_SYSTEM_PROBE},
                {"role": "user", "content": "v"},
            ]
            with self._probe_lock:
                self._inline_system = self._renders_text(probe, _INLINE_SYSTEM_PROBE)
        return self._inline_system

    def supports_tools(self) -> bool:
        """Whether the template presents the `tools` it is given (probed once, cached).

        The probe renders one user message with one tool whose name and description are unique
        strings; a template that raises, or whose output lacks the name, cannot present tools
        (SmolLM2's ChatML template ignores `tools` entirely).
        """
        if self._tools is None:
            probe_tool = {
                "type": "function",
                "function": {
                    "name": _TOOLS_PROBE_NAME,
                    "description": "probe",
                    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
                },
            }
            with self._probe_lock:
                try:
                    text: str | None = self.render(
                        [{"role": "user", "content": "u"}], tools=[probe_tool], add_generation_prompt=True
                    )
                except ChatTemplateError:
                    text = None
                self._tools = text is not None and _TOOLS_PROBE_NAME in text
        return self._tools

    def accepts_dict_tool_arguments(self) -> bool:
        """Whether assistant tool-call `arguments` may be a JSON object (probed once, cached).

        Most templates serialize a mapping themselves (`arguments | tojson`, or one tag per
        key). Some, such as DeepSeek V3.1's, concatenate `arguments` as a string: they raise, or
        show a Python repr, when given a mapping, and need the JSON text instead.
        """
        if self._dict_arguments is None:
            as_mapping = {_ARGUMENTS_PROBE_KEY: _ARGUMENTS_PROBE_VALUE}
            with self._probe_lock:
                text = self._try_render(_tool_call_probe(as_mapping))
                # A Python repr ("{'helios_probe_key': ...}") means the mapping was stringified.
                accepted = text is not None and f"'{_ARGUMENTS_PROBE_KEY}'" not in text
                if not accepted:
                    # Blame the mapping only if the JSON text renders; a template that cannot
                    # render tool calls at all keeps the neutral default (mappings).
                    accepted = self._try_render(_tool_call_probe(json.dumps(as_mapping))) is None
                self._dict_arguments = accepted
        return self._dict_arguments

    # -- internals --------------------------------------------------------------------------------

    def _render(self, variables: dict[str, Any]) -> str:
        token = _INPUT_CONTAINERS.set(frozenset(_container_ids(variables)))
        try:
            return self._template.render(variables)
        except ChatTemplateError:
            raise
        except Exception as exc:  # a template bug or an input the template cannot handle
            raise ChatTemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from exc
        finally:
            _INPUT_CONTAINERS.reset(token)

    def _try_render(self, messages: list[dict[str, Any]]) -> str | None:
        try:
            return self.render(messages, add_generation_prompt=True)
        except ChatTemplateError:
            return None

    def _renders_text(self, messages: list[dict[str, Any]], needle: str) -> bool:
        text = self._try_render(messages)
        return text is not None and needle in text


_TOOLS_PROBE_NAME = "helios_tools_probe_fn"


def _tool_call_probe(arguments: object) -> list[dict[str, Any]]:
    call = {"id": "call_probe", "type": "function", "function": {"name": "probe", "arguments": arguments}}
    return [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_probe", "content": "r"},
        {"role": "user", "content": "v"},
    ]


# -- environment ----------------------------------------------------------------------------------

# ids of the containers passed into the render in progress (per thread / task); those stay immutable.
_INPUT_CONTAINERS: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "helios_template_inputs", default=frozenset()
)


class _TemplateEnvironment(ImmutableSandboxedEnvironment):
    """Immutable sandbox, except for containers the template created itself."""

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        if super().is_safe_attribute(obj, attr, value):
            return True
        # Only the immutability rule refused it: allow it on a template-local container.
        return SandboxedEnvironment.is_safe_attribute(self, obj, attr, value) and (
            id(obj) not in _INPUT_CONTAINERS.get()
        )


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker) renders its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja's Extension declares it a plain class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: jinja2.runtime.Macro) -> str:
        return str(caller())


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names, so a template cannot reach internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        for name in dict(*rest, **kwargs):
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        super().__setitem__(name, value)


def _check_namespace_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _raise_exception(message: object) -> None:
    raise TemplateRaisedError(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | list[str] | None = None,
    sort_keys: bool = False,
) -> str:
    seps = (separators[0], separators[1]) if separators is not None else None
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=seps, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _dict(*args: Any, **kwargs: Any) -> dict[Any, Any]:
    return dict(*args, **kwargs)


_ENV: _TemplateEnvironment | None = None
_ENV_LOCK = threading.Lock()


def _environment() -> _TemplateEnvironment:
    global _ENV
    with _ENV_LOCK:
        if _ENV is None:
            env = _TemplateEnvironment(
                trim_blocks=True,
                lstrip_blocks=True,
                extensions=[jinja2.ext.loopcontrols, _GenerationTag],
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            env.globals["namespace"] = _Namespace
            env.globals["dict"] = _dict
            _ENV = env
        return _ENV


# -- data preparation -----------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """A fresh copy built from JSON types only; anything else becomes a `<TypeName>` placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


def _plain_message(message: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"a chat message must be a mapping, not {type(message).__name__}")
    # Like transformers: keys whose value is None are dropped; templates test `is defined`.
    return {str(k): _plain(v) for k, v in message.items() if v is not None}


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    # transformers fills `reasoning_content` from `thinking`/`reasoning` and `thinking` from it
    # (gpt-oss reads `thinking`); templates then find reasoning under whichever name they use.
    for key in ("reasoning_content", "thinking", "reasoning"):
        if message.get(key) is not None:
            reasoning = message[key]
            return {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _container_ids(value: Any) -> Iterator[int]:
    if isinstance(value, dict):
        yield id(value)
        for v in value.values():
            yield from _container_ids(v)
    elif isinstance(value, list):
        yield id(value)
        for v in value:
            yield from _container_ids(v)


def _mark_final_message(chat: list[dict[str, Any]], add_generation_prompt: bool) -> None:
    if add_generation_prompt:
        raise ChatTemplateError("continue_final_message cannot be combined with add_generation_prompt")
    if not chat or chat[-1].get("role") != "assistant":
        raise ChatTemplateError("continue_final_message needs a final assistant message to continue")
    final = chat[-1]
    content = final.get("content", "")
    if isinstance(content, str):
        final["content"] = content + _CONTINUE_MARK + _CONTINUE_TAIL
        return
    if isinstance(content, list):
        for block in reversed(content):
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                block["text"] = block["text"] + _CONTINUE_MARK + _CONTINUE_TAIL
                return
    raise ChatTemplateError("continue_final_message needs text in the final assistant message")


def _cut_at_mark(text: str) -> str:
    at = text.rfind(_CONTINUE_MARK)
    if at < 0:
        raise ChatTemplateError(
            "continue_final_message: the chat template does not render the final assistant message's content"
        )
    if text.startswith(_CONTINUE_TAIL, at + len(_CONTINUE_MARK)):
        return text[:at]
    # The template trimmed the content: the continuation starts after the trimmed text.
    return text[:at].rstrip()
