"""The sampler: one token per row over one engine step's batch of raw logits.

Per row, in this order (vLLM semantics):

1. Logprobs, when requested, from the raw logits: ``logit - logsumexp(logits)`` in float32, before any
   transform. The chosen token always carries its own logprob and rank.
2. Logit bias (``SamplingParams.logit_bias``), added to the raw logits, as vLLM applies it: after
   the logprobs are taken, so they stay raw.
3. Penalties: repetition over prompt and output tokens (positive logits divided, negative multiplied),
   then frequency and presence over output tokens only. Then, while a row's output is shorter than
   its ``min_tokens``, its EOS and stop ids (``SamplingRow.stop_ids``) get ``-inf``, as vLLM's
   min-tokens processor does.
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
bias, mask, top-k or top-p; min_tokens' masked stops keep a row there) take the vectorised path
(`Sampler._sample_plain`): one argmax for the greedy ones, one scaled whole-vocabulary inverse-CDF
draw for the others, with per-row parameters as tensors (`RowParams`, which the runner's persistent
batch keeps per request). Every other row takes the general path. Both compute the same float operations on a row, so a row gets the same token on
either (``Sampler(fast_path=False)`` sends every row through the general path; the tests compare).

The parts: `logprobs.py` (step 1, the records and prompt scores), `penalties.py` (steps 2-3),
`filters.py` (step 6), `draw.py` (step 7, and the reproducibility of draws: generators, uniforms),
`rows.py` (rows, the vectorised path's parameters, grammar masks).

Host reads (device syncs): ``sample`` reads device values once per call, at the end: the sampled
ids, together with every logprob record's numbers when any row asked for logprobs (one float64
tensor). Only the general path's filters read more: a top-k or top-p row's candidate decisions, a
wide nucleus's bucket cut; and a logprob row whose k-th alternative ties with a value beyond it
reads once more to order the ties by id. Host values the vectorised path sends to an accelerator
(uniforms, row indices) go through pinned memory in non-blocking copies, since a blocking
host-to-device copy waits for the device as well (penalty and bias rows still copy blocking).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from helios.domain.logprobs import TokenLogprob
from helios.engine.sampling.draw import (
    argmax_rows,
    blocked_inverse_cdf,
    draw,
    first_argmax,
    make_generator,
    uniforms_for,
)
from helios.engine.sampling.filters import filter_survivors
from helios.engine.sampling.logprobs import read_tokens_and_logprobs
from helios.engine.sampling.penalties import apply_logit_bias, apply_scaled_penalties
from helios.engine.sampling.rows import (
    RowMasks,
    RowParams,
    SamplingRow,
    StopMasks,
    is_greedy,
    is_plain,
    row_temperature,
)
from helios.engine.sampling.tensors import (
    NEG_INF,
    as_index,
    column,
    finite_peak,
    row_index,
    select_rows,
    to_device,
)

_EXP_FLOOR = -80.0  # exp(-80) is a normal float32 (~1.8e-35); below about -87 exp underflows (slowly)


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
        """A request's CPU generator for ``seed`` (`draw.make_generator`); None when it has no seed."""
        return make_generator(seed)

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
        stops = StopMasks.of(rows, vocab_size)  # rows under their min_tokens: their stop ids masked on either path
        vectorise = self.fast_path and token_mask is None
        for i, row in enumerate(rows):
            if not is_greedy(row.params):
                drawing.append(i)
            if vectorise and is_plain(row, vocab_size):
                plain.append(i)
            else:
                general.append(i)
        uniforms = to_device(uniforms_for(rows, drawing, self._generator), torch.float64, x.device) if drawing else None
        if not general:
            picked = self._sample_plain(x, rows, plain, uniforms, row_params, masks, stops)
        else:
            picked = self._sample_transformed(x, rows, general, token_mask, uniforms, masks, stops)
            if plain:
                picked = torch.empty(num_rows, dtype=torch.long, device=x.device).index_copy_(
                    0, as_index(general, x.device), picked)
                picked.index_copy_(0, as_index(plain, x.device),
                                   self._sample_plain(x, rows, plain, uniforms, row_params, masks, stops))
        return read_tokens_and_logprobs(x, rows, picked)

    def _sample_plain(
        self,
        x: Tensor,
        rows: Sequence[SamplingRow],
        plain: list[int],
        uniforms: Tensor | None,
        row_params: RowParams | None,
        masks: RowMasks | None = None,
        stops: StopMasks | None = None,
    ) -> Tensor:
        """The vectorised path for ``plain`` rows (greedy, or temperature and min-p only): their
        sampled ids as a device tensor aligned with ``plain``, with no host read (but `argmax_rows`'
        on the CPU for rows under their min_tokens) and no per-row tensor operation (but one masking
        fill per grammar-masked row, ``masks``; one indexed write for the stops min_tokens masks,
        ``stops``). The float operations on a row are the general path's, so a row's token does not
        depend on which path took it."""
        num_rows = x.shape[0]
        device = x.device
        greedy: list[int] = []
        drawn: list[int] = []
        scaled = min_p = False
        for j, i in enumerate(plain):
            params = rows[i].params
            if is_greedy(params):
                greedy.append(j)
            else:
                drawn.append(j)
                scaled = scaled or params.temperature != 1.0
                min_p = min_p or params.min_p > 0.0
        if not drawn:
            return argmax_rows(x, plain, num_rows, masks, stops)
        rows_drawn = [plain[j] for j in drawn]
        index = row_index(rows_drawn, num_rows, device)
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
        stopped = stops is not None and stops.touches(rows_drawn)
        if stopped:
            assert stops is not None
            if w is x:
                w = buffer.copy_(x)
            stops.apply(w, rows_drawn)
        peak = w.amax(dim=-1, keepdim=True)
        excluded: Tensor | None = None
        if min_p:
            assert tensors is not None
            log_min_p = tensors.log_min_p if index is None else tensors.log_min_p.index_select(0, index)
            excluded = w < (peak.squeeze(1) + log_min_p).unsqueeze(1)
        weights = torch.sub(w, finite_peak(peak), out=buffer)
        if masks is not None and masks.touches(rows_drawn):
            # exp of -inf (or of anything that underflows) takes a slow path on the CPU, several
            # times slower than the whole row: masked rows are floored first and their masked
            # tokens zeroed after. Unmasked rows are untouched.
            masks.floor(weights, rows_drawn, _EXP_FLOOR)
            weights.exp_()
            masks.apply(weights, rows_drawn, 0.0)
        else:
            weights.exp_()
        if stopped:  # (zero already, unless a grammar mask's floor raised them)
            assert stops is not None
            stops.apply(weights, rows_drawn, 0.0)
        if excluded is not None:
            weights.masked_fill_(excluded, 0.0)
        assert uniforms is not None
        u = uniforms if index is None else uniforms.index_select(0, index)
        sampled = blocked_inverse_cdf(weights, u)
        if not greedy:
            return sampled
        picked = torch.empty(len(plain), dtype=torch.long, device=device)
        picked.index_copy_(0, as_index(drawn, device), sampled)
        picked.index_copy_(0, as_index(greedy, device),
                           argmax_rows(x, [plain[j] for j in greedy], num_rows, masks, stops))
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
        stops: StopMasks | None = None,
    ) -> Tensor:
        """The general path: rows that need penalties, bias, a mask or filters. Their sampled ids as a
        device tensor aligned with ``work``."""
        num_rows = x.shape[0]
        device = x.device
        work_rows = [rows[i] for i in work]
        temperatures = [row_temperature(r.params) for r in work_rows]
        index = row_index(work, num_rows, device)
        scaled = any(t != 1.0 for t in temperatures)
        # w is this step's private copy: penalties, the mask and the draw write it in place.
        if index is None:
            w = x / column(temperatures, device) if scaled else x.clone()
        else:
            w = x.index_select(0, index)
            if scaled:
                w.div_(column(temperatures, device))
        scales = [1.0 / t for t in temperatures]  # bias and penalties act before the temperature
        if any(r.params.logit_bias for r in work_rows):
            apply_logit_bias(w, work_rows, scales)
        if any(r.has_penalties for r in work_rows):
            apply_scaled_penalties(w, work_rows, scales)
        if stops is not None:
            stops.apply(w, work)
        if masks is not None:
            masks.apply(w, work)
        if token_mask is not None:
            mask = token_mask[:, : self.vocab_size]
            if index is not None:
                mask = mask.index_select(0, index.to(mask.device))
            w.masked_fill_(~mask.to(device), NEG_INF)

        greedy = [j for j, r in enumerate(work_rows) if is_greedy(r.params)]
        drawn = [j for j, r in enumerate(work_rows) if not is_greedy(r.params)]
        if not drawn:
            return first_argmax(w)
        ws = select_rows(w, drawn, len(work))
        survivors = filter_survivors(ws, [work_rows[j].params for j in drawn])
        assert uniforms is not None
        drawn_index = row_index([work[j] for j in drawn], num_rows, device)
        sampled = draw(ws, survivors, uniforms if drawn_index is None else uniforms.index_select(0, drawn_index))
        if not greedy:
            return sampled
        picked = torch.empty(len(work), dtype=torch.long, device=device)
        picked.index_copy_(0, as_index(drawn, device), sampled)
        picked.index_copy_(0, as_index(greedy, device), first_argmax(select_rows(w, greedy, len(work))))
        return picked
