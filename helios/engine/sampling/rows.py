"""What the sampler knows of each row: its `SamplingRow`, the vectorised path's `RowParams`, and a
step's grammar masks (`RowMasks`) and min_tokens stops (`StopMasks`).

A row is greedy when ``SamplingParams.is_greedy`` or its temperature is below 1e-5 (`is_greedy`,
like vLLM: a temperature too small to divide by safely). A row takes the vectorised path
(`is_plain`) when it has nothing to do but a temperature and perhaps min-p: no penalties, bias,
top-k or top-p (a grammar mask or masked stops keep it there).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np
import torch
from torch import Tensor

from helios.domain.sampling import SamplingParams
from helios.engine.sampling.tensors import NEG_INF, as_index, to_device

_MIN_TEMPERATURE = 1e-5


@attrs.define
class SamplingRow:
    """One running sequence's state as the sampler needs it for one step."""

    params: SamplingParams
    generator: torch.Generator | None
    """The request's own CPU generator (``Sampler.make_generator(seed)``); None uses the process one."""
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    num_top_logprobs: int | None = None
    """None: no logprobs; 0..20: that many natural alternatives."""
    logprob_token_ids: tuple[int, ...] | None = None
    """Explicit ids that replace the natural alternatives (an empty tuple is the same as None)."""
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()
    """The request's EOS and token-stop ids: masked from the draw while the row has fewer than
    ``min_tokens`` output tokens (vLLM's min_tokens), after the logprobs are taken."""

    @property
    def wants_logprobs(self) -> bool:
        return self.num_top_logprobs is not None or bool(self.logprob_token_ids)

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0

    @property
    def masks_stops(self) -> bool:
        """This draw may not take ``stop_ids``: the output is still shorter than ``min_tokens``."""
        return bool(self.stop_ids) and len(self.output_token_ids) < self.min_tokens

    @property
    def transforms_logits(self) -> bool:
        """Anything besides temperature, filters and masks changes this row's logits (penalties, bias)."""
        return self.has_penalties or bool(self.params.logit_bias)


@attrs.frozen
class RowParams:
    """The vectorised path's per-row parameters as tensors on the logits' device, aligned with the
    rows of one ``sample`` call. The runner's persistent batch keeps them per request and gathers
    them each step; without them the sampler builds them from the rows."""

    temperature: Tensor
    """float32 [B]: ``row_temperature`` of each row (1.0 for greedy rows)."""
    log_min_p: Tensor
    """float32 [B]: ``row_log_min_p`` of each row (-inf where min-p is off)."""

    @classmethod
    def of(cls, rows: Sequence[SamplingRow], device: torch.device) -> RowParams:
        return cls(
            to_device([row_temperature(r.params) for r in rows], torch.float32, device),
            to_device([row_log_min_p(r.params) for r in rows], torch.float32, device),
        )


def row_temperature(params: SamplingParams) -> float:
    """The temperature a row's logits are divided by (1.0 for greedy rows, which are never divided)."""
    return 1.0 if is_greedy(params) else params.temperature


def row_log_min_p(params: SamplingParams) -> float:
    """log(min_p), the min-p threshold's offset from a row's peak logit; -inf where min-p is off."""
    return math.log(params.min_p) if params.min_p > 0.0 else NEG_INF


def is_plain(row: SamplingRow, vocab_size: int) -> bool:
    """Whether the row takes the vectorised path: greedy, or a temperature draw with at most min-p,
    and nothing that transforms its logits (penalties, bias; masks keep it there)."""
    params = row.params
    if row.transforms_logits:
        return False
    return is_greedy(params) or (params.top_p >= 1.0 and not top_k_active(params, vocab_size))


def is_greedy(params: SamplingParams) -> bool:
    # Like vLLM, a temperature too small to divide by safely means greedy.
    return params.is_greedy or params.temperature < _MIN_TEMPERATURE


def top_k_active(params: SamplingParams, vocab_size: int) -> bool:
    return 1 < params.top_k < vocab_size


@attrs.frozen
class RowMasks:
    """Grammar masks of some rows of one ``sample`` call: batch row -> index into ``disallowed``
    ([M, vocab] bool, True where a token is not allowed)."""

    where: dict[int, int]
    disallowed: Tensor

    def touches(self, rows: Sequence[int]) -> bool:
        return any(i in self.where for i in rows)

    def apply(self, w: Tensor, rows: Sequence[int], value: float = NEG_INF) -> None:
        """Sets the disallowed tokens of ``w`` (row j holds batch row ``rows[j]``) to ``value`` in
        place. On the CPU through numpy, one single-threaded pass per row (a torch op per row pays
        the intra-op thread pool's wake-up each time)."""
        pairs = self._pairs(rows)
        if not pairs:
            return
        if w.device.type == "cpu":
            wn, dn = w.numpy(), self.disallowed.numpy()
            for j, k in pairs:
                np.putmask(wn[j], dn[k], value)
            return
        js = as_index([j for j, _ in pairs], w.device)
        ks = as_index([k for _, k in pairs], w.device)
        w.index_copy_(0, js, w.index_select(0, js).masked_fill_(self.disallowed.index_select(0, ks), value))

    def floor(self, w: Tensor, rows: Sequence[int], low: float) -> None:
        """Raises the masked rows of ``w`` to at least ``low`` in place."""
        pairs = self._pairs(rows)
        if w.device.type == "cpu":
            wn = w.numpy()
            for j, _ in pairs:
                np.maximum(wn[j], low, out=wn[j])
        elif pairs:
            js = as_index([j for j, _ in pairs], w.device)
            w.index_copy_(0, js, w.index_select(0, js).clamp_min_(low))

    def _pairs(self, rows: Sequence[int]) -> list[tuple[int, int]]:
        return [(j, self.where[i]) for j, i in enumerate(rows) if i in self.where]


@attrs.frozen
class StopMasks:
    """The stop ids that min_tokens masks in one ``sample`` call: batch row -> the ids
    (`SamplingRow.masks_stops` rows only)."""

    where: dict[int, tuple[int, ...]]

    @classmethod
    def of(cls, rows: Sequence[SamplingRow], vocab_size: int) -> StopMasks | None:
        """Ids past the sampled vocabulary are never drawn anyway (and are left out)."""
        where = {i: tuple(t for t in row.stop_ids if t < vocab_size) for i, row in enumerate(rows) if row.masks_stops}
        return cls(where) if where else None

    def touches(self, rows: Sequence[int]) -> bool:
        return any(i in self.where for i in rows)

    def apply(self, w: Tensor, rows: Sequence[int], value: float = NEG_INF) -> None:
        """Sets the stop ids of ``w`` (row j holds batch row ``rows[j]``) to ``value`` in place: one
        indexed write for all rows."""
        js = [j for j, i in enumerate(rows) for _ in self.where.get(i, ())]
        if js:
            ids = [t for i in rows for t in self.where.get(i, ())]
            w.index_put_((as_index(js, w.device), as_index(ids, w.device)),
                         torch.tensor(value, dtype=w.dtype, device=w.device))

    def hits(self, picked: Tensor, rows: Sequence[int]) -> list[int]:
        """The positions j whose greedy pick ``picked[j]`` (of batch row ``rows[j]``) is one of its
        stops: the picks a mask would change (a pick that is no stop is the masked argmax too,
        ties included, since a stop tied below it would have been picked). Reads ``picked``."""
        touched = [j for j, i in enumerate(rows) if i in self.where]
        if not touched:
            return []
        values = picked.tolist()
        return [j for j in touched if values[j] in self.where[rows[j]]]
