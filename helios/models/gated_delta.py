"""Gated DeltaNet's token mixing on a flattened batch of chunks (`helios.models.qwen3_next`), in torch.

Two pieces, each reading and writing per-request state rows (`interface.RecurrentBatch`: the
chunks' spans and the layer's state tensors; a span whose first position is 0 starts from zeros):

- `causal_conv`: the short depthwise causal convolution (kernel ``K``) over each chunk, continued
  from the last ``K - 1`` inputs of the request's previous chunk (the conv state, [K - 1, channels]),
  followed by SiLU. The state after a chunk is its request's last ``K - 1`` inputs.
- the gated delta rule over per-head states ``S`` [k_dim, v_dim] (float32): for each token,
  ``S <- exp(g) S`` (``g`` one log decay per head, or per head and key channel: Kimi Delta
  Attention, `helios.models.kimi_linear`, which scales row c of ``S`` by ``exp(g_c)``); ``S <- S + k (beta (v - S^T k))^T``; output ``S^T q``, with ``q`` and ``k``
  L2-normalised and ``q`` scaled by ``k_dim ** -0.5`` (a key head serves a group of value heads:
  consecutive ones, or with ``tiled`` every key-head-count-th, llama.cpp's Qwen3.5 order). A
  one-token chunk (decode) is that update, for every decode token of the step at once (`recurrent_step`, or on the CPU the
  `cpu_kernels.gated_delta_step` kernel, in place on the state slots); a longer chunk runs the chunked
  form (`chunked_scan`) in blocks of ``block`` tokens: within a block the updates are solved as one
  unit-lower-triangular system (the WY form: ``(I + A) U = beta V - beta exp(gamma) K S0`` with
  ``A[i, j] = beta_i exp(gamma_i - gamma_j) k_i . k_j`` for j < i and ``gamma`` the block's cumulative
  log decay), the blocks then run in sequence through the state. A chunk boundary anywhere gives the
  same state as one pass (up to float32 rounding), since each chunk starts from the state the last
  one left. Per-channel decays take the same form with per-channel pair weights (`chunked_scan`)
  and the torch decode update (the C++ kernel takes one decay per head).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from helios.models import cpu_kernels

__all__ = ["causal_conv", "chunked_scan", "gated_delta", "l2norm", "recurrent_step"]

Span = tuple[int, int, int, int]  # (first token index, length, state slot, first position)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (flash-linear-attention's and transformers')."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv(x: Tensor, weight: Tensor, state: Tensor, spans: Sequence[Span]) -> Tensor:
    """SiLU of the depthwise causal convolution of ``x`` [T, C] with ``weight`` [C, K] per span,
    continued from ``state`` [slots, K - 1, C] (updated in place). float32 [T, C] (float64 for float64 ``x``). One-token spans
    (decode) run as one batched convolution of their K-input windows; longer ones one each."""
    channels = x.shape[1]
    hist = weight.shape[1] - 1
    wide = _wide(x.dtype)
    kernel = weight.to(wide)[:, None, :]  # [C, 1, K]
    xf = x.to(wide)
    out = torch.empty_like(xf)
    device = x.device

    def history(slot: int, first: int) -> Tensor:
        return xf.new_zeros(hist, channels) if first == 0 else state[slot].to(wide)

    steps = [(start, slot, first) for start, length, slot, first in spans if length == 1]
    if steps:
        rows = torch.tensor([s[0] for s in steps], dtype=torch.long, device=device)
        slots = torch.tensor([s[1] for s in steps], dtype=torch.long, device=device)
        windows = torch.cat((torch.stack([history(slot, first) for _, slot, first in steps]),
                             xf.index_select(0, rows)[:, None, :]), dim=1)  # [D, K, C]
        out.index_copy_(0, rows, F.conv1d(windows.transpose(1, 2), kernel, groups=channels)[:, :, 0])
        state.index_copy_(0, slots, windows[:, 1:].to(state.dtype))
    for start, length, slot, first in spans:
        if length == 1:
            continue
        ext = torch.cat((history(slot, first), xf[start : start + length]))  # [K - 1 + L, C]
        out[start : start + length] = F.conv1d(ext.t()[None], kernel, groups=channels)[0].t()
        state[slot] = ext[-hist:].to(state.dtype) if hist else state[slot]
    return F.silu(out)


def recurrent_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One gated delta update for N independent tokens: ``q``, ``k`` [N, H, dk] (normalised and
    scaled, float32), ``v`` [N, H, dv], ``g`` [N, H] (or per key channel [N, H, dk]), ``beta``
    [N, H], ``state`` [N, H, dk, dv]. Returns (output [N, H, dv], the new state)."""
    s = state * (g.exp()[..., None] if g.dim() == k.dim() else g.exp()[..., None, None])
    predicted = torch.einsum("nhkv,nhk->nhv", s, k)
    delta = (v - predicted) * beta[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return torch.einsum("nhkv,nhk->nhv", s, q), s


def chunked_scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                 block: int = 64) -> tuple[Tensor, Tensor]:
    """The gated delta rule over one sequence of L tokens in blocks of ``block``: ``q``, ``k``
    [H, L, dk] (normalised and scaled, float32), ``v`` [H, L, dv], ``g`` [H, L] (or per key
    channel [H, L, dk]: Kimi Delta Attention), ``beta`` [H, L], from ``state`` [H, dk, dv].
    Returns (output [H, L, dv], the final state).

    With per-channel decays the pair weights ``exp(gamma_i - gamma_j)`` are per channel, so the
    block's A and scores are sums over the key channels of products weighted by them (formed one
    block at a time, [H, block, block, dk]); a decay per token factors out of those sums."""
    heads, length, _ = k.shape
    dv = v.shape[-1]
    channel = g.dim() == 3
    pad = -length % block
    if pad:  # padded tokens: no decay (g = 0), no write (beta = 0, k = 0), outputs dropped
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g = F.pad(g, (0, 0, 0, pad) if channel else (0, pad))
        beta = F.pad(beta, (0, pad))
    n = (length + pad) // block
    q, k, v = (t.reshape(heads, n, block, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(heads, n, block, *g.shape[2:]), beta.reshape(heads, n, block)
    gamma = g.cumsum(dim=2)  # log decay from the block's start through each token (per channel)
    causal = torch.ones(block, block, dtype=torch.bool, device=q.device).tril()
    kb = k * beta[..., None]
    if channel:
        system = torch.empty(heads, n, block, block, dtype=q.dtype, device=q.device)
        scores = torch.empty_like(system)
        for i in range(n):
            # exp(gamma_i - gamma_j) per channel for j <= i, 0 above the diagonal (masked before the exp).
            pair = gamma[:, i, :, None, :] - gamma[:, i, None, :, :]
            pair = pair.masked_fill(~causal[..., None], float("-inf")).exp()  # [H, block, block, dk]
            system[:, i] = torch.einsum("hic,hjc,hijc->hij", kb[:, i], k[:, i], pair)
            scores[:, i] = torch.einsum("hic,hjc,hijc->hij", q[:, i], k[:, i], pair)
        at_token, to_end = gamma.exp(), (gamma[:, :, -1:] - gamma).exp()
        block_decay = gamma[:, :, -1].exp()[..., None]  # [H, n, dk, 1]
    else:
        decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        system = (kb @ k.transpose(-1, -2)) * decay
        scores = (q @ k.transpose(-1, -2)) * decay
        at_token, to_end = gamma.exp()[..., None], (gamma[..., -1:] - gamma).exp()[..., None]
        block_decay = gamma[..., -1].exp()[..., None, None]  # [H, n, 1, 1]
    # the system's strictly lower part is A; its diagonal is ignored (unit triangular)
    w_v = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(system, kb * at_token, upper=False, unitriangular=True)
    q_decayed = q * at_token
    k_to_end = k * to_end
    out = q.new_empty(heads, n, block, dv)
    s = state
    for i in range(n):
        u = w_v[:, i] - w_k[:, i] @ s  # the block's state corrections
        out[:, i] = q_decayed[:, i] @ s + scores[:, i] @ u
        s = s * block_decay[:, i] + k_to_end[:, i].transpose(-1, -2) @ u
    return out.reshape(heads, n * block, dv)[:, :length], s


def gated_delta(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, spans: Sequence[Span],
                block: int = 64, *, tiled: bool = False) -> Tensor:
    """The gated delta rule over every span of a flattened batch: ``q``, ``k`` [T, Hk, dk],
    ``v`` [T, H, dv] (H a multiple of Hk: k head h serves v heads h * H / Hk ... (grouped), or with
    ``tiled`` v heads h, h + Hk, h + 2 Hk ...), ``g`` [T, H] (or per key channel [T, H, dk]), ``beta``
    [T, H], ``state`` [slots, H, dk, dv] float32 (updated in place). Computes in float32 (float64 for
    float64 inputs) and returns [T, H, dv] in that dtype."""
    num_tokens, heads, dv = v.shape
    dk = k.shape[-1]
    group = heads // k.shape[1]
    wide = _wide(v.dtype)
    q = l2norm(q.to(wide)) * dk ** -0.5
    k = l2norm(k.to(wide))
    if group > 1 and tiled:
        q, k = q.repeat(1, group, 1), k.repeat(1, group, 1)
    elif group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    v, g, beta = v.to(wide), g.to(wide), beta.to(wide)
    out = torch.empty(num_tokens, heads, dv, dtype=wide, device=v.device)
    device = v.device
    steps = [(start, slot, first) for start, length, slot, first in spans if length == 1]
    if steps and g.dim() == 2 and _kernel_serves(state, wide):  # every one-token chunk in one update, in place
        rows = torch.tensor([s[0] for s in steps], dtype=torch.long, device=device)
        slots = torch.tensor([s[1] for s in steps], dtype=torch.long, device=device)
        fresh_rows = torch.tensor([s[2] == 0 for s in steps], dtype=torch.uint8, device=device)
        out.index_copy_(0, rows, cpu_kernels.gated_delta_step(q[rows], k[rows], v[rows], g[rows], beta[rows], state,
                                                              slots, fresh_rows))
    elif steps:  # every one-token chunk in one update
        rows = torch.tensor([s[0] for s in steps], dtype=torch.long, device=device)
        slots = torch.tensor([s[1] for s in steps], dtype=torch.long, device=device)
        s0 = state.index_select(0, slots).to(wide)
        fresh = [i for i, s in enumerate(steps) if s[2] == 0]
        if fresh:
            s0[fresh] = 0.0
        o, s1 = recurrent_step(q[rows], k[rows], v[rows], g[rows], beta[rows], s0)
        out.index_copy_(0, rows, o)
        state.index_copy_(0, slots, s1.to(state.dtype))
    for start, length, slot, first in spans:
        if length == 1:
            continue
        part = slice(start, start + length)
        s0 = v.new_zeros(heads, dk, dv) if first == 0 else state[slot].to(wide)
        o, s1 = chunked_scan(q[part].transpose(0, 1), k[part].transpose(0, 1), v[part].transpose(0, 1),
                             g[part].transpose(0, 1), beta[part].t(), s0, block)
        out[part] = o.transpose(0, 1)
        state[slot] = s1.to(state.dtype)
    return out


def _kernel_serves(state: Tensor, wide: torch.dtype) -> bool:
    """Whether `cpu_kernels.gated_delta_step` takes the decode tokens: a float32 CPU state, the kernels built."""
    return (wide == torch.float32 and state.dtype == torch.float32 and state.device.type == "cpu"
            and state.is_contiguous() and cpu_kernels.available())


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype the rule runs in: float32, or float64 for float64 inputs (a reference)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
