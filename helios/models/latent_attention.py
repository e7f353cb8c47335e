"""Multi-head latent attention (DeepSeek-V2/V3's MLA) over cached latent rows, in its two forms.

A latent-attention layer caches one row per token, ``[c | k_rope]`` (`interface.LatentProjection`):
the normed latent ``c`` (``rank`` elements, 512 in DeepSeek-V3) and the rotary key shared by all
heads (64). Per head h the key is ``[W_k[h] c | k_rope]`` and the value ``W_v[h] c`` (``W_k``,
``W_v``: the two parts of ``kv_up``). Two ways to compute the same attention:

- **expanded** (`expanded_attention`, prefill chunks): keys and values of the chunk's whole
  context are made from its rows (one matmul by ``kv_up``), then ordinary causal attention of
  ``[q_nope | q_rope]`` over them. Compute-bound work, done as transformers does it.
- **absorbed** (`absorb_query` → `absorbed_attention` → `absorbed_output`, decode tokens): since
  ``q_nope · W_k[h] c = (W_k[h]^T q_nope) · c``, the query's non-rotary part is projected into the
  latent space once per token, and ``[W_k^T q_nope | q_rope]`` is scored against the cached rows
  themselves (one shared key head, multi-query attention of row size ``rank + rope_dim``); the
  weighted sum of the rows' latent parts is then taken out through ``W_v[h]``. Nothing is expanded:
  a decode step reads each cached row once for all heads.

For a chunk of several queries both forms apply (`chunk_attention` picks the one of fewer
multiply-adds, `absorbed_is_cheaper`): expanding costs ``L * rank * (nope + v)`` per head whatever
the chunk's length, absorbing ``Lq * rank * (nope + v)`` plus wider scores (``rank + rope`` and
``rank`` against ``nope + rope`` and ``v``), so a long first chunk expands and a short chunk over a
long context (a prompt's tail after a prefix-cache hit, a small chunk late in a chunked prefill)
absorbs; for DeepSeek-V3's shapes the crossover is near 170 queries.

Both are exact rewrites of the same sums (float32 rounding differs by summation order only;
tests/parity/test_deepseek_v3_parity.py checks each against the other and against transformers).
`DenseAttention` and the engine's paged backend call these; the paged decode kernel serves the
absorbed form with the rows as both its K and V (`helios.engine.attention`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from helios.models.interface import LatentProjection, SparseIndex

__all__ = ["absorb_query", "absorbed_attention", "absorbed_chunk_attention", "absorbed_is_cheaper", "absorbed_output",
           "chunk_attention", "expand_context", "expanded_attention", "sparse_attention", "sparse_selection"]


def expand_context(rows: Tensor, projection: LatentProjection) -> tuple[Tensor, Tensor]:
    """Keys [L, heads, nope_dim + rope_dim] and values [L, heads, v_dim] of cached ``rows`` [L,
    rank + rope_dim]."""
    r, heads, nope = projection.rank, projection.num_heads, projection.nope_dim
    length = rows.shape[0]
    kv = F.linear(rows[:, :r], projection.kv_up.reshape(-1, r)).view(length, heads, -1)
    rope = rows[:, None, r:].expand(length, heads, rows.shape[1] - r)
    return torch.cat((kv[..., :nope], rope), dim=-1), kv[..., nope:]


def expanded_attention(q_nope: Tensor, q_rope: Tensor, rows: Tensor, projection: LatentProjection, scale: float,
                       first_position: int, mask: Tensor | None = None) -> Tensor:
    """Causal attention of queries at positions ``first_position`` .. ``first_position + Lq - 1``
    ([Lq, heads, nope_dim] and [Lq, heads, rope_dim]) over the rows of positions 0 .. (``rows``
    [L, rank + rope_dim], L = first_position + Lq): [Lq, heads, v_dim]. ``mask`` [Lq, L] (True:
    attends) replaces the causal mask."""
    k, v = expand_context(rows, projection)
    v_dim = v.shape[-1]
    if v_dim < k.shape[-1]:
        # torch's CPU flash kernel needs one head size for Q, K and V; with V narrower SDPA falls back
        # to its math path (6.7 times as long for DeepSeek-V3's 192 / 128 at 2,048 tokens, one
        # thread, materializing every score). Zero columns leave the other outputs as they were.
        v = F.pad(v, (0, k.shape[-1] - v_dim))
    q = torch.cat((q_nope, q_rope.to(q_nope.dtype)), dim=-1).transpose(0, 1).unsqueeze(0)
    k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    length = q.shape[2]
    if mask is not None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    elif first_position == 0:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        mask = torch.ones(length, rows.shape[0], dtype=torch.bool, device=q.device).tril(diagonal=first_position)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out[0, ..., :v_dim].transpose(0, 1)


def absorbed_is_cheaper(num_queries: int, context: int, row_dim: int, projection: LatentProjection) -> bool:
    """Whether the absorbed form takes fewer multiply-adds than the expanded one for
    ``num_queries`` queries over ``context`` rows of ``row_dim`` elements (per head)."""
    r, nope, v = projection.rank, projection.nope_dim, projection.v_dim
    rope = row_dim - r
    expanded = context * r * (nope + v) + num_queries * context * (nope + rope + v)
    absorbed = num_queries * r * (nope + v) + num_queries * context * (2 * r + rope)
    return absorbed < expanded


def chunk_attention(q_nope: Tensor, q_rope: Tensor, rows: Tensor, projection: LatentProjection, scale: float,
                    first_position: int, mask: Tensor | None = None) -> Tensor:
    """`expanded_attention`'s result (same arguments), in whichever form is cheaper."""
    if absorbed_is_cheaper(q_nope.shape[0], rows.shape[0], rows.shape[1], projection):
        return absorbed_chunk_attention(q_nope, q_rope, rows, projection, scale, first_position, mask)
    return expanded_attention(q_nope, q_rope, rows, projection, scale, first_position, mask)


def absorbed_chunk_attention(q_nope: Tensor, q_rope: Tensor, rows: Tensor, projection: LatentProjection,
                             scale: float, first_position: int, mask: Tensor | None = None) -> Tensor:
    """`expanded_attention` in the absorbed form: every (query, head) pair is one query row of a
    multi-query attention over ``rows``, with the causal mask of its position (or ``mask``)."""
    q = absorb_query(q_nope, q_rope, projection).to(rows.dtype)
    length, heads = q.shape[0], q.shape[1]
    if mask is None:
        query_pos = torch.arange(first_position, first_position + length, device=q.device)
        mask = torch.arange(rows.shape[0], device=q.device)[None, :] <= query_pos[:, None]
    bias = torch.zeros(length, rows.shape[0], dtype=torch.float32, device=q.device).masked_fill_(
        ~mask, float("-inf"))
    bias = bias.repeat_interleave(heads, dim=0)[None]  # [1, length * heads, L], (query, head) order
    latent = absorbed_attention(q.reshape(1, length * heads, -1), rows[None], bias, scale, projection.rank)
    return absorbed_output(latent.view(length, heads, -1), projection)


def absorb_query(q_nope: Tensor, q_rope: Tensor, projection: LatentProjection) -> Tensor:
    """The absorbed query [T, heads, rank + rope_dim]: ``[W_k[h]^T q_nope[h] | q_rope[h]]``."""
    w_k = projection.kv_up[:, : projection.nope_dim]  # [heads, nope, rank]
    latent = torch.bmm(q_nope.transpose(0, 1).to(w_k.dtype), w_k).transpose(0, 1)  # [T, heads, rank]
    return torch.cat((latent, q_rope.to(latent.dtype)), dim=-1).contiguous()


def absorbed_attention(q: Tensor, rows: Tensor, bias: Tensor | None, scale: float, rank: int) -> Tensor:
    """Each token's absorbed query ``q`` [D, heads, rank + rope_dim] over its context ``rows`` [D, L,
    rank + rope_dim] (``bias`` [D, 1, L]: 0 where a token attends, -inf on padding; None: all
    attend; or [D, heads, L]): the weighted sums of the rows' latents, [D, heads, rank] in the rows'
    dtype. Scores, softmax and sums in float32 (float64 for float64 rows), as the paged decode
    kernel computes them: bfloat16 operands are widened, not the products rounded."""
    acc = torch.promote_types(rows.dtype, torch.float32)
    wide = rows.to(acc)
    scores = torch.bmm(q.to(acc), wide.transpose(1, 2)) * scale
    if bias is not None:
        scores = scores + bias
    return torch.bmm(torch.softmax(scores, dim=-1), wide[..., :rank]).to(rows.dtype)


def absorbed_output(latent: Tensor, projection: LatentProjection) -> Tensor:
    """The attention output [T, heads, v_dim] of latent outputs [T, heads, rank]: ``W_v[h] o[h]``."""
    w_v = projection.kv_up[:, projection.nope_dim :]  # [heads, v, rank]
    # W_v[h] @ o[h]^T, the weight as stored: bmm against its transpose (o @ W_v^T) took 4.5 times as
    # long for one bfloat16 token (17 against 3.7 ms for DeepSeek-V3's 128 heads on one core).
    return torch.bmm(w_v, latent.permute(1, 2, 0).to(w_v.dtype)).permute(2, 0, 1)


def sparse_selection(index: SparseIndex, keys: Tensor, first_position: int) -> Tensor:
    """Which keys each query attends to under DSA's indexer: [Lq, L] bool, True at the ``top_k``
    causal keys of highest index score (`SparseIndex`), for queries at positions
    ``first_position`` .. over the indexer ``keys`` [L, index_dim] of positions 0 .. L - 1. Where
    fewer than ``top_k`` keys are causal, all of them."""
    assert index.q is not None and index.weights is not None, "a shared layer reuses a selection"
    length, context = index.q.shape[0], keys.shape[0]
    query_pos = torch.arange(first_position, first_position + length, device=keys.device)
    causal = torch.arange(context, device=keys.device)[None, :] <= query_pos[:, None]
    if context <= index.top_k:
        return causal
    acc = torch.promote_types(keys.dtype, torch.float32)
    scores = torch.matmul(index.q.to(acc), keys.to(acc).t().unsqueeze(0)) * keys.shape[1] ** -0.5  # [Lq, H, L]
    scores = torch.matmul(index.weights.to(acc).unsqueeze(1), torch.relu(scores)).squeeze(1)  # [Lq, L]
    scores = scores.masked_fill(~causal, float("-inf"))
    # A stable sort, not topk: equal scores (keys every head's ReLU zeroes) resolve to the earlier
    # key whatever the chunking, so a chunked prefill or a cache hit selects what one pass does.
    top = scores.sort(dim=-1, descending=True, stable=True).indices[:, : index.top_k]
    return torch.zeros_like(causal).scatter_(-1, top, True) & causal


def sparse_attention(q_nope: Tensor, q_rope: Tensor, rows: Tensor, projection: LatentProjection, scale: float,
                     first_position: int, index: SparseIndex, selection: list[Tensor | None]) -> Tensor:
    """`chunk_attention` of a sparse layer (DeepSeek's DSA): each query attends only to the keys
    its indexer selects (`sparse_selection`; None: every causal key, the context being no longer
    than ``top_k``), in the cheaper form. ``rows`` [L, rank + rope_dim (+ index_dim)]: with the
    layer's own indexer (``index.q``) they end with the indexer keys, and the selection is stored
    as ``selection``'s one element; without (a shared layer) ``selection`` holds the one to reuse."""
    width = projection.rank + q_rope.shape[-1]
    if index.q is not None:
        selection[:] = [None if rows.shape[0] <= index.top_k else
                        sparse_selection(index, rows[:, width:], first_position)]
    elif not selection:
        raise ValueError("a shared sparse layer before any layer with an indexer")
    return chunk_attention(q_nope, q_rope, rows[:, :width], projection, scale, first_position, selection[0])
