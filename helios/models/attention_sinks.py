"""Attention with sinks (gpt-oss): a learned logit per query head that joins the softmax's
denominator and attends to nothing.

transformers' eager gpt-oss attention concatenates the head's sink logit to each query's scores,
subtracts the row maximum, takes the softmax and drops the sink's column before multiplying by V:

    p_j = exp(s_j - m) / (sum_i exp(s_i - m) + exp(sink - m)),  m = max(max_i s_i, sink)

`sink_attention` computes exactly that, in float32 (without the concatenation copy), for the
attention backends' torch paths (`helios.models.dense_attention.DenseAttention`, the engine's
paged backend); the CPU paged kernels know no sinks, so layers with sinks never take them.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["sink_attention", "sink_softmax"]


def sink_softmax(scores: Tensor, sinks: Tensor) -> Tensor:
    """The softmax of ``scores`` [..., L] (masked entries -inf) with one more logit ``sinks``
    (broadcastable to [..., 1]) in the denominator, in float32; the sink's own column is dropped."""
    scores = scores.float()
    sinks = sinks.float()
    top = scores.amax(dim=-1, keepdim=True).maximum(sinks)
    e = (scores - top).exp()
    return e / (e.sum(dim=-1, keepdim=True) + (sinks - top).exp())


def sink_attention(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, scale: float,
                   mask: Tensor | None = None) -> Tensor:
    """Attention of ``q`` [B, H, Lq, d] over ``k``, ``v`` [B, Hkv, Lk, d] with per-head sink logits
    ``sinks`` [H]; ``mask``: None (every key) or a boolean [Lq, Lk] (True: attended). Query head h
    uses kv head h // (H // Hkv): each kv head's query group is folded into the query axis, so K/V
    are not repeated. Long chunks run in query blocks of at most `MAX_SCORES` scores each (the
    float32 score matrix is materialised). Returns [B, H, Lq, d] in ``q``'s dtype."""
    b, h, lq, _ = q.shape
    lk = k.shape[2]
    block = max(1, MAX_SCORES // max(1, b * h * lk))
    if lq <= block:
        return _sink_block(q, k, v, sinks, scale, mask)
    parts = [_sink_block(q[:, :, i : i + block], k, v, sinks, scale, None if mask is None else mask[i : i + block])
             for i in range(0, lq, block)]
    return torch.cat(parts, dim=2)


MAX_SCORES = 1 << 24
"""The most attention scores `sink_attention` materialises at once (64 MiB of float32)."""


def _sink_block(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, scale: float, mask: Tensor | None) -> Tensor:
    b, h, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    group = h // hkv
    qg = q.reshape(b, hkv, group * lq, d)
    scores = (qg @ k.transpose(-1, -2)).view(b, hkv, group, lq, lk) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = sink_softmax(scores, sinks.view(1, hkv, group, 1, 1))
    out = probs.to(v.dtype).view(b, hkv, group * lq, lk) @ v
    return out.view(b, h, lq, d).to(q.dtype)
