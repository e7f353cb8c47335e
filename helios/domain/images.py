"""Images as the protocol side sees them (spec: Conversation and tool semantics, usage, System One).

Pure values: no torch, no pillow. The contract between the three parts of image support:

* ``serving/images.py`` reads an `ImagePart`'s header (pillow, under the byte and pixel limits) into an
  `ImageSource`, and asks the model's `VisionProfile` what it costs (`ImageCost`) before admission.
* the model family (``models/vision/``) implements `VisionProfile`: the cost of an image from its size
  alone, the placeholder text one image expands to in the rendered prompt, and its processing settings.
* the engine receives each admitted image as an ``engine.records.ImageInput`` (its span of placeholder
  tokens in the prompt, its identity for the prefix cache, and a lazy loader of its prepared input).
"""

from __future__ import annotations

from typing import Protocol

import attrs

# Signatures of formats we name when rejecting them (the accepted three first).
_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
    (b"II*\x00", "image/tiff"),
    (b"MM\x00*", "image/tiff"),
)


def sniff(data: bytes) -> str | None:
    """The media type the bytes' signature says (None: no known signature); the image pipeline and
    System One's assets read it."""
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    for sig, media in _SIGNATURES:
        if data.startswith(sig):
            return media
    return None


@attrs.frozen
class ImageSource:
    """One image of a request after its header was read, before any decoding of pixels."""

    index: int
    """Position in prompt order (0-based): the n-th image of the whole request."""
    media_type: str
    """``image/png``, ``image/jpeg`` or ``image/webp`` (what the bytes are, not what the client said)."""
    width: int
    height: int
    byte_size: int
    digest: str
    """sha256 hex of the encoded bytes: with the profile's ``settings_key`` the image's prefix identity."""


@attrs.frozen
class ImageCost:
    """What one image costs a prompt under a vision profile."""

    tokens: int
    """Image feature tokens (``prompt_tokens_details.multimodal_tokens.image``; the image budgets)."""
    patches: int
    """Encoder patches before the connector merges them into ``tokens``."""
    grid: tuple[int, int]
    """(rows, cols) of the tiles the image is split into ((0, 0): not split, one global view)."""
    prompt_text: str
    """The text one image placeholder of the rendered template expands to: the framing tokens (which
    count in prompt tokens only) around ``tokens`` image placeholder tokens."""


class VisionProfile(Protocol):
    """A vision-language family's image rules, as the serving side needs them (no tensors)."""

    @property
    def image_token(self) -> str:
        """The placeholder token's text; each feature row replaces one of these in the prompt."""
        ...

    @property
    def settings_key(self) -> str:
        """The processing settings (resize, split, normalization, ...) as a stable string: part of
        every image's prefix identity, so changed settings never reuse another setting's prefix."""
        ...

    @property
    def max_image_tokens_per_image(self) -> int: ...

    def cost(self, width: int, height: int) -> ImageCost:
        """The cost of an image of this decoded size, computed from the size alone."""
        ...


@attrs.frozen
class VisionLimits:
    """The image limits a server admits under (the ``flare`` card's image fields; all zero for a
    text-only model). ``serving/images.py`` enforces them; the card and ``/api/show`` report them."""

    max_images_per_prompt: int = 0
    max_image_tokens_per_prompt: int = 0
    image_feature_window_tokens: int = 0
    max_image_tokens_per_image: int = 0
    max_image_pixels: int = 0
    max_image_bytes: int = 0

    @property
    def accepts_images(self) -> bool:
        return self.max_images_per_prompt > 0

    def card_fields(self) -> dict[str, int]:
        """The six card fields, in the spec's order."""
        return attrs.asdict(self)
