"""Token sampling over one engine step's batch of raw logits.

Per row, in this order (vLLM semantics):

1. Logprobs, when requested, from the raw logits: ``logit - logsumexp(logits)`` in float32, before any
   transform. The chosen token always carries its own logprob and rank.
2. Logit bias (``SamplingParams.logit_bias``), added to the raw logits, as vLLM applies it: after
   the logprobs are taken, so they stay raw.
3. Penalties: repetition over prompt and output tokens (positive logits divided, negative multiplied),
   then frequency and presence over output tokens only.
4. Temperature (skipped for greedy rows). The bias and the penalties are applied to the scaled
   logits with the same scale, which equals applying them first: both commute with a positive
   temperature.
5. The optional token mask (grammar): disallowed tokens get ``-inf``. Per-row grammar masks
   (``masked_rows``) do not send a row off the vectorised path: it fills its masked rows in its
   workspace.
6. Filters: top-k, then top-p over the top-k renormalised distribution, then min-p. Every filter keeps
   all tokens tied with its boundary value, so ties never depend on a sort's order.
7. The draw. Greedy rows (``SamplingParams.is_greedy``, or a temperature below 1e-5) take the argmax,
   ties to the lowest token id.
   Other rows use inverse-CDF sampling in token-id order with one float64 uniform from the row's own
   CPU generator per step.

Two paths, one result. Rows with nothing to do but a temperature and perhaps min-p (no penalties,
bias, mask, top-k or top-p) take the vectorised path (`Sampler._sample_plain`): one argmax for the
greedy ones, one scaled whole-vocabulary inverse-CDF draw for the others, with per-row parameters as
tensors (`RowParams`, which the runner's persistent batch keeps per request). Every other row takes
the general path. Both compute the same float operations on a row, so a row gets the same token on
either (``Sampler(fast_path=False)`` sends every row through the general path; the tests compare).

Reproducibility: a seeded row consumes exactly one uniform from its own generator per sampling step,
and every other quantity it uses is computed from its own logits row, so the batch it runs in cannot
change its tokens. Unseeded rows share the sampler's process generator: one call per step draws the
uniforms of every unseeded row that samples, in row order. Generators live on the CPU even when the
logits are on an accelerator: the uniforms are written into one float64 tensor (one generator call
per seeded row, one for all unseeded rows) that crosses to the device once; no per-row kernel is
launched on the device. (An exponential race would also be batch-independent but draws V values per
row and step; on the CPU it measured ten times slower than the inverse CDF, which needs one.)

Host reads (device syncs): ``sample`` reads device values once per call, at the end: the sampled
ids, together with every logprob record's numbers when any row asked for logprobs (one float64
tensor). Only the general path's filters read more: a top-k or top-p row's candidate decisions, a
wide nucleus's bucket cut; and a logprob row whose k-th alternative ties with a value beyond it
reads once more to order the ties by id. Host values the vectorised path sends to an accelerator
(uniforms, row indices) go through pinned memory in non-blocking copies, since a blocking
host-to-device copy waits for the device as well (penalty and bias rows still copy blocking).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np
import torch
from torch import Tensor

from helios.domain.logprobs import TokenLogprob
from helios.domain.sampling import SamplingParams

NONFINITE_LOGPROB = -9999.0
"""Stands in for a non-finite logprob in records that leave the engine (JSON has no -inf)."""

MAX_TOP_LOGPROBS = 20
MAX_LOGPROB_TOKEN_IDS = 128

# Top-p without top-k first looks for its cut among this many of the most likely tokens; a wider
# nucleus is located through value buckets (``_top_p_bucket_cut``) instead of a sort of the vocabulary.
_TOP_P_CANDIDATES = 256
_BUCKETS = 2048
_NEG_INF = float("-inf")
_BLOCK = 256  # tokens per block of the full-vocabulary inverse CDF
_SEED_MASK = 0xFFFF_FFFF_FFFF_FFFF
_MIN_TEMPERATURE = 1e-5
_EXP_FLOOR = -80.0  # exp(-80) is a normal float32 (~1.8e-35); below about -87 exp underflows (slowly)


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

    @property
    def wants_logprobs(self) -> bool:
        return self.num_top_logprobs is not None or bool(self.logprob_token_ids)

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0

    @property
    def transforms_logits(self) -> bool:
        """Anything besides temperature and filters changes this row's logits (penalties, bias)."""
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
            _to_device([row_temperature(r.params) for r in rows], torch.float32, device),
            _to_device([row_log_min_p(r.params) for r in rows], torch.float32, device),
        )


def row_temperature(params: SamplingParams) -> float:
    """The temperature a row's logits are divided by (1.0 for greedy rows, which are never divided)."""
    return 1.0 if _is_greedy(params) else params.temperature


def row_log_min_p(params: SamplingParams) -> float:
    """log(min_p), the min-p threshold's offset from a row's peak logit; -inf where min-p is off."""
    return math.log(params.min_p) if params.min_p > 0.0 else _NEG_INF


def is_plain(row: SamplingRow, vocab_size: int) -> bool:
    """Whether the row takes the vectorised path: greedy, or a temperature draw with at most min-p,
    and nothing that transforms its logits (penalties, bias)."""
    params = row.params
    if row.transforms_logits:
        return False
    return _is_greedy(params) or (params.top_p >= 1.0 and not _top_k_active(params, vocab_size))


# Logprob records are the domain's `TokenLogprob`: rank is 1 + the number of vocabulary entries with
# a strictly greater logprob (ties share a rank); `top` holds the natural alternatives (id, logprob) by
# decreasing logprob, then increasing id, or the explicit ids in caller order (first occurrence kept)
# with the sampled token appended when absent.


class Sampler:
    """Samples one token per row from a batch of logits; stateless apart from the process generator."""

    def __init__(self, vocab_size: int, device: str | torch.device = "cpu", *, fast_path: bool = True) -> None:
        """``device`` is where the logits live; generators and uniforms stay on the CPU.
        ``fast_path=False`` sends every row through the general path (a reference for tests)."""
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.fast_path = fast_path
        self._generator = torch.Generator()
        self._generator.seed()
        self._buffer: Tensor | None = None

    @staticmethod
    def make_generator(seed: int | None) -> torch.Generator | None:
        """A request's CPU generator for ``seed``; None when the request has no seed."""
        if seed is None:
            return None
        generator = torch.Generator()
        generator.manual_seed(seed & _SEED_MASK)
        return generator

    def sample(
        self,
        logits: Tensor,
        rows: Sequence[SamplingRow],
        *,
        token_mask: Tensor | None = None,
        masked_rows: Sequence[int] | None = None,
        row_params: RowParams | None = None,
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """One token per row, and its logprob record for the rows that asked for one.

        ``logits`` is [B, V'] of any float dtype with V' >= vocab_size (columns beyond the vocabulary
        are padding and ignored). ``token_mask`` is an optional bool tensor, True where a token is
        allowed: [B, vocab_size] for every row, or, with ``masked_rows`` (row indices, increasing),
        one row per masked row; the other rows are unmasked and keep the vectorised path.
        ``row_params``: the rows' `RowParams` when the caller keeps them (built from the rows
        otherwise). No tensor passed in is modified.
        """
        num_rows = len(rows)
        if logits.dim() != 2 or logits.shape[0] != num_rows:
            raise ValueError(f"logits shape {tuple(logits.shape)} does not match {num_rows} rows")
        vocab_size = self.vocab_size
        if logits.shape[1] < vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns, fewer than vocab_size {vocab_size}")
        if num_rows == 0:
            return [], []
        x = logits[:, :vocab_size]
        if x.dtype != torch.float32:
            x = x.float()
        # x may be the caller's tensor: it is read, never written.

        plain: list[int] = []
        general: list[int] = []
        drawing: list[int] = []  # rows that consume a uniform (every row that is not greedy)
        # Per-row masks (grammar rows): row -> its disallowed tokens. Each path sets them to -inf in
        # its own working copy (the vectorised one in its workspace, no extra copy), after the
        # temperature, which equals masking before it (-inf stays -inf); logprobs read `x`.
        masks: RowMasks | None = None
        if token_mask is not None and masked_rows is not None:
            masks = RowMasks({r: k for k, r in enumerate(masked_rows)}, ~token_mask[:, :vocab_size].to(x.device))
            token_mask = None
        vectorise = self.fast_path and token_mask is None
        for i, row in enumerate(rows):
            if not _is_greedy(row.params):
                drawing.append(i)
            if vectorise and is_plain(row, vocab_size):
                plain.append(i)
            else:
                general.append(i)
        uniforms = _to_device(self._uniforms(rows, drawing), torch.float64, x.device) if drawing else None
        if not general:
            picked = self._sample_plain(x, rows, plain, uniforms, row_params, masks)
        else:
            picked = self._sample_transformed(x, rows, general, token_mask, uniforms, masks)
            if plain:
                picked = torch.empty(num_rows, dtype=torch.long, device=x.device).index_copy_(
                    0, _index(general, x.device), picked)
                picked.index_copy_(0, _index(plain, x.device),
                                   self._sample_plain(x, rows, plain, uniforms, row_params, masks))
        return _read_tokens_and_logprobs(x, rows, picked)

    def _sample_plain(
        self,
        x: Tensor,
        rows: Sequence[SamplingRow],
        plain: list[int],
        uniforms: Tensor | None,
        row_params: RowParams | None,
        masks: RowMasks | None = None,
    ) -> Tensor:
        """The vectorised path for ``plain`` rows (greedy, or temperature and min-p only): their
        sampled ids as a device tensor aligned with ``plain``, with no host read and no per-row
        tensor operation (but one masking fill per grammar-masked row, ``masks``). The float
        operations on a row are the general path's, so a row's token does not depend on which path
        took it."""
        num_rows = x.shape[0]
        device = x.device
        greedy: list[int] = []
        drawn: list[int] = []
        scaled = min_p = False
        for j, i in enumerate(plain):
            params = rows[i].params
            if _is_greedy(params):
                greedy.append(j)
            else:
                drawn.append(j)
                scaled = scaled or params.temperature != 1.0
                min_p = min_p or params.min_p > 0.0
        if not drawn:
            return _argmax_rows(x, plain, num_rows, masks)
        rows_drawn = [plain[j] for j in drawn]
        index = _row_index(rows_drawn, num_rows, device)
        # The scaled logits and then the weights live in the sampler's workspace (x is only read).
        buffer = self._workspace(len(rows_drawn), x.shape[1], device)
        w = x if index is None else torch.index_select(x, 0, index, out=buffer)
        tensors = row_params if row_params is not None else RowParams.of(rows, device) if scaled or min_p else None
        if scaled:
            assert tensors is not None
            temperature = tensors.temperature if index is None else tensors.temperature.index_select(0, index)
            w = torch.div(w, temperature.unsqueeze(1), out=buffer)
        if masks is not None and masks.touches(rows_drawn):
            if w is x:
                w = buffer.copy_(x)
            masks.apply(w, rows_drawn)
        peak = w.amax(dim=-1, keepdim=True)
        excluded: Tensor | None = None
        if min_p:
            assert tensors is not None
            log_min_p = tensors.log_min_p if index is None else tensors.log_min_p.index_select(0, index)
            excluded = w < (peak.squeeze(1) + log_min_p).unsqueeze(1)
        weights = torch.sub(w, _finite_peak(peak), out=buffer)
        if masks is not None and masks.touches(rows_drawn):
            # exp of -inf (or of anything that underflows) takes a slow path on the CPU, several
            # times slower than the whole row: masked rows are floored first and their masked
            # tokens zeroed after. Unmasked rows are untouched.
            masks.floor(weights, rows_drawn, _EXP_FLOOR)
            weights.exp_()
            masks.apply(weights, rows_drawn, 0.0)
        else:
            weights.exp_()
        if excluded is not None:
            weights.masked_fill_(excluded, 0.0)
        assert uniforms is not None
        u = uniforms if index is None else uniforms.index_select(0, index)
        sampled = _blocked_inverse_cdf(weights, u)
        if not greedy:
            return sampled
        picked = torch.empty(len(plain), dtype=torch.long, device=device)
        picked.index_copy_(0, _index(drawn, device), sampled)
        picked.index_copy_(0, _index(greedy, device), _argmax_rows(x, [plain[j] for j in greedy], num_rows, masks))
        return picked

    def _workspace(self, num_rows: int, width: int, device: torch.device) -> Tensor:
        """A float32 [num_rows, width] buffer kept between calls for the vectorised draw's weights
        (a fresh vocabulary-sized tensor per step costs page faults on the CPU)."""
        buffer = self._buffer
        if buffer is None or buffer.device != device or buffer.shape[1] != width or buffer.shape[0] < num_rows:
            rows = max(num_rows, 0 if buffer is None else buffer.shape[0])
            with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode
                buffer = self._buffer = torch.empty(rows, width, dtype=torch.float32, device=device)
        return buffer[:num_rows]

    def _sample_transformed(
        self,
        x: Tensor,
        rows: Sequence[SamplingRow],
        work: list[int],
        token_mask: Tensor | None,
        uniforms: Tensor | None,
        masks: RowMasks | None = None,
    ) -> Tensor:
        """The general path: rows that need penalties, bias, a mask or filters. Their sampled ids as a
        device tensor aligned with ``work``."""
        num_rows = x.shape[0]
        device = x.device
        work_rows = [rows[i] for i in work]
        temperatures = [row_temperature(r.params) for r in work_rows]
        index = _row_index(work, num_rows, device)
        scaled = any(t != 1.0 for t in temperatures)
        # w is this step's private copy: penalties, the mask and the draw write it in place.
        if index is None:
            w = x / _column(temperatures, device) if scaled else x.clone()
        else:
            w = x.index_select(0, index)
            if scaled:
                w.div_(_column(temperatures, device))
        scales = [1.0 / t for t in temperatures]  # bias and penalties act before the temperature
        if any(r.params.logit_bias for r in work_rows):
            _apply_logit_bias(w, work_rows, scales)
        if any(r.has_penalties for r in work_rows):
            _apply_penalties(w, work_rows, scales)
        if masks is not None:
            masks.apply(w, work)
        if token_mask is not None:
            mask = token_mask[:, : self.vocab_size]
            if index is not None:
                mask = mask.index_select(0, index.to(mask.device))
            w.masked_fill_(~mask.to(device), _NEG_INF)

        greedy = [j for j, r in enumerate(work_rows) if _is_greedy(r.params)]
        drawn = [j for j, r in enumerate(work_rows) if not _is_greedy(r.params)]
        if not drawn:
            return w.argmax(dim=-1)
        ws = _select_rows(w, drawn, len(work))
        survivors = _survivors(ws, [work_rows[j].params for j in drawn])
        assert uniforms is not None
        drawn_index = _row_index([work[j] for j in drawn], num_rows, device)
        sampled = _draw(ws, survivors, uniforms if drawn_index is None else uniforms.index_select(0, drawn_index))
        if not greedy:
            return sampled
        picked = torch.empty(len(work), dtype=torch.long, device=device)
        picked.index_copy_(0, _index(drawn, device), sampled)
        picked.index_copy_(0, _index(greedy, device), _select_rows(w, greedy, len(work)).argmax(dim=-1))
        return picked

    def _uniforms(self, rows: Sequence[SamplingRow], drawing: list[int]) -> Tensor:
        """[B] float64 uniforms in [0, 1) on the CPU for the ``drawing`` rows (0 elsewhere): seeded
        rows from their own generator, the unseeded ones from the process generator in one call, in
        row order. Written in place, never read back."""
        unseeded = [i for i in drawing if rows[i].generator is None]
        if len(unseeded) == len(rows):
            return torch.rand(len(rows), generator=self._generator, dtype=torch.float64)
        out = torch.zeros(len(rows), dtype=torch.float64)
        if unseeded:
            out[torch.tensor(unseeded)] = torch.rand(len(unseeded), generator=self._generator, dtype=torch.float64)
        for i in drawing:
            generator = rows[i].generator
            if generator is not None:
                out[i : i + 1].uniform_(generator=generator)
        return out


def draws_uniform(params: SamplingParams) -> bool:
    """Whether a row with these parameters consumes a uniform per ``sample`` call (every row that
    is not greedy)."""
    return not _is_greedy(params)


def consume_uniforms(generator: torch.Generator, count: int) -> None:
    """Advance a seeded row's generator by ``count`` draws exactly as ``count`` sampling steps do
    (speculative verification rewinds a generator to the draws of the tokens it committed)."""
    one = torch.empty(1, dtype=torch.float64)
    for _ in range(count):
        one.uniform_(generator=generator)


def apply_penalties(logits: Tensor, rows: Sequence[SamplingRow]) -> None:
    """Applies each row's repetition, frequency and presence penalties to [B, V] float logits in place."""
    _apply_penalties(logits, rows, [1.0] * len(rows))


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


# -- private helpers ------------------------------------------------------------------------------


def _read_tokens_and_logprobs(
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
    lp = _log_softmax(_select_rows(x, wanted, num_rows))
    index = _row_index(wanted, num_rows, device)
    chosen_ids = picked if index is None else picked.index_select(0, index)
    chosen = lp.gather(1, chosen_ids.unsqueeze(1)).squeeze(1)
    ranks = (lp > chosen.unsqueeze(1)).sum(dim=-1) + 1
    parts = [picked.double(), chosen.double(), ranks.double()]

    natural = [j for j in range(num_wanted) if j not in explicit]
    ks = [rows[wanted[j]].num_top_logprobs or 0 for j in natural]
    width = min(max(ks, default=0) + 1, vocab_size)  # one extra column shows a tie beyond the k-th
    natural_lp: Tensor | None = None
    if max(ks, default=0) > 0:
        natural_lp = _select_rows(lp, natural, num_wanted)
        values, indices = natural_lp.topk(width, dim=-1)
        parts += [values.double().flatten(), indices.double().flatten()]
    if explicit:
        flat = [j * vocab_size + t for j, ids in explicit.items() for t in ids]
        parts.append(lp.reshape(-1)[_to_device(flat, torch.long, device)].double())
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


def _argmax_rows(x: Tensor, selected: list[int], num_rows: int, masks: RowMasks | None) -> Tensor:
    """Greedy picks of the ``selected`` rows; a grammar-masked row's among its allowed tokens."""
    if masks is None or not masks.touches(selected):
        return _select_rows(x, selected, num_rows).argmax(dim=-1)
    w = x.index_select(0, _index(selected, x.device))
    masks.apply(w, selected)
    return w.argmax(dim=-1)


@attrs.frozen
class RowMasks:
    """Grammar masks of some rows of one ``sample`` call: batch row -> index into ``disallowed``
    ([M, vocab] bool, True where a token is not allowed)."""

    where: dict[int, int]
    disallowed: Tensor

    def touches(self, rows: Sequence[int]) -> bool:
        return any(i in self.where for i in rows)

    def apply(self, w: Tensor, rows: Sequence[int], value: float = _NEG_INF) -> None:
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
        js = _index([j for j, _ in pairs], w.device)
        ks = _index([k for _, k in pairs], w.device)
        w.index_copy_(0, js, w.index_select(0, js).masked_fill_(self.disallowed.index_select(0, ks), value))

    def floor(self, w: Tensor, rows: Sequence[int], low: float) -> None:
        """Raises the masked rows of ``w`` to at least ``low`` in place."""
        pairs = self._pairs(rows)
        if w.device.type == "cpu":
            wn = w.numpy()
            for j, _ in pairs:
                np.maximum(wn[j], low, out=wn[j])
        elif pairs:
            js = _index([j for j, _ in pairs], w.device)
            w.index_copy_(0, js, w.index_select(0, js).clamp_min_(low))

    def _pairs(self, rows: Sequence[int]) -> list[tuple[int, int]]:
        return [(j, self.where[i]) for j, i in enumerate(rows) if i in self.where]


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


def _apply_penalties(w: Tensor, rows: Sequence[SamplingRow], scales: Sequence[float]) -> None:
    """Penalties on [S, V] ``w`` in place, all rows at once. ``scales[j]`` (1/temperature) applies to
    row j's additive terms, so the result equals penalising first and dividing by the temperature
    after; the repetition penalty commutes with a positive temperature."""
    if not w.is_contiguous():
        staged = w.contiguous()
        _apply_penalties(staged, rows, scales)
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


def _apply_logit_bias(w: Tensor, rows: Sequence[SamplingRow], scales: Sequence[float]) -> None:
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


def _is_greedy(params: SamplingParams) -> bool:
    # Like vLLM, a temperature too small to divide by safely means greedy.
    return params.is_greedy or params.temperature < _MIN_TEMPERATURE


def _top_k_active(params: SamplingParams, vocab_size: int) -> bool:
    return 1 < params.top_k < vocab_size


@attrs.define
class _Survivors:
    """What the filters leave of each row: every token whose (temperature-scaled) logit is at least the
    row's threshold. Rows whose survivors all lie among their leading candidates also carry those
    candidates, so their draw never scans the vocabulary."""

    thresholds: Tensor | None
    """[S]; -inf where a row filters nothing; None when no row filters."""
    candidate_rows: list[int] = attrs.field(factory=list)
    candidate_values: Tensor | None = None
    """[len(candidate_rows), width] logits, sorted in decreasing order."""
    candidate_ids: Tensor | None = None


def _survivors(w: Tensor, params: Sequence[SamplingParams]) -> _Survivors:
    num_rows, vocab_size = w.shape
    device = w.device
    thresholds: Tensor | None = None
    if any(p.min_p > 0.0 for p in params):
        log_min_p = [math.log(p.min_p) if p.min_p > 0.0 else _NEG_INF for p in params]
        thresholds = w.amax(dim=-1) + torch.tensor(log_min_p, dtype=w.dtype, device=device)
    filtered = [j for j, p in enumerate(params) if _top_k_active(p, vocab_size) or p.top_p < 1.0]
    if not filtered:
        return _Survivors(thresholds)
    top = _top_k_top_p(_select_rows(w, filtered, num_rows), [params[j] for j in filtered])
    assert top.thresholds is not None
    if thresholds is None:
        thresholds = torch.full((num_rows,), _NEG_INF, dtype=w.dtype, device=device)
    index = _row_index(filtered, num_rows, device)
    if index is None:
        thresholds = torch.maximum(thresholds, top.thresholds)
    else:
        thresholds[index] = torch.maximum(thresholds[index], top.thresholds)
    out = _Survivors(thresholds)
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
            selected = _row_index(keep, len(rows), device)
            out.candidate_values = values if selected is None else values.index_select(0, selected)
            out.candidate_ids = (
                top.candidate_ids if selected is None else top.candidate_ids.index_select(0, selected)
            )
    return out


def _top_k_top_p(w: Tensor, params: Sequence[SamplingParams]) -> _Survivors:
    """Thresholds for rows with top-k and/or top-p; top-p applies to the top-k renormalised
    distribution.

    Every row first looks among its sorted leading candidates (its top k + 1, or the top 256 without
    top-k); rows settled there come back with their candidates. A top-p row whose nucleus extends
    beyond them (a flat distribution) finds its cut through value buckets.
    """
    num_rows, vocab_size = w.shape
    device = w.device
    out = _Survivors(torch.full((num_rows,), _NEG_INF, dtype=w.dtype, device=device))
    ks = [p.top_k if _top_k_active(p, vocab_size) else 0 for p in params]
    width = min(vocab_size, max(k + 1 if k else _TOP_P_CANDIDATES for k in ks))
    if width < vocab_size:
        values, ids = w.topk(width, dim=-1)
    else:
        values, ids = w.sort(dim=-1, descending=True)
    has_k = torch.tensor([k > 0 for k in ks], device=device)
    kth = values.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=device).unsqueeze(1))
    kth = torch.where(has_k.unsqueeze(1), kth, torch.full_like(kth, _NEG_INF))
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
        selected = _row_index(done, num_rows, device)
        _store(out, done, result if selected is None else result.index_select(0, selected))
        out.candidate_rows = done
        out.candidate_values = values if selected is None else values.index_select(0, selected)
        out.candidate_ids = ids if selected is None else ids.index_select(0, selected)

    if pending:
        # Only top-p rows without top-k remain, with a nucleus wider than their candidates.
        index = torch.tensor(pending, dtype=torch.long, device=device)
        _store(out, pending, _top_p_bucket_cut(w.index_select(0, index), [params[r] for r in pending]))
    return out


def _store(out: _Survivors, rows: list[int], thresholds: Tensor) -> None:
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
    peak = _finite_peak(w.amax(dim=-1, keepdim=True))
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
    kept = values.masked_fill(values < kth, _NEG_INF)  # candidates surviving top-k
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
            beyond = int((w[r] >= kth[r]).sum()) - int((kept[r] > _NEG_INF).sum())
            mass[r] += beyond * math.exp(float(kth[r] - peak[r]))
    flags = has_k.tolist()
    no_k = [r for r, flag in enumerate(flags) if not flag]
    if no_k:
        # Without top-k the normaliser is the whole row's.
        lse = torch.logsumexp(_select_rows(w, no_k, num_rows), dim=-1)
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
    cut = torch.where(reached, cut, torch.full_like(cut, _NEG_INF))
    is_nucleus = top_p < 1.0
    cut = torch.where(is_nucleus, cut, torch.full_like(cut, _NEG_INF))
    return cut, reached | ~is_nucleus


def _draw(w: Tensor, survivors: _Survivors, uniforms: Tensor) -> Tensor:
    """One token per row from softmax(w) restricted to the survivors; overwrites ``w``.

    Inverse-CDF sampling in token-id order, so a row drawn from its candidates and the same row drawn
    over the whole vocabulary (where the others weigh exactly zero) give the same token for the same
    uniform, up to float64 rounding.
    """
    num_rows = w.shape[0]
    device = w.device
    picked = torch.empty(num_rows, dtype=torch.long, device=device)
    by_candidates = survivors.candidate_rows
    if by_candidates and survivors.candidate_values is not None and survivors.candidate_ids is not None:
        index = torch.tensor(by_candidates, dtype=torch.long, device=device)
        values = survivors.candidate_values
        thresholds = survivors.thresholds
        assert thresholds is not None
        weights = torch.exp(values - _finite_peak(values[:, :1]))
        weights.masked_fill_(values < thresholds[index].unsqueeze(1), 0.0)
        ids, order = survivors.candidate_ids.sort(dim=-1)
        position = _inverse_cdf(weights.gather(1, order), uniforms[index])
        picked[index] = ids.gather(1, position.unsqueeze(1)).squeeze(1)
    chosen = set(by_candidates)
    rest = [r for r in range(num_rows) if r not in chosen]
    if rest:
        sub = _select_rows(w, rest, num_rows)
        excluded: Tensor | None = None
        if survivors.thresholds is not None:
            thresholds = survivors.thresholds
            if len(rest) < num_rows:
                thresholds = thresholds[torch.tensor(rest, dtype=torch.long, device=device)]
            excluded = sub < thresholds.unsqueeze(1)
        weights = sub.sub_(_finite_peak(sub.amax(dim=-1, keepdim=True))).exp_()
        if excluded is not None:
            weights.masked_fill_(excluded, 0.0)
        position = _blocked_inverse_cdf(weights, uniforms if len(rest) == num_rows else uniforms[rest])
        if len(rest) == num_rows:
            return position
        picked[torch.tensor(rest, dtype=torch.long, device=device)] = position
    return picked


def _finite_peak(peak: Tensor) -> Tensor:
    return torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))


def _inverse_cdf(weights: Tensor, uniforms: Tensor) -> Tensor:
    """Per row, the position whose cumulative weight interval (float64) holds ``u * total``."""
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1]
    return _search(cdf, torch.minimum(uniforms * total, _just_below(total)))


def _blocked_inverse_cdf(weights: Tensor, uniforms: Tensor) -> Tensor:
    """``_inverse_cdf`` over a whole vocabulary without a float64 copy of it: pick a block of
    ``_BLOCK`` tokens by the cumulative block sums, then the token within that block."""
    num_rows, width = weights.shape
    if width % _BLOCK:
        weights = torch.nn.functional.pad(weights, (0, _BLOCK - width % _BLOCK))
    blocks = weights.view(num_rows, -1, _BLOCK)
    # Block sums in float32 (a float64 sum would first copy the whole tensor to float64).
    masses = blocks.sum(dim=-1).double()
    block_cdf = masses.cumsum(dim=-1)
    total = block_cdf[:, -1]
    target = torch.minimum(uniforms * total, _just_below(total))
    block = _search(block_cdf, target)
    rows = torch.arange(num_rows, device=weights.device)
    mass = masses[rows, block]
    fraction = (target - (block_cdf[rows, block] - mass)) / mass
    inner_cdf = blocks[rows, block].cumsum(dim=-1, dtype=torch.float64)
    inner_total = inner_cdf[:, -1]
    # The same fraction of the block's own running sum, kept strictly inside it.
    inner = torch.minimum(fraction.clamp(min=0.0) * inner_total, _just_below(inner_total))
    return (block * _BLOCK + _search(inner_cdf, inner)).clamp_(max=width - 1)


def _just_below(total: Tensor) -> Tensor:
    return torch.nextafter(total, torch.zeros_like(total))


def _search(cdf: Tensor, target: Tensor) -> Tensor:
    """The first position whose cdf exceeds ``target``: one with a positive weight when target < total."""
    position = torch.searchsorted(cdf, target.unsqueeze(1).contiguous(), right=True).squeeze(1)
    return position.clamp_(max=cdf.shape[1] - 1)


def _row_index(selected: list[int], num_rows: int, device: torch.device) -> Tensor | None:
    """Index tensor for ``selected`` rows, or None when they are all rows in order."""
    if len(selected) == num_rows:
        return None
    return _to_device(selected, torch.long, device)


def _index(selected: list[int], device: torch.device) -> Tensor:
    return _to_device(selected, torch.long, device)


def _to_device(values: list[int] | list[float] | Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Host values as a tensor on ``device``. On CUDA they cross through pinned memory in a
    non-blocking copy: a blocking host-to-device copy synchronises the stream, a host sync too."""
    t = values if isinstance(values, Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _select_rows(x: Tensor, selected: list[int], num_rows: int) -> Tensor:
    index = _row_index(selected, num_rows, x.device)
    return x if index is None else x.index_select(0, index)


def _column(values: list[float], device: torch.device) -> Tensor:
    return _to_device(values, torch.float32, device).unsqueeze(1)
