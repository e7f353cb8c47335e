"""Hugging Face model directories: config.json, *.safetensors (single or sharded), tokenizer files.

Tensors are memory-mapped (``safetensors.safe_open``) and read one at a time when the model loads
them, so peak memory stays near the size of the model itself. The architecture (and so the config
parser) is the registry's answer for ``config.json`` (`helios.models.registry.for_hf_config`); a
vision-language checkpoint's text model is found through its family
(`helios.models.vision.registry.vision_family`). Weight names pass through as stored (the families'
modules take Hugging Face names).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors import safe_open
from torch import Tensor

from helios.loaders.tokenizer import Tokenizer
from helios.models import registry
from helios.models.architecture import Architecture, ArchitectureConfig
from helios.models.vision.registry import VisionFamily, vision_family

_log = logging.getLogger(__name__)
TensorThunk = Callable[[], Tensor]
_INDEX_FILE = "model.safetensors.index.json"


@attrs.frozen
class VisionFiles:
    """The vision side of a vision-language directory: its family, the config files that describe the
    encoder and the image processor, and the vision weights (still on disk)."""

    family: str
    config: dict[str, Any]
    """The whole ``config.json``."""
    preprocessor: dict[str, Any]
    """``preprocessor_config.json`` ({} when absent)."""
    processor: dict[str, Any]
    """``processor_config.json`` ({} when absent)."""
    tensors: dict[str, TensorThunk]
    """Every weight that is not the text model's, by its Hugging Face name."""


@attrs.frozen
class HFDirectory:
    """What a Hugging Face model directory holds, with tensors still on disk."""

    path: Path
    config: ArchitectureConfig
    architecture: Architecture
    raw_config: dict[str, Any]
    tensors: dict[str, TensorThunk]
    tokenizer: Tokenizer
    chat_template: str | None
    generation_config: dict[str, Any]
    vision: VisionFiles | None = None


def read_hf_directory(path: str | Path, dtype: torch.dtype) -> HFDirectory:
    root = Path(path)
    raw_config = _read_json(root / "config.json")
    if raw_config is None:
        raise FileNotFoundError(f"{root} has no config.json")
    family = vision_family(raw_config)
    text_config = raw_config if family is None else family.text_config(raw_config)
    architecture = registry.for_hf_config(text_config)
    config = architecture.parse_hf_config(text_config)
    generation_config = _read_json(root / "generation_config.json") or {}
    tokenizer_config = _read_json(root / "tokenizer_config.json") or {}
    chat_template = read_chat_template(root, tokenizer_config)
    tokenizer_json = root / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise FileNotFoundError(f"{root} has no tokenizer.json")
    tokenizer = Tokenizer.from_hf_files(tokenizer_json, tokenizer_config, generation_config, chat_template)
    tensors = safetensors_thunks(root, dtype)
    vision = None
    if family is not None and not family.tower:
        tensors, vision_tensors = _split_text_weights(tensors, family)
        _log.info("%s: text model only; %d vision-tower/projector tensors ignored (no %s vision tower in Helios)",
                  family.name, len(vision_tensors), family.name)
    elif family is not None:
        tensors, vision_tensors = _split_text_weights(tensors, family)
        vision = VisionFiles(family=family.name, config=raw_config,
                             preprocessor=_read_json(root / "preprocessor_config.json") or {},
                             processor=_read_json(root / "processor_config.json") or {}, tensors=vision_tensors)
    return HFDirectory(path=root, config=config, architecture=architecture, raw_config=raw_config, tensors=tensors,
                       tokenizer=tokenizer, chat_template=chat_template, generation_config=generation_config,
                       vision=vision)


def _split_text_weights(tensors: dict[str, TensorThunk],
                        family: VisionFamily) -> tuple[dict[str, TensorThunk], dict[str, TensorThunk]]:
    """A vision-language checkpoint's weights -> (the text model's, renamed by the family
    (`VisionFamily.text_weight_name`); everything else)."""
    text: dict[str, TensorThunk] = {}
    other: dict[str, TensorThunk] = {}
    for name, thunk in tensors.items():
        text_name = family.text_weight_name(name)
        if text_name is not None:
            text[text_name] = thunk
        else:
            other[name] = thunk
    return text, other


def safetensors_thunks(root: Path, dtype: torch.dtype) -> dict[str, TensorThunk]:
    """Tensor name -> function reading it (converted to ``dtype``), over one file or a sharded index."""
    index = _read_json(root / _INDEX_FILE)
    if index is not None:
        files = sorted(set(index["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{root} has no *.safetensors files")
    thunks: dict[str, TensorThunk] = {}
    for file_name in files:
        shard = _Shard(root / file_name)
        for name in shard.keys():
            thunks[name] = _make_thunk(shard, name, dtype)
    return thunks


def read_chat_template(root: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja, chat_template.json or tokenizer_config.json."""
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template: Any = (_read_json(root / "chat_template.json") or {}).get("chat_template")
    if template is None:
        template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


class _Shard:
    """One safetensors file, opened (memory-mapped) on first use."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._handle: Any = None

    def keys(self) -> list[str]:
        return list(self._open().keys())

    def get(self, name: str) -> Tensor:
        return self._open().get_tensor(name)

    def _open(self) -> Any:
        if self._handle is None:
            self._handle = safe_open(str(self.path), framework="pt", device="cpu")
        return self._handle


def _make_thunk(shard: _Shard, name: str, dtype: torch.dtype) -> TensorThunk:
    def load() -> Tensor:
        tensor = shard.get(name)
        return tensor.to(dtype) if tensor.is_floating_point() else tensor

    return load


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as fh:
        data = json.load(fh)
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data
