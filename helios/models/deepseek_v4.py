"""DeepSeek V4 (transformers' ``deepseek_v4`` / ``DeepseekV4ForCausalLM``): sliding-window
attention in every layer, with compressed sparse attention (CSA) or heavily compressed attention
(HCA) in the layers ``layer_types`` names so, manifold-constrained hyper-connections, and a mixture
of experts with hash-routed leading layers.

Each layer, as transformers 5 computes it:

- hyper-connections (mHC): the residual is ``hc_mult`` streams [T, n, hidden]. Before the
  attention and before the feed-forward, a projection of the RMS-normed (unweighted) flattened
  streams gives ``pre`` (sigmoid + eps: the block's input is the ``pre``-weighted sum of the
  streams), ``post`` (2 sigmoid: how the block's output goes back into each stream) and ``comb``
  (softmax + eps, then Sinkhorn-Knopp: ``hc_sinkhorn_iters`` column/row normalisations); the new
  streams are ``post * out + comb^T @ streams``. The model's last step collapses the streams with
  the head's own ``pre`` weights (the HyperHead) before the final norm. All of it in float32.
- attention: one key-value head of ``head_dim`` (K = V) ``kv_norm(kv_proj(x))``, the query
  ``q_b_proj(q_a_norm(q_a_proj(x)))`` RMS-normed per head without a weight; RoPE on the last
  ``qk_rope_head_dim`` dimensions of each head, on consecutive pairs (interleaved), with base
  ``rope_theta`` in sliding layers and ``compress_rope_theta`` (with the config's YaRN scaling,
  its cos/sin factor forced to 1) in compressed ones; per-head attention sinks; the output's
  rotary part rotated back by the query's position (``-sin``: the value carried its key's
  rotation); then the grouped output projection (``o_groups`` groups of heads, each through its own
  block of ``o_a_proj`` to ``o_lora_rank``, then ``o_b_proj``).
- the keys a query at position p sees: the sliding window (positions p - ``sliding_window`` + 1 ..
  p), and in a compressed layer the compressed entries completed by then. A compressor turns every
  window of m tokens (``compress_rates``: CSA's, HCA's) into one entry: per channel, the
  softmax over the window's gates (``gate_proj(x)`` plus a learned bias per offset) weighs its
  ``kv_proj(x)`` rows; then ``kv_norm`` and RoPE at the window's first position. Entry w is
  complete once position (w + 1) m - 1 is, so query p sees entries w < (p + 1) // m. CSA's
  compressor makes two series per token (2 x ``head_dim``): entry w pools the first series of
  window w - 1 and the second of window w (2m rows; for w = 0 only the second). CSA also has a
  lightning indexer: its own such compressor (``index_head_dim``) and query heads
  (``index_n_heads``, from the low-rank query), scores ``sum_h w_h relu(q_h . k)`` (the head
  weights ``weights_proj(x)`` / sqrt(heads), the dot product / sqrt(index_head_dim)), and the query
  attends only to the ``index_topk`` best of its entries.
- feed-forward: routed experts (SwiGLU with ``swiglu_limit`` clipping: the gate to at most it, the
  up projection to +-it) plus one shared expert of the same width and clipping; the router scores
  ``sqrt(softplus(logits))`` (``scoring_func``), chooses the top ``num_experts_per_tok`` of the
  scores plus ``e_score_correction_bias``, renormalises and scales by ``routed_scaling_factor``;
  a ``hash_moe`` layer's experts are ``tid2eid[input_id]`` (a fixed table), its weights the scores
  of those.

The cache (`cache_specs`). A sliding layer keeps its K in a `SlidingWindowSpec` group (one kv head;
V is the same tensor, stored twice), served by the engine's sliding-window attention with sinks. A
compressed layer keeps two streams and attends over them itself (`AttentionContext.rows` with
``entries``): raw rows per token, of which only the last `raw_window` positions' are kept
(`RowWindowSpec`), and its compressed entries, one row per m positions (`CompressedSpec`, cache
index `entry_stream`, after the layers' specs)::

    raw   HCA: [ k | kv | gate ]                                  3 x head_dim
          CSA: [ k | kv (2) | gate (2) | i_kv (2) | i_gate (2) ]  5 x head_dim + 4 x index_head_dim
    entry HCA: [ entry ]                                           head_dim
          CSA: [ entry | i_entry ]                                 head_dim + index_head_dim

``k``: the token's sliding key (RoPE applied); ``kv`` / ``gate``: its compressor projections (the
partial window's buffer, and CSA's overlap state, are these rows of the positions not yet
compressed); entry w is written by the step that computes position (w + 1) m - 1, pooled from the
raw rows of windows w (and w - 1). A query or compression at position p or later reads raw rows of
positions p - `raw_window` + 1 .. only (the sliding window; the partial window; CSA's previous
window), so the engine keeps the raw rows of each running request's window and of its step's
chunk (`engine/kv`'s `RowWindowPool`), and the entries of every past window
(`CompressedPool`). Every row is a function of its prefix, so pages, chunked prefill at any
boundary, batching and prefix-cache hits give the one-pass result; a hit needs its window's raw
rows cached, and the KV manager shortens hits to where they are.

MTP layers (``mtp.*``) are not part of the model (transformers ignores them too); with speculation
on, the first drafts (`helios.models.mtp.DeepseekV4MTP`), reading the streams before the HyperHead
(`forward_with_features`, `interface.DraftFeatureLM`). FP8 checkpoints (``quantization_config``)
are refused; a bfloat16 conversion loads.

GGUF: llama.cpp's ``deepseek4`` (`config_from_gguf`, `gguf_tensor`): the shapes under its keys
(``attention.compress_ratios`` per layer, 0 / 4 / the HCA rate; ``hyper_connection.*``,
``attention.output_group_count`` / ``output_lora_rank``, ``attention.indexer.*``,
``hash_layer_count``, ``swiglu_clamp_exp``, ``attention.compress_rope_freq_base``; the YaRN keys
describe the compressed layers' RoPE), every tensor in the checkpoint's own layout (no rotary
permutation: the pairs stay consecutive), the experts stacked, ``tid2eid`` as I32. The MTP blocks
after ``num_layers`` (``blk.{N + i}``: llama.cpp's ``--mtp`` conversion writes them alone, with the
shared embedding, head and output norm, to an MTP-only file) go to ``mtp.{i}.*`` as a folder's,
which the model skips and `helios.models.mtp` reads (an MTP-only file given as ``[speculative]
draft_model`` drafts). llama.cpp accepts only rates 4 (CSA) and 128 (HCA); a layer of
rate 4 is CSA here too, any other non-zero rate HCA.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, cast

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
from helios.models.attention_sinks import sink_softmax
from helios.models.config import yarn_inv_freq
from helios.models.decoder import DecoderLayer, param, rms_norm
from helios.models.interface import (
    AttentionContext,
    CacheSpec,
    CompressedSpec,
    RowWindowSpec,
    SlidingWindowSpec,
)
from helios.models.moe import RouterSpec, expert_mix, route, swiglu
from helios.models.moe_decoder import MoEConfig, MoEForCausalLM, MoELayer, gguf_moe_tensor
from helios.models.quant import BuildSource, DenseLinear, UnloadedLinear, WeightFormat

__all__ = ["ARCHITECTURES", "DeepseekV4Config", "DeepseekV4ForCausalLM", "cache_specs", "compress_inv_freq",
           "config_from_gguf",
           "config_from_hf", "gguf_tensor", "hf_name", "hyper_merge", "hyper_weights", "pool_windows", "rope_tail"]

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}  # the legacy ``compress_ratios`` values


@attrs.frozen(kw_only=True)
class DeepseekV4Config(MoEConfig):
    """`MoEConfig` (one kv head of ``head_dim``; ``rotary_dim`` = ``qk_rope_head_dim``; every layer
    an MoE layer, ``intermediate_size`` = ``moe_intermediate_size``) plus V4's own shape."""

    layer_types: tuple[str, ...]
    hash_layers: tuple[bool, ...]
    csa_rate: int
    hca_rate: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    compress_rope_theta: float
    compress_yarn: dict[str, Any] | None = attrs.field(default=None, hash=False)
    sliding_window: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    swiglu_limit: float

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.num_kv_heads != 1:
            raise ValueError("deepseek_v4: one key-value head (num_key_value_heads = 1)")
        for name, values in (("layer_types", self.layer_types), ("hash_layers", self.hash_layers)):
            if len(values) != self.num_layers:
                raise ValueError(f"{name} has {len(values)} entries for {self.num_layers} layers")
        bad = sorted({t for t in self.layer_types if t not in (SLIDING, CSA, HCA)})
        if bad:
            raise ValueError(f"deepseek_v4: unknown layer types {bad}")
        for name in ("csa_rate", "hca_rate", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "hc_mult",
                     "hc_sinkhorn_iters", "index_n_heads", "index_head_dim", "index_topk"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.o_groups:
            raise ValueError(f"o_groups ({self.o_groups}) must divide num_attention_heads ({self.num_heads})")
        if self.index_head_dim < self.rotary:
            raise ValueError("index_head_dim must be at least qk_rope_head_dim")

    def rate(self, layer: int) -> int:
        """The compress rate m of a compressed layer."""
        return self.csa_rate if self.layer_types[layer] == CSA else self.hca_rate

    def row_dim(self, layer: int) -> int:
        """Elements of a compressed layer's raw row per token (see the module docstring)."""
        d = self.head_dim
        if self.layer_types[layer] == HCA:
            return 3 * d
        return 5 * d + 4 * self.index_head_dim

    def raw_window(self, layer: int) -> int:
        """The positions of raw rows a compressed layer still reads at a query or compression at
        position p or later: its sliding window's keys (p - sliding_window + 1 ..), the partial
        window (from p - (p mod m)), in CSA also the window before it (its first series pools
        into the next entry): ``max(sliding_window, m)`` (HCA), ``max(sliding_window, 2 m)`` (CSA)."""
        rate = self.rate(layer)
        return max(self.sliding_window, 2 * rate if self.layer_types[layer] == CSA else rate)

    def entry_dim(self, layer: int) -> int:
        """Elements of a compressed layer's entry row (one per ``rate(layer)`` positions)."""
        return self.head_dim + (self.index_head_dim if self.layer_types[layer] == CSA else 0)

    def entry_stream(self, layer: int) -> int:
        """The cache index of a compressed layer's entry stream (`cache_specs`: after the layers)."""
        return self.num_layers + sum(1 for kind in self.layer_types[:layer] if kind != SLIDING)

    def projection_params(self) -> int:
        hidden, d, heads = self.hidden_size, self.head_dim, self.num_heads
        total = 0
        for kind in self.layer_types:
            first = self.q_lora_rank + d + (0 if kind == SLIDING else 2 * d if kind == HCA
                                            else 4 * d + 4 * self.index_head_dim + self.index_n_heads)
            q_b = heads * d + (self.index_n_heads * self.index_head_dim if kind == CSA else 0)
            total += first * hidden + q_b * self.q_lora_rank + hidden * self.o_groups * self.o_lora_rank
            total += 3 * self.shared_intermediate_size * hidden
        return int(total)


def config_from_hf(config: Mapping[str, Any]) -> DeepseekV4Config:
    """A DeepSeek V4 config from its ``config.json``, with the legacy keys transformers folds in
    (``compress_ratios``, ``compress_rate_csa`` / ``compress_rate_hca``, ``num_hash_layers``,
    ``qk_rope_head_dim``) and transformers' defaults where a key is absent."""
    if config.get("quantization_config"):
        raise NotImplementedError("deepseek_v4: quantized checkpoints (quantization_config, e.g. FP8) are not "
                                  "supported; convert the weights to bfloat16")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config.get('hidden_act')!r}")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise NotImplementedError("deepseek_v4: attention / MLP biases are not supported")
    scoring_func = str(config.get("scoring_func") or "sqrtsoftplus")
    if scoring_func not in ("sqrtsoftplus", "sigmoid"):
        raise NotImplementedError(f"deepseek_v4: router scoring {scoring_func!r} is not supported")
    scoring: Literal["sqrtsoftplus", "sigmoid"] = "sigmoid" if scoring_func == "sigmoid" else "sqrtsoftplus"
    n = int(config.get("num_hidden_layers") or 43)
    rates = {CSA: 4, HCA: 128, **(config.get("compress_rates") or {})}
    if config.get("compress_rate_csa") is not None:
        rates[CSA] = int(config["compress_rate_csa"])
    if config.get("compress_rate_hca") is not None:
        rates[HCA] = int(config["compress_rate_hca"])
    layer_types = config.get("layer_types")
    if layer_types is None and config.get("compress_ratios") is not None:
        layer_types = [_RATIO_TO_TYPE[int(r)] for r in config["compress_ratios"]]
    if layer_types is None:
        layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    mlp_types = config.get("mlp_layer_types")
    if mlp_types is None:
        hashed = int(config["num_hash_layers"]) if config.get("num_hash_layers") is not None else 3
        mlp_types = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    if any(t not in ("hash_moe", "moe") for t in mlp_types):
        raise ValueError(f"deepseek_v4: mlp_layer_types must be 'hash_moe' / 'moe', got {mlp_types!r}")
    head_dim = int(config.get("head_dim") or 512)
    factor = config.get("partial_rotary_factor")
    if factor is None:  # transformers: qk_rope_head_dim / head_dim, by default 64 / 512
        factor = int(config["qk_rope_head_dim"]) / head_dim if config.get("qk_rope_head_dim") else 64 / 512
    rope_dim = int(head_dim * float(factor))
    rope_theta = float(config.get("rope_theta") or 10000.0)
    compress_theta = float(config.get("compress_rope_theta") or 160000.0)
    params: Mapping[str, Any] = config.get("rope_parameters") or {}
    if isinstance(params.get("main"), Mapping) and isinstance(params.get("compress"), Mapping):
        main, compress = dict(params["main"]), dict(params["compress"])
        if main.get("rope_type", main.get("type", "default")) != "default":
            raise NotImplementedError("deepseek_v4: the sliding layers' rope must be the default one")
        rope_theta = float(main.get("rope_theta", rope_theta))
    else:
        compress = {k: v for k, v in params.items() if k not in ("main", "compress")}
        if config.get("rope_scaling"):
            compress = {**dict(config["rope_scaling"]), **compress}
    compress_theta = float(compress.get("rope_theta", compress_theta))
    kind = compress.get("rope_type", compress.get("type", "default"))
    max_pos = int(config.get("max_position_embeddings") or 1048576)
    yarn: dict[str, Any] | None = None
    if kind == "yarn":
        yarn = {k: v for k, v in compress.items() if k not in ("rope_theta", "partial_rotary_factor", "type")}
        yarn.setdefault("original_max_position_embeddings", max_pos)
        yarn.setdefault("attention_factor", 1.0)  # transformers forces it: the reference scales no cos/sin
    elif kind != "default":
        raise NotImplementedError(f"deepseek_v4: rope type {kind!r} is not supported (default, yarn)")
    moe_inter = int(config.get("moe_intermediate_size") or 2048)
    return DeepseekV4Config(
        arch="deepseek_v4",
        vocab_size=int(config.get("vocab_size") or 129280),
        hidden_size=int(config.get("hidden_size") or 4096),
        intermediate_size=moe_inter,
        num_layers=n,
        num_heads=int(config.get("num_attention_heads") or 64),
        num_kv_heads=int(config.get("num_key_value_heads") or 1),
        head_dim=head_dim,
        moe_layers=(True,) * n,
        router=RouterSpec(num_experts=int(config.get("n_routed_experts") or 256),
                          top_k=int(config.get("num_experts_per_tok") or 6), scoring=scoring, norm_topk_prob=True,
                          routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.5),
                          fp32_logits=False),
        moe_intermediate_size=moe_inter,
        shared_intermediate_size=moe_inter,
        shared_name="shared_experts",
        rotary_dim=rope_dim,
        rms_norm_eps=float(config.get("rms_norm_eps") or 1e-6),
        rope_theta=rope_theta,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        layer_types=tuple(str(t) for t in layer_types[:n]),
        hash_layers=tuple(t == "hash_moe" for t in mlp_types[:n]),
        csa_rate=int(rates[CSA]),
        hca_rate=int(rates[HCA]),
        q_lora_rank=int(config.get("q_lora_rank") or 1024),
        o_groups=int(config.get("o_groups") or 8),
        o_lora_rank=int(config.get("o_lora_rank") or 1024),
        compress_rope_theta=compress_theta,
        compress_yarn=yarn,
        sliding_window=int(config.get("sliding_window") or 128),
        hc_mult=int(config.get("hc_mult") or 4),
        hc_sinkhorn_iters=int(config.get("hc_sinkhorn_iters") or 20),
        hc_eps=float(config.get("hc_eps") or 1e-6),
        index_n_heads=int(config.get("index_n_heads") or 64),
        index_head_dim=int(config.get("index_head_dim") or 128),
        index_topk=int(config.get("index_topk") or 512),
        swiglu_limit=float(config.get("swiglu_limit") or 10.0),
    )


_SQRT_SOFTPLUS_GATING, _SIGMOID_GATING = 4, 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_*


def config_from_gguf(source: GGUFSource) -> DeepseekV4Config:
    """A DeepSeek V4 config from llama.cpp's ``deepseek4`` metadata (see the module docstring)."""
    key = gguf_key(source)
    meta, tensors = source.metadata, source.tensor_shapes
    prefix = str(meta.get("general.architecture"))

    def optional(name: str) -> Any:
        return meta.get(f"{prefix}.{name}")

    def first(value: Any) -> Any:  # a per-layer array of equal values, or one value
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise NotImplementedError(f"deepseek4: per-layer values {value!r} are not supported")
            return value[0]
        return value

    gating = int(key("expert_gating_func"))
    if gating not in (_SQRT_SOFTPLUS_GATING, _SIGMOID_GATING):
        raise NotImplementedError(f"deepseek4 expert_gating_func {gating} is not supported (sqrtsoftplus: 4)")
    n = int(key("block_count")) - int(optional("nextn_predict_layers") or 0)
    ratios = [int(r) for r in key("attention.compress_ratios")][:n]
    hca = sorted({r for r in ratios if r not in (0, 4)})
    if len(hca) > 1:
        raise NotImplementedError(f"deepseek4: several heavily compressed rates {hca}")
    hashed = int(key("hash_layer_count"))
    yarn: dict[str, Any] | None = None
    kind = optional("rope.scaling.type")
    if kind == "yarn":
        yarn = {"rope_type": "yarn", "factor": float(key("rope.scaling.factor")),
                "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
                "beta_fast": float(optional("rope.scaling.yarn_beta_fast") or 32.0),
                "beta_slow": float(optional("rope.scaling.yarn_beta_slow") or 1.0), "attention_factor": 1.0}
    elif kind not in (None, "none"):
        raise NotImplementedError(f"GGUF rope scaling {kind!r} is not supported for deepseek4")
    moe_inter = int(first(key("expert_feed_forward_length")))
    top_k = int(key("expert_used_count"))
    return DeepseekV4Config(
        arch="deepseek_v4",
        vocab_size=int(tensors["token_embd.weight"][0]),
        hidden_size=int(key("embedding_length")),
        intermediate_size=moe_inter,
        num_layers=n,
        num_heads=int(key("attention.head_count")),
        num_kv_heads=int(first(key("attention.head_count_kv", 1))),
        head_dim=int(key("attention.key_length")),
        moe_layers=(True,) * n,
        router=RouterSpec(num_experts=int(key("expert_count")), top_k=top_k,
                          scoring="sigmoid" if gating == _SIGMOID_GATING else "sqrtsoftplus", norm_topk_prob=True,
                          routed_scaling_factor=float(optional("expert_weights_scale") or 1.0), fp32_logits=False),
        moe_intermediate_size=moe_inter,
        shared_intermediate_size=moe_inter,
        shared_name="shared_experts",
        rotary_dim=int(key("rope.dimension_count")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length", 1048576)),
        tie_word_embeddings="output.weight" not in tensors,
        layer_types=tuple(SLIDING if r == 0 else CSA if r == 4 else HCA for r in ratios),
        hash_layers=tuple(i < hashed for i in range(n)),
        csa_rate=4,
        hca_rate=hca[0] if hca else 128,
        q_lora_rank=int(key("attention.q_lora_rank")),
        o_groups=int(key("attention.output_group_count")),
        o_lora_rank=int(key("attention.output_lora_rank")),
        compress_rope_theta=float(key("attention.compress_rope_freq_base")),
        compress_yarn=yarn,
        sliding_window=int(key("attention.sliding_window")),
        hc_mult=int(key("hyper_connection.count")),
        hc_sinkhorn_iters=int(key("hyper_connection.sinkhorn_iterations")),
        hc_eps=float(key("hyper_connection.epsilon")),
        index_n_heads=int(key("attention.indexer.head_count")),
        index_head_dim=int(key("attention.indexer.key_length")),
        index_topk=int(key("attention.indexer.top_k")),
        swiglu_limit=float(first(key("swiglu_clamp_exp"))),
    )


# llama.cpp's deepseek4 per-layer names -> transformers' (suffixes of ``model.layers.{i}.``); the rest
# as the MoE families' (`moe_decoder.gguf_moe_tensor`: norms, router, stacked and shared experts).
_GGUF_LAYER_NAMES = {
    "attn_sinks.weight": "self_attn.sinks",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_norm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv.weight": "self_attn.kv_proj.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_norm.weight",
    "attn_output_a.weight": "self_attn.o_a_proj.weight",
    "attn_output_b.weight": "self_attn.o_b_proj.weight",
    "attn_compressor_kv.weight": "self_attn.compressor.kv_proj.weight",
    "attn_compressor_gate.weight": "self_attn.compressor.gate_proj.weight",
    "attn_compressor_ape.weight": "self_attn.compressor.position_bias",
    "attn_compressor_norm.weight": "self_attn.compressor.kv_norm.weight",
    "indexer.proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "indexer.attn_q_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "indexer_compressor_kv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "indexer_compressor_gate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "indexer_compressor_ape.weight": "self_attn.compressor.indexer.position_bias",
    "indexer_compressor_norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn_gate_tid2eid.weight": "mlp.gate.tid2eid",
    **{f"hc_{part}_{p}.weight": f"{part}_hc.{p}" for part in ("attn", "ffn") for p in ("fn", "base", "scale")},
}
_GGUF_GLOBAL_NAMES = {f"output_hc_{p}.weight": f"model.hc_head.hc_{p}" for p in ("fn", "base", "scale")}


# llama.cpp's names of an MTP module's own tensors (``blk.{N + i}.nextn.*``) -> their suffixes of
# ``mtp.{i}.`` (DeepSeek's release names; ``eh_proj``: llama.cpp's concatenation [e_proj | h_proj]).
_GGUF_NEXTN_NAMES = {
    "nextn.eh_proj.weight": "eh_proj.weight",
    "nextn.enorm.weight": "enorm.weight",
    "nextn.hnorm.weight": "hnorm.weight",
    "nextn.shared_head_norm.weight": "norm.weight",
    "nextn.embed_tokens.weight": "emb.tok_emb.weight",
    "nextn.shared_head_head.weight": "head.weight",
}


def gguf_tensor(config: ArchitectureConfig, gguf_name: str) -> GGUFTensor | None:
    """Where a ``deepseek4`` tensor goes (no rotary permutation). The blocks past ``num_layers``
    (MTP modules: an MTP-only file's, or a file's that holds both) go to ``mtp.{i}.*``, which the
    model skips and `helios.models.mtp.load_mtp` reads: the block's tensors under their
    transformers suffixes, the module's own under `_GGUF_NEXTN_NAMES` (a name known to neither goes
    nowhere)."""
    assert isinstance(config, DeepseekV4Config), type(config)
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return GGUFTensor(_GGUF_GLOBAL_NAMES[gguf_name])
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) >= config.num_layers:
        prefix = f"mtp.{int(parts[1]) - config.num_layers}."
        if parts[2] in _GGUF_NEXTN_NAMES:
            return GGUFTensor(prefix + _GGUF_NEXTN_NAMES[parts[2]])
        try:
            block = gguf_moe_tensor(config, f"blk.0.{parts[2]}", _GGUF_LAYER_NAMES)
        except NotImplementedError:
            return None
        return None if block is None else GGUFTensor(prefix + block.name.removeprefix("model.layers.0."))
    return gguf_moe_tensor(config, gguf_name, _GGUF_LAYER_NAMES)


# -- checkpoint names -------------------------------------------------------------------------------------

# DeepSeek's own names (and the mix transformers' save_pretrained writes) -> transformers' in-memory
# names, in order (transformers' conversion mapping for deepseek_v4: each applies to what the
# previous ones left). Idempotent on transformers' names.
_RENAMES = tuple((re.compile(a), b) for a, b in (
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight$", "embed_tokens.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_(fn|base|scale)$", r".attn_hc.\1"),
    (r"\.hc_ffn_(fn|base|scale)$", r".ffn_hc.\1"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
    (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
    (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
))


def hf_name(name: str) -> str | None:
    """A checkpoint tensor's transformers name (``model.layers.{i}.self_attn.q_a_proj.weight`` ...),
    from DeepSeek's names (``layers.{i}.attn.wq_a.weight``, ``embed.weight``, ``head.weight``), what
    transformers' ``save_pretrained`` writes (DeepSeek's per-layer names under ``model.``) or
    transformers' own; None for the multi-token-prediction layers (``mtp.*``), not loaded."""
    bare = name[len("model."):] if name.startswith("model.") else name
    if bare.startswith("mtp."):
        return None
    for pattern, replacement in _RENAMES:
        bare = pattern.sub(replacement, bare)
    return bare if bare == "lm_head.weight" else f"model.{bare}"


class _Renamed(Mapping[str, BuildSource]):
    """``tensors`` under their transformers names (`hf_name`), without the MTP layers and the
    names in ``unused``."""

    def __init__(self, tensors: Mapping[str, BuildSource], unused: set[str]) -> None:
        self._tensors = tensors
        self._names: dict[str, str] = {}
        for name in tensors:
            new = hf_name(name)
            if new is not None and new not in unused:
                self._names[new] = name

    def __getitem__(self, name: str) -> BuildSource:
        return self._tensors[self._names[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


# -- numerics shared by the layers -------------------------------------------------------------------------

def rope_tail(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """V4's RoPE on the last ``2 * cos.shape[-1]`` dimensions of ``x`` [..., d], on consecutive
    pairs; ``cos`` / ``sin`` broadcast to [..., pairs] (float32; rounded to ``x``'s dtype first,
    as transformers hands them over), the rotation in float32."""
    rd = 2 * cos.shape[-1]
    cos, sin = cos.to(x.dtype).float(), sin.to(x.dtype).float()
    pairs = x[..., -rd:].float().unflatten(-1, (rd // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-rd], rotated), dim=-1)


def _angles(positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos(), freqs.sin()


def _unit_rms(x: Tensor, eps: float) -> Tensor:
    """RMSNorm without a weight (transformers' ``DeepseekV4UnweightedRMSNorm``)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def hyper_weights(streams: Tensor, fn: Tensor, base: Tensor, scale: Tensor, iters: int, hc_eps: float,
                  eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """One hyper-connection's ``(post [T, n], comb [T, n, n], collapsed input [T, hidden])`` of the
    streams [T, n, hidden] (float32 weights; see the module docstring)."""
    n = streams.shape[1]
    mixes = F.linear(_unit_rms(streams.reshape(streams.shape[0], -1).float(), eps), fn)
    pre_w, post_w, comb_w = mixes.split((n, n, n * n), dim=-1)
    pre = torch.sigmoid(pre_w * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + base[n : 2 * n])
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * scale[2] + base[2 * n :].view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def hyper_merge(streams: Tensor, out: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """The streams after a block: ``post * out + comb^T @ streams``."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


def pool_windows(kv: Tensor, gate: Tensor, bias: Tensor, rate: int, dim: int, overlap: bool) -> Tensor:
    """One entry per window of ``rate`` rows of ``kv`` / ``gate`` [windows * rate, c * dim] (c = 2
    with ``overlap``, CSA: entry w pools window w - 1's first series and window w's second, the
    first window's without a predecessor; else c = 1): the per-channel softmax of gate + ``bias``
    [rate, c * dim] over the pooled rows weighs the kv rows. [windows, dim], before the norm."""
    windows = kv.shape[0] // rate
    kv = kv.view(windows, rate, -1)
    gate = gate.view(windows, rate, -1) + bias
    if overlap:
        pooled_kv = kv.new_zeros(windows, 2 * rate, dim)
        pooled_gate = gate.new_full((windows, 2 * rate, dim), float("-inf"))
        pooled_kv[:, rate:] = kv[..., dim:]
        pooled_gate[:, rate:] = gate[..., dim:]
        pooled_kv[1:, :rate] = kv[:-1, :, :dim]
        pooled_gate[1:, :rate] = gate[:-1, :, :dim]
        kv, gate = pooled_kv, pooled_gate
    return (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)


def compress_inv_freq(config: DeepseekV4Config) -> Tensor:
    """The compressed layers' inverse RoPE frequencies [qk_rope_head_dim // 2]: base
    ``compress_rope_theta``, with the config's YaRN scaling (its cos/sin factor is 1 here)."""
    rd = config.rotary
    if config.compress_yarn is not None:
        return yarn_inv_freq(rd, config.compress_rope_theta, config.compress_yarn, config.max_position_embeddings)[0]
    return 1.0 / (config.compress_rope_theta ** (torch.arange(0, rd, 2, dtype=torch.int64).float() / rd))


def cache_specs(cfg: DeepseekV4Config) -> tuple[CacheSpec, ...]:
    """What each layer keeps (see the module docstring): a sliding layer its K, a compressed layer
    its raw rows for the last `raw_window` positions; then each compressed layer's entry stream,
    one row per rate positions (cache index `entry_stream`)."""
    layers = tuple(SlidingWindowSpec(1, cfg.head_dim, cfg.sliding_window) if kind == SLIDING
                   else RowWindowSpec(cfg.row_dim(i), cfg.raw_window(i)) for i, kind in enumerate(cfg.layer_types))
    entries = tuple(CompressedSpec(cfg.entry_dim(i), cfg.rate(i))
                    for i, kind in enumerate(cfg.layer_types) if kind != SLIDING)
    return layers + entries


class DeepseekV4ForCausalLM(MoEForCausalLM):
    """DeepSeek V4 on `MoEForCausalLM` (its MoE layers, weight formats and loading; same constructor
    arguments): V4 layers on ``hc_mult`` residual streams, the HyperHead, two RoPE tables."""

    config: DeepseekV4Config
    compress_inv_freq: Tensor

    def __init__(self, config: DeepseekV4Config, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", *, lm_head_fp32: bool = True,
                 weights: WeightFormat | None = None, q8_head: bool = False) -> None:
        super().__init__(config, dtype, device, lm_head_fp32=lm_head_fp32, weights=weights, q8_head=q8_head)
        self.register_buffer("compress_inv_freq", compress_inv_freq(config).to(device), persistent=False)
        n, hidden = config.hc_mult, config.hidden_size
        self.hc_head_fn = param(torch.empty(n, n * hidden, dtype=torch.float32, device=device))
        self.hc_head_base = param(torch.empty(n, dtype=torch.float32, device=device))
        self.hc_head_scale = param(torch.empty(1, dtype=torch.float32, device=device))

    def _build_layers(self, device: torch.device, dense_dtype: torch.dtype | None) -> list[DecoderLayer]:
        cfg = self.config
        return [_V4Layer(cfg, i, self.dtype, device, dense_dtype) for i in range(cfg.num_layers)]

    def cache_specs(self) -> tuple[CacheSpec, ...]:
        return cache_specs(self.config)

    def load_weights(self, tensors: Mapping[str, BuildSource]) -> None:
        """`MoEForCausalLM.load_weights` over the tensors' transformers names (`hf_name`). A hash
        layer's router bias, which DeepSeek's checkpoints may carry and its routing never reads
        (transformers' hash router has none), is skipped."""
        unused = {f"model.layers.{i}.mlp.gate.e_score_correction_bias"
                  for i, hashed in enumerate(self.config.hash_layers) if hashed}
        super().load_weights(_Renamed(tensors, unused))

    def _weight_targets(self) -> dict[str, Tensor]:
        targets = super()._weight_targets()
        targets.update({"model.hc_head.hc_fn": self.hc_head_fn, "model.hc_head.hc_base": self.hc_head_base,
                        "model.hc_head.hc_scale": self.hc_head_scale})
        return targets

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionContext, *,
                embeds: tuple[Tensor, Tensor] | None = None, keep: Tensor | None = None) -> Tensor:
        """Hidden states after the HyperHead and the final norm (``embeds`` and ``keep`` as in
        `LlamaForCausalLM.forward`)."""
        return self.hyper_head(self._streams(input_ids, positions, attn, embeds, keep))

    def forward_with_features(self, input_ids: Tensor, positions: Tensor, attn: AttentionContext, *,
                              embeds: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """`interface.DraftFeatureLM`: every row's hidden state (as `forward`) and its residual
        streams before the HyperHead, flattened [T, hc_mult * hidden]: what the MTP layers read."""
        streams = self._streams(input_ids, positions, attn, embeds, None)
        return self.hyper_head(streams), streams.flatten(1)

    def _streams(self, input_ids: Tensor, positions: Tensor, attn: AttentionContext,
                 embeds: tuple[Tensor, Tensor] | None, keep: Tensor | None) -> Tensor:
        h = self.embed(input_ids)
        if embeds is not None:
            rows, features = embeds
            h = h.index_copy(0, rows.to(h.device), features.to(device=h.device, dtype=h.dtype))
        streams = h.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        return self.run_streams(streams, input_ids, positions, attn, keep=keep)

    def run_streams(self, streams: Tensor, input_ids: Tensor, positions: Tensor, attn: AttentionContext, *,
                    keep: Tensor | None = None) -> Tensor:
        """The layers on the residual streams [T, hc_mult, hidden] of tokens ``input_ids`` at
        ``positions``: the streams after the last layer (the rows ``keep``, every row writing the
        cache), before the HyperHead. An MTP block (`mtp.DeepseekV4MTP`) runs its one layer here on
        streams of its own."""
        tables = {"main": _angles(positions, self.inv_freq), "compress": _angles(positions, self.compress_inv_freq)}
        for layer in self._v4_layers():
            streams = layer(streams, input_ids, positions, tables, attn)
        return streams if keep is None else streams.index_select(0, keep)

    def hyper_head(self, streams: Tensor) -> Tensor:
        """The HyperHead and the final norm: the streams [T, hc_mult, hidden] collapsed with the
        head's own ``pre`` weights, then normed: [T, hidden]."""
        cfg = self.config
        if streams.shape[0] == 0:
            return streams[:, 0]
        flat = _unit_rms(streams.flatten(1).float(), cfg.rms_norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_head_fn) * self.hc_head_scale + self.hc_head_base) + cfg.hc_eps
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return rms_norm(collapsed, self.norm, cfg.rms_norm_eps)

    def _v4_layers(self) -> Sequence[_V4Layer]:
        return [cast(_V4Layer, layer) for layer in self.layers]


class _V4Layer(MoELayer):
    """`MoELayer` (its routed and shared experts) with V4's attention and hyper-connections.
    Projections: ``qkv_a_proj`` (everything that reads the normed input: ``q_a_proj``, ``kv_proj``,
    the compressor's ``kv_proj`` / ``gate_proj``, the indexer's compressor and ``weights_proj``),
    ``q_b_proj`` (the attention's and the indexer's, both reading the low-rank query), ``o_proj``
    (``o_b_proj``); ``o_a_proj`` is a dense [groups, o_lora_rank, heads * head_dim / groups]
    parameter."""

    def __init__(self, config: DeepseekV4Config, layer_idx: int, dtype: torch.dtype, device: torch.device,
                 dense_dtype: torch.dtype | None) -> None:
        super().__init__(config, layer_idx, dtype, device, dense_dtype)
        del self.qkv_proj  # the llama-style placeholder
        cfg = config
        self.kind = cfg.layer_types[layer_idx]
        self.hashed = cfg.hash_layers[layer_idx]
        self.rate = 0 if self.kind == SLIDING else cfg.rate(layer_idx)
        self.entry_stream = 0 if self.kind == SLIDING else cfg.entry_stream(layer_idx)
        self.rank, self.index_heads, self.index_dim = cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim
        self.index_topk, self.window = cfg.index_topk, cfg.sliding_window
        self.groups, self.o_rank = cfg.o_groups, cfg.o_lora_rank
        self.hc, self.hc_iters, self.hc_eps = cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps
        self.limit = cfg.swiglu_limit
        self.rope_kind = "main" if self.kind == SLIDING else "compress"
        d, hidden = self.head_dim, cfg.hidden_size
        series = 2 if self.kind == CSA else 1
        # The first projection's column blocks, in order (name, width).
        blocks = [("self_attn.q_a_proj.weight", self.rank), ("self_attn.kv_proj.weight", d)]
        if self.kind != SLIDING:
            blocks += [("self_attn.compressor.kv_proj.weight", series * d),
                       ("self_attn.compressor.gate_proj.weight", series * d)]
        if self.kind == CSA:
            blocks += [("self_attn.compressor.indexer.kv_proj.weight", 2 * self.index_dim),
                       ("self_attn.compressor.indexer.gate_proj.weight", 2 * self.index_dim),
                       ("self_attn.compressor.indexer.scorer.weights_proj.weight", self.index_heads)]
        self.first_blocks = tuple(blocks)
        q_blocks = [("self_attn.q_b_proj.weight", self.num_heads * d)]
        if self.kind == CSA:
            q_blocks.append(("self_attn.compressor.indexer.q_b_proj.weight", self.index_heads * self.index_dim))
        self.q_blocks = tuple(q_blocks)

        def projection(rows: int, cols: int) -> nn.Module:
            if dense_dtype is None:
                return UnloadedLinear()
            return DenseLinear(torch.empty(rows, cols, dtype=dense_dtype, device=device))

        def f32(*shape: int) -> nn.Parameter:
            return param(torch.empty(*shape, dtype=torch.float32, device=device))

        self.qkv_a_proj: nn.Module = projection(sum(w for _, w in blocks), hidden)
        self.q_b_proj: nn.Module = projection(sum(w for _, w in q_blocks), self.rank)
        self.o_proj = projection(hidden, self.groups * self.o_rank)
        self.o_a = param(torch.empty(self.groups, self.o_rank, self.num_heads * d // self.groups, dtype=dtype,
                                     device=device))
        self.q_a_norm, self.kv_norm, self.sinks = f32(self.rank), f32(d), f32(self.num_heads)
        mixes = (2 + self.hc) * self.hc
        self.attn_hc = nn.ParameterList([f32(mixes, self.hc * hidden), f32(mixes), f32(3)])
        self.ffn_hc = nn.ParameterList([f32(mixes, self.hc * hidden), f32(mixes), f32(3)])
        self.comp_norm: nn.Parameter | None = None
        self.comp_bias: nn.Parameter | None = None
        self.index_norm: nn.Parameter | None = None
        self.index_bias: nn.Parameter | None = None
        if self.kind != SLIDING:
            self.comp_norm, self.comp_bias = f32(d), f32(self.rate, series * d)
        if self.kind == CSA:
            self.index_norm, self.index_bias = f32(self.index_dim), f32(self.rate, 2 * self.index_dim)
        self.register_buffer("compress_inv_freq", compress_inv_freq(cfg).to(device), persistent=False)
        self.tid2eid: nn.Parameter | None = None
        if self.hashed:  # experts by token id; no correction bias
            self.tid2eid = param(torch.zeros(cfg.vocab_size, cfg.router.top_k, dtype=torch.long, device=device))
            self.correction_bias = None
        elif self.correction_bias is None:
            self.correction_bias = f32(cfg.router.num_experts)

    def projection_parts(self) -> dict[str, tuple[tuple[str, tuple[int, int]], ...]]:
        parts = super().projection_parts()
        del parts["qkv_proj"]
        hidden = self.hidden_size
        parts["qkv_a_proj"] = tuple((name, (width, hidden)) for name, width in self.first_blocks)
        parts["q_b_proj"] = tuple((name, (width, self.rank)) for name, width in self.q_blocks)
        parts["o_proj"] = (("self_attn.o_b_proj.weight", (hidden, self.groups * self.o_rank)),)
        return parts

    def set_projection(self, attr: str, module: nn.Module) -> None:
        if attr in ("qkv_a_proj", "q_b_proj"):
            setattr(self, attr, module)
        else:
            super().set_projection(attr, module)

    def weight_targets(self) -> dict[str, Tensor]:
        targets = super().weight_targets()
        targets.update({
            "self_attn.o_a_proj.weight": self.o_a.view(-1, self.o_a.shape[-1]),
            "self_attn.q_a_norm.weight": self.q_a_norm,
            "self_attn.kv_norm.weight": self.kv_norm,
            "self_attn.sinks": self.sinks,
        })
        for name, params in (("attn_hc", self.attn_hc), ("ffn_hc", self.ffn_hc)):
            targets.update({f"{name}.fn": params[0], f"{name}.base": params[1], f"{name}.scale": params[2]})
        if self.comp_norm is not None and self.comp_bias is not None:
            targets["self_attn.compressor.kv_norm.weight"] = self.comp_norm
            targets["self_attn.compressor.position_bias"] = self.comp_bias
        if self.index_norm is not None and self.index_bias is not None:
            targets["self_attn.compressor.indexer.kv_norm.weight"] = self.index_norm
            targets["self_attn.compressor.indexer.position_bias"] = self.index_bias
        if self.tid2eid is not None:
            targets["mlp.gate.tid2eid"] = self.tid2eid
        return targets

    # -- the layer ------------------------------------------------------------------------------------------

    def forward(self, streams: Tensor, input_ids: Tensor, positions: Tensor,  # type: ignore[override]
                tables: Mapping[str, tuple[Tensor, Tensor]], attn: AttentionContext) -> Tensor:
        """One layer on the streams [T, hc_mult, hidden]."""
        eps = self.eps
        fn, base, scale = self.attn_hc
        post, comb, x = hyper_weights(streams, fn, base, scale, self.hc_iters, self.hc_eps, eps)
        out = self.attention(rms_norm(x, self.input_norm, eps), positions, tables[self.rope_kind], attn)
        streams = hyper_merge(streams, out, post, comb)
        fn, base, scale = self.ffn_hc
        post, comb, x = hyper_weights(streams, fn, base, scale, self.hc_iters, self.hc_eps, eps)
        out = self.v4_feed_forward(rms_norm(x, self.post_attention_norm, eps), input_ids)
        return hyper_merge(streams, out, post, comb)

    def v4_feed_forward(self, x: Tensor, input_ids: Tensor) -> Tensor:
        """Routed experts (top-k or hashed) plus the shared expert, both with the SwiGLU clipping."""
        assert self.router is not None
        logits = F.linear(x, self.router)
        if self.tid2eid is not None:
            weights, ids = route(logits, self.router_spec, ids=self.tid2eid[input_ids])
        else:
            weights, ids = route(logits, self.router_spec, self.correction_bias)
        out = expert_mix(x, weights, ids, *self.routed_experts(), limit=self.limit)
        gate_up = cast(nn.Module, self.gate_up_proj)(x)
        gate, up = gate_up.split(self.mlp_size, dim=-1)
        return out + cast(Tensor, cast(nn.Module, self.down_proj)(swiglu(gate, up, limit=self.limit)))

    def attention(self, x: Tensor, positions: Tensor, angles: tuple[Tensor, Tensor], attn: AttentionContext) -> Tensor:
        """The attention block of the normed input ``x`` [T, hidden]: [T, hidden]."""
        num_tokens, d = x.shape[0], self.head_dim
        a = cast(nn.Module, self.qkv_a_proj)(x)
        widths = [w for _, w in self.first_blocks]
        parts = list(a.split(widths, dim=-1))
        q_residual = rms_norm(parts[0], self.q_a_norm, self.eps)
        b = cast(nn.Module, self.q_b_proj)(q_residual)
        cos, sin = angles[0][:, None], angles[1][:, None]
        q = _unit_rms(b[:, : self.num_heads * d].view(num_tokens, self.num_heads, d), self.eps)
        q = rope_tail(q, cos, sin)
        k = rope_tail(rms_norm(parts[1], self.kv_norm, self.eps)[:, None], cos, sin)  # [T, 1, d]
        scale = d ** -0.5
        if self.kind == SLIDING:
            out = attn(self.layer_idx, q, k, k, scale, sinks=self.sinks)
        else:
            out = self._compressed_attention(q, k[:, 0], parts, b, x, positions, (cos, sin), attn, scale)
        out = rope_tail(out, cos, -sin)
        grouped = out.reshape(num_tokens, self.groups, -1).transpose(0, 1)  # [groups, T, heads * d / groups]
        mixed = torch.bmm(grouped, self.o_a.transpose(1, 2)).transpose(0, 1).reshape(num_tokens, -1)
        return cast(Tensor, self.o_proj(mixed))

    def _compressed_attention(self, q: Tensor, k: Tensor, parts: Sequence[Tensor], b: Tensor, x: Tensor,
                              positions: Tensor, angles: tuple[Tensor, Tensor], attn: AttentionContext,
                              scale: float) -> Tensor:
        """A CSA / HCA layer: its raw rows written, each span's completed windows compressed into
        their entries, then each span's queries over their window and their (selected) entries."""
        d, csa = self.head_dim, self.kind == CSA
        num_tokens = q.shape[0]
        pieces = [k, parts[2], parts[3]]
        index_q: Tensor | None = None
        index_w: Tensor | None = None
        if csa:
            pieces += [parts[4], parts[5]]
            iq = b[:, self.num_heads * d :].view(num_tokens, self.index_heads, self.index_dim)
            index_q = rope_tail(iq, *angles)
            index_w = parts[6].float() * self.index_heads ** -0.5
        ctx = attn.rows(self.layer_idx, torch.cat(pieces, dim=-1), entries=self.entry_stream)
        assert ctx.entries is not None and len(ctx.entry_slots) == len(ctx.spans)
        out = q.new_empty(q.shape)
        for (first, length, slots), entry_slots in zip(ctx.spans, ctx.entry_slots, strict=True):
            tokens = slice(first, first + length)
            self._compress(ctx.cache, slots, length, ctx.entries, entry_slots)
            out[tokens] = self._span_attention(
                q[tokens], ctx.cache, slots, length, scale, ctx.entries, entry_slots,
                None if index_q is None or index_w is None else (index_q[tokens], index_w[tokens]))
        return out

    def _compress(self, cache: Tensor, slots: Tensor, length: int, entries: Tensor, entry_slots: Tensor) -> None:
        """The entries of the windows a span completes (positions end - length .. end - 1), pooled
        from their raw rows (and, in CSA, the previous window's), written at their entry slots."""
        end = len(slots)
        m, d = self.rate, self.head_dim
        lo, hi = (end - length) // m, end // m
        if hi <= lo:
            return
        csa = self.kind == CSA
        first = max(lo - 1, 0) if csa else lo  # CSA's entry lo pools window lo - 1 too (computed, then dropped)
        rows = cache.index_select(0, slots[first * m : hi * m])
        at = entry_slots[lo:hi]
        positions = torch.arange(first, hi, device=slots.device) * m
        series = 2 if csa else 1
        assert self.comp_norm is not None and self.comp_bias is not None
        kv, gate = rows[:, d : (1 + series) * d], rows[:, (1 + series) * d : (1 + 2 * series) * d]
        entries[at, :d] = self._entries(kv, gate, self.comp_bias, self.comp_norm, d, positions)[lo - first :].to(
            entries.dtype)
        if csa:
            assert self.index_norm is not None and self.index_bias is not None
            i, start = self.index_dim, 5 * d
            kv, gate = rows[:, start : start + 2 * i], rows[:, start + 2 * i : start + 4 * i]
            index_entries = self._entries(kv, gate, self.index_bias, self.index_norm, i, positions)
            entries[at, d : d + i] = index_entries[lo - first :].to(entries.dtype)

    def _entries(self, kv: Tensor, gate: Tensor, bias: Tensor, norm: Tensor, dim: int, positions: Tensor) -> Tensor:
        pooled = pool_windows(kv, gate, bias, self.rate, dim, self.kind == CSA)
        cos, sin = _angles(positions, cast(Tensor, self.compress_inv_freq))
        return rope_tail(rms_norm(pooled, norm, self.eps), cos, sin)

    def _span_attention(self, q: Tensor, cache: Tensor, slots: Tensor, length: int, scale: float,
                        entries: Tensor, entry_slots: Tensor, index: tuple[Tensor, Tensor] | None) -> Tensor:
        """One span's queries [n, heads, d] over their sliding window's keys and their entries."""
        end, d, m = len(slots), self.head_dim, self.rate
        start = end - length
        device = q.device
        win_lo = max(0, start - self.window + 1)
        key_pos = torch.arange(win_lo, end, device=device)
        query_pos = torch.arange(start, end, device=device)
        count = end // m
        keys = [cache.index_select(0, slots[win_lo:end])[:, :d]]
        gap = query_pos[:, None] - key_pos[None, :]
        allowed = [(gap >= 0) & (gap < self.window)]
        if count:
            entry_rows = entries.index_select(0, entry_slots[:count])
            keys.append(entry_rows[:, :d])
            visible = torch.arange(count, device=device)[None, :] < ((query_pos + 1) // m)[:, None]
            if index is not None:
                visible = visible & self._selection(index, entry_rows[:, d : d + self.index_dim], visible)
            allowed.append(visible)
        kv = torch.cat(keys).to(q.dtype)
        scores = torch.einsum("thd,kd->thk", q, kv) * scale
        scores = scores.masked_fill(~torch.cat(allowed, dim=-1)[:, None, :], float("-inf"))
        probs = sink_softmax(scores, self.sinks[:, None])
        return torch.einsum("thk,kd->thd", probs.to(kv.dtype), kv)

    def _selection(self, index: tuple[Tensor, Tensor], keys: Tensor, visible: Tensor) -> Tensor:
        """The indexer's choice [n, entries] over the entries' indexer keys: the ``index_topk``
        visible entries of the best scores."""
        iq, weights = index
        i = self.index_dim
        scores = torch.relu(torch.einsum("thi,ki->thk", iq.float(), keys.float())) * i ** -0.5
        scores = (scores * weights[..., None]).sum(dim=1).masked_fill(~visible, float("-inf"))
        top = scores.topk(min(self.index_topk, scores.shape[-1]), dim=-1).indices
        chosen = torch.zeros_like(visible)
        return chosen.scatter_(-1, top, True)


def build(config: ArchitectureConfig, options: BuildOptions) -> DeepseekV4ForCausalLM:
    assert isinstance(config, DeepseekV4Config), config
    model = DeepseekV4ForCausalLM(config, dtype=options.dtype, device=options.device, weights=options.weights,
                                  q8_head=options.q8_head)
    return model


ARCHITECTURES = (
    Architecture(
        name="deepseek_v4",
        hf_model_types=("deepseek_v4",),
        hf_architectures=("DeepseekV4ForCausalLM",),
        gguf_architectures=("deepseek4",),
        config_from_hf=config_from_hf,
        config_from_gguf=config_from_gguf,
        gguf_tensor=gguf_tensor,
        build=build,
    ),
)
"""DeepSeek V4's registry entry (`helios.models.registry`)."""
