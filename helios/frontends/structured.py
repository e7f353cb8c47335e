"""Structured-output fields of every protocol, decoded into one domain `OutputConstraint`.

- Chat Completions ``response_format``: ``text`` (no constraint), ``json_object``, ``json_schema``
  (``{"name", "schema", "strict", "description"}``, as OpenAI defines it);
- Responses ``text.format``: the same types, with the ``json_schema`` fields flattened;
- Messages ``output_config.format``: ``{"type": "json_schema", "schema": {...}}``;
- the native extension ``structured_outputs`` (Chat, Completions, Responses), spelled as vLLM's
  ``StructuredOutputsParams``: exactly one of ``json`` (a schema, object or string), ``regex``,
  ``choice`` (strings), ``grammar`` (Lark; GBNF is converted) or ``json_object: true``.

Sans-IO: the grammar itself is compiled on the serving side before admission
(`helios.serving.structured`), which reports malformed schemas and grammars with llguidance's
message and this field's name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from helios.domain.conversation import ToolGrammar
from helios.domain.generation import OutputConstraint
from helios.errors import BadRequest
from helios.frontends.wire import loads_strict


def _nonempty_str(spec: Any) -> bool:
    return isinstance(spec, str) and spec != ""


_NATIVE: dict[str, tuple[Callable[[Any], bool], str, Any]] = {
    "json": (lambda spec: isinstance(spec, dict), "a JSON schema (an object or its JSON text)", "json_schema"),
    "regex": (_nonempty_str, "a nonempty string", "regex"),
    "choice": (lambda spec: isinstance(spec, list) and spec != [] and all(isinstance(x, str) for x in spec),
               "a nonempty array of strings", "choice"),
    "grammar": (_nonempty_str, "a nonempty string", "grammar"),
    "json_object": (lambda spec: spec is True, "true", "json_object"),
}
"""The kinds of ``structured_outputs``: each one's test of its value, what the value must be, and the
constraint's kind."""
_FORMATS = ("text", "json_object", "json_schema")
"""The types of Chat's ``response_format`` and Responses' ``text.format``."""
_UNSUPPORTED_FORMAT = {True: "{param}.type must be 'text', 'json_object' or 'json_schema', got '{kind}'",
                       False: "unsupported {param} type '{kind}'; use text, json_object or json_schema"}
"""The 400 for a type outside `_FORMATS`: Chat's (nested) wording, and Responses'."""
# vLLM's StructuredOutputsParams options that tune its own backends; accepted and inert here.
_NATIVE_INERT = ("disable_fallback",)


def decode_structured_outputs(value: Any, param: str = "structured_outputs") -> OutputConstraint | None:
    """vLLM's ``structured_outputs`` extension (None or ``{}``: no constraint)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadRequest(f"{param} must be an object", param=param)
    unknown = sorted(set(value) - set(_NATIVE) - set(_NATIVE_INERT))
    if unknown:
        raise BadRequest(f"{param}: unsupported option(s) {', '.join(unknown)}; use one of "
                         f"{', '.join(_NATIVE)}", param=param)
    given = [k for k in _NATIVE if value.get(k) not in (None, False)]
    if not given:
        return None
    if len(given) > 1:
        raise BadRequest(f"{param}: give exactly one of {', '.join(_NATIVE)} (got {', '.join(given)})",
                         param=param)
    kind = given[0]
    spec, where = value[kind], f"{param}.{kind}"
    if kind == "json" and isinstance(spec, str):  # its JSON text, decoded here with every JSON document's checks
        try:
            spec = loads_strict(spec)
        except ValueError as exc:
            raise BadRequest(f"{where}: the JSON schema is not valid JSON: {exc}", param=param) from None
    valid, expected, constraint = _NATIVE[kind]
    if not valid(spec):
        raise BadRequest(f"{where} must be {expected}", param=param)
    spec = None if kind == "json_object" else tuple(spec) if kind == "choice" else spec
    return OutputConstraint(constraint, spec, param=where)


def decode_format(fmt: Any, param: str, *, nested: bool = False) -> OutputConstraint | None:
    """Chat's ``response_format`` (`nested`: the ``json_schema`` fields under ``json_schema``) or
    Responses' ``text.format`` (flat; a ``text`` format's other keys are not checked): type ``text``
    is no constraint."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise BadRequest(f"{param} must be an object with a type", param=param)
    kind = fmt["type"]
    if kind not in _FORMATS:
        raise BadRequest(_UNSUPPORTED_FORMAT[nested].format(param=param, kind=kind), param=param)
    if kind == "text" and not nested:
        return None
    schema_keys = {"json_schema"} if nested else {"name", "schema", "strict", "description"}
    _only(fmt, {"type", *schema_keys} if kind == "json_schema" else {"type"}, param)
    if kind != "json_schema":
        return None if kind == "text" else OutputConstraint("json_object", param=param)
    if not nested:
        return _json_schema(fmt, param, param)
    if not isinstance(fmt.get("json_schema"), dict):
        raise BadRequest(f"{param}.json_schema must be an object", param=param)
    return _json_schema(fmt["json_schema"], f"{param}.json_schema", param)


def decode_output_format(fmt: Any, param: str = "output_config.format") -> OutputConstraint | None:
    """Messages ``output_config.format``: ``{"type": "json_schema", "schema": {...}}``."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise BadRequest(f"{param} must be an object with type 'json_schema'", param=param)
    _only(fmt, {"type", "schema"}, param)
    schema = fmt.get("schema")
    if not isinstance(schema, dict):
        raise BadRequest(f"{param}.schema must be a JSON schema object", param=param)
    return OutputConstraint("json_schema", schema, param=param)


def one_constraint(*constraints: OutputConstraint | None) -> OutputConstraint | None:
    """The request's constraint: at most one of its fields may set one."""
    given = [c for c in constraints if c is not None]
    if len(given) > 1:
        raise BadRequest(f"{given[0].param} and {given[1].param} cannot both constrain the output",
                         param=given[1].param.split(".")[0])
    return given[0] if given else None


def tool_contract(description: str | None, g: ToolGrammar) -> str:
    """A custom tool's description with its grammar contract (the model's only guide: generation is
    not constrained to it)."""
    kind = "Lark grammar" if g.syntax == "lark" else "regular expression"
    contract = (f"The input must match this {kind} exactly; input that does not match fails the call:\n"
                f"```\n{g.definition}\n```")
    return f"{description}\n\n{contract}" if description else contract


_SCHEMA_OPTIONS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("name", _nonempty_str, "a nonempty string"), ("strict", lambda v: isinstance(v, bool), "a boolean"),
    ("description", lambda v: isinstance(v, str), "a string"))
"""A JSON schema's optional fields (null is absence): each one's test and what it must be."""


def _json_schema(body: dict[str, Any], where: str, param: str) -> OutputConstraint:
    for key, valid, expected in _SCHEMA_OPTIONS:
        if body.get(key) is not None and not valid(body[key]):
            raise BadRequest(f"{where}.{key} must be {expected}", param=param)
    schema = body.get("schema")
    if schema is None:
        raise BadRequest(f"{where}.schema is required", param=param)
    if not isinstance(schema, dict):
        raise BadRequest(f"{where}.schema must be a JSON schema object", param=param)
    return OutputConstraint("json_schema", schema, param=where, strict=bool(body.get("strict")), name=body.get("name"))


def _only(obj: dict[str, Any], allowed: set[str], param: str) -> None:
    extra = sorted(set(obj) - allowed)
    if extra:
        raise BadRequest(f"unrecognized field(s) in {param}: {', '.join(extra)}", param=param)
