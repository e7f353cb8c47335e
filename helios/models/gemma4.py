"""Gemma 4 text decoder (transformers' ``gemma4_text`` / ``Gemma4ForCausalLM``, 5.24).

What differs from Gemma 3 (`helios.models.gemma3`), all as transformers' ``modeling_gemma4`` computes it:

- RMSNorm multiplies by ``w`` (not 1 + w): the checkpoint's norm weights are used as stored;
- per-layer-type attention shapes: the global (``full_attention``) layers have their own head dim
  (``global_head_dim``, default 512) and, with ``attention_k_eq_v``, their own kv head count
  (``num_global_key_value_heads``); transformers 5.24 writes both as ``per_layer_config``;
- ``attention_k_eq_v``: the global layers have no v_proj; the values are the k projection's output
  (before the k norm and RoPE);
- a scale-free RMSNorm on the values (``v_norm``), q/k RMSNorm per head as in Gemma 3, and an
  attention scale of 1 (no ``query_pre_attn_scalar``); no attention logit soft cap;
- RoPE per layer type: ``default`` (sliding layers, theta 10,000) and ``proportional`` (global
  layers: the first ``partial_rotary_factor * head_dim / 2`` frequencies are theta^(-2i/head_dim),
  the rest are 0, i.e. not rotated; all divided by ``factor``);
- KV sharing (``num_kv_shared_layers``): the last layers compute no K/V; each reuses the K/V of the
  last non-shared layer of its type. Helios keeps them exact without engine support: a shared layer
  keeps its own cache rows (the same spec as its producer's) and writes the producer's K/V of the
  step into them, so it attends over exactly the producer's keys and values (the cost: those layers'
  cache memory, which the reference saves). With ``use_double_wide_mlp`` their MLP is twice as wide;
- per-layer embeddings (``hidden_size_per_layer_input``, PLE): a second token embedding
  [vocab_size_per_layer_input, num_layers * P] scaled by sqrt(P), plus a projection of the scaled
  main embedding (times hidden_size^-0.5, RMSNorm over P), summed and scaled by 2^-0.5; each layer ends
  with h + norm(W_up(gelu(W_gate h) * ple_i));
- ``layer_scalar``: every layer's output is multiplied by a stored scalar;
- the MoE block (``enable_moe_block``): every layer runs its dense MLP *and* a routed expert block
  next to it, both on the attention output: mlp = post_ff_norm_1(MLP(pre_ff_norm(r))), experts on
  pre_ff_norm_2(r) routed on r itself (scale-free RMSNorm, times ``router.scale`` and hidden^-0.5,
  softmax in float32, top-k renormalised, times ``router.per_expert_scale``), GELU (tanh) experts
  (`helios.models.moe.expert_mix`), post_ff_norm_2; their sum goes through post_ff_norm.

Refused (``NotImplementedError``): ``use_bidirectional_attention="all"`` (not causal),
``attention_bias``, activations other than GELU (tanh), RoPE types other than default/proportional,
``per_layer_config`` overrides other than head_dim / num_key_value_heads.

GGUF: llama.cpp's ``gemma4`` (`config_from_gguf`, `gguf_tensor`; the text model of
``Gemma4ForCausalLM`` and ``Gemma4ForConditionalGeneration`` alike, the vision / audio towers go to
a separate mmproj file). Its converter stores the norms as w (no Gemma 3 style + 1), the experts
stacked as transformers holds them (``ffn_gate_up_exps`` [E, 2I, hidden], ``ffn_down_exps``),
``router.scale`` / ``per_expert_scale`` as ``ffn_gate_inp.scale`` / ``ffn_down_exps.scale``,
``layer_scalar`` as ``layer_output_scale``, per-layer-type shapes as ``key_length`` /
``key_length_swa`` and a per-layer ``head_count_kv`` array, the double-wide MLPs as a per-layer
``feed_forward_length`` array, and the global layers' proportional RoPE as ``rope_freqs`` (1 for a
rotated frequency, 1e30 for an unrotated one: the partial factor is read back from it). It writes no
``attention_k_eq_v`` (read here from the global layers having no ``attn_v``) and drops
proportional RoPE's ``factor`` (a file means factor 1). q/k rows are in rotate-half order (NeoX RoPE
in llama.cpp).
The embedding, output projection, fused q/k/v (q/k, or q alone) and gate/up projections in any
`WeightFormat` and packed states are `helios.models.decoder.FusedDecoderLM`'s; the PLE tables and
projections, the router and the stacked experts stay dense in the model dtype.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from helios.models.architecture import (
    Architecture,
    ArchitectureConfig,
    BuildOptions,
    GGUFSource,
    GGUFTensor,
    gguf_key,
)
from helios.models.config import DecoderDims
from helios.models.decoder import (
    PROJECTIONS,
    DecoderLayer,
    FusedDecoderLM,
    apply_rope,
    param,
    rms_norm,
    rope_tables,
)
from helios.models.interface import AttentionContext, CacheSpec, FullAttentionSpec, SlidingWindowSpec
from helios.models.moe import expert_mix
from helios.models.quant import BuildSource, DenseLinear, UnloadedLinear, WeightFormat

__all__ = ["ARCHITECTURES", "Gemma4Config", "Gemma4ForCausalLM", "RopeParams", "config_from_gguf", "gguf_tensor"]

_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")
_DEFAULT_PATTERN = 6


@attrs.frozen
class RopeParams:
    """One layer type's RoPE: ``theta``, the rotated share of each head (``partial``: proportional
    RoPE's ``partial_rotary_factor``, 1 for default RoPE) and the divisor ``factor``."""

    theta: float
    partial: float = 1.0
    factor: float = 1.0

    def inv_freq(self, head_dim: int) -> Tensor:
        """head_dim / 2 inverse frequencies as transformers computes them (zeros past the rotated share)."""
        angles = int(self.partial * head_dim // 2)
        rotated = 1.0 / (self.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
        freq = torch.cat((rotated, torch.zeros(head_dim // 2 - angles, dtype=torch.float32)))
        return freq / self.factor


def _rope_params(params: Mapping[str, Any] | None, default_theta: float) -> RopeParams:
    params = params or {}
    kind = params.get("rope_type", "default")
    theta = float(params.get("rope_theta") or default_theta)
    if kind == "default":
        return RopeParams(theta)  # transformers' default RoPE ignores partial_rotary_factor and factor here
    if kind == "proportional":
        return RopeParams(theta, float(params.get("partial_rotary_factor", 1.0)), float(params.get("factor", 1.0)))
    raise NotImplementedError(f"gemma4 rope_type {kind!r} is not supported (default, proportional)")


@attrs.frozen(kw_only=True)
class Gemma4Config(DecoderDims):
    """Shape and numerics of a Gemma 4 text decoder (see the module docstring).

    ``head_dim`` / ``num_kv_heads``: the sliding layers'; ``global_head_dim`` /
    ``global_kv_heads``: the full-attention layers'. ``kv_source``: per layer, None when it computes
    its K/V, else the earlier layer whose K/V it reuses. ``ple_dim``: per-layer embedding width (0:
    none). ``num_experts``: 0 for no MoE block."""

    arch: str = "gemma4"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    global_head_dim: int
    global_kv_heads: int
    sliding_layers: tuple[bool, ...]
    sliding_window: int = 512
    rms_norm_eps: float = 1e-6
    rope_global: RopeParams = RopeParams(1_000_000.0, 0.25)
    rope_local: RopeParams = RopeParams(10_000.0)
    k_eq_v: bool = False
    kv_source: tuple[int | None, ...] = ()
    double_wide_mlp: bool = False
    ple_dim: int = 0
    ple_vocab_size: int = 0
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 131_072
    tie_word_embeddings: bool = True

    def __attrs_post_init__(self) -> None:
        self.check_dims()
        if len(self.sliding_layers) != self.num_layers:
            raise ValueError(f"sliding_layers has {len(self.sliding_layers)} entries for {self.num_layers} layers")
        if self.kv_source and len(self.kv_source) != self.num_layers:
            raise ValueError(f"kv_source has {len(self.kv_source)} entries for {self.num_layers} layers")
        for i, src in enumerate(self.kv_source):
            if src is not None and not (0 <= src < i and self.sliding_layers[src] == self.sliding_layers[i]
                                        and self.kv_source[src] is None):
                raise ValueError(f"layer {i} cannot reuse the K/V of layer {src}")
        if self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.global_head_dim <= 0 or self.global_head_dim % 2 or self.num_heads % self.global_kv_heads:
            raise ValueError(f"bad global attention shape: head_dim {self.global_head_dim}, "
                             f"kv heads {self.global_kv_heads}")
        if self.num_experts and not (0 < self.top_k_experts <= self.num_experts and self.moe_intermediate_size > 0):
            raise ValueError(f"bad MoE shape: top_k {self.top_k_experts} of {self.num_experts}, "
                             f"intermediate {self.moe_intermediate_size}")

    def layer_head_dim(self, i: int) -> int:
        return self.head_dim if self.sliding_layers[i] else self.global_head_dim

    def layer_kv_heads(self, i: int) -> int:
        return self.num_kv_heads if self.sliding_layers[i] else self.global_kv_heads

    def shares_kv(self, i: int) -> bool:
        return bool(self.kv_source) and self.kv_source[i] is not None

    def layer_intermediate(self, i: int) -> int:
        return self.intermediate_size * (2 if self.double_wide_mlp and self.shares_kv(i) else 1)

    def values_from_keys(self, i: int) -> bool:
        """attention_k_eq_v: the global layers take their values from the k projection."""
        return self.k_eq_v and not self.sliding_layers[i]

    def projection_params(self) -> int:
        total = 0
        for i in range(self.num_layers):
            d, kv = self.layer_head_dim(i), self.layer_kv_heads(i)
            q = self.num_heads * d
            kv_rows = 0 if self.shares_kv(i) else kv * d * (1 if self.values_from_keys(i) else 2)
            total += (2 * q + kv_rows) * self.hidden_size + 3 * self.layer_intermediate(i) * self.hidden_size
        return int(total)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> Gemma4Config:
        """From a ``config.json`` of ``gemma4_text`` (or of ``gemma4`` with its ``text_config``, a
        Gemma4ForCausalLM checkpoint)."""
        if isinstance(config.get("text_config"), Mapping):
            config = config["text_config"]
        activation = config.get("hidden_activation") or "gelu_pytorch_tanh"
        if activation not in _ACTIVATIONS:
            raise NotImplementedError(f"unsupported hidden_activation {activation!r}; supported: {list(_ACTIVATIONS)}")
        if config.get("use_bidirectional_attention") == "all":
            raise NotImplementedError("use_bidirectional_attention='all' is not supported (causal decoding only)")
        if config.get("attention_bias"):
            raise NotImplementedError("attention_bias=True is not supported for gemma4")
        num_layers = int(config.get("num_hidden_layers", 30))
        layer_types = list(config.get("layer_types") or [
            "sliding_attention" if (i + 1) % _DEFAULT_PATTERN else "full_attention" for i in range(num_layers)])
        if len(layer_types) != num_layers:
            raise ValueError(f"{len(layer_types)} layer_types for {num_layers} layers")
        unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise ValueError(f"unsupported layer_types {unknown}")
        layer_types[-1] = "full_attention"  # transformers forces the last layer global
        sliding = tuple(kind == "sliding_attention" for kind in layer_types)
        head_dim = int(config.get("head_dim") or 256)
        num_kv = int(config.get("num_key_value_heads") or 4)
        k_eq_v = bool(config.get("attention_k_eq_v", False))
        global_head_dim, global_kv = _global_shape(config, sliding, head_dim, num_kv, k_eq_v)
        rope = config.get("rope_parameters") or {}
        rope_global = _rope_params(rope.get("full_attention") if rope else
                                   {"rope_type": "proportional", "partial_rotary_factor": 0.25}, 1_000_000.0)
        rope_local = _rope_params(rope.get("sliding_attention"), 10_000.0)
        num_shared = int(config.get("num_kv_shared_layers") or 0)
        moe = bool(config.get("enable_moe_block"))
        ple = int(config.get("hidden_size_per_layer_input") or 0)
        softcap = config.get("final_logit_softcapping")
        return cls(
            vocab_size=int(config.get("vocab_size", 262_144)),
            hidden_size=int(config.get("hidden_size", 2304)),
            intermediate_size=int(config.get("intermediate_size", 9216)),
            num_layers=num_layers,
            num_heads=int(config.get("num_attention_heads", 8)),
            num_kv_heads=num_kv,
            head_dim=head_dim,
            global_head_dim=global_head_dim,
            global_kv_heads=global_kv,
            sliding_layers=sliding,
            sliding_window=int(config.get("sliding_window") or 512),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_global=rope_global,
            rope_local=rope_local,
            k_eq_v=k_eq_v,
            kv_source=kv_sources(sliding, num_shared),
            double_wide_mlp=bool(config.get("use_double_wide_mlp", False)),
            ple_dim=ple,
            ple_vocab_size=int(config.get("vocab_size_per_layer_input") or 262_144) if ple else 0,
            num_experts=int(config.get("num_experts") or 0) if moe else 0,
            top_k_experts=int(config.get("top_k_experts") or 0) if moe else 0,
            moe_intermediate_size=int(config.get("moe_intermediate_size") or 0) if moe else 0,
            final_logit_softcapping=float(softcap) if softcap else None,
            max_position_embeddings=int(config.get("max_position_embeddings") or 131_072),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        )


def _global_shape(config: Mapping[str, Any], sliding: tuple[bool, ...], head_dim: int, num_kv: int,
                  k_eq_v: bool) -> tuple[int, int]:
    """The full-attention layers' (head_dim, kv heads): from ``per_layer_config`` (transformers 5.24's
    saved form), else ``global_head_dim`` (default 512) and, with attention_k_eq_v,
    ``num_global_key_value_heads``."""
    per_layer = config.get("per_layer_config")
    if per_layer is None:
        global_kv = config.get("num_global_key_value_heads") if k_eq_v else None
        return int(config.get("global_head_dim") or 512), int(global_kv or num_kv)
    shapes: dict[bool, set[tuple[int, int]]] = {True: set(), False: set()}
    for i, is_sliding in enumerate(sliding):
        override: Mapping[str, Any] = per_layer.get(str(i)) or per_layer.get(i) or {}  # type: ignore[call-overload]
        extra = sorted(set(override) - {"head_dim", "num_key_value_heads"})
        if extra:
            raise NotImplementedError(f"per_layer_config overrides {extra} (layer {i}) are not supported")
        shapes[is_sliding].add((int(override.get("head_dim", head_dim)),
                                int(override.get("num_key_value_heads", num_kv))))
    if shapes[True] - {(head_dim, num_kv)} or len(shapes[False]) > 1:
        raise NotImplementedError("per_layer_config: the sliding layers, and the full layers, must each share one "
                                  "attention shape")
    return next(iter(shapes[False])) if shapes[False] else (head_dim, num_kv)


def config_from_gguf(source: GGUFSource) -> Gemma4Config:
    """A Gemma 4 text config from llama.cpp's ``gemma4`` metadata and tensor shapes (see the module
    docstring)."""
    key = gguf_key(source)
    tensors = source.tensor_shapes
    num_layers = int(key("block_count"))
    sliding = tuple(bool(p) for p in key("attention.sliding_window_pattern"))
    if len(sliding) != num_layers:
        raise ValueError(f"gemma4: {len(sliding)} sliding_window_pattern entries for {num_layers} layers")
    num_heads = int(key("attention.head_count"))
    kv = key("attention.head_count_kv")
    kv = list(kv) if isinstance(kv, list) else [int(kv)] * num_layers
    kinds = {flag: {int(n) for n, s in zip(kv, sliding, strict=True) if s == flag} for flag in (True, False)}
    if any(len(v) > 1 for v in kinds.values()):
        raise NotImplementedError(f"gemma4: the kv head counts {kv} differ within a layer type")
    num_kv = next(iter(kinds[True]), 0) or next(iter(kinds[False]))
    head_dim = int(key("attention.key_length_swa"))
    global_head_dim = int(key("attention.key_length"))
    num_shared = int(key("attention.shared_kv_layers", 0))
    sources = kv_sources(sliding, num_shared)
    ffn = key("feed_forward_length")
    ffn = [int(f) for f in ffn] if isinstance(ffn, list) else [int(ffn)] * num_layers
    double_wide = any(f != ffn[0] for f in ffn)
    if double_wide and ffn != [ffn[0] * (2 if sources and sources[i] is not None else 1) for i in range(num_layers)]:
        raise NotImplementedError(f"gemma4: feed_forward_length {ffn} is not a double-wide MLP on the KV-sharing layers")
    scaling = key("rope.scaling.type", "none")
    if scaling != "none":
        raise NotImplementedError(f"gemma4 GGUF rope scaling {scaling!r} is not supported")
    partial = 1.0
    if "rope_freqs.weight" in tensors:  # 1 for the rotated frequencies, 1e30 for the others
        factors = source.read_tensor("rope_freqs.weight")
        partial = 2 * int((factors < 1e10).sum()) / global_head_dim
    global_values = [f"blk.{i}.attn_v.weight" in tensors for i in range(num_layers)
                     if not sliding[i] and not (sources and sources[i] is not None)]
    moe = "blk.0.ffn_gate_inp.weight" in tensors
    ple = int(key("embedding_length_per_layer_input", 0))
    softcap = key("final_logit_softcapping", 0.0)
    theta = float(key("rope.freq_base", 1_000_000.0))
    return Gemma4Config(
        vocab_size=int(tensors["token_embd.weight"][0]),
        hidden_size=int(key("embedding_length")),
        intermediate_size=ffn[0],
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=head_dim,
        global_head_dim=global_head_dim,
        global_kv_heads=next(iter(kinds[False]), num_kv),
        sliding_layers=sliding,
        sliding_window=int(key("attention.sliding_window")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_global=RopeParams(theta, partial),
        rope_local=RopeParams(float(key("rope.freq_base_swa", 10_000.0))),
        k_eq_v=bool(global_values) and not any(global_values),
        kv_source=sources,
        double_wide_mlp=double_wide,
        ple_dim=ple,
        ple_vocab_size=int(tensors["per_layer_token_embd.weight"][0]) if ple else 0,
        num_experts=int(key("expert_count")) if moe else 0,
        top_k_experts=int(key("expert_used_count")) if moe else 0,
        moe_intermediate_size=int(key("expert_feed_forward_length")) if moe else 0,
        final_logit_softcapping=float(softcap) or None,
        max_position_embeddings=int(key("context_length", 131_072)),
        tie_word_embeddings="output.weight" not in tensors,
    )


_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "layer_output_scale.weight": "layer_scalar",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
}


def gguf_tensor(config: ArchitectureConfig, gguf_name: str) -> GGUFTensor | None:
    """Where a ``gemma4`` GGUF tensor goes; None for ``rope_freqs`` (read by `config_from_gguf`)."""
    if gguf_name == "rope_freqs.weight":
        return None
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return GGUFTensor(_GGUF_GLOBAL_NAMES[gguf_name])
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_LAYER_NAMES:
        return GGUFTensor(f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}")
    raise NotImplementedError(f"GGUF tensor {gguf_name!r} has no gemma4 counterpart here")


def kv_sources(sliding: Sequence[bool], num_shared: int) -> tuple[int | None, ...]:
    """Per layer: None, or the layer whose K/V it reuses (transformers' ``kv_sharing_modes``: the last
    ``num_shared`` layers reuse the last earlier layer of their type)."""
    n = len(sliding)
    if num_shared <= 0:
        return ()
    first = n - num_shared
    if first <= 0:
        raise NotImplementedError("num_kv_shared_layers covers every layer (no layer computes K/V)")
    producers = {kind: max((i for i in range(first) if sliding[i] == kind), default=None) for kind in set(sliding)}
    if any(p is None for p in producers.values()):
        raise ValueError("The set of layer types producing a cache is different than the set of layer types using them")
    return tuple(None if i < first else producers[sliding[i]] for i in range(n))


class Gemma4ForCausalLM(FusedDecoderLM):
    """The Gemma 4 text decoder on `FusedDecoderLM` (same constructor arguments as
    `helios.models.llama.LlamaForCausalLM`)."""

    config: Gemma4Config
    embed_scale: Tensor
    global_inv_freq: Tensor
    local_inv_freq: Tensor
    ple_embed_scale: Tensor

    def __init__(self, config: Gemma4Config, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", *, lm_head_fp32: bool = True,
                 weights: WeightFormat | None = None, q8_head: bool = False) -> None:
        super().__init__(config, dtype, device, lm_head_fp32=lm_head_fp32, weights=weights, q8_head=q8_head)
        self.register_buffer("global_inv_freq", config.rope_global.inv_freq(config.global_head_dim).to(device),
                             persistent=False)
        self.register_buffer("local_inv_freq", config.rope_local.inv_freq(config.head_dim).to(device),
                             persistent=False)
        # transformers: float32 scalars cast to the embedding's dtype before the multiply.
        scale = torch.tensor(config.hidden_size ** 0.5, dtype=torch.float32).to(dtype)
        self.register_buffer("embed_scale", scale.to(device), persistent=False)
        if config.ple_dim:
            width = config.num_layers * config.ple_dim
            self.embed_tokens_per_layer = param(torch.empty(config.ple_vocab_size, width, dtype=dtype, device=device))
            self.per_layer_model_projection = param(torch.empty(width, config.hidden_size, dtype=dtype, device=device))
            self.per_layer_projection_norm = param(torch.empty(config.ple_dim, dtype=torch.float32, device=device))
            ple_scale = torch.tensor(config.ple_dim ** 0.5, dtype=torch.float32).to(dtype)
            self.register_buffer("ple_embed_scale", ple_scale.to(device), persistent=False)

    def _build_layers(self, device: torch.device, dense_dtype: torch.dtype | None) -> list[DecoderLayer]:
        cfg = self.config
        return [_Gemma4Layer(cfg, i, self.dtype, device, dense_dtype) for i in range(cfg.num_layers)]

    def cache_specs(self) -> tuple[CacheSpec, ...]:
        """Sliding layers a `SlidingWindowSpec` of ``sliding_window``, global ones full K/V, each in its
        layer type's shape (a KV-sharing layer keeps rows of its producer's shape)."""
        cfg = self.config
        specs: list[CacheSpec] = []
        for i, sliding in enumerate(cfg.sliding_layers):
            heads, dim = cfg.layer_kv_heads(i), cfg.layer_head_dim(i)
            specs.append(SlidingWindowSpec(heads, dim, cfg.sliding_window) if sliding else FullAttentionSpec(heads, dim))
        return tuple(specs)

    def per_layer_inputs(self, input_ids: Tensor, h: Tensor) -> Tensor | None:
        """The per-layer embeddings [T, num_layers, ple_dim] (None without PLE) of the scaled main
        embeddings ``h``."""
        cfg = self.config
        if not cfg.ple_dim:
            return None
        tokens = F.embedding(input_ids, self.embed_tokens_per_layer) * self.ple_embed_scale
        projected = F.linear(h, self.per_layer_model_projection) * cfg.hidden_size ** -0.5
        projected = rms_norm(projected.view(-1, cfg.num_layers, cfg.ple_dim), self.per_layer_projection_norm,
                             cfg.rms_norm_eps)
        return (projected + tokens.view(-1, cfg.num_layers, cfg.ple_dim)) * 2.0 ** -0.5

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionContext, *,
                embeds: tuple[Tensor, Tensor] | None = None, keep: Tensor | None = None) -> Tensor:
        """Hidden states after the final norm, [T, hidden_size] (``embeds`` and ``keep`` as in
        `LlamaForCausalLM.forward`; ``embeds`` rows are not scaled; their PLE token part is that of
        their ``input_ids``)."""
        cfg = self.config
        tables = {True: rope_tables(positions, self.local_inv_freq, self.dtype),
                  False: rope_tables(positions, self.global_inv_freq, self.dtype)}
        h = self.embed(input_ids) * self.embed_scale
        if embeds is not None:
            rows, features = embeds
            h = h.index_copy(0, rows.to(h.device), features.to(device=h.device, dtype=h.dtype))
        ple = self.per_layer_inputs(input_ids, h)
        produced: dict[int, tuple[Tensor, Tensor]] = {}
        layers = self._decoder_layers()
        for i, layer in enumerate(layers):
            last = i == len(layers) - 1
            cos, sin = tables[cfg.sliding_layers[i]]
            shared = produced[cfg.kv_source[i]] if cfg.shares_kv(i) else None  # type: ignore[index]
            h, kv = layer(h, cos, sin, attn, None if ple is None else ple[:, i], shared,
                          keep=keep if last else None)
            if kv is not None:
                produced[i] = kv
        return rms_norm(h, self.norm, cfg.rms_norm_eps)

    def decode_weight_bytes(self) -> int:
        """As `FusedDecoderLM.decode_weight_bytes`, with the per-layer embedding table counted as the
        one row a step looks up."""
        total = super().decode_weight_bytes()
        if self.config.ple_dim:
            table = self.embed_tokens_per_layer
            total -= int(table.numel() * table.element_size()) - int(table[0].numel() * table.element_size())
        return total

    def load_weights(self, tensors: Mapping[str, BuildSource]) -> None:
        """`FusedDecoderLM.load_weights`, ignoring the k/v projections and norms a KV-sharing layer
        does not use (transformers ignores them too)."""
        cfg = self.config
        ignored = {f"model.layers.{i}.self_attn.{name}.weight" for i in range(cfg.num_layers) if cfg.shares_kv(i)
                   for name in ("k_proj", "v_proj", "k_norm", "v_norm")}
        super().load_weights(_Without(tensors, ignored) if ignored else tensors)

    def _weight_targets(self) -> dict[str, Tensor]:
        targets = super()._weight_targets()
        if self.config.ple_dim:
            targets["model.embed_tokens_per_layer.weight"] = self.embed_tokens_per_layer
            targets["model.per_layer_model_projection.weight"] = self.per_layer_model_projection
            targets["model.per_layer_projection_norm.weight"] = self.per_layer_projection_norm
        return targets

    def _decoder_layers(self) -> Sequence[_Gemma4Layer]:
        return [cast(_Gemma4Layer, layer) for layer in self.layers]


class _Without(Mapping[str, BuildSource]):
    """A view of ``tensors`` without ``names`` (values are still read lazily)."""

    def __init__(self, tensors: Mapping[str, BuildSource], names: set[str]) -> None:
        self._tensors = tensors
        self._names = names

    def __getitem__(self, name: str) -> BuildSource:
        if name in self._names:
            raise KeyError(name)
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return (name for name in self._tensors if name not in self._names)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _Gemma4Layer(DecoderLayer):
    qkv_proj: nn.Module
    o_proj: nn.Module
    gate_up_proj: nn.Module
    down_proj: nn.Module

    def __init__(self, config: Gemma4Config, layer_idx: int, dtype: torch.dtype, device: torch.device,
                 dense_dtype: torch.dtype | None) -> None:
        super().__init__(config, layer_idx)
        self.head_dim = config.layer_head_dim(layer_idx)
        self.num_kv_heads = config.layer_kv_heads(layer_idx)
        self.q_size = config.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.intermediate_size = config.layer_intermediate(layer_idx)
        self.shares_kv = config.shares_kv(layer_idx)
        self.values_from_keys = config.values_from_keys(layer_idx)
        self.num_experts = config.num_experts
        self.top_k = config.top_k_experts
        hidden = config.hidden_size

        def norm(*shape: int) -> nn.Parameter:
            return param(torch.empty(*shape, dtype=torch.float32, device=device))

        def plain(*shape: int) -> nn.Parameter:
            return param(torch.empty(*shape, dtype=dtype, device=device))

        for attr, parts in self.projection_parts().items():
            rows = sum(shape[0] for _, shape in parts)
            cols = parts[0][1][1]
            setattr(self, attr, UnloadedLinear() if dense_dtype is None
                    else DenseLinear(torch.empty(rows, cols, dtype=dense_dtype, device=device)))
        self.input_norm = norm(hidden)
        self.post_attention_norm = norm(hidden)
        self.pre_feedforward_norm = norm(hidden)
        self.post_feedforward_norm = norm(hidden)
        self.q_norm = norm(self.head_dim)
        self.k_norm = norm(self.head_dim) if not self.shares_kv else None
        self.layer_scalar = plain(1)
        self.ple_dim = config.ple_dim
        if config.ple_dim:
            self.per_layer_input_gate = plain(config.ple_dim, hidden)
            self.per_layer_projection = plain(hidden, config.ple_dim)
            self.post_per_layer_input_norm = norm(hidden)
        if config.num_experts:
            experts, inter = config.num_experts, config.moe_intermediate_size
            self.router_proj = plain(experts, hidden)
            self.router_scale = plain(hidden)
            self.per_expert_scale = plain(experts)
            self.experts_gate_up = plain(experts, 2 * inter, hidden)
            self.experts_down = plain(experts, hidden, inter)
            self.post_feedforward_norm_1 = norm(hidden)
            self.post_feedforward_norm_2 = norm(hidden)
            self.pre_feedforward_norm_2 = norm(hidden)

    def projection_parts(self) -> dict[str, tuple[tuple[str, tuple[int, int]], ...]]:
        """q alone (a KV-sharing layer), q and k (values from keys) or q, k, v; o; the MLP."""
        hidden, inter, q, kv = self.hidden_size, self.intermediate_size, self.q_size, self.kv_size
        qkv: list[tuple[str, tuple[int, int]]] = [("self_attn.q_proj.weight", (q, hidden))]
        if not self.shares_kv:
            qkv.append(("self_attn.k_proj.weight", (kv, hidden)))
            if not self.values_from_keys:
                qkv.append(("self_attn.v_proj.weight", (kv, hidden)))
        return {
            "qkv_proj": tuple(qkv),
            "o_proj": (("self_attn.o_proj.weight", (hidden, q)),),
            "gate_up_proj": (("mlp.gate_proj.weight", (inter, hidden)), ("mlp.up_proj.weight", (inter, hidden))),
            "down_proj": (("mlp.down_proj.weight", (hidden, inter)),),
        }

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, attn: AttentionContext, ple: Tensor | None,
                shared: tuple[Tensor, Tensor] | None, *,
                keep: Tensor | None = None) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """One layer on the residual stream ``h``: the new stream and the K/V it computed (None for a
        KV-sharing layer, which attends over ``shared``, its producer's K/V of this step). ``ple``:
        this layer's per-layer input [T, ple_dim]; ``keep`` as in the llama layer."""
        num_tokens = h.shape[0]
        x = rms_norm(h, self.input_norm, self.eps)
        qkv = self.qkv_proj(x)
        q = rms_norm(qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim), self.q_norm, self.eps)
        q = apply_rope(q, cos, sin)
        computed: tuple[Tensor, Tensor] | None = None
        if shared is not None:
            k, v = shared
        else:
            assert self.k_norm is not None
            k_raw = qkv[:, self.q_size : self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
            v = k_raw if self.values_from_keys else qkv[:, self.q_size + self.kv_size :].view(
                num_tokens, self.num_kv_heads, self.head_dim)
            k = apply_rope(rms_norm(k_raw, self.k_norm, self.eps), cos, sin)
            v = _scale_free_norm(v, self.eps)
            computed = (k, v)
        out = attn(self.layer_idx, q, k, v, 1.0)
        if keep is not None:
            num_tokens = keep.shape[0]
            h, out = h.index_select(0, keep), out.index_select(0, keep)
            ple = None if ple is None else ple.index_select(0, keep)
        h = h + rms_norm(self.o_proj(out.reshape(num_tokens, self.q_size)), self.post_attention_norm, self.eps)
        gate_up = self.gate_up_proj(rms_norm(h, self.pre_feedforward_norm, self.eps))
        gate, up = gate_up[:, : self.intermediate_size], gate_up[:, self.intermediate_size :]
        mlp = self.down_proj(F.gelu(gate, approximate="tanh") * up)
        if self.num_experts:
            mlp = rms_norm(mlp, self.post_feedforward_norm_1, self.eps) + self._experts(h)
        h = h + rms_norm(mlp, self.post_feedforward_norm, self.eps)
        if ple is not None:
            gated = F.gelu(F.linear(h, self.per_layer_input_gate), approximate="tanh") * ple
            h = h + rms_norm(F.linear(gated, self.per_layer_projection), self.post_per_layer_input_norm, self.eps)
        return h * self.layer_scalar, computed

    def _experts(self, h: Tensor) -> Tensor:
        """The MoE block on the residual stream ``h`` (routed on h itself), post-normed."""
        routed = _scale_free_norm(h, self.eps) * self.router_scale * self.hidden_size ** -0.5
        probs = torch.softmax(F.linear(routed, self.router_proj), dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True) * self.per_expert_scale[ids]
        x = rms_norm(h, self.pre_feedforward_norm_2, self.eps)
        mixed = expert_mix(x, top, ids, self.experts_gate_up, self.experts_down,
                           act=lambda t: F.gelu(t, approximate="tanh"))
        return rms_norm(mixed, self.post_feedforward_norm_2, self.eps)

    def set_projection(self, attr: str, module: nn.Module) -> None:
        if attr not in PROJECTIONS:
            raise KeyError(attr)
        setattr(self, attr, module)

    def weight_targets(self) -> dict[str, Tensor]:
        targets: dict[str, Tensor] = {
            "input_layernorm.weight": self.input_norm,
            "post_attention_layernorm.weight": self.post_attention_norm,
            "pre_feedforward_layernorm.weight": self.pre_feedforward_norm,
            "post_feedforward_layernorm.weight": self.post_feedforward_norm,
            "self_attn.q_norm.weight": self.q_norm,
            "layer_scalar": self.layer_scalar,
        }
        if self.k_norm is not None:
            targets["self_attn.k_norm.weight"] = self.k_norm
        if self.ple_dim:
            targets.update({
                "per_layer_input_gate.weight": self.per_layer_input_gate,
                "per_layer_projection.weight": self.per_layer_projection,
                "post_per_layer_input_norm.weight": self.post_per_layer_input_norm,
            })
        if self.num_experts:
            targets.update({
                "router.proj.weight": self.router_proj,
                "router.scale": self.router_scale,
                "router.per_expert_scale": self.per_expert_scale,
                "experts.gate_up_proj": self.experts_gate_up,
                "experts.down_proj": self.experts_down,
                "post_feedforward_layernorm_1.weight": self.post_feedforward_norm_1,
                "post_feedforward_layernorm_2.weight": self.post_feedforward_norm_2,
                "pre_feedforward_layernorm_2.weight": self.pre_feedforward_norm_2,
            })
        return targets


def _scale_free_norm(x: Tensor, eps: float) -> Tensor:
    """transformers' Gemma4RMSNorm(with_scale=False): x * (mean(x^2) + eps)^-0.5 in float32."""
    x32 = x.float()
    return (x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(x.dtype)


def build(config: ArchitectureConfig, options: BuildOptions) -> Gemma4ForCausalLM:
    assert isinstance(config, Gemma4Config), type(config)
    return Gemma4ForCausalLM(config, dtype=options.dtype, device=options.device, weights=options.weights,
                             q8_head=options.q8_head)


ARCHITECTURES = (
    Architecture(
        name="gemma4",
        hf_model_types=("gemma4_text",),
        hf_architectures=("Gemma4ForCausalLM",),
        gguf_architectures=("gemma4",),
        config_from_hf=Gemma4Config.from_hf_config,
        config_from_gguf=config_from_gguf,
        gguf_tensor=gguf_tensor,
        build=build,
    ),
)
"""Gemma 4 text's registry entry (`helios.models.registry`)."""
