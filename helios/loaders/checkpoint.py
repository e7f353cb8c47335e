"""One entry point for model files: a GGUF file or a Hugging Face directory -> `Checkpoint`.

    ckpt = load_checkpoint(path, torch.bfloat16, progress=report)
    model = ckpt.architecture.build(ckpt.config, BuildOptions(dtype=torch.bfloat16))
    model.load_weights(ckpt.tensors)

``ckpt.architecture`` is the `helios.models.registry` entry the checkpoint names (an unknown one fails
here, with one line naming the supported ones); ``ckpt.config`` is that family's config and the
tensors carry the family's names.

``Checkpoint.tensors`` is lazy: each tensor is read (and dequantized) from disk when it is accessed,
so loading the model never holds two full copies of the weights. ``Checkpoint.weights`` is the same
in the checkpoint's own form: GGUF Q4_0/Q4_1/Q8_0 tensors as `GroupQuantized` codes (which a quantized
`WeightFormat` keeps as they are), Q4_K/Q5_K/Q6_K/Q5_0/Q5_1 matrices as `kquant.BlockQuantized` blocks
(kept by a quantized format's `kquant.KQuantLinear`), everything else dense as stored:

    model = ckpt.architecture.build(ckpt.config, BuildOptions(dtype=torch.bfloat16, weights=WeightFormat("int4")))
    model.load_weights(ckpt.weights)
 The progress callback is called with
``("reading", f)`` while metadata and tokenizer are read, and with ``("weights", f)`` as tensors are
first materialized -- that is, during ``model.load_weights``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import attrs
import torch
from torch import Tensor

from helios.loaders.gguf_loader import BLOCK_TYPES, GGUFFile
from helios.loaders.gguf_reader import GGML_Q4_0, GGML_Q4_1
from helios.loaders.safetensors_loader import read_hf_directory
from helios.loaders.tokenizer import Tokenizer
from helios.models.architecture import Architecture, ArchitectureConfig
from helios.models.quant import BuildSource

ProgressCallback = Callable[[str, float], None]
_V = TypeVar("_V")


@attrs.frozen
class Checkpoint:
    model_id: str
    config: ArchitectureConfig
    architecture: Architecture
    """The `helios.models.registry` entry ``config`` belongs to (it builds the model)."""
    tensors: Mapping[str, Tensor]
    tokenizer: Tokenizer
    chat_template: str | None
    generation_config: dict[str, Any]
    source_path: str
    weights: Mapping[str, BuildSource]
    # Some decoder projections are stored as Q4_0/Q4_1 blocks, which an int4 format keeps as they are.
    int4_codes: bool = False
    # Some decoder projections are stored as K-quant / Q5_0 / Q5_1 blocks (`kquant.BlockQuantized`),
    # which a format with ``keep_blocks`` keeps as they are (with any Q8_0 beside them).
    block_codes: bool = False
    # Once the model is built: drop the resident pages of a memory-mapped file (GGUF), if any.
    release_pages: Callable[[], None] | None = None
    vision: VisionCheckpoint | None = None
    """A vision-language checkpoint's vision side (``tensors``/``weights`` are its text model's)."""


@attrs.frozen
class VisionCheckpoint:
    """What `helios.models.vision.registry.load_vision_tower` builds a vision tower from."""

    family: str
    config: dict[str, Any]
    preprocessor: dict[str, Any]
    processor: dict[str, Any]
    tensors: Mapping[str, Tensor]


class LazyTensors(Mapping[str, _V]):
    """Name -> tensor, produced on access (every access reads again: iterate once, keep what you need)."""

    def __init__(self, thunks: Mapping[str, Callable[[], _V]], progress: ProgressCallback | None = None) -> None:
        self._thunks: dict[str, Callable[[], _V]] = dict(thunks)
        self._progress = progress
        self._seen: set[str] = set()

    def __getitem__(self, name: str) -> _V:
        tensor = self._thunks[name]()
        if self._progress is not None and name not in self._seen:
            self._seen.add(name)
            self._progress("weights", len(self._seen) / len(self._thunks))
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._thunks)

    def __len__(self) -> int:
        return len(self._thunks)

    def __contains__(self, name: object) -> bool:
        return name in self._thunks


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32,
                    progress: ProgressCallback | None = None, header_cache: str | Path | None = None) -> Checkpoint:
    """Open a ``.gguf`` file or a Hugging Face model directory. ``header_cache``: a directory where
    a GGUF file's parsed header is kept for the next start (`gguf_reader.read_gguf`)."""
    source = Path(path).expanduser()
    if progress is not None:
        progress("reading", 0.0)
    if source.is_dir():
        checkpoint = _from_hf_directory(source, dtype, progress)
    elif source.is_file() and _is_gguf(source):
        checkpoint = _from_gguf(source, dtype, progress, header_cache)
    elif source.exists():
        raise ValueError(f"{source} is neither a GGUF file nor a model directory")
    else:
        raise FileNotFoundError(f"no model at {source}")
    if progress is not None:
        progress("reading", 1.0)
    return checkpoint


def _from_gguf(path: Path, dtype: torch.dtype, progress: ProgressCallback | None,
               header_cache: str | Path | None = None) -> Checkpoint:
    file = GGUFFile(path, header_cache)
    if progress is not None:
        progress("reading", 0.5)
    tokenizer = Tokenizer.from_gguf_metadata(file.metadata)
    generation_config: dict[str, Any] = {"eos_token_id": list(tokenizer.eos_token_ids)}
    if tokenizer.bos_token_id is not None:
        generation_config["bos_token_id"] = tokenizer.bos_token_id
    return Checkpoint(
        model_id=path.stem,  # the file name, as llama.cpp reports it; general.name is often a training tag
        config=file.config,
        architecture=file.architecture,
        tensors=LazyTensors(file.tensor_thunks(dtype), progress),
        tokenizer=tokenizer,
        chat_template=file.chat_template,
        generation_config=generation_config,
        source_path=str(path),
        weights=LazyTensors(file.weight_thunks(), progress),
        int4_codes=any(kind in (GGML_Q4_0, GGML_Q4_1) for name, kind in file.tensor_types.items()
                       if name.startswith("blk.")),
        block_codes=any(kind in BLOCK_TYPES for name, kind in file.tensor_types.items() if name.startswith("blk.")),
        release_pages=file.release_pages,
    )


def _from_hf_directory(path: Path, dtype: torch.dtype, progress: ProgressCallback | None) -> Checkpoint:
    directory = read_hf_directory(path, dtype)
    return Checkpoint(
        model_id=path.resolve().name,
        config=directory.config,
        architecture=directory.architecture,
        tensors=LazyTensors(directory.tensors, progress),
        tokenizer=directory.tokenizer,
        chat_template=directory.chat_template,
        generation_config=directory.generation_config,
        source_path=str(path),
        weights=LazyTensors(directory.tensors, progress),
        vision=None if directory.vision is None else VisionCheckpoint(
            family=directory.vision.family, config=directory.vision.config,
            preprocessor=directory.vision.preprocessor, processor=directory.vision.processor,
            tensors=LazyTensors(directory.vision.tensors)),
    )


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as fh:
        return fh.read(4) == b"GGUF"
