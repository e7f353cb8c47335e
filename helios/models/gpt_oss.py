"""gpt-oss (transformers' ``gpt_oss`` / ``GptOssForCausalLM``).

A pre-norm decoder whose every layer is a mixture of experts, with:

- alternating sliding-window and full attention (``layer_types``; by default layer i slides when
  i is even), the sliding layers on a `SlidingWindowSpec` of ``sliding_window`` (query position p
  sees keys p - window + 1 .. p, transformers' sliding mask);
- attention sinks: a learned logit per query head (``self_attn.sinks``) in the softmax's
  denominator (`helios.models.attention_sinks`, passed to the attention context as ``sinks``: the
  backends run sink layers on their torch paths, never the CPU paged kernels);
- q/k/v and o biases; rotate-half RoPE with YaRN scaling (`config.yarn_inv_freq`: the frequencies
  and an attention factor that scales cos and sin);
- a router with bias: ``logits = x W^T + b``, the ``top_k`` largest logits, softmax over those
  (in the activation dtype);
- experts with biases and a clamped SwiGLU: ``gate_up = x @ gate_up_proj[e] + bias`` with gate and
  up interleaved (gate: even columns, up: odd), ``gate = min(gate, limit)``, ``up = clamp(up,
  -limit, limit)``, ``h = (up + 1) * gate * sigmoid(alpha * gate)``, ``out = h @ down_proj[e] +
  bias`` (``alpha`` 1.702, ``limit`` 7.0). The expert weights are kept as transformers stores them
  ([E, hidden, 2I] and [E, I, hidden], multiplied from the left), dense in the model's dtype
  whatever the weight format (which converts the attention projections); tokens are grouped by
  expert as in `helios.models.moe.expert_mix`.

The checkpoints OpenAI publishes hold the experts in MXFP4 (``quantization_config`` ``mxfp4``:
``gate_up_proj_blocks`` / ``_scales`` ...): they are dequantized on load into the model's dtype
(`dequantize_mxfp4`, transformers' ``convert_moe_packed_tensors``), so the experts take their dense
size in memory. bfloat16 or float32 exports (``gate_up_proj`` ...) load as they are.

GGUF: llama.cpp's ``gpt-oss`` (`config_from_gguf`, `gguf_tensor`). Its converter splits the
experts into llama.cpp's stacked layout: ``ffn_gate_exps`` / ``ffn_up_exps`` [E, I, hidden] (the
even and odd columns of ``gate_up_proj``), ``ffn_down_exps`` [E, hidden, I] (``down_proj``
transposed), their biases [E, I] / [E, hidden]; ``attn_sinks``, ``ffn_gate_inp`` (weight and
bias: the router), ``post_attention_norm``. The experts of an MXFP4 checkpoint are written as ggml
MXFP4 blocks (dequantized on load by ``gguf.quants``, exact: every FP4 value times a power of two
is a float32), those of a dense one in the output type. On load they are joined back into
transformers' layout (`_SplitExperts`). llama.cpp writes no layer types: its loader takes the
``attention.sliding_window_pattern`` array when a file has one, else every even layer slides (what
`config_from_hf` defaults to). q/k rows are in rotate-half order (llama.cpp runs gpt-oss with NeoX
RoPE).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar, cast

import attrs
import torch
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
from helios.models.config import DecoderDims, yarn_inv_freq
from helios.models.decoder import DecoderLayer, FusedDecoderLM, add_rms_norm, apply_rope, param, rope_tables
from helios.models.interface import AttentionContext, CacheSpec, FullAttentionSpec, SlidingWindowSpec
from helios.models.quant import BuildSource, DenseLinear, UnloadedLinear, WeightFormat, dense_of

__all__ = ["ARCHITECTURES", "GptOssConfig", "GptOssForCausalLM", "clamped_swiglu_mix", "config_from_gguf",
           "config_from_hf", "dequantize_mxfp4", "gguf_tensor"]

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The E2M1 values of the 16 FP4 codes."""


@attrs.frozen(kw_only=True)
class GptOssConfig(DecoderDims):
    """Shape and numerics of a gpt-oss decoder. ``intermediate_size``: each expert's;
    ``sliding_layers``: per layer, True for a sliding-window layer; ``rope_scaling``: None (plain
    RoPE) or a YaRN dict (``factor``, ``original_max_position_embeddings``, ``beta_fast``,
    ``beta_slow``, ``truncate``...)."""

    arch: str = "gpt_oss"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_layers: tuple[bool, ...]
    sliding_window: int | None
    num_experts: int
    top_k: int
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling: dict[str, Any] | None = attrs.field(default=None, hash=False)
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    attention_bias: bool = True

    def __attrs_post_init__(self) -> None:
        self.check_dims()
        if len(self.sliding_layers) != self.num_layers:
            raise ValueError(f"sliding_layers has {len(self.sliding_layers)} entries for {self.num_layers} layers")
        if any(self.sliding_layers) and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError(f"sliding layers need a positive sliding_window, got {self.sliding_window}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be in 1..num_experts ({self.num_experts})")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type")
            if kind != "yarn":
                raise ValueError(f"gpt_oss supports plain or 'yarn' rope scaling, got {kind!r}")
            if "original_max_position_embeddings" not in self.rope_scaling:
                raise ValueError("yarn rope scaling lacks original_max_position_embeddings")

    def projection_params(self) -> int:
        """Weights in the projections a weight format converts: the attention's (the experts stay dense)."""
        attention = (self.q_size + 2 * self.kv_size) * self.hidden_size + self.hidden_size * self.q_size
        return int(attention * self.num_layers)


def config_from_hf(config: Mapping[str, Any]) -> GptOssConfig:
    """A gpt-oss config from its ``config.json`` (``rope_scaling`` + ``rope_theta``, or transformers
    5's ``rope_parameters``; absent: transformers' default YaRN, factor 32 over 4096 positions)."""
    hidden = int(config["hidden_size"])
    num_heads = int(config["num_attention_heads"])
    num_layers = int(config["num_hidden_layers"])
    quant = config.get("quantization_config")
    if quant and quant.get("quant_method") != "mxfp4":
        raise NotImplementedError(f"gpt_oss with quantization_config {quant.get('quant_method')!r} is not supported "
                                  "(MXFP4 experts and dense exports are)")
    rope: Mapping[str, Any] | None = config.get("rope_parameters") or config.get("rope_scaling")
    if rope is None:
        rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
    theta = config.get("rope_theta") or rope.get("rope_theta") or 150000.0
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in ("default", "yarn"):
        raise NotImplementedError(f"gpt_oss rope type {kind!r} is not supported")
    scaling = None if kind == "default" else {**{k: v for k, v in rope.items() if k not in ("type", "rope_theta")},
                                              "rope_type": "yarn"}
    layer_types = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    unknown = set(layer_types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"unknown gpt_oss layer types {sorted(unknown)}")
    window = config.get("sliding_window", 128)
    return GptOssConfig(
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden // num_heads),
        sliding_layers=tuple(t == "sliding_attention" for t in layer_types),
        sliding_window=int(window) if window else None,
        num_experts=int(config.get("num_local_experts") or config["num_experts"]),
        top_k=int(config.get("num_experts_per_tok", 4)),
        swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(config.get("swiglu_limit", 7.0)),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_position_embeddings=int(config.get("max_position_embeddings") or 131072),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", True)),
    )


def config_from_gguf(source: GGUFSource) -> GptOssConfig:
    """A gpt-oss config from llama.cpp's ``gpt-oss`` metadata: ``expert_feed_forward_length`` (each
    expert's), ``attention.sliding_window``, the layer pattern (``attention.sliding_window_pattern``
    when written, else llama.cpp's default: even layers slide), and YaRN from ``rope.scaling.*``.
    llama.cpp's YaRN floors / ceils the correction range (``ggml_rope_yarn_corr_dims``), which is
    transformers' ``truncate`` True; the file does not carry transformers' ``truncate``, nor the
    clamped SwiGLU's ``swiglu_limit`` / alpha, which llama.cpp hard-codes to 7.0 / 1.702 as here."""
    key = gguf_key(source)
    tensors = source.tensor_shapes
    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    num_layers = int(key("block_count"))
    kv = key("attention.head_count_kv", num_heads)
    if isinstance(kv, list):
        if len(set(kv)) != 1:
            raise NotImplementedError("gpt-oss with per-layer kv head counts is not supported")
        kv = kv[0]
    pattern = key("attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):
        sliding = tuple(bool(p) for p in pattern[:num_layers])
    else:  # llama.cpp's set_swa_pattern(n): layer i slides unless i % n == n - 1 (n = 0: every layer)
        n = int(pattern)
        sliding = tuple(n == 0 or i % n < n - 1 for i in range(num_layers))
    kind = key("rope.scaling.type", "none")
    scaling: dict[str, Any] | None = None
    if kind == "yarn":
        for unsupported in ("rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor"):
            if key(unsupported, False) is not False:
                raise NotImplementedError(f"gpt-oss GGUF with {unsupported} is not supported")
        scaling = {"rope_type": "yarn", "factor": float(key("rope.scaling.factor")),
                   "original_max_position_embeddings": int(key("rope.scaling.original_context_length")),
                   "beta_fast": float(key("rope.scaling.yarn_beta_fast", 32.0)),
                   "beta_slow": float(key("rope.scaling.yarn_beta_slow", 1.0)), "truncate": True}
    elif kind != "none":
        raise NotImplementedError(f"gpt-oss GGUF rope scaling {kind!r} is not supported (yarn)")
    window = key("attention.sliding_window", 0)
    return GptOssConfig(
        vocab_size=int(tensors["token_embd.weight"][0]),
        hidden_size=hidden,
        intermediate_size=int(key("expert_feed_forward_length")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(kv),
        head_dim=int(key("attention.key_length", hidden // num_heads)),
        sliding_layers=sliding,
        sliding_window=int(window) or None,
        num_experts=int(key("expert_count")),
        top_k=int(key("expert_used_count")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 150000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(key("context_length", 131072)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
    )


_GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                      "output.weight": "lm_head.weight"}
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    **{f"attn_{g}.{kind}": f"self_attn.{h}_proj.{kind}" for g, h in (("q", "q"), ("k", "k"), ("v", "v"),
                                                                     ("output", "o"))
       for kind in ("weight", "bias")},
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    # llama.cpp's split experts, joined by `_SplitExperts`
    **{f"ffn_{part}_exps.{kind}": f"mlp.experts.{part}_proj.{kind}" for part in ("gate", "up", "down")
       for kind in ("weight", "bias")},
}


def gguf_tensor(config: ArchitectureConfig, gguf_name: str) -> GGUFTensor | None:
    """Where a ``gpt-oss`` GGUF tensor goes (no q/k permutation: NeoX RoPE in llama.cpp)."""
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return GGUFTensor(_GGUF_GLOBAL_NAMES[gguf_name])
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_LAYER_NAMES:
        return GGUFTensor(f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}")
    raise NotImplementedError(f"GGUF tensor {gguf_name!r} has no gpt-oss counterpart here")


class _SplitExperts(Mapping[str, BuildSource]):
    """``tensors`` with llama.cpp's split experts (``mlp.experts.{gate,up,down}_proj.{weight,bias}``,
    gate / up [E, I, hidden], down [E, hidden, I]) seen as transformers' ``gate_up_proj`` [E, hidden,
    2I] (gate in the even columns, up in the odd ones), ``down_proj`` [E, I, hidden] and their
    biases (read when asked for, dense)."""

    _JOINED: ClassVar[dict[str, tuple[str, ...]]] = {"gate_up_proj": ("gate_proj.weight", "up_proj.weight"),
                                                     "gate_up_proj_bias": ("gate_proj.bias", "up_proj.bias"),
                                                     "down_proj": ("down_proj.weight",),
                                                     "down_proj_bias": ("down_proj.bias",)}

    def __init__(self, tensors: Mapping[str, BuildSource]) -> None:
        self._tensors = tensors
        self._joined: dict[str, tuple[str, ...]] = {}
        self._names: list[str] = []
        split = {name for name in tensors if ".mlp.experts." in name and name.endswith((".weight", ".bias"))}
        for name in tensors:
            if name not in split:
                self._names.append(name)
        for prefix in sorted({name.split(".mlp.experts.")[0] for name in split}):
            for joined, parts in self._JOINED.items():
                sources = tuple(f"{prefix}.mlp.experts.{p}" for p in parts)
                if all(s in split for s in sources):
                    self._joined[f"{prefix}.mlp.experts.{joined}"] = sources
                    self._names.append(f"{prefix}.mlp.experts.{joined}")
                    split -= set(sources)
        self._names.extend(sorted(split))  # left unjoined: reported as unexpected by load_weights

    def __getitem__(self, name: str) -> BuildSource:
        sources = self._joined.get(name)
        if sources is None:
            return self._tensors[name]
        parts = [dense_of(self._tensors[s]) for s in sources]
        if len(parts) == 1:  # down: [E, hidden, I] -> [E, I, hidden]; its bias as it is
            return parts[0].transpose(1, 2).contiguous() if parts[0].dim() == 3 else parts[0]
        gate, up = parts
        joined = torch.stack((gate, up), dim=-2 if gate.dim() == 3 else -1)  # [E, I, 2, hidden] / [E, I, 2]
        if gate.dim() == 3:
            return joined.reshape(gate.shape[0], 2 * gate.shape[1], gate.shape[2]).transpose(1, 2).contiguous()
        return joined.reshape(gate.shape[0], 2 * gate.shape[1])

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """MXFP4 expert weights as transformers' ``convert_moe_packed_tensors`` dequantizes them:
    ``blocks`` [E, rows, G, 16] uint8 (two FP4 codes a byte, the low nibble first), ``scales``
    [E, rows, G] uint8 (E8M0: 2 ** (s - 127) per 32 values) -> [E, G * 32, rows] in ``dtype`` (the
    transposed layout the experts multiply from the left)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} do not match scales "
                         f"{tuple(scales.shape)} {scales.dtype}")
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    *prefix, groups, width = blocks.shape
    out = torch.empty(*prefix, groups, width * 2, dtype=dtype)
    out[..., 0::2] = lut[(blocks & 0x0F).long()]
    out[..., 1::2] = lut[(blocks >> 4).long()]
    torch.ldexp(out, (scales.to(torch.int32) - 127).unsqueeze(-1), out=out)
    return out.reshape(*prefix, groups * width * 2).transpose(1, 2).contiguous()


class _Mxfp4Experts(Mapping[str, BuildSource]):
    """``tensors`` with each pair ``{name}_blocks`` / ``{name}_scales`` of the experts seen as the
    dense ``{name}`` (`dequantize_mxfp4`, read when asked for)."""

    def __init__(self, tensors: Mapping[str, BuildSource], dtype: torch.dtype) -> None:
        self._tensors = tensors
        self._dtype = dtype
        self._pairs: dict[str, tuple[str, str]] = {}
        self._names: list[str] = []
        for name in tensors:
            if name.endswith("_scales") and name[: -len("_scales")] + "_blocks" in tensors:
                continue
            if name.endswith("_blocks") and name[: -len("_blocks")] + "_scales" in tensors:
                base = name[: -len("_blocks")]
                self._pairs[base] = (name, base + "_scales")
                name = base
            self._names.append(name)

    def __getitem__(self, name: str) -> BuildSource:
        pair = self._pairs.get(name)
        if pair is None:
            return self._tensors[name]
        blocks, scales = (self._tensors[n] for n in pair)
        assert isinstance(blocks, Tensor) and isinstance(scales, Tensor), (name, type(blocks), type(scales))
        return dequantize_mxfp4(blocks, scales, self._dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def clamped_swiglu_mix(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Tensor, gate_up_bias: Tensor,
                       down: Tensor, down_bias: Tensor, alpha: float, limit: float) -> Tensor:
    """sum over each token's chosen experts e of ``weight * (h @ down[e] + down_bias[e])``, ``h``
    the clamped SwiGLU of ``x @ gate_up[e] + gate_up_bias[e]`` (gate / up interleaved; see the module
    docstring): [T, hidden] in ``x``'s dtype. ``gate_up`` [E, hidden, 2I], ``down`` [E, I, hidden].
    Tokens are grouped by expert (a stable sort of the (token, slot) pairs), one pair of matmuls per
    active expert."""
    num_tokens, top_k = ids.shape
    out = torch.zeros_like(x)
    if num_tokens == 0:
        return out
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // top_k
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    rows = x.index_select(0, token_of)
    parts: list[Tensor] = []
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        gu = torch.addmm(gate_up_bias[expert], rows[start : start + count], gate_up[expert])
        gate = gu[:, ::2].clamp(max=limit)
        up = gu[:, 1::2].clamp(min=-limit, max=limit)
        h = (up + 1) * (gate * torch.sigmoid(gate * alpha))
        parts.append(torch.addmm(down_bias[expert], h, down[expert]))
        start += count
    mixed = torch.cat(parts) * weights.reshape(-1, 1).index_select(0, order)
    return out.index_add_(0, token_of, mixed.to(x.dtype))


class GptOssForCausalLM(FusedDecoderLM):
    """gpt-oss on `FusedDecoderLM` (same constructor arguments as
    `helios.models.llama.LlamaForCausalLM`)."""

    config: GptOssConfig
    inv_freq: Tensor

    def __init__(self, config: GptOssConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", *, lm_head_fp32: bool = True,
                 weights: WeightFormat | None = None, q8_head: bool = False) -> None:
        super().__init__(config, dtype, device, lm_head_fp32=lm_head_fp32, weights=weights, q8_head=q8_head)
        if config.rope_scaling is None:
            freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float) / config.head_dim))
            self.attention_factor = 1.0
        else:
            freq, self.attention_factor = yarn_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling,
                                                        config.max_position_embeddings)
        self.register_buffer("inv_freq", freq.to(device), persistent=False)

    def _build_layers(self, device: torch.device, dense_dtype: torch.dtype | None) -> list[DecoderLayer]:
        cfg = self.config
        return [_GptOssLayer(cfg, i, self.dtype, device, dense_dtype) for i in range(cfg.num_layers)]

    def cache_specs(self) -> tuple[CacheSpec, ...]:
        """Sliding layers keep a `SlidingWindowSpec` of ``sliding_window``, full ones full K/V."""
        cfg = self.config
        full = FullAttentionSpec(cfg.num_kv_heads, cfg.head_dim)
        if cfg.sliding_window is None:
            return (full,) * cfg.num_layers
        window = SlidingWindowSpec(cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window)
        return tuple(window if sliding else full for sliding in cfg.sliding_layers)

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionContext, *,
                embeds: tuple[Tensor, Tensor] | None = None, keep: Tensor | None = None) -> Tensor:
        """Hidden states after the final norm (``embeds`` and ``keep`` as in `LlamaForCausalLM.forward`)."""
        cos, sin = rope_tables(positions, self.inv_freq, torch.float32)
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        cos, sin = cos.to(self.dtype), sin.to(self.dtype)
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

    def load_weights(self, tensors: Mapping[str, BuildSource]) -> None:
        """`FusedDecoderLM.load_weights`, with MXFP4 expert blocks dequantized into the model's dtype
        and llama.cpp's split experts joined (`_SplitExperts`)."""
        super().load_weights(_SplitExperts(_Mxfp4Experts(tensors, self.dtype)))

    def decode_weight_bytes(self) -> int:
        """`FusedDecoderLM.decode_weight_bytes`, with the experts counted for the ``top_k`` of them
        one token reads."""
        total = super().decode_weight_bytes()
        cfg = self.config
        for layer in self._decoder_layers():
            total -= layer.expert_bytes() * (cfg.num_experts - cfg.top_k) // cfg.num_experts
        return total

    def _decoder_layers(self) -> Sequence[_GptOssLayer]:
        return [cast(_GptOssLayer, layer) for layer in self.layers]


_PROJ_ATTRS = ("qkv_proj", "o_proj")


class _GptOssLayer(DecoderLayer):
    def __init__(self, config: GptOssConfig, layer_idx: int, dtype: torch.dtype, device: torch.device,
                 dense_dtype: torch.dtype | None) -> None:
        super().__init__(config, layer_idx)
        hidden, experts, inter = config.hidden_size, config.num_experts, config.intermediate_size
        self.top_k = config.top_k
        self.alpha = config.swiglu_alpha
        self.limit = config.swiglu_limit

        def empty(*shape: int, dt: torch.dtype = dtype) -> nn.Parameter:
            return param(torch.empty(*shape, dtype=dt, device=device))

        def projection(rows: int, cols: int) -> nn.Module:
            if dense_dtype is None:
                return UnloadedLinear()
            return DenseLinear(torch.empty(rows, cols, dtype=dense_dtype, device=device))

        self.input_norm = empty(hidden, dt=torch.float32)
        self.qkv_proj: nn.Module = projection(config.q_size + 2 * config.kv_size, hidden)
        self.o_proj: nn.Module = projection(hidden, config.q_size)
        self.qkv_bias = empty(config.q_size + 2 * config.kv_size) if config.attention_bias else None
        self.o_bias = empty(hidden) if config.attention_bias else None
        self.sinks = empty(config.num_heads, dt=torch.float32)
        self.post_attention_norm = empty(hidden, dt=torch.float32)
        self.router = empty(experts, hidden)
        self.router_bias = empty(experts)
        self.experts_gate_up = empty(experts, hidden, 2 * inter)
        self.experts_gate_up_bias = empty(experts, 2 * inter)
        self.experts_down = empty(experts, inter, hidden)
        self.experts_down_bias = empty(experts, hidden)

    def projection_parts(self) -> dict[str, tuple[tuple[str, tuple[int, int]], ...]]:
        """The attention's fused q/k/v and o projections (no dense MLP)."""
        parts = super().projection_parts()
        return {attr: parts[attr] for attr in _PROJ_ATTRS}

    def set_projection(self, attr: str, module: nn.Module) -> None:
        if attr not in _PROJ_ATTRS:
            raise KeyError(attr)
        setattr(self, attr, module)

    def expert_bytes(self) -> int:
        tensors = (self.experts_gate_up, self.experts_gate_up_bias, self.experts_down, self.experts_down_bias)
        return sum(int(t.numel() * t.element_size()) for t in tensors)

    def weight_targets(self) -> dict[str, Tensor]:
        q, kv = self.q_size, self.kv_size
        targets: dict[str, Tensor] = {
            "input_layernorm.weight": self.input_norm,
            "post_attention_layernorm.weight": self.post_attention_norm,
            "self_attn.sinks": self.sinks,
            "mlp.router.weight": self.router,
            "mlp.router.bias": self.router_bias,
            "mlp.experts.gate_up_proj": self.experts_gate_up,
            "mlp.experts.gate_up_proj_bias": self.experts_gate_up_bias,
            "mlp.experts.down_proj": self.experts_down,
            "mlp.experts.down_proj_bias": self.experts_down_bias,
        }
        if self.qkv_bias is not None and self.o_bias is not None:
            targets["self_attn.q_proj.bias"] = self.qkv_bias[:q]
            targets["self_attn.k_proj.bias"] = self.qkv_bias[q : q + kv]
            targets["self_attn.v_proj.bias"] = self.qkv_bias[q + kv :]
            targets["self_attn.o_proj.bias"] = self.o_bias
        return targets

    def forward(self, h: Tensor, delta: Tensor | None, cos: Tensor, sin: Tensor, attn: AttentionContext,
                fused: bool = False, *, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """One layer on the residual stream ``h`` plus the previous layer's feed-forward output
        ``delta``: the stream after attention and this layer's feed-forward output (``keep`` as in
        the llama layer)."""
        num_tokens = h.shape[0]
        h, x = add_rms_norm(h, delta, self.input_norm, self.eps, fused)
        qkv = cast(nn.Module, self.qkv_proj)(x)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        split = self.q_size + self.kv_size
        qk = qkv[:, :split].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, split:].view(num_tokens, self.num_kv_heads, self.head_dim)
        qk = cpu_kernels.rope_(qk, cos, sin) if fused and qk.is_contiguous() else apply_rope(qk, cos, sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        out = attn(self.layer_idx, q, k, v, sinks=self.sinks)
        if keep is not None:
            num_tokens = keep.shape[0]
            h, out = h.index_select(0, keep), out.index_select(0, keep)
            if num_tokens == 0:
                return h, h
        o = self.o_proj(out.reshape(num_tokens, self.q_size))
        if self.o_bias is not None:
            o = o + self.o_bias
        h, x = add_rms_norm(h, o, self.post_attention_norm, self.eps, fused)
        return h, self.feed_forward(x)

    def feed_forward(self, x: Tensor) -> Tensor:
        """The router (linear with bias, top-k logits, softmax over them) and the chosen experts."""
        logits = torch.addmm(self.router_bias, x, self.router.t())
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        weights = torch.softmax(top, dim=-1)
        return clamped_swiglu_mix(x, weights, ids, self.experts_gate_up, self.experts_gate_up_bias,
                                  self.experts_down, self.experts_down_bias, self.alpha, self.limit)


def build(config: ArchitectureConfig, options: BuildOptions) -> GptOssForCausalLM:
    assert isinstance(config, GptOssConfig), config
    return GptOssForCausalLM(config, dtype=options.dtype, device=options.device, weights=options.weights,
                             q8_head=options.q8_head)


ARCHITECTURES = (
    Architecture(
        name="gpt_oss",
        hf_model_types=("gpt_oss",),
        hf_architectures=("GptOssForCausalLM",),
        gguf_architectures=("gpt-oss",),
        config_from_hf=config_from_hf,
        config_from_gguf=config_from_gguf,
        gguf_tensor=gguf_tensor,
        build=build,
    ),
)
"""gpt-oss's registry entry (`helios.models.registry`)."""
