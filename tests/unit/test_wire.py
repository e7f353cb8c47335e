"""Strict JSON and strict structuring shared by every protocol decoder."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from helios.errors import BadRequest
from helios.frontends.wire import loads_strict, parse_json_object, structure


@pytest.mark.parametrize("body", [b'{"a": Infinity}', b'{"a": -Infinity}', b'{"a": NaN}', b'{"a": 1e999}',
                                  b'{"a": [1, -1e400]}', b"[1]", b"", b"\xff", b"{"])
def test_non_json_bodies_are_bad_requests(body: bytes) -> None:
    with pytest.raises(BadRequest):
        parse_json_object(body)


def test_loads_strict_keeps_ordinary_numbers() -> None:
    assert loads_strict('{"a": 1.5e300, "b": -0.0, "c": 12}') == {"a": 1.5e300, "b": -0.0, "c": 12}


@attrs.frozen
class Wire:
    n: int | None = None
    names: list[str] | None = None
    t: float | None = None
    any_value: Any = None


@pytest.mark.parametrize("obj, param", [
    ({"n": "3"}, "n"), ({"n": True}, "n"), ({"n": 1.0}, "n"), ({"t": "0.5"}, "t"), ({"t": False}, "t"),
    ({"names": "abc"}, "names"), ({"names": ["a", 1]}, "names"), ({"extra": 1}, "extra"),
])
def test_structure_is_strict(obj: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as err:
        structure(obj, Wire)
    assert err.value.param is not None and err.value.param.startswith(param)


def test_structure_accepts_valid_values() -> None:
    assert structure({"n": 3, "names": ["a"], "t": 1, "any_value": {"x": [1]}}, Wire) == Wire(3, ["a"], 1.0, {"x": [1]})
