"""serving/images.py: validation of image bytes under limits, the spec's budgets and messages, caches.

The vision profile here is a test double: a pure function of the image size (64-pixel tiles of 16
patches, four patches merged into one token), which is all the serving side's budget logic asks of
a family's profile."""

from __future__ import annotations

import io
import math
import random
import struct
import threading
import zlib
from typing import Any

import pytest
from PIL import Image

from helios.config import VisionSection
from helios.domain.conversation import ImagePart
from helios.domain.images import ImageCost, VisionLimits
from helios.errors import BadRequest
from helios.serving.images import (
    ByteLRU,
    ImageAdmission,
    ImageStore,
    derive_limits,
    sniff,
)


class TileProfile:
    """64-pixel tiles of 16 patches each; 4 patches merge into one token."""

    image_token = "<image>"
    settings_key = "tiles64-v1"
    max_image_tokens_per_image = 256

    def cost(self, width: int, height: int) -> ImageCost:
        rows, cols = math.ceil(height / 64), math.ceil(width / 64)
        patches = rows * cols * 16
        tokens = patches // 4
        return ImageCost(tokens=tokens, patches=patches, grid=(rows, cols),
                         prompt_text="<img>" + self.image_token * tokens + "</img>")


LIMITS = VisionLimits(max_images_per_prompt=4, max_image_tokens_per_prompt=300, image_feature_window_tokens=256,
                      max_image_tokens_per_image=256, max_image_pixels=600 * 600, max_image_bytes=200_000)


def admission(limits: VisionLimits = LIMITS, store: ImageStore | None = None) -> ImageAdmission:
    return ImageAdmission(model="tiny-vlm", profile=TileProfile(), limits=limits, store=store)


def encode(fmt: str, size: tuple[int, int] = (64, 64), color: Any = (200, 30, 40), mode: str = "RGB",
           **kw: Any) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format=fmt, **kw)
    return buf.getvalue()


def animated(fmt: str, frames: int = 3) -> bytes:
    imgs = [Image.new("RGB", (32, 32), (i * 60, 0, 0)) for i in range(frames)]
    buf = io.BytesIO()
    imgs[0].save(buf, format=fmt, save_all=True, append_images=imgs[1:], duration=50, loop=0)
    return buf.getvalue()


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def png_bomb(width: int, height: int) -> bytes:
    """A valid PNG header claiming width x height RGB pixels over a small, highly compressed IDAT."""
    row = b"\x00" + b"\x00" * (3 * width)
    body = zlib.compress(row * min(height, 4), 9)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + _chunk(b"IDAT", body) + _chunk(b"IEND", b""))


PNG = encode("PNG")
JPEG = encode("JPEG")
WEBP = encode("WEBP")


def part(data: bytes, media: str = "image/png", where: str = "") -> ImagePart:
    return ImagePart(media, data, where)


def rejected(parts: list[ImagePart], adm: ImageAdmission | None = None) -> str:
    with pytest.raises(BadRequest) as info:
        (adm or admission()).admit(parts, param="messages")
    assert info.value.status == 400
    return str(info.value)


# -- formats --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("data", "media"), [(PNG, "image/png"), (JPEG, "image/jpeg"), (WEBP, "image/webp")])
def test_accepted_formats(data: bytes, media: str) -> None:
    out = admission().admit([part(data, media)])
    (src,) = out.sources
    assert (src.index, src.media_type, src.width, src.height, src.byte_size) == (0, media, 64, 64, len(data))
    assert out.tokens == 4 and out.costs[0].patches == 16
    assert out.images[0].identity == f"{src.digest}:tiles64-v1"


def test_modes_and_sizes_report_the_decoded_size() -> None:
    adm = admission()
    out = adm.admit([part(encode("PNG", (100, 30), 7, mode="L")), part(encode("PNG", (5, 9), (1, 2, 3, 4), mode="RGBA"))])
    assert [(s.width, s.height) for s in out.sources] == [(100, 30), (5, 9)]
    assert [s.index for s in out.sources] == [0, 1]


def test_sniff() -> None:
    assert sniff(PNG) == "image/png" and sniff(JPEG) == "image/jpeg" and sniff(WEBP) == "image/webp"
    assert sniff(encode("GIF")) == "image/gif" and sniff(b"hello") is None and sniff(b"") is None


def test_declared_type_must_agree() -> None:
    msg = rejected([part(PNG, "image/png"), part(JPEG, "image/png", "messages[0].content[2]")])
    assert msg == "image 2 (at messages[0].content[2]) is declared image/png but its data is JPEG (image/jpeg)"


def test_other_formats_and_garbage() -> None:
    assert rejected([part(encode("GIF"), "image/png")]) == (
        "image 1 is image/gif data; images must be PNG, JPEG or static WebP")
    assert rejected([part(encode("BMP"), "image/png", "input[0].content[0]")]) == (
        "image 1 (at input[0].content[0]) is image/bmp data; images must be PNG, JPEG or static WebP")
    assert rejected([part(b"not an image at all")]) == (
        "image 1 is not image data this server can read; images must be PNG, JPEG or static WebP")
    assert rejected([part(b"")]) == "image 1 is empty"


@pytest.mark.parametrize(("fmt", "media", "name"), [("PNG", "image/png", "PNG"), ("WEBP", "image/webp", "WebP")])
def test_animated_images_are_rejected(fmt: str, media: str, name: str) -> None:
    msg = rejected([part(animated(fmt), media, "messages[1].content[0]")])
    assert msg == (f"image 1 (at messages[1].content[0]) is an animated {name} (3 frames); "
                   "animated images are unsupported")


@pytest.mark.parametrize(("data", "media", "name"), [(PNG, "image/png", "PNG"), (JPEG, "image/jpeg", "JPEG"),
                                                     (WEBP, "image/webp", "WebP")])
def test_truncated_data_is_rejected(data: bytes, media: str, name: str) -> None:
    buf = io.BytesIO()
    noise = Image.frombytes("RGB", (128, 128), random.Random(7).randbytes(128 * 128 * 3))
    noise.save(buf, format={"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP"}[media])
    big = buf.getvalue()
    # (Data cut after the last pixel, such as a PNG without IEND, decodes completely: accepted.)
    for cut in (len(big) // 2, len(big) - 200):
        msg = rejected([part(big[:cut], media)])
        assert msg.startswith(f"image 1 is corrupt or truncated {name} data: ") or msg.startswith(
            f"image 1 is not readable {name} data: "), msg


def test_corrupt_header_is_rejected() -> None:
    bad = bytearray(PNG)
    bad[20] ^= 0xFF  # inside IHDR: the chunk's CRC no longer matches
    assert rejected([part(bytes(bad))]).startswith("image 1 is not readable PNG data: ")


# -- limits on one image ---------------------------------------------------------------------------
def test_bytes_are_checked_before_decoding() -> None:
    limits = VisionLimits(4, 300, 256, 256, 600 * 600, 100)
    msg = rejected([part(b"\x89PNG" + b"\x00" * 500, where="messages[0].content[0]")], admission(limits))
    assert msg == "image 1 (at messages[0].content[0]) is 504 bytes encoded; max_image_bytes is 100"


def test_pixels_are_checked_before_any_pixel_is_decoded() -> None:
    store = ImageStore()
    adm = admission(store=store)
    msg = rejected([part(png_bomb(20000, 20000))], adm)
    assert msg == "image 1 is 20000x20000 = 400000000 pixels; max_image_pixels is 360000"
    assert store.decoded_images == 0 and store.rejected_images == 1


def test_the_configured_pixel_limit_replaces_pillows() -> None:
    # Above twice pillow's MAX_IMAGE_PIXELS Image.open refuses a header; the plugins are opened
    # directly, so the message is ours, with the observed size, whatever pillow's global says.
    msg = rejected([part(png_bomb(100_000, 100_000))])
    assert msg == "image 1 is 100000x100000 = 10000000000 pixels; max_image_pixels is 360000"


def test_oversized_image_tokens() -> None:
    data = encode("PNG", (520, 520))
    msg = rejected([part(PNG), part(data, where="messages[2].content[0]")])
    assert msg == ("image 2 (at messages[2].content[0]) of 520x520 pixels costs 324 image tokens (1296 patches); "
                   "max_image_tokens_per_image is 256")


# -- budgets of the whole request -------------------------------------------------------------------
def test_image_count() -> None:
    assert rejected([part(PNG)] * 5) == "the request has 5 images; max_images_per_prompt is 4"


def test_prompt_budget_names_the_first_image_that_crossed() -> None:
    a = part(encode("PNG", (256, 256)), where="messages[0].content[0]")  # 64 tokens, 256 patches
    b = part(encode("PNG", (512, 320), (1, 2, 3)), where="messages[0].content[1]")  # 160 tokens, 640 patches
    c = part(encode("JPEG", (384, 256)), "image/jpeg", "messages[2].content[0]")  # 96 tokens, 384 patches
    d = part(encode("PNG", (64, 64), (9, 9, 9)), where="messages[3].content[0]")  # 4 tokens, 16 patches
    msg = rejected([a, b, c, d])
    assert msg == ("the request's 4 images cost 324 image tokens (patches: 256 + 640 + 384 + 16 = 1296), over "
                   "max_image_tokens_per_prompt 300; image 3 (at messages[2].content[0]), 384x256 pixels and 96 "
                   "tokens, is the first that crossed it")


def test_prompt_budget_single_image() -> None:
    limits = VisionLimits(4, 100, 256, 256, 600 * 600, 200_000)
    # 320x320 is 5x5 tiles = 100 tokens: exactly the budget, admitted.
    assert admission(limits).admit([part(encode("PNG", (320, 320)))]).tokens == 100
    msg = rejected([part(encode("PNG", (330, 320)))], admission(limits))
    assert msg == ("the request's 1 image cost 120 image tokens (patches: 480), over max_image_tokens_per_prompt "
                   "100; image 1, 330x320 pixels and 120 tokens, is the first that crossed it")


def test_within_budget() -> None:
    out = admission().admit([part(PNG), part(JPEG, "image/jpeg"), part(WEBP, "image/webp")])
    assert out.tokens == 12 and [s.index for s in out.sources] == [0, 1, 2]


# -- text-only --------------------------------------------------------------------------------------
def test_text_only_model_rejects_any_image() -> None:
    adm = ImageAdmission(model="tiny-text", profile=None, limits=LIMITS)
    assert adm.limits == VisionLimits() and not adm.accepts_images
    assert rejected([part(PNG)], adm) == "model tiny-text does not accept image input (it is text-only)"
    assert adm.admit([]).images == ()


def test_derived_limits() -> None:
    sec = VisionSection()
    assert derive_limits(sec, profile=None, max_model_len=4096, max_body_bytes=1 << 25) == VisionLimits()
    lim = derive_limits(sec, profile=TileProfile(), max_model_len=4096, max_body_bytes=1 << 20)
    assert lim == VisionLimits(max_images_per_prompt=4095 // 4, max_image_tokens_per_prompt=4095,
                               image_feature_window_tokens=256, max_image_tokens_per_image=256,
                               max_image_pixels=8192 * 4096, max_image_bytes=1 << 20)
    sec = VisionSection(max_images_per_prompt=3, max_image_tokens_per_prompt=10**6, max_image_tokens_per_image=100,
                        image_feature_window_tokens=128, max_image_pixels=1000, max_image_bytes=10)
    lim = derive_limits(sec, profile=TileProfile(), max_model_len=4096, max_body_bytes=1 << 20)
    assert lim == VisionLimits(3, 4095, 128, 100, 1000, 10)


# -- caches -----------------------------------------------------------------------------------------
def test_a_known_image_is_not_decoded_again() -> None:
    store = ImageStore()
    adm = admission(store=store)
    adm.admit([part(PNG)])
    adm.admit([part(PNG, where="messages[4].content[0]")])
    s = store.stats()
    assert s["input_decoded_images_total"] == 1
    assert s["input_source_cache_hits_total"] == 1 and s["input_source_cache_misses_total"] == 1
    # ... but its declared type is still checked against the bytes
    assert rejected([part(PNG, "image/jpeg")], adm).endswith("is declared image/jpeg but its data is PNG (image/png)")


def test_loaders_use_the_decoded_and_prepared_caches() -> None:
    store = ImageStore()
    adm = admission(store=store)
    (img,) = adm.admit([part(encode("PNG", (70, 40), (5, 6, 7)))]).images
    calls: list[tuple[int, int]] = []

    class Prepared:
        def __init__(self, size: tuple[int, int]) -> None:
            self.size, self.nbytes = size, 1000

    def prepare(image: Image.Image) -> Prepared:
        calls.append(image.size)
        return Prepared(image.size)

    load = store.prepared_loader(img, "tiles64-v1", prepare)
    first, second = load(), load()
    assert first is second and calls == [(70, 40)]
    assert store.loader(img)().getpixel((3, 3)) == (5, 6, 7)
    s = store.stats()
    assert s["input_decoded_images_total"] == 1 and s["input_prepared_images_total"] == 1
    assert s["input_prepared_cache_hits_total"] == 1 and s["input_prepared_cache_bytes"] == 1000
    # another settings key is another entry
    store.prepared_loader(img, "other", prepare)()
    assert len(calls) == 2


def test_an_evicted_image_is_decoded_again() -> None:
    store = ImageStore(decoded_bytes=0)
    (img,) = admission(store=store).admit([part(PNG)]).images
    assert store.loader(img)().size == (64, 64)
    assert store.stats()["input_decoded_images_total"] == 2


def test_byte_lru() -> None:
    lru: ByteLRU[str, int] = ByteLRU(10)
    lru.put("a", 1, 4)
    lru.put("b", 2, 4)
    assert lru.get("a") == 1  # a is now the most recent
    lru.put("c", 3, 4)  # evicts b
    assert lru.get("b") is None and lru.get("c") == 3 and lru.bytes == 8 and lru.evictions == 1
    lru.put("big", 4, 11)  # larger than the capacity: not kept
    assert lru.get("big") is None and lru.bytes == 8
    lru.put("a", 5, 2)  # replaced
    assert lru.get("a") == 5 and lru.bytes == 6


def test_admission_is_thread_safe() -> None:
    store = ImageStore(decoded_bytes=50_000)
    adm = admission(store=store)
    images = [part(encode("PNG", (64 + i, 64), (i, i, i))) for i in range(6)]
    errors: list[BaseException] = []

    def run() -> None:
        try:
            for _ in range(5):
                for p in images:
                    (img,) = adm.admit([p]).images
                    assert store.loader(img)().size == (img.source.width, img.source.height)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert store.decoded.bytes <= 50_000


@pytest.mark.parametrize("kw", [{}, {"lossless": True}])
def test_webp_size_is_read_before_pillow_allocates(kw: dict[str, Any]) -> None:
    from helios.serving.images import webp_size

    data = encode("WEBP", (300, 170), **kw)
    assert webp_size(data) == (300, 170)
    assert webp_size(animated("WEBP")) == (32, 32)
    small = admission(VisionLimits(4, 300, 256, 256, 299 * 170, 200_000))
    assert rejected([part(data, "image/webp")], small) == "image 1 is 300x170 = 51000 pixels; max_image_pixels is 50830"


def test_input_metrics_in_prometheus_and_json() -> None:
    from helios.obs.metrics import INPUT_EXPORTED, ServingMetrics

    assert set(INPUT_EXPORTED) == set(ImageStore().stats())
    m = ServingMetrics()
    snap = m.snapshot()
    assert all(snap[k] == 0 for k in INPUT_EXPORTED)  # text-only: zeros in JSON, nothing exported
    assert "flare_input_" not in m.prometheus()
    store = ImageStore()
    admission(store=store).admit([part(PNG)])
    m.input_stats = store.stats
    snap = m.snapshot()
    assert snap["input_decoded_images_total"] == 1 and snap["input_source_cache_misses_total"] == 1
    text = m.prometheus()
    assert "flare_input_decoded_images_total 1.0" in text and "# TYPE flare_input_decoded_cache_bytes gauge" in text


def test_jpeg_size_is_read_before_pillow_opens() -> None:
    from helios.serving.images import jpeg_size

    for kw in ({}, {"progressive": True}, {"quality": 5}):
        assert jpeg_size(encode("JPEG", (123, 45), **kw)) == (123, 45)
    assert jpeg_size(b"\xff\xd8\xff") is None and jpeg_size(PNG) is None
    small = admission(VisionLimits(4, 300, 256, 256, 100 * 44, 200_000))
    assert rejected([part(encode("JPEG", (123, 45)), "image/jpeg")], small) == (
        "image 1 is 123x45 = 5535 pixels; max_image_pixels is 4400")


def test_vision_config_section() -> None:
    from helios.config import ConfigError, load_config

    cfg = load_config(overrides={"vision": {"max_image_pixels": 1000, "decoded_cache_mib": 8}})
    assert cfg.vision.max_image_pixels == 1000 and cfg.vision.decoded_cache_mib == 8
    with pytest.raises(ConfigError):
        load_config(overrides={"vision": {"max_image_bytes": -1}})
    with pytest.raises(ConfigError):
        load_config(overrides={"vision": {"max_images": 3}})


def test_chat_usage_reports_image_tokens() -> None:
    from helios.domain.events import Usage
    from helios.domain.shapes import to_json
    from helios.frontends.openai.chat import usage_shape

    def usage_json(usage: Usage) -> Any:
        return to_json(usage_shape(usage))

    assert "multimodal_tokens" not in usage_json(Usage(10, 2))["prompt_tokens_details"]
    assert usage_json(Usage(100, 2, image_tokens=64))["prompt_tokens_details"] == {
        "cached_tokens": 0, "multimodal_tokens": {"image": 64}}


def test_multi_picture_jpeg_is_its_first_picture() -> None:
    buf = io.BytesIO()
    first, second = Image.new("RGB", (40, 30), (250, 0, 0)), Image.new("RGB", (40, 30), (0, 0, 250))
    first.save(buf, format="MPO", save_all=True, append_images=[second])
    store = ImageStore()
    (img,) = admission(store=store).admit([part(buf.getvalue(), "image/jpeg")]).images
    assert (img.source.media_type, img.source.width, img.source.height) == ("image/jpeg", 40, 30)
    assert store.loader(img)().getpixel((5, 5))[0] > 200
