"""Logit bias and penalties, on a step's working copy of the logits.

Logit bias (``SamplingParams.logit_bias``) is added to the raw logits, as vLLM applies it: after the
logprobs are taken, so they stay raw. Penalties: repetition over prompt and output tokens (positive
logits divided, negative multiplied), then frequency and presence over output tokens only. The
sampler applies both to the temperature-scaled logits with the same scale (``scales``, 1 /
temperature), which equals applying them first: both commute with a positive temperature. Penalty
and bias rows copy their host values to the device blocking.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from helios.engine.sampling.rows import SamplingRow


def apply_penalties(logits: Tensor, rows: Sequence[SamplingRow]) -> None:
    """Applies each row's repetition, frequency and presence penalties to [B, V] float logits in place."""
    apply_scaled_penalties(logits, rows, [1.0] * len(rows))


def apply_scaled_penalties(w: Tensor, rows: Sequence[SamplingRow], scales: Sequence[float]) -> None:
    """Penalties on [S, V] ``w`` in place, all rows at once. ``scales[j]`` (1/temperature) applies to
    row j's additive terms, so the result equals penalising first and dividing by the temperature
    after; the repetition penalty commutes with a positive temperature."""
    if not w.is_contiguous():
        staged = w.contiguous()
        apply_scaled_penalties(staged, rows, scales)
        w.copy_(staged)
        return
    seen = _TokenSet()
    produced = _TokenSet()
    for j, row in enumerate(rows):
        params = row.params
        if params.repetition_penalty != 1.0:
            seen.add(j, row.prompt_token_ids)
            seen.add(j, row.output_token_ids)
        if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
            produced.add(j, row.output_token_ids)
    vocab_size = w.shape[1]
    flat = w.view(-1)
    device = w.device
    if seen.parts:
        owner, index = seen.flat_ids(vocab_size)
        factors = torch.tensor([r.params.repetition_penalty for r in rows], dtype=w.dtype)[owner]
        index, factors = index.to(device), factors.to(device)
        # Duplicate ids gather the same value and write the same result.
        values = flat[index]
        flat[index] = torch.where(values > 0, values / factors, values * factors)
    if produced.parts:
        _, index = produced.flat_ids(vocab_size)
        unique, counts = torch.unique(index, return_counts=True)
        owner = unique // vocab_size
        table = torch.tensor(
            [
                (r.params.frequency_penalty, r.params.presence_penalty, scale)
                for r, scale in zip(rows, scales, strict=True)
            ],
            dtype=w.dtype,
        )
        fp, pp, scale = table[owner].unbind(dim=1)
        penalty = (counts.to(w.dtype) * fp + pp) * scale
        index = unique.to(device)
        flat[index] = flat[index] - penalty.to(device)


def apply_logit_bias(w: Tensor, rows: Sequence[SamplingRow], scales: Sequence[float]) -> None:
    """Adds each row's bias, times its scale (1/temperature), to [S, V] ``w`` in place (one scatter)."""
    vocab_size = w.shape[1]
    flat_index: list[int] = []
    values: list[float] = []
    for j, (row, scale) in enumerate(zip(rows, scales, strict=True)):
        for token, bias in row.params.logit_bias:
            if 0 <= token < vocab_size:
                flat_index.append(j * vocab_size + token)
                values.append(bias * scale)
    if flat_index:
        index = torch.tensor(flat_index, dtype=torch.long, device=w.device)
        w.view(-1).index_add_(0, index, torch.tensor(values, dtype=w.dtype, device=w.device))


class _TokenSet:
    """Token ids of several rows, gathered for one batched index operation."""

    def __init__(self) -> None:
        self.parts: list[Tensor] = []
        self.owners: list[int] = []

    def add(self, row: int, ids: Sequence[int]) -> None:
        if len(ids):
            self.parts.append(_as_long(ids))
            self.owners.append(row)

    def flat_ids(self, vocab_size: int) -> tuple[Tensor, Tensor]:
        """(owning row, row * vocab_size + id) per id, ids outside the vocabulary left out (CPU)."""
        ids = torch.cat(self.parts)
        lengths = torch.tensor([part.numel() for part in self.parts], dtype=torch.long)
        owner = torch.repeat_interleave(torch.tensor(self.owners, dtype=torch.long), lengths)
        valid = (ids >= 0) & (ids < vocab_size)
        owner, ids = owner[valid], ids[valid]
        return owner, owner * vocab_size + ids


def _as_long(ids: Sequence[int]) -> Tensor:
    if isinstance(ids, Tensor):
        return ids.to(torch.long).flatten().cpu()
    if isinstance(ids, np.ndarray):
        return torch.from_numpy(ids.astype(np.int64, copy=False)).flatten()
    return torch.tensor(ids if isinstance(ids, list) else list(ids), dtype=torch.long)
