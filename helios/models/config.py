"""Architecture hyper-parameters of the Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3).

`ModelConfig` is the one description the model, the loaders and the engine share. It is built from a
Hugging Face ``config.json`` (`ModelConfig.from_hf_config`) or from GGUF metadata (see
`helios.loaders.gguf_loader`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

SUPPORTED_ARCHS = frozenset({"llama", "mistral", "qwen2", "qwen3"})
SUPPORTED_ROPE_TYPES = frozenset({"linear", "llama3"})
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@attrs.frozen(kw_only=True)
class ModelConfig:
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
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported architecture {self.arch!r}; supported: {sorted(SUPPORTED_ARCHS)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type")
            if kind not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: None, 'linear', 'llama3'")
            needed = ("factor",) if kind == "linear" else _LLAMA3_ROPE_KEYS
            missing = [key for key in needed if key not in self.rope_scaling]
            if missing:
                raise ValueError(f"rope_scaling {kind!r} lacks {missing}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` (transformers 4.x and 5.x spellings)."""
        arch = str(config.get("model_type", ""))
        if arch not in SUPPORTED_ARCHS:
            raise ValueError(f"unsupported model_type {arch!r}; supported: {sorted(SUPPORTED_ARCHS)}")
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
