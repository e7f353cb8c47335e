"""Tool-call arguments: strict JSON, schema-guided conversion of tag values, the 8 MiB bound.

Every tool syntax ends up here: the arguments of a call are a JSON object with nonempty, unique
names, serialized to at most `MAX_ARGUMENTS_BYTES` of UTF-8. Tag-based syntaxes (Qwen function tags,
GLM, MiniMax, DSML, XTML) carry each value as raw text; the declared parameter schema guides a
best-effort conversion and never rejects a value (spec: "non-strict schemas do not reject invalid
values"). Unknown tools and undeclared parameters have no schema, so their values stay strings.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from helios.parsers.errors import ToolParseError

MAX_ARGUMENTS_BYTES = 8 * 1024 * 1024
"""Largest serialized arguments object a call may carry (spec: bounded to 8 MiB)."""

JsonSchema = Mapping[str, Any]
ToolSchemas = Mapping[str, JsonSchema]
"""Declared tools: tool name -> the JSON schema of its parameters (an object schema)."""


def loads_json(text: str) -> Any:
    """Strict JSON: no NaN/Infinity, no duplicate object keys. Raises ToolParseError."""
    try:
        return json.loads(text, object_pairs_hook=_unique_object, parse_constant=_reject_constant)
    except ToolParseError:
        raise
    except (ValueError, RecursionError) as exc:
        raise ToolParseError(f"invalid JSON in tool call: {_short(str(exc))}") from None


def loads_arguments(text: str) -> dict[str, Any]:
    """A JSON object given as text (Hermes, Kimi, harmony, DeepSeek V3.1 arguments)."""
    if len(text) > 2 * MAX_ARGUMENTS_BYTES:
        raise ToolParseError("tool call arguments exceed 8 MiB")
    value = loads_json(text.strip() or "{}")
    if not isinstance(value, dict):
        raise ToolParseError("tool call arguments must be a JSON object")
    return value


def add_argument(arguments: dict[str, Any], key: str, value: Any) -> None:
    """Adds one tag-carried argument, enforcing nonempty, unique names."""
    if not key:
        raise ToolParseError("tool call argument with an empty name")
    if key in arguments:
        raise ToolParseError(f"duplicate tool call argument {_short(key)!r}")
    arguments[key] = value


def dump_arguments(arguments: Mapping[str, Any]) -> str:
    """Serializes validated arguments; raises ToolParseError past the 8 MiB bound."""
    for key in arguments:
        if not isinstance(key, str) or not key:
            raise ToolParseError("tool call argument with an empty name")
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, RecursionError) as exc:
        raise ToolParseError(f"tool call arguments are not valid JSON: {_short(str(exc))}") from None
    if len(text) > MAX_ARGUMENTS_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_ARGUMENTS_BYTES:
        raise ToolParseError("tool call arguments exceed 8 MiB")
    return text


def parameter_schema(tools: ToolSchemas, tool_name: str, key: str) -> JsonSchema | None:
    """The declared schema of one parameter, or None (unknown tool or undeclared parameter)."""
    schema = tools.get(tool_name)
    if not isinstance(schema, Mapping):
        return None
    properties = schema.get("properties")
    if not isinstance(properties, Mapping):
        return None
    prop = properties.get(key)
    return prop if isinstance(prop, Mapping) else None


def convert_value(raw: str, schema: JsonSchema | None) -> Any:
    """Best-effort conversion of a tag value guided by its parameter schema.

    Without a schema, or when the schema allows strings first, the text is kept as is. Each declared
    type is tried in order; a value that fits none of them stays a string.
    """
    types = _schema_types(schema)
    if not types or types[0] == "string":
        return raw
    for kind in types:
        converted = _convert(raw, kind)
        if converted is not _NO_VALUE:
            return converted
    return raw


def convert_typed(raw: str, kind: str) -> Any:
    """Conversion driven by an explicit type attribute (XTML `type="…"`); strict: raises on mismatch."""
    if kind == "string":
        return raw
    converted = _convert(raw, kind)
    if converted is _NO_VALUE:
        raise ToolParseError(f"tool call argument is not a valid {_short(kind)}")
    return converted


# --- private helpers -------------------------------------------------------------------------------

_NO_VALUE: Any = object()


def _convert(raw: str, kind: str) -> Any:
    text = raw.strip()
    if kind == "integer":
        try:
            return int(text, 10)
        except ValueError:
            number = _as_number(text)
            if isinstance(number, float) and number.is_integer():
                return int(number)
            return _NO_VALUE
    if kind == "number":
        number = _as_number(text)
        return number if number is not None else _NO_VALUE
    if kind == "boolean":
        lowered = text.lower()
        if lowered == "true":
            return True
        if lowered == "false":
            return False
        return _NO_VALUE
    if kind == "null":
        return None if text.lower() in ("null", "none", "") else _NO_VALUE
    if kind in ("object", "array"):
        try:
            value = loads_json(text)
        except ToolParseError:
            return _NO_VALUE
        expected = dict if kind == "object" else list
        return value if isinstance(value, expected) else _NO_VALUE
    if kind == "string":
        return raw
    return _NO_VALUE


def _as_number(text: str) -> int | float | None:
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, ToolParseError):
        try:
            value = float(text)
        except ValueError:
            return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _schema_types(schema: JsonSchema | None) -> list[str]:
    if not isinstance(schema, Mapping):
        return []
    found: list[str] = []
    kind = schema.get("type")
    if isinstance(kind, str):
        found.append(kind)
    elif isinstance(kind, list):
        found.extend(k for k in kind if isinstance(k, str))
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list):
            for option in options:
                found.extend(_schema_types(option))
    if not found and "enum" in schema and isinstance(schema["enum"], list):
        found.extend(_json_type(v) for v in schema["enum"])
    if not found and isinstance(schema.get("properties"), Mapping):
        found.append("object")
    if not found and "items" in schema:
        found.append("array")
    # Strings first only when the schema lists them first; otherwise try the typed forms first.
    ordered: list[str] = []
    for kind_name in found:
        if kind_name not in ordered:
            ordered.append(kind_name)
    return ordered


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "string"


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ToolParseError(f"duplicate key {_short(key)!r} in tool call JSON")
        obj[key] = value
    return obj


def _reject_constant(name: str) -> Any:
    raise ToolParseError(f"non-finite number {name} in tool call JSON")


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "…"
