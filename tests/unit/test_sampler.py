"""Sampler: greedy and seeded draws, filters, penalties, logprobs and prompt scores."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from helios.domain.logprobs import TokenLogprob
from helios.domain.sampling import SamplingParams
from helios.engine.sampling import (
    NONFINITE_LOGPROB,
    RowParams,
    Sampler,
    SamplingRow,
    apply_penalties,
    prompt_logprobs,
)
from helios.engine.sampling.draw import blocked_inverse_cdf, draw, inverse_cdf
from helios.engine.sampling.filters import filter_survivors

GREEDY = SamplingParams(temperature=0.0)


def _row(
    params: SamplingParams,
    *,
    seed: int | None = None,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    num_top_logprobs: int | None = None,
    logprob_token_ids: tuple[int, ...] | None = None,
) -> SamplingRow:
    return SamplingRow(
        params=params,
        generator=Sampler.make_generator(seed),
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        num_top_logprobs=num_top_logprobs,
        logprob_token_ids=logprob_token_ids,
    )


def _draws(logits: torch.Tensor, params: SamplingParams, num_draws: int, seed: int = 0) -> Counter[int]:
    """``num_draws`` tokens from one logits row, each from its own seeded generator (deterministic)."""
    vocab_size = logits.shape[-1]
    sampler = Sampler(vocab_size)
    rows = [_row(params, seed=seed * 1_000_003 + i) for i in range(num_draws)]
    tokens, _ = sampler.sample(logits.reshape(1, -1).expand(num_draws, -1), rows)
    return Counter(tokens)


def _chi_square(counts: Counter[int], probs: torch.Tensor) -> float:
    total = sum(counts.values())
    stat = 0.0
    for token, p in enumerate(probs.tolist()):
        expected = total * p
        if expected > 0:
            stat += (counts.get(token, 0) - expected) ** 2 / expected
        else:
            assert counts.get(token, 0) == 0
    return stat


# -- greedy -------------------------------------------------------------------------------------------


def test_greedy_takes_argmax_and_lowest_id_on_ties() -> None:
    sampler = Sampler(6)
    logits = torch.tensor(
        [
            [0.1, 2.0, -1.0, 0.5, 1.9, 0.0],
            [1.0, 3.0, 3.0, -2.0, 3.0, 0.0],  # tie between ids 1, 2 and 4
            [float("-inf"), -5.0, -5.0, float("-inf"), -6.0, -7.0],
        ]
    )
    rows = [_row(GREEDY), _row(SamplingParams(temperature=0.7, top_k=1)), _row(GREEDY, seed=3)]
    tokens, logprobs = sampler.sample(logits, rows)
    assert tokens == [1, 1, 1]
    assert logprobs == [None, None, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_argmax_is_argmax_with_ties_nan_and_infinities(dtype: torch.dtype) -> None:
    """`first_argmax` (max's indices, the fast one on the CPU) picks what argmax picks: ties to the
    lowest index wherever they fall in the vector lanes, a NaN as the maximum, rows all -inf."""
    from helios.engine.sampling.draw import first_argmax

    g = torch.Generator().manual_seed(2)
    for n in (1, 7, 16, 17, 255, 4097, 151_936):
        x = torch.randn(6, n, generator=g).round()  # many ties
        x[1] = 0.0
        x[2, torch.randint(0, n, (3,), generator=g)] = 50.0
        x[3] = float("-inf")
        x[4, n // 2] = float("nan")
        x[5, -1] = float("inf")
        x = x.to(dtype)
        assert torch.equal(first_argmax(x), x.argmax(dim=-1)), n
        assert torch.equal(first_argmax(x[::2]), x[::2].argmax(dim=-1)), n


def test_greedy_in_bf16_ignores_padding_columns_and_leaves_input_untouched() -> None:
    sampler = Sampler(4)
    logits = torch.tensor([[0.0, 1.0, 0.5, 0.25, 9.0, 9.0]], dtype=torch.bfloat16)  # 2 padding columns
    before = logits.clone()
    tokens, _ = sampler.sample(logits, [_row(GREEDY)])
    assert tokens == [1]
    assert torch.equal(logits, before)


def test_tiny_temperature_is_greedy_and_inputs_are_never_modified() -> None:
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 100, generator=gen)
    mask = torch.ones(4, 100, dtype=torch.bool)
    before = logits.clone()
    rows = [
        _row(SamplingParams(temperature=1e-7), seed=1),
        _row(SamplingParams(repetition_penalty=1.5, presence_penalty=1.0), seed=2, prompt=[1], output=[2]),
        _row(SamplingParams(top_p=0.5, temperature=0.5), num_top_logprobs=3),
        _row(SamplingParams(min_p=0.2)),
    ]
    tokens, _ = Sampler(100).sample(logits, rows)
    Sampler(100).sample(logits, rows, token_mask=mask)
    assert tokens[0] == int(logits[0].argmax())
    assert torch.equal(logits, before)


def test_rejects_mismatched_shapes() -> None:
    sampler = Sampler(8)
    with pytest.raises(ValueError):
        sampler.sample(torch.zeros(2, 8), [_row(GREEDY)])
    with pytest.raises(ValueError):
        sampler.sample(torch.zeros(1, 4), [_row(GREEDY)])
    assert sampler.sample(torch.zeros(0, 8), []) == ([], [])


# -- temperature and the draw ---------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_draws_follow_the_tempered_distribution(temperature: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    counts = _draws(logits, SamplingParams(temperature=temperature), 6000)
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    # 5 degrees of freedom: P(chi2 > 25) ~ 1.4e-4, and the seeds are fixed.
    assert _chi_square(counts, expected) < 25.0
    other = torch.softmax(logits.double() / (temperature * 2.5), dim=-1)
    assert _chi_square(counts, other) > 100.0


def test_unseeded_rows_use_the_process_generator() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]]).expand(4000, -1)
    tokens, _ = Sampler(4).sample(logits, [_row(SamplingParams())] * 4000)
    counts = Counter(tokens)
    # Unseeded, so not deterministic: 3 degrees of freedom, P(chi2 > 30) ~ 1.4e-6.
    assert _chi_square(counts, torch.full((4,), 0.25, dtype=torch.float64)) < 30.0


# -- filters --------------------------------------------------------------------------------------------


def test_top_k_keeps_the_k_largest_and_their_ties() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, 2.0, -1.0, 0.5, 2.0])
    counts = _draws(logits, SamplingParams(top_k=2), 3000)
    # 3.0 then 2.0 at ids 3, 4 and 7: the boundary value's ties all survive.
    assert set(counts) == {1, 3, 4, 7}
    counts = _draws(logits, SamplingParams(top_k=5, temperature=3.0), 3000)
    assert set(counts) == {1, 3, 4, 7, 2}


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    logits = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]).log()
    counts = _draws(logits, SamplingParams(top_p=0.69), 3000)
    assert set(counts) == {0, 1}
    renormalized = torch.tensor([0.4, 0.3, 0.0, 0.0, 0.0], dtype=torch.float64) / 0.7
    assert _chi_square(counts, renormalized) < 15.0
    counts = _draws(logits, SamplingParams(top_p=0.71), 3000)
    assert set(counts) == {0, 1, 2}


def test_top_p_applies_to_the_top_k_renormalized_distribution() -> None:
    # Over the full distribution the nucleus for 0.5 is {0, 1}; over top-2 it is {0} alone (0.3/0.5).
    logits = torch.tensor([0.3, 0.2, 0.2 - 1e-3, 0.1, 0.1, 0.1]).log()
    counts = _draws(logits, SamplingParams(top_k=2, top_p=0.5), 1000)
    assert set(counts) == {0}
    counts = _draws(logits, SamplingParams(top_k=2, top_p=0.7), 1000)
    assert set(counts) == {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_top() -> None:
    logits = torch.tensor([0.5, 0.2, 0.11, 0.09, 0.105]).log()
    counts = _draws(logits, SamplingParams(min_p=0.2), 3000)
    assert set(counts) == {0, 1, 2, 4}
    # At temperature 0.5 the weights square: 0.25, 0.04, 0.0121, 0.0081, 0.011; min-p 0.1 cuts at 0.025.
    counts = _draws(logits, SamplingParams(min_p=0.1, temperature=0.5), 3000)
    assert set(counts) == {0, 1}


def _brute_force_kept(w: torch.Tensor, params: SamplingParams) -> set[int]:
    """The surviving token set, computed in float64 with a full sort."""
    w = w.double()
    keep = torch.ones_like(w, dtype=torch.bool)
    if 1 < params.top_k < w.numel():
        keep &= w >= w.sort(descending=True).values[params.top_k - 1]
    if params.top_p < 1.0:
        probs = torch.softmax(w.masked_fill(~keep, float("-inf")), dim=-1)
        ordered = probs.sort(descending=True).values
        keep &= probs >= ordered[int((ordered.cumsum(0) < params.top_p).sum())]
    if params.min_p > 0.0:
        probs = torch.softmax(w, dim=-1)
        keep &= probs >= params.min_p * probs.max()
    return set(keep.nonzero().flatten().tolist())


@pytest.mark.parametrize("vocab_size", [1000, 12000])
def test_filter_thresholds_match_a_full_sort(vocab_size: int) -> None:
    """Nuclei narrower and wider than the candidate levels (256, 4096), and the full-sort fallback."""
    gen = torch.Generator().manual_seed(vocab_size)
    rows: list[torch.Tensor] = []
    for head, boost in [(5, 8.0), (300, 3.0), (2000, 3.0), (vocab_size, 0.0)]:
        w = torch.rand(vocab_size, generator=gen) * 0.5
        w[torch.randperm(vocab_size, generator=gen)[:head]] += boost
        rows.append(w)
    logits = torch.stack(rows)
    settings = [
        SamplingParams(top_p=0.6),
        SamplingParams(top_p=0.9, min_p=0.5),
        SamplingParams(top_k=50, top_p=0.3),
        SamplingParams(top_k=700, top_p=0.95),
        SamplingParams(top_k=3000),
        SamplingParams(min_p=0.7),
    ]
    for params in settings:
        batch = [params] * len(rows)
        thresholds = filter_survivors(logits, batch).thresholds
        if thresholds is None:  # top-k 3000 over 1000 tokens filters nothing
            thresholds = torch.full((len(rows),), float("-inf"))
        for r in range(len(rows)):
            kept = set((logits[r] >= thresholds[r]).nonzero().flatten().tolist())
            assert kept == _brute_force_kept(logits[r], params), (params, r)
    assert filter_survivors(logits, [SamplingParams()] * len(rows)).thresholds is None


def test_candidate_draw_equals_the_full_vocabulary_draw() -> None:
    """Rows settled among their top candidates skip the vocabulary scan without changing any token."""
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(6, 3000, generator=gen) * 4
    params = [
        SamplingParams(top_k=40),
        SamplingParams(top_p=0.8),
        SamplingParams(top_k=10, top_p=0.9, min_p=0.05),
        SamplingParams(top_p=0.5, min_p=0.2),
        SamplingParams(top_k=2500),
        SamplingParams(min_p=0.1),
    ]
    survivors = filter_survivors(logits, params)
    assert survivors.candidate_rows == [0, 1, 2, 3, 4]
    full = filter_survivors(logits, params)
    full.candidate_rows = []
    for _ in range(20):
        uniforms = torch.rand(6, generator=gen, dtype=torch.float64)
        by_candidates = draw(logits.clone(), survivors, uniforms)
        assert torch.equal(by_candidates, draw(logits.clone(), full, uniforms))


def test_wide_nucleus_never_samples_outside_it() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.rand(6000, generator=gen) * 0.5
    params = SamplingParams(top_p=0.6)
    counts = _draws(logits, params, 200)
    assert set(counts) <= _brute_force_kept(logits, params)


def test_filters_and_penalties_mix_in_one_batch() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 300, generator=gen) * 3
    params = [
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.5),
        SamplingParams(min_p=0.3, temperature=0.8),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
        SamplingParams(top_k=10, top_p=0.8, min_p=0.1),
        SamplingParams(),
    ]
    sampler = Sampler(300)
    for step in range(30):
        rows = [_row(p, seed=step * 10 + i, prompt=[1, 2], output=[3]) for i, p in enumerate(params)]
        tokens, _ = sampler.sample(logits, rows)
        assert tokens[0] in set(logits[0].topk(5).indices.tolist())
        probs1 = torch.softmax(logits[1].double(), -1)
        ordered = probs1.sort(descending=True)
        nucleus = ordered.indices[: int((ordered.values.cumsum(0) < 0.5).sum()) + 1].tolist()
        assert tokens[1] in nucleus
        probs2 = torch.softmax(logits[2].double() / 0.8, -1)
        assert probs2[tokens[2]] >= 0.3 * probs2.max()
        assert tokens[4] in set(logits[4].topk(10).indices.tolist())


def test_blocked_inverse_cdf_equals_the_flat_one_and_skips_zero_weights() -> None:
    gen = torch.Generator().manual_seed(9)
    weights = torch.rand(4, 1000, generator=gen)
    weights[weights < 0.7] = 0.0  # long runs of zero weight, inside and across blocks
    weights[1, :900] = 0.0
    weights[2, 1:] = 0.0
    weights[2, 0] = 0.5
    weights[3, :-1] = 0.0
    weights[3, -1] = 0.5
    edges = torch.tensor([0.0, 1.0 - 2.0**-53], dtype=torch.float64)
    for u in [*torch.rand(200, generator=gen, dtype=torch.float64).tolist(), *edges.tolist()]:
        uniforms = torch.full((4,), u, dtype=torch.float64)
        blocked = blocked_inverse_cdf(weights, uniforms)
        assert torch.equal(blocked, inverse_cdf(weights, uniforms))
        assert bool((weights.gather(1, blocked.unsqueeze(1)) > 0).all())


# -- token mask -----------------------------------------------------------------------------------------


def test_token_mask_restricts_draws_but_not_logprobs() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0, 0.5], [5.0, 1.0, 0.0, 0.5]])
    mask = torch.tensor([[False, True, True, False], [False, False, False, True]])
    rows = [_row(SamplingParams(), seed=1, num_top_logprobs=1), _row(GREEDY, num_top_logprobs=1)]
    sampler = Sampler(4)
    for _ in range(50):
        tokens, logprobs = sampler.sample(logits, rows, token_mask=mask)
        assert tokens[0] in (1, 2)
        assert tokens[1] == 3
        first = logprobs[0]
        assert first is not None
        assert first.top[0][0] == 0  # the raw distribution still ranks the masked token first
        assert first.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[tokens[0]]), abs=1e-6)


def _stop_row(params: SamplingParams, output: Sequence[int], stops: tuple[int, ...], *, min_tokens: int = 3,
              seed: int | None = None, num_top_logprobs: int | None = None) -> SamplingRow:
    row = _row(params, seed=seed, output=output, num_top_logprobs=num_top_logprobs)
    row.min_tokens, row.stop_ids = min_tokens, stops
    return row


@pytest.mark.parametrize("fast_path", [True, False])
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9),
                                    SamplingParams(temperature=0.0, repetition_penalty=1.3)])
def test_min_tokens_masks_the_stop_ids_until_the_output_reaches_it(params: SamplingParams, fast_path: bool) -> None:
    """vLLM's min_tokens: while a row's output is shorter than min_tokens its stop ids cannot be drawn
    (whatever their logits); from then on they can; the logprobs stay raw either way."""
    logits = torch.tensor([[1.0, 9.0, 0.5, 8.5, 0.0, 2.0]])  # tokens 1 and 3 are the row's stops
    raw = torch.log_softmax(logits[0].double(), -1)
    sampler = Sampler(6, fast_path=fast_path)
    for n in range(3):
        row = _stop_row(params, [4] * n, (1, 3), seed=n, num_top_logprobs=2)
        assert row.masks_stops
        for _ in range(40):
            (token,), (lp,) = sampler.sample(logits, [row])
            assert token not in (1, 3)
            assert lp is not None and lp.logprob == pytest.approx(float(raw[token]), abs=1e-6)
            assert lp.top[0][0] == 1  # the raw ranking still has the masked stop first
    done = _stop_row(params, [4, 4, 4], (1, 3), seed=9)
    assert not done.masks_stops
    if params.is_greedy:
        assert sampler.sample(logits, [done])[0] == [1]  # the stop is the argmax again (no penalty touches it)
    assert not _row(params, output=[4]).masks_stops  # no stop ids: min_tokens masks nothing


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8), SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.9, min_p=0.05)])
def test_min_tokens_rows_take_the_same_tokens_on_both_paths(params: SamplingParams) -> None:
    """The vectorised path (one indexed write of the stops; greedy rows picked again only where the
    unmasked pick is a stop) and the general path agree row for row, in batches that mix rows under
    their min_tokens, rows past it and rows without stops, stops often at the top."""
    gen = torch.Generator().manual_seed(5)
    vocab = 300
    for trial in range(20):
        logits = torch.randn(7, vocab, generator=gen) * 3
        stops = tuple(sorted({int(logits[1].argmax()), int(logits[4].argmax()), int(logits[3].argmax()), 7, 250}))
        rows = [_stop_row(params, [1] * (i % 4), stops, seed=100 * trial + i) if i % 3 else _row(params, seed=i)
                for i in range(7)]
        fast, _ = Sampler(vocab).sample(logits, rows)
        rows = [_stop_row(params, [1] * (i % 4), stops, seed=100 * trial + i) if i % 3 else _row(params, seed=i)
                for i in range(7)]  # fresh generators: the same uniforms
        general, _ = Sampler(vocab, fast_path=False).sample(logits, rows)
        assert fast == general
        for i, token in enumerate(fast):
            if i % 3 and i % 4 < 3:  # under min_tokens
                assert token not in stops


def test_min_tokens_rows_mix_with_plain_rows_in_one_batch() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0], [0.0, 5.0, 4.0], [0.0, 5.0, 4.0]])
    tokens, _ = Sampler(3).sample(logits, [_row(GREEDY), _stop_row(GREEDY, [2], (1, 9), min_tokens=2),
                                           _stop_row(GREEDY, [2, 2], (1,), min_tokens=2)])
    assert tokens == [1, 2, 1]  # (id 9, past the sampled vocabulary, is never drawn anyway)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, min_p=0.05),
                                    GREEDY, SamplingParams(temperature=0.8, top_k=5),
                                    SamplingParams(temperature=0.9, repetition_penalty=1.2)])
def test_per_row_masks_equal_the_full_mask_on_the_general_path(params: SamplingParams) -> None:
    """Grammar masks for some rows (`masked_rows`, the vectorised path fills them in its workspace)
    give the same seeded tokens as the reference general path with a full-batch mask; unmasked rows
    beside them are unchanged, and logprobs stay raw."""
    torch.manual_seed(0)
    vocab = 300
    logits = torch.randn(5, vocab) * 3
    allowed = torch.rand(2, vocab) < 0.1
    masked_rows = [1, 3]
    full = torch.ones(5, vocab, dtype=torch.bool)
    full[masked_rows] = allowed

    def draw(sampler: Sampler, **kw: object) -> list[list[int]]:
        out = []
        for step in range(8):
            rows = [_row(params, seed=100 * step + i, output=[1, 2], num_top_logprobs=1 if i == 1 else None)
                    for i in range(5)]
            tokens, logprobs = sampler.sample(logits, rows, **kw)  # type: ignore[arg-type]
            lp = logprobs[1]
            assert lp is not None and lp.top[0][0] == int(logits[1].argmax())  # raw, not masked
            out.append(tokens)
        return out

    fast = draw(Sampler(vocab), token_mask=allowed, masked_rows=masked_rows)
    reference = draw(Sampler(vocab, fast_path=False), token_mask=full)
    unmasked = draw(Sampler(vocab))
    assert fast == reference
    for tokens, free in zip(fast, unmasked, strict=True):
        assert all(bool(allowed[k, tokens[r]]) for k, r in enumerate(masked_rows))
        assert [tokens[i] for i in (0, 2, 4)] == [free[i] for i in (0, 2, 4)]


# -- penalties ------------------------------------------------------------------------------------------


def test_penalties_match_a_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    row = _row(params, prompt=[0, 1, 1], output=[2, 2, 2, 4, 0])
    # Rows around it with other penalties (or none) must not leak into it, and it must not leak out.
    others = [
        _row(SamplingParams(frequency_penalty=1.0), output=[6, 6]),
        _row(SamplingParams(), prompt=[0], output=[1]),
        _row(SamplingParams(repetition_penalty=4.0), prompt=[3]),
    ]
    batch = logits.repeat(4, 1)
    apply_penalties(batch, [others[0], row, others[1], others[2]])
    assert batch[0].tolist() == pytest.approx([2.0, -1.0, 0.5, 3.0, -2.0, 0.0, 1.0 - 2.0])
    assert batch[2].tolist() == logits[0].tolist()
    assert batch[3].tolist() == pytest.approx([2.0, -1.0, 0.5, 0.75, -2.0, 0.0, 1.0])
    penalized = batch[1:2]
    expected = [
        2.0 / 2.0 - (0.5 * 1 + 0.25),  # prompt and output once: divided, then 1 occurrence
        -1.0 * 2.0,  # prompt only: multiplied, no frequency/presence
        0.5 / 2.0 - (0.5 * 3 + 0.25),  # output three times
        3.0,  # unseen
        -2.0 * 2.0 - (0.5 * 1 + 0.25),
        0.0,  # unseen
        1.0,
    ]
    assert penalized[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_penalties_apply_before_temperature_and_change_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 1.0, 0.0]])
    sampler = Sampler(4)
    tokens, _ = sampler.sample(
        logits, [_row(SamplingParams(temperature=0.0, presence_penalty=0.2), output=[0])]
    )
    assert tokens == [1]
    tokens, _ = sampler.sample(
        logits, [_row(SamplingParams(temperature=0.0, repetition_penalty=1.2), prompt=[0])]
    )
    assert tokens == [1]  # 3.0 / 1.2 = 2.5 < 2.9
    # Sampling at temperature 0.5 with a frequency penalty equals sampling the hand-penalised logits.
    params = SamplingParams(temperature=0.5, frequency_penalty=0.4, repetition_penalty=1.3)
    row_kwargs = {"prompt": [3], "output": [0, 0, 1]}
    by_sampler = _seeded_run(logits, params, row_kwargs, steps=40)
    hand = logits.clone()
    apply_penalties(hand, [_row(params, **row_kwargs)])  # type: ignore[arg-type]
    by_hand = _seeded_run(hand, SamplingParams(temperature=0.5), {}, steps=40)
    assert by_sampler == by_hand


def _seeded_run(
    logits: torch.Tensor, params: SamplingParams, row_kwargs: dict[str, list[int]], steps: int
) -> list[int]:
    sampler = Sampler(logits.shape[-1])
    row = _row(params, seed=11, **row_kwargs)  # type: ignore[arg-type]
    return [sampler.sample(logits, [row])[0][0] for _ in range(steps)]


# -- seeds ----------------------------------------------------------------------------------------------


def test_same_seed_same_tokens_and_different_seed_differs() -> None:
    gen = torch.Generator().manual_seed(0)
    steps = [torch.randn(1, 64, generator=gen) for _ in range(40)]
    params = SamplingParams(temperature=1.0)

    def run(seed: int) -> list[int]:
        sampler = Sampler(64)
        row = _row(params, seed=seed)
        return [sampler.sample(x, [row])[0][0] for x in steps]

    assert run(7) == run(7)
    assert run(7) != run(8)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.9),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.95),
        SamplingParams(top_p=0.9, min_p=0.02, presence_penalty=0.5),
    ],
)
def test_seeded_row_is_independent_of_batch_composition(params: SamplingParams) -> None:
    vocab_size = 2048
    gen = torch.Generator().manual_seed(1)
    num_steps = 40
    target_logits = [torch.randn(vocab_size, generator=gen) * 2 for _ in range(num_steps)]

    alone = Sampler(vocab_size)
    target = _row(params, seed=1234, prompt=[5, 6])
    solo_tokens: list[int] = []
    for x in target_logits:
        token = alone.sample(x.unsqueeze(0), [target])[0][0]
        solo_tokens.append(token)
        target.output_token_ids = [*target.output_token_ids, token]

    crowd = Sampler(vocab_size)
    target = _row(params, seed=1234, prompt=[5, 6])
    others = [
        _row(SamplingParams(temperature=1.3), seed=99),
        _row(SamplingParams(top_k=3)),
        _row(SamplingParams(top_p=0.5, repetition_penalty=1.1), prompt=[1]),
        _row(GREEDY),
        _row(SamplingParams(min_p=0.1), seed=4, num_top_logprobs=3),
    ]
    batch_tokens: list[int] = []
    for step, x in enumerate(target_logits):
        size = step % len(others) + 1
        batch_rows = others[:size]
        position = step % (size + 1)
        batch_rows = [*batch_rows[:position], target, *batch_rows[position:]]
        batch = torch.randn(size + 1, vocab_size, generator=gen) * 3
        batch[position] = x
        tokens, _ = crowd.sample(batch, batch_rows)
        batch_tokens.append(tokens[position])
        target.output_token_ids = [*target.output_token_ids, tokens[position]]
    assert batch_tokens == solo_tokens


# -- generation logprobs --------------------------------------------------------------------------------


def test_logprobs_match_float64_log_softmax_and_report_the_chosen_token() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(4, 1000, generator=gen) * 4).to(torch.bfloat16)
    rows = [
        _row(SamplingParams(), seed=1, num_top_logprobs=5),
        _row(GREEDY, num_top_logprobs=0),
        _row(SamplingParams(temperature=0.3, top_k=4, repetition_penalty=1.5), seed=2, num_top_logprobs=20),
        _row(SamplingParams(), seed=3),
    ]
    tokens, logprobs = Sampler(1000).sample(logits, rows)
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert logprobs[3] is None
    for i in range(3):
        entry = logprobs[i]
        assert isinstance(entry, TokenLogprob)
        assert entry.token_id == tokens[i]
        assert entry.logprob == pytest.approx(float(reference[i, tokens[i]]), abs=1e-5)
        assert entry.rank == 1 + int((reference[i] > reference[i, tokens[i]]).sum())
        k = rows[i].num_top_logprobs or 0
        assert len(entry.top) == k
        values = reference[i].tolist()
        expected = sorted(range(1000), key=lambda t: (-values[t], t))[:k]
        assert [t for t, _ in entry.top] == expected
        for token, value in entry.top:
            assert value == pytest.approx(float(reference[i, token]), abs=1e-5)
    assert logprobs[1] is not None and logprobs[1].rank == 1 and logprobs[1].top == ()


def test_top_alternatives_order_ties_by_id_and_ranks_are_shared() -> None:
    # Values: id 7 highest; ids 2, 5, 9 tie second; ids 0, 1, 4 tie third; the rest lower.
    logits = torch.full((1, 12), -3.0)
    logits[0, 7] = 2.0
    logits[0, [9, 5, 2]] = 1.0
    logits[0, [4, 0, 1]] = 0.0
    sampler = Sampler(12)
    for k, expected in [(1, [7]), (2, [7, 2]), (3, [7, 2, 5]), (5, [7, 2, 5, 9, 0]), (6, [7, 2, 5, 9, 0, 1])]:
        _, logprobs = sampler.sample(logits, [_row(GREEDY, num_top_logprobs=k)])
        entry = logprobs[0]
        assert entry is not None
        assert [t for t, _ in entry.top] == expected
    # A sampled token among the third tie group has rank 5 (four entries strictly greater).
    row = _row(SamplingParams(top_k=7, top_p=1.0), seed=0, num_top_logprobs=2)
    seen = set()
    for _ in range(60):
        tokens, logprobs = sampler.sample(logits, [row])
        entry = logprobs[0]
        assert entry is not None
        seen.add(tokens[0])
        expected_rank = {7: 1, 2: 2, 5: 2, 9: 2, 4: 5, 0: 5, 1: 5}[tokens[0]]
        assert entry.rank == expected_rank
    assert {4, 0, 1} & seen


def test_all_tied_row_and_infinite_logits() -> None:
    logits = torch.zeros(1, 40)
    _, logprobs = Sampler(40).sample(logits, [_row(GREEDY, num_top_logprobs=20)])
    entry = logprobs[0]
    assert entry is not None
    assert entry.token_id == 0 and entry.rank == 1
    assert [t for t, _ in entry.top] == list(range(20))
    logits = torch.full((1, 40), float("-inf"))
    logits[0, 3] = 1.0
    logits[0, 30] = 0.0
    _, logprobs = Sampler(40).sample(logits, [_row(GREEDY, num_top_logprobs=4)])
    entry = logprobs[0]
    assert entry is not None
    assert entry.top == (
        (3, pytest.approx(-math.log1p(math.exp(-1.0)))),
        (30, pytest.approx(-math.log1p(math.e))),
        (0, NONFINITE_LOGPROB),
        (1, NONFINITE_LOGPROB),
    )


def test_explicit_logprob_token_ids_dedup_and_append_the_sampled_token() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 500, generator=gen)
    explicit = (17, 4, 17, 250, 4, 0)
    sampled_first = int(logits[0].argmax())
    assert sampled_first not in explicit
    rows = [
        _row(GREEDY, num_top_logprobs=3, logprob_token_ids=explicit),
        _row(GREEDY, num_top_logprobs=0, logprob_token_ids=(int(logits[1].argmax()), 9)),
    ]
    tokens, logprobs = Sampler(500).sample(logits, rows)
    reference = torch.log_softmax(logits.double(), dim=-1)
    first, second = logprobs
    assert first is not None and second is not None
    assert [t for t, _ in first.top] == [17, 4, 250, 0, sampled_first]
    for token, value in first.top:
        assert value == pytest.approx(float(reference[0, token]), abs=1e-5)
    assert [t for t, _ in second.top] == [tokens[1], 9]


def test_explicit_ids_allow_128_entries_plus_the_sampled_token() -> None:
    logits = torch.zeros(1, 300)
    logits[0, 299] = 5.0
    ids = tuple(range(128))
    _, logprobs = Sampler(300).sample(logits, [_row(GREEDY, num_top_logprobs=0, logprob_token_ids=ids)])
    entry = logprobs[0]
    assert entry is not None
    assert len(entry.top) == 129
    assert entry.top[-1][0] == 299
    with pytest.raises(ValueError):
        Sampler(300).sample(logits, [_row(GREEDY, num_top_logprobs=0, logprob_token_ids=(300,))])


# -- prompt logprobs ------------------------------------------------------------------------------------


def test_prompt_logprobs_chunked_equals_unchunked() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(23, 700, generator=gen) * 3
    targets = torch.randint(0, 700, (23,), generator=gen).tolist()
    whole = prompt_logprobs(logits, targets, 5)
    chunked: list[dict[int, tuple[float, int]]] = []
    for start in range(0, 23, 7):
        chunked.extend(prompt_logprobs(logits[start : start + 7], targets[start : start + 7], 5))
    assert chunked == whole
    reference = torch.log_softmax(logits.double(), dim=-1)
    for position, entry in enumerate(whole):
        target = targets[position]
        assert next(iter(entry)) == target  # the actual token comes first
        assert entry[target][0] == pytest.approx(float(reference[position, target]), abs=1e-5)
        assert entry[target][1] == 1 + int((reference[position] > reference[position, target]).sum())
        alternatives = [t for t in entry if t != target]
        top5 = reference[position].topk(5).indices.tolist()
        assert set(alternatives) == set(top5) - {target}
        for token in top5:
            assert entry[token][1] == top5.index(token) + 1


def test_prompt_logprobs_non_finite_and_ties() -> None:
    logits = torch.tensor(
        [
            [0.0, float("-inf"), 1.0, 1.0, float("-inf")],
            [2.0, 2.0, 2.0, 0.0, 0.0],
        ]
    )
    scores = prompt_logprobs(logits, [4, 2], 3)
    first, second = scores
    assert first[4] == (NONFINITE_LOGPROB, 4)
    assert list(first) == [4, 2, 3, 0]
    assert first[2][1] == 1 and first[3][1] == 1 and first[0][1] == 3
    assert list(second) == [2, 0, 1]
    assert all(rank == 1 for _, rank in second.values())
    assert prompt_logprobs(logits, [0, 3], 0) == [
        {0: (pytest.approx(float(torch.log_softmax(logits[0].double(), -1)[0])), 3)},
        {3: (pytest.approx(float(torch.log_softmax(logits[1].double(), -1)[3])), 4)},
    ]
    assert prompt_logprobs(torch.zeros(0, 5), [], 3) == []


# -- logit bias ---------------------------------------------------------------------------------------


def test_logit_bias_steers_the_draw_but_logprobs_stay_raw() -> None:
    torch.manual_seed(3)
    logits = torch.randn(1, 50) * 2
    top = int(logits.argmax())
    low = int(logits.argmin())
    sampler = Sampler(50)
    plain_tokens, plain_lps = sampler.sample(logits, [_row(GREEDY, num_top_logprobs=3)])
    assert plain_tokens == [top]
    biased = SamplingParams(temperature=0.0, logit_bias=((low, 100.0),))
    tokens, lps = sampler.sample(logits, [_row(biased, num_top_logprobs=3)])
    assert tokens == [low]
    raw = torch.log_softmax(logits[0].double(), dim=-1)
    assert lps[0] is not None and plain_lps[0] is not None
    assert abs(lps[0].logprob - raw[low].item()) < 1e-5  # the chosen token's raw logprob
    assert lps[0].top == plain_lps[0].top  # alternatives of the raw distribution
    banned = SamplingParams(temperature=0.0, logit_bias=((top, -100.0),))
    assert sampler.sample(logits, [_row(banned)])[0] == [int(raw.topk(2).indices[1])]


def test_logit_bias_before_temperature_equals_biased_logits() -> None:
    """A seeded tempered draw with a bias equals the same draw from logits with the bias added."""
    torch.manual_seed(4)
    logits = torch.randn(1, 64)
    bias = ((5, 2.5), (9, -1.0), (40, 3.0))
    shifted = logits.clone()
    for token, value in bias:
        shifted[0, token] += value
    sampler = Sampler(64)
    for seed in range(20):
        a = sampler.sample(logits, [_row(SamplingParams(temperature=0.7, logit_bias=bias), seed=seed)])[0]
        b = sampler.sample(shifted, [_row(SamplingParams(temperature=0.7), seed=seed)])[0]
        assert a == b


def test_a_biased_row_does_not_change_its_neighbours() -> None:
    torch.manual_seed(5)
    logits = torch.randn(2, 64)
    sampler = Sampler(64)
    alone = sampler.sample(logits[1:], [_row(SamplingParams(temperature=0.9), seed=11)])[0]
    both = sampler.sample(logits, [_row(SamplingParams(temperature=0.9, logit_bias=((3, 50.0),)), seed=1),
                                   _row(SamplingParams(temperature=0.9), seed=11)])[0]
    assert both[0] == 3 and both[1:] == alone


# -- the vectorised path ----------------------------------------------------------------------------


def _mixed_rows(rng: torch.Generator, count: int, *, general: bool) -> list[SamplingRow]:
    """Greedy, seeded and unseeded temperature rows, some with min-p or logprobs; with ``general``,
    also rows the vectorised path never takes (penalties, bias, top-k, top-p)."""
    plain = [
        lambda seed: _row(GREEDY),
        lambda seed: _row(SamplingParams(temperature=1e-7), seed=seed),
        lambda seed: _row(SamplingParams(temperature=1.0), seed=seed),
        lambda seed: _row(SamplingParams(temperature=0.7)),
        lambda seed: _row(SamplingParams(temperature=1.3), seed=seed, num_top_logprobs=3),
        lambda seed: _row(SamplingParams(temperature=0.9, min_p=0.05), seed=seed),
        lambda seed: _row(SamplingParams(min_p=0.2)),
        lambda seed: _row(GREEDY, logprob_token_ids=(4, 1, 4)),
    ]
    others = [
        lambda seed: _row(SamplingParams(temperature=0.8, top_k=5), seed=seed),
        lambda seed: _row(SamplingParams(top_p=0.9)),
        lambda seed: _row(SamplingParams(presence_penalty=0.5), seed=seed, prompt=[1], output=[2, 3]),
        lambda seed: _row(SamplingParams(temperature=0.0, logit_bias=((7, 3.0),)), num_top_logprobs=1),
    ]
    kinds = plain + others if general else plain
    picks = torch.randint(len(kinds), (count,), generator=rng).tolist()
    return [kinds[k](1000 + i) for i, k in enumerate(picks)]


@pytest.mark.parametrize("general", [False, True])
def test_vectorised_path_equals_the_general_path(general: bool) -> None:
    """Tokens and logprob records match exactly, seeded and unseeded rows alike, whichever other
    rows share the batch. Fresh rows (fresh generators) for each sampler; the process generators
    start from the same state."""
    vocab_size = 1000
    rng = torch.Generator().manual_seed(21)
    for trial in range(25):
        logits = torch.randn(12, vocab_size, generator=rng) * 3
        state = torch.randint(10**9, (1,), generator=rng).item()
        results = []
        for fast_path in (True, False):
            sampler = Sampler(vocab_size, fast_path=fast_path)
            sampler._generator.manual_seed(state)
            rows = _mixed_rows(torch.Generator().manual_seed(trial), 12, general=general)
            results.append([sampler.sample(logits, rows) for _ in range(3)])  # generators advance
        assert results[0] == results[1]


def test_vectorised_path_uses_the_row_parameters_it_is_given() -> None:
    """`RowParams` (the runner's persistent per-row tensors) drive the vectorised draw: a temperature
    passed there changes the tokens exactly as the row's own parameters would."""
    vocab_size = 500
    logits = torch.randn(16, vocab_size, generator=torch.Generator().manual_seed(5)) * 2
    hot = [_row(SamplingParams(temperature=2.0), seed=i) for i in range(16)]
    expected, _ = Sampler(vocab_size).sample(logits, hot)
    cold = [_row(SamplingParams(temperature=0.5), seed=i) for i in range(16)]
    params = RowParams(torch.full((16,), 2.0), torch.full((16,), float("-inf")))
    tokens, _ = Sampler(vocab_size).sample(logits, cold, row_params=params)
    assert tokens == expected
    assert Sampler(vocab_size).sample(logits, [_row(SamplingParams(temperature=0.5), seed=i)
                                               for i in range(16)])[0] != expected

