"""One decoder for the Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm).

The model sees a flat batch: the tokens of several sequences concatenated into ``T`` rows, each with
its absolute position. Attention across the rows of one sequence is the job of an `interface.AttentionContext`
(the engine's `PagedAttention`, or `helios.models.dense_attention.DenseAttention` for one sequence).

Layout choices for CPU speed: q/k/v are one matmul and gate/up another (weights concatenated at load
time); RoPE is applied to q and k in one pass, with cos/sin computed once per forward from the
positions. RMSNorm runs in float32 whatever the weight dtype, and so do the logits (the output
projection keeps a float32 copy for bf16/fp16 weights unless ``lm_head_fp32=False``).

The projections' storage is a `helios.models.quant.WeightFormat`: dense in the model dtype by default,
or grouped int4 / per-channel int8 (with an optional dense copy for large steps). `load_weights` takes
dense tensors or `GroupQuantized` codes (GGUF Q4_0/Q4_1/Q8_0 blocks) and builds each fused projection
in that format; `packed_state` / `load_packed_state` save and restore the built tensors.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from functools import partial
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from helios.models import cpu_kernels, packing
from helios.models.architecture import Architecture, ArchitectureConfig, BuildOptions, GGUFSource, GGUFTensor
from helios.models.config import LLAMA_FAMILY, ROPE_FREQS, ModelConfig, config_from_gguf, rope_inv_freq
from helios.models.decoder import (
    PROJECTIONS,
    DecoderLayer,
    FusedDecoderLM,
    add_rms_norm,
    apply_rope,
    broadcast_qk_norm,
    param,
    rms_norm,
    rope_tables,
)
from helios.models.interface import AttentionContext, CacheSpec, FullAttentionSpec
from helios.models.kquant import TILE_ROWS, plan_segments
from helios.models.packing import Q8_BF16_ROWS as Q8_BF16_ROWS  # re-exported: compute_logits' threshold
from helios.models.quant import DenseLinear, UnloadedLinear, WeightFormat
from helios.models.tp import ParallelContext

__all__ = ["PROJECTIONS", "Q8_BF16_ROWS", "LlamaForCausalLM", "rope_inv_freq"]


class LlamaForCausalLM(FusedDecoderLM):
    config: ModelConfig
    inv_freq: Tensor

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", *, lm_head_fp32: bool = True,
                 weights: WeightFormat | None = None, q8_head: bool = False,
                 parallel: ParallelContext | None = None) -> None:
        """``dtype``: activations, norms' outputs, embeddings and the KV cache; dense projections
        too unless ``weights`` says otherwise (default: dense in ``dtype``). ``lm_head_fp32``: with
        bf16/fp16 weights, keep a float32 copy of the output projection, made from the checkpoint's
        own values (not from the rounded copy), so logits are neither rounded to the weight dtype nor
        computed from rounded weights. Rounding matters: bf16 logits near 25 are multiples of 0.125,
        which turns the default model's first-token near tie into an exact one (and the wrong answer).
        It costs a float32 vocab x hidden matrix of memory and its bandwidth each step; with False,
        logits are computed in the weight dtype and upcast.

        ``q8_head``: when the checkpoint's output projection is a ggml Q8_0 weight (the default model's
        tied embedding is), keep its int8 codes and block scales and compute logits with
        `cpu_kernels.q8_linear`: the same float32 weights and float32 accumulation as the float32
        copy, from a quarter of the bytes (the copy is then not made). CPU only; the caller checks
        that the kernels are built.

        ``parallel``: one tensor-parallel rank's shard (`helios.models.tp`; the config is the
        checkpoint's)."""
        super().__init__(config, dtype, device, lm_head_fp32=lm_head_fp32, weights=weights, q8_head=q8_head,
                         parallel=parallel)
        self.softmax_scale = config.head_dim ** -0.5
        self.register_buffer("inv_freq", rope_inv_freq(config).to(device), persistent=False)

    def _build_layers(self, device: torch.device, dense_dtype: torch.dtype | None) -> list[DecoderLayer]:
        cfg = self.config
        return [_DecoderLayer(cfg, i, self.dtype, device, dense_dtype) for i in range(cfg.num_layers)]

    def cache_specs(self) -> tuple[CacheSpec, ...]:
        """Every layer keeps full-attention K/V (a sliding window in the config is not applied)."""
        spec = FullAttentionSpec(self.config.num_kv_heads, self.config.head_dim)
        return (spec,) * self.config.num_layers

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionContext, *,
                embeds: tuple[Tensor, Tensor] | None = None, keep: Tensor | None = None) -> Tensor:
        """Hidden states after the final norm, [T, hidden_size], for flat ``input_ids``/``positions`` [T].

        ``embeds = (rows, features)``: rows (1-D long, indices into the T flattened tokens) take the
        given features ([len(rows), hidden_size], the model dtype) in place of their token embeddings
        before layer 0 (image features at their placeholder tokens; `helios.models.vision`).

        ``keep`` (1-D long, indices into the T tokens): only these rows' hidden states are wanted
        (those that get logits), returned in that order, [len(keep), hidden_size]. Every token still
        goes through every layer up to the last one's attention (their K/V are written to the cache),
        but the last layer's o projection, norm and MLP, and the final norm, run for the kept rows only:
        a 512-token prompt's first token needs one row of them, not 512. Each row's values are its
        own (attention, projections and norms are row by row), though a projection may pick another
        kernel for fewer rows."""
        cos, sin = self._rope_tables(positions)
        h = self.embed(input_ids)
        if embeds is not None:
            rows, features = embeds
            h = h.index_copy(0, rows.to(h.device), features.to(device=h.device, dtype=h.dtype))
        fused = h.device.type == "cpu" and h.dtype in (torch.float32, torch.bfloat16) and cpu_kernels.available()
        delta: Tensor | None = None
        layers = self._decoder_layers()
        planned = self.planned_decode(h, cos, sin, attn, self._build_plan) \
            if fused and type(self) is LlamaForCausalLM else None
        i = 0
        if planned is not None:  # every layer in one call (k-quant layers)
            h, delta = planned
            i = len(layers)
        while i < len(layers):
            # An all-decode step: each run of layers with one fused projection kind is one operator.
            run = layers[i].fused_decode(h.shape[0], attn) if fused else None
            if run is None:
                last = i == len(layers) - 1
                h, delta = layers[i](h, delta, cos, sin, attn, fused, keep=keep if last else None)
                keep = None if last else keep  # the last layer applied it
                i += 1
                continue
            runs = [run]
            while i + len(runs) < len(layers):
                more = layers[i + len(runs)].fused_decode(h.shape[0], attn)
                if more is None or more[0].group != run[0].group:
                    break
                runs.append(more)
            first = layers[i]
            h, delta = cpu_kernels.decode_layers(h, delta, [r[0] for r in runs], [r[1] for r in runs], cos, sin,
                                                 first.eps, first.num_heads, first.num_kv_heads)
            i += len(runs)
        if keep is not None:  # the last layer ran inside a fused run (an all-decode step)
            h, delta = h.index_select(0, keep), cast(Tensor, delta).index_select(0, keep)
        if h.shape[0] == 0:
            return h
        return _add_rms_norm(h, delta, self.norm, self.config.rms_norm_eps, fused)[1]

    def _decoder_layers(self) -> list[_DecoderLayer]:
        return [cast(_DecoderLayer, layer) for layer in self.layers]

    def _build_plan(self) -> cpu_kernels.KqDecodePlan | None:
        return build_decode_plan(self.config, self._decoder_layers())

    def _rope_tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sign-folded sin, [T, 1, head_dim], so that rope(x) = x*cos + roll(x, d/2)*sin."""
        return rope_tables(positions, self.inv_freq, self.dtype)


class _DecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device,
                 dense_dtype: torch.dtype | None) -> None:
        super().__init__(config, layer_idx)
        hidden = config.hidden_size
        qkv_rows = config.q_size + 2 * config.kv_size

        def empty(*shape: int, dt: torch.dtype = dtype) -> nn.Parameter:
            return _param(torch.empty(*shape, dtype=dt, device=device))

        self.input_norm = empty(hidden, dt=torch.float32)
        # The projections (PROJECTIONS) are built by load_weights in the model's weight format; dense
        # formats start with uninitialised dense parameters (so a model can also be filled in place).
        def projection(rows: int, cols: int) -> nn.Module:
            if dense_dtype is None:
                return UnloadedLinear()
            return DenseLinear(torch.empty(rows, cols, dtype=dense_dtype, device=device))

        self.qkv_proj: nn.Module = projection(qkv_rows, hidden)
        self.o_proj: nn.Module = projection(hidden, config.q_size)
        self.gate_up_proj: nn.Module = projection(2 * config.intermediate_size, hidden)
        self.down_proj: nn.Module = projection(hidden, config.intermediate_size)
        self.qkv_bias = empty(qkv_rows) if config.attention_bias else None
        # One weight for q and k heads side by side: [num_heads + num_kv_heads, head_dim].
        self.qk_norm = empty(config.num_heads + config.num_kv_heads, config.head_dim, dt=torch.float32) \
            if config.qk_norm else None
        self.post_attention_norm = empty(hidden, dt=torch.float32)
        # find_fused_decode: the one-operator decode layers' weights and the step sizes they serve.
        self._int4: cpu_kernels.FusedLayer | None = None
        self._int4_rows = 0
        self._onednn: cpu_kernels.FusedLayer | None = None
        self._onednn_above = 0

    def forward(self, h: Tensor, delta: Tensor | None, cos: Tensor, sin: Tensor, attn: AttentionContext,
                fused: bool = False, *, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """One decoder layer on the residual stream ``h`` plus the previous layer's MLP output ``delta``
        (None before layer 0): returns the stream after attention and this layer's MLP output, so the
        next residual add is fused with the next norm. ``fused``: Helios's CPU kernels do the residual
        add + RMSNorm, the rotary embedding and the SwiGLU activation (`models/cpu_kernels.py`).
        ``keep``: after attention (every token's K/V written, every token attended), only these rows
        go on; both results have len(keep) rows (none: the MLP is skipped).
        (In an all-decode step the model runs the layers `fused_decode` offers as one operator
        instead: the same operators in the same order.)"""
        num_tokens = h.shape[0]
        qk_heads = self.num_heads + self.num_kv_heads
        h, x = _add_rms_norm(h, delta, self.input_norm, self.eps, fused)
        qkv = self.qkv_proj(x)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, qk_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm is not None and fused:
            qk = cpu_kernels.qk_norm_rope_(qk, self.qk_norm, self.eps, cos, sin)
        else:
            if self.qk_norm is not None:
                qk = _rms_norm(qk, self.qk_norm, self.eps)
            qk = cpu_kernels.rope_(qk, cos, sin) if fused else _apply_rope(qk, cos, sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        out = attn(self.layer_idx, q, k, v)
        if keep is not None:
            num_tokens = keep.shape[0]
            h, out = h.index_select(0, keep), out.index_select(0, keep)
            if num_tokens == 0:
                return h, h
        attended = self.o_proj(out.reshape(num_tokens, self.q_size))
        if self.parallel is not None:  # row parallel: each rank's heads' share of the sum
            attended = self.parallel.all_reduce(attended)
        h, x = _add_rms_norm(h, attended, self.post_attention_norm, self.eps, fused)
        gate_up = self.gate_up_proj(x)
        if fused:
            mlp = self.down_proj(cpu_kernels.silu_mul(gate_up))
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            mlp = self.down_proj(F.silu(gate).mul_(up))
        return h, (mlp if self.parallel is None else self.parallel.all_reduce(mlp))

    def set_projection(self, attr: str, module: nn.Module) -> None:
        if attr not in PROJECTIONS:
            raise KeyError(attr)
        setattr(self, attr, module)
        self._int4 = None  # until finish_loading looks at the new set
        self._onednn = None
        self.generation += 1

    def fused_decode(self, num_tokens: int, attn: AttentionContext) -> tuple[cpu_kernels.FusedLayer,
                                                                              cpu_kernels.DecodeArgs] | None:
        """This layer as `cpu_kernels.decode_layers` runs it, for an all-decode step of ``num_tokens``
        rows whose attention offers `all_decode_args`: its weights (int4 up to ``_int4_rows`` rows,
        oneDNN-packed above ``_onednn_above``) and its decode arguments; None where it does not apply."""
        if self._int4 is not None and num_tokens <= self._int4_rows:
            layer = self._int4
        elif self._onednn is not None and num_tokens > self._onednn_above:
            layer = self._onednn
        else:
            return None
        args = attn.all_decode_args(self.layer_idx)
        return (layer, args) if args is not None else None

    def find_fused_decode(self) -> None:
        """Where the one-operator decode layers apply (no q/k/v bias, no q/k norm):
        ``_int4`` (packed weights and scales in PROJECTIONS order, and the group size) when every
        projection is int4 with one group size, for steps of up to ``_int4_rows`` rows (above those,
        a dense copy answers); ``_onednn`` (the four oneDNN-packed weights) when every projection
        multiplies through one (`quant.pack_onednn`) for steps of more than ``_onednn_above`` rows.
        Called by `finish_loading` and after packing."""
        self._int4 = None
        self._onednn = None
        mods = [getattr(self, attr) for attr in PROJECTIONS]
        if self.qkv_bias is not None or self.qk_norm is not None or self.parallel is not None:
            return  # (tensor parallel: the one-operator layer has no all-reduce)
        int4 = packing.fused_int4_layer(mods, self.input_norm, self.post_attention_norm)
        if int4 is not None:
            self._int4, self._int4_rows = int4
        onednn = packing.fused_onednn_layer(mods, self.input_norm, self.post_attention_norm)
        if onednn is not None:
            self._onednn, self._onednn_above = onednn

    def weight_targets(self) -> dict[str, Tensor]:
        """Hugging Face suffix -> parameter (view) for the norms and biases (not the projections)."""
        q, kv = self.q_size, self.kv_size
        targets: dict[str, Tensor] = {
            "input_layernorm.weight": self.input_norm,
            "post_attention_layernorm.weight": self.post_attention_norm,
        }
        if self.qkv_bias is not None:
            targets["self_attn.q_proj.bias"] = self.qkv_bias[:q]
            targets["self_attn.k_proj.bias"] = self.qkv_bias[q : q + kv]
            targets["self_attn.v_proj.bias"] = self.qkv_bias[q + kv :]
        if self.qk_norm is not None:
            # Loaded into the first q row and first k row; finish_loading() broadcasts them.
            targets["self_attn.q_norm.weight"] = self.qk_norm[0]
            targets["self_attn.k_norm.weight"] = self.qk_norm[self.num_heads]
        return targets

    def finish_loading(self) -> None:
        self.find_fused_decode()
        if self.qk_norm is not None:
            broadcast_qk_norm(self.qk_norm, self.num_heads, self.num_kv_heads)
        self.generation += 1


def build_decode_plan(config: ModelConfig, layers: Sequence[_DecoderLayer]) -> cpu_kernels.KqDecodePlan | None:
    """The layers as one `cpu_kernels.KqDecodePlan` where every projection of every layer is a
    `kquant.KQuantLinear` (`kquant.plan_segments`; a k-quant GGUF under ``keep_blocks``) and no layer
    is a tensor-parallel shard; otherwise None. ``max_rows``: the most rows a step may have for every
    projection to take the kernels the plan calls (at most `kquant.TILE_ROWS`' upper end)."""
    if not layers or not cpu_kernels.available():
        return None
    limits = [TILE_ROWS[1]]
    plan = cpu_kernels.KqDecodePlan(config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps)
    for layer in layers:
        if type(layer) is not _DecoderLayer or layer.parallel is not None:
            return None
        qkv, o, gate_up, down = (plan_segments(getattr(layer, attr), limits) for attr in PROJECTIONS)
        if qkv is None or o is None or gate_up is None or down is None:
            return None
        plan.add_layer(layer.input_norm, layer.post_attention_norm, layer.qkv_bias, layer.qk_norm, qkv, o,
                       mlp=(gate_up, down))
    plan.max_rows = min(limits)
    return plan


_param = param
_add_rms_norm = add_rms_norm
_rms_norm = rms_norm
_apply_rope = apply_rope


# -- weight names and registry entries -------------------------------------------------------------------

# llama.cpp's GGUF tensor names -> the Hugging Face names `load_weights` takes.
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)")


def gguf_to_hf_name(gguf_name: str, layer_names: Mapping[str, str] = GGUF_LAYER_NAMES) -> str:
    """A llama-family GGUF tensor's Hugging Face name (NotImplementedError for names it has none for);
    ``layer_names``: another family's per-layer names (the global ones are shared)."""
    if gguf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[gguf_name]
    match = _GGUF_LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in layer_names:
        raise NotImplementedError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart here")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{layer_names[part]}.{kind}"


def gguf_tensor(config: ArchitectureConfig, gguf_name: str, *, interleaved_rotary: bool) -> GGUFTensor | None:
    """Where a GGUF tensor goes; llama.cpp's ``llama`` files store q/k rows in interleaved rotary
    order (``interleaved_rotary``), which are put back into the rotate-half order `forward` uses."""
    if gguf_name == ROPE_FREQS:
        return None  # read into the config's rope scaling
    name = gguf_to_hf_name(gguf_name)
    if interleaved_rotary:
        assert isinstance(config, ModelConfig)
        if ".self_attn.q_proj." in name:
            return GGUFTensor(name, config.num_heads)
        if ".self_attn.k_proj." in name:
            return GGUFTensor(name, config.num_kv_heads)
    return GGUFTensor(name)


def build(config: ArchitectureConfig, options: BuildOptions) -> LlamaForCausalLM:
    assert isinstance(config, ModelConfig), type(config)
    return LlamaForCausalLM(config, dtype=options.dtype, device=options.device, weights=options.weights,
                            q8_head=options.q8_head, parallel=options.parallel)


def _gguf_config(arch: str) -> partial[ModelConfig]:
    return partial(_config_from_gguf, arch=arch)


def _config_from_gguf(source: GGUFSource, *, arch: str) -> ModelConfig:
    return config_from_gguf(source, arch)


_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                     "qwen3": "Qwen3ForCausalLM"}
# GGUF general.architecture per variant (llama.cpp writes Mistral checkpoints as "llama"); only
# "llama" files interleave the q/k rotary rows.
_GGUF_ARCHITECTURES = {"llama": ("llama",), "mistral": (), "qwen2": ("qwen2",), "qwen3": ("qwen3",)}

ARCHITECTURES = tuple(
    Architecture(
        name=variant,
        hf_model_types=(variant,),
        hf_architectures=(_HF_ARCHITECTURES[variant],),
        gguf_architectures=_GGUF_ARCHITECTURES[variant],
        config_from_hf=ModelConfig.from_hf_config,
        config_from_gguf=_gguf_config(variant) if _GGUF_ARCHITECTURES[variant] else None,
        gguf_tensor=partial(gguf_tensor, interleaved_rotary=variant == "llama") if _GGUF_ARCHITECTURES[variant] else None,
        build=build,
    )
    for variant in LLAMA_FAMILY
)
"""The llama family's registry entries (`helios.models.registry`): one per variant."""
