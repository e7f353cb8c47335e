"""The filters: top-k, then top-p over the top-k renormalised distribution, then min-p.

Every filter keeps all tokens tied with its boundary value, so ties never depend on a sort's order.
What survives is described by one threshold per row (`Survivors`): every token whose scaled logit is
at least it. Host reads: a top-k or top-p row's candidate decisions, and a wide nucleus's bucket
cut (`_top_p_bucket_cut`), read the device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch
from torch import Tensor

from helios.domain.sampling import SamplingParams
from helios.engine.sampling.rows import top_k_active
from helios.engine.sampling.tensors import NEG_INF, finite_peak, row_index, select_rows

# Top-p without top-k first looks for its cut among this many of the most likely tokens; a wider
# nucleus is located through value buckets (``_top_p_bucket_cut``) instead of a sort of the vocabulary.
_TOP_P_CANDIDATES = 256
_BUCKETS = 2048


@attrs.define
class Survivors:
    """What the filters leave of each row: every token whose (temperature-scaled) logit is at least the
    row's threshold. Rows whose survivors all lie among their leading candidates also carry those
    candidates, so their draw never scans the vocabulary."""

    thresholds: Tensor | None
    """[S]; -inf where a row filters nothing; None when no row filters."""
    candidate_rows: list[int] = attrs.field(factory=list)
    candidate_values: Tensor | None = None
    """[len(candidate_rows), width] logits, sorted in decreasing order."""
    candidate_ids: Tensor | None = None


def filter_survivors(w: Tensor, params: Sequence[SamplingParams]) -> Survivors:
    num_rows, vocab_size = w.shape
    device = w.device
    thresholds: Tensor | None = None
    if any(p.min_p > 0.0 for p in params):
        log_min_p = [math.log(p.min_p) if p.min_p > 0.0 else NEG_INF for p in params]
        thresholds = w.amax(dim=-1) + torch.tensor(log_min_p, dtype=w.dtype, device=device)
    filtered = [j for j, p in enumerate(params) if top_k_active(p, vocab_size) or p.top_p < 1.0]
    if not filtered:
        return Survivors(thresholds)
    top = _top_k_top_p(select_rows(w, filtered, num_rows), [params[j] for j in filtered])
    assert top.thresholds is not None
    if thresholds is None:
        thresholds = torch.full((num_rows,), NEG_INF, dtype=w.dtype, device=device)
    index = row_index(filtered, num_rows, device)
    if index is None:
        thresholds = torch.maximum(thresholds, top.thresholds)
    else:
        thresholds[index] = torch.maximum(thresholds[index], top.thresholds)
    out = Survivors(thresholds)
    if top.candidate_rows and top.candidate_values is not None and top.candidate_ids is not None:
        rows = [filtered[r] for r in top.candidate_rows]
        values = top.candidate_values
        # A candidate row qualifies when nothing below its last candidate survives (min-p included).
        final = thresholds[torch.tensor(rows, dtype=torch.long, device=device)]
        inside = (final > values[:, -1]) | (values.shape[1] >= vocab_size)
        flags = inside.tolist()
        keep = [r for r, flag in enumerate(flags) if flag]
        if keep:
            out.candidate_rows = [rows[r] for r in keep]
            selected = row_index(keep, len(rows), device)
            out.candidate_values = values if selected is None else values.index_select(0, selected)
            out.candidate_ids = (
                top.candidate_ids if selected is None else top.candidate_ids.index_select(0, selected)
            )
    return out


def _top_k_top_p(w: Tensor, params: Sequence[SamplingParams]) -> Survivors:
    """Thresholds for rows with top-k and/or top-p; top-p applies to the top-k renormalised
    distribution.

    Every row first looks among its sorted leading candidates (its top k + 1, or the top 256 without
    top-k); rows settled there come back with their candidates. A top-p row whose nucleus extends
    beyond them (a flat distribution) finds its cut through value buckets.
    """
    num_rows, vocab_size = w.shape
    device = w.device
    out = Survivors(torch.full((num_rows,), NEG_INF, dtype=w.dtype, device=device))
    ks = [p.top_k if top_k_active(p, vocab_size) else 0 for p in params]
    width = min(vocab_size, max(k + 1 if k else _TOP_P_CANDIDATES for k in ks))
    if width < vocab_size:
        values, ids = w.topk(width, dim=-1)
    else:
        values, ids = w.sort(dim=-1, descending=True)
    has_k = torch.tensor([k > 0 for k in ks], device=device)
    kth = values.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=device).unsqueeze(1))
    kth = torch.where(has_k.unsqueeze(1), kth, torch.full_like(kth, NEG_INF))
    result = kth.squeeze(1)
    complete = [True] * num_rows
    if any(p.top_p < 1.0 for p in params):
        cut, reached = _top_p_cut(w, values, kth, params)
        result = torch.maximum(result, cut)
        if width < vocab_size:
            complete = (reached | has_k).tolist()
    pending = [r for r, flag in enumerate(complete) if not flag]
    done = [r for r, flag in enumerate(complete) if flag]
    if done:
        selected = row_index(done, num_rows, device)
        _store(out, done, result if selected is None else result.index_select(0, selected))
        out.candidate_rows = done
        out.candidate_values = values if selected is None else values.index_select(0, selected)
        out.candidate_ids = ids if selected is None else ids.index_select(0, selected)

    if pending:
        # Only top-p rows without top-k remain, with a nucleus wider than their candidates.
        index = torch.tensor(pending, dtype=torch.long, device=device)
        _store(out, pending, _top_p_bucket_cut(w.index_select(0, index), [params[r] for r in pending]))
    return out


def _store(out: Survivors, rows: list[int], thresholds: Tensor) -> None:
    """Sets the thresholds of ``rows`` (aligned with them)."""
    assert out.thresholds is not None
    out.thresholds[torch.tensor(rows, dtype=torch.long, device=thresholds.device)] = thresholds


def _top_p_bucket_cut(w: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """The top-p cut of rows without top-k whose nucleus is wide, without sorting the vocabulary.

    Tokens fall into ``_BUCKETS`` value buckets between the row's smallest finite logit and its peak
    (order preserving, ties share a bucket); the bucket masses locate the bucket holding the cut, and
    only that bucket's tokens are sorted.
    """
    num_rows = w.shape[0]
    device = w.device
    peak = finite_peak(w.amax(dim=-1, keepdim=True))
    weights = torch.exp(w - peak)
    low = torch.where(torch.isfinite(w), w, peak).amin(dim=-1, keepdim=True)
    scale = _BUCKETS / (peak - low).clamp(min=torch.finfo(w.dtype).tiny)
    buckets = (w - low).mul_(scale).clamp_(0, _BUCKETS - 1).long()  # -inf lands in bucket 0
    masses = torch.zeros(num_rows, _BUCKETS, dtype=torch.float64, device=device)
    masses.scatter_add_(1, buckets, weights.double())
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device)
    target = top_p * masses.sum(dim=-1)
    from_top = masses.flip(-1).cumsum(dim=-1)  # mass of the j + 1 highest buckets
    j = (from_top < target.unsqueeze(1)).sum(dim=-1).clamp_(max=_BUCKETS - 1)
    bucket = _BUCKETS - 1 - j
    rows = torch.arange(num_rows, device=device)
    before = from_top[rows, j] - masses[rows, bucket]  # mass of the buckets above the cut's bucket
    cuts: list[Tensor] = []
    for r, (b, mass, goal) in enumerate(zip(bucket.tolist(), before.tolist(), target.tolist(), strict=True)):
        members = (buckets[r] == b).nonzero().flatten()
        if not members.numel():  # nothing but -inf: any cut will do
            cuts.append(peak[r, 0])
            continue
        values, order = w[r, members].sort(descending=True)
        cumulative = weights[r, members[order]].double().cumsum(dim=0) + mass
        position = min(int((cumulative < goal).sum()), values.numel() - 1)
        cuts.append(values[position])
    return torch.stack(cuts)


def _top_p_cut(
    w: Tensor, values: Tensor, kth: Tensor, params: Sequence[SamplingParams]
) -> tuple[Tensor, Tensor]:
    """(cut, reached) per row: the smallest candidate value in the top-p nucleus of the top-k
    survivors, and whether the nucleus closed within the candidates. Rows without top-p get
    (-inf, True)."""
    num_rows, vocab_size = w.shape
    width = values.shape[1]
    device = w.device
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device)
    kept = values.masked_fill(values < kth, NEG_INF)  # candidates surviving top-k
    peak = values[:, :1]
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = torch.exp(kept - peak)
    # Normaliser of the top-k survivors: the candidates, plus entries tied with the k-th value that lie
    # beyond the candidates (only possible when the last candidate is itself a survivor).
    mass = weights.sum(dim=-1, dtype=torch.float64)
    has_k = torch.isfinite(kth.squeeze(1))
    overflow = has_k & (values[:, -1] >= kth.squeeze(1)) & (width < vocab_size)
    if bool(overflow.any()):
        for r in overflow.nonzero().flatten().tolist():
            beyond = int((w[r] >= kth[r]).sum()) - int((kept[r] > NEG_INF).sum())
            mass[r] += beyond * math.exp(float(kth[r] - peak[r]))
    flags = has_k.tolist()
    no_k = [r for r, flag in enumerate(flags) if not flag]
    if no_k:
        # Without top-k the normaliser is the whole row's.
        lse = torch.logsumexp(select_rows(w, no_k, num_rows), dim=-1)
        full = torch.exp(lse.double() - peak.squeeze(1).double()[no_k])
        if len(no_k) == num_rows:
            mass = full
        else:
            mass[torch.tensor(no_k, dtype=torch.long, device=device)] = full
    probs = weights.double() / mass.unsqueeze(1)
    cumulative = probs.cumsum(dim=-1)
    below = (cumulative < top_p.unsqueeze(1)).sum(dim=-1)  # the nucleus is positions 0..below
    reached = below < width
    position = below.clamp(max=width - 1).unsqueeze(1)
    cut = kept.gather(1, position).squeeze(1)
    cut = torch.where(reached, cut, torch.full_like(cut, NEG_INF))
    is_nucleus = top_p < 1.0
    cut = torch.where(is_nucleus, cut, torch.full_like(cut, NEG_INF))
    return cut, reached | ~is_nucleus
