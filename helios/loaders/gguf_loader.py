"""GGUF files (llama.cpp's format): metadata -> ModelConfig and tokenizer, tensors -> HF names.

Tensors are dequantized to float32 with ``gguf.quants.dequantize`` (F32, F16, BF16, Q8_0, Q4_0,
Q4_1, Q4_K, Q5_K, Q6_K and the other types that package knows), renamed to Hugging Face names, and
the q/k projection rows of ``llama``-architecture files are put back from llama.cpp's interleaved
rotary order into the rotate-half (NeoX) order the model uses.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np
import torch
from torch import Tensor

from helios.models.config import ModelConfig
from helios.models.llama import rope_inv_freq

TensorThunk = Callable[[], Tensor]

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
    """An opened GGUF file: decoded metadata and lazily dequantized tensors."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._reader = gguf.GGUFReader(self.path)
        self.metadata: dict[str, Any] = {name: _field_value(field) for name, field in self._reader.fields.items()
                                         if not name.startswith("GGUF.")}
        self._tensors = {tensor.name: tensor for tensor in self._reader.tensors}
        self.config = self._build_config()

    @property
    def model_name(self) -> str | None:
        name = self.metadata.get("general.name")
        return str(name) if name else None

    @property
    def chat_template(self) -> str | None:
        template = self.metadata.get("tokenizer.chat_template")
        return str(template) if template else None

    def read_tensor(self, gguf_name: str) -> np.ndarray:
        """One tensor as float32, numpy layout (rows = outermost GGUF dimension)."""
        tensor = self._tensors[gguf_name]
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        array = np.asarray(array, dtype=np.float32).reshape(shape)
        return array if array.flags.writeable else array.copy()

    def tensor_thunks(self, dtype: torch.dtype) -> dict[str, TensorThunk]:
        """Hugging Face name -> function producing that tensor in ``dtype`` (dequantized on each call)."""
        cfg = self.config
        permute_heads: dict[str, int] = {}
        if self.metadata.get("general.architecture") == "llama":
            permute_heads = {"self_attn.q_proj": cfg.num_heads, "self_attn.k_proj": cfg.num_kv_heads}
        thunks: dict[str, TensorThunk] = {}
        for gguf_name in self._tensors:
            if gguf_name == _ROPE_FREQS:
                continue
            hf_name, heads = _hf_name(gguf_name, permute_heads)
            thunks[hf_name] = _make_thunk(self, gguf_name, heads, dtype)
        return thunks

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


def _make_thunk(file: GGUFFile, gguf_name: str, permute_heads: int | None, dtype: torch.dtype) -> TensorThunk:
    def load() -> Tensor:
        array = file.read_tensor(gguf_name)
        if permute_heads is not None:
            array = np.ascontiguousarray(unpermute_rotary_rows(array, permute_heads))
        return torch.from_numpy(array).to(dtype)

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


def _field_value(field: Any) -> Any:
    """A GGUF metadata field as a Python value (str, int, float, bool or list of them)."""
    if hasattr(field, "contents"):
        return field.contents()
    types = list(field.types)
    if not types:
        return None
    value_type = gguf.GGUFValueType
    if types[0] == value_type.ARRAY:
        if types[-1] == value_type.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == value_type.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    scalar = field.parts[field.data[0]].tolist()[0]
    return bool(scalar) if types[0] == value_type.BOOL else scalar
