"""Idefics3 (SmolVLM) image preprocessing and prompt expansion, written from the processor's rules.

An image goes through, in order (every step is what transformers' ``Idefics3ImageProcessorPil`` does,
and `tests/parity/test_idefics3_parity.py` checks the result bit for bit):

1. RGB: transparency (an alpha band, or a palette/greyscale ``transparency``) is composited onto
   white, any other mode converted with pillow's ``convert("RGB")``.
2. ``do_resize``: the longest edge is scaled to ``size.longest_edge`` (up or down, aspect kept, the
   other edge truncated and rounded up to even), then, if an edge exceeds 4096, down to 4096.
3. ``do_image_splitting``: both edges rounded up to multiples of the tile size (``max_image_size``;
   the longest edge first, the other derived from the aspect ratio, then rounded up). When that is
   larger than one tile, the image is cut into a ``rows x cols`` grid of tiles in row-major order and
   followed by a global view (the whole image squashed to one tile). Without splitting the image is
   squashed to one tile.
4. ``do_rescale``: ``uint8 * rescale_factor`` in float64, stored as float32; ``do_normalize``:
   ``(x - mean) / std`` per channel in float32.

Resizing is pillow's ``Image.resize`` with the configured filter (Lanczos for SmolVLM) on 8-bit RGB.
The prompt text of an image is the tiles' framing (``<fake_token_around_image><row_r_col_c>``, a
newline after each grid row, then ``\\n<fake_token_around_image><global-img>``) around
``image_seq_len`` ``<image>`` tokens per tile; an unsplit image is
``<fake_token_around_image><global-img><image>*N<fake_token_around_image>``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from PIL import Image

from helios.domain.images import ImageCost
from helios.models.vision.base import PreparedImage

MAX_IMAGE_SIZE = 4096
"""Idefics3's absolute bound on an edge after the first resize."""
IMAGE_TOKEN = "<image>"
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TAG = "<global-img>"

_RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}


@attrs.frozen
class Idefics3ImageSettings:
    """The processor's settings (``preprocessor_config.json`` / ``processor_config.json``)."""

    longest_edge: int = 4 * 364
    """``size.longest_edge``: the first resize's target."""
    tile_size: int = 364
    """``max_image_size.longest_edge``: the edge of a tile (and of the global view)."""
    image_seq_len: int = 169
    """``<image>`` tokens per tile (the connector's output rows per tile)."""
    do_resize: bool = True
    do_image_splitting: bool = True
    resample: int = 1
    """A pillow filter number (``Image.Resampling``): 1 is Lanczos."""
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __attrs_post_init__(self) -> None:
        if self.longest_edge <= 0 or self.tile_size <= 0 or self.image_seq_len <= 0:
            raise ValueError(f"invalid Idefics3 image settings: {self}")
        if self.resample not in _RESAMPLE_NAMES:
            raise ValueError(f"unknown resample filter {self.resample}")

    @classmethod
    def from_json(cls, preprocessor: Mapping[str, Any], processor: Mapping[str, Any] | None = None) -> Idefics3ImageSettings:
        """From ``preprocessor_config.json`` (or a processor_config.json's ``image_processor`` entry)
        and ``processor_config.json`` (``image_seq_len``). Missing keys take the processor's defaults."""
        processor = processor or {}
        nested = processor.get("image_processor")
        pre: dict[str, Any] = {**(nested if isinstance(nested, Mapping) else {}), **preprocessor}
        defaults = cls()
        size = pre.get("size") or {"longest_edge": defaults.longest_edge}
        tile = pre.get("max_image_size") or {"longest_edge": defaults.tile_size}
        if "longest_edge" not in size:
            raise ValueError(f"unsupported Idefics3 size {size!r}: only longest_edge is supported")
        if "longest_edge" not in tile:
            raise ValueError(f"unsupported Idefics3 max_image_size {tile!r}: only longest_edge is supported")
        seq_len = processor.get("image_seq_len", pre.get("image_seq_len", defaults.image_seq_len))
        mean = pre.get("image_mean", defaults.image_mean)
        std = pre.get("image_std", defaults.image_std)
        mean = (float(mean),) * 3 if isinstance(mean, int | float) else tuple(float(m) for m in mean)
        std = (float(std),) * 3 if isinstance(std, int | float) else tuple(float(s) for s in std)
        if len(mean) != 3 or len(std) != 3:
            raise ValueError(f"image_mean/image_std need 3 channels, got {mean!r} / {std!r}")
        return cls(
            longest_edge=int(size["longest_edge"]), tile_size=int(tile["longest_edge"]), image_seq_len=int(seq_len),
            do_resize=bool(pre.get("do_resize", True)), do_image_splitting=bool(pre.get("do_image_splitting", True)),
            resample=int(pre.get("resample", defaults.resample)), do_rescale=bool(pre.get("do_rescale", True)),
            rescale_factor=float(pre.get("rescale_factor", defaults.rescale_factor)),
            do_normalize=bool(pre.get("do_normalize", True)),
            image_mean=(mean[0], mean[1], mean[2]), image_std=(std[0], std[1], std[2]),
        )

    def key(self) -> str:
        """The settings as a stable string (part of an image's prefix identity)."""
        return "idefics3:" + json.dumps(attrs.asdict(self), sort_keys=True, separators=(",", ":"))


@attrs.frozen
class ImagePlan:
    """The geometry of one image under the settings, from its size alone."""

    resized: tuple[int, int] | None
    """(height, width) after the first resize (None: not resized)."""
    split_size: tuple[int, int] | None
    """(height, width) after rounding up to whole tiles (None: not splitting)."""
    rows: int
    cols: int

    @property
    def tiles(self) -> int:
        """Encoder inputs: the grid's tiles and the global view, or one squashed view."""
        return self.rows * self.cols + 1 if self.rows else 1


class Idefics3ImageProcessor:
    """Preprocessing, geometry and prompt text of one image under `Idefics3ImageSettings`."""

    def __init__(self, settings: Idefics3ImageSettings) -> None:
        self.settings = settings
        self._table: torch.Tensor | None = None

    def plan(self, width: int, height: int) -> ImagePlan:
        if width <= 0 or height <= 0:
            raise ValueError(f"image size {width}x{height} is empty")
        s = self.settings
        h, w = height, width
        resized: tuple[int, int] | None = None
        if s.do_resize:
            h, w = _scale_longest_edge_to(h, w, s.longest_edge)
            h, w = _scale_below(h, w, MAX_IMAGE_SIZE)
            resized = (h, w)
        if not s.do_image_splitting:
            return ImagePlan(resized, None, 0, 0)
        h, w = _round_up_to_tiles(h, w, s.tile_size)
        if h <= 0 or w <= 0:
            raise ValueError(f"image size {width}x{height} is too thin to split into tiles")
        if h > s.tile_size or w > s.tile_size:
            return ImagePlan(resized, (h, w), (h - s.tile_size) // s.tile_size + 1, (w - s.tile_size) // s.tile_size + 1)
        return ImagePlan(resized, (h, w), 0, 0)

    def cost(self, width: int, height: int, patches_per_tile: int) -> ImageCost:
        plan = self.plan(width, height)
        return ImageCost(tokens=plan.tiles * self.settings.image_seq_len, patches=plan.tiles * patches_per_tile,
                         grid=(plan.rows, plan.cols), prompt_text=self.prompt_text(plan.rows, plan.cols))

    def _value_table(self) -> torch.Tensor:
        """[3, 256] float32: each channel's 8-bit value after rescale and normalize."""
        if self._table is None:
            s = self.settings
            levels = torch.arange(256, dtype=torch.uint8).view(1, 256).expand(3, 256)
            values = levels.double().mul(s.rescale_factor).float() if s.do_rescale else levels.float()
            if s.do_normalize:
                mean = torch.tensor(s.image_mean, dtype=torch.float32).view(3, 1)
                std = torch.tensor(s.image_std, dtype=torch.float32).view(3, 1)
                values = (values - mean) / std
            self._table = values.contiguous()
        return self._table

    def prompt_text(self, rows: int, cols: int) -> str:
        """What one ``<image>`` of the prompt expands to for a ``rows x cols`` grid (0 x 0: unsplit)."""
        run = IMAGE_TOKEN * self.settings.image_seq_len
        global_view = f"{FAKE_TOKEN}{GLOBAL_TAG}{run}{FAKE_TOKEN}"
        if rows == 0 and cols == 0:
            return global_view
        grid = "".join(
            "".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n" for r in range(rows)
        )
        return f"{grid}\n{global_view}"

    def prepare(self, image: Image.Image) -> PreparedImage:
        """Decoded pixels -> normalized tiles [tiles, 3, tile, tile] float32 and their pixel mask."""
        s = self.settings
        rgb = to_rgb(image)
        plan = self.plan(rgb.width, rgb.height)
        resample = Image.Resampling(s.resample)
        if plan.resized is not None:
            rgb = rgb.resize((plan.resized[1], plan.resized[0]), resample=resample)
        tile = s.tile_size
        if plan.split_size is None:
            frames = [rgb.resize((tile, tile), resample=resample)]
        else:
            rgb = rgb.resize((plan.split_size[1], plan.split_size[0]), resample=resample)
            if plan.rows:
                frames = [rgb.crop((c * tile, r * tile, (c + 1) * tile, (r + 1) * tile))
                          for r in range(plan.rows) for c in range(plan.cols)]
                frames.append(rgb.resize((tile, tile), resample=resample))
            else:
                frames = [rgb]
        pixels = _stack_frames(frames)
        # Rescale and normalize depend on (channel, 8-bit value) only: a 3 x 256 table computed with
        # the processor's own arithmetic, then looked up (the same numbers, without the float64 pass
        # over every pixel).
        table = self._value_table()
        values = torch.empty(pixels.shape, dtype=torch.float32)
        for channel in range(3):
            values[:, channel] = table[channel][pixels[:, channel].long()]
        mask = torch.ones(values.shape[0], values.shape[2], values.shape[3], dtype=torch.bool)
        return PreparedImage(pixel_values=values.contiguous(), pixel_attention_mask=mask, rows=plan.rows,
                             cols=plan.cols)


def to_rgb(image: Image.Image) -> Image.Image:
    """8-bit RGB; transparent pixels composited onto opaque white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def _stack_frames(frames: list[Image.Image]) -> torch.Tensor:
    """Equal-size RGB frames -> uint8 [frames, 3, height, width]."""
    height, width = frames[0].height, frames[0].width
    data = bytearray(b"".join(f.tobytes() for f in frames))
    return torch.frombuffer(data, dtype=torch.uint8).view(len(frames), height, width, 3).permute(0, 3, 1, 2)


def _scale_longest_edge_to(height: int, width: int, max_len: int) -> tuple[int, int]:
    """The longest edge becomes ``max_len``; the other follows the aspect ratio, truncated, made even."""
    aspect = width / height
    if width >= height:
        width = max_len
        height = int(width / aspect)
        height += height % 2
    else:
        height = max_len
        width = int(height * aspect)
        width += width % 2
    return max(height, 1), max(width, 1)


def _scale_below(height: int, width: int, max_len: int) -> tuple[int, int]:
    """Scale down so that no edge exceeds ``max_len`` (aspect kept, truncated)."""
    aspect = width / height
    if width >= height and width > max_len:
        width = max_len
        height = int(width / aspect)
    elif height > width and height > max_len:
        height = max_len
        width = int(height * aspect)
    return max(height, 1), max(width, 1)


def _round_up_to_tiles(height: int, width: int, tile: int) -> tuple[int, int]:
    """The longest edge rounded up to whole tiles, the other derived from the aspect ratio and
    rounded up likewise."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width
