"""The draw: greedy picks, inverse-CDF draws, and the generators and uniforms they consume.

Greedy rows take the argmax, ties to the lowest token id. Other rows use inverse-CDF sampling in
token-id order with one float64 uniform from the row's own CPU generator per step.

Reproducibility: a seeded row consumes exactly one uniform from its own generator per sampling step,
and every other quantity it uses is computed from its own logits row, so the batch it runs in cannot
change its tokens. Unseeded rows share the sampler's process generator: one call per step draws the
uniforms of every unseeded row that samples, in row order. Generators live on the CPU even when the
logits are on an accelerator: the uniforms are written into one float64 tensor (one generator call
per seeded row, one for all unseeded rows) that crosses to the device once; no per-row kernel is
launched on the device. (An exponential race would also be batch-independent but draws V values per
row and step; on the CPU it measured ten times slower than the inverse CDF, which needs one.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from helios.domain.sampling import SamplingParams
from helios.engine.sampling.filters import Survivors
from helios.engine.sampling.rows import RowMasks, SamplingRow, StopMasks, is_greedy
from helios.engine.sampling.tensors import as_index, finite_peak, select_rows

_SEED_MASK = 0xFFFF_FFFF_FFFF_FFFF
_BLOCK = 256  # tokens per block of the full-vocabulary inverse CDF


def make_generator(seed: int | None) -> torch.Generator | None:
    """A request's CPU generator for ``seed``; None when the request has no seed."""
    if seed is None:
        return None
    generator = torch.Generator()
    generator.manual_seed(seed & _SEED_MASK)
    return generator


def uniforms_for(rows: Sequence[SamplingRow], drawing: list[int], process: torch.Generator) -> Tensor:
    """[B] float64 uniforms in [0, 1) on the CPU for the ``drawing`` rows (0 elsewhere): seeded
    rows from their own generator, the unseeded ones from the ``process`` generator in one call, in
    row order. Written in place, never read back."""
    unseeded = [i for i in drawing if rows[i].generator is None]
    if len(unseeded) == len(rows):
        return torch.rand(len(rows), generator=process, dtype=torch.float64)
    out = torch.zeros(len(rows), dtype=torch.float64)
    if unseeded:
        out[torch.tensor(unseeded)] = torch.rand(len(unseeded), generator=process, dtype=torch.float64)
    for i in drawing:
        generator = rows[i].generator
        if generator is not None:
            out[i : i + 1].uniform_(generator=generator)
    return out


def draws_uniform(params: SamplingParams) -> bool:
    """Whether a row with these parameters consumes a uniform per ``sample`` call (every row that
    is not greedy)."""
    return not is_greedy(params)


def consume_uniforms(generator: torch.Generator, count: int) -> None:
    """Advance a seeded row's generator by ``count`` draws exactly as ``count`` sampling steps do
    (speculative verification rewinds a generator to the draws of the tokens it committed)."""
    one = torch.empty(1, dtype=torch.float64)
    for _ in range(count):
        one.uniform_(generator=generator)


def first_argmax(x: Tensor) -> Tensor:
    """Each row's argmax over the last dim, ties to the lowest index (a NaN counts as the maximum):
    ``argmax``'s picks through ``max(dim).indices``, which both rules document; on the CPU ``argmax``
    over 8 rows of a 151,936-token vocabulary takes 0.9-1.6 ms, ``max`` 0.3."""
    return x.max(dim=-1).indices


def argmax_rows(x: Tensor, selected: list[int], num_rows: int, masks: RowMasks | None,
                stops: StopMasks | None = None) -> Tensor:
    """Greedy picks of the ``selected`` rows; a grammar-masked row's among its allowed tokens, and a
    row under its min_tokens among the tokens that are no stop of it. On the CPU only the rows whose
    unmasked pick is a stop are picked again (`StopMasks.hits`: a host read, free there); elsewhere
    every such row is, with no read."""
    if masks is None or not masks.touches(selected):
        picked = first_argmax(select_rows(x, selected, num_rows))
    else:
        w = x.index_select(0, as_index(selected, x.device))
        masks.apply(w, selected)
        picked = first_argmax(w)
    if stops is None or not stops.touches(selected):
        return picked
    fix = (stops.hits(picked, selected) if x.device.type == "cpu"
           else [j for j, i in enumerate(selected) if i in stops.where])
    if fix:
        rows = [selected[j] for j in fix]
        w = x.index_select(0, as_index(rows, x.device))
        if masks is not None:
            masks.apply(w, rows)
        stops.apply(w, rows)
        picked.index_copy_(0, as_index(fix, x.device), first_argmax(w))
    return picked


def draw(w: Tensor, survivors: Survivors, uniforms: Tensor) -> Tensor:
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
        weights = torch.exp(values - finite_peak(values[:, :1]))
        weights.masked_fill_(values < thresholds[index].unsqueeze(1), 0.0)
        ids, order = survivors.candidate_ids.sort(dim=-1)
        position = inverse_cdf(weights.gather(1, order), uniforms[index])
        picked[index] = ids.gather(1, position.unsqueeze(1)).squeeze(1)
    chosen = set(by_candidates)
    rest = [r for r in range(num_rows) if r not in chosen]
    if rest:
        sub = select_rows(w, rest, num_rows)
        excluded: Tensor | None = None
        if survivors.thresholds is not None:
            thresholds = survivors.thresholds
            if len(rest) < num_rows:
                thresholds = thresholds[torch.tensor(rest, dtype=torch.long, device=device)]
            excluded = sub < thresholds.unsqueeze(1)
        weights = sub.sub_(finite_peak(sub.amax(dim=-1, keepdim=True))).exp_()
        if excluded is not None:
            weights.masked_fill_(excluded, 0.0)
        position = blocked_inverse_cdf(weights, uniforms if len(rest) == num_rows else uniforms[rest])
        if len(rest) == num_rows:
            return position
        picked[torch.tensor(rest, dtype=torch.long, device=device)] = position
    return picked


def inverse_cdf(weights: Tensor, uniforms: Tensor) -> Tensor:
    """Per row, the position whose cumulative weight interval (float64) holds ``u * total``."""
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1]
    return _search(cdf, torch.minimum(uniforms * total, _just_below(total)))


def blocked_inverse_cdf(weights: Tensor, uniforms: Tensor) -> Tensor:
    """``inverse_cdf`` over a whole vocabulary without a float64 copy of it: pick a block of
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
