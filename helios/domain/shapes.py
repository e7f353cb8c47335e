"""Declared JSON output shapes and the one serializer that writes them.

Every protocol declares its response bodies and stream events once, as `@shape` classes (attrs:
slotted, keyword-only), and builds them; `to_json` is the only place their JSON objects are made. A
shape writes its fields in declaration order; a field whose value is `OMIT` is left out (the wire's
absent optional field), None is written as null; nested shapes, lists, tuples and dicts are
converted recursively (tuples and byte strings annotated as sequences as arrays). A field declared
with `flat()` splices its shape's fields in place of itself.

A stream event is written when it is sent (`StreamEvent.data`), so an encoder never changes a shape
an event already holds; it builds a new one (shapes are not frozen: attrs' frozen initializers cost
several times more, on every token).

Each class's writer is generated once, the first time the class is written, from its annotations:
JSON scalars (str, int, float, bool, None, Literal) copied as they are, sequences of scalars as
lists, a field naming one shape class (or a list of them) by that class's writer, anything else by
`to_json`. No torch, no trio, no protocol.
"""

from __future__ import annotations

import collections.abc
import enum
import threading
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, TypeAlias, TypeVar, Union, dataclass_transform

import attrs

T = TypeVar("T")


class Omit(enum.Enum):
    OMIT = "omit"


OMIT: Literal[Omit.OMIT] = Omit.OMIT
"""A field's value when the field is absent from the wire."""

Opt: TypeAlias = Union[T, Literal[Omit.OMIT]]  # noqa: UP007
"""An optional wire field: present with a value (which may be None) or absent (`OMIT`)."""

_FLAT = "helios.shape.flat"
_SCALARS = (str, int, float, bool, type(None), Omit)
_UNIONS = (typing.Union, types.UnionType)


def flat() -> Any:
    """A field holding a shape whose fields are written in place of this one."""
    return attrs.field(metadata={_FLAT: True})


@dataclass_transform(kw_only_default=True, field_specifiers=(attrs.field, flat))
def shape(cls: type[T] | None = None, /, *, tag: str | None = None) -> Any:
    """Declare a wire shape: an attrs class (slotted, keyword-only) `to_json` writes. `tag` is its
    type tag where it has one (`@shape(tag="text")`): the class attribute `type`, written first."""
    def define(c: type[T]) -> type[T]:
        if tag is not None:
            c.type = tag  # type: ignore[attr-defined]
        return attrs.define(kw_only=True)(c)
    return define if cls is None else define(cls)


def to_json(obj: Any) -> Any:
    """The JSON value of a shape (a dict), or of a list, tuple or dict holding shapes and scalars."""
    cls = obj.__class__
    fn = _WRITERS.get(cls)
    if fn is not None:
        return fn(obj)
    if cls in _SCALARS:
        return obj
    if cls is list or cls is tuple:
        return [to_json(x) for x in obj]
    if cls is dict:
        return {k: to_json(v) for k, v in obj.items()}
    if attrs.has(cls):
        return _writer(cls)(obj)
    return obj


_WRITERS: dict[type, Callable[[Any], dict[str, Any]]] = {}


def _is_scalar(tp: Any) -> bool:
    """A type whose values are JSON scalars as they are (no conversion needed)."""
    origin = typing.get_origin(tp)
    if origin in _UNIONS:
        return all(_is_scalar(a) for a in typing.get_args(tp))
    return tp in _SCALARS or origin is Literal


def _scalar_list(tp: Any) -> bool:
    """list[scalar], tuple[scalar, ...] or Sequence[scalar] (bytes: their values): written as a list of
    its items as they are."""
    args = typing.get_args(tp)
    return (typing.get_origin(tp) in (list, tuple, collections.abc.Sequence) and bool(args)
            and _is_scalar(args[0]) and args[-1] in (args[0], ...))


def _convert(tp: Any, get: str, ns: dict[str, Any]) -> str:
    """The expression writing the value `get` of a field annotated `tp`: a shape's own writer called
    directly where the annotation names one shape class (optionally, or as the items of a list)."""
    if _is_scalar(tp):
        return get
    if _scalar_list(tp):
        return f"list({get})"
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if origin in _UNIONS and len(args) == 2 and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        if _is_shape(inner):
            return f"(None if {get} is None else {_writer_name(inner, ns)}({get}))"
    if origin is list and len(args) == 1 and _is_shape(args[0]):
        return f"list(map({_writer_name(args[0], ns)}, {get}))"
    if _is_shape(tp):
        return f"{_writer_name(tp, ns)}({get})"
    return f"to_json({get})"


def _is_shape(tp: Any) -> bool:
    return isinstance(tp, type) and attrs.has(tp) and tp not in _GENERATING


def _writer_name(cls: type, ns: dict[str, Any]) -> str:
    """The name of `cls`'s writer in the namespace `ns` of a writer being generated."""
    ns[f"w_{cls.__name__}"] = _writer(cls)
    return f"w_{cls.__name__}"


_GENERATING: set[type] = set()
_LOCK = threading.RLock()


def _writer(cls: type) -> Callable[[Any], dict[str, Any]]:
    """Generate `cls`'s writer: one dict display of its present fields, in declaration order."""
    with _LOCK:  # generated once per class, whichever thread writes it first
        if cls in _WRITERS:
            return _WRITERS[cls]
        _GENERATING.add(cls)
        try:
            hints = typing.get_type_hints(cls)
            ns: dict[str, Any] = {"to_json": to_json, "OMIT": OMIT}
            tag = getattr(cls, "type", None)  # a field named type is a slot, not a string
            head = [f"'type': {tag!r}"] if isinstance(tag, str) else []  # the leading always-present fields
            body: list[str] = []
            for a in attrs.fields(cls):
                tp, get = hints.get(a.name, Any), f"o.{a.name}"
                if typing.get_origin(tp) in _UNIONS:  # Opt[X]: X once present
                    args = [x for x in typing.get_args(tp) if x != Literal[Omit.OMIT]]
                    tp = args[0] if len(args) == 1 else typing.Union[tuple(args)]  # noqa: UP007
                if a.metadata.get(_FLAT):
                    body.append(f"    d.update({_convert(tp, get, ns)})")
                elif a.default is OMIT:
                    body += [f"    v = {get}", f"    if v is not OMIT: d[{a.name!r}] = {_convert(tp, 'v', ns)}"]
                elif not body:
                    head.append(f"{a.name!r}: {_convert(tp, get, ns)}")
                else:
                    body.append(f"    d[{a.name!r}] = {_convert(tp, get, ns)}")
            lines = ["def write(o):", f"    d = {{{', '.join(head)}}}", *body, "    return d"]
            exec(compile("\n".join(lines), f"<shape writer {cls.__qualname__}>", "exec"), ns)
        finally:
            _GENERATING.discard(cls)
        fn: Callable[[Any], dict[str, Any]] = ns["write"]
        _WRITERS[cls] = fn
        return fn
