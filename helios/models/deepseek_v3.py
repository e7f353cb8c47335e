"""DeepSeek-V3 / Kimi K2 (transformers' ``deepseek_v3`` / ``DeepseekV3ForCausalLM``): multi-head
latent attention (MLA) with an MoE feed-forward.

Attention, as transformers 5 computes it (`DeepseekV3Attention`):

- the query: ``q_proj`` (``q_lora_rank`` None), or ``q_b_proj(rms_norm(q_a_proj(x)))`` (eps 1e-6,
  the norm's own default); per head ``qk_nope_head_dim`` non-rotary and ``qk_rope_head_dim`` rotary
  dimensions;
- ``kv_a_proj_with_mqa(x)`` = the latent (``kv_lora_rank``, RMSNorm'd, eps 1e-6) and one rotary key
  shared by all heads (``qk_rope_head_dim``);
- RoPE on the rotary dimensions only, with ``rope_interleave`` (the default) on interleaved pairs:
  the rotary parts are de-interleaved (even dimensions, then odd) and rotated in halves, which is
  transformers' ``apply_rotary_pos_emb_interleave`` to the bit (q and k take the same order, so the
  scores are unchanged by it); YaRN rope scaling (`config.yarn_inv_freq`: frequencies and the cos/sin
  factor ``mscale / mscale_all_dim``) and, with ``mscale_all_dim``, the softmax scale
  ``(qk_nope + qk_rope) ** -0.5 * yarn_get_mscale(factor, mscale_all_dim) ** 2``;
- ``kv_b_proj`` expands the latent into each head's non-rotary key and value (``v_head_dim``);
  the layer keeps it as a dense [heads, nope + v, rank] tensor (`interface.LatentProjection`) and
  the attention context applies it: expanded for prefill, absorbed into the query for decode
  (`helios.models.latent_attention`).

Each layer's cache is a `LatentAttentionSpec` row of ``kv_lora_rank + qk_rope_head_dim`` elements
(576 in DeepSeek-V3, against 2 x 128 x 192 = 49,152 for the expanded K and V of its 128 heads).

``mla_cache = "expanded"`` (`BuildOptions.mla_cache`; the comparison of docs/benchmarks.md, "MLA:
absorbed decode against expanded KV") keeps instead what a server without MLA support keeps: each
head's key ``[k_nope | k_rope]`` (the rotary key repeated for every head) and value, made from the
step's latent rows through ``kv_b_proj`` (`latent_attention.expand_context`) as they are written,
in a `FullAttentionSpec` of ``num_heads`` kv heads, and ordinary multi-head attention over them
through the context's standard call (the engine's paged path and kernels of every other family).
The cache specs have one head size for K and V, so the narrower of the two (V: 128 against 192) is
padded with zeros to the wider and the output sliced back (the zero columns add nothing to the
scores or the sums): 2 x 128 x 192 elements per token and layer, of which 128 x 64 are padding.

Feed-forward (`helios.models.moe_decoder`): the first ``first_k_dense_replace`` layers dense
(``intermediate_size``), the others the sigmoid router with ``e_score_correction_bias``,
``n_group`` / ``topk_group``, renormalised, ``routed_scaling_factor``, and ``n_shared_experts``
shared experts. The multi-token-prediction layer (``model.layers.{num_hidden_layers}``) is not
part of the model, as in transformers; with speculation on it drafts (`helios.models.mtp`). FP8 checkpoints (``quantization_config``, DeepSeek's and Kimi's
releases) are refused: a bfloat16 conversion loads.

GGUF: llama.cpp's ``deepseek2`` (`config_from_gguf`, `gguf_tensor`). Its converter writes the
attention as multi-query over the latent (``head_count_kv`` 1, ``key_length`` = rank + rope,
``value_length`` = rank; the per-head sizes under ``key_length_mla`` / ``value_length_mla``; older
files have no ``*_mla`` keys and the per-head sizes in ``key_length`` / ``value_length``), the
rotary dimensions in DeepSeek's interleaved order (llama.cpp's "normal" RoPE on consecutive
pairs: ``rope_interleave``), YaRN's ``mscale_all_dim`` as ``rope.scaling.yarn_log_multiplier`` =
0.1 x it, and ``kv_b_proj`` either whole (``attn_kv_b``) or split into ``attn_k_b`` ([heads,
rank, nope]: transposed) and ``attn_v_b`` ([heads, v, rank]), which are joined back on load
(`_JoinedKvB`). Only sigmoid gating (``expert_gating_func`` 2; DeepSeek-V2's files, which write
none, are softmax-routed) is accepted.
"""

from __future__ import annotations

import math
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
from helios.models.config import normalize_rope_scaling, yarn_inv_freq
from helios.models.decoder import DecoderLayer, add_rms_norm, apply_rope, param, rms_norm, rope_tables
from helios.models.interface import (
    AttentionContext,
    CacheSpec,
    FullAttentionSpec,
    LatentAttentionSpec,
    LatentProjection,
    SparseIndex,
)
from helios.models.latent_attention import expand_context
from helios.models.moe import RouterSpec
from helios.models.moe_decoder import MoEConfig, MoEForCausalLM, MoELayer, gguf_moe_tensor
from helios.models.quant import BuildSource, DenseLinear, UnloadedLinear, WeightFormat, dense_of

__all__ = ["ARCHITECTURES", "DeepseekV3Config", "DeepseekV3ForCausalLM", "config_from_gguf", "config_from_hf",
           "gguf_mla_fields", "gguf_tensor"]

_LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them with the default eps


@attrs.frozen(kw_only=True)
class DeepseekV3Config(MoEConfig):
    """`MoEConfig` (``head_dim`` = ``qk_nope_head_dim + qk_rope_head_dim``, the q/k head size;
    ``num_kv_heads`` = ``num_heads``; ``rotary_dim`` = ``qk_rope_head_dim``) plus MLA's shape and
    ``yarn`` (a YaRN rope scaling dict, or None; ``rope_scaling`` stays None)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True
    yarn: dict[str, Any] | None = attrs.field(default=None, hash=False)
    rope: bool = True
    """False: the ``qk_rope_head_dim`` parts of the query and the shared key are not rotated (Kimi
    Linear's MLA, `helios.models.kimi_linear`)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise ValueError("head_dim must be qk_nope_head_dim + qk_rope_head_dim")
        for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"q_lora_rank must be positive or None, got {self.q_lora_rank}")

    @property
    def row_dim(self) -> int:
        """Elements of one token's cache row per layer: the latent and the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``(qk_nope + qk_rope) ** -0.5``, times ``mscale ** 2`` under YaRN with ``mscale_all_dim``."""
        scale = self.head_dim ** -0.5
        yarn = self.yarn
        if yarn is not None and yarn.get("mscale_all_dim"):
            factor = float(yarn["factor"])
            mscale = 1.0 if factor <= 1 else 0.1 * float(yarn["mscale_all_dim"]) * math.log(factor) + 1.0
            scale *= mscale * mscale
        return scale

    def projection_params(self) -> int:
        """Weights of the attention (q, kv_a, kv_b, o), dense MLPs and shared experts (not the
        routed experts; `MoEConfig.projection_params`)."""
        hidden, heads = self.hidden_size, self.num_heads
        q = heads * self.head_dim
        q_params = hidden * q if self.q_lora_rank is None else self.q_lora_rank * (hidden + q)
        attention = q_params + hidden * self.row_dim + self.kv_lora_rank * heads * (
            self.qk_nope_head_dim + self.v_head_dim) + heads * self.v_head_dim * hidden
        total = 0
        for moe in self.moe_layers:
            inter = self.shared_intermediate_size if moe else self.intermediate_size
            total += attention + 3 * inter * hidden
        return int(total)


def config_from_hf(config: Mapping[str, Any]) -> DeepseekV3Config:
    """A DeepSeek-V3 config from its ``config.json`` (legacy ``rope_theta`` / ``rope_scaling`` or
    transformers 5's ``rope_parameters``)."""
    if config.get("quantization_config"):
        raise NotImplementedError("deepseek_v3: quantized checkpoints (quantization_config, e.g. FP8) are not "
                                  "supported; convert the weights to bfloat16")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config.get('hidden_act')!r}")
    if config.get("attention_bias"):
        raise NotImplementedError("deepseek_v3: attention_bias is not supported")
    if config.get("scoring_func", "sigmoid") != "sigmoid" or config.get("topk_method", "noaux_tc") != "noaux_tc":
        raise NotImplementedError("deepseek_v3: only sigmoid scoring with noaux_tc routing is supported")
    hidden = int(config["hidden_size"])
    num_heads = int(config["num_attention_heads"])
    num_layers = int(config["num_hidden_layers"])
    nope, rope = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
    rope_params: Mapping[str, Any] = config.get("rope_parameters") or {}
    rope_theta = config.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
    scaling = normalize_rope_scaling(config.get("rope_scaling") or (rope_params if rope_params else None))
    if scaling is not None and scaling["rope_type"] != "yarn":
        raise NotImplementedError(f"deepseek_v3: rope type {scaling['rope_type']!r} is not supported (yarn only)")
    max_pos = int(config.get("max_position_embeddings") or 4096)
    if scaling is not None:
        scaling.setdefault("original_max_position_embeddings", max_pos)
        if scaling.get("factor") is None:
            scaling["factor"] = max_pos / float(scaling["original_max_position_embeddings"])
    moe_inter = int(config["moe_intermediate_size"])
    first_dense = int(config.get("first_k_dense_replace") or 0)
    q_lora = config.get("q_lora_rank")
    return DeepseekV3Config(
        arch="deepseek_v3",
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=nope + rope,
        moe_layers=tuple(i >= first_dense for i in range(num_layers)),
        router=RouterSpec(num_experts=int(config["n_routed_experts"]), top_k=int(config["num_experts_per_tok"]),
                          scoring="sigmoid", norm_topk_prob=bool(config.get("norm_topk_prob", True)),
                          n_group=int(config.get("n_group") or 1), topk_group=int(config.get("topk_group") or 1),
                          routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0)),
        moe_intermediate_size=moe_inter,
        shared_intermediate_size=moe_inter * int(config.get("n_shared_experts") or 0),
        shared_name="shared_experts",
        rotary_dim=rope,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(config["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=int(config.get("v_head_dim") or 128),
        rope_interleave=bool(config.get("rope_interleave", True)),
        yarn=scaling,
    )


_SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def config_from_gguf(source: GGUFSource) -> DeepseekV3Config:
    """A DeepSeek-V3 config from llama.cpp's ``deepseek2`` metadata (see the module docstring)."""
    gating = source.metadata.get(f"{source.metadata.get('general.architecture')}.expert_gating_func")
    if gating != _SIGMOID_GATING:
        raise NotImplementedError(f"deepseek2 expert_gating_func {gating} is not supported (sigmoid: 2; a file "
                                  "without it is DeepSeek-V2's softmax routing)")
    return DeepseekV3Config(arch="deepseek_v3", **gguf_mla_fields(source))


def gguf_mla_fields(source: GGUFSource) -> dict[str, Any]:
    """The `DeepseekV3Config` fields (all but ``arch``) of llama.cpp's MLA metadata, ``deepseek2``'s
    and ``kimi-linear``'s (`helios.models.kimi_linear`): the sizes, RoPE (YaRN), the sigmoid
    router's counts, groups and scale, the dense leading layers."""
    key = gguf_key(source)
    meta, tensors = source.metadata, source.tensor_shapes
    prefix = str(meta.get("general.architecture"))

    def optional(name: str) -> Any:
        return meta.get(f"{prefix}.{name}")

    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    num_layers = int(key("block_count")) - int(optional("nextn_predict_layers") or 0)
    rank, rope = int(key("attention.kv_lora_rank")), int(key("rope.dimension_count"))
    if optional("attention.key_length_mla") is not None:
        qk_head, v_head = int(key("attention.key_length_mla")), int(key("attention.value_length_mla"))
    else:  # converters before the MLA-as-MQA layout: the per-head sizes
        qk_head, v_head = int(key("attention.key_length")), int(key("attention.value_length"))
    q_lora = optional("attention.q_lora_rank")
    max_pos = int(key("context_length", 4096))
    yarn: dict[str, Any] | None = None
    kind = optional("rope.scaling.type")
    if kind == "yarn":
        yarn = {"rope_type": "yarn", "factor": float(key("rope.scaling.factor")),
                "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
                "beta_fast": float(optional("rope.scaling.yarn_beta_fast") or 32.0),
                "beta_slow": float(optional("rope.scaling.yarn_beta_slow") or 1.0)}
        log_mul = optional("rope.scaling.yarn_log_multiplier")
        if log_mul:  # 0.1 * mscale_all_dim; llama.cpp's cos/sin factor is then 1: mscale = mscale_all_dim
            yarn["mscale"] = yarn["mscale_all_dim"] = float(log_mul) / 0.1
    elif kind not in (None, "none"):
        raise NotImplementedError(f"GGUF rope scaling {kind!r} is not supported for deepseek2")
    moe_inter = int(key("expert_feed_forward_length"))
    ffn = key("feed_forward_length")
    if isinstance(ffn, list):
        ffn = max(ffn)
    return dict(
        vocab_size=int(tensors["token_embd.weight"][0]),
        hidden_size=hidden,
        intermediate_size=int(ffn),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=qk_head,
        moe_layers=tuple(i >= int(optional("leading_dense_block_count") or 0) for i in range(num_layers)),
        router=RouterSpec(num_experts=int(key("expert_count")), top_k=int(key("expert_used_count")),
                          scoring="sigmoid", norm_topk_prob=bool(optional("expert_weights_norm") or False),
                          n_group=int(optional("expert_group_count") or 1),
                          topk_group=int(optional("expert_group_used_count") or 1),
                          routed_scaling_factor=float(optional("expert_weights_scale") or 1.0)),
        moe_intermediate_size=moe_inter,
        shared_intermediate_size=moe_inter * int(optional("expert_shared_count") or 0),
        shared_name="shared_experts",
        rotary_dim=rope,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=max_pos,
        tie_word_embeddings="output.weight" not in tensors,
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=rank,
        qk_nope_head_dim=qk_head - rope,
        qk_rope_head_dim=rope,
        v_head_dim=v_head,
        rope_interleave=True,
        yarn=yarn,
    )


_GGUF_MLA_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_k_b.weight": "self_attn.k_b_proj.weight",  # joined with v_b into kv_b_proj (`_JoinedKvB`)
    "attn_v_b.weight": "self_attn.v_b_proj.weight",
}


def gguf_tensor(config: ArchitectureConfig, gguf_name: str, *, mtp: bool = True) -> GGUFTensor | None:
    """Where a ``deepseek2`` tensor goes: the MLA names here, the rest as the MoE families'
    (`moe_decoder.gguf_moe_tensor`; the next-token-prediction layers, which llama.cpp writes for
    GLM-4.7-Flash's and DeepSeek-V3.2's conversions, under ``model.layers.{N}`` as a folder has
    them, unless not ``mtp``). No q/k permutation: the rotary dimensions stay interleaved
    (``rope_interleave``)."""
    assert isinstance(config, DeepseekV3Config), type(config)
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_MLA_NAMES:
        if int(parts[1]) >= config.num_layers and not mtp:
            return None
        return GGUFTensor(f"model.layers.{parts[1]}.{_GGUF_MLA_NAMES[parts[2]]}")
    return gguf_moe_tensor(config, gguf_name, mtp=mtp)


class _JoinedKvB(Mapping[str, BuildSource]):
    """``tensors`` with each layer's ``k_b_proj`` ([heads, rank, nope]) and ``v_b_proj`` ([heads,
    v, rank]), llama.cpp's split of ``kv_b_proj``, seen as the ``kv_b_proj`` [heads * (nope + v),
    rank] they make (read when it is asked for)."""

    def __init__(self, tensors: Mapping[str, BuildSource]) -> None:
        self._tensors = tensors
        self._names: list[str] = []
        for name in tensors:
            if name.endswith(".self_attn.k_b_proj.weight"):
                self._names.append(name.replace(".k_b_proj.", ".kv_b_proj."))
            elif not name.endswith(".self_attn.v_b_proj.weight"):
                self._names.append(name)

    def __getitem__(self, name: str) -> BuildSource:
        if name.endswith(".self_attn.kv_b_proj.weight") and name not in self._tensors:
            k_b = dense_of(self._tensors[name.replace(".kv_b_proj.", ".k_b_proj.")])
            v_b = dense_of(self._tensors[name.replace(".kv_b_proj.", ".v_b_proj.")])
            if k_b.dim() != 3 or v_b.dim() != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
                raise ValueError(f"{name}: k_b {tuple(k_b.shape)} and v_b {tuple(v_b.shape)} do not make a kv_b_proj")
            return torch.cat((k_b.transpose(1, 2), v_b.to(k_b.dtype)), dim=1).reshape(-1, k_b.shape[1])
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class DeepseekV3ForCausalLM(MoEForCausalLM):
    """DeepSeek-V3 on `MoEForCausalLM` (same constructor arguments): MLA layers, one latent cache
    row per token and layer."""

    config: DeepseekV3Config
    rope_factor: float
    expanded: bool

    def __init__(self, config: DeepseekV3Config, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", *, lm_head_fp32: bool = True,
                 weights: WeightFormat | None = None, q8_head: bool = False, mla_cache: str = "latent") -> None:
        """``mla_cache``: "latent" (one row per token, absorbed decode) or "expanded" (each head's K
        and V; `BuildOptions.mla_cache`)."""
        if mla_cache not in ("latent", "expanded"):
            raise ValueError(f"mla_cache must be 'latent' or 'expanded', got {mla_cache!r}")
        super().__init__(config, dtype, device, lm_head_fp32=lm_head_fp32, weights=weights, q8_head=q8_head)
        self.expanded = mla_cache == "expanded"
        if self.expanded:
            for layer in self._decoder_layers():
                layer.expanded = True
        self.rope_factor = 1.0  # YaRN's cos/sin factor
        if config.yarn is not None:
            freq, self.rope_factor = yarn_inv_freq(config.qk_rope_head_dim, config.rope_theta, config.yarn,
                                                   config.max_position_embeddings)
            self.inv_freq = freq.to(device)

    def load_weights(self, tensors: Mapping[str, BuildSource]) -> None:
        """`MoEForCausalLM.load_weights`, with llama.cpp's split ``k_b`` / ``v_b`` joined into ``kv_b_proj``."""
        super().load_weights(_JoinedKvB(tensors))

    def _build_layers(self, device: torch.device, dense_dtype: torch.dtype | None) -> list[DecoderLayer]:
        cfg = self.config
        return [_MLALayer(cfg, i, self.dtype, device, dense_dtype) for i in range(cfg.num_layers)]

    def cache_specs(self) -> tuple[CacheSpec, ...]:
        cfg = self.config
        if self.expanded:  # K and V of every head, the narrower zero-padded to the wider
            width = max(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim)
            return (FullAttentionSpec(cfg.num_heads, width),) * cfg.num_layers
        return (LatentAttentionSpec(cfg.row_dim),) * cfg.num_layers

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionContext, *,
                embeds: tuple[Tensor, Tensor] | None = None, keep: Tensor | None = None) -> Tensor:
        """Hidden states after the final norm (``embeds`` and ``keep`` as in `LlamaForCausalLM.forward`)."""
        cos, sin = rope_tables(positions, self.inv_freq, self.dtype)
        if self.rope_factor != 1.0:
            cos, sin = cos * self.rope_factor, sin * self.rope_factor
        h = self.embed(input_ids)
        if embeds is not None:
            rows, features = embeds
            h = h.index_copy(0, rows.to(h.device), features.to(device=h.device, dtype=h.dtype))
        fused = h.device.type == "cpu" and h.dtype in (torch.float32, torch.bfloat16) and cpu_kernels.available()
        delta: Tensor | None = None
        layers = self._decoder_layers()
        for i, layer in enumerate(layers):
            last = i == len(layers) - 1
            h, delta = layer(h, delta, cos, sin, attn, fused, keep=keep if last else None)
        if h.shape[0] == 0:
            return h
        return add_rms_norm(h, delta, self.norm, self.config.rms_norm_eps, fused)[1]

    def _decoder_layers(self) -> Sequence[_MLALayer]:
        return [cast(_MLALayer, layer) for layer in self.layers]


class _MLALayer(MoELayer):
    """`MoELayer` (its feed-forward) with multi-head latent attention. Projections: ``qkv_a_proj``
    (the query's first projection, ``q_a_proj`` or ``q_proj``, fused with ``kv_a_proj_with_mqa``:
    both read the normed input), ``q_b_proj`` (with ``q_lora_rank``), ``o_proj``; ``kv_b_proj`` is
    a dense [heads, nope + v, rank] parameter (``kv_up``), which the attention context uses."""

    def __init__(self, config: DeepseekV3Config, layer_idx: int, dtype: torch.dtype, device: torch.device,
                 dense_dtype: torch.dtype | None) -> None:
        super().__init__(config, layer_idx, dtype, device, dense_dtype)
        del self.qkv_proj  # the llama-style placeholder: MLA has its own projections
        heads = config.num_heads
        self.nope, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.rank, self.q_lora_rank = config.kv_lora_rank, config.q_lora_rank
        self.q_first = config.q_lora_rank if config.q_lora_rank is not None else heads * self.head_dim
        self.scale = config.softmax_scale
        self.o_size = heads * self.v_dim

        def projection(rows: int, cols: int) -> nn.Module:
            if dense_dtype is None:
                return UnloadedLinear()
            return DenseLinear(torch.empty(rows, cols, dtype=dense_dtype, device=device))

        hidden = config.hidden_size
        self.qkv_a_proj: nn.Module = projection(self.q_first + config.row_dim, hidden)
        self.q_b_proj: nn.Module | None = None
        self.q_a_norm: nn.Parameter | None = None
        if config.q_lora_rank is not None:
            self.q_b_proj = projection(heads * self.head_dim, config.q_lora_rank)
            self.q_a_norm = param(torch.empty(config.q_lora_rank, dtype=torch.float32, device=device))
        self.kv_a_norm = param(torch.empty(self.rank, dtype=torch.float32, device=device))
        self.kv_up = param(torch.empty(heads, self.nope + self.v_dim, self.rank, dtype=dtype, device=device))
        self.o_proj = projection(hidden, self.o_size)
        self.projection = LatentProjection(self.kv_up, self.nope)
        # transformers' rope_interleave: the rotary dimensions' even ones, then the odd ones.
        order = torch.arange(self.rope_dim, device=device)
        self.rope_order = torch.cat((order[0::2], order[1::2])) if config.rope_interleave else None
        self.rotate = config.rope
        self.expanded = False  # `DeepseekV3ForCausalLM`'s ``mla_cache = "expanded"``: K/V per head, standard attention

    def projection_parts(self) -> dict[str, tuple[tuple[str, tuple[int, int]], ...]]:
        parts = super().projection_parts()
        del parts["qkv_proj"]
        hidden = self.hidden_size
        first = "self_attn.q_proj.weight" if self.q_lora_rank is None else "self_attn.q_a_proj.weight"
        parts["qkv_a_proj"] = ((first, (self.q_first, hidden)),
                               ("self_attn.kv_a_proj_with_mqa.weight", (self.rank + self.rope_dim, hidden)))
        if self.q_lora_rank is not None:
            parts["q_b_proj"] = (("self_attn.q_b_proj.weight", (self.num_heads * self.head_dim, self.q_lora_rank)),)
        parts["o_proj"] = (("self_attn.o_proj.weight", (hidden, self.o_size)),)
        return parts

    def set_projection(self, attr: str, module: nn.Module) -> None:
        if attr in ("qkv_a_proj", "q_b_proj"):
            setattr(self, attr, module)
        else:
            super().set_projection(attr, module)

    def weight_targets(self) -> dict[str, Tensor]:
        targets = super().weight_targets()
        targets["self_attn.kv_a_layernorm.weight"] = self.kv_a_norm
        targets["self_attn.kv_b_proj.weight"] = self.kv_up.view(-1, self.rank)
        if self.q_a_norm is not None:
            targets["self_attn.q_a_layernorm.weight"] = self.q_a_norm
        return targets

    def finish_loading(self) -> None:
        super().finish_loading()
        self.projection = LatentProjection(self.kv_up, self.nope)  # the (re)loaded parameter

    def attend(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionContext,
               index: SparseIndex | None = None) -> Tensor:
        """The attention of the normed input ``x`` [T, hidden]: [T, heads, v_dim] (``index``: the
        context's, `AttentionContext.latent`)."""
        a = cast(nn.Module, self.qkv_a_proj)(x)
        q = a[:, : self.q_first]
        if self.q_b_proj is not None and self.q_a_norm is not None:
            q = cast(nn.Module, self.q_b_proj)(rms_norm(q, self.q_a_norm, _LATENT_NORM_EPS))
        q_nope, q_rope, rows = self.latent_inputs(a, q, cos, sin)
        if self.expanded:
            return self.expanded_attend(q_nope, q_rope, rows, attn)
        return attn.latent(self.layer_idx, q_nope, q_rope, rows, self.projection, self.scale, index=index)

    def expanded_attend(self, q_nope: Tensor, q_rope: Tensor, rows: Tensor, attn: AttentionContext) -> Tensor:
        """``mla_cache = "expanded"``: the step's keys and values made from its ``rows`` (`expand_context`),
        the query ``[q_nope | q_rope]``, each zero-padded to the cache's head size, through the
        context's standard (multi-head) attention; [T, heads, v_dim]."""
        k, v = expand_context(rows, self.projection)
        q = torch.cat((q_nope, q_rope.to(q_nope.dtype)), dim=-1)
        width = max(q.shape[-1], v.shape[-1])
        if q.shape[-1] < width:  # zero key columns: the scores are unchanged
            q, k = F.pad(q, (0, width - q.shape[-1])), F.pad(k, (0, width - k.shape[-1]))
        if v.shape[-1] < width:  # zero value columns: sliced off the output
            v = F.pad(v, (0, width - v.shape[-1]))
        out = attn(self.layer_idx, q.contiguous(), k.to(q.dtype).contiguous(), v.to(q.dtype).contiguous(), self.scale)
        return out[..., : self.v_dim]

    def latent_inputs(self, a: Tensor, q: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The query's two parts and the cache rows ``[c | k_rope]`` (RoPE applied) of the first
        projection's output ``a`` (its columns after the query's) and the query ``q`` [T, heads *
        head_dim]."""
        q = q.reshape(q.shape[0], self.num_heads, self.head_dim)
        start = self.q_first
        latent = rms_norm(a[:, start : start + self.rank], self.kv_a_norm, _LATENT_NORM_EPS)
        k_rope = a[:, None, start + self.rank : start + self.rank + self.rope_dim]
        q_nope, q_rope = q[..., : self.nope], q[..., self.nope :]
        if self.rotate:
            if self.rope_order is not None:
                q_rope, k_rope = q_rope[..., self.rope_order], k_rope[..., self.rope_order]
            q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope, cos, sin)
        return q_nope, q_rope, torch.cat((latent, k_rope[:, 0]), dim=-1)

    def forward(self, h: Tensor, delta: Tensor | None, cos: Tensor, sin: Tensor, attn: AttentionContext,
                fused: bool = False, *, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """One layer on the residual stream ``h`` plus the previous layer's feed-forward output
        ``delta``: the stream after attention and this layer's feed-forward output."""
        h, x = add_rms_norm(h, delta, self.input_norm, self.eps, fused)
        out = self.attend(x, cos, sin, attn)
        return self.finish(h, out, keep, fused, self.o_size)


def build(config: ArchitectureConfig, options: BuildOptions) -> DeepseekV3ForCausalLM:
    assert isinstance(config, DeepseekV3Config), config
    return DeepseekV3ForCausalLM(config, dtype=options.dtype, device=options.device, weights=options.weights,
                                 q8_head=options.q8_head, mla_cache=options.mla_cache)


ARCHITECTURES = (
    Architecture(
        name="deepseek_v3",
        hf_model_types=("deepseek_v3", "kimi_k2"),
        hf_architectures=("DeepseekV3ForCausalLM",),
        gguf_architectures=("deepseek2",),
        config_from_hf=config_from_hf,
        config_from_gguf=config_from_gguf,
        gguf_tensor=gguf_tensor,
        build=build,
    ),
)
"""DeepSeek-V3's registry entry (`helios.models.registry`); Kimi K2 checkpoints (``kimi_k2``, with
``DeepseekV3ForCausalLM``) are the same architecture."""
