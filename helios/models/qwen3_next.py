"""Qwen3-Next (transformers' ``qwen3_next`` / ``Qwen3NextForCausalLM``) and Qwen3.5 text: a hybrid
of Gated DeltaNet linear-attention layers and gated full-attention layers, each followed by a
sparse MoE with a shared expert (or a dense MLP).

- Layer kinds: ``layer_types`` (``linear_attention`` / ``full_attention``; by default every
  ``full_attention_interval``-th layer, 4, is full attention).
- Full attention: ``q_proj`` gives per head ``[query | gate]`` (2 x ``head_dim``); per-head q/k
  RMSNorm; rotate-half RoPE on the first ``partial_rotary_factor`` (0.25) of each head; the
  attention output times ``sigmoid(gate)`` before ``o_proj``.
- Gated DeltaNet (`helios.models.gated_delta`): ``in_proj_qkvz`` gives, per key head, ``[q | k |
  v | z]`` (the value heads of the key head's group), ``in_proj_ba`` per key head ``[b | a]``; q, k,
  v go through the depthwise causal conv (``linear_conv_kernel_dim``, SiLU), then the gated delta
  rule with ``beta = sigmoid(b)`` and log decay ``g = -exp(A_log) * softplus(a + dt_bias)``; the
  output is RMS-normed per value head (a plain weight), times ``silu(z)``, then ``out_proj``. Its
  cache is a `RecurrentStateSpec`: the conv state [K - 1, conv channels] and the delta-rule state
  [value heads, key dim, value dim], float32. The engine gives such a layout no prefix cache and no
  speculative decoding (no state snapshots).
- Feed-forward: `helios.models.moe_decoder`'s MoE (softmax routing, top ``num_experts_per_tok``,
  renormalised when ``norm_topk_prob``) plus the ``shared_expert`` gated by
  ``sigmoid(shared_expert_gate)``, on layers ``decoder_sparse_step`` / ``mlp_only_layers`` make
  sparse; the others a dense MLP.
- RMSNorms (the layer norms, q/k norms and the final norm) scale by ``1 + weight`` (stored as such
  on load); the gated norm inside Gated DeltaNet by ``weight``.

GGUF: llama.cpp's ``qwen3next`` files (`config_from_gguf`, `gguf_tensor`): the q/k/v rows of
``in_proj_qkvz`` as ``attn_qkv``, its z rows as ``attn_gate``, ``ssm_a`` = -exp(A_log), the
``1 + weight`` norms stored shifted; the multi-token-prediction block past ``block_count -
nextn_predict_layers`` is not loaded.

Qwen3.5 text (transformers' ``qwen3_5_text`` / ``Qwen3_5ForCausalLM``, entry ``qwen3_5``, and
``qwen3_5_moe_text`` / ``Qwen3_5MoeForCausalLM``, entry ``qwen3_5_moe``) is this model with
``Qwen3NextConfig.split_ba``: ``in_proj_qkv`` already in [all q | all k | all v] order,
``in_proj_b`` and ``in_proj_a`` separate projections of one row per value head; the dense one has a
dense MLP in every layer, the MoE one the routed experts (renormalised) and the gated shared expert
in every layer. Its interleaved MRoPE rotates the same share by (text, height, width) positions that
are all the text position without images, which is RoPE over the first ``partial_rotary_factor`` of
each head. The vision-language checkpoints (``qwen3_5`` / ``qwen3_5_moe``) give their text model
through `helios.models.vision.registry` (no tower). llama.cpp's ``qwen35`` / ``qwen35moe`` files
store ``ssm_beta`` / ``ssm_alpha`` and, with fewer key than value heads, the value heads tiled (value
head j reads key head j mod key heads: ``Qwen3NextConfig.value_heads_tiled``, which
`gated_delta.gated_delta` follows; every per-value-head tensor of the file is in that order).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
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
    gguf_kv_heads,
)
from helios.models.config import normalize_rope_scaling
from helios.models.decoder import DecoderLayer, add_rms_norm, apply_rope, param, rms_norm
from helios.models.gated_delta import causal_conv, gated_delta
from helios.models.interface import AttentionContext, CacheSpec, FullAttentionSpec, RecurrentStateSpec
from helios.models.moe import RouterSpec
from helios.models.moe_decoder import MoEConfig, MoEForCausalLM, MoELayer, gguf_moe_tensor
from helios.models.quant import BuildSource, WeightFormat
from helios.models.qwen3_moe import moe_layer_flags

__all__ = ["ARCHITECTURES", "LinearAttentionNames", "Qwen3NextConfig", "Qwen3NextForCausalLM", "config_from_gguf",
           "config_from_hf"]

_LINEAR_PROJ = ("in_proj", "out_proj")


@attrs.frozen(kw_only=True)
class Qwen3NextConfig(MoEConfig):
    """`MoEConfig` plus the linear-attention layers: which layers they are and their sizes."""

    linear_layers: tuple[bool, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int = 4
    norms_shifted: bool = False
    """The checkpoint stores the ``1 + weight`` norms as 1 + w already (llama.cpp's GGUF files)."""
    split_ba: bool = False
    """``in_proj_b`` and ``in_proj_a`` are two projections of [value heads] rows each (Qwen3.5), not
    Qwen3-Next's ``in_proj_ba`` of per key head [b of its value heads | a of them]."""
    value_heads_tiled: bool = False
    """The linear-attention value heads are in llama.cpp's tiled order (value head j reads key head
    j mod key heads: its Qwen3.5 GGUF files), not grouped by key head."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if len(self.linear_layers) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.linear_layers)} entries for {self.num_layers} layers")
        if all(self.linear_layers):
            raise ValueError(f"{self.arch} needs at least one full_attention layer")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.conv_kernel < 1:
            raise ValueError(f"linear_conv_kernel_dim must be positive, got {self.conv_kernel}")

    @property
    def linear_key_size(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_size(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_channels(self) -> int:
        return 2 * self.linear_key_size + self.linear_value_size

    def projection_params(self) -> int:
        h = self.hidden_size
        full = (2 * self.q_size + 2 * self.kv_size) * h + h * self.q_size
        linear = (2 * self.linear_key_size + 2 * self.linear_value_size + 2 * self.linear_num_value_heads) * h \
            + h * self.linear_value_size
        total = 0
        for moe, lin in zip(self.moe_layers, self.linear_layers, strict=True):
            inter = self.shared_intermediate_size if moe else self.intermediate_size
            total += (linear if lin else full) + 3 * inter * h
        return int(total)


_GGUF_ARCHES = {"qwen3next": "qwen3_next", "qwen35": "qwen3_5", "qwen35moe": "qwen3_5_moe"}


def config_from_gguf(source: GGUFSource) -> Qwen3NextConfig:
    """A Qwen3-Next / Qwen3.5 config from llama.cpp's ``qwen3next`` / ``qwen35`` / ``qwen35moe``
    metadata (``ssm.*``: conv kernel, key head size, key heads, value heads, value size; recurrent
    layers are those with ``ssm_a``, sparse ones those with a router). Qwen3.5 files keep ``ssm_beta``
    and ``ssm_alpha`` apart and, with fewer key than value heads, the value heads tiled."""
    key = gguf_key(source)
    arch = _GGUF_ARCHES[str(source.metadata.get("general.architecture"))]
    tensors = source.tensor_shapes
    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    num_layers = int(key("block_count")) - int(key("nextn_predict_layers", 0))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    num_experts = int(key("expert_count", 0))
    ffn = key("feed_forward_length", 0)
    if isinstance(ffn, list):
        ffn = max(ffn)
    scaling_kind = source.metadata.get(f"{source.metadata.get('general.architecture')}.rope.scaling.type")
    if scaling_kind not in (None, "none"):
        raise NotImplementedError(f"GGUF rope scaling {scaling_kind!r} is not supported for {arch}")
    num_v = int(key("ssm.time_step_rank"))
    num_k = int(key("ssm.group_count"))
    moe = tuple(f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(num_layers))
    router = RouterSpec(num_experts=num_experts, top_k=int(key("expert_used_count")), scoring="softmax",
                        norm_topk_prob=bool(key("expert_weights_norm", True))) if num_experts else \
        RouterSpec(num_experts=1, top_k=1)
    return Qwen3NextConfig(
        arch=arch,
        vocab_size=int(tensors["token_embd.weight"][0]),
        hidden_size=hidden,
        intermediate_size=int(ffn) or 1,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=gguf_kv_heads(key, num_heads),
        head_dim=head_dim,
        moe_layers=moe,
        router=router,
        moe_intermediate_size=int(key("expert_feed_forward_length", 1)),
        shared_intermediate_size=int(key("expert_shared_feed_forward_length", 0)),
        shared_name="shared_expert",
        shared_expert_gate=True,
        rotary_dim=int(key("rope.dimension_count", head_dim // 4)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length", 32768)),
        tie_word_embeddings="output.weight" not in tensors,
        qk_norm=True,
        linear_layers=tuple(f"blk.{i}.ssm_a" in tensors for i in range(num_layers)),
        linear_num_key_heads=num_k,
        linear_num_value_heads=num_v,
        linear_key_head_dim=int(key("ssm.state_size")),
        linear_value_head_dim=int(key("ssm.inner_size")) // num_v,
        conv_kernel=int(key("ssm.conv_kernel")),
        norms_shifted=True,
        split_ba=arch != "qwen3_next",
        value_heads_tiled=arch != "qwen3_next" and num_k != num_v,
    )


_GGUF_LINEAR_NAMES = {
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}


def gguf_tensor(config: ArchitectureConfig, gguf_name: str) -> GGUFTensor | None:
    return gguf_moe_tensor(config, gguf_name, _GGUF_LINEAR_NAMES)


def config_from_hf(config: Mapping[str, Any], arch: str = "qwen3_next") -> Qwen3NextConfig:
    """A Qwen3-Next config from its ``config.json`` (transformers 4.57+ and 5.x spellings), or with
    ``arch`` ``qwen3_5`` / ``qwen3_5_moe`` a Qwen3.5 text config (``qwen3_5_text`` /
    ``qwen3_5_moe_text``: separate ``in_proj_b`` / ``in_proj_a``; the MoE one sparse in every layer,
    renormalised)."""
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config.get('hidden_act')!r}")
    hidden = int(config["hidden_size"])
    num_heads = int(config["num_attention_heads"])
    num_layers = int(config["num_hidden_layers"])
    num_experts = int(config.get("num_experts") or 0)
    rope_params: Mapping[str, Any] = config.get("rope_parameters") or {}
    rope_theta = config.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
    partial = float(rope_params.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 0.25)
    scaling = config.get("rope_scaling") or (rope_params if rope_params else None)
    head_dim = int(config.get("head_dim") or hidden // num_heads)
    types = config.get("layer_types")
    if types is None:
        interval = int(config.get("full_attention_interval") or 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown:
        raise NotImplementedError(f"{arch} layer types {unknown} are not supported")
    if num_experts > 0:
        moe = moe_layer_flags(num_layers, num_experts, int(config.get("decoder_sparse_step") or 1),
                              tuple(int(i) for i in config.get("mlp_only_layers") or ()))
        router = RouterSpec(num_experts=num_experts, top_k=int(config["num_experts_per_tok"]), scoring="softmax",
                            norm_topk_prob=bool(config.get("norm_topk_prob", True)))
    else:
        moe, router = (False,) * num_layers, RouterSpec(num_experts=1, top_k=1)
    return Qwen3NextConfig(
        arch=arch,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config.get("intermediate_size") or 1),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        moe_layers=moe,
        router=router,
        moe_intermediate_size=int(config.get("moe_intermediate_size") or 1),
        shared_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0),
        shared_name="shared_expert",
        shared_expert_gate=True,
        rotary_dim=int(head_dim * partial),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=normalize_rope_scaling(scaling),
        max_position_embeddings=int(config.get("max_position_embeddings") or 32768),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", False)),
        qk_norm=True,
        linear_layers=tuple(t == "linear_attention" for t in types),
        linear_num_key_heads=int(config.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(config.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(config.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(config.get("linear_value_head_dim", 128)),
        conv_kernel=int(config.get("linear_conv_kernel_dim", 4)),
        split_ba=arch != "qwen3_next",
    )


class Qwen3NextForCausalLM(MoEForCausalLM):
    """`MoEForCausalLM` with Qwen3-Next's two layer kinds (`_GatedAttentionLayer`,
    `_GatedDeltaNetLayer`) and ``1 + weight`` RMSNorms."""

    config: Qwen3NextConfig

    def __init__(self, config: Qwen3NextConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", *, lm_head_fp32: bool = True,
                 weights: WeightFormat | None = None, q8_head: bool = False) -> None:
        super().__init__(config, dtype, device, lm_head_fp32=lm_head_fp32, weights=weights, q8_head=q8_head)

    def _build_layers(self, device: torch.device, dense_dtype: torch.dtype | None) -> list[DecoderLayer]:
        cfg = self.config
        return [(_GatedDeltaNetLayer if cfg.linear_layers[i] else _GatedAttentionLayer)(cfg, i, self.dtype, device,
                                                                                         dense_dtype)
                for i in range(cfg.num_layers)]

    def _checkpoint_value(self, name: str, value: Tensor) -> Tensor:
        """The ``1 + weight`` norms stored as the scale they apply (float32); the gated norm of the
        linear-attention layers is a plain weight."""
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight") \
                and not self.config.norms_shifted:
            return value.float() + 1.0
        return value

    def cache_specs(self) -> tuple[CacheSpec, ...]:
        cfg = self.config
        full = FullAttentionSpec(cfg.num_kv_heads, cfg.head_dim)
        state = RecurrentStateSpec(((cfg.conv_kernel - 1, cfg.conv_channels),
                                    (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)),
                                   dtype=torch.float32)
        return tuple(state if linear else full for linear in cfg.linear_layers)

    def load_weights(self, tensors: Mapping[str, BuildSource]) -> None:
        """`MoEForCausalLM.load_weights` over the names this module keeps (`LinearAttentionNames`)."""
        super().load_weights(LinearAttentionNames(tensors, self.config))


class LinearAttentionNames(Mapping[str, BuildSource]):
    """``tensors`` (read lazily) as the models with a delta-rule mixer keep its weights (Qwen3-Next,
    Qwen3.5, `helios.models.kimi_linear`), in llama.cpp's layout, which GGUF files have already:
    ``in_proj_qkvz`` (per key head [q | k | v | z]) read as ``in_proj_qkv`` ([all q | all k | all
    v], the conv's channel order) and ``in_proj_z``; any ``A_log`` as ``A`` = -exp(A_log)
    (flattened: Kimi's is [1, 1, heads, 1], and so is a Kimi GGUF's ``A``); a ``*conv1d`` weight
    [C, 1, K] (or a Kimi GGUF's [1, C, 1, K]) as [C, K]. Without the
    multi-token-prediction weights (``mtp.*``), which transformers ignores too. ``config``: the
    Qwen3-Next shape that regroups ``in_proj_qkvz`` (None where no checkpoint has one)."""

    def __init__(self, tensors: Mapping[str, BuildSource], config: Qwen3NextConfig | None) -> None:
        self._tensors = tensors
        self._config = config
        self._source: dict[str, tuple[str, str]] = {}  # our name -> (checkpoint name, how)
        for name in tensors:
            if name.startswith("mtp."):
                continue
            if name.endswith("linear_attn.in_proj_qkvz.weight"):
                base = name.removesuffix("in_proj_qkvz.weight")
                self._source[f"{base}in_proj_qkv.weight"] = (name, "qkv")
                self._source[f"{base}in_proj_z.weight"] = (name, "z")
            elif name.endswith(".A_log"):
                self._source[name.removesuffix("A_log") + "A"] = (name, "a")
            elif name.endswith("conv1d.weight"):
                self._source[name] = (name, "conv")
            elif name.endswith("self_attn.A"):  # a GGUF's -exp(A_log) of Kimi's shape
                self._source[name] = (name, "flat")
            else:
                self._source[name] = (name, "")
        self._last: tuple[str, Tensor] | None = None

    def __getitem__(self, name: str) -> BuildSource:
        source, how = self._source[name]
        if not how:
            return self._tensors[source]
        if self._last is not None and self._last[0] == source:
            value = self._last[1]
        else:
            raw = self._tensors[source]
            if not isinstance(raw, Tensor):
                raise NotImplementedError(f"{source}: only dense tensors are read in transformers' layout")
            value = raw
            self._last = (source, value)
        if how == "a":
            return -value.float().exp().reshape(-1)
        if how == "conv":  # [C, 1, K], [C, K] or a GGUF's [1, C, 1, K]
            return value.reshape(-1, value.shape[-1])
        if how == "flat":
            return value.reshape(-1)
        cfg = self._config
        assert cfg is not None, f"{source}: in_proj_qkvz needs the Qwen3-Next shape"
        group = cfg.linear_num_value_heads // cfg.linear_num_key_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        per_head = value.view(cfg.linear_num_key_heads, 2 * dk + 2 * group * dv, -1)
        q, k, v, z = per_head.split((dk, dk, group * dv, group * dv), dim=1)
        if how == "z":
            return z.reshape(-1, value.shape[-1]).clone()
        return torch.cat([t.reshape(-1, value.shape[-1]) for t in (q, k, v)])

    def __iter__(self) -> Iterator[str]:
        return iter(self._source)

    def __len__(self) -> int:
        return len(self._source)


class _GatedAttentionLayer(MoELayer):
    """`MoELayer` with the output-gated attention: ``q_proj`` rows are per head [query | gate]."""

    def projection_parts(self) -> dict[str, tuple[tuple[str, tuple[int, int]], ...]]:
        parts = super().projection_parts()
        hidden = self.hidden_size
        parts["qkv_proj"] = (("self_attn.q_proj.weight", (2 * self.q_size, hidden)),
                             ("self_attn.k_proj.weight", (self.kv_size, hidden)),
                             ("self_attn.v_proj.weight", (self.kv_size, hidden)))
        return parts

    def forward(self, h: Tensor, delta: Tensor | None, cos: Tensor, sin: Tensor, attn: AttentionContext,
                fused: bool = False, *, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
        num_tokens = h.shape[0]
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        h, x = add_rms_norm(h, delta, self.input_norm, self.eps, fused)
        qkv = cast(nn.Module, self.qkv_proj)(x)
        if self.qkv_bias is not None:
            raise NotImplementedError("gated attention with attention_bias is not supported")
        q_gate = qkv[:, : 2 * self.q_size].view(num_tokens, nh, 2 * d)
        gate = q_gate[..., d:]
        k = qkv[:, 2 * self.q_size : 2 * self.q_size + self.kv_size].view(num_tokens, nkv, d)
        v = qkv[:, 2 * self.q_size + self.kv_size :].view(num_tokens, nkv, d)
        qk = torch.cat((q_gate[..., :d], k), dim=1)
        assert self.qk_norm is not None
        qk = rms_norm(qk, self.qk_norm, self.eps)
        rot = self.rotary_dim
        qk = apply_rope(qk, cos, sin) if rot == d else torch.cat((apply_rope(qk[..., :rot], cos, sin), qk[..., rot:]),
                                                                 dim=-1)
        q, k = qk.split((nh, nkv), dim=1)
        out = attn(self.layer_idx, q, k, v)
        out = out * torch.sigmoid(gate)
        return self.finish(h, out, keep, fused, self.q_size)


class _GatedDeltaNetLayer(MoELayer):
    """`MoELayer`'s feed-forward after a Gated DeltaNet mixer (no attention projections: ``in_proj``
    fuses ``in_proj_qkv``, ``in_proj_z`` and ``in_proj_ba`` (`LinearAttentionNames`), or Qwen3.5's
    ``in_proj_b`` and ``in_proj_a``; ``out_proj``)."""

    def __init__(self, config: Qwen3NextConfig, layer_idx: int, dtype: torch.dtype, device: torch.device,
                 dense_dtype: torch.dtype | None) -> None:
        super().__init__(config, layer_idx, dtype, device, dense_dtype)
        del self.qkv_proj, self.o_proj  # no attention projections here
        self.qk_norm = None
        self.qkv_bias = None
        self.nk, self.nv = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_size, self.value_size = config.linear_key_size, config.linear_value_size
        self.split_ba, self.tiled = config.split_ba, config.value_heads_tiled
        channels, width = config.conv_channels, config.conv_kernel
        self.in_proj: nn.Module | None = None
        self.out_proj: nn.Module | None = None
        self.conv_weight = param(torch.empty(channels, width, dtype=dtype, device=device))
        self.dt_bias = param(torch.empty(self.nv, dtype=torch.float32, device=device))
        self.neg_rate = param(torch.empty(self.nv, dtype=torch.float32, device=device))  # -exp(A_log)
        self.gated_norm = param(torch.empty(self.dv, dtype=torch.float32, device=device))

    def projection_parts(self) -> dict[str, tuple[tuple[str, tuple[int, int]], ...]]:
        parts = {k: v for k, v in super().projection_parts().items() if k not in ("qkv_proj", "o_proj")}
        hidden = self.hidden_size
        parts["in_proj"] = (("linear_attn.in_proj_qkv.weight", (2 * self.key_size + self.value_size, hidden)),
                            ("linear_attn.in_proj_z.weight", (self.value_size, hidden)),
                            *((("linear_attn.in_proj_b.weight", (self.nv, hidden)),
                               ("linear_attn.in_proj_a.weight", (self.nv, hidden))) if self.split_ba else
                              (("linear_attn.in_proj_ba.weight", (2 * self.nv, hidden)),)))
        parts["out_proj"] = (("linear_attn.out_proj.weight", (hidden, self.value_size)),)
        return parts

    def set_projection(self, attr: str, module: nn.Module) -> None:
        if attr in _LINEAR_PROJ:
            setattr(self, attr, module)
            return
        super().set_projection(attr, module)

    def weight_targets(self) -> dict[str, Tensor]:
        targets = super().weight_targets()
        targets.update({
            "linear_attn.conv1d.weight": self.conv_weight,
            "linear_attn.dt_bias": self.dt_bias,
            "linear_attn.A": self.neg_rate,
            "linear_attn.norm.weight": self.gated_norm,
        })
        return targets

    def mix(self, x: Tensor, attn: AttentionContext) -> Tensor:
        """The Gated DeltaNet output [T, hidden] of the normed stream ``x``."""
        num_tokens = x.shape[0]
        nk, nv, dk, dv = self.nk, self.nv, self.dk, self.dv
        group = nv // nk
        proj = cast(nn.Module, self.in_proj)(x)
        conv_in = 2 * self.key_size + self.value_size
        mixed, z, ba = proj.split((conv_in, self.value_size, 2 * nv), dim=-1)
        if self.split_ba:
            b, a = ba.split((nv, nv), dim=-1)
        else:
            ba = ba.reshape(num_tokens, nk, 2 * group)  # per key head [b of its value heads | a of them]
            b, a = ba[..., :group].reshape(num_tokens, nv), ba[..., group:].reshape(num_tokens, nv)
        batch = attn.recurrent(self.layer_idx)
        conv_state, delta_state = batch.states
        mixed = causal_conv(mixed, self.conv_weight, conv_state, batch.spans).to(x.dtype)
        q, k, v = mixed.split((self.key_size, self.key_size, self.value_size), dim=-1)
        wide = torch.promote_types(x.dtype, torch.float32)  # float32 (float64 for a float64 reference)
        beta = torch.sigmoid(b).to(wide)
        g = self.neg_rate * F.softplus(a.to(wide) + self.dt_bias)
        core = gated_delta(q.reshape(num_tokens, nk, dk), k.reshape(num_tokens, nk, dk),
                           v.reshape(num_tokens, nv, dv), g, beta, delta_state, batch.spans, tiled=self.tiled)
        core = core.to(x.dtype).to(wide)
        normed = core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + self.eps) * self.gated_norm
        out = normed * F.silu(z.reshape(num_tokens, nv, dv).to(wide))
        return cast(Tensor, cast(nn.Module, self.out_proj)(out.to(x.dtype).reshape(num_tokens, self.value_size)))

    def forward(self, h: Tensor, delta: Tensor | None, cos: Tensor, sin: Tensor, attn: AttentionContext,
                fused: bool = False, *, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
        h, x = add_rms_norm(h, delta, self.input_norm, self.eps, fused)
        out = self.mix(x, attn)
        if keep is not None:
            h, out = h.index_select(0, keep), out.index_select(0, keep)
            if keep.shape[0] == 0:
                return h, h
        h, x = add_rms_norm(h, out, self.post_attention_norm, self.eps, fused)
        return h, self.feed_forward(x, fused)


def build(config: ArchitectureConfig, options: BuildOptions) -> Qwen3NextForCausalLM:
    assert isinstance(config, Qwen3NextConfig), config
    return Qwen3NextForCausalLM(config, dtype=options.dtype, device=options.device, weights=options.weights,
                                q8_head=options.q8_head)


ARCHITECTURES = (
    Architecture(
        name="qwen3_next",
        hf_model_types=("qwen3_next",),
        hf_architectures=("Qwen3NextForCausalLM",),
        gguf_architectures=("qwen3next",),
        config_from_hf=config_from_hf,
        config_from_gguf=config_from_gguf,
        gguf_tensor=gguf_tensor,
        build=build,
    ),
    Architecture(
        name="qwen3_5",
        hf_model_types=("qwen3_5_text",),
        hf_architectures=("Qwen3_5ForCausalLM",),
        gguf_architectures=("qwen35",),
        config_from_hf=functools.partial(config_from_hf, arch="qwen3_5"),
        config_from_gguf=config_from_gguf,
        gguf_tensor=gguf_tensor,
        build=build,
    ),
    Architecture(
        name="qwen3_5_moe",
        hf_model_types=("qwen3_5_moe_text",),
        hf_architectures=("Qwen3_5MoeForCausalLM",),
        gguf_architectures=("qwen35moe",),
        config_from_hf=functools.partial(config_from_hf, arch="qwen3_5_moe"),
        config_from_gguf=config_from_gguf,
        gguf_tensor=gguf_tensor,
        build=build,
    ),
)
"""The registry entries (`helios.models.registry`): Qwen3-Next, and Qwen3.5 dense and MoE (text;
their vision-language checkpoints' text part through `helios.models.vision.registry`)."""
