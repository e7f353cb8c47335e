"""GGUF files (llama.cpp's format): metadata -> the family's config and a tokenizer, tensors -> the
family's names.

The header is parsed by `helios.loaders.gguf_reader` and tensor data is memory-mapped. The
architecture is the registry's entry for ``general.architecture`` (`helios.models.registry.for_gguf`):
its parser builds the config from the metadata, and its tensor map renames each tensor (and says
which q/k projections llama.cpp stored in interleaved rotary order, put back here into the
rotate-half order, `unpermute_rotary_rows`). Each tensor is read in one of two forms:

* `GGUFFile.weight_thunks`: the checkpoint's own form. Q4_0, Q4_1 and Q8_0 blocks become
  `GroupQuantized` codes (unpacked in torch, bit for bit), so a quantized weight format can keep them;
  Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1 matrices stay `kquant.BlockQuantized` (the file's bytes, for
  `kquant.KQuantLinear`; a format with ``keep_blocks`` turns Q8_0 codes back into blocks beside them);
  F32, F16 and BF16 tensors stay dense in their dtype (I32 ones, index tables such as DeepSeek V4's
  ``tid2eid``, stay int32); a stacked [experts, rows, cols] tensor in one
  of these block types (an MoE's ``ffn_*_exps``) is a `quant.StackedExperts`, each expert read from its
  own byte range in the form above; other types are dequantized to float32 by ``gguf.quants``.
* `GGUFFile.tensor_thunks`: everything dense in one dtype (the dequantization of the above,
  equal to ``gguf.quants.dequantize`` bit for bit); integer tensors stay integers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from helios.loaders.gguf_reader import (
    GGML_BF16,
    GGML_F16,
    GGML_F32,
    GGML_I32,
    GGML_Q4_0,
    GGML_Q4_1,
    GGML_Q8_0,
    GGUFTensorInfo,
    block_layout,
    read_gguf,
)
from helios.models import registry
from helios.models.architecture import Architecture, ArchitectureConfig
from helios.models.kquant import BlockQuantized
from helios.models.quant import BuildSource, GroupQuantized, StackedExperts, dense_of

TensorThunk = Callable[[], Tensor]
SourceThunk = Callable[[], BuildSource]
# ggml types kept as `BlockQuantized` (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K); Q8_0 stays `GroupQuantized` codes.
BLOCK_TYPES = (6, 7, 12, 13, 14)

class GGUFFile:
    """An opened GGUF file: decoded metadata and lazily read tensors."""

    def __init__(self, path: str | Path, header_cache: str | Path | None = None) -> None:
        """``header_cache``: a directory keeping the parsed header (`gguf_reader.read_gguf`)."""
        self.path = Path(path)
        self._contents = read_gguf(self.path, header_cache)
        self.metadata: dict[str, Any] = self._contents.metadata
        self._tensors: dict[str, GGUFTensorInfo] = self._contents.tensors
        self.architecture: Architecture = registry.for_gguf(str(self.metadata.get("general.architecture")))
        self.config: ArchitectureConfig = self.architecture.parse_gguf(self)

    def release_pages(self) -> None:
        """`GGUFContents.release_pages`: call once the model's weights are built."""
        self._contents.release_pages()

    @property
    def model_name(self) -> str | None:
        name = self.metadata.get("general.name")
        return str(name) if name else None

    @property
    def chat_template(self) -> str | None:
        template = self.metadata.get("tokenizer.chat_template")
        return str(template) if template else None

    @property
    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """GGUF tensor name -> shape (outermost dimension first)."""
        return {name: info.shape for name, info in self._tensors.items()}

    @property
    def tensor_types(self) -> dict[str, int]:
        """GGUF tensor name -> ggml type."""
        return {name: info.ggml_type for name, info in self._tensors.items()}

    def read_source(self, gguf_name: str) -> BuildSource:
        """One tensor in the checkpoint's own form (rows = outermost GGUF dimension): `GroupQuantized`
        for Q4_0/Q4_1/Q8_0, `BlockQuantized` for Q4_K/Q5_K/Q6_K/Q5_0/Q5_1 matrices (a view of the
        memory-mapped file: no copy), the stored dtype for F32/F16/BF16/I32, float32 for other types."""
        info = self._tensors[gguf_name]
        raw = self._contents.tensor_bytes(info)
        kind = info.ggml_type
        if kind == GGML_F32:
            return raw.view(torch.float32).reshape(info.shape).clone()
        if kind == GGML_F16:
            return raw.view(torch.float16).reshape(info.shape).clone()
        if kind == GGML_BF16:
            return raw.view(torch.bfloat16).reshape(info.shape).clone()
        if kind == GGML_I32:
            return raw.view(torch.int32).reshape(info.shape).clone()
        if kind in (GGML_Q4_0, GGML_Q4_1, GGML_Q8_0) and len(info.shape) == 2:
            return unpack_blocks(raw, kind, info.shape)
        if kind in BLOCK_TYPES and len(info.shape) == 2:
            return BlockQuantized.from_bytes(raw, kind, (info.shape[0], info.shape[1]))
        if kind in (GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, *BLOCK_TYPES) and len(info.shape) == 3:
            return stacked_experts(raw, kind, (info.shape[0], info.shape[1], info.shape[2]))
        return torch.from_numpy(_numpy_dequantize(raw, info))

    def read_tensor(self, gguf_name: str) -> np.ndarray:
        """One tensor as float32, numpy layout (rows = outermost GGUF dimension)."""
        return dense_of(self.read_source(gguf_name)).to(torch.float32).numpy()

    def weight_thunks(self) -> dict[str, SourceThunk]:
        """The family's name -> function producing that weight in the checkpoint's form (`read_source`)."""
        thunks: dict[str, SourceThunk] = {}
        for gguf_name, hf_name, heads in self._names():
            thunks[hf_name] = _make_source_thunk(self, gguf_name, heads)
        return thunks

    def tensor_thunks(self, dtype: torch.dtype) -> dict[str, TensorThunk]:
        """The family's name -> function producing that tensor in ``dtype`` (dequantized on each call)."""
        thunks: dict[str, TensorThunk] = {}
        for gguf_name, hf_name, heads in self._names():
            thunks[hf_name] = _make_thunk(self, gguf_name, heads, dtype)
        return thunks

    def _names(self) -> list[tuple[str, str, int | None]]:
        """(GGUF name, the family's name, heads to un-permute the rows of or None) per loaded tensor."""
        out = []
        for gguf_name in self._tensors:
            target = self.architecture.gguf_name(self.config, gguf_name)
            if target is not None:
                out.append((gguf_name, target.name, target.rotary_heads))
        return out


def unpermute_rotary_rows(weight: Tensor | np.ndarray, num_heads: int) -> Any:
    """Undo llama.cpp's q/k row permutation (interleaved rotary pairs -> rotate-half halves).

    Per head, llama.cpp orders the rows as (r0, r_half, r1, r_half+1, ...); this restores
    (r0, r1, ..., r_half, ...). Works on [rows, cols] weights and [rows] biases.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    rest = tuple(weight.shape[1:])
    if isinstance(weight, np.ndarray):
        return weight.reshape(num_heads, half, 2, *rest).swapaxes(1, 2).reshape(weight.shape)
    return weight.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape)


def permute_rotary_rows(weight: Tensor | np.ndarray, num_heads: int) -> Any:
    """llama.cpp's permutation (the inverse of `unpermute_rotary_rows`); for tests and writers."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    rest = tuple(weight.shape[1:])
    if isinstance(weight, np.ndarray):
        return weight.reshape(num_heads, 2, half, *rest).swapaxes(1, 2).reshape(weight.shape)
    return weight.reshape(num_heads, 2, half, *rest).transpose(1, 2).reshape(weight.shape)


def unpack_blocks(raw: Tensor, ggml_type: int, shape: tuple[int, ...]) -> GroupQuantized:
    """Q4_0 / Q4_1 / Q8_0 blocks (raw bytes of a [rows, cols] tensor) -> `GroupQuantized`, in torch.

    Q4_0: float16 d, 16 bytes of nibbles (element j in the low nibble of byte j, element j + 16 in the
    high one); w = d (q - 8). Q4_1: float16 d, float16 m, the same nibbles; w = d q + m. Q8_0: float16 d,
    32 int8; w = d q."""
    rows, cols = shape
    per_block, block_bytes = block_layout(ggml_type)
    blocks = raw.view(rows * cols // per_block, block_bytes)
    groups = (rows, cols // per_block)
    d = blocks[:, 0:2].contiguous().view(torch.float16).to(torch.float32).view(groups)
    if ggml_type == GGML_Q8_0:
        codes = blocks[:, 2:].contiguous().view(torch.int8).view(rows, cols)
        return GroupQuantized(codes, d, torch.zeros_like(d), bits=8, group_size=per_block)
    if ggml_type == GGML_Q4_1:
        offset = blocks[:, 2:4].contiguous().view(torch.float16).to(torch.float32).view(groups)
        nibbles = blocks[:, 4:]
    else:
        offset = d * -8
        nibbles = blocks[:, 2:]
    codes = torch.empty(blocks.shape[0], per_block, dtype=torch.uint8)
    torch.bitwise_and(nibbles, 0x0F, out=codes[:, : per_block // 2])
    torch.bitwise_right_shift(nibbles, 4, out=codes[:, per_block // 2 :])
    return GroupQuantized(codes.view(rows, cols), d, offset, bits=4, group_size=per_block)


def stacked_experts(raw: Tensor, ggml_type: int, shape: tuple[int, int, int]) -> StackedExperts:
    """A stacked [experts, rows, cols] tensor of blocks (raw bytes) whose expert e is read as a 2-D
    tensor of its type is (`unpack_blocks` codes, `BlockQuantized` blocks), from its own byte range."""
    experts, rows, cols = shape
    per_expert = raw.reshape(experts, -1)

    def read(e: int) -> GroupQuantized | BlockQuantized:
        if ggml_type in BLOCK_TYPES:
            return BlockQuantized.from_bytes(per_expert[e], ggml_type, (rows, cols))
        return unpack_blocks(per_expert[e], ggml_type, (rows, cols))

    return StackedExperts(shape, ggml_type, int(raw.numel()), read)


def _numpy_dequantize(raw: Tensor, info: GGUFTensorInfo) -> np.ndarray:
    """Types Helios does not unpack itself, through ``gguf.quants`` (float32, numpy layout)."""
    import gguf

    rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
    array = gguf.quants.dequantize(raw.numpy().reshape(rows, -1), gguf.GGMLQuantizationType(info.ggml_type))
    return np.asarray(array, dtype=np.float32).reshape(info.shape)


def _make_source_thunk(file: GGUFFile, gguf_name: str, permute_heads: int | None) -> SourceThunk:
    def load() -> BuildSource:
        value = file.read_source(gguf_name)
        if permute_heads is None:
            return value
        if isinstance(value, (GroupQuantized, BlockQuantized)):
            rows = torch.arange(value.shape[0])
            return value.take_rows(unpermute_rotary_rows(rows, permute_heads))
        if isinstance(value, StackedExperts):
            raise ValueError(f"{gguf_name}: stacked expert tensors have no rotary rows to un-permute")
        return unpermute_rotary_rows(value, permute_heads).contiguous()

    return load


def _make_thunk(file: GGUFFile, gguf_name: str, permute_heads: int | None, dtype: torch.dtype) -> TensorThunk:
    source = _make_source_thunk(file, gguf_name, permute_heads)

    def load() -> Tensor:
        value = dense_of(source())
        return value.to(dtype) if value.is_floating_point() else value  # index tables stay integers

    return load
