"""Architecture hyper-parameters of the Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3).

`ModelConfig` is the llama family's config (`helios.models.registry` serves its four entries from
`helios.models.llama`). It is built from a Hugging Face ``config.json`` (`ModelConfig.from_hf_config`)
or from GGUF metadata (`ModelConfig.from_gguf`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import torch
from torch import Tensor

from helios.models.architecture import GGUFSource, gguf_key, gguf_kv_heads

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
"""The variants `ModelConfig` describes (its ``arch``; each a registry entry)."""
SUPPORTED_ROPE_TYPES = frozenset({"linear", "llama3"})
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class DecoderDims:
    """What the decoder families' configs share (`ModelConfig`, `gemma3.Gemma3Config`): the checks of
    their shape and the sizes derived from it."""

    if TYPE_CHECKING:
        vocab_size: int
        hidden_size: int
        intermediate_size: int
        num_layers: int
        num_heads: int
        num_kv_heads: int
        head_dim: int
        max_position_embeddings: int

    def check_dims(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def projection_params(self) -> int:
        """Weights in the decoder layers' projections (q, k, v, o, gate, up, down)."""
        per_layer = (self.q_size + 2 * self.kv_size) * self.hidden_size + self.hidden_size * self.q_size \
            + 3 * self.intermediate_size * self.hidden_size
        return int(self.num_layers * per_layer)


@attrs.frozen(kw_only=True)
class ModelConfig(DecoderDims):
    """Shape and numerics of one decoder-only transformer of the Llama family.

    ``rope_scaling`` is None for plain RoPE, or a dict whose ``"rope_type"`` is ``"linear"``
    (with ``"factor"``) or ``"llama3"`` (with ``"factor"``, ``"low_freq_factor"``,
    ``"high_freq_factor"`` and ``"original_max_position_embeddings"``).
    ``sliding_window`` is informational: no Helios attention backend applies it yet, so contexts
    longer than it differ from the reference (Mistral v0.1 only).
    """

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = attrs.field(default=None, hash=False)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None

    def __attrs_post_init__(self) -> None:
        if self.arch not in LLAMA_FAMILY:
            raise ValueError(f"architecture {self.arch!r} is not of the llama family ({', '.join(LLAMA_FAMILY)})")
        self.check_dims()
        check_rope_scaling(self.rope_scaling)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` (transformers 4.x and 5.x spellings)."""
        arch = str(config.get("model_type", ""))
        if arch not in LLAMA_FAMILY:
            raise ValueError(f"unsupported model_type {arch!r}; supported: {list(LLAMA_FAMILY)}")
        hidden_size = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        head_dim = config.get("head_dim") or hidden_size // num_heads
        rope_params: Mapping[str, Any] = config.get("rope_parameters") or {}
        rope_theta = config.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
        scaling = config.get("rope_scaling") or (rope_params if rope_params else None)
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.get('hidden_act')!r}")
        if config.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        sliding_window = config.get("sliding_window")
        if arch == "qwen2" and not config.get("use_sliding_window", False):
            sliding_window = None
        if arch == "qwen3" and not config.get("use_sliding_window", False):
            sliding_window = None
        return cls(
            arch=arch,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=normalize_rope_scaling(scaling),
            max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; its config.json does not say so.
            attention_bias=bool(config.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            sliding_window=int(sliding_window) if sliding_window else None,
        )


def check_rope_scaling(scaling: Mapping[str, Any] | None) -> None:
    """Raise ValueError unless ``scaling`` is None or a linear / Llama-3 rope scaling dict."""
    if scaling is not None:
        kind = scaling.get("rope_type")
        if kind not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: None, 'linear', 'llama3'")
        needed = ("factor",) if kind == "linear" else _LLAMA3_ROPE_KEYS
        missing = [key for key in needed if key not in scaling]
        if missing:
            raise ValueError(f"rope_scaling {kind!r} lacks {missing}")


def normalize_rope_scaling(scaling: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Canonical form of a rope scaling dict: None for plain RoPE, else with a ``"rope_type"`` key.

    Accepts the legacy ``"type"`` key and transformers 5's ``rope_parameters`` (which also holds
    ``rope_theta``, dropped here).
    """
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return None
    out = {key: value for key, value in scaling.items() if key not in ("type", "rope_theta")}
    out["rope_type"] = kind
    if kind == "linear" and float(out.get("factor", 1.0)) == 1.0:
        return None
    return out


# -- GGUF metadata -------------------------------------------------------------------------------------

ROPE_FREQS = "rope_freqs.weight"
"""llama.cpp's per-frequency RoPE divisors (Llama 3.1+): metadata, not a weight."""


def config_from_gguf(source: GGUFSource, arch: str) -> ModelConfig:
    """A llama-family config (``arch``) from GGUF metadata (keys under ``general.architecture``'s
    prefix) and the file's tensor names."""
    meta = source.metadata
    tensors = source.tensor_shapes
    prefix = str(meta.get("general.architecture"))
    key = gguf_key(source)

    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    num_kv_heads = gguf_kv_heads(key, num_heads)
    head_dim = int(key("attention.key_length", hidden // num_heads))
    rope_dims = meta.get(f"{prefix}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise NotImplementedError(f"partial rotary embeddings ({rope_dims} of {head_dim}) are not supported")
    vocab = meta.get(f"{prefix}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or []) \
        or int(tensors["token_embd.weight"][-1])
    ffn = key("feed_forward_length")
    if isinstance(ffn, list):
        ffn = ffn[0]
    return ModelConfig(
        arch=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(ffn),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(num_kv_heads),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(source, prefix, head_dim),
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
    )


def _gguf_rope_scaling(source: GGUFSource, prefix: str, head_dim: int) -> dict[str, Any] | None:
    meta = source.metadata
    kind = meta.get(f"{prefix}.rope.scaling.type")
    factor = float(meta.get(f"{prefix}.rope.scaling.factor") or 0.0)
    if kind == "linear" and factor > 0:
        return {"rope_type": "linear", "factor": factor}
    if kind not in (None, "none", "linear"):
        raise NotImplementedError(f"GGUF rope scaling {kind!r} is not supported")
    if ROPE_FREQS in source.tensor_shapes:
        # Llama 3.1+: llama.cpp stores the per-frequency divisors instead of the parameters.
        divisors = source.read_tensor(ROPE_FREQS).reshape(-1)
        original = int(meta.get(f"{prefix}.rope.scaling.original_context_length") or 8192)
        return _infer_llama3_scaling(divisors, float(meta.get(f"{prefix}.rope.freq_base", 10000.0)),
                                     head_dim, original)
    return None


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


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse RoPE frequencies [head_dim // 2] in float32, with linear or Llama-3 scaling applied."""
    return inv_freq_of(config.head_dim, config.rope_theta, config.rope_scaling)


def inv_freq_of(dim: int, theta: float, scaling: Mapping[str, Any] | None) -> Tensor:
    """Inverse RoPE frequencies [dim // 2] in float32 for base ``theta``, with a `normalize_rope_scaling`
    dict's linear or Llama-3 scaling applied (None: plain RoPE)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # Llama 3: long wavelengths are slowed down by `factor`, short ones kept, the band between
    # interpolated smoothly in 1/wavelength.
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(is_medium, blended, scaled)


def yarn_inv_freq(dim: int, theta: float, scaling: Mapping[str, Any],
                  max_position_embeddings: int | None = None) -> tuple[Tensor, float]:
    """YaRN's inverse RoPE frequencies [dim // 2] (float32) and its attention factor (cos and sin
    are multiplied by it), as transformers' ``_compute_yarn_parameters``: the frequencies blend
    interpolation (divided by ``factor``) and extrapolation over a linear ramp between the
    correction dimensions of ``beta_fast`` and ``beta_slow`` rotations in
    ``original_max_position_embeddings`` (floored / ceiled unless ``truncate`` is false). Not part
    of `check_rope_scaling`: only families that apply the attention factor use it (gpt-oss)."""
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else float(max_position_embeddings or original) / original
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, float(mscale)) / get_mscale(factor, float(mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the extrapolation's share
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)
