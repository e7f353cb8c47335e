"""Logprob records and prompt scores, from the raw logits.

Logprobs, when requested, are taken from the raw logits: ``logit - logsumexp(logits)`` in float32,
before any transform (bias, penalties, temperature, mask, filters). The chosen token always carries
its own logprob and rank.

Logprob records are the domain's `TokenLogprob`: rank is 1 + the number of vocabulary entries with
a strictly greater logprob (ties share a rank); `top` holds the natural alternatives (id, logprob) by
decreasing logprob, then increasing id, or the explicit ids in caller order (first occurrence kept)
with the sampled token appended when absent. Non-finite logprobs leave the engine as
`NONFINITE_LOGPROB`.

Host reads: `read_tokens_and_logprobs` reads the device once: the sampled ids, together with every
logprob record's number when any row asked for logprobs (one float64 tensor); a logprob row whose
k-th alternative ties with a value beyond it reads once more to order the ties by id.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch
from torch import Tensor

from helios.domain.logprobs import TokenLogprob
from helios.engine.sampling.rows import SamplingRow
from helios.engine.sampling.tensors import row_index, select_rows, to_device

NONFINITE_LOGPROB = -9999.0
"""Stands in for a non-finite logprob in records that leave the engine (JSON has no -inf)."""

MAX_TOP_LOGPROBS = 20
MAX_LOGPROB_TOKEN_IDS = 128


@attrs.frozen
class PromptScore:
    """The raw-distribution score of one prompt token given everything before it."""

    token_id: int
    logprob: float
    rank: int
    """1 + the number of vocabulary entries with a strictly greater logprob (ties share a rank)."""
    top: tuple[tuple[int, float, int], ...]
    """Up to k natural alternatives (id, logprob, rank) by decreasing logprob, then increasing id."""


def prompt_scores(logits: Tensor, target_ids: Sequence[int], k: int) -> list[PromptScore]:
    """Scores for prompt positions: row i of ``logits`` predicts ``target_ids[i]``.

    Columns are the vocabulary (the caller drops padding columns). Non-finite logprobs become -9999.0.
    Rows are independent, so a caller scores a long prompt chunk by chunk and concatenates the results.
    """
    num_positions = len(target_ids)
    if logits.dim() != 2 or logits.shape[0] != num_positions:
        raise ValueError(f"logits shape {tuple(logits.shape)} does not match {num_positions} targets")
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise ValueError(f"k must be within 0..{MAX_TOP_LOGPROBS}, got {k}")
    if num_positions == 0:
        return []
    lp = _log_softmax(logits)
    targets = torch.tensor(list(target_ids), dtype=torch.long, device=lp.device)
    actual = lp.gather(1, targets.unsqueeze(1)).squeeze(1)
    ranks = ((lp > actual.unsqueeze(1)).sum(dim=-1) + 1).tolist()
    alternatives = _natural_top(lp, [k] * num_positions)
    return [
        PromptScore(
            token_id=int(target),
            logprob=_reported(value),
            rank=int(rank),
            top=tuple((token, _reported(alt_value), alt_rank) for token, alt_value, alt_rank in _ranked(top)),
        )
        for target, value, rank, top in zip(target_ids, actual.tolist(), ranks, alternatives, strict=True)
    ]


def prompt_logprobs(logits: Tensor, target_ids: Sequence[int], k: int) -> list[dict[int, tuple[float, int]]]:
    """`prompt_scores` as dicts: token id to (logprob, rank), the actual token first, then up to ``k``
    natural alternatives by decreasing logprob and increasing id."""
    out: list[dict[int, tuple[float, int]]] = []
    for score in prompt_scores(logits, target_ids, k):
        entry = {score.token_id: (score.logprob, score.rank)}
        for token, value, rank in score.top:
            entry.setdefault(token, (value, rank))
        out.append(entry)
    return out


def read_tokens_and_logprobs(
    x: Tensor, rows: Sequence[SamplingRow], picked: Tensor
) -> tuple[list[int], list[TokenLogprob | None]]:
    """The sampled ids ([B] device tensor ``picked``) and the logprob records, in one host read.

    Without logprob rows the read is ``picked`` alone. Otherwise every number the records need (the
    chosen tokens' logprobs and ranks, the natural alternatives' values and ids, the explicit ids'
    values) joins the ids in one float64 tensor, which holds the int64 ids and ranks exactly."""
    num_rows = len(rows)
    out: list[TokenLogprob | None] = [None] * num_rows
    wanted = [i for i, r in enumerate(rows) if r.wants_logprobs]
    if not wanted:
        return picked.tolist(), out
    vocab_size = x.shape[1]
    explicit: dict[int, list[int]] = {}  # position in wanted -> explicit ids (first occurrences)
    for j, i in enumerate(wanted):
        requested = rows[i].logprob_token_ids
        if requested:
            ids = list(dict.fromkeys(int(t) for t in requested))
            if len(ids) > MAX_LOGPROB_TOKEN_IDS or any(not 0 <= t < vocab_size for t in ids):
                raise ValueError(
                    f"logprob_token_ids must be at most {MAX_LOGPROB_TOKEN_IDS} ids within the vocabulary"
                )
            explicit[j] = ids
    device = x.device
    num_wanted = len(wanted)
    lp = _log_softmax(select_rows(x, wanted, num_rows))
    index = row_index(wanted, num_rows, device)
    chosen_ids = picked if index is None else picked.index_select(0, index)
    chosen = lp.gather(1, chosen_ids.unsqueeze(1)).squeeze(1)
    ranks = (lp > chosen.unsqueeze(1)).sum(dim=-1) + 1
    parts = [picked.double(), chosen.double(), ranks.double()]

    natural = [j for j in range(num_wanted) if j not in explicit]
    ks = [rows[wanted[j]].num_top_logprobs or 0 for j in natural]
    width = min(max(ks, default=0) + 1, vocab_size)  # one extra column shows a tie beyond the k-th
    natural_lp: Tensor | None = None
    if max(ks, default=0) > 0:
        natural_lp = select_rows(lp, natural, num_wanted)
        values, indices = natural_lp.topk(width, dim=-1)
        parts += [values.double().flatten(), indices.double().flatten()]
    if explicit:
        flat = [j * vocab_size + t for j, ids in explicit.items() for t in ids]
        parts.append(lp.reshape(-1)[to_device(flat, torch.long, device)].double())
    data: list[float] = torch.cat(parts).tolist()  # the one host read

    tokens = [int(t) for t in data[:num_rows]]
    chosen_values = data[num_rows : num_rows + num_wanted]
    rank_values = data[num_rows + num_wanted : num_rows + 2 * num_wanted]
    at = num_rows + 2 * num_wanted
    tops: dict[int, tuple[tuple[int, float], ...]] = {}
    if natural_lp is not None:
        size = len(natural) * width
        values_l = [data[at + r * width : at + (r + 1) * width] for r in range(len(natural))]
        indices_l = [[int(t) for t in data[at + size + r * width : at + size + (r + 1) * width]]
                     for r in range(len(natural))]
        at += 2 * size
        for j, top in zip(natural, _top_lists(natural_lp, ks, values_l, indices_l), strict=True):
            tops[j] = tuple((token, _reported(value)) for token, value in top)
    for j, ids in explicit.items():
        values_e = data[at : at + len(ids)]
        at += len(ids)
        entries = list(zip(ids, values_e, strict=True))
        token = tokens[wanted[j]]
        if token not in ids:
            entries.append((token, chosen_values[j]))
        tops[j] = tuple((t, _reported(v)) for t, v in entries)
    for j, i in enumerate(wanted):
        out[i] = TokenLogprob(
            token_id=tokens[i], logprob=_reported(chosen_values[j]), rank=int(rank_values[j]), top=tops.get(j, ())
        )
    return tokens, out


def _log_softmax(x: Tensor) -> Tensor:
    """``logit - logsumexp(logits)`` in float32 (a new tensor)."""
    x = x.float()
    return x - torch.logsumexp(x, dim=-1, keepdim=True)


def _natural_top(lp: Tensor, ks: Sequence[int]) -> list[list[tuple[int, float]]]:
    """Per row, its ``ks[r]`` largest entries by decreasing value, then increasing id (exact on ties)."""
    vocab_size = lp.shape[1]
    kmax = min(max(ks, default=0), vocab_size)
    if kmax <= 0:
        return [[] for _ in ks]
    # One extra column tells whether the k-th value is tied with an entry outside the first k.
    width = min(kmax + 1, vocab_size)
    values, indices = lp.topk(width, dim=-1)
    return _top_lists(lp, ks, values.tolist(), indices.tolist())


def _top_lists(
    lp: Tensor, ks: Sequence[int], values_l: list[list[float]], indices_l: list[list[int]]
) -> list[list[tuple[int, float]]]:
    """`_natural_top` from each row's leading ``topk`` values and ids (one more than its k where the
    vocabulary allows). A row whose k-th value ties with the next one reads ``lp`` again for the
    lowest-id tied entries."""
    vocab_size = lp.shape[1]
    out: list[list[tuple[int, float]]] = []
    for r, (values, indices) in enumerate(zip(values_l, indices_l, strict=True)):
        k = min(ks[r], vocab_size)
        if k <= 0:
            out.append([])
            continue
        kth = values[k - 1]
        head = list(zip(indices[:k], values[:k], strict=True))
        if k < len(values) and values[k] == kth:
            # Ties straddle the boundary: keep every greater entry and the lowest-id tied ones.
            row = lp[r]
            greater = [(t, v) for t, v in head if v > kth]
            tied = torch.nonzero(row == kth).flatten()[: k - len(greater)].tolist()
            head = greater + [(int(t), kth) for t in tied]
        head.sort(key=lambda item: (-item[1], item[0]))
        out.append(head)
    return out


def _ranked(top: Sequence[tuple[int, float]]) -> list[tuple[int, float, int]]:
    """Ranks for a natural top list: everything greater precedes an entry, so its rank is the position
    of the first entry with its value, plus one."""
    out: list[tuple[int, float, int]] = []
    rank = 0
    previous: float | None = None
    for position, (token, value) in enumerate(top):
        if previous is None or value != previous:
            rank = position + 1
            previous = value
        out.append((token, value, rank))
    return out


def _reported(value: float) -> float:
    return value if math.isfinite(value) else NONFINITE_LOGPROB
