"""MiMo-V2-Flash (transformers' ``mimo_v2_flash`` / ``MiMoV2FlashForCausalLM``).

What differs from the other MoE families (`helios.models.glm4_moe`), as transformers 5 computes it:

- layers of two kinds (``layer_types``; by default full attention on layer 0 and every 6th layer,
  sliding-window attention elsewhere). A sliding layer attends within ``sliding_window`` positions
  (query p sees keys p - window + 1 .. p, a `SlidingWindowSpec`; a ``config.json`` with
  ``sliding_window_size`` s means window s + 1, as transformers reads it), has twice
  ``num_key_value_heads`` kv heads and attention sinks (``self_attn.attention_sink_bias``, one
  logit per query head, `helios.models.attention_sinks`); a full layer has neither;
- each kind has its own rotary embedding (``rope_parameters[layer_type]``: ``rope_theta`` and
  ``partial_rotary_factor``, default 0.334; rotate-half on the first ``int(head_dim * factor)``
  dimensions of each head; only the default rope type);
- the values have their own head size (``v_head_dim``, 128 against ``head_dim`` 192 for q and k)
  and are multiplied by ``attention_value_scale`` right after the projection. The cache keeps one
  head size: V is padded with zeros up to ``head_dim`` before the cache write and the attention's
  output sliced back to ``v_head_dim`` before ``o_proj`` (the zero columns contribute exactly
  nothing), so every backend and cache spec stays as it is, at the price of the padding's cache
  bytes; scores are scaled by ``head_dim ** -0.5``;
- the feed-forward is dense (``intermediate_size``) or MoE per ``mlp_layer_types`` (by default
  layer 0 dense), the router DeepSeek-V3's (float32 sigmoid scores, ``e_score_correction_bias``,
  ``n_group`` / ``topk_group``, renormalised, ``routed_scaling_factor``), no shared experts, no
  q/k norm.

The multi-token-prediction weights (``model.mtp.*``) are ignored, as transformers does. Built on
`helios.models.moe_decoder.MoEForCausalLM`; no FP8 checkpoints here.

GGUF: llama.cpp's ``mimo2`` (`config_from_gguf`): the MoE families' names
(`helios.models.moe_decoder.gguf_moe_tensor`) plus ``attn_sinks.weight`` (the sliding layers'
sinks); ``block_count`` counts the ``nextn_predict_layers`` multi-token-prediction blocks (not
loaded). What llama.cpp's converter writes, and so what a file can say:

- one ``rope.dimension_count`` for both kinds of layer (the hub config's one
  ``partial_rotary_factor``), ``rope.freq_base`` / ``rope.freq_base_swa``;
- per-layer ``attention.head_count_kv`` and ``attention.sliding_window_pattern`` arrays (1: sliding),
  ``attention.value_length`` (``v_head_dim``), ``attention.value_scale``;
- ``attention.sliding_window``, read as llama.cpp's mask reads it: a query sees that many
  positions, itself included. The converter copies the hub config's ``sliding_window`` (128), where
  transformers and the reference attend ``sliding_window_size`` + 1 (129) positions, so a GGUF of
  the released model attends one position less than its safetensors form beyond 128 tokens;
- no ``routed_scaling_factor`` (the release's is null, i.e. 1): ``expert_weights_scale`` is read
  when present, else 1.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
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
)
from helios.models.config import inv_freq_of
from helios.models.decoder import DecoderLayer, add_rms_norm, apply_rope, param, rope_tables
from helios.models.interface import AttentionContext, CacheSpec, FullAttentionSpec, SlidingWindowSpec
from helios.models.moe import RouterSpec
from helios.models.moe_decoder import MoEConfig, MoEForCausalLM, MoELayer, gguf_moe_tensor
from helios.models.quant import BuildSource, DenseLinear, UnloadedLinear, WeightFormat

__all__ = ["ARCHITECTURES", "MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", "config_from_gguf", "config_from_hf"]

_SINKS = "self_attn.attention_sink_bias"  # the checkpoints' name (transformers' in-memory one: self_attn.sinks)


@attrs.frozen(kw_only=True)
class MiMoV2FlashConfig(MoEConfig):
    """`MoEConfig` plus MiMo's per-kind attention: ``num_kv_heads``, ``rope_theta`` and
    ``rotary_dim`` are the full layers'; ``sliding_kv_heads``, ``sliding_rope_theta`` and
    ``sliding_rotary_dim`` the sliding layers'; ``v_head_dim`` the values' head size,
    ``value_scale`` their multiplier."""

    sliding_layers: tuple[bool, ...]
    sliding_window: int
    sliding_kv_heads: int
    sliding_rope_theta: float
    sliding_rotary_dim: int
    v_head_dim: int
    value_scale: float = 1.0

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if len(self.sliding_layers) != self.num_layers:
            raise ValueError(f"sliding_layers has {len(self.sliding_layers)} entries for {self.num_layers} layers")
        if self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.sliding_kv_heads <= 0 or self.num_heads % self.sliding_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of the sliding layers' kv heads "
                             f"({self.sliding_kv_heads})")
        rot = self.sliding_rotary_dim
        if rot <= 0 or rot > self.head_dim or rot % 2:
            raise ValueError(f"sliding_rotary_dim must be even and in 1..head_dim ({self.head_dim}), got {rot}")
        if self.v_head_dim <= 0:
            raise ValueError(f"v_head_dim must be positive, got {self.v_head_dim}")
        if self.attention_bias or self.qk_norm or self.shared_intermediate_size or self.rope_scaling is not None:
            raise ValueError("mimo_v2_flash has no attention bias, q/k norm, shared experts or rope scaling here")

    @property
    def cache_head_dim(self) -> int:
        """The head size the cache keeps for K and (zero-padded) V."""
        return max(self.head_dim, self.v_head_dim)

    def layer_kv_heads(self, layer_idx: int) -> int:
        return self.sliding_kv_heads if self.sliding_layers[layer_idx] else self.num_kv_heads

    def projection_params(self) -> int:
        """Weights in the projections a weight format converts: attention and dense MLPs."""
        total = 0
        for i, moe in enumerate(self.moe_layers):
            kv = self.layer_kv_heads(i)
            q, k, v = self.num_heads * self.head_dim, kv * self.head_dim, kv * self.v_head_dim
            total += (q + k + v) * self.hidden_size + self.hidden_size * self.num_heads * self.v_head_dim
            total += 0 if moe else 3 * self.intermediate_size * self.hidden_size
        return int(total)


def config_from_hf(config: Mapping[str, Any]) -> MiMoV2FlashConfig:
    """A MiMo-V2-Flash config from its ``config.json``, with transformers 5's defaults
    (`MiMoV2FlashConfig.__post_init__`)."""
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config.get('hidden_act')!r}")
    quant = config.get("quantization_config")
    if quant:
        raise NotImplementedError(f"mimo_v2_flash with quantization_config {quant.get('quant_method')!r} is not "
                                  "supported (bfloat16 / float32 exports are)")
    hidden = int(config.get("hidden_size", 4096))
    num_heads = int(config.get("num_attention_heads", 64))
    num_layers = int(config.get("num_hidden_layers", 48))
    head_dim = int(config.get("head_dim") or 192)
    kv_heads = int(config.get("num_key_value_heads") or 4)
    layer_types = config.get("layer_types") or [
        "full_attention" if (i == 0 or not (i + 1) % 6) else "sliding_attention" for i in range(num_layers)]
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown or len(layer_types) != num_layers:
        raise ValueError(f"bad mimo_v2_flash layer_types {layer_types}")
    mlp_types = config.get("mlp_layer_types") or ["dense"] + ["sparse"] * (num_layers - 1)
    if set(mlp_types) - {"dense", "sparse"}:
        raise ValueError(f"bad mimo_v2_flash mlp_layer_types {mlp_types}")
    rope: Mapping[str, Any] = config.get("rope_parameters") or {
        "full_attention": {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.334},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.334},
    }

    def rope_of(kind: str) -> tuple[float, int]:
        params = rope[kind]
        if params.get("rope_type", "default") != "default":
            raise NotImplementedError(f"mimo_v2_flash rope type {params.get('rope_type')!r} is not supported")
        return float(params["rope_theta"]), int(head_dim * float(params.get("partial_rotary_factor", 0.334)))

    full_theta, full_rot = rope_of("full_attention")
    sliding_theta, sliding_rot = rope_of("sliding_attention")
    window = config.get("sliding_window", 129)
    if config.get("sliding_window_size") is not None:  # the reference implementation's key: window - 1
        window = int(config["sliding_window_size"]) + 1
    value_scale = config.get("attention_value_scale", 0.707)
    num_experts = int(config.get("n_routed_experts") or config.get("num_local_experts") or 256)
    return MiMoV2FlashConfig(
        arch="mimo_v2_flash",
        vocab_size=int(config.get("vocab_size", 152576)),
        hidden_size=hidden,
        intermediate_size=int(config.get("intermediate_size", 16384)),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        moe_layers=tuple(t == "sparse" for t in mlp_types),
        router=RouterSpec(num_experts=num_experts, top_k=int(config.get("num_experts_per_tok", 8)),
                          scoring="sigmoid", norm_topk_prob=bool(config.get("norm_topk_prob", True)),
                          n_group=int(config.get("n_group") or 1), topk_group=int(config.get("topk_group") or 1),
                          routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0)),
        moe_intermediate_size=int(config.get("moe_intermediate_size", 2048)),
        rotary_dim=full_rot,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=full_theta,
        max_position_embeddings=int(config.get("max_position_embeddings") or 131072),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", False)),
        sliding_layers=tuple(t == "sliding_attention" for t in layer_types),
        sliding_window=int(window),
        sliding_kv_heads=2 * kv_heads,
        sliding_rope_theta=sliding_theta,
        sliding_rotary_dim=sliding_rot,
        v_head_dim=int(config.get("v_head_dim") or 128),
        value_scale=1.0 if value_scale is None else float(value_scale),
    )


def config_from_gguf(source: GGUFSource) -> MiMoV2FlashConfig:
    """A MiMo-V2-Flash config from llama.cpp's ``mimo2`` metadata (see the module docstring): the
    layer kinds from ``attention.sliding_window_pattern``, each kind's kv heads from
    ``attention.head_count_kv``, the sparse layers those with an ``ffn_gate_inp`` router."""
    key = gguf_key(source)
    tensors = source.tensor_shapes
    num_layers = int(key("block_count")) - int(key("nextn_predict_layers", 0))
    num_heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length"))
    pattern = key("attention.sliding_window_pattern")
    sliding = tuple(bool(p) for p in pattern[:num_layers])
    kv = key("attention.head_count_kv")
    kv = list(kv[:num_layers]) if isinstance(kv, list) else [int(kv)] * num_layers
    kinds = {flag: {int(n) for n, s in zip(kv, sliding, strict=True) if s == flag} for flag in (False, True)}
    if any(len(v) > 1 for v in kinds.values()):
        raise NotImplementedError(f"mimo2: the kv head counts {kv} differ within a kind of layer")
    full_kv = next(iter(kinds[False]), 0) or next(iter(kinds[True]))
    sliding_kv = next(iter(kinds[True]), 0) or 2 * full_kv
    scaling_kind = key("rope.scaling.type", "none")
    if scaling_kind != "none":
        raise NotImplementedError(f"GGUF rope scaling {scaling_kind!r} is not supported for mimo2")
    gating = int(key("expert_gating_func", 2))
    if gating != 2:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (its mimo2 graph hard-codes it)
        raise NotImplementedError(f"mimo2 expert_gating_func {gating} is not supported (sigmoid: 2)")
    rotary = int(key("rope.dimension_count", head_dim))
    moe = tuple(f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(num_layers))
    theta = float(key("rope.freq_base", 5_000_000.0))
    ffn = key("feed_forward_length")
    return MiMoV2FlashConfig(
        arch="mimo_v2_flash",
        vocab_size=int(tensors["token_embd.weight"][0]),
        hidden_size=int(key("embedding_length")),
        intermediate_size=int(max(ffn) if isinstance(ffn, list) else ffn),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=full_kv,
        head_dim=head_dim,
        moe_layers=moe,
        router=RouterSpec(num_experts=int(key("expert_count")), top_k=int(key("expert_used_count")),
                          scoring="sigmoid", norm_topk_prob=bool(key("expert_weights_norm", True)),
                          n_group=int(key("expert_group_count", 1)), topk_group=int(key("expert_group_used_count", 1)),
                          routed_scaling_factor=float(key("expert_weights_scale", 1.0)) or 1.0),
        moe_intermediate_size=int(key("expert_feed_forward_length")),
        rotary_dim=rotary,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=theta,
        max_position_embeddings=int(key("context_length", 131072)),
        tie_word_embeddings="output.weight" not in tensors,
        sliding_layers=sliding,
        sliding_window=int(key("attention.sliding_window")),
        sliding_kv_heads=sliding_kv,
        sliding_rope_theta=float(key("rope.freq_base_swa", theta)),
        sliding_rotary_dim=rotary,
        v_head_dim=int(key("attention.value_length", head_dim)),
        value_scale=float(key("attention.value_scale", 1.0)),
    )


_GGUF_NAMES = {"attn_sinks.weight": _SINKS}


def gguf_tensor(config: ArchitectureConfig, gguf_name: str) -> GGUFTensor | None:
    return gguf_moe_tensor(config, gguf_name, _GGUF_NAMES)


class _Renamed(Mapping[str, BuildSource]):
    """``tensors`` with transformers' in-memory sink name read as the checkpoints' one, and without
    the multi-token-prediction weights (``model.mtp.*``)."""

    def __init__(self, tensors: Mapping[str, BuildSource]) -> None:
        self._tensors = tensors
        self._names = {name.replace(".self_attn.sinks", f".{_SINKS}"): name
                       for name in tensors if not name.startswith("model.mtp.")}

    def __getitem__(self, name: str) -> BuildSource:
        return self._tensors[self._names[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class MiMoV2FlashForCausalLM(MoEForCausalLM):
    """MiMo-V2-Flash on `MoEForCausalLM` (same constructor arguments)."""

    config: MiMoV2FlashConfig
    sliding_inv_freq: Tensor

    def __init__(self, config: MiMoV2FlashConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", *, lm_head_fp32: bool = True,
                 weights: WeightFormat | None = None, q8_head: bool = False) -> None:
        super().__init__(config, dtype, device, lm_head_fp32=lm_head_fp32, weights=weights, q8_head=q8_head)
        freq = inv_freq_of(config.sliding_rotary_dim, config.sliding_rope_theta, None)
        self.register_buffer("sliding_inv_freq", freq.to(device), persistent=False)

    def _build_layers(self, device: torch.device, dense_dtype: torch.dtype | None) -> list[DecoderLayer]:
        cfg = self.config
        return [_MiMoLayer(cfg, i, self.dtype, device, dense_dtype) for i in range(cfg.num_layers)]

    def cache_specs(self) -> tuple[CacheSpec, ...]:
        """Sliding layers: a `SlidingWindowSpec` of their kv heads; full layers: full K/V; both of
        `MiMoV2FlashConfig.cache_head_dim`."""
        cfg = self.config
        d = cfg.cache_head_dim
        full = FullAttentionSpec(cfg.num_kv_heads, d)
        window = SlidingWindowSpec(cfg.sliding_kv_heads, d, cfg.sliding_window)
        return tuple(window if sliding else full for sliding in cfg.sliding_layers)

    def load_weights(self, tensors: Mapping[str, BuildSource]) -> None:
        """`MoEForCausalLM.load_weights`, without ``model.mtp.*``, the sinks under either name."""
        super().load_weights(_Renamed(tensors))

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionContext, *,
                embeds: tuple[Tensor, Tensor] | None = None, keep: Tensor | None = None) -> Tensor:
        """Hidden states after the final norm (``embeds`` and ``keep`` as in `LlamaForCausalLM.forward`)."""
        tables = (rope_tables(positions, self.inv_freq, self.dtype),
                  rope_tables(positions, self.sliding_inv_freq, self.dtype))
        h = self.embed(input_ids)
        if embeds is not None:
            rows, features = embeds
            h = h.index_copy(0, rows.to(h.device), features.to(device=h.device, dtype=h.dtype))
        fused = h.device.type == "cpu" and h.dtype in (torch.float32, torch.bfloat16) and cpu_kernels.available()
        delta: Tensor | None = None
        layers = self._decoder_layers()
        for i, layer in enumerate(layers):
            last = i == len(layers) - 1
            cos, sin = tables[self.config.sliding_layers[i]]
            h, delta = layer(h, delta, cos, sin, attn, fused, keep=keep if last else None)
        if h.shape[0] == 0:
            return h
        return add_rms_norm(h, delta, self.norm, self.config.rms_norm_eps, fused)[1]

    def _decoder_layers(self) -> Sequence[_MiMoLayer]:
        return [cast(_MiMoLayer, layer) for layer in self.layers]


class _MiMoLayer(MoELayer):
    """`MoELayer` with this layer's kind of attention: its kv heads, the values' head size and
    scale, partial RoPE of its kind, sinks on sliding layers."""

    def __init__(self, config: MiMoV2FlashConfig, layer_idx: int, dtype: torch.dtype, device: torch.device,
                 dense_dtype: torch.dtype | None) -> None:
        super().__init__(config, layer_idx, dtype, device, dense_dtype)
        sliding = config.sliding_layers[layer_idx]
        self.num_kv_heads = config.layer_kv_heads(layer_idx)
        self.kv_size = self.num_kv_heads * self.head_dim
        self.v_head_dim = config.v_head_dim
        self.v_size = self.num_kv_heads * self.v_head_dim
        self.o_size = self.num_heads * self.v_head_dim
        self.cache_head_dim = config.cache_head_dim
        self.value_scale = config.value_scale
        self.rotary_dim = config.sliding_rotary_dim if sliding else config.rotary

        def projection(rows: int, cols: int) -> nn.Module:
            if dense_dtype is None:
                return UnloadedLinear()
            return DenseLinear(torch.empty(rows, cols, dtype=dense_dtype, device=device))

        hidden = config.hidden_size
        self.qkv_proj = projection(self.q_size + self.kv_size + self.v_size, hidden)
        self.o_proj = projection(hidden, self.o_size)
        self.sinks: nn.Parameter | None = param(torch.empty(config.num_heads, dtype=torch.float32, device=device)) \
            if sliding else None

    def projection_parts(self) -> dict[str, tuple[tuple[str, tuple[int, int]], ...]]:
        """`MoELayer.projection_parts` with this layer's q/k/v and o shapes."""
        parts = super().projection_parts()
        hidden = self.hidden_size
        parts["qkv_proj"] = (("self_attn.q_proj.weight", (self.q_size, hidden)),
                             ("self_attn.k_proj.weight", (self.kv_size, hidden)),
                             ("self_attn.v_proj.weight", (self.v_size, hidden)))
        parts["o_proj"] = (("self_attn.o_proj.weight", (hidden, self.o_size)),)
        return parts

    def weight_targets(self) -> dict[str, Tensor]:
        targets = super().weight_targets()
        if self.sinks is not None:
            targets[_SINKS] = self.sinks
        return targets

    def forward(self, h: Tensor, delta: Tensor | None, cos: Tensor, sin: Tensor, attn: AttentionContext,
                fused: bool = False, *, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """One layer on the residual stream ``h`` plus the previous layer's feed-forward output
        ``delta``: the stream after attention and this layer's feed-forward output."""
        num_tokens = h.shape[0]
        h, x = add_rms_norm(h, delta, self.input_norm, self.eps, fused)
        qkv = cast(nn.Module, self.qkv_proj)(x)
        split = self.q_size + self.kv_size
        qk = qkv[:, :split].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, split:].view(num_tokens, self.num_kv_heads, self.v_head_dim) * self.value_scale
        rot = self.rotary_dim
        if rot == self.head_dim:
            qk = apply_rope(qk, cos, sin)
        else:
            qk = torch.cat((apply_rope(qk[..., :rot], cos, sin), qk[..., rot:]), dim=-1)
        d = self.cache_head_dim
        if self.head_dim < d:  # zero q/k dimensions add nothing to the scores
            qk = F.pad(qk, (0, d - self.head_dim))
        if self.v_head_dim < d:  # zero v dimensions give zero output columns, sliced off below
            v = F.pad(v, (0, d - self.v_head_dim))
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        out = attn(self.layer_idx, q, k, v, self.head_dim ** -0.5, sinks=self.sinks)[..., : self.v_head_dim]
        return self.finish(h, out, keep, fused, self.o_size)


def build(config: ArchitectureConfig, options: BuildOptions) -> MiMoV2FlashForCausalLM:
    assert isinstance(config, MiMoV2FlashConfig), config
    return MiMoV2FlashForCausalLM(config, dtype=options.dtype, device=options.device, weights=options.weights,
                                  q8_head=options.q8_head)


ARCHITECTURES = (
    Architecture(
        name="mimo_v2_flash",
        hf_model_types=("mimo_v2_flash",),
        hf_architectures=("MiMoV2FlashForCausalLM",),
        gguf_architectures=("mimo2",),
        config_from_hf=config_from_hf,
        config_from_gguf=config_from_gguf,
        gguf_tensor=gguf_tensor,
        build=build,
    ),
)
"""MiMo-V2-Flash's registry entry (`helios.models.registry`)."""
