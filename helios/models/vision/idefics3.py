"""Idefics3 / SmolVLM: a SigLIP encoder, a pixel-shuffle connector and a Llama text model.

Each tile of an image (`idefics3_processor`) is encoded into ``side x side`` patch states (side =
tile / patch). The connector's pixel shuffle merges every ``s x s`` block of neighbouring patches
(s = ``scale_factor``) into one vector: output token (i, j) of the ``side/s x side/s`` grid, in
row-major order, is the concatenation over block row a, then block column b, of patch
(i*s + a, j*s + b)'s state (channel ``(a*s + b) * hidden + d``). A linear projection without bias
maps the ``hidden * s^2`` channels to the text model's hidden size. The rows of all tiles, tiles in
prompt order (grid row-major, then the global view), replace the ``<image>`` tokens of the image's
prompt text one for one (`LlamaForCausalLM.forward(embeds=...)`).

The text model is Helios's `LlamaForCausalLM`, loaded from ``model.text_model.*`` (renamed to
``model.*`` by the loader) and ``lm_head.weight``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from helios.domain.images import ImageCost
from helios.models.vision.base import PreparedImage
from helios.models.vision.idefics3_processor import IMAGE_TOKEN, Idefics3ImageProcessor, Idefics3ImageSettings
from helios.models.vision.siglip import SiglipVisionConfig, SiglipVisionEncoder

if TYPE_CHECKING:
    from PIL import Image

ARCHITECTURES = frozenset({"Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"})
MODEL_TYPES = frozenset({"idefics3", "smolvlm"})
VISION_PREFIX = "model.vision_model."
CONNECTOR_WEIGHT = "model.connector.modality_projection.proj.weight"


@attrs.frozen(kw_only=True)
class Idefics3VisionSpec:
    """The vision side of an Idefics3 ``config.json`` plus the processor settings."""

    vision: SiglipVisionConfig
    scale_factor: int
    image_token_id: int
    text_hidden_size: int
    image: Idefics3ImageSettings

    def __attrs_post_init__(self) -> None:
        side = self.image.tile_size // self.vision.patch_size
        if self.image.tile_size % self.vision.patch_size or side % self.scale_factor:
            raise ValueError(f"tile size {self.image.tile_size} does not split into {self.vision.patch_size}-pixel "
                             f"patches in {self.scale_factor}x{self.scale_factor} blocks")
        if (side // self.scale_factor) ** 2 != self.image.image_seq_len:
            raise ValueError(f"image_seq_len {self.image.image_seq_len} does not match the connector's "
                             f"{(side // self.scale_factor) ** 2} rows per {self.image.tile_size}-pixel tile")

    @property
    def patches_per_tile(self) -> int:
        return (self.image.tile_size // self.vision.patch_size) ** 2

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], preprocessor: Mapping[str, Any],
                processor: Mapping[str, Any] | None = None) -> Idefics3VisionSpec:
        """From ``config.json``, ``preprocessor_config.json`` and ``processor_config.json``. Without
        an ``image_seq_len`` in the processor files it is derived from the geometry, as the model
        was trained (``(tile / patch / scale_factor)^2``)."""
        vision = SiglipVisionConfig.from_hf_config(config.get("vision_config") or {})
        scale = int(config.get("scale_factor", 2))
        text = config.get("text_config") or {}
        processor = dict(processor or {})
        nested = processor.get("image_processor")
        if "image_seq_len" not in processor and not (isinstance(nested, Mapping) and "image_seq_len" in nested):
            tile = int(((preprocessor.get("max_image_size") or {}).get("longest_edge")) or
                       (nested.get("max_image_size", {}).get("longest_edge") if isinstance(nested, Mapping) else 0)
                       or Idefics3ImageSettings().tile_size)
            processor["image_seq_len"] = (tile // vision.patch_size // scale) ** 2
        image_token_id = config.get("image_token_id", config.get("image_token_index"))
        if image_token_id is None:
            raise ValueError("Idefics3 config.json has no image_token_id")
        return cls(vision=vision, scale_factor=scale, image_token_id=int(image_token_id),
                   text_hidden_size=int(text.get("hidden_size", 4096)),
                   image=Idefics3ImageSettings.from_json(preprocessor, processor))


class Idefics3Profile:
    """`helios.domain.images.VisionProfile` of an Idefics3 model."""

    def __init__(self, spec: Idefics3VisionSpec) -> None:
        self.spec = spec
        self.processor = Idefics3ImageProcessor(spec.image)
        self._key = spec.image.key() + f";patch={spec.vision.patch_size};scale={spec.scale_factor}"

    @property
    def image_token(self) -> str:
        return IMAGE_TOKEN

    @property
    def settings_key(self) -> str:
        return self._key

    @property
    def max_image_tokens_per_image(self) -> int:
        """The most tokens any image can cost: the largest grid the first resize allows, plus the
        global view (one tile without splitting)."""
        s = self.spec.image
        if not s.do_image_splitting:
            return s.image_seq_len
        if not s.do_resize:
            side = -(-4096 // s.tile_size)  # an unresized image is bounded only by the 4096 cap of the model
            return (side * side + 1) * s.image_seq_len
        side = -(-min(s.longest_edge, 4096) // s.tile_size)
        return (side * side + 1) * s.image_seq_len if side > 1 else s.image_seq_len

    def cost(self, width: int, height: int) -> ImageCost:
        return self.processor.cost(width, height, self.spec.patches_per_tile)


class Idefics3Tower(nn.Module):
    """`helios.models.vision.base.VisionTower` of Idefics3 / SmolVLM: SigLIP encoder + connector."""

    def __init__(self, spec: Idefics3VisionSpec, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.spec = spec
        self._profile = Idefics3Profile(spec)
        self.encoder = SiglipVisionEncoder(spec.vision, dtype, device)
        merged = spec.vision.hidden_size * spec.scale_factor ** 2
        self.projection = nn.Parameter(torch.empty(spec.text_hidden_size, merged, dtype=dtype, device=device),
                                       requires_grad=False)

    @property
    def profile(self) -> Idefics3Profile:
        return self._profile

    @property
    def image_token_id(self) -> int:
        return self.spec.image_token_id

    @property
    def device(self) -> torch.device:
        return self.projection.device

    @property
    def dtype(self) -> torch.dtype:
        return self.projection.dtype

    def prepare(self, image: Image.Image) -> PreparedImage:
        return self._profile.processor.prepare(image)

    def encode(self, prepared: PreparedImage) -> Tensor:
        """[tiles * image_seq_len, text hidden] in the model dtype, tiles in prompt order."""
        with torch.no_grad():
            states = self.encode_patches(prepared)
            return self.connect(states).reshape(-1, self.spec.text_hidden_size)

    def encode_patches(self, prepared: PreparedImage) -> Tensor:
        """The encoder's output [tiles, patches, vision hidden] (before the connector)."""
        pixels = prepared.pixel_values.to(device=self.device, dtype=self.dtype)
        mask = prepared.pixel_attention_mask.to(self.device)
        p = self.spec.vision.patch_size
        n, h, w = mask.shape
        # A patch is real if any of its pixels is.
        patch_mask = mask.view(n, h // p, p, w // p, p).any(dim=4).any(dim=2)
        return self.encoder(pixels, patch_mask)

    def connect(self, states: Tensor) -> Tensor:
        """Pixel shuffle + projection: [tiles, side^2, hidden] -> [tiles, (side/s)^2, text hidden]."""
        n, seq, d = states.shape
        s = self.spec.scale_factor
        side = math.isqrt(seq)
        if side * side != seq or side % s:
            raise ValueError(f"{seq} patches per tile do not form a square grid divisible by {s}")
        blocks = states.reshape(n, side // s, s, side // s, s, d).permute(0, 1, 3, 2, 4, 5)
        return F.linear(blocks.reshape(n, (side // s) ** 2, s * s * d), self.projection)

    def load_weights(self, tensors: Mapping[str, Tensor]) -> None:
        """From Hugging Face names: ``model.vision_model.*`` and the connector's projection. Raises on
        a missing or unexpected name."""
        used = self.encoder.load_weights(tensors, VISION_PREFIX)
        if CONNECTOR_WEIGHT not in tensors:
            raise ValueError(f"missing vision weight {CONNECTOR_WEIGHT}")
        weight = tensors[CONNECTOR_WEIGHT]
        if tuple(weight.shape) != tuple(self.projection.shape):
            raise ValueError(f"{CONNECTOR_WEIGHT}: expected shape {tuple(self.projection.shape)}, "
                             f"got {tuple(weight.shape)}")
        with torch.no_grad():
            self.projection.copy_(weight)
        used.add(CONNECTOR_WEIGHT)
        unexpected = sorted(set(tensors) - used)
        if unexpected:
            raise ValueError(f"unexpected vision weights: {unexpected[:8]}")
