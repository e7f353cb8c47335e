"""Strict JSON → attrs structuring shared by every protocol decoder.

cattrs structures request bodies into attrs wire classes with unknown keys forbidden and no
silent coercion ("1" is not an int, true is not a number); failures become a BadRequest naming the
offending parameter.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar, get_args, get_origin

import attrs
import cattrs
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError

from helios.errors import BadRequest

T = TypeVar("T")


def _strict_int(v: Any, _t: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"expected an integer, got {type(v).__name__}")
    return v


def _strict_float(v: Any, _t: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise TypeError(f"expected a number, got {type(v).__name__}")
    return float(v)


def _strict_str(v: Any, _t: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"expected a string, got {type(v).__name__}")
    return v


def _strict_bool(v: Any, _t: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"expected a boolean, got {type(v).__name__}")
    return v


def _any(v: Any, _t: Any) -> Any:
    return v


def _is_list(t: Any) -> bool:
    return get_origin(t) is list or t is list


def make_converter() -> cattrs.Converter:
    c = cattrs.Converter(forbid_extra_keys=True)

    def list_hook(v: Any, t: Any) -> list[Any]:
        # A string is not a list of characters, and an object is not a list of its keys.
        if not isinstance(v, list):
            raise TypeError(f"expected an array, got {type(v).__name__}")
        args = get_args(t)
        if not args or args[0] is Any:
            return list(v)
        return [c.structure(x, args[0]) for x in v]

    c.register_structure_hook_func(_is_list, list_hook)
    c.register_structure_hook(int, _strict_int)
    c.register_structure_hook(float, _strict_float)
    c.register_structure_hook(str, _strict_str)
    c.register_structure_hook(bool, _strict_bool)
    c.register_structure_hook(Any, _any)
    return c


CONVERTER = make_converter()


@attrs.frozen(kw_only=True)
class NativeGenerationFields:
    """Sampling, stop and logprob fields that Chat Completions, Completions and Responses share
    (the OpenAI ones plus vLLM's native extensions); each wire class adds its own. Their rows in the
    protocols' field tables are `fields.NATIVE_GENERATION_ROWS`."""

    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: Any = None
    stop_token_ids: Any = None
    stop_token_sequences: Any = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    logprob_token_ids: list[int] | None = None
    structured_outputs: Any = None


def parse_json_object(body: bytes) -> dict[str, Any]:
    if not body:
        raise BadRequest("the request body is empty; expected a JSON object")
    try:
        obj = loads_strict(body)
    except (UnicodeDecodeError, RecursionError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise BadRequest(f"malformed JSON body: {exc}") from None
    if not isinstance(obj, dict):
        raise BadRequest("the request body must be a JSON object")
    return obj


def loads_strict(text: str | bytes) -> Any:
    """json.loads without Python's extensions: NaN, ±Infinity and numbers that overflow to an
    infinite float are not JSON (RFC 8259) and could not be written back out; ValueError."""
    return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is out of range for a JSON number")
    return value


def structure(obj: Any, cls: type[T]) -> T:
    try:
        return CONVERTER.structure(obj, cls)
    except (ClassValidationError, IterableValidationError, ForbiddenExtraKeysError) as exc:
        msg, param = _describe(exc)
        raise BadRequest(msg, param=param) from None
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise BadRequest(f"invalid request: {exc}") from None


def _describe(exc: BaseException) -> tuple[str, str | None]:
    """The first leaf error as a message and a dotted parameter path."""
    path: list[str] = []
    cur: BaseException = exc
    while True:
        if isinstance(cur, ForbiddenExtraKeysError):
            keys = ", ".join(sorted(cur.extra_fields))
            where = ".".join(path)
            return (f"unrecognized request argument(s): {keys}" + (f" in {where}" if where else ""),
                    ".".join([*path, sorted(cur.extra_fields)[0]]))
        if isinstance(cur, ClassValidationError | IterableValidationError):
            subs = list(cur.exceptions)
            if not subs:
                break
            sub = subs[0]
            note = _note_of(sub)
            if note is not None:
                path.append(note)
            cur = sub
            continue
        break
    param = ".".join(path) or None
    if isinstance(cur, KeyError):
        return f"missing required parameter: {param}", param
    return f"invalid value for {param or 'request'}: {cur}", param


def _note_of(exc: BaseException) -> str | None:
    for note in getattr(exc, "__notes__", []) or []:
        name = getattr(note, "name", None)
        if name is not None:
            return str(name)
        idx = getattr(note, "index", None)
        if idx is not None:
            return str(idx)
    return None
