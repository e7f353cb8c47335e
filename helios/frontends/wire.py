"""Strict JSON → attrs structuring shared by every protocol decoder.

Each wire shape is declared once, as an attrs class (or a union of them), and cattrs structures a
request body into it with unknown keys forbidden and no silent coercion ("1" is not an int, true is
not a number). Below the top level:

- a union of attrs classes is a *tagged union*: the field every member declares as a `Literal`
  (``type``, or ``role`` for chat messages) picks the member;
- any other union (``str | list[Part] | None``, ``Literal["auto", "none"] | NamedChoice``) is picked
  by the JSON kind of the value (string, array, object, ...);
- a member of a tagged union may be *refused* (`REFUSED`, a message template or a function of the
  tag): its tag values are known, and the 400 says why they are not taken (``'url'`` image sources,
  misplaced blocks, hosted tools); one member whose tag has a default is taken when the tag is absent
  (a Responses message item without ``type``);
- a class may *build* the value it stands for (`BUILD`, a function of its fields): both converters
  return the built value (a domain part) instead of an instance, or the instance where the builder
  returns None (the value needs context the fields lack, such as an image's place, and the decoder
  completes it); a field holding such values declares the built type with the wire shape it comes
  from, ``Annotated[TextPart, From(InputText)]`` (one object per block instead of a wire object and
  then its domain part);
- a field's `fields.FieldPolicy` lives in its metadata (`wire_field`); a class whose fields include
  ignored or refused ones screens them after structuring, and a class marked `lenient` ignores
  unknown keys instead of refusing them (content parts, whose extensions vLLM ignores too);
- leaf checks that need more than a type raise `Invalid`.

Every failure becomes one BadRequest whose ``param`` is the path of the offending value
(``messages[2].content[0].image_url.url``) and whose message names it. Success is structured
without cattrs' per-field error collection (`FAST`); only a failing body is structured again with
it (`DETAILED`) to find the path.
"""

from __future__ import annotations

import base64
import functools
import inspect
import json
import re
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from types import NoneType, UnionType
from typing import Any, Literal, NewType, TypeVar, Union, cast, get_args, get_origin

import attrs
import cattrs
from cattrs.cols import list_structure_factory
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn, override

from helios.errors import BadRequest
from helios.frontends.fields import JSON_KINDS, FieldPolicy, policy_rows
from helios.frontends.fields import NativeGenerationFields as NativeGenerationFields  # the shared wire fields

T = TypeVar("T")

LENIENT = "__wire_lenient__"
"""A class attribute: True where unknown keys are ignored rather than refused."""
REFUSED = "__wire_refused__"
"""A class attribute of a tagged union's member: the 400 for its tag values (``{value!r}`` is the
tag), which the union knows but does not take; or a function of the tag returning the `Invalid`. Such a
member declares only its tag."""
BUILD = "__wire_build__"
"""A class attribute: a function taking fields of the class as keyword arguments (by alias; the ones it
names) and returning the value the class stands for, which both converters return in place of an
instance (see `From`); or None, and they return the instance."""


@attrs.frozen
class From:
    """``Annotated[Built, From(wire)]``: a value structured from the wire shape `wire` (an attrs class
    or a tagged union of them) whose members `BUILD` values of type ``Built`` (members that do not
    build stay instances, so ``Built`` names them too)."""

    wire: Any


ABSENT = object()
"""A tagged union's key for its member taken when the tag is absent."""


class WireDeclarationError(Exception):
    """A wire type the converter cannot structure: a bug in a declaration, never the client's 400."""


class Invalid(ValueError):
    """A value of the right JSON type that its field does not take. The 400 reads "{path} {reason}"
    for a predicate ("must be ...", "is ...") and "{path}: {reason}" otherwise; `at` names a key
    below the value (a union's tag), appended to the path; `param_at` one appended to the 400's param
    only (the message names the value, the param its bad key); `param` replaces the param (a coarser
    one that clients key on); `details` are the 400's Anthropic ``error.details``."""

    def __init__(self, reason: str, *, at: str | None = None, details: dict[str, Any] | None = None,
                 param_at: str | None = None, param: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.at = at
        self.details = details
        self.param_at = param_at
        self.param = param


def json_kind(v: Any) -> str:
    """The JSON kind of a decoded value."""
    return next((kind for t, (kind, _) in JSON_KINDS.items() if isinstance(v, t)), type(v).__name__)


def _exact(t: type) -> Callable[[Any, Any], Any]:
    """The hook of a JSON string, boolean, integer, number or object (`t`): the value itself (a
    number's as a float: an integer is one too), never a boolean for a number."""
    expected = JSON_KINDS[t][1]
    accepted: Any = (int, float) if t is float else t

    def hook(v: Any, _t: Any) -> Any:
        if not isinstance(v, accepted) or (t in (int, float) and isinstance(v, bool)):
            raise TypeError(f"expected {expected}, got {json_kind(v) if t is dict else type(v).__name__}")
        return float(v) if t is float else v

    return hook


_json_object = _exact(dict)


def _any(v: Any, _t: Any) -> Any:
    return v


NonEmptyStr = NewType("NonEmptyStr", str)
"""A string with at least one character (names)."""
JSONObjectText = NewType("JSONObjectText", dict[str, Any])
"""A JSON object, or a string holding one (tool-call arguments; a blank string is {})."""
JSONObjectString = NewType("JSONObjectString", dict[str, Any])
"""A string holding a JSON object, parsed (Responses call arguments; a blank string is {})."""


Base64Bytes = NewType("Base64Bytes", bytes)
"""A string of standard base64 (no whitespace or URL alphabet), structured as the bytes it encodes."""


def _base64_bytes(v: Any, _t: Any) -> bytes:
    if not isinstance(v, str):
        raise TypeError(f"expected a base64 string, got {json_kind(v)}")
    try:
        return base64.b64decode(v, validate=True)
    except ValueError:  # binascii.Error is a ValueError
        raise Invalid("is not valid base64 data") from None


IMAGE_MEDIA_TYPES = ("image/png", "image/jpeg", "image/webp")
"""The image types a request may declare (the serving side checks the bytes against them)."""


def data_url_image(url: str, *, param_at: str | None = None) -> tuple[str, bytes]:
    """A base64 data URL's declared media type and bytes; Invalid (naming `param_at`) for anything else."""
    if not url.startswith("data:"):
        raise Invalid("images must be base64 data URLs; remote image downloads are unsupported", param_at=param_at)
    head, _, data = url.partition(",")
    media = head[5:].split(";")[0]
    if media not in IMAGE_MEDIA_TYPES:
        raise Invalid(f"unsupported image type '{media}'; images must be base64 PNG, JPEG or WebP data URLs",
                      param_at=param_at)
    if ";base64" not in head:
        raise Invalid("images must be base64 PNG, JPEG or WebP data URLs", param_at=param_at)
    try:
        return media, base64.b64decode(data, validate=True)
    except ValueError:  # binascii.Error is a ValueError
        raise Invalid("invalid base64 image data", param_at=param_at) from None


def _nonempty_str(v: Any, _t: Any) -> str:
    if not isinstance(v, str) or not v:
        raise Invalid("must be a nonempty string")
    return v


def _json_object_text(v: Any, t: Any) -> dict[str, Any]:
    """The hook of `JSONObjectText` and `JSONObjectString` (`t`, the one structured)."""
    if isinstance(v, str):
        try:
            v = loads_strict(v) if v.strip() else {}
        except ValueError:  # JSONShapeError (too deep) too: the parser's RecursionError is one
            raise Invalid("must be a JSON object") from None
    elif t is JSONObjectString:
        raise Invalid("must be a JSON string")
    if not isinstance(v, dict):
        raise Invalid("must be a JSON object")
    return v


def _is_list(t: Any) -> bool:
    return get_origin(t) is list or t is list


def _is_literal(t: Any) -> bool:
    return get_origin(t) is Literal


def _is_union(t: Any) -> bool:
    return get_origin(t) in (Union, UnionType)


def _is_tagged_union(t: Any) -> bool:
    return _is_union(t) and all(attrs.has(a) for a in get_args(t))


def _is_class(t: Any) -> bool:
    return isinstance(t, type) and attrs.has(t)


def _built_from(t: Any) -> Any:
    """The wire shape of ``Annotated[Built, From(wire)]``; None for any other type."""
    return next((meta.wire for meta in getattr(t, "__metadata__", ()) if isinstance(meta, From)), None)


def one_of_text(values: Sequence[Any]) -> str:
    quoted = [repr(v) for v in values]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _field_types(cls: type) -> dict[str, Any]:
    return {f.name: f.type for f in attrs.fields(attrs.resolve_types(cls))}


def _tag_of(members: tuple[Any, ...]) -> str:
    """The field every member declares as a Literal: the union's tag."""
    for name in attrs.fields_dict(members[0]):
        if all(_is_literal(_field_types(m).get(name)) for m in members):
            return name
    raise WireDeclarationError(f"no common Literal tag field in {members}")


def _member_type(t: Any) -> Any:
    """The Python type of a kind union member's JSON values (its key in `JSON_KINDS`)."""
    base = t.__supertype__ if isinstance(t, NewType) else _built_from(t)  # a checked leaf's, a built value's
    if base is not None:
        return _member_type(base)
    if _is_literal(t) and all(isinstance(a, str) for a in get_args(t)):
        return str
    if _is_list(t):
        return list
    if _is_class(t) or _is_tagged_union(t) or get_origin(t) is dict:
        return dict
    if t in JSON_KINDS:
        return t
    raise WireDeclarationError(f"no JSON kind for {t}")


_LEAVES: dict[Any, Callable[[Any, Any], Any]] = {
    str: _exact(str), bool: _exact(bool), int: _exact(int), float: _exact(float), Any: _any,
    NonEmptyStr: _nonempty_str, JSONObjectText: _json_object_text, JSONObjectString: _json_object_text,
    Base64Bytes: _base64_bytes}


class WireConverter(cattrs.Converter):
    """The strict converter. Factories run at a type's first structuring, once every hook is
    registered: they look up their members' hooks then (wire types are not recursive). `detailed`
    collects the path of a failure (cattrs' detailed validation), at a cost: only for bad bodies."""

    def __init__(self, *, detailed: bool) -> None:
        super().__init__(forbid_extra_keys=True, detailed_validation=detailed)
        self._inline: dict[Callable[[Any, Any], Any], tuple[str, Any]] = {
            _LEAVES[t]: ("{w}.__class__ is {a}", t) for t in (str, bool, int)}
        """Hooks whose accepted values a fast function tests inline (calling the hook only to raise or
        convert): a test over ``{w}`` (the value, first read), ``{v}`` (it again) and ``{a}`` (the datum)."""
        self._inline[_json_object] = "{w}.__class__ is {a}", dict
        self._inline[_nonempty_str] = "{w}.__class__ is str and {v}", None
        for leaf, hook in _LEAVES.items():
            self.register_structure_hook(leaf, hook)
        self.register_structure_hook_func(lambda t: t == dict[str, Any], _json_object)
        for predicate, factory in ((_is_list, self.list_factory), (_is_literal, self.literal_factory),
                                   (_is_union, self.kind_factory), (_is_tagged_union, self.tagged_factory),
                                   (_is_class, self.class_hook),
                                   (_built_from, lambda t: self.get_structure_hook(_built_from(t)))):
            self.register_structure_hook_factory(predicate, factory)  # a later one wins: tagged unions

    def list_factory(self, t: Any) -> Callable[[Any, Any], list[Any]]:
        """cattrs' list hook (the detailed one collects every failing element, each with its index)
        for an array only; the fast converter's own hook for a list of tagged-union members."""
        elem = next(iter(get_args(t)), Any)  # a bare list's: Any
        elem = _built_from(elem) or elem
        structure_list = list_structure_factory(t, self)
        # The fast converter's hot path (messages, parts, items): a tagged-union element's hook looked up
        # by its tag; anything wrong raises (an absent tag too, unless a member takes it), and `structure`
        # finds it again in detail.
        fast_tagged = not self.detailed_validation and _is_tagged_union(elem)
        tag, by_tag = self.tagged_members(elem) if fast_tagged else ("", None)

        def hook(v: Any, _t: Any) -> list[Any]:
            # A string is not a list of characters, and an object is not a list of its keys.
            if type(v) is not list:
                raise TypeError(f"expected an array, got {json_kind(v)}")
            if by_tag is None:
                return structure_list(v, t)  # type: ignore[no-any-return]
            out: list[Any] = []
            for x in v:  # a loop: a comprehension's own function costs more on these short lists
                out.append(by_tag[x.get(tag, ABSENT)](x, elem))
            return out

        return hook

    def tagged_members(self, t: Any) -> tuple[str, dict[object, Callable[[Any, Any], Any]]]:
        """A tagged union's tag and, for each tag value, its member's hook (under `ABSENT`, the hook
        of the member whose tag has a default: taken when the tag is absent, not when null); a
        `REFUSED` member's hook raises its 400."""
        tag = _tag_of(get_args(t))
        by_tag: dict[object, Callable[[Any, Any], Any]] = {}
        for m in get_args(t):
            refusal = getattr(m, REFUSED, None)
            hook = functools.partial(_refuse, refusal, tag) if refusal else self.class_hook(m, checked=tag)
            by_tag.update(dict.fromkeys(get_args(_field_types(m)[tag]), hook))
            if attrs.fields_dict(m)[tag].default is not attrs.NOTHING:
                by_tag[ABSENT] = hook
        return tag, by_tag

    def tagged_factory(self, t: Any) -> Callable[[Any, Any], Any]:
        tag, by_tag = self.tagged_members(t)
        expected = one_of_text([value for m in get_args(t) if not hasattr(m, REFUSED)
                                for value in get_args(_field_types(m)[tag])])

        def hook(v: Any, _t: Any) -> Any:
            if type(v) is not dict:
                raise TypeError(f"expected an object, got {json_kind(v)}")
            value = v.get(tag)
            found = by_tag.get(value) if type(value) is str else by_tag.get(ABSENT) if tag not in v else None
            if found is None:
                raise Invalid(f"is required; expected {expected}" if value is None else
                              f"{value!r} is not supported; expected {expected}", at=tag)
            return found(v, t)

        return hook

    def literal_factory(self, t: Any) -> Callable[[Any, Any], Any]:
        allowed = {(type(a), a) for a in get_args(t)}
        reason = f"must be {one_of_text(get_args(t))}"

        def hook(v: Any, _t: Any) -> Any:
            if (type(v), v) not in allowed:
                raise Invalid(reason)
            return v

        if all(type(a) is str for a in get_args(t)):
            self._inline[hook] = "{w}.__class__ is str and {v} in {a}", frozenset(get_args(t))
        return hook

    def kind_factory(self, t: Any) -> Callable[[Any, Any], Any]:
        """Members picked by the value's Python type (what json.loads made of it)."""
        table: dict[type, list[Any]] = {}
        for m in get_args(t):
            table.setdefault(_member_type(m), []).append(m)
        if len(table.get(dict, ())) > 1:  # several object shapes: one tagged union
            table[dict] = [Union[tuple(table[dict])]]  # noqa: UP007 - built at run time
        expected = " or ".join(JSON_KINDS[k][1] for k in table)
        as_is = {k for k, ms in table.items() if ms[0] in (NoneType, bool, int, str, dict[str, Any])}
        by_type = {k: (ms[0], _any if k is NoneType else self.get_structure_hook(ms[0])) for k, ms in table.items()}
        if float in by_type:
            by_type.setdefault(int, by_type[float])
        arrays = table.get(list, [])
        by_elem = {} if len(arrays) < 2 else {_member_type(get_args(m)[0]): (m, self.get_structure_hook(m))
                                              for m in reversed(arrays)}

        def hook(v: Any, _t: Any) -> Any:
            tp = type(v)
            if tp in as_is:
                return v
            found = by_type.get(tp)
            if found is None:
                raise TypeError(f"expected {expected}, got {json_kind(v)}")
            if by_elem and tp is list and v:  # arrays of different elements: the first element decides
                found = by_elem.get(type(v[0]), found)
            return found[1](v, found[0])

        if as_is:
            self._inline[hook] = "{w}.__class__ in {a}", frozenset(as_is)
        return hook

    def class_hook(self, t: Any, checked: str | None = None) -> Callable[[Any, Any], Any]:
        """An attrs class's hook: unknown keys refused (ignored where the class is `lenient`), then
        its ignored and refused fields screened. `checked` names a field already validated (a tagged
        union's tag), structured as is; a union member's value is an object (the union checked it),
        any other class's value is checked here."""
        hooks: dict[str, Callable[[Any, Any], Any]] = {} if checked is None else {checked: _any}
        hints = _field_types(t)
        for name, row in policy_rows(t).items():
            if row.kind != "honoured":
                hooks[name] = self._screened(hints[name], name, row)
        forbid = not getattr(t, LENIENT, False)
        build: Callable[..., Any] | None = getattr(t, BUILD, None)
        takes = () if build is None else inspect.signature(build).parameters  # the builder's fields
        if not self.detailed_validation:  # a non-member's object check is in the function
            return self._fast_class_fn(t, hooks, forbid, build, takes, check_object=checked is None)
        overrides: dict[str, Any] = {name: override(struct_hook=h) for name, h in hooks.items()}
        instance_fn = make_dict_structure_fn(t, self, _cattrs_forbid_extra_keys=forbid, **overrides)
        names = [(f.alias, f.name) for f in attrs.fields(t) if f.alias in takes]

        def detailed(v: Any, _t: Any) -> Any:  # the instance, or the value a builder makes of its fields
            if checked is None and type(v) is not dict:
                raise TypeError(f"expected an object, got {json_kind(v)}")
            instance = instance_fn(v, t)
            value = None if build is None else build(**{alias: getattr(instance, name) for alias, name in names})
            return instance if value is None else value

        return detailed

    def _fast_class_fn(self, t: Any, hooks: Mapping[str, Callable[[Any, Any], Any]], forbid: bool,
                       build: Callable[..., Any] | None, takes: Container[str],
                       check_object: bool) -> Callable[[Any, Any], Any]:
        """The fast converter's function for attrs class `t`: one generated call of `t` with each
        key's value structured by its field's hook (`hooks` first) or its default where absent,
        unknown keys refused where `forbid`. It accepts exactly what cattrs' detailed function
        accepts, without that one's bookkeeping: the tag (`_any`) is passed as is and the leaves,
        literals and kind unions of `_inline` are tested inline, calling their hook only to raise or
        convert. A class that `BUILD`s its value calls `build` instead of the class, with the fields it
        `takes` (the others are structured for their errors only); `check_object` tests that the
        value is an object."""
        globs: dict[str, Any] = {"cls": t, "build": build, "allowed": frozenset(f.name for f in attrs.fields(t)),
                                 "ForbiddenExtraKeysError": ForbiddenExtraKeysError, "json_kind": json_kind}
        lines = ["def structure(o, _t):"]
        if check_object:
            lines.append("    if o.__class__ is not dict: raise TypeError('expected an object, got ' + json_kind(o))")
        if forbid:
            lines.append("    if not o.keys() <= allowed: raise ForbiddenExtraKeysError('', cls, set(o) - allowed)")
        fields = attrs.fields(attrs.resolve_types(t))
        values: list[str] = []  # each field's value: its expression, or a builder's class's local
        for k, f in enumerate(fields):
            key = repr(f.name)  # the JSON key, as cattrs reads it; `alias` is the init argument
            value = self._value_code(k, key, hooks.get(f.name) or self.get_structure_hook(f.type), f.type, globs)
            if f.default is not attrs.NOTHING:
                factory = isinstance(f.default, attrs.Factory)  # type: ignore[arg-type]
                globs[f"d{k}"] = f.default.factory if factory else f.default
                value = f"({value} if {key} in o else d{k}{'()' if factory else ''})"
            if build is not None:  # every field first, taken or not: for its errors and the instance
                lines.append(f"    f{k} = {value}")
                value = f"f{k}"
            values.append(value)
        instance = f"cls({', '.join(f'{f.alias}={v}' for f, v in zip(fields, values, strict=True))})"
        if build is None:
            lines.append(f"    return {instance}")
        else:
            taken = ", ".join(f"{f.alias}={v}" for f, v in zip(fields, values, strict=True) if f.alias in takes)
            lines += [f"    value = build({taken})", f"    return value if value is not None else {instance}"]
        exec(compile("\n".join(lines), f"<wire structure {t.__qualname__}>", "exec"), globs)
        return cast("Callable[[Any, Any], Any]", globs["structure"])

    def _value_code(self, k: int, key: str, hook: Callable[[Any, Any], Any], tp: Any, globs: dict[str, Any]) -> str:
        """The expression of field `k`'s value (JSON key `key`) in a fast function, its names in `globs`."""
        globs[f"h{k}"], globs[f"t{k}"] = hook, tp
        if hook is _any:
            return f"o[{key}]"
        if hook in self._inline:
            test, globs[f"a{k}"] = self._inline[hook]
            return f"(v{k} if {test.format(w=f'(v{k} := o[{key}])', v=f'v{k}', a=f'a{k}')} else h{k}(v{k}, t{k}))"
        return f"h{k}(o[{key}], t{k})"

    def _screened(self, tp: Any, name: str, row: FieldPolicy) -> Callable[[Any, Any], Any]:
        """An ignored or refused field's hook: its value structured, then screened by its row (the
        field's hook runs only where the key is present: an absent field costs nothing)."""
        structure_value = self.get_structure_hook(tp)

        def hook(v: Any, _t: Any) -> Any:
            value = structure_value(v, tp)
            try:
                row.screen(name, value)  # null: dropped, or refused (`refuse_null`)
            except BadRequest as exc:
                raise Invalid(exc.message, details=exc.error_details) from None
            return value

        return hook


def _refuse(refusal: str | Callable[[str], Invalid], tag: str, v: Any, _t: Any) -> Any:
    """A `REFUSED` tagged-union member's hook: its 400 for the tag's value."""
    raise refusal(v[tag]) if callable(refusal) else Invalid(refusal.format(value=v[tag]), at=tag)


FAST = WireConverter(detailed=False)
DETAILED = WireConverter(detailed=True)


def all_built(values: list[Any], types: tuple[type, ...]) -> tuple[Any, ...] | None:
    """`values` (a list of built values and kept instances) where every one is of the built `types`;
    None where one was kept, to be completed with context (a builder's test for its own value)."""
    for v in values:
        if type(v) not in types:
            return None
    return tuple(values)


def register_leaf(t: Any, hook: Callable[[Any, Any], Any]) -> None:
    """A protocol's own leaf type (a `NewType`) and its check, on both converters."""
    for converter in (FAST, DETAILED):
        converter.register_structure_hook(t, hook)


def parse_json_object(body: bytes, limits: Sequence[CountLimit] = ()) -> dict[str, Any]:
    """A request body as a JSON object (`loads_strict` with the route's item counts, `limits`),
    checked at the edge before anything else reads it; a 400 for anything else."""
    if not body:
        raise BadRequest("the request body is empty; expected a JSON object")
    try:
        return loads_strict(body, limits)  # type: ignore[no-any-return]
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors; JSONShapeError a 400
        raise exc if isinstance(exc, JSONShapeError) else BadRequest(f"malformed JSON body: {exc}") from None


MAX_JSON_DEPTH = 64
"""Arrays and objects nested in one JSON document (a request body, or a JSON string inside one such as
tool-call arguments), the document itself counting as one. Far below what every recursive consumer
(the chat template's `_plain` and `_container_ids`, Jinja's `tojson`, `json.dumps`) can take."""


class JSONShapeError(BadRequest, ValueError):
    """A JSON document nested deeper than MAX_JSON_DEPTH, or with a string (a key or a value) that is
    not a sequence of Unicode scalar values (a lone surrogate such as "\\ud800"); `param` names where.
    A request body's 400 as it is; a ValueError to `loads_strict`'s callers (JSON inside a body)."""


def loads_strict(text: str | bytes, limits: Sequence[CountLimit] | None = None) -> Any:
    """json.loads without Python's extensions: NaN, ±Infinity and numbers that overflow to an
    infinite float are not JSON (RFC 8259) and could not be written back out; ValueError. It parses
    through one shared decoder (json.loads would build one per call for its keyword arguments).
    Every decoded document then passes the one document check: nesting at most MAX_JSON_DEPTH and
    only Unicode scalar text, keys included (JSONShapeError, a ValueError, naming its first problem
    in document order). With `limits`, the text is a request body: a JSON object (else BadRequest)
    whose item counts are checked first (`check_counts`: cheap)."""
    if not isinstance(text, str):
        text = text.decode(json.detect_encoding(text), "surrogatepass")
    try:
        obj = _DECODER.decode(text)
    except RecursionError:  # the parser recurses per level: far past MAX_JSON_DEPTH
        raise _too_deep("") from None
    if limits is not None:
        if not isinstance(obj, dict):
            raise BadRequest("the request body must be a JSON object")
        check_counts(obj, limits)
    found = _first_problem([obj], 0)  # the document as the one item of a list, below any depth limit
    if found is not None:
        error, *steps, _ = found  # `_`: the wrapping list's index
        raise error(functools.reduce(_join, reversed(steps), ""))
    return obj


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
        *parents, field = limit.path.split("[].")
        level: list[tuple[Any, str]] = [(obj, "")]
        for name in parents:
            level = [(item, f"{here}[{i}]") for here, items in _arrays(level, name) for i, item in enumerate(items)]
        for here, items in _arrays(level, field):
            if len(items) > limit.max_items:
                raise BadRequest(f"'{here}' has {len(items)} items; at most {limit.max_items} are accepted", param=here)


def _arrays(level: list[tuple[Any, str]], name: str) -> Iterator[tuple[str, list[Any]]]:
    """The arrays under key `name` of the objects in `level` (each with its path), with their paths."""
    for container, where in level:
        if isinstance(container, dict) and isinstance(container.get(name), list):
            yield (f"{where}.{name}" if where else name), container[name]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} is out of range for a JSON number")
    return value


_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


def structure(obj: Any, cls: type[T], *, at: str = "",
              failure: Callable[[BaseException], Exception] | None = None) -> T:
    """`obj` as `cls`, or the BadRequest naming the path of its first bad value (below `at`, the
    path of `obj` itself where it is not the whole body). A route with its own error shape passes
    `failure`: it maps cattrs' detailed error (the tree of every failure found, each with its
    path in the notes) to the exception raised instead."""
    try:
        return FAST.structure(obj, cls)
    except Exception as fast_error:  # structure it again, collecting where it failed
        try:
            DETAILED.structure(obj, cls)
        except Exception as exc:  # every failure here is the client's
            raise (_bad_request(exc, at) if failure is None else failure(exc)) from None
        raise fast_error


def _bad_request(exc: BaseException, path: str = "") -> BadRequest:
    """The first leaf error as a 400 whose param is its path (``messages[2].content[0].text``)."""
    while isinstance(exc, ClassValidationError | IterableValidationError) and exc.exceptions:
        exc = exc.exceptions[0]
        path = _join(path, _note_of(exc))
    if isinstance(exc, ForbiddenExtraKeysError):
        keys = sorted(exc.extra_fields)
        return BadRequest(f"unrecognized request argument(s): {', '.join(keys)}" + (f" in {path}" if path else ""),
                          param=_join(path, keys[0]))
    if isinstance(exc, Invalid):
        path = _join(path, exc.at)
        sep = " " if exc.reason.startswith(("must ", "is ")) else ": "  # a predicate, or a statement
        message = f"{path or 'the request'}{sep}{exc.reason}"
        return BadRequest(message, param=exc.param or _join(path, exc.param_at) or None, details=exc.details)
    if isinstance(exc, KeyError):
        return BadRequest(f"missing required parameter: {path}", param=path or None)
    if isinstance(exc, TypeError | ValueError):
        return BadRequest(f"invalid value for {path or 'request'}: {exc}", param=path or None)
    raise exc  # not the client's error


def _join(path: str, step: str | int | None) -> str:
    if step is None:
        return path
    if isinstance(step, int):
        return f"{path}[{step}]"
    return f"{path}.{step}" if path else step


def _note_of(exc: BaseException) -> str | int | None:
    """The attribute or index where cattrs' detailed converter noted `exc`."""
    for note in getattr(exc, "__notes__", ()):
        if isinstance(note, AttributeValidationNote | IterableValidationNote):
            return note.name if isinstance(note, AttributeValidationNote) else note.index
    return None


_SURROGATE = re.compile("[\ud800-\udfff]")


def _is_scalar_text(text: str) -> bool:
    return text.isascii() or _SURROGATE.search(text) is None


def _first_problem(value: dict[str, Any] | list[Any], depth: int) -> list[Any] | None:
    """The first problem in a container (`depth` levels deep), in document order: None, or the
    constructor of its JSONShapeError followed by the path's steps below `value`, innermost first
    (each level appends its step, looked up only once a problem is found: a valid document builds no
    paths). Recursive, but at most MAX_JSON_DEPTH levels: deeper is the problem."""
    if depth > MAX_JSON_DEPTH:
        return [_too_deep]
    if type(value) is dict:
        for key in value:
            if not _is_scalar_text(key):
                return [_text_error, "<key>"]
        items: Any = value.values()
    else:
        items = value
    found: list[Any] | None
    for item in items:
        kind = type(item)
        if kind is str:
            if _is_scalar_text(item):
                continue
            found = [_text_error]
        elif kind is dict or kind is list:
            found = _first_problem(item, depth + 1)
            if found is None:
                continue
        else:
            continue
        pairs = value.items() if type(value) is dict else enumerate(value)
        found.append(next(step for step, v in pairs if v is item))
        return found
    return None


def _too_deep(where: str) -> JSONShapeError:
    field = re.split(r"[.\[]", where, maxsplit=1)[0] or None  # the top-level field it is under
    return JSONShapeError(f"{f'{field!r}' if field else 'the JSON document'} is nested more than {MAX_JSON_DEPTH} "
                          f"levels deep (arrays and objects); at most {MAX_JSON_DEPTH} are accepted", param=field)


def _text_error(where: str) -> JSONShapeError:
    return JSONShapeError(f"{where or 'the JSON document'} is not valid Unicode text: it contains a lone UTF-16 "
                          "surrogate (an unpaired \\ud800-\\udfff escape)", param=where or None)
