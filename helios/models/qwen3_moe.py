"""Qwen3-MoE (transformers' ``qwen3_moe`` / ``Qwen3MoeForCausalLM``; llama.cpp's ``qwen3moe``).

Qwen3's attention (per-head q/k RMSNorm, no bias by default, full rotary) with a softmax-routed
mixture of experts (`helios.models.moe`: top ``num_experts_per_tok`` of ``num_experts``,
renormalised when ``norm_topk_prob``) on the layers transformers makes sparse: layer i is an MoE
layer unless it is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step`` is not 0; the others
have a dense MLP of ``intermediate_size``. No shared experts. Built as
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


def moe_layer_flags(num_layers: int, num_experts: int, step: int, mlp_only: tuple[int, ...]) -> tuple[bool, ...]:
    """transformers' Qwen2/Qwen3-MoE rule: which layers are sparse."""
    return tuple(i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))


def config_from_hf(config: Mapping[str, Any]) -> MoEConfig:
    """A Qwen3-MoE config from its ``config.json`` (transformers 4.x and 5.x spellings)."""
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config.get('hidden_act')!r}")
    if config.get("use_sliding_window"):
        raise NotImplementedError("qwen3_moe with use_sliding_window is not supported")
    hidden = int(config["hidden_size"])
    num_heads = int(config["num_attention_heads"])
    num_layers = int(config["num_hidden_layers"])
    num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if num_experts <= 0:
        raise ValueError("qwen3_moe config has no experts (num_experts)")
    rope_params: Mapping[str, Any] = config.get("rope_parameters") or {}
    rope_theta = config.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
    scaling = config.get("rope_scaling") or (rope_params if rope_params else None)
    return MoEConfig(
        arch="qwen3_moe",
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden // num_heads),
        moe_layers=moe_layer_flags(num_layers, num_experts, int(config.get("decoder_sparse_step") or 1),
                                   tuple(int(i) for i in config.get("mlp_only_layers") or ())),
        router=RouterSpec(num_experts=num_experts, top_k=int(config["num_experts_per_tok"]), scoring="softmax",
                          norm_topk_prob=bool(config.get("norm_topk_prob", False))),
        moe_intermediate_size=int(config["moe_intermediate_size"]),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=normalize_rope_scaling(scaling),
        max_position_embeddings=int(config.get("max_position_embeddings") or 32768),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", False)),
        qk_norm=True,
    )


def config_from_gguf(source: GGUFSource) -> MoEConfig:
    """A Qwen3-MoE config from llama.cpp's ``qwen3moe`` metadata (``expert_count``,
    ``expert_used_count``, ``expert_feed_forward_length``; llama.cpp renormalises the chosen
    experts' weights for this architecture unless ``expert_weights_norm`` says otherwise; the layers
    with an ``ffn_gate_inp`` router are the sparse ones)."""
    key = gguf_key(source)
    tensors = source.tensor_shapes
    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    num_layers = int(key("block_count"))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    num_experts = int(key("expert_count"))
    ffn = key("feed_forward_length", 0)
    if isinstance(ffn, list):
        ffn = max(ffn)
    scaling_kind = source.metadata.get(f"{source.metadata.get('general.architecture')}.rope.scaling.type")
    if scaling_kind not in (None, "none"):
        raise NotImplementedError(f"GGUF rope scaling {scaling_kind!r} is not supported for qwen3moe")
    return MoEConfig(
        arch="qwen3_moe",
        vocab_size=int(tensors["token_embd.weight"][0]),
        hidden_size=hidden,
        intermediate_size=int(ffn) or int(key("expert_feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=gguf_kv_heads(key, num_heads),
        head_dim=head_dim,
        moe_layers=tuple(f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(num_layers)),
        router=RouterSpec(num_experts=num_experts, top_k=int(key("expert_used_count")), scoring="softmax",
                          norm_topk_prob=bool(key("expert_weights_norm", True))),
        moe_intermediate_size=int(key("expert_feed_forward_length")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length", 32768)),
        tie_word_embeddings="output.weight" not in tensors,
        qk_norm=True,
    )


def gguf_tensor(config: ArchitectureConfig, gguf_name: str) -> GGUFTensor | None:
    return gguf_moe_tensor(config, gguf_name)


def build(config: ArchitectureConfig, options: BuildOptions) -> MoEForCausalLM:
    assert isinstance(config, MoEConfig) and config.arch == "qwen3_moe", config
    return MoEForCausalLM(config, dtype=options.dtype, device=options.device, weights=options.weights,
                          q8_head=options.q8_head, parallel=options.parallel)


ARCHITECTURES = (
    Architecture(
        name="qwen3_moe",
        hf_model_types=("qwen3_moe",),
        hf_architectures=("Qwen3MoeForCausalLM",),
        gguf_architectures=("qwen3moe",),
        config_from_hf=config_from_hf,
        config_from_gguf=config_from_gguf,
        gguf_tensor=gguf_tensor,
        build=build,
    ),
)
"""Qwen3-MoE's registry entry (`helios.models.registry`)."""
