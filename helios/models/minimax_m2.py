"""MiniMax-M2 (transformers' ``minimax_m2`` / ``MiniMaxM2ForCausalLM``).

What differs from the other MoE families (`helios.models.glm4_moe`), as transformers 5 computes it:

- the q/k RMSNorm is over the whole projection: one norm over all the q heads together
  (``num_attention_heads * head_dim`` weights) and one over all the k heads, before the heads are
  split (the checkpoints' ``qk_norm_type`` ``"per_layer"``; another type is refused);
- partial rotary embeddings: rotate-half RoPE on the first ``rotary_dim`` dimensions of each head
  (``rotary_dim`` at the top level, or ``partial_rotary_factor`` in ``rope_parameters``);
- every layer is an MoE layer (experts of ``intermediate_size``), no shared experts, no bias;
- the router: logits in the activation dtype (the router weight kept in it), float32 sigmoid
  scores, the choice on ``scores + e_score_correction_bias`` (no groups), the chosen unbiased
  scores renormalised, unscaled (`helios.models.moe`).

Checkpoints use Mixtral's names (``block_sparse_moe.gate.weight``,
``block_sparse_moe.e_score_correction_bias``, ``block_sparse_moe.experts.{e}.w1/w3/w2.weight`` for
gate/up/down), as ``save_pretrained`` writes them too; transformers' in-memory names
(``mlp.e_score_correction_bias``, stacked ``mlp.experts.gate_up_proj`` / ``down_proj``) load as
well. Built as `helios.models.moe_decoder.MoEForCausalLM`.

GGUF: llama.cpp's ``minimax-m2`` (`config_from_gguf`): the MoE families' names
(`helios.models.moe_decoder.gguf_moe_tensor`: stacked ``ffn_*_exps``, ``exp_probs_b.bias``, the
whole-projection ``attn_q_norm`` / ``attn_k_norm``), q/k rows in rotate-half order (llama.cpp runs
this architecture with NeoX RoPE), ``rope.dimension_count`` the rotated dimensions.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
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
from helios.models.quant import BuildSource

__all__ = ["ARCHITECTURES", "MiniMaxM2ForCausalLM", "MixtralNames", "config_from_gguf", "config_from_hf", "hf_name"]


def config_from_hf(config: Mapping[str, Any]) -> MoEConfig:
    """A MiniMax-M2 config from its ``config.json`` (the original release's keys and transformers 5's)."""
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config.get('hidden_act')!r}")
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        raise NotImplementedError(f"minimax_m2 scoring_func {config.get('scoring_func')!r} is not supported")
    if config.get("qk_norm_type", "per_layer") != "per_layer" or not config.get("use_qk_norm", True):
        raise NotImplementedError("minimax_m2 supports the q/k norm over the whole projection "
                                  f"(qk_norm_type 'per_layer'), got {config.get('qk_norm_type')!r}")
    if int(config.get("shared_intermediate_size") or 0):
        raise NotImplementedError("minimax_m2 with shared experts (shared_intermediate_size) is not supported")
    if config.get("quantization_config"):
        raise NotImplementedError("minimax_m2: quantized checkpoints (quantization_config) are not supported")
    hidden = int(config["hidden_size"])
    num_heads = int(config["num_attention_heads"])
    num_layers = int(config["num_hidden_layers"])
    head_dim = int(config.get("head_dim") or hidden // num_heads)
    rope_params: Mapping[str, Any] = config.get("rope_parameters") or {}
    rope_theta = config.get("rope_theta") or rope_params.get("rope_theta") or 5000000.0
    if config.get("rotary_dim"):
        rotary = int(config["rotary_dim"])
    else:
        partial = float(rope_params.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0)
        rotary = int(head_dim * partial)
    scaling = config.get("rope_scaling") or (rope_params if rope_params else None)
    if scaling:
        scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"}
    num_experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    inter = int(config["intermediate_size"])
    return MoEConfig(
        arch="minimax_m2",
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        moe_layers=(True,) * num_layers,
        router=RouterSpec(num_experts=num_experts, top_k=int(config["num_experts_per_tok"]), scoring="sigmoid",
                          norm_topk_prob=True, fp32_logits=False),
        moe_intermediate_size=inter,
        rotary_dim=rotary,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=normalize_rope_scaling(scaling),
        max_position_embeddings=int(config.get("max_position_embeddings") or 196608),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qk_norm=True,
        qk_norm_per_head=False,
    )


def config_from_gguf(source: GGUFSource) -> MoEConfig:
    """A MiniMax-M2 config from llama.cpp's ``minimax-m2`` metadata (``expert_count``,
    ``expert_used_count``, ``expert_feed_forward_length``, ``rope.dimension_count``). llama.cpp's
    converter writes no router keys for this architecture: its graph hard-codes what
    `config_from_hf` assumes (sigmoid scores plus ``exp_probs_b``, renormalised, unscaled)."""
    key = gguf_key(source)
    tensors = source.tensor_shapes
    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    num_layers = int(key("block_count"))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    scaling_kind = source.metadata.get(f"{source.metadata.get('general.architecture')}.rope.scaling.type")
    if scaling_kind not in (None, "none"):
        raise NotImplementedError(f"GGUF rope scaling {scaling_kind!r} is not supported for minimax-m2")
    gating = int(key("expert_gating_func", 2))
    if gating != 2:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
        raise NotImplementedError(f"minimax-m2 expert_gating_func {gating} is not supported (sigmoid: 2)")
    inter = int(key("expert_feed_forward_length"))
    return MoEConfig(
        arch="minimax_m2",
        vocab_size=int(tensors["token_embd.weight"][0]),
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=gguf_kv_heads(key, num_heads),
        head_dim=head_dim,
        moe_layers=(True,) * num_layers,
        router=RouterSpec(num_experts=int(key("expert_count")), top_k=int(key("expert_used_count")),
                          scoring="sigmoid", norm_topk_prob=True, fp32_logits=False),
        moe_intermediate_size=inter,
        rotary_dim=int(key("rope.dimension_count", head_dim)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 5000000.0)),
        max_position_embeddings=int(key("context_length", 196608)),
        tie_word_embeddings="output.weight" not in tensors,
        qk_norm=True,
        qk_norm_per_head=False,
    )


def gguf_tensor(config: ArchitectureConfig, gguf_name: str) -> GGUFTensor | None:
    return gguf_moe_tensor(config, gguf_name)


_EXPERT_PART = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")


def hf_name(name: str) -> str:
    """A MiniMax-M2 checkpoint name as the MoE decoder knows it (`MoEForCausalLM.load_weights`)."""
    match = _MIXTRAL_EXPERT.search(name)
    if match:
        return f"{name[: match.start()]}.mlp.experts.{match[1]}.{_EXPERT_PART[match[2]]}.weight"
    name = name.replace(".block_sparse_moe.", ".mlp.")
    if name.endswith(".mlp.e_score_correction_bias"):
        return name[: -len("e_score_correction_bias")] + "gate.e_score_correction_bias"
    return name


class MixtralNames(Mapping[str, BuildSource]):
    """``tensors`` under `hf_name`'s names (read lazily); Kimi Linear's MoE layers use them too
    (`helios.models.kimi_linear`)."""

    def __init__(self, tensors: Mapping[str, BuildSource]) -> None:
        self._tensors = tensors
        self._names: dict[str, str] = {}
        for name in tensors:
            new = hf_name(name)
            if new in self._names:
                raise ValueError(f"{name}: {new} is in the checkpoint twice")
            self._names[new] = name

    def __getitem__(self, name: str) -> BuildSource:
        return self._tensors[self._names[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class MiniMaxM2ForCausalLM(MoEForCausalLM):
    """`MoEForCausalLM` reading MiniMax-M2's (Mixtral-style) weight names."""

    def load_weights(self, tensors: Mapping[str, BuildSource]) -> None:
        super().load_weights(MixtralNames(tensors))


def build(config: ArchitectureConfig, options: BuildOptions) -> MiniMaxM2ForCausalLM:
    assert isinstance(config, MoEConfig) and config.arch == "minimax_m2", config
    return MiniMaxM2ForCausalLM(config, dtype=options.dtype, device=options.device, weights=options.weights,
                                q8_head=options.q8_head)


ARCHITECTURES = (
    Architecture(
        name="minimax_m2",
        hf_model_types=("minimax_m2",),
        hf_architectures=("MiniMaxM2ForCausalLM",),
        gguf_architectures=("minimax-m2",),
        config_from_hf=config_from_hf,
        config_from_gguf=config_from_gguf,
        gguf_tensor=gguf_tensor,
        build=build,
    ),
)
"""MiniMax-M2's registry entry (`helios.models.registry`)."""
