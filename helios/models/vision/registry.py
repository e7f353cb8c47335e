"""Vision-language families by name: the one place that maps a checkpoint's vision side to a tower.

A second family (Qwen2.5-VL, Gemma 3) adds its module under ``helios/models/vision/``, a `VisionFamily`
in `VISION_MODEL_TYPES` and a branch in `load_vision_tower`; the loaders ask `vision_family` about a
``config.json`` (``helios.loaders.safetensors_loader``) and split the text model's weights and config
off with it; the engine sees only `VisionTower`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import Tensor

from helios.models.vision.base import VisionTower

FAMILIES = ("idefics3",)


@attrs.frozen
class VisionFamily:
    """How a vision-language checkpoint holds its text model: ``text_prefix`` of the text model's
    weight names (``<prefix>X`` is the text architecture's ``model.X``; ``lm_head.weight`` is the text
    model's too) and the text config's ``model_type`` where ``text_config`` does not say."""

    name: str
    text_prefix: str
    default_text_model_type: str
    tower: bool = True
    """False: Helios has no tower for this family; the text model loads and the vision weights are
    ignored (the loader logs how many)."""

    def text_config(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The text model's ``config.json`` part (the outer config decides whether lm_head is tied)."""
        text = dict(config.get("text_config") or {})
        if "tie_word_embeddings" in config:
            text["tie_word_embeddings"] = config["tie_word_embeddings"]
        text.setdefault("model_type", self.default_text_model_type)
        return text

    def text_weight_name(self, name: str) -> str | None:
        """A checkpoint weight's name in the text model's naming, or None for the vision side's."""
        if name.startswith(self.text_prefix):
            return "model." + name[len(self.text_prefix):]
        if name == "lm_head.weight":
            return name
        return None


@attrs.frozen
class _KimiK25Family(VisionFamily):
    """Kimi K2.5 / K2.6 (transformers' ``kimi_k25``): a DeepSeek-V3 text model (``text_config``) behind
    a MoonViT tower. Its files name the text weights ``language_model.model.X`` /
    ``language_model.lm_head.weight`` (transformers' own save writes its ``blocks`` rename back too:
    ``language_model.model.blocks.N``); transformers' in-memory ``model.language_model.X`` /
    ``lm_head.weight`` are accepted as well."""

    def text_config(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """As `VisionFamily.text_config`; an outer config without ``tie_word_embeddings`` ties, as
        transformers' ``Kimi_K25Config`` (default True, which decides over the text config's)."""
        return super().text_config({"tie_word_embeddings": True, **config})

    def text_weight_name(self, name: str) -> str | None:
        if name in ("language_model.lm_head.weight", "lm_head.weight"):
            return "lm_head.weight"
        for prefix in ("language_model.model.", self.text_prefix):
            if name.startswith(prefix):
                rest = name[len(prefix):]
                if rest.startswith("blocks."):
                    rest = "layers." + rest[len("blocks."):]
                return "model." + rest
        return None


_IDEFICS3 = VisionFamily("idefics3", text_prefix="model.text_model.", default_text_model_type="llama")
_KIMI_K25 = _KimiK25Family("kimi_k25", text_prefix="model.language_model.", default_text_model_type="deepseek_v3",
                           tower=False)
_QWEN3_5 = VisionFamily("qwen3_5", text_prefix="model.language_model.", default_text_model_type="qwen3_5_text",
                        tower=False)
_QWEN3_5_MOE = VisionFamily("qwen3_5_moe", text_prefix="model.language_model.",
                            default_text_model_type="qwen3_5_moe_text", tower=False)
VISION_MODEL_TYPES: dict[str, VisionFamily] = {"idefics3": _IDEFICS3, "smolvlm": _IDEFICS3, "kimi_k25": _KIMI_K25,
                                               "qwen3_5": _QWEN3_5, "qwen3_5_moe": _QWEN3_5_MOE}
"""``config.json`` model_type -> the vision-language family."""


def vision_family(config: Mapping[str, Any]) -> VisionFamily | None:
    """The vision-language family of a ``config.json``, None for a text-only model."""
    return VISION_MODEL_TYPES.get(str(config.get("model_type", "")))


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
