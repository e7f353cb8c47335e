"""System One image assets without a model: multipart parsing, assets, references, rejections."""

from __future__ import annotations

import base64
import io
from typing import Any

import pytest
from PIL import Image

from helios.errors import BadRequest
from helios.frontends.decisions.multipart import FormPart, parse_form_data
from helios.frontends.decisions.systemone import decode_systemone
from helios.serving.decisions import _with_images


def _png(color: tuple[int, int, int] = (1, 2, 3)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buf, format="PNG")
    return buf.getvalue()


def _jpeg() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (9, 9, 9)).save(buf, format="JPEG")
    return buf.getvalue()


PNG, JPEG = _png(), _jpeg()
B64 = base64.b64encode(PNG).decode()


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "state": {"photo": "receipt", "note": "see receipt and receipt2"},
            "questions": {"q": {"type": "score", "instructions": "How bad is receipt?",
                                "criteria": ["fine", "receipt2 shows damage"]}}, **kw}


ASSETS = {"receipt": {"type": "image", "format": "png", "data_base64": B64},
          "receipt2": {"format": "jpeg", "data_base64": base64.b64encode(JPEG).decode()}}


def decode(obj: dict[str, Any], parts: list[FormPart] | None = None, **kw: Any) -> Any:
    opts = {"model": "tiny-vlm", "vision": True, "danger_zone": True, **kw}
    return decode_systemone(obj, parts=parts or [], **opts)


def message(obj: dict[str, Any], parts: list[FormPart] | None = None, **kw: Any) -> str:
    with pytest.raises(BadRequest) as info:
        decode(obj, parts, **kw)
    return str(info.value)


def test_references_replace_values_whole_first_then_left_to_right() -> None:
    plan = decode(body(assets=ASSETS))
    markers = dict(plan.images)
    (m1, img1), (m2, img2) = plan.images
    assert img1.media_type == "image/png" and img1.data == PNG and img1.where == "assets.receipt"
    assert img2.media_type == "image/jpeg" and img2.data == JPEG
    # "receipt" is a whole value; in "see receipt and receipt2" the longer reference wins at its position
    assert f'"photo": "{m1}"' in plan.state and f"see {m1} and {m2}" in plan.state
    (q,) = plan.questions
    assert q.question.instructions == f"How bad is {m1}?"
    assert q.question.options == ("fine", f"{m2} shows damage")
    assert q.levels == ("fine", "receipt2 shows damage")  # the legend keeps the original reference
    parts = _with_images(f"State:\n{plan.state}", markers)
    assert [type(p).__name__ for p in parts] == ["TextPart", "ImagePart", "TextPart", "ImagePart", "TextPart",
                                                 "ImagePart", "TextPart"]


def test_choice_keys_remain_text() -> None:
    obj = {"model": "m", "state": "look at img", "assets": {"img": {"data_base64": B64}},
           "questions": {"c": {"type": "choice", "criteria": {"img": "the img itself", "other": None}}}}
    plan = decode(obj)
    ((marker, _),) = plan.images
    (q,) = plan.questions
    assert q.keys == ("img", "other")
    assert q.question.options == (f"img — the {marker} itself", "other")


def test_marker_cannot_be_forged() -> None:
    a, b = decode(body(assets=ASSETS)), decode(body(assets=ASSETS))
    assert dict(a.images).keys().isdisjoint(dict(b.images).keys())


def test_header_and_vision_are_required() -> None:
    assert message(body(assets=ASSETS), danger_zone=False) == (
        "image assets require the TypeSafe-Danger-Zone-Images: true header")
    assert message(body(assets=ASSETS), vision=False) == "model tiny-vlm does not accept image input (it is text-only)"


@pytest.mark.parametrize(("assets", "expected"), [
    ([{"name": "img"}], "assets must be a nonempty object that maps each reference to an image asset"),
    ({"receipt": {"data_base64": B64}, "receipt2": {"data_base64": B64}, "unused": {"data_base64": B64}},
     "asset 'unused' is not referenced by the state, instructions or criteria; unused assets are rejected"),
    ({"receipt": {"data_base64": "!!"}, "receipt2": {"data_base64": B64}},
     "assets.receipt.data_base64 is not valid base64"),
    ({"receipt": {"data_base64": base64.b64encode(b"GIF89a....").decode()}},
     "assets.receipt is not PNG or JPEG data; System One image assets are PNG or JPEG"),
    ({"receipt": {"format": "gif", "data_base64": B64}}, "assets.receipt.format must be png or jpeg"),
    ({"receipt": {"type": "box", "data_base64": B64}}, "assets.receipt: only image assets are supported, not 'box'"),
    ({"receipt": {"url": "https://x"}}, "assets.receipt: unknown field(s) url; an image asset has type, format, "
                                         "data_base64 or part"),
    ({"receipt": {}}, "assets.receipt needs data_base64 (a base64 string) or a multipart part"),
    ({"": {"data_base64": B64}}, "asset references must be nonempty strings"),
])
def test_asset_rejections(assets: Any, expected: str) -> None:
    assert message(body(assets=assets)) == expected


def test_parts_take_precedence_and_each_belongs_to_one_asset() -> None:
    parts = [FormPart("a", "image/png", _png((7, 7, 7))), FormPart("b", "image/jpeg", JPEG)]
    assets = {"receipt": {"part": "a", "data_base64": B64}, "receipt2": {"part": "b"}}
    plan = decode(body(assets=assets), parts)
    assert [img.data for _, img in plan.images] == [parts[0].data, JPEG]
    assert message(body(assets={"receipt": {"part": "a"}, "receipt2": {"part": "a"}}), parts) == (
        "multipart part 'a' belongs to both assets 'receipt' and 'receipt2'; every part must belong to exactly "
        "one asset")
    assert message(body(assets={"receipt": {"part": "a"}, "receipt2": {"data_base64": B64}}), parts) == (
        "multipart part 'b' belongs to no asset; every part must belong to exactly one asset")
    assert message(body(assets={"receipt": {"part": "zz"}}), parts) == (
        "assets.receipt.part names 'zz', which is not a part of this multipart body")
    assert message(body(assets=ASSETS), [parts[0], FormPart("a", "", JPEG)]) == (
        "multipart part names must be unique; 'a' repeats")


def test_without_assets_nothing_changes() -> None:
    plan = decode_systemone(body())
    assert plan.images == () and plan.state.startswith("{")


def _multipart(*parts: tuple[str, str, bytes], boundary: str = "XyZ") -> tuple[bytes, str]:
    out = b""
    for name, ctype, data in parts:
        out += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"{name}.bin\"\r\n"
                f"Content-Type: {ctype}\r\n\r\n").encode() + data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode(), f'multipart/form-data; boundary="{boundary}"'


def test_parse_form_data() -> None:
    raw, ctype = _multipart(("request", "application/json; charset=utf-8", b'{"a": 1}'), ("img", "image/png", PNG))
    parts = parse_form_data(b"preamble\r\n" + raw, ctype)
    assert [(p.name, p.content_type, p.data) for p in parts] == [
        ("request", "application/json", b'{"a": 1}'), ("img", "image/png", PNG)]


@pytest.mark.parametrize(("raw", "ctype", "expected"), [
    (b"--x\r\n\r\n{}\r\n--x--", "multipart/form-data; boundary=x",
     "multipart part 1 needs Content-Disposition: form-data with a name"),
    (b"--x\r\nContent-Disposition: form-data; name=a\r\n\r\n{}", "multipart/form-data; boundary=x",
     "the multipart body ends without its closing boundary"),
    (b"{}", "multipart/form-data; boundary=x", "the multipart body has no opening boundary"),
    (b"--x--", "multipart/form-data", "multipart/form-data needs a boundary parameter of 1 to 70 characters"),
    (b"--x--", "multipart/mixed; boundary=x", "multipart bodies must be multipart/form-data, not multipart/mixed"),
])
def test_parse_form_data_rejections(raw: bytes, ctype: str, expected: str) -> None:
    with pytest.raises(BadRequest) as info:
        parse_form_data(raw, ctype)
    assert str(info.value) == expected
