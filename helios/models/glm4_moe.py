"""GLM-4.5 / GLM-4.6 MoE (transformers' ``glm4_moe`` / ``Glm4MoeForCausalLM``; llama.cpp's ``glm4moe``).

What differs from Qwen3-MoE (`helios.models.qwen3_moe`), as transformers computes it:

- partial rotary embeddings: rotate-half RoPE on the first ``head_dim * partial_rotary_factor``
  dimensions of each head (0.5 in GLM-4.5), the rest passed through;
- q/k/v bias (``attention_bias``), the per-head q/k RMSNorm only with ``use_qk_norm``;
- the first ``first_k_dense_replace`` layers have a dense MLP (``intermediate_size``), the others are
  MoE layers;
- the router: float32 sigmoid scores, the choice on ``scores + e_score_correction_bias`` within the
  ``topk_group`` best of ``n_group`` groups, weights renormalised (``norm_topk_prob``) and scaled by
  ``routed_scaling_factor`` (`helios.models.moe`);
- ``n_shared_experts`` shared experts (one MLP of ``n_shared_experts * moe_intermediate_size``)
  added to every MoE layer's output, ungated.

A checkpoint's multi-token-prediction layers (``num_nextn_predict_layers``: ``model.layers.{N}``
for N >= ``num_hidden_layers``) are not part of the model, as in transformers; with speculation on
a folder's or a GGUF file's first one drafts (`helios.models.mtp`). Built as
`helios.models.moe_decoder.MoEForCausalLM`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
from helios.models.moe import RouterSpec
from helios.models.moe_decoder import MoEConfig, MoEForCausalLM, gguf_moe_tensor

__all__ = ["ARCHITECTURES", "config_from_gguf", "config_from_hf"]

_SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def config_from_hf(config: Mapping[str, Any]) -> MoEConfig:
    """A GLM-4-MoE config from its ``config.json`` (``partial_rotary_factor`` at the top level or in
    ``rope_parameters``)."""
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config.get('hidden_act')!r}")
    hidden = int(config["hidden_size"])
    num_heads = int(config["num_attention_heads"])
    num_layers = int(config["num_hidden_layers"])
    head_dim = int(config.get("head_dim") or hidden // num_heads)
    rope_params: Mapping[str, Any] = config.get("rope_parameters") or {}
    rope_theta = config.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
    partial = float(rope_params.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0)
    scaling = config.get("rope_scaling") or (rope_params if rope_params else None)
    if scaling:
        scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"}
    first_dense = int(config.get("first_k_dense_replace") or 0)
    moe_inter = int(config["moe_intermediate_size"])
    num_experts = int(config.get("n_routed_experts") or config.get("num_local_experts") or 0)
    return MoEConfig(
        arch="glm4_moe",
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        moe_layers=tuple(i >= first_dense for i in range(num_layers)),
        router=RouterSpec(num_experts=num_experts, top_k=int(config["num_experts_per_tok"]), scoring="sigmoid",
                          norm_topk_prob=bool(config.get("norm_topk_prob", True)),
                          n_group=int(config.get("n_group") or 1), topk_group=int(config.get("topk_group") or 1),
                          routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0)),
        moe_intermediate_size=moe_inter,
        shared_intermediate_size=moe_inter * int(config.get("n_shared_experts") or 0),
        shared_name="shared_experts",
        rotary_dim=int(head_dim * partial),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=float(rope_theta),
        rope_scaling=normalize_rope_scaling(scaling),
        max_position_embeddings=int(config.get("max_position_embeddings") or 131072),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", False)),
        qk_norm=bool(config.get("use_qk_norm", False)),
    )


def config_from_gguf(source: GGUFSource) -> MoEConfig:
    """A GLM-4-MoE config from llama.cpp's ``glm4moe`` metadata: ``block_count`` counts the
    ``nextn_predict_layers`` too (not part of the model; `gguf_tensor`), ``leading_dense_block_count``, ``expert_count``,
    ``expert_used_count``, ``expert_shared_count``, ``expert_feed_forward_length``,
    ``expert_weights_scale``, ``expert_weights_norm``, ``expert_group_count`` /
    ``expert_group_used_count`` (default 1), ``rope.dimension_count`` (the rotated dimensions)."""
    key = gguf_key(source)
    tensors = source.tensor_shapes
    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    num_layers = int(key("block_count")) - int(key("nextn_predict_layers", 0))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    gating = int(key("expert_gating_func", _SIGMOID_GATING))
    if gating != _SIGMOID_GATING:
        raise NotImplementedError(f"glm4moe expert_gating_func {gating} is not supported (sigmoid: 2)")
    scaling_kind = source.metadata.get(f"{source.metadata.get('general.architecture')}.rope.scaling.type")
    if scaling_kind not in (None, "none"):
        raise NotImplementedError(f"GGUF rope scaling {scaling_kind!r} is not supported for glm4moe")
    moe_inter = int(key("expert_feed_forward_length"))
    ffn = key("feed_forward_length")
    if isinstance(ffn, list):
        ffn = max(ffn)
    return MoEConfig(
        arch="glm4_moe",
        vocab_size=int(tensors["token_embd.weight"][0]),
        hidden_size=hidden,
        intermediate_size=int(ffn),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=gguf_kv_heads(key, num_heads),
        head_dim=head_dim,
        moe_layers=tuple(i >= int(key("leading_dense_block_count", 0)) for i in range(num_layers)),
        router=RouterSpec(num_experts=int(key("expert_count")), top_k=int(key("expert_used_count")),
                          scoring="sigmoid", norm_topk_prob=bool(key("expert_weights_norm", True)),
                          n_group=int(key("expert_group_count", 1)), topk_group=int(key("expert_group_used_count", 1)),
                          routed_scaling_factor=float(key("expert_weights_scale", 1.0))),
        moe_intermediate_size=moe_inter,
        shared_intermediate_size=moe_inter * int(key("expert_shared_count", 0)),
        shared_name="shared_experts",
        rotary_dim=int(key("rope.dimension_count", head_dim)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length", 131072)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
    )


def gguf_tensor(config: ArchitectureConfig, gguf_name: str) -> GGUFTensor | None:
    """`moe_decoder.gguf_moe_tensor`'s names; the ``nextn_predict_layers`` layers llama.cpp
    appends (``blk.{N}``, their ``nextn.*`` tensors) under ``model.layers.{N}`` as a folder has
    them, for `helios.models.mtp`."""
    return gguf_moe_tensor(config, gguf_name, mtp=True)


def build(config: ArchitectureConfig, options: BuildOptions) -> MoEForCausalLM:
    assert isinstance(config, MoEConfig) and config.arch == "glm4_moe", config
    return MoEForCausalLM(config, dtype=options.dtype, device=options.device, weights=options.weights,
                          q8_head=options.q8_head)


ARCHITECTURES = (
    Architecture(
        name="glm4_moe",
        hf_model_types=("glm4_moe",),
        hf_architectures=("Glm4MoeForCausalLM",),
        gguf_architectures=("glm4moe",),
        config_from_hf=config_from_hf,
        config_from_gguf=config_from_gguf,
        gguf_tensor=gguf_tensor,
        build=build,
    ),
)
"""GLM-4-MoE's registry entry (`helios.models.registry`)."""
