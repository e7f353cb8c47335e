"""DeepSeek-V3.2 (transformers' ``deepseek_v32`` / ``DeepseekV32ForCausalLM``): DeepSeek-V3's
multi-head latent attention and MoE (`helios.models.deepseek_v3`) with DeepSeek Sparse Attention
(DSA): a lightning indexer picks, per query, the ``index_topk`` keys of its causal context that the
MLA attention then attends to (all of them while the context is no longer).

The indexer, as transformers 5 computes it (`DeepseekV32Indexer`), per layer:

- its query ``wq_b(q_resid)`` ([``index_n_heads``, ``index_head_dim``]) from the attention's
  normed low-rank query ``q_resid = q_a_layernorm(q_a_proj(x))`` (``q_lora_rank`` is required);
- its key ``k_norm(wk(x))`` (one head of ``index_head_dim``; ``k_norm`` a LayerNorm with bias,
  eps 1e-6);
- RoPE on the first ``qk_rope_head_dim`` dimensions of both, rotate-half (not interleaved, unlike
  the attention's), with the attention's cos/sin (YaRN's factor included);
- the score of key j for query i: ``sum_h w[i, h] * relu(q[i, h] . k[j] / sqrt(index_head_dim))``
  with head weights ``w = weights_proj(x) / sqrt(index_n_heads)`` (``weights_proj`` kept in
  float32, as transformers keeps it), in float32; the top ``index_topk`` causal keys are selected
  and the attention's mask is the causal mask and the selection.

The indexer key is cached with the latent row: each layer's `LatentAttentionSpec` row is
``[c | k_rope | k_index]`` (``kv_lora_rank + qk_rope_head_dim + index_head_dim`` elements; 512 +
64 + 128 = 704 in DeepSeek-V3.2), so the pages, the prefix cache and chunked prefill keep and
reuse it with the row, with no other spec; the attention context receives the indexer's query
as a `SparseIndex` and scores the cached keys (`latent_attention.sparse_attention`). The
projections are fused where they read the same input: ``wk`` into the first projection (with
``q_a_proj`` and ``kv_a_proj_with_mqa``), ``wq_b`` with ``q_b_proj``.

GGUF: llama.cpp's ``deepseek32`` (`config_from_gguf`, `gguf_tensor`): ``deepseek2``'s metadata
and tensors, the indexer's shape under ``attention.indexer.*`` and its tensors as
``blk.N.indexer.{attn_k, attn_q_b, k_norm, proj}``.

GLM-5 (transformers' ``glm_moe_dsa``, `glm_config_from_hf`) is the same model with two
differences: the indexer's RoPE is interleaved (its rotary pairs de-interleaved first, as the
attention's), and ``indexer_types`` may mark layers "shared": such a layer has no indexer (and
its row no indexer key: a `LatentAttentionSpec` of the latent row only, its own cache group) and
attends to the keys the previous layer selected (``SparseIndex(None, None, top_k)``: the context
keeps the step's last selection per chunk). GGUF: llama.cpp's ``glm-dsa`` (`glm_config_from_gguf`):
``deepseek32``'s, with ``attention.indexer.types``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from helios.models import deepseek_v3
from helios.models.architecture import (
    Architecture,
    ArchitectureConfig,
    BuildOptions,
    GGUFSource,
    GGUFTensor,
    gguf_key,
)
from helios.models.decoder import DecoderLayer, apply_rope, param, rms_norm
from helios.models.deepseek_v3 import _LATENT_NORM_EPS, DeepseekV3Config, DeepseekV3ForCausalLM, _MLALayer
from helios.models.interface import AttentionContext, CacheSpec, LatentAttentionSpec, SparseIndex
from helios.models.quant import DenseLinear, UnloadedLinear

__all__ = ["ARCHITECTURES", "DeepseekV32Config", "DeepseekV32ForCausalLM", "config_from_gguf", "config_from_hf",
           "gguf_tensor", "glm_config_from_gguf", "glm_config_from_hf"]

_INDEX_NORM_EPS = 1e-6  # the indexer's k_norm (nn.LayerNorm(index_head_dim, eps=1e-6))


@attrs.frozen(kw_only=True)
class DeepseekV32Config(DeepseekV3Config):
    """`DeepseekV3Config` plus the indexer's shape: ``index_n_heads`` heads of ``index_head_dim``
    (the first ``qk_rope_head_dim`` of them rotary), ``index_topk`` keys per query."""

    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_rope_interleave: bool = False
    index_shared: tuple[bool, ...] = ()

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.q_lora_rank is None:
            raise ValueError("deepseek_v32: the indexer reads the low-rank query: q_lora_rank is required")
        for name in ("index_n_heads", "index_head_dim", "index_topk"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError("index_head_dim must be at least qk_rope_head_dim")
        if self.index_shared and (len(self.index_shared) != self.num_layers or self.index_shared[0]):
            raise ValueError("index_shared: one flag per layer, the first layer with an indexer of its own")

    def shares_index(self, layer: int) -> bool:
        """Whether ``layer`` has no indexer and reuses the previous layer's selection (GLM-5)."""
        return bool(self.index_shared) and self.index_shared[layer]

    @property
    def cache_row_dim(self) -> int:
        """Elements of one token's cache row per layer: the latent row and the indexer key."""
        return self.row_dim + self.index_head_dim

    def projection_params(self) -> int:
        index = self.index_n_heads * (self.index_head_dim * (self.q_lora_rank or 0) + self.hidden_size) + (
            self.hidden_size * self.index_head_dim)
        indexers = sum(not self.shares_index(i) for i in range(self.num_layers))
        return super().projection_params() + index * indexers


def config_from_hf(config: Mapping[str, Any]) -> DeepseekV32Config:
    """A DeepSeek-V3.2 config from its ``config.json``: DeepSeek-V3's (`deepseek_v3.config_from_hf`)
    plus the indexer's; the attention's RoPE is always the interleaved one (transformers' V3.2
    has no ``rope_interleave`` switch)."""
    return _config_from_hf(config, "deepseek_v32", index_heads=64)


def glm_config_from_hf(config: Mapping[str, Any]) -> DeepseekV32Config:
    """A GLM-5 (``glm_moe_dsa``) config: DeepSeek-V3.2's, with the indexer's RoPE interleaved
    and ``indexer_types`` ("full" / "shared" per layer; else transformers' defaults from
    ``index_topk_pattern`` or ``index_topk_freq`` / ``index_skip_topk_offset``)."""
    layers = int(config["num_hidden_layers"])
    kinds = config.get("indexer_types")
    if kinds is None:
        pattern = config.get("index_topk_pattern")
        if pattern is not None:
            kinds = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
        else:
            freq = max(int(config.get("index_topk_freq") or 1), 1)
            offset = int(config.get("index_skip_topk_offset", 2))
            kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    if len(kinds) != layers or any(kind not in ("full", "shared") for kind in kinds):
        raise ValueError(f"glm_moe_dsa: indexer_types must be 'full' / 'shared' per layer, got {kinds!r}")
    shared = tuple(kind == "shared" for kind in kinds)
    return _config_from_hf(config, "glm_moe_dsa", index_heads=32, index_rope_interleave=True,
                           index_shared=shared if any(shared) else ())


def config_from_gguf(source: GGUFSource) -> DeepseekV32Config:
    """A DeepSeek-V3.2 config from llama.cpp's ``deepseek32`` metadata: ``deepseek2``'s
    (`deepseek_v3.config_from_gguf`) plus ``attention.indexer.head_count`` / ``key_length`` /
    ``top_k``."""
    key = gguf_key(source)
    base = deepseek_v3.config_from_gguf(source)
    fields = {f.name: getattr(base, f.name) for f in attrs.fields(DeepseekV3Config)}
    fields.update(arch="deepseek_v32")
    return DeepseekV32Config(**fields, index_n_heads=int(key("attention.indexer.head_count")),
                             index_head_dim=int(key("attention.indexer.key_length")),
                             index_topk=int(key("attention.indexer.top_k")))


def glm_config_from_gguf(source: GGUFSource) -> DeepseekV32Config:
    """A GLM-5 config from llama.cpp's ``glm-dsa`` metadata: ``deepseek32``'s, the indexer's RoPE
    interleaved, and ``attention.indexer.types`` (per layer, true where the layer has its own
    indexer; absent: every layer has one)."""
    base = config_from_gguf(source)
    kinds = source.metadata.get(f"{source.metadata.get('general.architecture')}.attention.indexer.types")
    shared: tuple[bool, ...] = ()
    if kinds is not None:
        flags = [bool(k) for k in kinds]
        if len(flags) < base.num_layers:
            raise ValueError(f"glm-dsa attention.indexer.types has {len(flags)} entries for {base.num_layers} layers")
        shared = tuple(not full for full in flags[: base.num_layers])
    return attrs.evolve(base, arch="glm_moe_dsa", index_rope_interleave=True,
                        index_shared=shared if any(shared) else ())


_GGUF_INDEXER_NAMES = {
    "indexer.k_norm.weight": "self_attn.indexer.k_norm.weight",
    "indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "indexer.proj.weight": "self_attn.indexer.weights_proj.weight",
    "indexer.attn_k.weight": "self_attn.indexer.wk.weight",
    "indexer.attn_q_b.weight": "self_attn.indexer.wq_b.weight",
}


def gguf_tensor(config: ArchitectureConfig, gguf_name: str) -> GGUFTensor | None:
    """Where a ``deepseek32`` tensor goes: the indexer's names here (no permutation: llama.cpp
    keeps the indexer's rotate-half dimensions as they are), the rest as ``deepseek2``'s
    (`deepseek_v3.gguf_tensor`; the appended next-token-prediction layer's, its indexer's too,
    under ``model.layers.{N}`` for `helios.models.mtp`)."""
    assert isinstance(config, DeepseekV32Config), type(config)
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_INDEXER_NAMES:
        return GGUFTensor(f"model.layers.{parts[1]}.{_GGUF_INDEXER_NAMES[parts[2]]}")
    return deepseek_v3.gguf_tensor(config, gguf_name)


def _config_from_hf(config: Mapping[str, Any], arch: str, *, index_heads: int, index_rope_interleave: bool = False,
                    index_shared: tuple[bool, ...] = ()) -> DeepseekV32Config:
    config = dict(config)
    if config.get("num_experts") is not None and config.get("n_routed_experts") is None:
        config["n_routed_experts"] = config["num_experts"]
    layer_types = config.get("mlp_layer_types")
    if layer_types:
        dense = [kind == "dense" for kind in layer_types]
        if dense != sorted(dense, reverse=True):
            raise NotImplementedError("deepseek_v32: dense layers after MoE layers are not supported")
        config["first_k_dense_replace"] = sum(dense)
    base = deepseek_v3.config_from_hf(config)
    fields = {f.name: getattr(base, f.name) for f in attrs.fields(DeepseekV3Config)}
    fields.update(arch=arch, rope_interleave=True)
    return DeepseekV32Config(**fields, index_n_heads=int(config.get("index_n_heads") or index_heads),
                             index_head_dim=int(config.get("index_head_dim") or 128),
                             index_topk=int(config.get("index_topk") or 2048),
                             index_rope_interleave=index_rope_interleave, index_shared=index_shared)


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2 on `DeepseekV3ForCausalLM`: its MLA layers with the DSA indexer, one
    ``[c | k_rope | k_index]`` row per token and layer."""

    config: DeepseekV32Config

    def _build_layers(self, device: torch.device, dense_dtype: torch.dtype | None) -> list[DecoderLayer]:
        cfg = self.config
        return [_DSALayer(cfg, i, self.dtype, device, dense_dtype) for i in range(cfg.num_layers)]

    def cache_specs(self) -> tuple[CacheSpec, ...]:
        cfg = self.config
        return tuple(LatentAttentionSpec(cfg.row_dim if cfg.shares_index(i) else cfg.cache_row_dim)
                     for i in range(cfg.num_layers))


class _DSALayer(_MLALayer):
    """`_MLALayer` with the indexer: ``wk`` fused into ``qkv_a_proj`` (after the latent row's
    columns), ``wq_b`` into ``q_b_proj`` (after the query's), ``k_norm`` (weight and bias) and
    ``weights_proj`` float32 parameters."""

    def __init__(self, config: DeepseekV32Config, layer_idx: int, dtype: torch.dtype, device: torch.device,
                 dense_dtype: torch.dtype | None) -> None:
        self.index_heads, self.index_dim, self.index_topk = (config.index_n_heads, config.index_head_dim,
                                                             config.index_topk)
        self.shared = config.shares_index(layer_idx)
        super().__init__(config, layer_idx, dtype, device, dense_dtype)
        hidden, lora = config.hidden_size, cast(int, config.q_lora_rank)
        order = torch.arange(self.rope_dim, device=device)  # GLM-5's interleaved pairs, as in `latent_inputs`
        self.index_rope_order = torch.cat((order[0::2], order[1::2])) if config.index_rope_interleave else None
        if self.shared:
            return

        def projection(rows: int, cols: int) -> nn.Module:
            if dense_dtype is None:
                return UnloadedLinear()
            return DenseLinear(torch.empty(rows, cols, dtype=dense_dtype, device=device))

        self.qkv_a_proj = projection(self.q_first + config.row_dim + self.index_dim, hidden)
        self.q_b_proj = projection(self.num_heads * self.head_dim + self.index_heads * self.index_dim, lora)
        self.index_norm_weight = param(torch.empty(self.index_dim, dtype=torch.float32, device=device))
        self.index_norm_bias = param(torch.empty(self.index_dim, dtype=torch.float32, device=device))
        self.index_weights = param(torch.empty(self.index_heads, hidden, dtype=torch.float32, device=device))

    def projection_parts(self) -> dict[str, tuple[tuple[str, tuple[int, int]], ...]]:
        parts = super().projection_parts()
        if self.shared:
            return parts
        hidden, lora = self.hidden_size, cast(int, self.q_lora_rank)
        parts["qkv_a_proj"] = (*parts["qkv_a_proj"], ("self_attn.indexer.wk.weight", (self.index_dim, hidden)))
        parts["q_b_proj"] = (*parts["q_b_proj"],
                             ("self_attn.indexer.wq_b.weight", (self.index_heads * self.index_dim, lora)))
        return parts

    def weight_targets(self) -> dict[str, Tensor]:
        targets = super().weight_targets()
        if self.shared:
            return targets
        targets["self_attn.indexer.k_norm.weight"] = self.index_norm_weight
        targets["self_attn.indexer.k_norm.bias"] = self.index_norm_bias
        targets["self_attn.indexer.weights_proj.weight"] = self.index_weights
        return targets

    def attend(self, x: Tensor, cos: Tensor, sin: Tensor, attn: AttentionContext,
               index: SparseIndex | None = None) -> Tensor:
        if self.shared:  # MLA over the previous sparse layer's selection
            return super().attend(x, cos, sin, attn, SparseIndex(None, None, self.index_topk))
        a = cast(nn.Module, self.qkv_a_proj)(x)
        assert self.q_a_norm is not None
        b = cast(nn.Module, self.q_b_proj)(rms_norm(a[:, : self.q_first], self.q_a_norm, _LATENT_NORM_EPS))
        q_size = self.num_heads * self.head_dim
        q_nope, q_rope, rows = self.latent_inputs(a, b[:, :q_size], cos, sin)
        # The indexer: its key (one head) and query heads, RoPE (rotate-half) on their first rope_dim.
        key = a[:, self.q_first + self.rank + self.rope_dim :]
        key = F.layer_norm(key.float(), (self.index_dim,), self.index_norm_weight, self.index_norm_bias,
                           _INDEX_NORM_EPS).to(x.dtype)[:, None]
        iq = b[:, q_size:].reshape(x.shape[0], self.index_heads, self.index_dim)
        rope = self.rope_dim
        iq_rope, key_rope = iq[..., :rope], key[..., :rope]
        if self.index_rope_order is not None:  # the same order for both: the dot products are unchanged
            iq_rope, key_rope = iq_rope[..., self.index_rope_order], key_rope[..., self.index_rope_order]
        iq = torch.cat((apply_rope(iq_rope, cos, sin), iq[..., rope:]), dim=-1)
        key = torch.cat((apply_rope(key_rope, cos, sin), key[..., rope:]), dim=-1)
        weights = F.linear(x.float(), self.index_weights) * self.index_heads ** -0.5
        index = SparseIndex(iq, weights, self.index_topk)
        rows = torch.cat((rows, key[:, 0].to(rows.dtype)), dim=-1)
        return attn.latent(self.layer_idx, q_nope, q_rope, rows, self.projection, self.scale, index=index)


def build(config: ArchitectureConfig, options: BuildOptions) -> DeepseekV32ForCausalLM:
    assert isinstance(config, DeepseekV32Config), config
    return DeepseekV32ForCausalLM(config, dtype=options.dtype, device=options.device, weights=options.weights,
                                  q8_head=options.q8_head)


ARCHITECTURES = (
    Architecture(
        name="deepseek_v32",
        hf_model_types=("deepseek_v32",),
        hf_architectures=("DeepseekV32ForCausalLM",),
        gguf_architectures=("deepseek32",),
        config_from_hf=config_from_hf,
        config_from_gguf=config_from_gguf,
        gguf_tensor=gguf_tensor,
        build=build,
    ),
    Architecture(
        name="glm_moe_dsa",
        hf_model_types=("glm_moe_dsa",),
        hf_architectures=("GlmMoeDsaForCausalLM",),
        gguf_architectures=("glm-dsa",),
        config_from_hf=glm_config_from_hf,
        config_from_gguf=glm_config_from_gguf,
        gguf_tensor=gguf_tensor,
        build=build,
    ),
)
"""DeepSeek-V3.2's and GLM-5's (``glm_moe_dsa``) registry entries (`helios.models.registry`)."""
