"""A tiny synthetic hybrid decoder for the engine's per-group cache (`engine/kv/coordinator.py`).

It implements `models.interface.CausalLM` with three kinds of layers, listed in the config's
``layers`` (default: full attention, sliding window, recurrent state, sliding window again, so the
sliding group holds two layers that are not adjacent):

- ``"full"``: multi-head attention with grouped K/V heads, through ``ctx(i, q, k, v, scale)``.
- ``"sliding"``: the same, declared as a `SlidingWindowSpec` of ``window`` positions.
- ``"recurrent"``: a per-channel gated linear recurrence h_t = a * h_{t-1} + (1 - a) * u_t with a
  learned decay a = sigmoid(d) and u_t a projection of the layer's input, read from and written to
  ``ctx.recurrent(i).states[0]`` at each span's slot (zeroed where a span starts at position 0).

Every layer adds its output to a residual stream (pre-norm: RMS without weights); token plus
position embeddings go in, the final RMS-normed stream times the embedding matrix gives the
logits. The attention scale is ``scale_factor`` / sqrt(head_dim) (not the default), so a backend
that ignores ``scale`` is caught. Weights are seeded random, float32.

`build_hybrid_model(config)` builds it from a small config dict (`DEFAULT_CONFIG` keys); the tests
keep their own float64 full-sequence reference (`tests/unit/test_hybrid_cache.py`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from helios.models.interface import (
    AttentionContext,
    CacheSpec,
    FullAttentionSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
)

DEFAULT_CONFIG: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 8,
    "window": 5,
    "state_size": 16,
    "max_positions": 512,
    "layers": ("full", "sliding", "recurrent", "sliding"),
    "scale_factor": 0.8,
    "seed": 0,
}
LAYER_KINDS = ("full", "sliding", "recurrent")


class HybridModel(nn.Module):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        cfg = {**DEFAULT_CONFIG, **config}
        self.config = cfg
        self.kinds: tuple[str, ...] = tuple(cfg["layers"])
        if any(k not in LAYER_KINDS for k in self.kinds):
            raise ValueError(f"layer kinds are {LAYER_KINDS}, got {self.kinds}")
        h, nh, nkv, d, c = (cfg["hidden_size"], cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"],
                            cfg["state_size"])
        self.num_heads, self.num_kv_heads, self.head_dim, self.window = nh, nkv, d, cfg["window"]
        self.scale = cfg["scale_factor"] * d ** -0.5
        g = torch.Generator().manual_seed(cfg["seed"])

        def w(*shape: int, std: float) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=g) * std, requires_grad=False)

        self.embed = w(cfg["vocab_size"], h, std=1.0)
        self.pos_embed = w(cfg["max_positions"], h, std=0.5)
        self.wq = nn.ParameterList()
        self.wk = nn.ParameterList()
        self.wv = nn.ParameterList()
        self.wo = nn.ParameterList()
        self.w_in = nn.ParameterList()
        self.w_out = nn.ParameterList()
        self.decay = nn.ParameterList()
        self.slot: list[int] = []  # layer -> index into its kind's parameter lists
        for kind in self.kinds:
            if kind == "recurrent":
                self.slot.append(len(self.w_in))
                self.w_in.append(w(h, c, std=h ** -0.5))
                self.w_out.append(w(c, h, std=c ** -0.5))
                self.decay.append(w(c, std=1.5))
            else:
                self.slot.append(len(self.wq))
                self.wq.append(w(h, nh * d, std=2 * h ** -0.5))
                self.wk.append(w(h, nkv * d, std=2 * h ** -0.5))
                self.wv.append(w(h, nkv * d, std=h ** -0.5))
                self.wo.append(w(nh * d, h, std=(nh * d) ** -0.5))

    # -- CausalLM ------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def cache_specs(self) -> tuple[CacheSpec, ...]:
        out: list[CacheSpec] = []
        for kind in self.kinds:
            if kind == "full":
                out.append(FullAttentionSpec(self.num_kv_heads, self.head_dim))
            elif kind == "sliding":
                out.append(SlidingWindowSpec(self.num_kv_heads, self.head_dim, self.window))
            else:
                out.append(RecurrentStateSpec(((int(self.config["state_size"]),),)))
        return tuple(out)

    def decode_weight_bytes(self) -> int:
        return 0

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: AttentionContext, *,
                embeds: tuple[Tensor, Tensor] | None = None, keep: Tensor | None = None) -> Tensor:
        x = self.embed[input_ids] + self.pos_embed[positions]
        if embeds is not None:
            x = x.index_copy(0, embeds[0], embeds[1].to(x.dtype))
        t = x.shape[0]
        for i, kind in enumerate(self.kinds):
            h = _rms(x)
            j = self.slot[i]
            if kind == "recurrent":
                u = h @ self.w_in[j]
                a = torch.sigmoid(self.decay[j])
                batch = ctx.recurrent(i)
                state = batch.states[0]
                y = torch.empty_like(u)
                for start, length, slot, first in batch.spans:
                    s = torch.zeros_like(u[0]) if first == 0 else state[slot].to(u.dtype)
                    for r in range(start, start + length):
                        s = a * s + (1 - a) * u[r]
                        y[r] = s
                    state[slot] = s.to(state.dtype)
                x = x + y @ self.w_out[j]
            else:
                q = (h @ self.wq[j]).view(t, self.num_heads, self.head_dim)
                k = (h @ self.wk[j]).view(t, self.num_kv_heads, self.head_dim)
                v = (h @ self.wv[j]).view(t, self.num_kv_heads, self.head_dim)
                o = ctx(i, q, k, v, self.scale)
                x = x + o.reshape(t, -1) @ self.wo[j]
        x = _rms(x)
        return x if keep is None else x.index_select(0, keep)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return (hidden @ self.embed.T).float()


def _rms(x: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def build_hybrid_model(config: Mapping[str, Any] | None = None) -> HybridModel:
    """The model of ``config`` (missing keys: `DEFAULT_CONFIG`'s), in eval mode."""
    return HybridModel(config or {}).eval()
