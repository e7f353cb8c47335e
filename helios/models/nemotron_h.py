"""Nemotron-H (transformers' ``nemotron_h`` / ``NemotronHForCausalLM``): a hybrid of Mamba2 layers,
attention layers, MLP layers and mixture-of-experts layers, in the order of the config's
``layers_block_type`` (older configs: ``hybrid_override_pattern``, ``M`` Mamba2, ``*`` attention,
``-`` MLP, ``E`` MoE). Every block is pre-norm (RMSNorm, weight multiply in float32) around one mixer
plus the residual; embeddings in, ``norm_f`` then ``lm_head`` out.

- Mamba2 (``linear_attention``): ``in_proj`` gives the gate z, the conv input xBC and dt per head;
  xBC goes through a depthwise causal conv1d (``conv_kernel`` taps, bias) and SiLU, then splits into
  x [heads, head_dim], B and C [n_groups, state] (head h uses group h // (heads // n_groups)); dt is
  ``softplus(dt + dt_bias)`` clamped below at ``time_step_min`` (transformers' chunked path's
  ``time_step_limit``; its single-step path skips the clamp, which matters only where
  ``softplus`` falls under it); with A = -exp(A_log) the state update per token is
  ``h = exp(dt A) h + dt x B^T``, the output ``y = h C + D x``; then the gated RMSNorm (``y *
  silu(z)`` normed per group of ``intermediate / n_groups`` channels, times its weight) and
  ``out_proj``. Prefill runs the chunked SSD form (`ssd_scan`: within chunks of ``chunk_size`` the
  quadratic form, across chunks the state recurrence), from the slot's state where a chunk does not
  start the sequence, so an engine chunk boundary gives the state one pass would; a decode token is
  one state update (`ssd_step`). Its `RecurrentStateSpec` holds the conv window (the last
  ``conv_kernel - 1`` xBC rows, [conv_dim, conv_kernel - 1]) and the SSM state [heads, head_dim,
  state], both float32.
- Attention (``full_attention``): grouped-query attention without positional embedding (no RoPE),
  no biases, scale ``head_dim ** -0.5``.
- MLP (``mlp``): ``down(relu(up x) ** 2)`` (``mlp_hidden_act`` relu2), no gate.
- MoE (``moe``): the sigmoid router of `helios.models.moe.route` (correction bias, groups,
  renormalised, scaled), non-gated relu2 experts (optionally through ``moe_latent_size``
  projections), plus one shared relu2 MLP.

GGUF: llama.cpp's ``nemotron_h`` (Mamba2, attention and MLP blocks) and ``nemotron_h_moe`` (Mamba2,
attention and MoE blocks; llama.cpp has no file mixing MLP and MoE blocks) files, as its
``convert_hf_to_gguf.py`` writes them (`config_from_gguf`, `gguf_tensor`). The layer kinds come
from the per-layer ``attention.head_count_kv`` and ``feed_forward_length`` (both 0: Mamba2; a kv
count: attention; a feed-forward length: MLP, or MoE where the file has experts); the Mamba2
shape from the ``ssm.*`` keys (``time_step_rank`` is the head count, ``inner_size`` heads x
head_dim); the router from the ``expert_*`` keys (sigmoid; ``expert_group_count`` and
``expert_group_used_count`` are n_group / topk_group). The tensors go to transformers' names and
`NemotronHForCausalLM.load_weights` takes llama.cpp's layouts: ``ssm_a`` ([heads, 1], -exp(A_log))
back to A_log, ``ssm_d`` and the grouped ``ssm_norm`` ([n_groups, -1]) flattened, the squeezed
conv1d [C, K], ``ssm_dt.bias`` as dt_bias, the stacked ``ffn_{up,down}_exps`` as transformers'
stacked experts; the q/k rows, which the converter permutes as for rotary heads (no effect here:
no RoPE, q and k alike), are put back in order. Not in the files: ``chunk_size`` (an evaluation
detail: 128, transformers' default), ``time_step_min`` (0.001, the default) and the trained
context (``context_length`` is the converter's 2**20). The MTP block (the last
``nextn_predict_layers`` of ``block_count``) is skipped. The vocabulary is ``token_embd``'s rows (llama.cpp's converter pads
it to a multiple of 8 or 16).

Dense weights only (no quantized weight formats; a quantized GGUF's tensors are dequantized on
load, untested: the tests convert F32 files). For a layout with recurrent layers
the engine reuses prefixes through state checkpoints and speculates with a state rollback
(`helios.engine.scheduler`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
from helios.models.interface import AttentionContext, CacheSpec, FullAttentionSpec, RecurrentStateSpec
from helios.models.moe import RouterSpec, route
from helios.models.quant import BuildSource, dense_of

__all__ = ["ARCHITECTURES", "NemotronHConfig", "NemotronHForCausalLM", "config_from_gguf", "config_from_hf",
           "gguf_tensor", "ssd_scan", "ssd_step"]

_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}
KINDS = ("linear_attention", "full_attention", "mlp", "moe")


@attrs.frozen(kw_only=True)
class NemotronHConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    time_step_min: float
    use_conv_bias: bool
    use_bias: bool
    mlp_bias: bool
    eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    router: RouterSpec | None
    moe_intermediate_size: int
    shared_intermediate_size: int
    moe_latent_size: int | None

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.mamba_intermediate + 2 * self.n_groups * self.ssm_state_size

    def projection_params(self) -> int:
        h, total = self.hidden_size, 0
        for kind in self.layer_types:
            if kind == "linear_attention":
                total += h * (self.mamba_intermediate + self.conv_dim + self.mamba_num_heads)
                total += self.mamba_intermediate * h
            elif kind == "full_attention":
                total += h * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
            elif kind == "mlp":
                total += 2 * h * self.intermediate_size
            elif self.router is not None:
                inner = self.moe_latent_size or h
                total += self.router.num_experts * 2 * inner * self.moe_intermediate_size
                total += 2 * h * self.shared_intermediate_size
        return total


def layer_types_of(config: Mapping[str, Any]) -> tuple[str, ...]:
    listed = config.get("layers_block_type") or config.get("layer_types")
    if listed:
        kinds = tuple(_LEGACY.get(str(k), str(k)) for k in listed)
    elif config.get("hybrid_override_pattern"):
        kinds = tuple(_PATTERN[c] for c in str(config["hybrid_override_pattern"]))
    else:
        raise ValueError("nemotron_h config names no layer types (layers_block_type / hybrid_override_pattern)")
    bad = sorted(set(kinds) - set(KINDS))
    if bad:
        raise ValueError(f"unknown nemotron_h layer types {bad}")
    return kinds


def config_from_hf(config: Mapping[str, Any]) -> NemotronHConfig:
    """A Nemotron-H config from its ``config.json`` (5.x names, and the older ``mamba_*`` ones)."""
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if config.get(key, want) != want:
            raise NotImplementedError(f"nemotron_h with {key}={config.get(key)!r}")
    kinds = layer_types_of(config)
    hidden = int(config["hidden_size"])
    num_heads = int(config.get("num_attention_heads", 32))
    router = None
    if "moe" in kinds:
        router = RouterSpec(num_experts=int(config.get("n_routed_experts", 8)),
                            top_k=int(config.get("num_experts_per_tok", 2)), scoring="sigmoid",
                            norm_topk_prob=bool(config.get("norm_topk_prob", True)),
                            n_group=int(config.get("n_group", 1)), topk_group=int(config.get("topk_group", 1)),
                            routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)))
    latent = config.get("moe_latent_size")

    def get(name: str, legacy: str, default: Any) -> Any:
        return config.get(name, config.get(legacy, default))

    return NemotronHConfig(
        arch="nemotron_h",
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        layer_types=kinds,
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden // num_heads),
        intermediate_size=int(config.get("intermediate_size", 21504)),
        mamba_num_heads=int(config.get("mamba_num_heads", 128)),
        mamba_head_dim=int(config.get("mamba_head_dim", 64)),
        ssm_state_size=int(config.get("ssm_state_size", 128)),
        n_groups=int(get("n_groups", "mamba_n_groups", 8)),
        conv_kernel=int(get("conv_kernel", "mamba_d_conv", 4)),
        chunk_size=int(get("chunk_size", "mamba_chunk_size", 128)),
        time_step_min=float(get("time_step_min", "mamba_dt_min", 0.001)),
        use_conv_bias=bool(get("use_conv_bias", "mamba_conv_bias", True)),
        use_bias=bool(config.get("use_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)),
        eps=float(config.get("layer_norm_epsilon", 1e-5)),
        max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        router=router,
        moe_intermediate_size=int(config.get("moe_intermediate_size", 7688)),
        shared_intermediate_size=int(config.get("moe_shared_expert_intermediate_size", 7688)),
        moe_latent_size=None if latent is None else int(latent),
    )


# -- the Mamba2 scan ---------------------------------------------------------------------------------


def _segsum(a: Tensor) -> Tensor:
    """[..., L] -> [..., L, L]: entry (i, j) = a[j+1] + ... + a[i] for j <= i, -inf above."""
    n = a.shape[-1]
    x = a[..., None].expand(*a.shape, n)
    x = x.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device), -1), 0)
    out = torch.cumsum(x, dim=-2)
    return out.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device)), float("-inf"))


def ssd_scan(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, state: Tensor | None,
             chunk: int) -> tuple[Tensor, Tensor]:
    """Mamba2's chunked SSD scan of one sequence, float32: ``x`` [T, H, P], ``dt`` [T, H] (already
    softplus'd and clamped), ``a`` [H] (negative), ``b``/``c`` [T, H, N] (groups expanded),
    ``state`` [H, P, N] or None (zeros). Returns (y [T, H, P] without the D skip, final state)."""
    t, h, p = x.shape
    n = b.shape[-1]
    pad = (-t) % chunk
    xd = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad)).view(-1, chunk, h, p)
    ad = F.pad(dt * a, (0, 0, 0, pad)).view(-1, chunk, h).permute(2, 0, 1)  # [H, C, L]
    bb = F.pad(b, (0, 0, 0, 0, 0, pad)).view(-1, chunk, h, n)
    cc = F.pad(c, (0, 0, 0, 0, 0, pad)).view(-1, chunk, h, n)
    cum = torch.cumsum(ad, dim=-1)
    decay_in = torch.exp(_segsum(ad))  # [H, C, L, S]
    scores = torch.einsum("clhn,cshn->clsh", cc, bb) * decay_in.permute(1, 2, 3, 0)
    y = torch.einsum("clsh,cshp->clhp", scores, xd)
    to_end = torch.exp(cum[:, :, -1:] - cum)  # [H, C, L]
    states = torch.einsum("clhn,clhp->chpn", bb * to_end.permute(1, 2, 0)[..., None], xd)
    start = torch.zeros_like(states[:1]) if state is None else state[None].to(states.dtype)
    states = torch.cat([start, states], dim=0)  # [C + 1, H, P, N]
    across = torch.exp(_segsum(F.pad(cum[:, :, -1], (1, 0))))  # [H, C + 1, C + 1]
    states = torch.einsum("hzc,chpn->zhpn", across, states)
    starts, final = states[:-1], states[-1]
    y = y + torch.einsum("clhn,chpn->clhp", cc, starts) * torch.exp(cum).permute(1, 2, 0)[..., None]
    return y.reshape(-1, h, p)[:t], final


def ssd_step(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One token per row: ``x`` [R, H, P], ``dt`` [R, H], ``b``/``c`` [R, H, N], ``state`` [R, H, P,
    N], float32. Returns (y [R, H, P] without the D skip, new state)."""
    new = state * torch.exp(dt * a)[..., None, None] + (dt[..., None] * x)[..., None] * b[:, :, None, :]
    return torch.einsum("rhpn,rhn->rhp", new, c), new


# -- the model ---------------------------------------------------------------------------------------


def _relu2(x: Tensor) -> Tensor:
    return torch.relu(x).square()


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return (weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def _zeros(*shape: int, dtype: torch.dtype, device: str) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=dtype, device=device), requires_grad=False)


def _optional(shape: int, on: bool, dtype: torch.dtype, device: str) -> nn.Parameter | None:
    return _zeros(shape, dtype=dtype, device=device) if on else None


class Mamba2Mixer(nn.Module):
    """One Mamba2 block's mixer (module docstring); state through ``ctx.recurrent``."""

    def __init__(self, cfg: NemotronHConfig, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.cfg = cfg
        inner, proj = cfg.mamba_intermediate, cfg.mamba_intermediate + cfg.conv_dim + cfg.mamba_num_heads
        self.in_proj = _zeros(proj, cfg.hidden_size, dtype=dtype, device=device)
        self.in_proj_bias = _optional(proj, cfg.use_bias, dtype, device)
        self.conv_weight = _zeros(cfg.conv_dim, cfg.conv_kernel, dtype=dtype, device=device)
        self.conv_bias = _optional(cfg.conv_dim, cfg.use_conv_bias, dtype, device)
        self.dt_bias = _zeros(cfg.mamba_num_heads, dtype=torch.float32, device=device)
        self.A_log = _zeros(cfg.mamba_num_heads, dtype=torch.float32, device=device)
        self.D = _zeros(cfg.mamba_num_heads, dtype=torch.float32, device=device)
        self.norm = _zeros(inner, dtype=dtype, device=device)
        self.out_proj = _zeros(cfg.hidden_size, inner, dtype=dtype, device=device)
        self.out_proj_bias = _optional(cfg.hidden_size, cfg.use_bias, dtype, device)

    def forward(self, x: Tensor, layer: int, ctx: AttentionContext) -> Tensor:
        cfg = self.cfg
        inner, heads, hd, g, n = (cfg.mamba_intermediate, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups,
                                  cfg.ssm_state_size)
        z, xbc, dt = F.linear(x, self.in_proj, self.in_proj_bias).split([inner, cfg.conv_dim, heads], dim=-1)
        batch = ctx.recurrent(layer)
        conv_states, ssm_states = batch.states
        keep = cfg.conv_kernel - 1
        weight = self.conv_weight.float()[:, None, :]
        bias = None if self.conv_bias is None else self.conv_bias.float()
        mixed = torch.empty(x.shape[0], cfg.conv_dim, dtype=torch.float32, device=x.device)
        for start, length, slot, first in batch.spans:
            rows = xbc[start : start + length].float().T  # [conv_dim, L]
            prev = (torch.zeros(cfg.conv_dim, keep, dtype=torch.float32, device=x.device) if first == 0
                    else conv_states[slot].float())
            window = torch.cat([prev, rows], dim=1)
            conv_states[slot] = window[:, window.shape[1] - keep :].to(conv_states.dtype)
            mixed[start : start + length] = F.conv1d(window[None], weight, bias, groups=cfg.conv_dim)[0].T
        mixed = F.silu(mixed)
        xs, b, c = mixed.split([inner, g * n, g * n], dim=-1)
        t = x.shape[0]
        xs = xs.view(t, heads, hd)
        b = b.view(t, g, n).repeat_interleave(heads // g, dim=1)
        c = c.view(t, g, n).repeat_interleave(heads // g, dim=1)
        dt = F.softplus(dt.float() + self.dt_bias).clamp(min=cfg.time_step_min)
        a = -torch.exp(self.A_log.float())
        y = torch.empty_like(xs)
        steps = [(start, slot) for start, length, slot, first in batch.spans if length == 1 and first > 0]
        if steps:  # decode tokens: one state update for all of them
            idx = torch.tensor([s for s, _ in steps], device=x.device)
            slots = torch.tensor([s for _, s in steps], device=x.device)
            out, new = ssd_step(xs[idx], dt[idx], a, b[idx], c[idx], ssm_states[slots].float())
            ssm_states[slots] = new.to(ssm_states.dtype)
            y[idx] = out
        for start, length, slot, first in batch.spans:
            if length == 1 and first > 0:
                continue
            span = slice(start, start + length)
            out, final = ssd_scan(xs[span], dt[span], a, b[span], c[span],
                                  None if first == 0 else ssm_states[slot].float(), cfg.chunk_size)
            ssm_states[slot] = final.to(ssm_states.dtype)
            y[span] = out
        y = (y + self.D[:, None] * xs).reshape(t, inner) * F.silu(z.float())
        grouped = y.view(t, g, inner // g)
        y = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + cfg.eps)).view(t, inner)
        y = self.norm * y.to(x.dtype)
        return F.linear(y.to(x.dtype), self.out_proj, self.out_proj_bias)


class Attention(nn.Module):
    """Grouped-query attention without positional embedding."""

    def __init__(self, cfg: NemotronHConfig, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.cfg = cfg
        h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = _zeros(q, h, dtype=dtype, device=device)
        self.k_proj = _zeros(kv, h, dtype=dtype, device=device)
        self.v_proj = _zeros(kv, h, dtype=dtype, device=device)
        self.o_proj = _zeros(h, q, dtype=dtype, device=device)

    def forward(self, x: Tensor, layer: int, ctx: AttentionContext) -> Tensor:
        cfg, t = self.cfg, x.shape[0]
        q = F.linear(x, self.q_proj).view(t, cfg.num_heads, cfg.head_dim)
        k = F.linear(x, self.k_proj).view(t, cfg.num_kv_heads, cfg.head_dim)
        v = F.linear(x, self.v_proj).view(t, cfg.num_kv_heads, cfg.head_dim)
        return F.linear(ctx(layer, q, k, v, cfg.head_dim ** -0.5).reshape(t, -1), self.o_proj)


class MLP(nn.Module):
    """``down(relu(up x) ** 2)``."""

    def __init__(self, hidden: int, inner: int, bias: bool, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.up_proj = _zeros(inner, hidden, dtype=dtype, device=device)
        self.up_bias = _optional(inner, bias, dtype, device)
        self.down_proj = _zeros(hidden, inner, dtype=dtype, device=device)
        self.down_bias = _optional(hidden, bias, dtype, device)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(_relu2(F.linear(x, self.up_proj, self.up_bias)), self.down_proj, self.down_bias)


class MoE(nn.Module):
    """Sigmoid-routed non-gated relu2 experts plus a shared MLP."""

    def __init__(self, cfg: NemotronHConfig, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        assert cfg.router is not None
        self.spec = cfg.router
        h, e, inner = cfg.hidden_size, cfg.router.num_experts, cfg.moe_latent_size or cfg.hidden_size
        self.gate = _zeros(e, h, dtype=torch.float32, device=device)
        self.correction_bias = _zeros(e, dtype=torch.float32, device=device)
        self.experts_up = _zeros(e, cfg.moe_intermediate_size, inner, dtype=dtype, device=device)
        self.experts_down = _zeros(e, inner, cfg.moe_intermediate_size, dtype=dtype, device=device)
        self.shared = MLP(h, cfg.shared_intermediate_size, cfg.mlp_bias, dtype, device)
        latent = cfg.moe_latent_size is not None
        self.fc1_latent = _zeros(inner, h, dtype=dtype, device=device) if latent else None
        self.fc2_latent = _zeros(h, inner, dtype=dtype, device=device) if latent else None

    def forward(self, x: Tensor) -> Tensor:
        weights, ids = route(F.linear(x.float(), self.gate), self.spec, self.correction_bias)
        inp = x if self.fc1_latent is None else F.linear(x, self.fc1_latent)
        mixed = torch.zeros(inp.shape, dtype=weights.dtype, device=x.device)
        for expert in torch.unique(ids).tolist():
            token, slot = torch.where(ids == expert)
            rows = F.linear(_relu2(F.linear(inp[token], self.experts_up[expert])), self.experts_down[expert])
            mixed.index_add_(0, token, (rows * weights[token, slot, None]).to(mixed.dtype))
        out = mixed.to(x.dtype)
        if self.fc2_latent is not None:
            out = F.linear(out, self.fc2_latent)
        return out + self.shared(x)


class Block(nn.Module):
    def __init__(self, cfg: NemotronHConfig, kind: str, dtype: torch.dtype, device: str) -> None:
        super().__init__()
        self.kind = kind
        self.norm = _zeros(cfg.hidden_size, dtype=dtype, device=device)
        self.mixer: nn.Module
        if kind == "linear_attention":
            self.mixer = Mamba2Mixer(cfg, dtype, device)
        elif kind == "full_attention":
            self.mixer = Attention(cfg, dtype, device)
        elif kind == "mlp":
            self.mixer = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, dtype, device)
        else:
            self.mixer = MoE(cfg, dtype, device)


class NemotronHForCausalLM(nn.Module):
    """The Nemotron-H decoder (module docstring). Dense weights in ``dtype``; the Mamba2 A_log, D,
    dt_bias and the router in float32."""

    def __init__(self, config: NemotronHConfig, *, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        super().__init__()
        self.config = config
        self._dtype = dtype
        h = config.hidden_size
        self.embeddings = _zeros(config.vocab_size, h, dtype=dtype, device=device)
        self.layers = nn.ModuleList([Block(config, kind, dtype, device) for kind in config.layer_types])
        self.norm_f = _zeros(h, dtype=dtype, device=device)
        self.lm_head = _zeros(config.vocab_size, h, dtype=dtype, device=device)

    # -- CausalLM ------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def cache_specs(self) -> tuple[CacheSpec, ...]:
        """One spec per cache layer: the Mamba2 and attention blocks, in order (MLP and MoE blocks
        keep nothing and take no cache index)."""
        cfg = self.config
        out: list[CacheSpec] = []
        for kind in cfg.layer_types:
            if kind == "full_attention":
                out.append(FullAttentionSpec(cfg.num_kv_heads, cfg.head_dim))
            elif kind == "linear_attention":
                out.append(RecurrentStateSpec(((cfg.conv_dim, cfg.conv_kernel - 1),
                                               (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size)),
                                              torch.float32))
        return tuple(out)

    def decode_weight_bytes(self) -> int:
        return 0

    def forward(self, input_ids: Tensor, positions: Tensor, ctx: AttentionContext, *,
                embeds: tuple[Tensor, Tensor] | None = None, keep: Tensor | None = None) -> Tensor:
        x = self.embeddings[input_ids]
        if embeds is not None:
            x = x.index_copy(0, embeds[0], embeds[1].to(x.dtype))
        cache_layer = 0
        for block in self.layers:
            assert isinstance(block, Block)
            hn = _rms(x, block.norm, self.config.eps)
            mixer = block.mixer
            if isinstance(mixer, Mamba2Mixer | Attention):
                out = mixer(hn, cache_layer, ctx)
                cache_layer += 1
            else:
                out = mixer(hn)
            x = x + out
        x = _rms(x, self.norm_f, self.config.eps)
        return x if keep is None else x.index_select(0, keep)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return F.linear(hidden, self.lm_head).float()

    # -- LoadableCausalLM ----------------------------------------------------------------------------
    def load_weights(self, tensors: Mapping[str, BuildSource]) -> None:
        """From transformers' names (``model.`` or ``backbone.`` prefixes; experts stacked or one
        by one), and llama.cpp's layouts of the Mamba2 tensors (`gguf_tensor`: ``mixer.A`` =
        -exp(A_log) [heads, 1], D [heads, 1], the norm [n_groups, -1])."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        experts: dict[tuple[str, int], Tensor] = {}
        for raw, source in tensors.items():
            name = raw.removeprefix("model.").removeprefix("backbone.")
            if name.startswith("mtp."):
                continue
            value = dense_of(source)
            if name.endswith(".mixer.A"):  # a GGUF's -exp(A_log), [heads, 1]
                name, value = f"{name}_log", torch.log(-value.float().reshape(-1))
            target = _our_name(name)
            if target is None:
                parts = name.split(".")  # layers.i.mixer.experts.e.{up,down}_proj.weight
                if len(parts) == 7 and parts[3] == "experts" and parts[6] == "weight":
                    key = f"layers.{parts[1]}.mixer.experts_{parts[5].removesuffix('_proj')}"
                    experts[(key, int(parts[4]))] = value
                    continue
                raise ValueError(f"unexpected nemotron_h weight {raw!r}")
            if target not in params:
                raise ValueError(f"unexpected nemotron_h weight {raw!r}")
            if target.endswith("conv_weight"):
                value = value.reshape(value.shape[0], -1)
            elif target.endswith((".D", ".A_log", "dt_bias", "mixer.norm")):  # a GGUF's [heads, 1], [groups, -1]
                value = value.reshape(-1)
            self._fill(params[target], value, raw)
            filled.add(target)
        for key in sorted({k for k, _ in experts}):
            stack = torch.stack([experts[(key, e)] for e in range(params[key].shape[0])])
            self._fill(params[key], stack, key)
            filled.add(key)
        if "lm_head" not in filled and self.config.tie_word_embeddings and "embeddings" in filled:
            params["lm_head"].data.copy_(params["embeddings"])
            filled.add("lm_head")
        missing = sorted(set(params) - filled)
        if missing:
            raise ValueError(f"nemotron_h checkpoint lacks {missing[:4]}")

    @staticmethod
    def _fill(param: nn.Parameter, value: Tensor, name: str) -> None:
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{name}: shape {tuple(value.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(value.to(param.dtype))

    def packed_state(self) -> tuple[dict[str, Tensor], dict[str, str]]:
        return {k: v.detach() for k, v in self.state_dict().items()}, {}

    def load_packed_state(self, state: Mapping[str, Tensor], kinds: Mapping[str, str]) -> None:
        self.load_state_dict(dict(state), strict=True)

    def pack_cpu_weights(self) -> int:
        return 0

    @property
    def head_format(self) -> str:
        return f"dense {str(self._dtype).removeprefix('torch.')}"

    @property
    def head_bf16_rows(self) -> int | None:
        return None


_RENAMES = {
    "embeddings.weight": "embeddings", "embedding.weight": "embeddings", "norm_f.weight": "norm_f",
    "lm_head.weight": "lm_head",
}
_MIXER_RENAMES = {
    "in_proj.weight": "in_proj", "in_proj.bias": "in_proj_bias", "conv1d.weight": "conv_weight",
    "conv1d.bias": "conv_bias", "dt_bias": "dt_bias", "A_log": "A_log", "D": "D", "norm.weight": "norm",
    "out_proj.weight": "out_proj", "out_proj.bias": "out_proj_bias",
    "q_proj.weight": "q_proj", "k_proj.weight": "k_proj", "v_proj.weight": "v_proj", "o_proj.weight": "o_proj",
    "up_proj.weight": "up_proj", "up_proj.bias": "up_bias", "down_proj.weight": "down_proj",
    "down_proj.bias": "down_bias",
    "gate.weight": "gate", "gate.e_score_correction_bias": "correction_bias",
    "experts.up_proj": "experts_up", "experts.down_proj": "experts_down",
    "shared_experts.up_proj.weight": "shared.up_proj", "shared_experts.up_proj.bias": "shared.up_bias",
    "shared_experts.down_proj.weight": "shared.down_proj", "shared_experts.down_proj.bias": "shared.down_bias",
    "fc1_latent_proj.weight": "fc1_latent", "fc2_latent_proj.weight": "fc2_latent",
}


def _our_name(name: str) -> str | None:
    if name in _RENAMES:
        return _RENAMES[name]
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[0] == "layers" and parts[2:] == ["norm", "weight"]:
        return f"layers.{parts[1]}.norm"
    if len(parts) == 4 and parts[0] == "layers" and parts[2] == "mixer" and parts[3] in _MIXER_RENAMES:
        return f"layers.{parts[1]}.mixer.{_MIXER_RENAMES[parts[3]]}"
    return None


# -- GGUF ---------------------------------------------------------------------------------------------


def _per_layer(value: Any, layers: int) -> list[int]:
    if isinstance(value, list):
        if len(value) < layers:
            raise ValueError(f"nemotron_h GGUF: {len(value)} per-layer values for {layers} layers")
        return [int(v) for v in value[:layers]]
    return [int(value)] * layers


def _decimal(value: Any) -> float:
    """A float32 metadata value as the decimal the config wrote (7 significant digits: 1e-05, not
    9.99999975e-06; the same float32)."""
    return float(f"{float(value):.7g}")


def config_from_gguf(source: GGUFSource) -> NemotronHConfig:
    """A Nemotron-H config from a llama.cpp ``nemotron_h`` / ``nemotron_h_moe`` file (module docstring)."""
    key = gguf_key(source)
    shapes = source.tensor_shapes
    layers = int(key("block_count")) - int(key("nextn_predict_layers", 0))
    kv = _per_layer(key("attention.head_count_kv"), layers)
    ff = _per_layer(key("feed_forward_length"), layers)
    experts = int(key("expert_count", 0))
    kinds = tuple("linear_attention" if k == 0 and f == 0 else "full_attention" if f == 0
                  else "moe" if experts else "mlp" for k, f in zip(kv, ff, strict=True))
    kv_counts = {k for k in kv if k}
    if len(kv_counts) > 1:
        raise NotImplementedError(f"nemotron_h GGUF with per-layer kv head counts {sorted(kv_counts)}")
    num_heads = max(_per_layer(key("attention.head_count"), layers))
    mamba_heads = int(key("ssm.time_step_rank"))
    inner = int(key("ssm.inner_size"))
    if inner % mamba_heads:
        raise ValueError(f"nemotron_h GGUF: ssm.inner_size {inner} is not a multiple of {mamba_heads} heads")
    hidden = int(key("embedding_length"))
    router, moe_ff, shared_ff, latent = None, 0, 0, None
    if "moe" in kinds:
        n_group = int(key("expert_group_count", 1))
        if n_group > 1 and key("expert_group_used_count", 0) == 0:
            raise NotImplementedError(f"nemotron_h GGUF with {n_group} expert groups names no expert_group_used_count")
        router = RouterSpec(num_experts=experts, top_k=int(key("expert_used_count")), scoring="sigmoid",
                            norm_topk_prob=bool(key("expert_weights_norm", False)), n_group=n_group,
                            topk_group=int(key("expert_group_used_count", 1)),
                            routed_scaling_factor=_decimal(key("expert_weights_scale", 1.0)))
        sizes = {f for f in _per_layer(key("expert_feed_forward_length", max(ff)), layers) if f}
        if len(sizes) != 1:  # NVIDIA's Puzzle files: one expert size per layer
            raise NotImplementedError(f"nemotron_h GGUF with per-layer expert sizes {sorted(sizes)}")
        moe_ff = sizes.pop()
        shared_ff = int(key("expert_shared_feed_forward_length"))
        latent_size = key("moe_latent_size", 0)
        latent = int(latent_size) or None
    mlp_ff = {f for f, kind in zip(ff, kinds, strict=True) if kind == "mlp"}
    if len(mlp_ff) > 1:
        raise NotImplementedError(f"nemotron_h GGUF with per-layer MLP sizes {sorted(mlp_ff)}")
    first = {kind: kinds.index(kind) for kind in KINDS if kind in kinds}
    mamba = first.get("linear_attention")
    mlp_layer = first.get("mlp", first.get("moe"))
    eps = key("attention.layer_norm_rms_epsilon", 0.0) or key("attention.layer_norm_epsilon", 1e-5)
    return NemotronHConfig(
        arch="nemotron_h",
        vocab_size=int(shapes["token_embd.weight"][0]),
        hidden_size=hidden,
        layer_types=kinds,
        num_heads=num_heads,
        num_kv_heads=kv_counts.pop() if kv_counts else num_heads,
        head_dim=int(key("attention.key_length", hidden // max(num_heads, 1))),
        intermediate_size=mlp_ff.pop() if mlp_ff else 0,
        mamba_num_heads=mamba_heads,
        mamba_head_dim=inner // mamba_heads,
        ssm_state_size=int(key("ssm.state_size")),
        n_groups=int(key("ssm.group_count", 1)),
        conv_kernel=int(key("ssm.conv_kernel")),
        chunk_size=128,
        time_step_min=0.001,
        use_conv_bias=mamba is not None and f"blk.{mamba}.ssm_conv1d.bias" in shapes,
        use_bias=mamba is not None and f"blk.{mamba}.ssm_in.bias" in shapes,
        mlp_bias=mlp_layer is not None and (f"blk.{mlp_layer}.ffn_up.bias" in shapes
                                            or f"blk.{mlp_layer}.ffn_up_shexp.bias" in shapes),
        eps=_decimal(eps),
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in shapes,
        router=router,
        moe_intermediate_size=moe_ff,
        shared_intermediate_size=shared_ff,
        moe_latent_size=latent,
    )


_GGUF_GLOBAL = {"token_embd.weight": "model.embeddings.weight", "output_norm.weight": "model.norm_f.weight",
                "output.weight": "lm_head.weight"}
_GGUF_LAYER = {
    "attn_norm.weight": "norm.weight",
    "ssm_in.weight": "mixer.in_proj.weight", "ssm_in.bias": "mixer.in_proj.bias",
    "ssm_conv1d.weight": "mixer.conv1d.weight", "ssm_conv1d.bias": "mixer.conv1d.bias",
    "ssm_dt.bias": "mixer.dt_bias", "ssm_a": "mixer.A", "ssm_d": "mixer.D", "ssm_norm.weight": "mixer.norm.weight",
    "ssm_out.weight": "mixer.out_proj.weight", "ssm_out.bias": "mixer.out_proj.bias",
    "attn_q.weight": "mixer.q_proj.weight", "attn_k.weight": "mixer.k_proj.weight",
    "attn_v.weight": "mixer.v_proj.weight", "attn_output.weight": "mixer.o_proj.weight",
    "ffn_up.weight": "mixer.up_proj.weight", "ffn_up.bias": "mixer.up_proj.bias",
    "ffn_down.weight": "mixer.down_proj.weight", "ffn_down.bias": "mixer.down_proj.bias",
    "ffn_gate_inp.weight": "mixer.gate.weight", "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
    "ffn_up_exps.weight": "mixer.experts.up_proj", "ffn_down_exps.weight": "mixer.experts.down_proj",
    "ffn_up_shexp.weight": "mixer.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mixer.shared_experts.down_proj.weight",
    "ffn_latent_down.weight": "mixer.fc1_latent_proj.weight", "ffn_latent_up.weight": "mixer.fc2_latent_proj.weight",
}


def gguf_tensor(config: ArchitectureConfig, gguf_name: str) -> GGUFTensor | None:
    """Where a llama.cpp Nemotron-H tensor goes (transformers' names; ``mixer.A`` is llama.cpp's
    -exp(A_log), which `NemotronHForCausalLM.load_weights` takes); None for the MTP blocks past
    the decoder's layers."""
    assert isinstance(config, NemotronHConfig), type(config)
    if gguf_name in _GGUF_GLOBAL:
        return GGUFTensor(_GGUF_GLOBAL[gguf_name])
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        if int(parts[1]) >= config.num_layers:
            return None
        if parts[2] in _GGUF_LAYER:
            heads = {"attn_q.weight": config.num_heads, "attn_k.weight": config.num_kv_heads}.get(parts[2])
            return GGUFTensor(f"model.layers.{parts[1]}.{_GGUF_LAYER[parts[2]]}", rotary_heads=heads)
    raise NotImplementedError(f"nemotron_h GGUF tensor {gguf_name!r} has no counterpart here")


def build(config: Any, options: BuildOptions) -> NemotronHForCausalLM:
    assert isinstance(config, NemotronHConfig), config
    if options.weights is not None and options.weights.kind != "dense":
        raise NotImplementedError(f"nemotron_h runs dense weights only, not {options.weights.kind}")
    return NemotronHForCausalLM(config, dtype=options.dtype, device=options.device).eval()


ARCHITECTURES = (
    Architecture(
        name="nemotron_h",
        hf_model_types=("nemotron_h",),
        hf_architectures=("NemotronHForCausalLM",),
        config_from_hf=config_from_hf,
        build=build,
        gguf_architectures=("nemotron_h", "nemotron_h_moe"),
        config_from_gguf=config_from_gguf,
        gguf_tensor=gguf_tensor,
    ),
)
"""Nemotron-H's registry entry (`helios.models.registry`)."""
