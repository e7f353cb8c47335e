"""Image features during chunked prefill: bounded feature windows (issue 16, spec "Images are encoded
sequentially into bounded feature windows").

A prompt's image is a span of tokens (`records.ImageInput`: framing tokens and ``tokens`` placeholder
tokens, the model's image token id). Its feature rows replace the placeholders' token embeddings
before the first layer (``model.forward(..., embeds=(rows, features))``, rows being indices into the
step's flattened batch). The runner asks `FeatureWindows.step_embeds` for a step's rows:

* A chunk that reaches an image's first placeholder not yet computed loads the image
  (``ImageInput.load()``: the prepared input, from the serving side's caches) and encodes it
  (``encoder.encode``) into the request's window, the image's whole feature rows. An image whose
  placeholders all lie in a cached prefix is never loaded nor encoded; a cached prefix that ends
  inside an image still needs that image's whole encode (the encoder sees the whole image), and only
  the rows past the cached point are used.
* Each chunk takes the rows of the placeholders it covers from the window, from the right index
  (a chunk boundary inside an image continues at the next row). The chunk that consumes the image's
  last placeholder frees the window.

Bounds. A request holds at most one window between steps (the image its prefill stopped inside),
of at most ``max_image_tokens_per_image`` rows (the serving side's admission limit) times the text
model's hidden size; the window is dropped when the request's last placeholder of that image is
consumed or the request leaves the batch (finished, aborted, preempted: `release`). Only partially
prefilled requests hold one, and the scheduler continues partial prefills oldest first, so there is
rarely more than one; ``max_active`` is the hard bound. Within one step, the features of the images
its chunks touch exist at once (at most the step's token budget in rows, plus one partly consumed
image per chunk).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any, Protocol

import attrs
import torch
from torch import Tensor

from helios.engine.records import ImageInput


class ImageEncoder(Protocol):
    """What the engine needs of a vision tower (``helios.models.vision.base.VisionTower``)."""

    @property
    def image_token_id(self) -> int: ...

    def encode(self, prepared: Any) -> Tensor:
        """Feature rows [tokens, hidden] in the text model's dtype and device, in placeholder order."""
        ...


class ImageError(Exception):
    """An image of a request could not be prepared or does not match its span (the request fails)."""


@attrs.define
class _Window:
    image: int
    """Index of the image in its request's ``images``."""
    features: Tensor


@attrs.define
class _RequestImages:
    positions: dict[int, list[int]] = attrs.field(factory=dict)
    """Per image index: the absolute positions of its placeholder tokens (computed on first use)."""
    window: _Window | None = None


@attrs.frozen
class StepEmbeds:
    rows: list[int]
    """Indices into the step's flattened tokens."""
    features: list[Tensor]
    """Feature rows for ``rows``, in the same order (one tensor per image piece)."""

    def tensors(self, device: torch.device) -> tuple[Tensor, Tensor]:
        return (torch.tensor(self.rows, dtype=torch.long, device=device),
                self.features[0] if len(self.features) == 1 else torch.cat(self.features))


class FeatureWindows:
    """The runner's per-request image state: placeholder positions and the one live feature window."""

    def __init__(self, encoder: ImageEncoder | None) -> None:
        self.encoder = encoder
        self._state: dict[str, _RequestImages] = {}
        self.encoded = 0
        """Images encoded so far (tests and metrics)."""

    @property
    def num_windows(self) -> int:
        """Feature windows held now (between steps: requests stopped inside an image)."""
        return sum(1 for s in self._state.values() if s.window is not None)

    def release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._state.pop(rid, None)

    def placeholders(self, rid: str, token_ids: Sequence[int], images: Sequence[ImageInput],
                     index: int) -> list[int]:
        """Absolute positions of image ``index``'s placeholder tokens (its ``tokens`` of them)."""
        state = self._state.setdefault(rid, _RequestImages())
        found = state.positions.get(index)
        if found is None:
            if self.encoder is None:
                raise ImageError("this model has no vision encoder, but the request has images")
            image = images[index]
            token = self.encoder.image_token_id
            found = [p for p in range(image.offset, image.offset + image.length) if token_ids[p] == token]
            if len(found) != image.tokens:
                raise ImageError(f"image {index + 1} has {len(found)} placeholder tokens in its span of the "
                                 f"prompt, expected {image.tokens}")
            state.positions[index] = found
        return found

    def is_placeholder(self, token_ids: Sequence[int], images: Sequence[ImageInput], position: int) -> bool:
        """Whether prompt ``position`` holds an image placeholder token (its prompt score is null)."""
        if self.encoder is None or token_ids[position] != self.encoder.image_token_id:
            return False
        return any(image.offset <= position < image.offset + image.length for image in images)

    def chunk_embeds(self, rid: str, token_ids: Sequence[int], images: Sequence[ImageInput], start: int,
                     end: int, offset: int, out: StepEmbeds) -> None:
        """Add to ``out`` the rows of the placeholders among positions ``start .. end`` (a chunk whose
        first token is the step's token ``offset``), loading and encoding images as needed. Raises
        `ImageError` (the request then fails; nothing of its chunk runs)."""
        for i, image in enumerate(images):
            if image.offset >= end:
                break
            if image.offset + image.length <= start:
                continue
            found = self.placeholders(rid, token_ids, images, i)
            a = bisect.bisect_left(found, start)
            b = bisect.bisect_left(found, end)
            if a == b:
                continue
            features = self._window(rid, images, i)
            out.rows.extend(offset + p - start for p in found[a:b])
            out.features.append(features[a:b])
            if b == len(found):
                self._state[rid].window = None  # its last placeholder is consumed: the window is free

    def _window(self, rid: str, images: Sequence[ImageInput], index: int) -> Tensor:
        state = self._state[rid]
        window = state.window
        if window is not None and window.image == index:
            return window.features
        state.window = None  # an earlier image's window (never left half-used by a running prefill)
        assert self.encoder is not None
        image = images[index]
        try:
            prepared = image.load()
            features = self.encoder.encode(prepared)
        except Exception as exc:  # the client's image, the caches, the encoder: this request fails
            raise ImageError(f"image {index + 1} could not be prepared: {type(exc).__name__}: {exc}") from exc
        self.encoded += 1
        if features.dim() != 2 or features.shape[0] != image.tokens:
            raise ImageError(f"image {index + 1}: the encoder gave {tuple(features.shape)} features for "
                             f"{image.tokens} placeholder tokens")
        state.window = _Window(index, features)
        return features
