"""Image input on the serving side: validation under limits, the spec's image budgets, host caches.

Spec (api.md): "Images must be base64 PNG, JPEG, or static WebP data", "Animated images are
unsupported", the card's image limits, and "Admission costs every image before rejecting, so a budget
rejection (HTTP 400) states the whole request's image tokens against max_image_tokens_per_prompt,
with the patch counts in parentheses, and names the first image that crossed the budget with its
position, pixel size, and tokens. Oversized single images are rejected against
max_image_tokens_per_image or max_image_pixels with the observed size."

`ImageAdmission.admit` is the one entry point (docs/vision.md, "Image input and budgets"). For each
image, in prompt order:

1. ``max_image_bytes`` on the encoded size, before pillow sees a byte;
2. the media type from the bytes' signature (PNG, JPEG, WebP; anything else is rejected), which must
   agree with the type the client declared;
3. the header (``PIL.Image.open`` reads no pixels): width x height against ``max_image_pixels`` before
   any pixel is decoded (decompression bombs; pillow's own ``DecompressionBombError`` is caught too),
   and more than one frame (APNG, animated WebP) is rejected;
4. a full decode (``Image.load``): corrupt or truncated data is found only so. This runs where
   `admit` runs: the serving side's bounded frontend pool, never the engine thread.

A source-description cache (sha256 -> media type and size) lets a known image skip steps 3 and 4;
the decoded image goes to the decoded-image cache, where the engine's loader finds it. Then every
image is costed by the model's `VisionProfile` (from its size alone) and the budgets are checked:
``max_images_per_prompt`` (before anything is decoded), ``max_image_tokens_per_image`` per image, and
``max_image_tokens_per_prompt`` over the whole request. Every rejection is a 400 (`BadRequest`) that
names the image: its 1-based position in prompt order and, when the frontend recorded it, where it
was in the request (``messages[1].content[0]``).

The caches are byte-bounded LRUs shared by the frontend pool's threads and the engine thread (a lock
each). Their counters are the ``flare_input_*`` metrics (`ImageStore.stats`).
"""

from __future__ import annotations

import hashlib
import io
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import attrs
from PIL import Image, JpegImagePlugin, PngImagePlugin, WebPImagePlugin

from helios.domain.images import ImageCost, ImageSource, VisionLimits, VisionProfile, sniff
from helios.errors import BadRequest

if TYPE_CHECKING:
    from helios.config import VisionSection
    from helios.domain.conversation import ImagePart

MEDIA_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "MPO": "image/jpeg", "WEBP": "image/webp"}
"""Pillow format -> media type. MPO is JPEG with extra pictures (phones' depth maps): its first
picture is the image."""
FORMAT_NAMES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WebP"}

SOURCE_ENTRY_BYTES = 256
"""What one source description is charged in the source cache's byte budget."""


# -- host caches ---------------------------------------------------------------------------------
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ByteLRU(Generic[K, V]):
    """A least-recently-used map bounded by the bytes its values declare; thread-safe.

    A value larger than the whole capacity is not kept (a capacity of 0 keeps nothing)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = max(0, int(capacity_bytes))
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: K) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return item[0]

    def put(self, key: K, value: V, nbytes: int) -> None:
        nbytes = max(0, int(nbytes))
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            if nbytes > self.capacity:
                return
            while self._items and self.bytes + nbytes > self.capacity:
                _, (_, size) = self._items.popitem(last=False)
                self.bytes -= size
                self.evictions += 1
            self._items[key] = (value, nbytes)
            self.bytes += nbytes


@attrs.frozen
class _Description:
    """What the source cache keeps of an image it validated (a fully decoded, accepted image)."""

    media_type: str
    width: int
    height: int


def decoded_nbytes(image: Image.Image) -> int:
    """Host bytes a decoded image's pixel buffer holds (an approximation for packed modes; the cache
    also charges the encoded bytes the image's file object still refers to)."""
    bands = len(image.getbands())
    per_band = 2 if image.mode in ("I;16", "I;16B", "I;16L") else 4 if image.mode in ("I", "F") else 1
    return image.width * image.height * bands * per_band


def _prepared_nbytes(value: Any) -> int:
    n = getattr(value, "nbytes", None)
    return int(n) if isinstance(n, int) else 0


class ImageStore:
    """The host caches of image input (spec: "Configured host memory ... also cache source
    descriptions and CPU vision inputs"):

    * sources: sha256 -> media type and size of an image that decoded cleanly (a known image is not
      decoded again to validate it);
    * decoded: sha256 -> the decoded pillow image (what the model's ``prepare`` takes);
    * prepared: (sha256, settings key) -> what the model's ``prepare`` returned (its ``nbytes``
      are charged), so changed text that defeats prefix reuse still skips preprocessing.

    Eviction only costs time: a loader decodes and prepares again from the request's bytes."""

    def __init__(self, *, source_bytes: int = 1 << 20, decoded_bytes: int = 256 << 20,
                 prepared_bytes: int = 512 << 20) -> None:
        self.sources: ByteLRU[str, _Description] = ByteLRU(source_bytes)
        self.decoded: ByteLRU[str, Image.Image] = ByteLRU(decoded_bytes)
        self.prepared: ByteLRU[tuple[str, str], Any] = ByteLRU(prepared_bytes)
        self._lock = threading.Lock()
        self.decoded_images = 0
        """Full decodes of image data (admission's validation, or a loader after an eviction)."""
        self.prepared_images = 0
        """Runs of the model's ``prepare`` (misses of the prepared-input cache)."""
        self.rejected_images = 0

    def _count(self, field: str) -> None:
        with self._lock:
            setattr(self, field, getattr(self, field) + 1)

    def decode(self, digest: str, data: bytes) -> Image.Image:
        """The decoded image of these bytes (already validated): from the cache, else decoded now."""
        image = self.decoded.get(digest)
        if image is None:
            media = sniff(data)
            image = open_image(media if media in FORMAT_NAMES else "image/png", data)
            image.load()
            self._count("decoded_images")
            self.decoded.put(digest, image, decoded_nbytes(image) + len(data))
        return image

    def loader(self, image: AdmittedImage) -> Callable[[], Image.Image]:
        """A loader of the admitted image's decoded pixels (cache first, else decoded again)."""
        digest, data = image.source.digest, image.data
        return lambda: self.decode(digest, data)

    def prepared_loader(self, image: AdmittedImage, settings_key: str,
                        prepare: Callable[[Image.Image], V]) -> Callable[[], V]:
        """A loader of the model's prepared input for this image (``engine.records.ImageInput.load``):
        from the prepared-input cache under (digest, settings_key), else ``prepare(decoded image)``,
        kept under its ``nbytes``."""
        digest, data = image.source.digest, image.data

        def load() -> V:
            key = (digest, settings_key)
            hit = self.prepared.get(key)
            if hit is not None:
                return hit  # type: ignore[no-any-return]
            value = prepare(self.decode(digest, data))
            self._count("prepared_images")
            self.prepared.put(key, value, _prepared_nbytes(value))
            return value

        return load

    def stats(self) -> dict[str, int]:
        """The ``flare_input_*`` metrics, by their JSON names (the Prometheus name without flare_)."""
        return {
            "input_decoded_images_total": self.decoded_images,
            "input_prepared_images_total": self.prepared_images,
            "input_rejected_images_total": self.rejected_images,
            "input_source_cache_hits_total": self.sources.hits,
            "input_source_cache_misses_total": self.sources.misses,
            "input_source_cache_evictions_total": self.sources.evictions,
            "input_source_cache_entries": len(self.sources),
            "input_decoded_cache_hits_total": self.decoded.hits,
            "input_decoded_cache_misses_total": self.decoded.misses,
            "input_decoded_cache_evictions_total": self.decoded.evictions,
            "input_decoded_cache_bytes": self.decoded.bytes,
            "input_prepared_cache_hits_total": self.prepared.hits,
            "input_prepared_cache_misses_total": self.prepared.misses,
            "input_prepared_cache_evictions_total": self.prepared.evictions,
            "input_prepared_cache_bytes": self.prepared.bytes,
        }


# -- admission -----------------------------------------------------------------------------------
@attrs.frozen
class AdmittedImage:
    """One image that passed validation and the per-image budgets."""

    source: ImageSource
    cost: ImageCost
    identity: str
    """The image's prefix identity: its content digest and the profile's settings key."""
    data: bytes = attrs.field(repr=False)
    """The encoded bytes (a loader decodes them again if the decoded image was evicted)."""


@attrs.frozen
class AdmittedImages:
    """A request's images after admission, in prompt order."""

    images: tuple[AdmittedImage, ...] = ()

    @property
    def sources(self) -> tuple[ImageSource, ...]:
        return tuple(i.source for i in self.images)

    @property
    def costs(self) -> tuple[ImageCost, ...]:
        return tuple(i.cost for i in self.images)

    @property
    def tokens(self) -> int:
        """Image feature tokens of the whole request (``multimodal_tokens.image``)."""
        return sum(i.cost.tokens for i in self.images)


def _name(index: int, where: str) -> str:
    """An image as messages name it: its 1-based position in prompt order, and where it was."""
    return f"image {index + 1} (at {where})" if where else f"image {index + 1}"


def text_only_error(model: str, param: str | None = None) -> BadRequest:
    """The 400 of an image sent to a text-only model (every route)."""
    return BadRequest(f"model {model} does not accept image input (it is text-only)", param=param)


class ImageAdmission:
    """Validates and costs a request's images under one model's limits (see the module docstring).

    ``profile`` None: a text-only model, whose limits are all zero and which rejects every image."""

    def __init__(self, *, model: str, profile: VisionProfile | None, limits: VisionLimits,
                 store: ImageStore | None = None) -> None:
        self.model = model
        self.profile = profile
        self.limits = limits if profile is not None else VisionLimits()
        self.store = store if store is not None else ImageStore()

    @property
    def accepts_images(self) -> bool:
        return self.profile is not None and self.limits.accepts_images

    def admit(self, parts: Sequence[ImagePart], *, param: str | None = None) -> AdmittedImages:
        """Validate, decode and cost every image of a request (prompt order), or raise BadRequest.

        Blocking (a full decode per image not seen before): run it in the bounded frontend pool,
        ``await trio.to_thread.run_sync(admission.admit, parts, limiter=service.limiter)``.
        ``param`` is the request field errors point at (``messages``, ``input``)."""
        if not parts:
            return AdmittedImages()
        if not self.accepts_images or self.profile is None:
            raise text_only_error(self.model, param)
        lim = self.limits
        if len(parts) > lim.max_images_per_prompt:
            raise BadRequest(f"the request has {len(parts)} images; max_images_per_prompt is "
                             f"{lim.max_images_per_prompt}", param=param)
        profile = self.profile
        settings = profile.settings_key
        admitted: list[AdmittedImage] = []
        for index, part in enumerate(parts):
            try:
                source = self._source(index, part)
            except BadRequest as exc:
                self.store._count("rejected_images")
                raise BadRequest(str(exc), param=param) from None
            cost = profile.cost(source.width, source.height)
            if cost.tokens > lim.max_image_tokens_per_image:
                self.store._count("rejected_images")
                raise BadRequest(
                    f"{_name(index, part.where)} of {source.width}x{source.height} pixels costs {cost.tokens} "
                    f"image tokens ({cost.patches} patches); max_image_tokens_per_image is "
                    f"{lim.max_image_tokens_per_image}", param=param)
            admitted.append(AdmittedImage(source, cost, f"{source.digest}:{settings}", part.data))
        total = sum(a.cost.tokens for a in admitted)
        if total > lim.max_image_tokens_per_prompt:
            running, first = 0, admitted[-1]
            for a in admitted:
                running += a.cost.tokens
                if running > lim.max_image_tokens_per_prompt:
                    first = a
                    break
            patches = " + ".join(str(a.cost.patches) for a in admitted)
            patch_total = sum(a.cost.patches for a in admitted)
            counts = f"{patches} = {patch_total}" if len(admitted) > 1 else patches
            s = first.source
            raise BadRequest(
                f"the request's {len(admitted)} image{'s' if len(admitted) > 1 else ''} cost {total} image "
                f"tokens (patches: {counts}), over max_image_tokens_per_prompt {lim.max_image_tokens_per_prompt}; "
                f"{_name(s.index, parts[s.index].where)}, {s.width}x{s.height} pixels and {first.cost.tokens} "
                "tokens, is the first that crossed it", param=param)
        return AdmittedImages(tuple(admitted))

    def _source(self, index: int, part: ImagePart) -> ImageSource:
        """Steps 1-4 of the module docstring for one image."""
        name = _name(index, part.where)
        data = part.data
        lim = self.limits
        if len(data) > lim.max_image_bytes:
            raise BadRequest(f"{name} is {len(data)} bytes encoded; max_image_bytes is {lim.max_image_bytes}")
        if not data:
            raise BadRequest(f"{name} is empty")
        actual = sniff(data)
        if actual is None or actual not in FORMAT_NAMES:
            what = f"{actual} data" if actual is not None else "not image data this server can read"
            raise BadRequest(f"{name} is {what}; images must be PNG, JPEG or static WebP")
        declared = part.media_type.lower()
        if declared and declared != actual:
            raise BadRequest(f"{name} is declared {part.media_type} but its data is {FORMAT_NAMES[actual]} ({actual})")
        digest = hashlib.sha256(data).hexdigest()
        known = self.store.sources.get(digest)
        if known is not None:
            self._check_pixels(name, known.width, known.height)
            return ImageSource(index, known.media_type, known.width, known.height, len(data), digest)
        width, height = self._decode(name, actual, digest, data)
        self.store.sources.put(digest, _Description(actual, width, height), SOURCE_ENTRY_BYTES)
        return ImageSource(index, actual, width, height, len(data), digest)

    def _check_pixels(self, name: str, width: int, height: int) -> None:
        if width * height > self.limits.max_image_pixels:
            raise BadRequest(f"{name} is {width}x{height} = {width * height} pixels; max_image_pixels is "
                             f"{self.limits.max_image_pixels}")
        if width <= 0 or height <= 0:
            raise BadRequest(f"{name} has no pixels ({width}x{height})")

    def _decode(self, name: str, media: str, digest: str, data: bytes) -> tuple[int, int]:
        fmt = FORMAT_NAMES[media]
        try:
            opened = open_image(media, data, self.limits.max_image_pixels)
        except OversizedImage as exc:
            self._check_pixels(name, exc.width, exc.height)
            raise AssertionError("unreachable: OversizedImage is over max_image_pixels") from None
        except Image.DecompressionBombError as exc:
            raise BadRequest(f"{name} is a decompression bomb ({exc}); max_image_pixels is "
                             f"{self.limits.max_image_pixels}") from None
        except Exception as exc:  # pillow raises many types for a bad header (UnidentifiedImageError, ...)
            raise BadRequest(f"{name} is not readable {fmt} data: {_reason(exc)}") from None
        # Not closed once loaded: closing a pillow image frees its pixels, which the cache keeps.
        try:
            width, height = opened.size
            self._check_pixels(name, width, height)
            frames = _frames(opened)
            if frames > 1 and opened.format != "MPO":
                raise BadRequest(f"{name} is an animated {fmt} ({frames} frames); animated images are unsupported")
            try:
                opened.load()
            except Exception as exc:  # truncated or corrupt data: OSError, SyntaxError, ValueError, ...
                raise BadRequest(f"{name} is corrupt or truncated {fmt} data: {_reason(exc)}") from None
        except BaseException:
            opened.close()
            raise
        self.store._count("decoded_images")
        self.store.decoded.put(digest, opened, decoded_nbytes(opened) + len(data))
        return width, height


def open_image(media: str, data: bytes, max_pixels: int | None = None) -> Image.Image:
    """Read the header of PNG, JPEG or WebP data (no pixels yet) with that format's pillow plugin.

    The plugin is called directly, not through ``Image.open``: the size check against the configured
    ``max_image_pixels`` that follows replaces pillow's global ``MAX_IMAGE_PIXELS`` bomb check, so the
    configured limit is the one that applies and a rejection states the observed size."""
    fp = io.BytesIO(data)
    if max_pixels is not None:
        # pillow's WebP plugin allocates the whole canvas while it opens the file, and its MPO
        # (multi-picture JPEG) plugin applies pillow's global bomb check: the header's size first.
        size = webp_size(data) if media == "image/webp" else jpeg_size(data) if media == "image/jpeg" else None
        if size is not None and size[0] * size[1] > max_pixels:
            raise OversizedImage(*size)
    if media == "image/png":
        return PngImagePlugin.PngImageFile(fp)
    if media == "image/jpeg":
        return JpegImagePlugin.jpeg_factory(fp)
    if media == "image/webp":
        return WebPImagePlugin.WebPImageFile(fp)
    raise ValueError(f"unsupported media type {media}")


class OversizedImage(Exception):
    """A header's size was over the limit before pillow could allocate (see `open_image`)."""

    def __init__(self, width: int, height: int) -> None:
        super().__init__(width, height)
        self.width, self.height = width, height


def webp_size(data: bytes) -> tuple[int, int] | None:
    """The canvas size a WebP header declares (VP8X, lossy VP8 or lossless VP8L), None if unreadable."""
    kind = data[12:16]
    if kind == b"VP8X" and len(data) >= 30:
        return 1 + int.from_bytes(data[24:27], "little"), 1 + int.from_bytes(data[27:30], "little")
    if kind == b"VP8 " and len(data) >= 30 and data[23:26] == b"\x9d\x01\x2a":
        return int.from_bytes(data[26:28], "little") & 0x3FFF, int.from_bytes(data[28:30], "little") & 0x3FFF
    if kind == b"VP8L" and len(data) >= 25 and data[20] == 0x2F:
        bits = int.from_bytes(data[21:25], "little")
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    return None


_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """The (width, height) of a JPEG's first frame header (SOFn), None if none precedes the scan."""
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD9)):  # no length
            i += 2
            continue
        if marker == 0xDA:  # start of scan: no frame header before it
            return None
        length = int.from_bytes(data[i + 2:i + 4], "big")
        if marker in _SOF:
            if i + 9 > n:
                return None
            return int.from_bytes(data[i + 7:i + 9], "big"), int.from_bytes(data[i + 5:i + 7], "big")
        i += 2 + length
    return None


def _frames(image: Image.Image) -> int:
    try:
        return int(getattr(image, "n_frames", 1))
    except Exception:  # counting frames walks chunks; corrupt data is reported by the load that follows
        return 1


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return text[:200] if text else type(exc).__name__


# -- limits ---------------------------------------------------------------------------------------
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 4096
DEFAULT_MAX_IMAGE_BYTES = 20 << 20


def derive_limits(section: VisionSection, *, profile: VisionProfile | None, max_model_len: int,
                  max_body_bytes: int) -> VisionLimits:
    """The serving limits of image input ([vision] in the configuration; 0 there: derived here).

    Text-only (no profile): all zero, whatever is configured. Otherwise (spec: the card's fields):

    * image_feature_window_tokens: configured, else one image at the profile's largest cost;
    * max_image_tokens_per_image: the smallest of the profile's largest image, one window and the
      configured value;
    * max_image_tokens_per_prompt: configured (at most the context less one output token), else the
      context less one output token: text, framing and output share the rest;
    * max_images_per_prompt: configured, else the prompt's image tokens over the smallest image's cost;
    * max_image_pixels: configured, else 32 Mpx (8192x4096);
    * max_image_bytes: configured, else 20 MiB; never more than the HTTP body limit.
    """
    if profile is None or max_model_len <= 1:
        return VisionLimits()
    context = max_model_len - 1
    window = section.image_feature_window_tokens or profile.max_image_tokens_per_image
    per_image = min(profile.max_image_tokens_per_image, window, section.max_image_tokens_per_image or window)
    per_prompt = min(section.max_image_tokens_per_prompt or context, context)
    smallest = max(1, profile.cost(1, 1).tokens)
    images = section.max_images_per_prompt or max(1, per_prompt // smallest)
    pixels = section.max_image_pixels or DEFAULT_MAX_IMAGE_PIXELS
    nbytes = min(section.max_image_bytes or DEFAULT_MAX_IMAGE_BYTES, max_body_bytes)
    return VisionLimits(
        max_images_per_prompt=images,
        max_image_tokens_per_prompt=per_prompt,
        image_feature_window_tokens=window,
        max_image_tokens_per_image=per_image,
        max_image_pixels=pixels,
        max_image_bytes=nbytes,
    )


def build_admission(section: VisionSection, *, model: str, profile: VisionProfile | None, max_model_len: int,
                    max_body_bytes: int) -> ImageAdmission:
    """The server's one `ImageAdmission` (its `limits` go on `ModelInfo.vision`)."""
    limits = derive_limits(section, profile=profile, max_model_len=max_model_len, max_body_bytes=max_body_bytes)
    store = ImageStore(
        source_bytes=section.source_cache_entries * SOURCE_ENTRY_BYTES,
        decoded_bytes=int(section.decoded_cache_mib * (1 << 20)),
        prepared_bytes=int(section.prepared_cache_mib * (1 << 20)),
    )
    return ImageAdmission(model=model, profile=profile, limits=limits, store=store)

