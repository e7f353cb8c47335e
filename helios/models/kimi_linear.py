"""Kimi Linear (transformers' ``kimi_linear`` / ``KimiLinearForCausalLM``): a hybrid of Kimi Delta
Attention (KDA) layers and multi-head latent attention (MLA) layers without RoPE, each followed by
DeepSeek-V3's feed-forward (a dense MLP, or the sigmoid-routed MoE with shared experts).

- Layer kinds: ``layer_types`` (``linear_attention`` / ``full_attention``), or the release's
  ``linear_attn_config`` (``kda_layers`` / ``full_attn_layers``, 1-based); MLP kinds:
  ``mlp_layer_types`` (``dense`` / ``sparse``), or the first ``first_k_dense_replace`` (1) dense.
- MLA (`helios.models.deepseek_v3`'s layer with ``DeepseekV3Config.rope`` False): the query from
  ``q_proj`` (or ``q_b_proj(norm(q_a_proj))``), the normed latent and the shared ``qk_rope_head_dim``
  key part, none of them rotated (NoPE); softmax scale ``(qk_nope + qk_rope) ** -0.5``. Its cache is
  the `LatentAttentionSpec` row.
- KDA: ``q_proj``, ``k_proj``, ``v_proj`` ([heads x head_dim] each) through one depthwise causal conv
  (``linear_conv_kernel_dim``, SiLU; `gated_delta.causal_conv`), then the gated delta rule
  (`gated_delta.gated_delta`) with a decay per head *and key channel*: ``g = -exp(A_log[h]) *
  softplus(f_b_proj(f_a_proj(x)) + dt_bias)``, ``beta = sigmoid(b_proj(x))``; the output RMS-normed
  per head (``o_norm``, a plain weight) times ``sigmoid(g_b_proj(g_a_proj(x)))``, then ``o_proj``.
  Its cache is a `RecurrentStateSpec`: the conv state [K - 1, 3 x heads x head_dim] and the state
  [heads, head_dim, head_dim], float32.
- RMSNorms scale by a plain weight.
- MoE (`helios.models.moe_decoder`, as DeepSeek-V3's): sigmoid scores plus
  ``e_score_correction_bias`` for the choice, ``num_expert_group`` / ``topk_group``,
  ``moe_renormalize``, ``routed_scaling_factor``, ``num_shared_experts`` shared experts.

GGUF: llama.cpp's ``kimi-linear`` (`config_from_gguf`, `gguf_tensor`): DeepSeek's MLA metadata and
tensors (``attn_k_b`` / ``attn_v_b`` joined into ``kv_b_proj``), the KDA layers those with
``attention.head_count_kv`` 0 (``kda.head_dim``, ``ssm.conv_kernel``; heads from ``ssm_beta``),
``ssm_a`` = -exp(A_log), ``ssm_conv1d_{q,k,v}`` [1, C, 1, K]. The converter writes no router
normalisation or groups: llama.cpp renormalises (transformers' ``moe_renormalize``, the release's
True) and uses no groups (the release's ``num_expert_group`` 1), and so does this config.
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
from helios.models.decoder import DecoderLayer, add_rms_norm, param
from helios.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM, _MLALayer
from helios.models.gated_delta import causal_conv, gated_delta
from helios.models.interface import AttentionContext, CacheSpec, LatentAttentionSpec, RecurrentStateSpec
from helios.models.minimax_m2 import MixtralNames
from helios.models.moe import RouterSpec
from helios.models.moe_decoder import MoELayer
from helios.models.quant import BuildSource, DenseLinear, UnloadedLinear, WeightFormat
from helios.models.qwen3_next import LinearAttentionNames

__all__ = ["ARCHITECTURES", "KimiLinearConfig", "KimiLinearForCausalLM", "config_from_gguf", "config_from_hf",
           "gguf_tensor"]

_KDA_PROJ = ("in_proj", "f_b_proj", "g_b_proj")


@attrs.frozen(kw_only=True)
class KimiLinearConfig(DeepseekV3Config):
    """`DeepseekV3Config` (MLA without RoPE: ``rope`` False) plus the KDA layers: which they are,
    their heads and head size (keys and values alike) and the conv kernel."""

    linear_layers: tuple[bool, ...]
    linear_num_heads: int
    linear_head_dim: int
    conv_kernel: int = 4

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if len(self.linear_layers) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.linear_layers)} entries for {self.num_layers} layers")
        if self.conv_kernel < 1:
            raise ValueError(f"short_conv_kernel_size must be positive, got {self.conv_kernel}")

    @property
    def linear_size(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    def projection_params(self) -> int:
        """Weights of the MLA or KDA projections, dense MLPs and shared experts (not the routed
        experts)."""
        hidden, heads, d = self.hidden_size, self.num_heads, self.linear_head_dim
        q = heads * self.head_dim
        q_params = hidden * q if self.q_lora_rank is None else self.q_lora_rank * (hidden + q)
        mla = q_params + hidden * self.row_dim + self.kv_lora_rank * heads * (
            self.qk_nope_head_dim + self.v_head_dim) + heads * self.v_head_dim * hidden
        kda = 4 * self.linear_size * hidden + (2 * d + self.linear_num_heads) * hidden + 2 * d * self.linear_size
        total = 0
        for moe, lin in zip(self.moe_layers, self.linear_layers, strict=True):
            inter = self.shared_intermediate_size if moe else self.intermediate_size
            total += (kda if lin else mla) + 3 * inter * hidden
        return int(total)


def _layer_kinds(config: Mapping[str, Any], num_layers: int) -> tuple[list[str], list[str]]:
    """``layer_types`` and ``mlp_layer_types`` as transformers' ``KimiLinearConfig`` derives them."""
    linear_cfg: Mapping[str, Any] = config.get("linear_attn_config") or {}
    types = config.get("layer_types")
    if types is None:
        if "full_attn_layers" in linear_cfg and "kda_layers" in linear_cfg:
            types = [""] * num_layers
            for i in linear_cfg["full_attn_layers"]:
                types[int(i) - 1] = "full_attention"
            for i in linear_cfg["kda_layers"]:
                types[int(i) - 1] = "linear_attention"
        else:
            types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(num_layers)]
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown:
        raise NotImplementedError(f"kimi_linear layer types {unknown} are not supported")
    mlp = config.get("mlp_layer_types")
    if mlp is None:
        first_dense = int(config.get("first_k_dense_replace", 1))
        mlp = ["dense" if i < first_dense else "sparse" for i in range(num_layers)]
    return list(types), list(mlp)


def config_from_hf(config: Mapping[str, Any]) -> KimiLinearConfig:
    """A Kimi Linear config from its ``config.json`` (the release's keys, ``linear_attn_config``
    included, or transformers 5.24's saved ones)."""
    if config.get("quantization_config"):
        raise NotImplementedError("kimi_linear: quantized checkpoints (quantization_config) are not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config.get('hidden_act')!r}")
    if config.get("attention_bias"):
        raise NotImplementedError("kimi_linear: attention_bias is not supported")
    if config.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise NotImplementedError("kimi_linear: only the sigmoid router is supported")
    hidden = int(config["hidden_size"])
    num_heads = int(config["num_attention_heads"])
    num_layers = int(config["num_hidden_layers"])
    nope, rope = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
    types, mlp = _layer_kinds(config, num_layers)
    linear_cfg: Mapping[str, Any] = config.get("linear_attn_config") or {}
    moe_inter = int(config["moe_intermediate_size"])
    q_lora = config.get("q_lora_rank")
    return KimiLinearConfig(
        arch="kimi_linear",
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=nope + rope,
        moe_layers=tuple(kind == "sparse" for kind in mlp),
        router=RouterSpec(num_experts=int(config["num_experts"]), top_k=int(config["num_experts_per_token"]),
                          scoring="sigmoid", norm_topk_prob=bool(config.get("moe_renormalize", True)),
                          n_group=int(config.get("num_expert_group") or 1),
                          topk_group=int(config.get("topk_group") or 1),
                          routed_scaling_factor=float(config.get("routed_scaling_factor") or 1.0)),
        moe_intermediate_size=moe_inter,
        shared_intermediate_size=moe_inter * int(config.get("num_shared_experts") or 0),
        shared_name="shared_experts",
        rotary_dim=rope,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=int(config.get("model_max_length") or config.get("max_position_embeddings")
                                    or 1048576),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(config["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=int(config["v_head_dim"]),
        rope_interleave=False,
        rope=False,
        linear_layers=tuple(t == "linear_attention" for t in types),
        linear_num_heads=int(linear_cfg.get("num_heads") or config.get("linear_num_heads") or 32),
        linear_head_dim=int(linear_cfg.get("head_dim") or config.get("linear_head_dim") or 128),
        conv_kernel=int(linear_cfg.get("short_conv_kernel_size") or config.get("linear_conv_kernel_dim") or 4),
    )


def config_from_gguf(source: GGUFSource) -> KimiLinearConfig:
    """A Kimi Linear config from llama.cpp's ``kimi-linear`` metadata (see the module docstring)."""
    key = gguf_key(source)
    fields = deepseek_v3.gguf_mla_fields(source)
    num_layers = int(fields["num_layers"])
    kv_heads = key("attention.head_count_kv")
    if not isinstance(kv_heads, list):
        kv_heads = [kv_heads] * num_layers
    linear = tuple(int(n) == 0 for n in kv_heads[:num_layers])
    first = linear.index(True) if any(linear) else None
    heads = int(source.tensor_shapes[f"blk.{first}.ssm_beta.weight"][0]) if first is not None else 1
    router = attrs.evolve(fields.pop("router"), norm_topk_prob=True, n_group=1, topk_group=1)
    fields.update(rope_interleave=False, yarn=None)
    return KimiLinearConfig(arch="kimi_linear", router=router, rope=False, linear_layers=linear,
                            linear_num_heads=heads, linear_head_dim=int(key("kda.head_dim")),
                            conv_kernel=int(key("ssm.conv_kernel")), **fields)


_GGUF_KDA_NAMES = {
    "ssm_conv1d_q.weight": "self_attn.q_conv1d.weight",
    "ssm_conv1d_k.weight": "self_attn.k_conv1d.weight",
    "ssm_conv1d_v.weight": "self_attn.v_conv1d.weight",
    "ssm_a": "self_attn.A",
    "ssm_dt.bias": "self_attn.dt_bias",
    "ssm_f_a.weight": "self_attn.f_a_proj.weight",
    "ssm_f_b.weight": "self_attn.f_b_proj.weight",
    "ssm_g_a.weight": "self_attn.g_a_proj.weight",
    "ssm_g_b.weight": "self_attn.g_b_proj.weight",
    "ssm_beta.weight": "self_attn.b_proj.weight",
    "ssm_norm.weight": "self_attn.o_norm.weight",
}


def gguf_tensor(config: ArchitectureConfig, gguf_name: str) -> GGUFTensor | None:
    """Where a ``kimi-linear`` tensor goes: the KDA names here, the rest as ``deepseek2``'s
    (`deepseek_v3.gguf_tensor`; layers past ``num_layers`` go nowhere)."""
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_KDA_NAMES:
        return GGUFTensor(f"model.layers.{parts[1]}.{_GGUF_KDA_NAMES[parts[2]]}")
    return deepseek_v3.gguf_tensor(config, gguf_name, mtp=False)


class KimiLinearForCausalLM(DeepseekV3ForCausalLM):
    """`DeepseekV3ForCausalLM` with Kimi Linear's two layer kinds (MLA without RoPE,
    `_KimiDeltaLayer`)."""

    config: KimiLinearConfig

    def __init__(self, config: KimiLinearConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", *, lm_head_fp32: bool = True,
                 weights: WeightFormat | None = None, q8_head: bool = False) -> None:
        super().__init__(config, dtype, device, lm_head_fp32=lm_head_fp32, weights=weights, q8_head=q8_head)

    def _build_layers(self, device: torch.device, dense_dtype: torch.dtype | None) -> list[DecoderLayer]:
        cfg = self.config
        return [(_KimiDeltaLayer if cfg.linear_layers[i] else _MLALayer)(cfg, i, self.dtype, device, dense_dtype)
                for i in range(cfg.num_layers)]

    def cache_specs(self) -> tuple[CacheSpec, ...]:
        cfg = self.config
        d = cfg.linear_head_dim
        state = RecurrentStateSpec(((cfg.conv_kernel - 1, 3 * cfg.linear_size), (cfg.linear_num_heads, d, d)),
                                   dtype=torch.float32)
        latent = LatentAttentionSpec(cfg.row_dim)
        return tuple(state if linear else latent for linear in cfg.linear_layers)

    def load_weights(self, tensors: Mapping[str, BuildSource]) -> None:
        """`DeepseekV3ForCausalLM.load_weights` over the checkpoint's names (the release's, which
        transformers' ``save_pretrained`` writes too): the MoE's Mixtral-style ``block_sparse_moe``
        ones (`minimax_m2.MixtralNames`), then `LinearAttentionNames` (``A_log`` as -exp(A_log), the
        q / k / v conv weights [C, K], rows of the one conv)."""
        super().load_weights(LinearAttentionNames(MixtralNames(tensors), None))


class _KimiDeltaLayer(MoELayer):
    """`MoELayer`'s feed-forward after a KDA mixer. Projections: ``in_proj`` fuses what reads the
    normed input (``q_proj``, ``k_proj``, ``v_proj``, ``f_a_proj``, ``b_proj``, ``g_a_proj``); ``f_b_proj`` and ``g_b_proj`` the low-rank gates' second halves; ``o_proj``
    (`MoELayer.finish`)."""

    def __init__(self, config: KimiLinearConfig, layer_idx: int, dtype: torch.dtype, device: torch.device,
                 dense_dtype: torch.dtype | None) -> None:
        super().__init__(config, layer_idx, dtype, device, dense_dtype)
        del self.qkv_proj  # the llama-style placeholder: KDA has its own projections
        self.qk_norm = None
        self.qkv_bias = None
        self.heads, self.d = config.linear_num_heads, config.linear_head_dim
        self.size = config.linear_size
        self.in_proj: nn.Module | None = None
        self.f_b_proj: nn.Module | None = None
        self.g_b_proj: nn.Module | None = None
        self.o_proj = UnloadedLinear() if dense_dtype is None else DenseLinear(
            torch.empty(config.hidden_size, self.size, dtype=dense_dtype, device=device))
        self.conv_weight = param(torch.empty(3 * self.size, config.conv_kernel, dtype=dtype, device=device))
        self.dt_bias = param(torch.empty(self.size, dtype=torch.float32, device=device))
        self.neg_rate = param(torch.empty(self.heads, dtype=torch.float32, device=device))  # -exp(A_log)
        self.gated_norm = param(torch.empty(self.d, dtype=torch.float32, device=device))

    def projection_parts(self) -> dict[str, tuple[tuple[str, tuple[int, int]], ...]]:
        parts = {k: v for k, v in super().projection_parts().items() if k != "qkv_proj"}
        hidden, size, d = self.hidden_size, self.size, self.d
        parts["in_proj"] = (("self_attn.q_proj.weight", (size, hidden)), ("self_attn.k_proj.weight", (size, hidden)),
                            ("self_attn.v_proj.weight", (size, hidden)),
                            ("self_attn.f_a_proj.weight", (d, hidden)),
                            ("self_attn.b_proj.weight", (self.heads, hidden)),
                            ("self_attn.g_a_proj.weight", (d, hidden)))
        parts["f_b_proj"] = (("self_attn.f_b_proj.weight", (size, d)),)
        parts["g_b_proj"] = (("self_attn.g_b_proj.weight", (size, d)),)
        parts["o_proj"] = (("self_attn.o_proj.weight", (hidden, size)),)
        return parts

    def set_projection(self, attr: str, module: nn.Module) -> None:
        if attr in _KDA_PROJ:
            setattr(self, attr, module)
            return
        super().set_projection(attr, module)

    def weight_targets(self) -> dict[str, Tensor]:
        targets = super().weight_targets()
        targets.update({
            "self_attn.q_conv1d.weight": self.conv_weight[: self.size],
            "self_attn.k_conv1d.weight": self.conv_weight[self.size : 2 * self.size],
            "self_attn.v_conv1d.weight": self.conv_weight[2 * self.size :],
            "self_attn.dt_bias": self.dt_bias,
            "self_attn.A": self.neg_rate,
            "self_attn.o_norm.weight": self.gated_norm,
        })
        return targets

    def mix(self, x: Tensor, attn: AttentionContext) -> Tensor:
        """The KDA output [T, heads x head_dim] of the normed stream ``x``, before ``o_proj``."""
        num_tokens = x.shape[0]
        heads, d, size = self.heads, self.d, self.size
        proj = cast(nn.Module, self.in_proj)(x)
        mixed, f_a, b, g_a = proj.split((3 * size, d, heads, d), dim=-1)
        batch = attn.recurrent(self.layer_idx)
        conv_state, delta_state = batch.states
        mixed = causal_conv(mixed, self.conv_weight, conv_state, batch.spans).to(x.dtype)
        q, k, v = (t.reshape(num_tokens, heads, d) for t in mixed.split((size, size, size), dim=-1))
        wide = torch.promote_types(x.dtype, torch.float32)  # float32 (float64 for a float64 reference)
        forget = cast(nn.Module, self.f_b_proj)(f_a).to(wide) + self.dt_bias
        g = self.neg_rate[:, None] * F.softplus(forget.reshape(num_tokens, heads, d))  # per head and key channel
        beta = torch.sigmoid(b).to(wide)
        core = gated_delta(q, k, v, g, beta, delta_state, batch.spans).to(x.dtype).to(wide)
        gate = cast(nn.Module, self.g_b_proj)(g_a).to(wide).reshape(num_tokens, heads, d)
        normed = core * torch.rsqrt(core.pow(2).mean(-1, keepdim=True) + self.eps) * self.gated_norm
        return (normed * torch.sigmoid(gate)).to(x.dtype).reshape(num_tokens, size)

    def forward(self, h: Tensor, delta: Tensor | None, cos: Tensor, sin: Tensor, attn: AttentionContext,
                fused: bool = False, *, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
        h, x = add_rms_norm(h, delta, self.input_norm, self.eps, fused)
        return self.finish(h, self.mix(x, attn), keep, fused, self.size)


def build(config: ArchitectureConfig, options: BuildOptions) -> KimiLinearForCausalLM:
    assert isinstance(config, KimiLinearConfig), config
    return KimiLinearForCausalLM(config, dtype=options.dtype, device=options.device, weights=options.weights,
                                 q8_head=options.q8_head)


ARCHITECTURES = (
    Architecture(
        name="kimi_linear",
        hf_model_types=("kimi_linear",),
        hf_architectures=("KimiLinearForCausalLM",),
        gguf_architectures=("kimi-linear",),
        config_from_hf=config_from_hf,
        config_from_gguf=config_from_gguf,
        gguf_tensor=gguf_tensor,
        build=build,
    ),
)
"""Kimi Linear's registry entry (`helios.models.registry`)."""
