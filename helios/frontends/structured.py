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

from typing import Any

from helios.domain.conversation import ToolGrammar
from helios.domain.generation import OutputConstraint
from helios.errors import BadRequest
from helios.frontends.wire import loads_strict

_NATIVE_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's StructuredOutputsParams options that tune its own backends; accepted and inert here.
_NATIVE_INERT = ("disable_fallback",)


def decode_structured_outputs(value: Any, param: str = "structured_outputs") -> OutputConstraint | None:
    """vLLM's ``structured_outputs`` extension (None or ``{}``: no constraint)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadRequest(f"{param} must be an object", param=param)
    unknown = sorted(set(value) - set(_NATIVE_KINDS) - set(_NATIVE_INERT))
    if unknown:
        raise BadRequest(f"{param}: unsupported option(s) {', '.join(unknown)}; use one of "
                         f"{', '.join(_NATIVE_KINDS)}", param=param)
    given = [k for k in _NATIVE_KINDS if value.get(k) not in (None, False)]
    if not given:
        return None
    if len(given) > 1:
        raise BadRequest(f"{param}: give exactly one of {', '.join(_NATIVE_KINDS)} (got {', '.join(given)})",
                         param=param)
    kind = given[0]
    spec = value[kind]
    where = f"{param}.{kind}"
    if kind == "json_object":
        if spec is not True:
            raise BadRequest(f"{where} must be true", param=param)
        return OutputConstraint("json_object", param=where)
    if kind == "json":
        if isinstance(spec, str):  # its JSON text, decoded here with every JSON document's checks
            try:
                spec = loads_strict(spec)
            except ValueError as exc:
                raise BadRequest(f"{where}: the JSON schema is not valid JSON: {exc}", param=param) from None
        if not isinstance(spec, dict):
            raise BadRequest(f"{where} must be a JSON schema (an object or its JSON text)", param=param)
        return OutputConstraint("json_schema", spec, param=where)
    if kind in ("regex", "grammar"):
        if not isinstance(spec, str) or not spec:
            raise BadRequest(f"{where} must be a nonempty string", param=param)
        return OutputConstraint("regex" if kind == "regex" else "grammar", spec, param=where)
    if not isinstance(spec, list) or not spec or not all(isinstance(x, str) for x in spec):
        raise BadRequest(f"{where} must be a nonempty array of strings", param=param)
    return OutputConstraint("choice", tuple(spec), param=where)


def decode_response_format(value: Any, param: str = "response_format") -> OutputConstraint | None:
    """Chat Completions ``response_format`` (None or type ``text``: no constraint)."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise BadRequest(f"{param} must be an object with a type", param=param)
    kind = value["type"]
    if kind == "text":
        _only(value, {"type"}, param)
        return None
    if kind == "json_object":
        _only(value, {"type"}, param)
        return OutputConstraint("json_object", param=param)
    if kind == "json_schema":
        _only(value, {"type", "json_schema"}, param)
        body = value.get("json_schema")
        if not isinstance(body, dict):
            raise BadRequest(f"{param}.json_schema must be an object", param=param)
        return _json_schema(body, f"{param}.json_schema", param)
    raise BadRequest(f"{param}.type must be 'text', 'json_object' or 'json_schema', got '{kind}'", param=param)


def decode_text_format(fmt: Any, param: str = "text.format") -> OutputConstraint | None:
    """Responses ``text.format`` (type ``text``: no constraint); ``json_schema`` fields are flat."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise BadRequest(f"{param} must be an object with a type", param=param)
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        _only(fmt, {"type"}, param)
        return OutputConstraint("json_object", param=param)
    if kind == "json_schema":
        _only(fmt, {"type", "name", "schema", "strict", "description"}, param)
        return _json_schema(fmt, param, param)
    raise BadRequest(f"unsupported {param} type '{kind}'; use text, json_object or json_schema", param=param)


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


def _json_schema(body: dict[str, Any], where: str, param: str) -> OutputConstraint:
    name = body.get("name")
    if name is not None and (not isinstance(name, str) or not name):
        raise BadRequest(f"{where}.name must be a nonempty string", param=param)
    strict = body.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise BadRequest(f"{where}.strict must be a boolean", param=param)
    description = body.get("description")
    if description is not None and not isinstance(description, str):
        raise BadRequest(f"{where}.description must be a string", param=param)
    schema = body.get("schema")
    if schema is None:
        raise BadRequest(f"{where}.schema is required", param=param)
    if not isinstance(schema, dict):
        raise BadRequest(f"{where}.schema must be a JSON schema object", param=param)
    return OutputConstraint("json_schema", schema, param=where, strict=bool(strict), name=name)


def _only(obj: dict[str, Any], allowed: set[str], param: str) -> None:
    extra = sorted(set(obj) - allowed)
    if extra:
        raise BadRequest(f"unrecognized field(s) in {param}: {', '.join(extra)}", param=param)
