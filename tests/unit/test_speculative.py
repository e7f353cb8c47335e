"""Exact speculative decoding (helios/engine/speculative.py): n-gram drafts verified in one step.

Speculation must never change what a request gets: greedy outputs are token-identical to decoding
without it across batch mixes, preemption and prefix-cache hits (a hypothesis property test on the
tiny random model, twin engines with speculation off); seeded sampled outputs are identical too (a
verification round consumes one uniform per committed token); sampled outputs from different seeds
keep the distribution (chi-square, speculation on vs off); logprobs equal the non-speculative ones
within 1e-5 at every committed position. Rejected positions' pages are rolled back and the prefix
cache never registers a page past a request's committed tokens.
"""

from __future__ import annotations

import copy
from collections import Counter

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.kv.manager import KVCacheManager
from helios.engine.records import EngineFinish, EngineRequest, ReasoningBudget
from helios.engine.speculative import (
    BATCH_DRAFT_TOKENS,
    MAX_PAUSE_ROUNDS,
    MISS_LIMIT,
    PAUSE_ROUNDS,
    DraftState,
    NgramProposer,
    SharedHistory,
    SpeculativeConfig,
    SpeculativeStats,
    planned_depth,
)
from tests.unit.test_engine import CFG, tiny_model

MODEL = tiny_model()
MODEL64 = copy.deepcopy(MODEL).double()
V = CFG.vocab_size


# -- the proposer, the depth and the rollback ----------------------------------------------------


def test_ngram_proposer_drafts_what_followed_the_latest_longest_match() -> None:
    p = NgramProposer(min_n=2, max_n=3)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # The suffix 1 2 3 occurred at 0..2 (followed by 4 5 9 ...); 2 3 occurred later (followed by 7)
    # but the longer match wins.
    assert p.propose(tokens, 3) == (4, 5, 9)
    tokens += [6, 2, 3]  # now only the 2-gram "2 3" matches; its latest occurrence is at 11..12
    assert p.propose(tokens, 4) == (6, 2, 3)
    assert p.propose(tokens, 0) == ()
    assert NgramProposer().propose([5, 6, 7, 8], 4) == ()  # nothing repeats
    # A continuation stops at the end of the known tokens.
    assert NgramProposer(min_n=1, max_n=1).propose([4, 9, 4], 5) == (9, 4)


def test_ngram_proposer_index_grows_incrementally_and_matches_a_scan() -> None:
    rng = torch.Generator().manual_seed(3)
    tokens: list[int] = []
    p = NgramProposer(min_n=2, max_n=4)
    for _ in range(200):
        tokens.append(int(torch.randint(0, 6, (1,), generator=rng)))
        got = p.propose(tokens, 3)
        want: tuple[int, ...] = ()
        for n in (4, 3, 2):  # reference: a backward scan for the latest earlier occurrence
            if n >= len(tokens):
                continue
            suffix = tokens[-n:]
            hits = [e for e in range(n, len(tokens)) if tokens[e - n : e] == suffix]
            if hits:
                e = max(hits)
                want = tuple(tokens[e : e + 3])
                break
        assert got == want, len(tokens)


def test_shared_history_drafts_from_other_requests_outputs() -> None:
    h = SharedHistory(min_n=2, max_n=3)
    h.extend("a", [90, 91, 1, 2, 3, 4, 5, 6], offset=2)  # a's prompt is 90 91; its output 1..6
    # Another request whose tokens end with "2 3" (the longest match, 3-gram "1 2 3", wins when present).
    assert h.lookup([7, 1, 2, 3], 3, exclude="b") == (4, 5, 6)
    assert h.lookup([7, 8, 2, 3], 2, exclude="b") == (4, 5)
    assert h.lookup([7, 8, 2, 3], 2, exclude="a") == ()  # a's own output is its own proposer's business
    assert h.lookup([90, 91], 3, exclude="b") == ()  # prompts are not history
    assert h.lookup([1, 2], 0) == ()
    # Growing outputs are indexed incrementally; the latest occurrence wins.
    h.extend("b", [50, 2, 3, 9, 9], offset=1)
    assert h.lookup([0, 2, 3], 2, exclude="c") == (9, 9)
    h.extend("a", [90, 91, 1, 2, 3, 4, 5, 6, 2, 3, 8], offset=2)  # a moves to most recent; 2 3 -> 8 now
    assert h.lookup([0, 2, 3], 2, exclude="c") == (8,)
    assert h.num_tokens == 9 + 4


def test_shared_history_drops_the_oldest_outputs_and_their_index() -> None:
    h = SharedHistory(min_n=2, max_n=2, capacity=10)
    h.extend("a", [1, 2, 3, 4, 5, 6])
    h.extend("b", [11, 12, 13, 14])
    assert h.lookup([0, 1, 2], 2, exclude="x") == (3, 4)
    h.extend("c", [21, 22, 23])  # 13 tokens > 10: a (the least recently extended) goes
    assert h.num_tokens == 7
    assert h.lookup([0, 1, 2], 2, exclude="x") == ()
    assert h.lookup([0, 11, 12], 2, exclude="x") == (13, 14)
    assert all(rid != "a" for index in h._index.values() for rid, _ in index.values())


def test_a_request_drafts_from_an_earlier_requests_output() -> None:
    """The second request of the same prompt gets drafts from the first one's output (its own prompt
    does not hold them), accepts them, and its tokens equal decoding without speculation; without the
    shared history it accepts fewer drafts."""
    prompt = (5, 17, 3, 29, 11, 2, 23)
    first = EngineRequest("first", prompt, SamplingParams(temperature=0.0), max_tokens=40, ignore_eos=True)
    second = attrs.evolve(first, request_id="second")
    off = _drive(_engine(MODEL, torch.float32, "off", 4, max_model_len=128), [[first], [second]])

    def second_round(history: bool) -> tuple[list[int], SpeculativeStats, SpeculativeStats]:
        core = _engine(MODEL, torch.float32, "ngram", 4, max_model_len=128)
        if not history:
            core.scheduler.history = None
        assert _drive(core, [[first]])["first"][0] == off["first"][0]
        before = core.stats().speculative
        tokens = _drive(core, [[second]])["second"][0]
        after = core.stats().speculative
        assert before is not None and after is not None
        return tokens, before, after

    tokens, before, after = second_round(history=True)
    assert tokens == off["second"][0]
    assert before.history_draft_rounds == 0  # the first request had no other output to draft from
    assert after.history_draft_rounds > 0 and after.history_accepted_drafts > 0
    plain_tokens, plain_before, plain_after = second_round(history=False)
    assert plain_tokens == off["second"][0] and plain_after.history_draft_rounds == 0
    assert (after.accepted_drafts - before.accepted_drafts
            > plain_after.accepted_drafts - plain_before.accepted_drafts)


def test_adaptive_depth_follows_acceptance_and_backs_off_in_large_batches() -> None:
    cfg = SpeculativeConfig(mode="adaptive", max_depth=6)
    state = DraftState(NgramProposer(), depth=6)
    state.observe(cfg, proposed=6, accepted=1)
    assert state.depth == 3  # half the drafts offered
    state.observe(cfg, proposed=3, accepted=2)
    assert state.depth == 3  # the accepted ones and one more
    state.observe(cfg, proposed=3, accepted=3)
    assert state.depth == 6  # doubled, at most max_depth
    state.observe(cfg, proposed=1, accepted=0)
    assert state.depth == 1
    state.observe(cfg, proposed=1, accepted=1)
    assert state.depth == 2
    state.depth = 6
    assert planned_depth(cfg, state, 1) == 6
    assert planned_depth(cfg, state, 2) == BATCH_DRAFT_TOKENS // 2 - 1 > 0
    assert planned_depth(cfg, state, 8) == max(BATCH_DRAFT_TOKENS // 8 - 1, 0)
    assert planned_depth(cfg, state, BATCH_DRAFT_TOKENS) == 0
    fixed = SpeculativeConfig(mode="ngram", max_depth=3)
    state = DraftState(NgramProposer(), depth=3)
    state.observe(fixed, proposed=3, accepted=0)
    assert state.depth == 3 and planned_depth(fixed, state, 64) == 3


def test_adaptive_requests_pause_after_drafts_stop_being_accepted() -> None:
    cfg = SpeculativeConfig(mode="adaptive", max_depth=4)
    state = DraftState(NgramProposer(), depth=4)
    for _ in range(MISS_LIMIT - 1):
        state.observe(cfg, proposed=2, accepted=0)
    assert state.paused == 0 and not state.pause_round()
    state.observe(cfg, proposed=1, accepted=0)  # the MISS_LIMIT-th miss in a row
    assert state.paused == PAUSE_ROUNDS
    assert [state.pause_round() for _ in range(PAUSE_ROUNDS + 1)] == [True] * PAUSE_ROUNDS + [False]
    for _ in range(MISS_LIMIT):  # misses again right after the pause: twice as long
        state.observe(cfg, proposed=1, accepted=0)
    assert state.paused == 2 * PAUSE_ROUNDS
    state.paused = 0
    state.observe(cfg, proposed=1, accepted=1)  # an acceptance resets the streak and the length
    assert (state.misses, state.pause_rounds) == (0, PAUSE_ROUNDS)
    for _ in range(40):
        for _ in range(MISS_LIMIT):
            state.observe(cfg, proposed=1, accepted=0)
        state.paused = 0
    assert state.pause_rounds == MAX_PAUSE_ROUNDS
    fixed = SpeculativeConfig(mode="ngram", max_depth=3)  # ngram mode drafts whatever happens
    state = DraftState(NgramProposer(), depth=3)
    for _ in range(10):
        state.observe(fixed, proposed=3, accepted=0)
    assert state.paused == 0


class _WrongProposer:
    """Drafts a token the model never picks here (greedy rows of the tiny model: checked below)."""

    kind = "ngram"
    last_kind: str | None = "ngram"

    def __init__(self, token: int) -> None:
        self.token = token
        self.calls = 0

    def propose(self, token_ids: object, depth: int) -> tuple[int, ...]:
        self.calls += 1
        return (self.token,) * depth

    def prefetch(self, token_ids: object, depth: int) -> None:
        pass

    def release(self) -> None:
        pass


def test_a_request_whose_drafts_all_fail_stops_verifying_them() -> None:
    request = EngineRequest("w", _prompt([4, 9, 2], 3, []), SamplingParams(temperature=0.0), max_tokens=60,
                            ignore_eos=True)
    off = _drive(_engine(MODEL64, torch.float64, "off", 4, max_model_len=128), [[request]])["w"][0]
    wrong = next(t for t in range(V) if t not in off)
    core = _engine(MODEL64, torch.float64, "adaptive", 4, max_model_len=128)
    seq = core.scheduler.add(request, None)
    assert seq.drafts is not None
    proposer = _WrongProposer(wrong)
    seq.drafts.proposer = proposer
    out: list[int] = []
    while core.scheduler.has_work:
        for o in core.step():
            out += o.new_token_ids
    assert out == off
    stats = core.scheduler.spec_stats
    assert stats.accepted_drafts == 0
    # 59 decode rounds after the prefill's token: MISS_LIMIT draft rounds, a pause of PAUSE_ROUNDS,
    # MISS_LIMIT more, a pause of twice that, MISS_LIMIT more, and the next pause to the end.
    assert len(off) - 1 == 3 * MISS_LIMIT + 3 * PAUSE_ROUNDS + 2
    assert stats.draft_rounds == proposer.calls == 3 * MISS_LIMIT
    assert stats.paused_rounds == len(off) - 1 - 3 * MISS_LIMIT


def test_trim_releases_only_the_lookahead_pages_at_the_end() -> None:
    kv = KVCacheManager(num_pages=8, page_size=4, enable_caching=True)
    tokens = list(range(10))
    kv.allocate_cached("a", [], [])
    kv.allocate_slots("a", 0, 10, num_lookahead=5)  # 15 slots: 4 pages
    assert len(kv.block_table("a")) == 4
    kv.cache_full_pages("a", tokens, 10)  # pages 0 and 1 are full and registered
    assert kv.trim("a", 11) == 1  # 11 tokens need 3 pages
    assert len(kv.block_table("a")) == 3
    assert kv.trim("a", 1) == 1  # never below the registered pages
    assert len(kv.block_table("a")) == 2
    kv.check_integrity()
    assert kv.num_free == 6


# -- engines ---------------------------------------------------------------------------------------


def _engine(model: torch.nn.Module, dtype: torch.dtype, mode: str, depth: int, **kw: object) -> EngineCore:
    cfg = EngineConfig(**{"page_size": 4, "num_pages": 64, "max_active": 4, "prefill_chunk_size": 16,
                          "max_model_len": 96, **kw})  # type: ignore[arg-type]
    cfg = attrs.evolve(cfg, speculative=SpeculativeConfig(mode=mode, max_depth=depth))
    return EngineCore(model, cfg, dtype)


def _check_registered_pages(core: EngineCore) -> None:
    """Every registered page a running request holds lies within its committed tokens, under the
    chain hash of those tokens: a page holding a rejected draft is never findable."""
    kv = core.kv_manager
    for seq in core.scheduler.running:
        table = kv.block_table(seq.request_id)
        full = len(seq.token_ids) // kv.page_size
        chain = kv.chain(seq.token_ids, full)
        for i, page in enumerate(table):
            h = kv.block_hash[page]
            if h is not None:
                assert i < full, f"{seq.request_id}: page {i} is registered past its committed tokens"
                assert h == chain[i], f"{seq.request_id}: page {i} is registered under other tokens"


def _drive(core: EngineCore, waves: list[list[EngineRequest]]) -> dict[str, tuple[list[int], list[float], EngineFinish]]:
    """Run waves of requests to completion (a wave starts once the previous one finished, so later
    waves hit the prefix cache); returns each request's tokens, chosen-token logprobs and finish."""
    tokens: dict[str, list[int]] = {}
    lps: dict[str, list[float]] = {}
    finish: dict[str, EngineFinish] = {}
    for wave in waves:
        for r in wave:
            tokens[r.request_id], lps[r.request_id] = [], []
            core.add(r)
        for _ in range(2000):
            if not core.scheduler.has_work:
                break
            for o in core.step():
                tokens[o.request_id] += o.new_token_ids
                lps[o.request_id] += [lp.logprob for lp in o.logprobs or ()]
                if o.finish is not None:
                    finish[o.request_id] = o.finish
            core.scheduler.check_integrity()
            _check_registered_pages(core)
            rows = core.runner.batch
            for seq in core.scheduler.running:  # the runner's block table rows agree with the manager
                row = rows.row_of(seq.request_id)
                if row is not None:
                    table = core.kv_manager.block_table(seq.request_id)
                    known = rows._num_pages[row]
                    # A rollback since the step is rewritten at the next one (SchedulerOutput.trimmed).
                    known = min(known, core.scheduler._trimmed.get(seq.request_id, known))
                    assert rows.block_table[row, :known].tolist() == table[:known]
        assert not core.scheduler.has_work
    assert core.kv_manager.num_free == core.kv_manager.num_pages
    return {rid: (tokens[rid], lps[rid], finish[rid]) for rid in tokens}


def _prompt(pattern: list[int], repeats: int, tail: list[int]) -> tuple[int, ...]:
    return tuple(pattern * repeats + tail) or (1,)


request_spec = st.tuples(
    st.lists(st.integers(0, V - 1), min_size=1, max_size=5),  # a pattern the prompt repeats
    st.integers(0, 4),  # repeats
    st.lists(st.integers(0, V - 1), max_size=6),  # a tail
    st.integers(1, 24),  # max_tokens
    st.integers(0, 3),  # sampling: greedy, greedy with penalties, seeded, seeded top-k/top-p
    st.booleans(),  # logprobs
)


def _sampling(kind: int, seed: int) -> SamplingParams:
    return [SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.2),
            SamplingParams(temperature=0.8, seed=seed),
            SamplingParams(temperature=0.7, top_k=8, top_p=0.9, presence_penalty=0.3, seed=seed)][kind]


@settings(max_examples=12, deadline=None)
@given(specs=st.lists(request_spec, min_size=1, max_size=6), second_wave=st.booleans(),
       mode=st.sampled_from(["ngram", "adaptive"]), depth=st.integers(1, 6), max_active=st.integers(1, 4),
       chunk=st.integers(4, 24), num_pages=st.sampled_from([14, 24, 64]), verify_as_decode=st.booleans())
def test_outputs_are_identical_with_speculation_on_and_off(
        specs: list[tuple[list[int], int, list[int], int, int, bool]], second_wave: bool, mode: str, depth: int,
        max_active: int, chunk: int, num_pages: int, verify_as_decode: bool) -> None:
    """Greedy (with and without penalties) and seeded sampled requests (plain and top-k/top-p with
    penalties) get the same tokens and logprobs with speculation as without, in mixed batches, under
    page pressure (preemption) and, in a second wave of the same prompts, with prefix-cache hits;
    verification rows attend as prefill chunks or as decode tokens (the gather path in float64)."""
    waves = [[EngineRequest(f"r{i}", _prompt(pat, rep, tail), _sampling(kind, i), max_tokens=mt, ignore_eos=True,
                            num_top_logprobs=1 if lp else None)
              for i, (pat, rep, tail, mt, kind, lp) in enumerate(specs)]]
    if second_wave:
        waves.append([attrs.evolve(r, request_id=r.request_id + "b") for r in waves[0]])
    kw = {"max_active": max_active, "prefill_chunk_size": chunk, "num_pages": num_pages}
    off = _drive(_engine(MODEL64, torch.float64, "off", depth, **kw), waves)
    spec = _engine(MODEL64, torch.float64, mode, depth, **kw)
    spec.runner.batch.verify_as_decode = verify_as_decode
    on = _drive(spec, waves)
    for rid, (tokens, lps, finish) in off.items():
        assert on[rid][0] == tokens, rid
        assert on[rid][2] == finish, rid
        assert len(on[rid][1]) == len(lps)
        assert all(abs(a - b) <= 1e-9 for a, b in zip(on[rid][1], lps, strict=True)), rid
    stats = spec.stats().speculative
    assert stats is not None
    assert stats.accepted_drafts <= stats.verification_drafts
    assert stats.verification_rounds == sum(stats.rounds_by_depth.values())


@pytest.mark.parametrize("verify_as_decode", [True, False])
def test_greedy_runs_accept_drafts_and_match_float32_logprobs_within_1e_5(verify_as_decode: bool) -> None:
    """On the production path (float32, the CPU decode kernel where it is built) a batch of
    repetitive prompts accepts many drafts, and every committed token and logprob (with top
    alternatives) equals decoding without speculation within 1e-5, whether verification rows attend
    as decode tokens or as prefill chunks (SDPA over their context)."""
    requests = [EngineRequest(f"r{i}", _prompt([3 + i, 7, 11 + i, 5], 5, [2]), SamplingParams(temperature=0.0),
                              max_tokens=40, ignore_eos=True, num_top_logprobs=3) for i in range(4)]
    full: dict[str, dict[str, list]] = {}
    cores = {}
    for mode in ("off", "ngram", "adaptive"):
        core = cores[mode] = _engine(MODEL, torch.float32, mode, 5)
        core.runner.batch.verify_as_decode = verify_as_decode
        for r in requests:
            core.add(r)
        got: dict[str, list] = {r.request_id: [] for r in requests}
        while core.scheduler.has_work:
            for o in core.step():
                got[o.request_id] += list(zip(o.new_token_ids, o.logprobs or (), strict=True))
        full[mode] = got
    for mode in ("ngram", "adaptive"):
        for rid, want in full["off"].items():
            have = full[mode][rid]
            assert [t for t, _ in have] == [t for t, _ in want], (mode, rid)
            for (_, a), (_, b) in zip(have, want, strict=True):
                assert abs(a.logprob - b.logprob) <= 1e-5 and a.rank == b.rank
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
                assert all(abs(x - y) <= 1e-5 for (_, x), (_, y) in zip(a.top, b.top, strict=True))
        stats = cores[mode].stats().speculative
        assert stats is not None and stats.accepted_drafts > 20, stats
        assert stats.verify_steps > 0 and stats.draft_rounds > 0
        # Every generated token but the first of each request came from a decode or verification round.
        assert stats.verification_rounds + stats.accepted_drafts == 4 * 39
    off_stats = cores["off"].stats().speculative
    assert off_stats == SpeculativeStats(verification_rounds=4 * 39, rounds_by_depth={0: 4 * 39})


def _chi_square_p(a: Counter[int], b: Counter[int]) -> float:
    """p-value of a chi-square test of homogeneity of two samples (categories with fewer than 10
    observations in all are pooled)."""
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    rare_a = sum(v for k, v in a.items() if k not in keys)
    rare_b = sum(v for k, v in b.items() if k not in keys)
    cols = [(a[k], b[k]) for k in keys] + ([(rare_a, rare_b)] if rare_a + rare_b else [])
    na, nb = sum(x for x, _ in cols), sum(y for _, y in cols)
    stat = 0.0
    for x, y in cols:
        total = x + y
        for obs, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (obs - expected) ** 2 / expected
    dof = len(cols) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_sampled_outputs_keep_the_distribution() -> None:
    """Seeded sampled requests at a low temperature over a prompt that holds its own greedy
    continuation (so drafts are offered, often accepted and often rejected), seeds 0..N-1 with
    speculation off against seeds N..2N-1 with it on: the distribution of the tokens at output
    positions 3 and 7 (after verification rounds) does not differ at p = 0.01. The same seeds with
    speculation on give exactly the tokens they give without it."""
    n = 300
    base = _prompt([9, 4, 17, 30], 4, [])
    greedy = _drive(_engine(MODEL, torch.float32, "off", 4),
                    [[EngineRequest("g", base, SamplingParams(temperature=0.0), max_tokens=40, ignore_eos=True)]])
    prompt = base + tuple(greedy["g"][0])

    def sample(mode: str, seeds: range, max_active: int = 32) -> dict[int, list[int]]:
        core = _engine(MODEL, torch.float32, mode, 4, max_active=max_active, num_pages=1024, prefill_chunk_size=256,
                       max_model_len=128)
        got: dict[str, list[int]] = {}
        for s in seeds:
            core.add(EngineRequest(str(s), prompt, SamplingParams(temperature=0.4, seed=s), max_tokens=8,
                                   ignore_eos=True))
            got[str(s)] = []
        while core.scheduler.has_work:
            for o in core.step():
                got[o.request_id] += o.new_token_ids
        stats = core.stats().speculative
        assert stats is not None
        if mode == "ngram":  # both verification outcomes were exercised, many times
            assert stats.accepted_drafts > len(seeds) // 4, stats
            assert stats.verification_drafts - stats.accepted_drafts > len(seeds) // 4, stats
        return {int(k): v for k, v in got.items()}

    off = sample("off", range(n))
    on = sample("ngram", range(n, 2 * n))
    for pos in (3, 7):
        p = _chi_square_p(Counter(v[pos] for v in off.values()), Counter(v[pos] for v in on.values()))
        assert p > 0.01, (pos, p)
    same = sample("off", range(n, n + 40))
    assert all(same[s] == on[s] for s in same)


def test_a_stop_inside_an_accepted_run_truncates_it() -> None:
    """A verification round whose accepted run holds a stop token (or reaches max_tokens) commits
    up to it; the request ends there with the same tokens as without speculation."""
    base = EngineRequest("x", _prompt([5, 8, 13], 6, []), SamplingParams(temperature=0.0), max_tokens=30,
                         ignore_eos=True)
    ref = _drive(_engine(MODEL64, torch.float64, "off", 4), [[base]])["x"][0]
    stop = ref[6]
    first = ref.index(stop)
    for req in (attrs.evolve(base, stop_token_ids=frozenset({stop})), attrs.evolve(base, max_tokens=7),
                attrs.evolve(base, stop_token_sequences=(tuple(ref[first + 1 : first + 3]),))):
        want = _drive(_engine(MODEL64, torch.float64, "off", 4), [[req]])["x"]
        core = _engine(MODEL64, torch.float64, "ngram", 6)
        assert _drive(core, [[req]])["x"] == want
        assert len(want[0]) < 30


@pytest.mark.parametrize("sampling, min_tokens", [(SamplingParams(temperature=0.0), 5),
                                                  (SamplingParams(temperature=0.0), 20),
                                                  (SamplingParams(temperature=0.8, seed=3), 20)])
def test_min_tokens_rounds_mask_the_stops_at_every_verified_position(sampling: SamplingParams,
                                                                     min_tokens: int) -> None:
    """min_tokens over verification rounds: each verified position masks the stops while the
    output before it is shorter than min_tokens (its sampler row counts the drafts before it), so
    the tokens and the finish equal those without speculation, no stop comes before min_tokens,
    and one may right after it (greedy, 5: the model's own next token is the stop)."""
    base = EngineRequest("x", _prompt([5, 8, 13], 6, []), sampling, max_tokens=30, ignore_eos=True)
    ref = _drive(_engine(MODEL64, torch.float64, "off", 4), [[base]])["x"][0]
    stops = frozenset(ref[2:5])  # tokens the unmasked run draws early
    req = attrs.evolve(base, stop_token_ids=stops, eos_token_ids=frozenset({ref[6]}), ignore_eos=False,
                       min_tokens=min_tokens)
    want = _drive(_engine(MODEL64, torch.float64, "off", 4), [[req]])["x"]
    core = _engine(MODEL64, torch.float64, "ngram", 6)
    got = _drive(core, [[req]])["x"]
    assert got == want
    tokens = want[0]
    assert len(tokens) >= min_tokens and not set(tokens[:min_tokens]) & (stops | {ref[6]})
    if sampling.is_greedy:  # (a draw's mask moves its whole inverse CDF: sampled rows differ earlier)
        k = next(i for i, t in enumerate(ref) if t in stops or t == ref[6])
        assert tokens[:k] == ref[:k] and tokens[k] != ref[k]  # the same tokens up to the first stop, then off it
    if min_tokens == 5 and sampling.is_greedy:
        assert len(tokens) == 6 and want[2] is EngineFinish.STOP_TOKEN
    stats = core.stats().speculative
    assert stats is not None and stats.verification_drafts > 0


def test_constrained_and_budgeted_requests_never_speculate() -> None:
    core = _engine(MODEL, torch.float32, "ngram", 4)
    budget = EngineRequest("b", (1, 2, 3, 1, 2, 3), SamplingParams(temperature=0.0), max_tokens=8,
                           reasoning_budget=ReasoningBudget(max_tokens=4, close_token_id=7))
    one = EngineRequest("one", (1, 2, 3, 1, 2, 3), SamplingParams(temperature=0.0), max_tokens=1)
    plain = EngineRequest("p", (1, 2, 3, 1, 2, 3), SamplingParams(temperature=0.0), max_tokens=8)
    states = {r.request_id: core.scheduler.add(r, None) for r in (budget, one, plain)}
    assert states["b"].drafts is None and states["one"].drafts is None
    assert states["p"].drafts is not None
    off = _engine(MODEL, torch.float32, "off", 4)
    assert off.scheduler.add(plain, None).drafts is None


@pytest.mark.parametrize("mode", ["ngram", "adaptive"])
def test_speculation_rounds_mix_with_prefill_chunks_in_one_step(mode: str) -> None:
    """A long prompt prefilled in chunks while another request verifies drafts: both run in the same
    steps, and both get the tokens they get without speculation."""
    short = EngineRequest("s", _prompt([4, 9, 2], 6, []), SamplingParams(temperature=0.0), max_tokens=24,
                          ignore_eos=True)
    long = EngineRequest("l", tuple((j * 11 + 3) % V for j in range(80)), SamplingParams(temperature=0.0),
                         max_tokens=6, ignore_eos=True)
    core = _engine(MODEL64, torch.float64, mode, 4, prefill_chunk_size=12, max_model_len=128)
    core.add(short)
    out: dict[str, list[int]] = {"s": [], "l": []}
    for _ in range(4):
        for o in core.step():
            out[o.request_id] += o.new_token_ids
    core.add(long)
    mixed = 0
    while core.scheduler.has_work:
        sched = core.scheduler.schedule()
        verify = [c for c in sched.chunks if c.num_drafts]
        prefill = [c for c in sched.chunks if c.seq.is_prefilling]
        mixed += bool(verify and prefill)
        for o in core.scheduler.update(sched, core.runner.execute(sched)):
            out[o.request_id] += o.new_token_ids
    assert mixed > 0
    off = _engine(MODEL64, torch.float64, "off", 4, prefill_chunk_size=12, max_model_len=128)
    want = _drive(off, [[short, long]])
    assert out["s"] == want["s"][0]
    assert out["l"] == want["l"][0]


# -- configuration, the card and the metrics -----------------------------------------------------


def test_speculative_config_section_defaults_adaptive_and_validates(tmp_path: object) -> None:
    from pathlib import Path

    from helios.config import ConfigError, load_config

    assert load_config().speculative.mode == "adaptive"
    path = Path(str(tmp_path)) / "h.toml"
    path.write_text('[speculative]\nmode = "off"\n')
    assert load_config(path).speculative.mode == "off"
    path.write_text('[speculative]\nmode = "adaptive"\nmax_depth = 6\n')
    cfg = load_config(path)
    assert (cfg.speculative.mode, cfg.speculative.max_depth, cfg.speculative.history) == ("adaptive", 6, True)
    path.write_text('[speculative]\nmode = "ngram"\nhistory = false\n')
    assert load_config(path).speculative.history is False
    for bad, message in (('mode = "eagle"', "speculative.mode must be one of off, ngram, adaptive"),
                         ('history = "yes"', "speculative.history must be true or false"),
                         ("max_depth = 0", "speculative.max_depth must be an integer within 1..16"),
                         ("max_depth = true", "speculative.max_depth"), ("depth = 2", "depth")):
        path.write_text(f"[speculative]\n{bad}\n")
        with pytest.raises(ConfigError, match=message):
            load_config(path)


def test_the_flare_card_says_what_speculation_is_active() -> None:
    from helios.domain.model import ModelInfo
    from helios.frontends.openai.models import model_card

    info = ModelInfo(model_id="m", aliases=(), created=0, max_model_len=64, vocab_size=V, default_max_tokens=16,
                     max_concurrency=4, prefill_chunk_size=16, max_top_logprobs=20, prompt_logprobs=True,
                     sampling_defaults={}, sampling_ranges={}, recipe="plain", has_bos=False)
    assert model_card(info, 0)["flare"]["speculative"] == {
        "mode": "off", "max_depth": 0, "proposers": [], "adaptive_depth": False, "history_drafts": False,
        "learned_drafter": False}
    on = attrs.evolve(info, speculative_mode="adaptive", speculative_max_depth=6)
    assert model_card(on, 0)["flare"]["speculative"] == {
        "mode": "adaptive", "max_depth": 6, "proposers": ["ngram"], "adaptive_depth": True, "history_drafts": False,
        "learned_drafter": False}
    shared = attrs.evolve(on, speculative_history=True)
    assert model_card(shared, 0)["flare"]["speculative"] == {
        "mode": "adaptive", "max_depth": 6, "proposers": ["ngram", "history"], "adaptive_depth": True,
        "history_drafts": True, "learned_drafter": False}


def test_engine_counters_reach_the_metrics_snapshot_and_prometheus() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from helios.obs.metrics import ServingMetrics

    core = _engine(MODEL, torch.float32, "ngram", 4)
    core.add(EngineRequest("r", _prompt([3, 7, 11, 5], 5, [2]), SamplingParams(temperature=0.0), max_tokens=30,
                           ignore_eos=True))
    while core.scheduler.has_work:
        core.step()
    stats = core.stats()
    spec = stats.speculative
    assert spec is not None and stats.speculative_mode == "ngram"
    assert spec.accepted_drafts > 0 and spec.verification_rounds + spec.accepted_drafts == 29
    snap = ServingMetrics(lambda: (stats, None)).snapshot()
    for key in ("verify_steps", "verification_drafts", "verification_rounds", "accepted_drafts", "draft_rounds"):
        assert snap[key] == getattr(spec, key), key
    assert snap["learned_drafter"] is False and snap["draft_steps"] == 0
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(ServingMetrics(lambda: (stats, None)).prometheus())
               for s in f.samples}
    assert samples[("flare_accepted_draft_tokens_total", ())] == spec.accepted_drafts
    assert samples[("flare_verification_draft_tokens_total", ())] == spec.verification_drafts
    assert samples[("flare_verification_request_rounds_total", ())] == spec.verification_rounds
    assert samples[("flare_draft_request_rounds_total", ())] == spec.draft_rounds
    widths = {k: v for k, v in samples.items() if k[0] == "flare_speculative_rounds_total"}
    assert sum(widths.values()) == spec.verify_steps > 0
    depths = {dict(k[1])["depth"]: v for k, v in samples.items() if k[0] == "flare_verification_request_rounds_by_depth_total"}
    assert sum(depths.values()) == spec.verification_rounds
    assert sum(int(d) * n for d, n in depths.items()) == spec.verification_drafts  # DEPTH's numerator
    # With speculation off the families are not exported (a feature that is not running reports nothing).
    off = _engine(MODEL, torch.float32, "off", 4).stats()
    assert off.speculative_mode == "off"
    names = {s.name for f in text_string_to_metric_families(ServingMetrics(lambda: (off, None)).prometheus())
             for s in f.samples}
    assert not any("draft" in n or "verif" in n or "speculative" in n for n in names)
    # The shared history is on (the default): its gauge and counters (one request: nothing to draft from).
    assert samples[("flare_history_drafts_enabled", ())] == 1
    assert samples[("flare_history_draft_request_rounds_total", ())] == spec.history_draft_rounds == 0


def test_a_verification_step_reads_the_device_once() -> None:
    """Verification rounds keep the step's one host read (the sampled ids with the logprob records):
    the run is decided on the host list, and a seeded row's generator is rewound on the CPU."""
    from tests.unit.test_input_batch import count_host_reads

    core = _engine(MODEL, torch.float32, "ngram", 4)
    kinds = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.3, seed=1),
             SamplingParams(temperature=0.0, repetition_penalty=1.2)]
    for i, params in enumerate(kinds):
        core.add(EngineRequest(f"r{i}", _prompt([3 + i, 7, 11, 5], 5, [2]), params, max_tokens=40, ignore_eos=True,
                               num_top_logprobs=2 if i == 0 else None))
    while core.scheduler.waiting or any(s.is_prefilling or s.num_computed == 0 for s in core.scheduler.running):
        core.step()
    verified = 0
    for _ in range(12):
        sched_before = core.stats().speculative
        with count_host_reads() as reads:
            outputs = core.step()
        assert outputs and reads.count("tolist") == 1 and set(reads) == {"tolist"}, reads
        after = core.stats().speculative
        assert sched_before is not None and after is not None
        verified += after.verify_steps - sched_before.verify_steps
    assert verified > 0
