"""The one output serializer (`helios.domain.shapes`): field order, absent versus null, flattened
and nested shapes, and sequences, checked against hand-written JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

import pytest

from helios.domain.generation import StreamEvent
from helios.domain.shapes import OMIT, Opt, flat, shape, to_json


@shape
class Inner:
    type: Literal["inner"] = "inner"
    value: float | None


@shape
class Echo:
    a: int
    b: Opt[str | None] = OMIT


@shape
class Outer:
    id: str
    maybe: Opt[int] = OMIT
    inner: Inner | None
    items: list[Inner]
    raw: Sequence[int]
    echo: Echo = flat()
    anything: Any = None
    tail: Opt[list[Inner]] = OMIT


def test_fields_in_order_absent_null_flat_and_nested() -> None:
    o = Outer(id="x", inner=None, items=[Inner(value=1.5), Inner(value=None)], raw=b"\x00\xff", echo=Echo(a=1))
    assert json.dumps(to_json(o)) == (
        '{"id": "x", "inner": null, "items": [{"type": "inner", "value": 1.5}, {"type": "inner", "value": null}], '
        '"raw": [0, 255], "a": 1, "anything": null}')
    o.maybe, o.echo.b, o.tail = 0, None, []
    o.inner = Inner(value=2.0)
    o.anything = {"k": [Inner(value=3.0), (1, 2)], "n": None}
    assert list(to_json(o)) == ["id", "maybe", "inner", "items", "raw", "a", "b", "anything", "tail"]
    assert to_json(o)["anything"] == {"k": [{"type": "inner", "value": 3.0}, [1, 2]], "n": None}
    assert to_json(o)["b"] is None and to_json(o)["inner"] == {"type": "inner", "value": 2.0}


def test_writes_are_fresh_json_values() -> None:
    items = [Inner(value=1.0)]
    o = Outer(id="x", inner=None, items=items, raw=(1, 2), echo=Echo(a=1), anything={"k": [1]})
    first = to_json(o)
    first["items"].append("changed")
    first["anything"]["k"].append(2)
    assert to_json(o) == {"id": "x", "inner": None, "items": [{"type": "inner", "value": 1.0}], "raw": [1, 2],
                          "a": 1, "anything": {"k": [1]}}
    assert type(to_json(o)["raw"]) is list


def test_a_stream_event_writes_its_shape_and_passes_text_and_objects() -> None:
    assert StreamEvent(Echo(a=2, b="y"), "e").data == {"a": 2, "b": "y"}
    assert StreamEvent("[DONE]").data == "[DONE]"
    assert StreamEvent({"error": {"message": "m"}}).data == {"error": {"message": "m"}}


@shape(tag="tagged")
class Tagged:
    value: Opt[int] = OMIT
    inner: Inner | None = None


@shape
class TaggedChild(Tagged):
    extra: str


def test_a_tag_is_a_class_attribute_written_first_and_inherited() -> None:
    not_a_field: dict[str, Any] = {"type": "other"}
    with pytest.raises(TypeError):
        Tagged(**not_a_field)
    assert Tagged().type == "tagged" and TaggedChild(extra="e").type == "tagged"  # type: ignore[attr-defined]
    assert json.dumps(to_json(Tagged())) == '{"type": "tagged", "inner": null}'
    assert json.dumps(to_json(TaggedChild(value=3, inner=Inner(value=None), extra="e"))) == (
        '{"type": "tagged", "value": 3, "inner": {"type": "inner", "value": null}, "extra": "e"}')
    assert json.dumps(to_json(Inner(value=0.5))) == '{"type": "inner", "value": 0.5}'  # a field named type
