"""The model side of image input: what a vision-language family gives the engine and the serving side.

A family (Idefics3 / SmolVLM today; Qwen2.5-VL or Gemma 3 later) implements `VisionTower`:

* ``profile`` (`helios.domain.images.VisionProfile`): the rules the serving side needs without tensors
  (an image's cost from its size, the placeholder text one image expands to, the settings key);
* ``prepare(image)``: decoded pixels -> `PreparedImage`, host tensors only (the serving side or the
  engine's loader runs it; it is the unit a preprocessed-input cache keeps);
* ``encode(prepared)``: the image's feature rows [tokens, text hidden] in the text model's dtype and
  device, in the order the image's placeholder tokens appear in the prompt. The engine writes row k
  over the k-th placeholder token of the image's span (`LlamaForCausalLM.forward(embeds=...)`).

Family-specific geometry (tiles, grids, position ids of M-RoPE, ...) stays inside ``PreparedImage``'s
tensors and the family's own code; the engine sees only rows of features, so a second family needs no
engine change. (A family whose text model needs extra position information, such as Qwen2.5-VL's
M-RoPE, would add it to the text model's forward, not to the engine records.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import attrs
from torch import Tensor

from helios.domain.images import VisionProfile

if TYPE_CHECKING:
    from PIL import Image


@attrs.frozen(eq=False)
class PreparedImage:
    """One image after preprocessing, on the host: what ``VisionTower.encode`` consumes."""

    pixel_values: Tensor
    """[tiles, channels, height, width] float32, normalized (tiles: the split tiles, then the global
    view, as the family orders them)."""
    pixel_attention_mask: Tensor
    """[tiles, height, width] bool: True where a pixel is real (not padding)."""
    rows: int
    """Tile grid rows (0 when the image was not split)."""
    cols: int
    """Tile grid columns (0 when the image was not split)."""

    @property
    def nbytes(self) -> int:
        """Host memory the record holds (for the preprocessed-input cache's byte budget)."""
        return int(self.pixel_values.nbytes + self.pixel_attention_mask.nbytes)


class VisionTower(Protocol):
    """A loaded vision encoder + connector of one vision-language family."""

    @property
    def profile(self) -> VisionProfile: ...

    @property
    def image_token_id(self) -> int:
        """The token id of the placeholder each feature row replaces."""
        ...

    def prepare(self, image: Image.Image) -> PreparedImage:
        """Decoded pixels (any PIL mode; converted as the family's processor does) -> host tensors."""
        ...

    def encode(self, prepared: PreparedImage) -> Tensor:
        """Feature rows [profile.cost(w, h).tokens, text hidden] in the text model's dtype and device,
        in the order of the image's placeholder tokens in the prompt."""
        ...
