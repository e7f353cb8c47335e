"""One decoder for the Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm).

The model sees a flat batch: the tokens of several sequences concatenated into ``T`` rows, each with
its absolute position. Attention across the rows of one sequence is the job of an `AttentionBackend`
(the engine's paged backend, or `helios.models.dense_attention.DenseAttention` for one sequence).

Layout choices for CPU speed: q/k/v are one matmul and gate/up another (weights concatenated at load
time); RoPE is applied to q and k in one pass, with cos/sin computed once per forward from the
positions. RMSNorm runs in float32 whatever the weight dtype, and so do the logits (the output
projection keeps a float32 copy for bf16/fp16 weights unless ``lm_head_fp32=False``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from helios.models.config import ModelConfig


class AttentionBackend(Protocol):
    """Causal attention over the flattened batch.

    ``q``: [T, num_heads, head_dim]; ``k``, ``v``: [T, num_kv_heads, head_dim], RoPE already applied,
    possibly non-contiguous views. Returns [T, num_heads, head_dim] in q's dtype. Scores are scaled by
    ``head_dim ** -0.5`` (`LlamaForCausalLM.softmax_scale`); query head ``h`` uses kv head
    ``h // (num_heads // num_kv_heads)``.
    """

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


class LlamaForCausalLM(nn.Module):
    inv_freq: Tensor

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", *, lm_head_fp32: bool = True) -> None:
        """``lm_head_fp32``: with bf16/fp16 weights, keep a float32 copy of the output projection so
        logits are not rounded to the weight dtype. Rounding matters: bf16 logits near 25 are
        multiples of 0.125, which turns the default model's first-token near tie into an exact one
        (and the wrong answer). It costs a float32 vocab x hidden matrix of memory and its bandwidth
        each step; with False, logits are computed in the weight dtype and upcast."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.softmax_scale = config.head_dim ** -0.5
        self.embed_tokens = _param(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device))
        self.layers = nn.ModuleList(
            _DecoderLayer(config, i, dtype, torch.device(device)) for i in range(config.num_layers)
        )
        self.norm = _param(torch.ones(config.hidden_size, dtype=torch.float32, device=device))
        if config.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = _param(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device))
        self.register_buffer("inv_freq", rope_inv_freq(config).to(device), persistent=False)
        self._lm_head_fp32: Tensor | None = None
        self._wants_lm_head_fp32 = lm_head_fp32 and dtype != torch.float32

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionBackend) -> Tensor:
        """Hidden states after the final norm, [T, hidden_size], for flat ``input_ids``/``positions`` [T]."""
        cos, sin = self._rope_tables(positions)
        h = F.embedding(input_ids, self.embed_tokens)
        for layer in self.layers:
            h = layer(h, cos, sin, attn)
        return _rms_norm(h, self.norm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Logits [N, vocab_size] in float32 for hidden states [N, hidden_size]."""
        if self._lm_head_fp32 is not None:
            return F.linear(hidden.float(), self._lm_head_fp32)
        return F.linear(hidden, self.lm_head).float()

    def load_weights(self, tensors: Mapping[str, Tensor]) -> None:
        """Copy Hugging Face-named tensors into the fused parameters (converting dtype).

        Every expected tensor must be present, except ``lm_head.weight`` when the embeddings are tied
        (then an ``lm_head.weight`` is ignored, as transformers does). Unknown names raise.
        """
        cfg = self.config
        loaded: set[str] = set()
        unexpected: list[str] = []
        targets = self._weight_targets()
        with torch.no_grad():
            for name in tensors:
                if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                    continue
                target = targets.get(name)
                if target is None:
                    unexpected.append(name)
                    continue
                tensor = tensors[name]  # read (lazily, for checkpoints) only what is used
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(f"{name}: expected shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
                target.copy_(tensor)
                loaded.add(name)
        if unexpected:
            raise ValueError(f"unexpected weights: {sorted(unexpected)[:8]}{' ...' if len(unexpected) > 8 else ''}")
        missing = sorted(set(targets) - loaded)
        if missing:
            raise ValueError(f"missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        for layer in self._decoder_layers():
            layer.finish_loading()
        if self._wants_lm_head_fp32:
            self._lm_head_fp32 = self.lm_head.detach().float()

    def _weight_targets(self) -> dict[str, Tensor]:
        """Hugging Face name -> the (view of the) parameter it fills."""
        targets: dict[str, Tensor] = {"model.embed_tokens.weight": self.embed_tokens, "model.norm.weight": self.norm}
        if not self.config.tie_word_embeddings:
            targets["lm_head.weight"] = self.lm_head
        for i, layer in enumerate(self._decoder_layers()):
            for suffix, view in layer.weight_targets().items():
                targets[f"model.layers.{i}.{suffix}"] = view
        return targets

    def _decoder_layers(self) -> list[_DecoderLayer]:
        return [cast(_DecoderLayer, layer) for layer in self.layers]

    def _rope_tables(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sign-folded sin, [T, 1, head_dim], so that rope(x) = x*cos + roll(x, d/2)*sin."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos = freqs.cos()
        sin = freqs.sin()
        cos = torch.cat((cos, cos), dim=-1)
        sin = torch.cat((-sin, sin), dim=-1)
        return cos.to(self.dtype).unsqueeze(1), sin.to(self.dtype).unsqueeze(1)


class _DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.eps = config.rms_norm_eps
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.intermediate_size = config.intermediate_size
        hidden = config.hidden_size
        qkv_rows = config.q_size + 2 * config.kv_size

        def empty(*shape: int, dt: torch.dtype = dtype) -> nn.Parameter:
            return _param(torch.empty(*shape, dtype=dt, device=device))

        self.input_norm = empty(hidden, dt=torch.float32)
        self.qkv_proj = empty(qkv_rows, hidden)
        self.qkv_bias = empty(qkv_rows) if config.attention_bias else None
        # One weight for q and k heads side by side: [num_heads + num_kv_heads, head_dim].
        self.qk_norm = empty(config.num_heads + config.num_kv_heads, config.head_dim, dt=torch.float32) \
            if config.qk_norm else None
        self.o_proj = empty(hidden, config.q_size)
        self.post_attention_norm = empty(hidden, dt=torch.float32)
        self.gate_up_proj = empty(2 * config.intermediate_size, hidden)
        self.down_proj = empty(hidden, config.intermediate_size)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, attn: AttentionBackend) -> Tensor:
        num_tokens = h.shape[0]
        qk_heads = self.num_heads + self.num_kv_heads
        x = _rms_norm(h, self.input_norm, self.eps)
        qkv = F.linear(x, self.qkv_proj, self.qkv_bias)
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, qk_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm is not None:
            qk = _rms_norm(qk, self.qk_norm, self.eps)
        qk = _apply_rope(qk, cos, sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        out = attn(self.layer_idx, q, k, v)
        h = h + F.linear(out.reshape(num_tokens, self.q_size), self.o_proj)
        x = _rms_norm(h, self.post_attention_norm, self.eps)
        gate, up = F.linear(x, self.gate_up_proj).split(self.intermediate_size, dim=-1)
        return h + F.linear(F.silu(gate).mul_(up), self.down_proj)

    def weight_targets(self) -> dict[str, Tensor]:
        q, kv, inter = self.q_size, self.kv_size, self.intermediate_size
        targets: dict[str, Tensor] = {
            "input_layernorm.weight": self.input_norm,
            "self_attn.q_proj.weight": self.qkv_proj[:q],
            "self_attn.k_proj.weight": self.qkv_proj[q : q + kv],
            "self_attn.v_proj.weight": self.qkv_proj[q + kv :],
            "self_attn.o_proj.weight": self.o_proj,
            "post_attention_layernorm.weight": self.post_attention_norm,
            "mlp.gate_proj.weight": self.gate_up_proj[:inter],
            "mlp.up_proj.weight": self.gate_up_proj[inter:],
            "mlp.down_proj.weight": self.down_proj,
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
        if self.qk_norm is not None:
            with torch.no_grad():
                self.qk_norm[1 : self.num_heads].copy_(self.qk_norm[0].expand(self.num_heads - 1, -1))
                self.qk_norm[self.num_heads + 1 :].copy_(
                    self.qk_norm[self.num_heads].expand(self.num_kv_heads - 1, -1)
                )


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse RoPE frequencies [head_dim // 2] in float32, with linear or Llama-3 scaling applied."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # Llama 3: long wavelengths are slowed down by `factor`, short ones kept, the band between
    # interpolated smoothly in 1/wavelength.
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(is_medium, blended, scaled)


def _param(tensor: Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim, computed in float32; ``weight`` is float32 and broadcastable."""
    if x.dtype == torch.float32:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype)


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """NeoX (rotate-half) RoPE on [T, heads, head_dim] with tables from `_rope_tables`."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)
