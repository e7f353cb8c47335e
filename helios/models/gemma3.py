"""Gemma 3 text decoder (transformers' ``gemma3_text`` / ``Gemma3ForCausalLM``; llama.cpp's ``gemma3``).

What differs from the Llama family (`helios.models.llama`), all as transformers 5's
``modeling_gemma3`` computes it:

- interleaved sliding-window and global layers (``layer_types``, or the older
  ``sliding_window_pattern``: every n-th layer global). Sliding layers declare a `SlidingWindowSpec`
  (a query at position p sees keys p - window + 1 .. p), global ones a `FullAttentionSpec`;
- two RoPE tables: sliding layers use the local base (``rope_local_base_freq``, 10,000), global
  layers the global base with its scaling (e.g. linear x8 on the larger models);
- RMSNorm with (1 + weight): the model keeps 1 + w in float32 (added on load from Hugging Face
  weights; llama.cpp's GGUF files store 1 + w already, `Gemma3Config.norms_shifted`), so the norm is
  the llama one, x * rsqrt(mean(x^2) + eps) * (1 + w), computed in float32;
- q/k RMSNorm per head before RoPE; attention scale ``query_pre_attn_scalar ** -0.5``;
- sandwich norms: post-attention and pre/post-feedforward norms around the attention and the MLP;
- the embedding scaled by sqrt(hidden_size) (rounded to the model dtype first, as transformers does);
- a GELU (tanh) gated MLP; tied embeddings; optional final logit soft cap (tanh(x / c) * c).

The embedding, output projection, fused q/k/v and gate/up projections in any `WeightFormat`, packed
state and CPU packing are `helios.models.decoder.FusedDecoderLM`'s (shared with the llama family).
Attention logit soft capping (Gemma 2) needs an attention backend that applies it: a config that
sets it is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from helios.models import cpu_kernels
from helios.models.architecture import (
    Architecture,
    ArchitectureConfig,
    BuildOptions,
    GGUFSource,
    GGUFTensor,
    gguf_key,
    gguf_kv_heads,
)
from helios.models.config import DecoderDims, check_rope_scaling, inv_freq_of, normalize_rope_scaling
from helios.models.decoder import (
    PROJECTIONS,
    DecoderLayer,
    FusedDecoderLM,
    add_rms_norm,
    apply_rope,
    broadcast_qk_norm,
    param,
    rms_norm,
    rope_tables,
)
from helios.models.interface import AttentionContext, CacheSpec, FullAttentionSpec, SlidingWindowSpec
from helios.models.llama import gguf_to_hf_name
from helios.models.quant import DenseLinear, UnloadedLinear, WeightFormat

__all__ = ["ARCHITECTURES", "GGUF_LAYER_NAMES", "Gemma3Config", "Gemma3ForCausalLM"]

_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")
_DEFAULT_PATTERN = 6  # transformers' and llama.cpp's default: every 6th layer global


@attrs.frozen(kw_only=True)
class Gemma3Config(DecoderDims):
    """Shape and numerics of a Gemma 3 text decoder.

    ``sliding_layers``: per layer, True for a sliding-window layer (window ``sliding_window``), False
    for a global one. ``rope_theta`` / ``rope_scaling``: the global layers' RoPE (``rope_scaling`` in
    `normalize_rope_scaling` form); ``rope_local_theta``: the sliding layers' base (no scaling).
    ``norms_shifted``: the checkpoint's norm weights are 1 + w already (llama.cpp's GGUF conversion),
    not transformers' w."""

    arch: str = "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_layers: tuple[bool, ...]
    sliding_window: int | None = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = attrs.field(default=None, hash=False)
    rope_local_theta: float = 10_000.0
    query_pre_attn_scalar: float = 256.0
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 131_072
    tie_word_embeddings: bool = True
    norms_shifted: bool = False

    def __attrs_post_init__(self) -> None:
        self.check_dims()
        if len(self.sliding_layers) != self.num_layers:
            raise ValueError(f"sliding_layers has {len(self.sliding_layers)} entries for {self.num_layers} layers")
        if any(self.sliding_layers) and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError(f"sliding layers need a positive sliding_window, got {self.sliding_window}")
        check_rope_scaling(self.rope_scaling)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> Gemma3Config:
        """From a ``config.json`` of ``gemma3_text``, or of ``gemma3`` with its ``text_config`` (a
        Gemma3ForCausalLM checkpoint); transformers 4.x and 5.x spellings."""
        if isinstance(config.get("text_config"), Mapping):
            config = config["text_config"]
        activation = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
        if activation not in _ACTIVATIONS:
            raise ValueError(f"unsupported hidden_activation {activation!r}; supported: {list(_ACTIVATIONS)}")
        if config.get("attn_logit_softcapping") is not None:
            raise NotImplementedError("attn_logit_softcapping is set: attention logit soft capping needs attention "
                                      "backend support, which Helios does not have")
        if config.get("use_bidirectional_attention"):
            raise NotImplementedError("use_bidirectional_attention=True is not supported (causal decoding only)")
        if config.get("attention_bias"):
            raise NotImplementedError("attention_bias=True is not supported for gemma3")
        num_layers = int(config.get("num_hidden_layers", 26))
        layer_types = config.get("layer_types")
        if layer_types:
            unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
            if unknown:
                raise ValueError(f"unsupported layer_types {unknown}")
            sliding = tuple(kind == "sliding_attention" for kind in layer_types)
        else:
            pattern = int(config.get("sliding_window_pattern") or config.get("_sliding_window_pattern")
                          or _DEFAULT_PATTERN)
            sliding = tuple(bool((i + 1) % pattern) for i in range(num_layers))
        rope_params: Mapping[str, Any] = config.get("rope_parameters") or {}
        if "full_attention" in rope_params or "sliding_attention" in rope_params:  # transformers 5
            global_rope: Mapping[str, Any] = rope_params.get("full_attention") or {}
            local_rope: Mapping[str, Any] = rope_params.get("sliding_attention") or {}
        else:
            global_rope = {**(config.get("rope_scaling") or {}), **rope_params}
            local_rope = {}
        local_scaling = normalize_rope_scaling(local_rope)
        if local_scaling is not None:
            raise NotImplementedError(f"rope scaling on the sliding layers ({local_scaling}) is not supported")
        hidden = int(config.get("hidden_size", 2304))
        num_heads = int(config.get("num_attention_heads", 8))
        window = config.get("sliding_window", 4096)
        softcap = config.get("final_logit_softcapping")
        return cls(
            vocab_size=int(config.get("vocab_size", 262_208)),
            hidden_size=hidden,
            intermediate_size=int(config.get("intermediate_size", 9216)),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or 4),
            head_dim=int(config.get("head_dim") or 256),
            sliding_layers=sliding,
            sliding_window=int(window) if window else None,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(global_rope.get("rope_theta") or config.get("rope_theta") or 1_000_000.0),
            rope_scaling=normalize_rope_scaling(global_rope),
            rope_local_theta=float(local_rope.get("rope_theta") or config.get("rope_local_base_freq") or 10_000.0),
            query_pre_attn_scalar=float(config.get("query_pre_attn_scalar", 256)),
            final_logit_softcapping=float(softcap) if softcap else None,
            max_position_embeddings=int(config.get("max_position_embeddings") or 131_072),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        )


def config_from_gguf(source: GGUFSource) -> Gemma3Config:
    """A Gemma 3 config from llama.cpp's ``gemma3`` metadata, read as llama.cpp's ``llama_model_gemma3``
    does: ``attention.sliding_window`` (absent or 0: every layer global), the pattern
    ``attention.sliding_window_pattern`` (a period, or one flag per layer; default 6),
    ``rope.freq_base`` (global layers) and ``rope.freq_base_swa`` (sliding, default 10,000),
    ``final_logit_softcapping``. The attention scale is not stored: llama.cpp uses 1/sqrt(head_dim),
    and 1/sqrt(hidden / heads) for the 27B model (62 layers), which are its query_pre_attn_scalar.
    The norm weights are stored as 1 + w."""
    meta = source.metadata
    tensors = source.tensor_shapes
    prefix = str(meta.get("general.architecture"))
    key = gguf_key(source)

    hidden = int(key("embedding_length"))
    num_layers = int(key("block_count"))
    num_heads = int(key("attention.head_count"))
    num_kv_heads = gguf_kv_heads(key, num_heads)
    head_dim = int(key("attention.key_length", 256))
    ffn = key("feed_forward_length")
    if isinstance(ffn, list):
        ffn = ffn[0]
    window = int(meta.get(f"{prefix}.attention.sliding_window") or 0)
    pattern = meta.get(f"{prefix}.attention.sliding_window_pattern", _DEFAULT_PATTERN)
    if window <= 0:
        sliding: tuple[bool, ...] = (False,) * num_layers
    elif isinstance(pattern, list):
        sliding = tuple(bool(flag) for flag in pattern)
    else:
        period = int(pattern)
        sliding = tuple(period == 0 or i % period < period - 1 for i in range(num_layers))
    scaling_kind = meta.get(f"{prefix}.rope.scaling.type")
    factor = float(meta.get(f"{prefix}.rope.scaling.factor") or 0.0)
    if scaling_kind not in (None, "none", "linear"):
        raise NotImplementedError(f"GGUF rope scaling {scaling_kind!r} is not supported")
    softcap = meta.get(f"{prefix}.final_logit_softcapping")
    if meta.get(f"{prefix}.attn_logit_softcapping"):
        raise NotImplementedError("attn_logit_softcapping is set: attention logit soft capping needs attention "
                                  "backend support, which Helios does not have")
    return Gemma3Config(
        vocab_size=int(tensors["token_embd.weight"][0]),
        hidden_size=hidden,
        intermediate_size=int(ffn),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(num_kv_heads),
        head_dim=head_dim,
        sliding_layers=sliding,
        sliding_window=window if window > 0 else None,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 1_000_000.0)),
        rope_scaling={"rope_type": "linear", "factor": factor} if scaling_kind == "linear" and factor not in (0.0, 1.0)
        else None,
        rope_local_theta=float(key("rope.freq_base_swa", 10_000.0)),
        query_pre_attn_scalar=float(hidden // num_heads if num_layers == 62 else head_dim),
        final_logit_softcapping=float(softcap) if softcap else None,
        max_position_embeddings=int(key("context_length", 131_072)),
        tie_word_embeddings="output.weight" not in tensors,
        norms_shifted=True,
    )


class Gemma3ForCausalLM(FusedDecoderLM):
    """The Gemma 3 text decoder on `FusedDecoderLM` (same constructor arguments as
    `helios.models.llama.LlamaForCausalLM`)."""

    config: Gemma3Config
    inv_freq: Tensor
    local_inv_freq: Tensor
    embed_scale: Tensor

    def __init__(self, config: Gemma3Config, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", *, lm_head_fp32: bool = True,
                 weights: WeightFormat | None = None, q8_head: bool = False) -> None:
        super().__init__(config, dtype, device, lm_head_fp32=lm_head_fp32, weights=weights, q8_head=q8_head)
        self.softmax_scale = config.query_pre_attn_scalar ** -0.5
        global_freq = inv_freq_of(config.head_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer("inv_freq", global_freq.to(device), persistent=False)
        local_freq = inv_freq_of(config.head_dim, config.rope_local_theta, None)
        self.register_buffer("local_inv_freq", local_freq.to(device), persistent=False)
        # transformers: a float32 scalar, cast to the embedding's dtype before the multiply.
        scale = torch.tensor(config.hidden_size ** 0.5, dtype=torch.float32).to(dtype)
        self.register_buffer("embed_scale", scale.to(device), persistent=False)

    def _build_layers(self, device: torch.device, dense_dtype: torch.dtype | None) -> list[DecoderLayer]:
        cfg = self.config
        return [_Gemma3Layer(cfg, i, self.dtype, device, dense_dtype) for i in range(cfg.num_layers)]

    def _checkpoint_value(self, name: str, value: Tensor) -> Tensor:
        """Norm weights w -> 1 + w in float32 (unless the checkpoint stores 1 + w already)."""
        if name.endswith("norm.weight") and not self.config.norms_shifted:
            return value.float() + 1.0
        return value

    def cache_specs(self) -> tuple[CacheSpec, ...]:
        """Sliding layers keep a `SlidingWindowSpec` of ``sliding_window``, global ones full K/V."""
        cfg = self.config
        full = FullAttentionSpec(cfg.num_kv_heads, cfg.head_dim)
        if cfg.sliding_window is None:
            return (full,) * cfg.num_layers
        window = SlidingWindowSpec(cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window)
        return tuple(window if sliding else full for sliding in cfg.sliding_layers)

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionContext, *,
                embeds: tuple[Tensor, Tensor] | None = None, keep: Tensor | None = None) -> Tensor:
        """Hidden states after the final norm, [T, hidden_size] (``embeds`` and ``keep`` as in
        `LlamaForCausalLM.forward`; ``embeds`` rows are not scaled, as llama.cpp does for raw
        embeddings)."""
        cfg = self.config
        tables: dict[bool, tuple[Tensor, Tensor]] = {}
        for sliding in set(cfg.sliding_layers):
            tables[sliding] = rope_tables(positions, self.local_inv_freq if sliding else self.inv_freq, self.dtype)
        h = self.embed(input_ids) * self.embed_scale
        if embeds is not None:
            rows, features = embeds
            h = h.index_copy(0, rows.to(h.device), features.to(device=h.device, dtype=h.dtype))
        fused = h.device.type == "cpu" and h.dtype in (torch.float32, torch.bfloat16) and cpu_kernels.available()
        delta: Tensor | None = None
        layers = self._decoder_layers()
        for i, layer in enumerate(layers):
            last = i == len(layers) - 1
            cos, sin = tables[cfg.sliding_layers[i]]
            h, delta = layer(h, delta, cos, sin, attn, fused, keep=keep if last else None)
        if h.shape[0] == 0:
            return h
        return add_rms_norm(h, delta, self.norm, cfg.rms_norm_eps, fused)[1]

    def _decoder_layers(self) -> Sequence[_Gemma3Layer]:
        return [cast(_Gemma3Layer, layer) for layer in self.layers]


class _Gemma3Layer(DecoderLayer):
    def __init__(self, config: Gemma3Config, layer_idx: int, dtype: torch.dtype, device: torch.device,
                 dense_dtype: torch.dtype | None) -> None:
        super().__init__(config, layer_idx)
        self.scale = config.query_pre_attn_scalar ** -0.5
        hidden = config.hidden_size

        def norm(*shape: int) -> nn.Parameter:
            return param(torch.empty(*shape, dtype=torch.float32, device=device))

        def projection(rows: int, cols: int) -> nn.Module:
            if dense_dtype is None:
                return UnloadedLinear()
            return DenseLinear(torch.empty(rows, cols, dtype=dense_dtype, device=device))

        self.input_norm = norm(hidden)
        self.qkv_proj: nn.Module = projection(config.q_size + 2 * config.kv_size, hidden)
        self.o_proj: nn.Module = projection(hidden, config.q_size)
        self.gate_up_proj: nn.Module = projection(2 * config.intermediate_size, hidden)
        self.down_proj: nn.Module = projection(hidden, config.intermediate_size)
        # One weight for q and k heads side by side: [num_heads + num_kv_heads, head_dim] (1 + w).
        self.qk_norm = norm(config.num_heads + config.num_kv_heads, config.head_dim)
        self.post_attention_norm = norm(hidden)
        self.pre_feedforward_norm = norm(hidden)
        self.post_feedforward_norm = norm(hidden)

    def forward(self, h: Tensor, delta: Tensor | None, cos: Tensor, sin: Tensor, attn: AttentionContext,
                fused: bool = False, *, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """One layer on the residual stream ``h`` plus the previous layer's (post-normed) MLP output
        ``delta``: returns the stream after attention and this layer's post-normed MLP output
        (``keep`` as in the llama layer)."""
        num_tokens = h.shape[0]
        h, x = add_rms_norm(h, delta, self.input_norm, self.eps, fused)
        qkv = self.qkv_proj(x)
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if fused:
            qk = cpu_kernels.qk_norm_rope_(qk, self.qk_norm, self.eps, cos, sin)
        else:
            qk = apply_rope(rms_norm(qk, self.qk_norm, self.eps), cos, sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        out = attn(self.layer_idx, q, k, v, self.scale)
        if keep is not None:
            num_tokens = keep.shape[0]
            h, out = h.index_select(0, keep), out.index_select(0, keep)
            if num_tokens == 0:
                return h, h
        attended = rms_norm(self.o_proj(out.reshape(num_tokens, self.q_size)), self.post_attention_norm, self.eps)
        h, x = add_rms_norm(h, attended, self.pre_feedforward_norm, self.eps, fused)
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up[:, : self.intermediate_size], gate_up[:, self.intermediate_size :]
        mlp = self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))
        return h, rms_norm(mlp, self.post_feedforward_norm, self.eps)

    def set_projection(self, attr: str, module: nn.Module) -> None:
        if attr not in PROJECTIONS:
            raise KeyError(attr)
        setattr(self, attr, module)

    def weight_targets(self) -> dict[str, Tensor]:
        return {
            "input_layernorm.weight": self.input_norm,
            "post_attention_layernorm.weight": self.post_attention_norm,
            "pre_feedforward_layernorm.weight": self.pre_feedforward_norm,
            "post_feedforward_layernorm.weight": self.post_feedforward_norm,
            # Loaded into the first q row and first k row; finish_loading() broadcasts them.
            "self_attn.q_norm.weight": self.qk_norm[0],
            "self_attn.k_norm.weight": self.qk_norm[self.num_heads],
        }

    def finish_loading(self) -> None:
        broadcast_qk_norm(self.qk_norm, self.num_heads, self.num_kv_heads)


# -- weight names and the registry entry -----------------------------------------------------------------

# llama.cpp's gemma3 per-layer GGUF tensor names (gguf-py MODEL_TENSORS[GEMMA3]) -> Hugging Face names.
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_tensor(config: ArchitectureConfig, gguf_name: str) -> GGUFTensor | None:
    """Where a gemma3 GGUF tensor goes (llama.cpp stores its q/k rows in rotate-half order: no
    permutation)."""
    return GGUFTensor(gguf_to_hf_name(gguf_name, GGUF_LAYER_NAMES))


def build(config: ArchitectureConfig, options: BuildOptions) -> Gemma3ForCausalLM:
    assert isinstance(config, Gemma3Config), type(config)
    return Gemma3ForCausalLM(config, dtype=options.dtype, device=options.device, weights=options.weights,
                             q8_head=options.q8_head)


ARCHITECTURES = (
    Architecture(
        name="gemma3",
        hf_model_types=("gemma3_text",),
        hf_architectures=("Gemma3ForCausalLM",),
        gguf_architectures=("gemma3",),
        config_from_hf=Gemma3Config.from_hf_config,
        config_from_gguf=config_from_gguf,
        gguf_tensor=gguf_tensor,
        build=build,
    ),
)
"""Gemma 3 text's registry entry (`helios.models.registry`)."""
