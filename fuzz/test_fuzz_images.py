"""Image bytes fuzz (issue 16): whatever bytes a client sends as an image, admission either admits it
or raises BadRequest (a 400) — never another exception, never a decode of an oversized image.

Inputs: arbitrary bytes, valid PNG / JPEG / WebP (static and animated) with random bit flips, byte
insertions, deletions and truncations, and valid headers that claim huge sizes (decompression bombs),
each declared with a random media type. Examples: $HELIOS_FUZZ_EXAMPLES, or 300 per test.

Over HTTP, the same bytes go to Chat, Messages, Responses and System One on the tiny Idefics3 server
(tests/serving/tiny_vlm.py): every answer is a 200 or a 400, never a 5xx, and /health stays 200
($HELIOS_FUZZ_EXAMPLES, or 40 examples of four requests each).
"""

from __future__ import annotations

import base64
import io
import math
import os
import struct
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from helios.domain.conversation import ImagePart
from helios.domain.images import ImageCost, VisionLimits
from helios.errors import BadRequest
from helios.serving.images import ImageAdmission, ImageStore

EXAMPLES = os.environ.get("HELIOS_FUZZ_EXAMPLES")
FUZZ = settings(max_examples=int(EXAMPLES or 300), deadline=None, suppress_health_check=list(HealthCheck),
                derandomize=bool(os.environ.get("CI")))

MAX_PIXELS = 256 * 256


class Profile:
    image_token = "<image>"
    settings_key = "fuzz"
    max_image_tokens_per_image = 64

    def cost(self, width: int, height: int) -> ImageCost:
        tiles = math.ceil(width / 64) * math.ceil(height / 64)
        return ImageCost(tokens=4 * tiles, patches=16 * tiles, grid=(0, 0), prompt_text="")


ADMISSION = ImageAdmission(model="fuzz", profile=Profile(),
                           limits=VisionLimits(4, 128, 64, 64, MAX_PIXELS, 1 << 20),
                           store=ImageStore(decoded_bytes=4 << 20, prepared_bytes=0))


def _encode(fmt: str, size: tuple[int, int], mode: str, frames: int, seed: int) -> bytes:
    rnd = bytes((seed * 31 + i * 7) & 0xFF for i in range(size[0] * size[1] * len(mode)))
    imgs = [Image.frombytes(mode, size, rnd[i:] + rnd[:i]) for i in range(frames)]
    buf = io.BytesIO()
    if frames > 1 and fmt != "JPEG":
        imgs[0].save(buf, format=fmt, save_all=True, append_images=imgs[1:], duration=40)
    else:
        imgs[0].save(buf, format=fmt)
    return buf.getvalue()


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def _png_bomb(width: int, height: int) -> bytes:
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", zlib.compress(b"\x00" * 4096, 9)) + _chunk(b"IEND", b""))


valid_images = st.builds(
    _encode,
    st.sampled_from(["PNG", "JPEG", "WEBP"]),
    st.tuples(st.integers(1, 80), st.integers(1, 80)),
    st.sampled_from(["RGB", "L"]),
    st.sampled_from([1, 1, 1, 2]),
    st.integers(0, 255),
).filter(lambda b: len(b) > 0)
bombs = st.builds(_png_bomb, st.integers(1, 2**31 - 1), st.integers(1, 2**31 - 1))


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.one_of(valid_images, bombs)))
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "splice"]))
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[at:at + draw(st.integers(1, 16))]
        elif op == "truncate":
            del data[at:]
        else:
            data[at:at + 4] = draw(st.sampled_from([b"\xff\xff\xff\xff", b"\x00\x00\x00\x00", b"\x7f\xff\xff\xff"]))
    return bytes(data)


media_types = st.sampled_from(["image/png", "image/jpeg", "image/webp", "", "image/gif"])


def _admit(parts: list[ImagePart]) -> None:
    try:
        out = ADMISSION.admit(parts, param="messages")
    except BadRequest as exc:
        assert exc.status == 400 and str(exc)
        return
    for image in out.images:  # admitted: within every limit, and its pixels load
        s = image.source
        assert s.width * s.height <= MAX_PIXELS and image.cost.tokens <= 64
        assert ADMISSION.store.loader(image)().size == (s.width, s.height)
    assert out.tokens <= 128


@FUZZ
@given(st.binary(max_size=2048), media_types)
def test_arbitrary_bytes(data: bytes, media: str) -> None:
    _admit([ImagePart(media, data, "messages[0].content[0]")])


@FUZZ
@given(mutated(), media_types)
def test_mutated_images(data: bytes, media: str) -> None:
    _admit([ImagePart(media, data)])


@FUZZ
@given(st.lists(st.tuples(st.one_of(valid_images, mutated()), media_types), min_size=1, max_size=5))
def test_several_images(items: list[tuple[bytes, str]]) -> None:
    _admit([ImagePart(media, data, f"messages[{i}].content[0]") for i, (data, media) in enumerate(items)])


# -- over HTTP: a vision server never answers an image with a 5xx ------------------------------------
SERVER_FUZZ = settings(FUZZ, max_examples=int(EXAMPLES or 40))


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("transformers")
    from helios.config import VisionSection
    from tests.serving.tiny_vlm import VisionServer, build_checkpoint, serving_config

    checkpoint = build_checkpoint(tmp_path_factory.mktemp("fuzz-vlm"))
    srv = VisionServer(serving_config(checkpoint, vision=VisionSection(max_image_pixels=200 * 200),
                                      max_model_len=2048)).start()
    yield srv
    srv.stop()


def _bodies(data: bytes, media: str) -> list[tuple[str, dict[str, str], Any]]:
    enc = base64.b64encode(data).decode()
    url = f"data:{media or 'image/png'};base64,{enc}"
    return [
        ("/v1/chat/completions", {}, {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "?"}, {"type": "image_url", "image_url": {"url": url}}]}]}),
        ("/v1/messages", {"anthropic-version": "2023-06-01"}, {"model": "m", "max_tokens": 1, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": media or "image/png", "data": enc}}]}]}),
        ("/v1/responses", {}, {"model": "m", "max_output_tokens": 1, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": url}]}]}),
        ("/v1/systemone", {"TypeSafe-Danger-Zone-Images": "true"}, {
            "model": "m", "state": "img", "assets": {"img": {"data_base64": enc}},
            "questions": {"q": {"type": "choice", "criteria": {"a": None, "b": None}}}}),
    ]


@pytest.mark.slow
@SERVER_FUZZ
@given(data=st.one_of(valid_images, mutated(), st.binary(max_size=512)), media=media_types)
def test_http_image_bodies_never_get_a_5xx(vlm: Any, data: bytes, media: str) -> None:
    with httpx.Client(base_url=vlm.url, timeout=60) as http:
        for path, headers, body in _bodies(data, media):
            r = http.post(path, json=body, headers=headers)
            assert r.status_code < 500, (path, r.status_code, r.text)
            assert r.status_code in (200, 400), (path, r.status_code, r.text)
        assert http.get("/health").status_code == 200
