"""GGUF files (llama.cpp's format): metadata -> ModelConfig and tokenizer, tensors -> HF names.

The header is parsed by `helios.loaders.gguf_reader` and tensor data is memory-mapped. Each tensor
is read in one of two forms, renamed to its Hugging Face name, with the q/k projection rows of
``llama``-architecture files put back from llama.cpp's interleaved rotary order into the
rotate-half (NeoX) order the model uses:

* `GGUFFile.weight_thunks`: the checkpoint's own form. Q4_0, Q4_1 and Q8_0 blocks become
  `GroupQuantized` codes (unpacked in torch, bit for bit), so a quantized weight format can keep them;
  F32, F16 and BF16 tensors stay dense in their dtype; other types (K-quants, Q5_x, ...) are
  dequantized to float32 by ``gguf.quants``.
* `GGUFFile.tensor_thunks`: everything dense in one dtype (the dequantization of the above,
  equal to ``gguf.quants.dequantize`` bit for bit).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from torch import Tensor

from helios.loaders.gguf_reader import (
    GGML_BF16,
    GGML_F16,
    GGML_F32,
    GGML_Q4_0,
    GGML_Q4_1,
    GGML_Q8_0,
    GGUFTensorInfo,
    block_layout,
    read_gguf,
)
from helios.models.config import ModelConfig
from helios.models.llama import rope_inv_freq
from helios.models.quant import GroupQuantized, WeightSource, dense_of

TensorThunk = Callable[[], Tensor]
SourceThunk = Callable[[], WeightSource]

_GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"


class GGUFFile:
    """An opened GGUF file: decoded metadata and lazily read tensors."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._contents = read_gguf(self.path)
        self.metadata: dict[str, Any] = self._contents.metadata
        self._tensors: dict[str, GGUFTensorInfo] = self._contents.tensors
        self.config = self._build_config()

    @property
    def model_name(self) -> str | None:
        name = self.metadata.get("general.name")
        return str(name) if name else None

    @property
    def chat_template(self) -> str | None:
        template = self.metadata.get("tokenizer.chat_template")
        return str(template) if template else None

    @property
    def tensor_types(self) -> dict[str, int]:
        """GGUF tensor name -> ggml type."""
        return {name: info.ggml_type for name, info in self._tensors.items()}

    def read_source(self, gguf_name: str) -> WeightSource:
        """One tensor in the checkpoint's own form (rows = outermost GGUF dimension): `GroupQuantized`
        for Q4_0/Q4_1/Q8_0, the stored dtype for F32/F16/BF16, float32 for other types."""
        info = self._tensors[gguf_name]
        raw = self._contents.tensor_bytes(info)
        kind = info.ggml_type
        if kind == GGML_F32:
            return raw.view(torch.float32).reshape(info.shape).clone()
        if kind == GGML_F16:
            return raw.view(torch.float16).reshape(info.shape).clone()
        if kind == GGML_BF16:
            return raw.view(torch.bfloat16).reshape(info.shape).clone()
        if kind in (GGML_Q4_0, GGML_Q4_1, GGML_Q8_0) and len(info.shape) == 2:
            return unpack_blocks(raw, kind, info.shape)
        return torch.from_numpy(_numpy_dequantize(raw, info))

    def read_tensor(self, gguf_name: str) -> np.ndarray:
        """One tensor as float32, numpy layout (rows = outermost GGUF dimension)."""
        return dense_of(self.read_source(gguf_name)).to(torch.float32).numpy()

    def weight_thunks(self) -> dict[str, SourceThunk]:
        """Hugging Face name -> function producing that weight in the checkpoint's form (`read_source`)."""
        thunks: dict[str, SourceThunk] = {}
        for gguf_name, hf_name, heads in self._names():
            thunks[hf_name] = _make_source_thunk(self, gguf_name, heads)
        return thunks

    def tensor_thunks(self, dtype: torch.dtype) -> dict[str, TensorThunk]:
        """Hugging Face name -> function producing that tensor in ``dtype`` (dequantized on each call)."""
        thunks: dict[str, TensorThunk] = {}
        for gguf_name, hf_name, heads in self._names():
            thunks[hf_name] = _make_thunk(self, gguf_name, heads, dtype)
        return thunks

    def _names(self) -> list[tuple[str, str, int | None]]:
        """(GGUF name, Hugging Face name, heads to un-permute the rows of or None) per tensor."""
        cfg = self.config
        permute_heads: dict[str, int] = {}
        if self.metadata.get("general.architecture") == "llama":
            permute_heads = {"self_attn.q_proj": cfg.num_heads, "self_attn.k_proj": cfg.num_kv_heads}
        out = []
        for gguf_name in self._tensors:
            if gguf_name == _ROPE_FREQS:
                continue
            hf_name, heads = _hf_name(gguf_name, permute_heads)
            out.append((gguf_name, hf_name, heads))
        return out

    def _build_config(self) -> ModelConfig:
        meta = self.metadata
        arch = str(meta.get("general.architecture"))
        if arch not in _GGUF_ARCHS:
            raise NotImplementedError(f"GGUF architecture {arch!r} is not supported (llama, qwen2, qwen3)")

        def key(name: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{name}", default)
            if value is None:
                raise ValueError(f"GGUF metadata lacks {arch}.{name}")
            return value

        hidden = int(key("embedding_length"))
        num_heads = int(key("attention.head_count"))
        num_kv_heads = key("attention.head_count_kv", num_heads)
        if isinstance(num_kv_heads, list):
            if len(set(num_kv_heads)) != 1:
                raise NotImplementedError("per-layer kv head counts are not supported")
            num_kv_heads = num_kv_heads[0]
        head_dim = int(key("attention.key_length", hidden // num_heads))
        rope_dims = meta.get(f"{arch}.rope.dimension_count")
        if rope_dims is not None and int(rope_dims) != head_dim:
            raise NotImplementedError(f"partial rotary embeddings ({rope_dims} of {head_dim}) are not supported")
        vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or []) \
            or int(self._tensors["token_embd.weight"].shape[-1])
        ffn = key("feed_forward_length")
        if isinstance(ffn, list):
            ffn = ffn[0]
        return ModelConfig(
            arch=_GGUF_ARCHS[arch],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(ffn),
            num_layers=int(key("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(num_kv_heads),
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=self._rope_scaling(arch, head_dim),
            max_position_embeddings=int(key("context_length", 4096)),
            tie_word_embeddings="output.weight" not in self._tensors,
            attention_bias="blk.0.attn_q.bias" in self._tensors,
            qk_norm="blk.0.attn_q_norm.weight" in self._tensors,
        )

    def _rope_scaling(self, arch: str, head_dim: int) -> dict[str, Any] | None:
        meta = self.metadata
        kind = meta.get(f"{arch}.rope.scaling.type")
        factor = float(meta.get(f"{arch}.rope.scaling.factor") or 0.0)
        if kind == "linear" and factor > 0:
            return {"rope_type": "linear", "factor": factor}
        if kind not in (None, "none", "linear"):
            raise NotImplementedError(f"GGUF rope scaling {kind!r} is not supported")
        if _ROPE_FREQS in self._tensors:
            # Llama 3.1+: llama.cpp stores the per-frequency divisors instead of the parameters.
            divisors = self.read_tensor(_ROPE_FREQS).reshape(-1)
            original = int(meta.get(f"{arch}.rope.scaling.original_context_length") or 8192)
            return _infer_llama3_scaling(divisors, float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
                                         head_dim, original)
        return None


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


def gguf_to_hf_name(gguf_name: str) -> str:
    name, _ = _hf_name(gguf_name, {})
    return name


def _hf_name(gguf_name: str, permute_heads: Mapping[str, int]) -> tuple[str, int | None]:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name], None
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise NotImplementedError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart here")
    layer, part, kind = match.groups()
    module = _LAYER_NAMES[part]
    return f"model.layers.{layer}.{module}.{kind}", permute_heads.get(module)


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


def _numpy_dequantize(raw: Tensor, info: GGUFTensorInfo) -> np.ndarray:
    """Types Helios does not unpack itself, through ``gguf.quants`` (float32, numpy layout)."""
    import gguf

    rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
    array = gguf.quants.dequantize(raw.numpy().reshape(rows, -1), gguf.GGMLQuantizationType(info.ggml_type))
    return np.asarray(array, dtype=np.float32).reshape(info.shape)


def _make_source_thunk(file: GGUFFile, gguf_name: str, permute_heads: int | None) -> SourceThunk:
    def load() -> WeightSource:
        value = file.read_source(gguf_name)
        if permute_heads is None:
            return value
        if isinstance(value, GroupQuantized):
            rows = torch.arange(value.shape[0])
            return value.take_rows(unpermute_rotary_rows(rows, permute_heads))
        return unpermute_rotary_rows(value, permute_heads).contiguous()

    return load


def _make_thunk(file: GGUFFile, gguf_name: str, permute_heads: int | None, dtype: torch.dtype) -> TensorThunk:
    source = _make_source_thunk(file, gguf_name, permute_heads)

    def load() -> Tensor:
        return dense_of(source()).to(dtype)

    return load


def _infer_llama3_scaling(divisors: np.ndarray, theta: float, head_dim: int, original: int) -> dict[str, Any]:
    """Recover Llama-3 rope parameters from llama.cpp's per-frequency divisors."""
    base = ModelConfig(arch="llama", vocab_size=1, hidden_size=head_dim, intermediate_size=1, num_layers=1,
                       num_heads=1, num_kv_heads=1, head_dim=head_dim, rope_theta=theta)
    plain = rope_inv_freq(base).numpy()
    factor = float(divisors.max())
    for low, high in ((1.0, 4.0), (1.0, 2.0), (2.0, 4.0)):
        candidate = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                     "original_max_position_embeddings": original}
        scaled = rope_inv_freq(attrs.evolve(base, rope_scaling=candidate)).numpy()
        if np.allclose(plain / scaled, divisors, rtol=1e-3, atol=1e-3):
            return candidate
    raise NotImplementedError("GGUF rope_freqs do not match any known Llama-3 rope scaling")
