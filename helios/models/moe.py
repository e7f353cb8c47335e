"""The mixture-of-experts feed-forward block: a router choosing ``top_k`` of ``num_experts`` SwiGLU
experts per token, the chosen experts' outputs summed with the router's weights, plus optional
shared experts every token goes through.

Routing is transformers' to the bit, so the same experts are chosen (ties included: the same
``torch.topk`` calls on the same values):

- ``softmax`` (Qwen2/Qwen3-MoE, Mixtral): router logits in the activation dtype (the router weight
  kept in it), softmax in float32, ``topk`` of the probabilities, renormalised over the chosen ones
  when ``norm_topk_prob``, the weights cast back to the logits' dtype;
- ``sigmoid`` (GLM-4.5 / DeepSeek-V3 style): logits in float32 (the router weight kept in
  float32), sigmoid scores; the choice is made on ``scores + e_score_correction_bias`` (the bias
  moves the selection, never the weights), restricted to the ``topk_group`` best of ``n_group``
  expert groups (a group's score: the sum of its two best biased scores); the weights are the
  chosen experts' unbiased scores, renormalised (``+ 1e-20``) when ``norm_topk_prob``, times
  ``routed_scaling_factor``; they stay float32;
- ``sqrtsoftplus`` (DeepSeek V4): scores ``sqrt(softplus(logits))`` in the logits' dtype (the
  router weight kept in the activation dtype), otherwise as ``sigmoid``; DeepSeek V4's hash layers
  give the experts themselves (``ids``: a fixed token-id -> experts table) and take only the
  weights from the scores.

Expert compute groups the tokens by expert: the (token, slot) pairs are sorted by expert id (a
stable sort), each active expert runs one gate/up and one down matmul over its contiguous group,
the rows are scaled by their routing weights and added back to their tokens with ``index_add_``.
The Python loop is over the experts that received tokens, never over tokens. Expert weights are
stacked dense tensors, ``gate_up`` [E, 2 * moe_intermediate, hidden] (gate rows first) and ``down``
[E, hidden, moe_intermediate], in the model's dense dtype under a dense weight format; under a
quantized one each expert's gate/up and down are modules built by `helios.models.quant.build_linear`
(`helios.models.moe_decoder`): `kquant.KQuantLinear` over the expert's own GGUF blocks (a k-quant /
Q5_x / Q8_0 GGUF under ``keep_blocks``, what ``weights = "auto"`` picks: the stacked
``ffn_*_exps`` tensors are never dequantized at load), `quant.Int4Linear` (int4; Q4_0 / Q4_1 codes
kept), `quant.Int8Linear` (int8).

Which path a step takes. A step of T rows makes T * top_k (token, expert) pairs; expert e runs on
its n_e rows (sum n_e = T * top_k), so the per-expert row count, not T, picks the path. With
`kquant.KQuantLinear` experts and no dense copy (``auto``: ``unpack_above`` =
``runtime.AUTO_BLOCKS_UNPACK_ABOVE`` = 32):

- 1 row (decode of one sequence): top_k experts with one row each: the kernel's GEMV
  (`cpu_kernels.kquant_linear`, 1 to 3 rows: single weight rows), top_k experts' blocks read.
- 8 rows: 8 * top_k pairs; with many experts (Qwen3-30B-A3B: 128, top 8) nearly every active
  expert gets one or two rows: GEMVs, each active expert's blocks read once; with few experts,
  4 rows and more take the kernel's register tiles (4 activation x 2 weight rows).
- 32 rows: 32 * top_k pairs: an expert's n_e is at most 32 here, so every expert stays on the
  kernel (GEMV or tiles, each active expert's blocks read once for all its rows); ``unpack_above``
  counts n_e, so only an expert chosen by more than 32 tokens of a larger step (prefill) leaves
  the exact kernel: bfloat16 rows, up to 128 of them, on the tiles path where it runs (AMX or AVX512-BF16)
  (`cpu_kernels.kquant_linear_tiles`: the weights rounded to bfloat16 as the unpack path rounds them,
  decoded in L1; docs/benchmarks.md, "The decode plan", has the prefill figures), otherwise
  dequantized for the call into a dense GEMM in the activation dtype.

With a dense copy (``dense_dtype``), an expert with more than ``dense_above`` rows uses it instead.
`quant.Int4Linear` experts take torch's int4 kernel at every row count (or the dense copy past
``dense_above``); dense stacked experts, ``torch.matmul`` per expert.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from helios.models.kquant import BlockExperts, grouped_linear

__all__ = ["Experts", "RouterSpec", "expert_mix", "route", "run_experts", "swiglu"]

Experts = Tensor | Sequence[Callable[[Tensor], Tensor]]
"""One projection of every expert: a stacked [E, rows, cols] weight, or one module per expert."""


@attrs.frozen(kw_only=True)
class RouterSpec:
    """How a family's router picks experts (see the module docstring)."""

    num_experts: int
    top_k: int
    scoring: Literal["softmax", "sigmoid", "sqrtsoftplus"] = "softmax"
    norm_topk_prob: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    fp32_logits: bool | None = None

    def __attrs_post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be in 1..num_experts ({self.num_experts})")
        if self.scoring not in ("softmax", "sigmoid", "sqrtsoftplus"):
            raise ValueError(f"unknown router scoring {self.scoring!r}")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise ValueError(f"n_group ({self.n_group}) must divide num_experts ({self.num_experts})")
        if not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be in 1..n_group ({self.n_group})")
        if self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError("grouped routing needs at least two experts per group")

    @property
    def router_fp32(self) -> bool:
        """Whether the router weight is kept, and its logits computed, in float32: ``fp32_logits``,
        by default for sigmoid routing (GLM / DeepSeek-V3 keep it in float32; MiniMax-M2 computes
        its logits in the activation dtype and only the sigmoid in float32)."""
        return self.scoring == "sigmoid" if self.fp32_logits is None else self.fp32_logits


def route(logits: Tensor, spec: RouterSpec, correction_bias: Tensor | None = None, *,
          ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The experts each token goes to and their weights, from router ``logits`` [T, E]:
    ``(weights [T, top_k], expert ids [T, top_k] long)``; weights in the logits' dtype for softmax
    and sqrtsoftplus routing, float32 for sigmoid routing (as transformers returns them). ``ids``
    [T, top_k]: the experts are given (hash routing, sigmoid / sqrtsoftplus scoring); only the
    weights are computed."""
    if spec.scoring == "softmax":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, spec.top_k, dim=-1)
        if spec.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), ids
    scores = logits.float().sigmoid() if spec.scoring == "sigmoid" else F.softplus(logits).sqrt()
    if ids is None:
        ids = _choose(scores, spec, correction_bias)
    weights = scores.gather(1, ids)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * spec.routed_scaling_factor, ids


def _choose(scores: Tensor, spec: RouterSpec, correction_bias: Tensor | None) -> Tensor:
    """The ``top_k`` experts of ``scores`` plus the correction bias, within the ``topk_group``
    best groups."""
    choice = scores if correction_bias is None else scores + correction_bias
    if spec.n_group > 1:
        per_group = spec.num_experts // spec.n_group
        group_scores = choice.view(-1, spec.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=spec.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, spec.n_group, per_group).reshape(-1, spec.num_experts)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    return torch.topk(choice, k=spec.top_k, dim=-1, sorted=False)[1]


def expert_mix(x: Tensor, weights: Tensor, ids: Tensor, gate_up: Experts, down: Experts, *,
               act: Callable[[Tensor], Tensor] = F.silu, limit: float | None = None,
               blocks: BlockExperts | None = None) -> Tensor:
    """sum over each token's chosen experts e of ``weight * down[e] @ (act(gate) * up)`` with
    ``gate, up = gate_up[e] @ x``: [T, hidden] in ``x``'s dtype. Tokens are grouped by expert (one
    pair of matmuls per active expert). ``gate_up`` / ``down``: stacked weights, or per-expert
    modules (quantized formats, `helios.models.quant.build_linear`); ``act``: SiLU unless the
    family says otherwise (Gemma 4: GELU tanh); ``limit``: the gate clipped to at most it and the
    up projection to [-limit, limit] first (DeepSeek V4's ``swiglu_limit``). ``blocks``: the same
    experts' GGUF blocks (`kquant.BlockExperts.of` ``gate_up`` and ``down``, listed once by the
    caller, and given only where the CPU kernels are available): with SiLU and no limit the whole mix
    is one operator (`cpu_kernels.moe_kquant_mix`, the same bits as the steps below) where it applies."""
    if blocks is not None and act is F.silu and limit is None:
        fused = blocks.mix(x, weights, ids)
        if fused is not None:
            return fused
    num_tokens, top_k = ids.shape
    out = torch.zeros_like(x)
    if num_tokens == 0:
        return out
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // top_k
    counts = torch.bincount(flat, minlength=len(gate_up)).tolist()
    rows = x.index_select(0, token_of)
    mixed = run_experts(rows, counts, gate_up, down, act=act, limit=limit)
    mixed = mixed * weights.reshape(-1, 1).index_select(0, order)
    return out.index_add_(0, token_of, mixed.to(x.dtype))


def run_experts(rows: Tensor, counts: Sequence[int], gate_up: Experts, down: Experts, *,
                act: Callable[[Tensor], Tensor] = F.silu, limit: float | None = None) -> Tensor:
    """Rows grouped by expert (``counts[e]`` rows for expert e, in expert order) through their
    experts' SwiGLU, unweighted: [rows, hidden] (`expert_mix`'s expert compute; expert parallelism
    runs it on the rows a rank received, `helios.models.tp.dispatch_experts`)."""
    active = [e for e, count in enumerate(counts) if count]
    sizes = [counts[e] for e in active]
    gu = _project(gate_up, active, sizes, rows)
    inter = gu.shape[-1] // 2
    return _project(down, active, sizes, swiglu(gu[:, :inter], gu[:, inter:], act, limit))


def swiglu(gate: Tensor, up: Tensor, act: Callable[[Tensor], Tensor] = F.silu, limit: float | None = None) -> Tensor:
    """``act(gate) * up``; with ``limit``, ``gate`` clipped to at most it and ``up`` to [-limit,
    limit] first."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return act(gate) * up


def _project(weights: Experts, active: Sequence[int], sizes: Sequence[int], rows: Tensor) -> Tensor:
    """Rows grouped by expert (``sizes[i]`` rows for expert ``active[i]``) through each one's weight:
    GGUF-block experts in one grouped kernel call where every group takes the kernel path
    (`kquant.grouped_linear`, the same bits), otherwise one matmul per expert."""
    if not isinstance(weights, Tensor):
        fused = grouped_linear([weights[e] for e in active], sizes, rows)
        if fused is not None:
            return fused
    parts: list[Tensor] = []
    start = 0
    for expert, size in zip(active, sizes, strict=True):
        chunk = rows[start : start + size]
        parts.append(F.linear(chunk, weights[expert]) if isinstance(weights, Tensor) else weights[expert](chunk))
        start += size
    return torch.cat(parts)
