"""Vision-language families by name: the one place that maps a checkpoint's vision side to a tower.

A second family (Qwen2.5-VL, Gemma 3) adds its module under ``helios/models/vision/`` and a branch
here; the loaders name the family from ``config.json`` (``helios.loaders.safetensors_loader``), and the
engine sees only `VisionTower`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from helios.models.vision.base import VisionTower

FAMILIES = ("idefics3",)


def load_vision_tower(family: str, config: Mapping[str, Any], preprocessor: Mapping[str, Any],
                      processor: Mapping[str, Any], tensors: Mapping[str, Tensor], *,
                      dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> VisionTower:
    """Build and load the tower of ``family`` from its config files and vision weights (Hugging Face
    names); its features come out in ``dtype`` on ``device`` (the text model's)."""
    if family == "idefics3":
        from helios.models.vision.idefics3 import Idefics3Tower, Idefics3VisionSpec

        tower = Idefics3Tower(Idefics3VisionSpec.from_hf(config, preprocessor, processor), dtype, device)
        tower.load_weights(tensors)
        tower.eval()
        return tower
    raise ValueError(f"unknown vision family {family!r}; known: {', '.join(FAMILIES)}")
