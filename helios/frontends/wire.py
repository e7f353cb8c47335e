"""Strict JSON → attrs structuring shared by every protocol decoder.

cattrs structures request bodies into attrs wire classes with unknown keys forbidden and no
silent coercion ("1" is not an int, true is not a number); failures become a BadRequest naming the
offending parameter.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
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


def parse_json_object(body: bytes, limits: Sequence[CountLimit] = ()) -> dict[str, Any]:
    """A request body as a JSON object, checked at the edge before anything else reads it: valid
    UTF-8 JSON, the route's item counts (`limits`: cheap, so first), then nesting and text (the
    `check_document` that `loads_strict` applies to every JSON document)."""
    if not body:
        raise BadRequest("the request body is empty; expected a JSON object")
    try:
        obj = _loads(body)
    except JSONShapeError as exc:
        raise BadRequest(str(exc), param=exc.param) from None
    except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
        raise BadRequest(f"malformed JSON body: {exc}") from None
    if not isinstance(obj, dict):
        raise BadRequest("the request body must be a JSON object")
    check_counts(obj, limits)
    try:
        check_document(obj)
    except JSONShapeError as exc:
        raise BadRequest(str(exc), param=exc.param) from None
    return obj


MAX_JSON_DEPTH = 64
"""Arrays and objects nested in one JSON document (a request body, or a JSON string inside one such as
tool-call arguments), the document itself counting as one. Far below what every recursive consumer
(the chat template's `_plain` and `_container_ids`, Jinja's `tojson`, `json.dumps`) can take."""


class JSONShapeError(ValueError):
    """A JSON document nested deeper than MAX_JSON_DEPTH, or with a string (a key or a value) that is
    not a sequence of Unicode scalar values (a lone surrogate such as "\\ud800"); `param` names where."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def loads_strict(text: str | bytes) -> Any:
    """json.loads without Python's extensions: NaN, ±Infinity and numbers that overflow to an
    infinite float are not JSON (RFC 8259) and could not be written back out; ValueError. Every
    decoded document then passes `check_document` (JSONShapeError, a ValueError)."""
    obj = _loads(text)
    check_document(obj)
    return obj


def _loads(text: str | bytes) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:  # the parser recurses per level: far past MAX_JSON_DEPTH
        raise JSONShapeError(f"the JSON document is nested more than {MAX_JSON_DEPTH} levels deep (arrays and "
                             f"objects); at most {MAX_JSON_DEPTH} are accepted", None) from None


def check_document(obj: Any) -> None:
    """Nesting at most MAX_JSON_DEPTH and only Unicode scalar text (keys included): the one check
    every decoded JSON document passes; iterative, so no document is too deep for it."""
    if not _document_ok(obj):
        raise _locate_problem(obj)


@attrs.frozen
class CountLimit:
    """At most `max_items` items in the array at `path`: a top-level field ("messages") or a field of
    every element of a limited array ("messages[].content"). Anything else (absent, not an array) is
    left to the protocol's decoder."""

    path: str
    max_items: int


def check_counts(obj: dict[str, Any], limits: Sequence[CountLimit]) -> None:
    """The route's item counts, in the order given (a parent array's rule comes before its
    children's, so walking a child rule touches at most the parent's limit of elements)."""
    for limit in limits:
        segments = limit.path.split("[].")
        level: list[tuple[Any, str]] = [(obj, "")]
        for k, name in enumerate(segments):
            last = k == len(segments) - 1
            nxt: list[tuple[Any, str]] = []
            for container, where in level:
                if not isinstance(container, dict) or not isinstance(container.get(name), list):
                    continue
                items = container[name]
                here = f"{where}.{name}" if where else name
                if last:
                    if len(items) > limit.max_items:
                        raise BadRequest(f"'{here}' has {len(items)} items; at most {limit.max_items} are accepted",
                                         param=here)
                else:
                    nxt.extend((item, f"{here}[{i}]") for i, item in enumerate(items))
            level = nxt


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


_SURROGATE = re.compile("[\ud800-\udfff]")


def _is_scalar_text(text: str) -> bool:
    return text.isascii() or _SURROGATE.search(text) is None


def _document_ok(obj: Any) -> bool:
    """The fast pass: no paths built, only containers on the stack."""
    if type(obj) is str:
        return _is_scalar_text(obj)
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return False
        if type(value) is dict:
            for key in value:
                if not _is_scalar_text(key):
                    return False
            items: Any = value.values()
        elif type(value) is list:
            items = value
        else:
            continue
        for item in items:
            kind = type(item)
            if kind is str:
                if not _is_scalar_text(item):
                    return False
            elif kind is dict or kind is list:
                stack.append((item, depth + 1))
    return True


def _locate_problem(obj: Any) -> JSONShapeError:
    """The slow pass, after the fast one failed: the first problem in document order, with its path."""
    stack: list[tuple[Any, int, str]] = [(obj, 1, "")]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, str):
            if not _is_scalar_text(value):
                return _text_error(where)
            continue
        if not isinstance(value, dict | list):
            continue
        if depth > MAX_JSON_DEPTH:
            field = re.split(r"[.\[]", where, maxsplit=1)[0] or None  # the top-level field it is under
            return JSONShapeError(f"{f'{field!r}' if field else 'the JSON document'} is nested more than "
                                  f"{MAX_JSON_DEPTH} levels deep (arrays and objects); at most {MAX_JSON_DEPTH} "
                                  "are accepted", field)
        if isinstance(value, dict):
            for key in value:
                if not _is_scalar_text(key):
                    return _text_error(f"{where}.<key>" if where else "<key>")
            children = [(item, depth + 1, f"{where}.{key}" if where else key) for key, item in value.items()]
        else:
            children = [(item, depth + 1, f"{where}[{i}]") for i, item in enumerate(value)]
        stack.extend(reversed(children))
    return JSONShapeError("the JSON document is invalid", None)  # not reached after a failed fast pass


def _text_error(where: str) -> JSONShapeError:
    return JSONShapeError(f"{where or 'the JSON document'} is not valid Unicode text: it contains a lone UTF-16 "
                          "surrogate (an unpaired \\ud800-\\udfff escape)", where or None)
