"""The engine's reasoning budget: a forced close token replaces one row's draw at the cap.

The tracker (`helios.engine.output_tracker`) follows committed token ids; the scheduler puts the
close token on the chunk of a request whose budget is spent (`ScheduledChunk.forced_token_id`); the
runner commits it instead of that row's sampled token, without a logprob record. Other rows of the
same step keep their own draws.
"""

from __future__ import annotations

from typing import Any

import torch

from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.output_tracker import BudgetState, OutputTracker
from helios.engine.records import EngineFinish, EngineRequest, ReasoningBudget
from tests.unit.test_engine import CFG, run, tiny_model
from tests.unit.test_input_batch import count_host_reads

GREEDY = SamplingParams(temperature=0.0)
PROMPT = (5, 6, 7, 8)


def _core(model: torch.nn.Module) -> EngineCore:
    return EngineCore(model, EngineConfig(page_size=4, num_pages=128, max_active=8, prefill_chunk_size=64,
                                               max_model_len=128), torch.float32)


def _tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def _greedy(model: torch.nn.Module, n: int = 16) -> list[int]:
    return _tokens(run(_core(model), [EngineRequest("probe", PROMPT, GREEDY, max_tokens=n, ignore_eos=True)])["probe"])


def _unused(tokens: list[int]) -> int:
    """A token id the model never produces in `tokens`: a close delimiter it would not write itself."""
    return next(t for t in range(CFG.vocab_size - 1, 0, -1) if t not in tokens)


# -- the tracker ----------------------------------------------------------------------------------


def test_tracker_counts_open_reasoning_and_forces_the_close_at_the_cap() -> None:
    t = OutputTracker(budget=ReasoningBudget(max_tokens=3, close_token_id=9))
    assert t.budget_state is BudgetState.OPEN and t.forced_token() is None
    for token in (1, 2):
        t.advance(token)
        assert t.forced_token() is None
    t.advance(3)
    assert t.num_reasoning_tokens == 3 and t.forced_token() == 9
    t.advance(9)  # the forced close is committed: the budget is done
    assert t.budget_state is BudgetState.DONE and t.forced_token() is None


def test_tracker_done_when_reasoning_closed_earlier_or_a_tool_opener_appears() -> None:
    closed = OutputTracker(budget=ReasoningBudget(max_tokens=2, close_token_id=9))
    closed.advance(9)
    for token in (1, 2, 3, 4):
        closed.advance(token)
    assert closed.budget_state is BudgetState.DONE and closed.forced_token() is None
    tool = OutputTracker(budget=ReasoningBudget(max_tokens=2, close_token_id=9, end_token_ids=frozenset({7})))
    tool.advance(1)
    tool.advance(7)  # a tool opener may end reasoning: no cut after it
    tool.advance(2)
    assert tool.budget_state is BudgetState.DONE and tool.forced_token() is None


def test_tracker_opens_only_on_a_first_generated_opener() -> None:
    opened = OutputTracker(budget=ReasoningBudget(max_tokens=2, opens=((4, 9), (5, 8))))
    assert opened.budget_state is BudgetState.START and opened.forced_token() is None
    opened.advance(5)  # the opener itself does not count
    opened.advance(1)
    assert opened.forced_token() is None
    opened.advance(2)
    assert opened.forced_token() == 8  # the close that matches this opener
    content = OutputTracker(budget=ReasoningBudget(max_tokens=2, opens=((4, 9),)))
    content.advance(1)  # output starts in content: accepted without a cut
    content.advance(4)
    for token in (1, 2, 3):
        content.advance(token)
    assert content.budget_state is BudgetState.DONE and content.forced_token() is None


# -- the engine -------------------------------------------------------------------------------------


def test_forced_close_replaces_only_that_rows_draw() -> None:
    """One greedy request with a budget of 5 among greedy and seeded neighbours: its 6th token is
    the close, its first 5 are its unbudgeted tokens, it continues after the close, and every other
    row's tokens are what they are without the budgeted request in the batch."""
    model = tiny_model()
    greedy = _greedy(model)
    close = _unused(greedy)

    def neighbours() -> list[EngineRequest]:
        return [
            EngineRequest("plain", PROMPT, GREEDY, max_tokens=12, ignore_eos=True, num_top_logprobs=2),
            EngineRequest("seeded", (9, 10, 11), SamplingParams(temperature=0.9, seed=7), max_tokens=12,
                          ignore_eos=True),
            EngineRequest("filtered", (3, 4), SamplingParams(temperature=0.8, top_k=5, seed=3), max_tokens=12,
                          ignore_eos=True),
        ]

    budgeted = EngineRequest("budget", PROMPT, GREEDY, max_tokens=12, ignore_eos=True, num_top_logprobs=2,
                             reasoning_budget=ReasoningBudget(max_tokens=5, close_token_id=close))
    core = _core(model)
    outs = run(core, [budgeted, *neighbours()])
    alone = run(_core(model), neighbours())

    tokens = _tokens(outs["budget"])
    assert tokens[:5] == greedy[:5]
    assert tokens[5] == close and len(tokens) == 12  # counted as generated; generation continues
    assert close not in tokens[6:]  # one cut only
    forced = [(o.forced, o.new_token_ids) for o in outs["budget"] if o.forced]
    assert forced == [((0,), (close,))]
    # Logprobs: one record per generated token except the forced one.
    records = [lp for o in outs["budget"] for lp in (o.logprobs or ())]
    assert len(records) == 11 and all(r.token_id == t for r, t in zip(records, tokens[:5] + tokens[6:], strict=True))
    for rid in ("plain", "seeded", "filtered"):
        assert _tokens(outs[rid]) == _tokens(alone[rid]), rid
        assert all(not o.forced for o in outs[rid])
    assert _tokens(outs["plain"]) == greedy[:12]
    assert len([lp for o in outs["plain"] for lp in (o.logprobs or ())]) == 12
    assert core.stats().reasoning_budget_cuts == 1


def test_no_cut_when_reasoning_closed_before_the_cap() -> None:
    """The model writes the close delimiter itself (its 3rd token) before a budget of 5: nothing is
    forced and its tokens are its unbudgeted ones."""
    model = tiny_model()
    greedy = _greedy(model)
    close = greedy[2]  # its first occurrence is at index 2 or earlier: before 5 reasoning tokens
    core = _core(model)
    outs = run(core, [EngineRequest("r", PROMPT, GREEDY, max_tokens=16, ignore_eos=True,
                                    reasoning_budget=ReasoningBudget(max_tokens=5, close_token_id=close))])
    assert _tokens(outs["r"]) == greedy
    assert all(not o.forced for o in outs["r"]) and core.stats().reasoning_budget_cuts == 0


def test_generated_opener_starts_the_count_and_content_start_never_cuts() -> None:
    model = tiny_model()
    greedy = _greedy(model)
    close = _unused(greedy)
    other = _unused([*greedy, close])
    core = _core(model)
    outs = run(core, [
        # The model's first token is the opener: 3 reasoning tokens after it, then the close.
        EngineRequest("opened", PROMPT, GREEDY, max_tokens=16, ignore_eos=True,
                      reasoning_budget=ReasoningBudget(max_tokens=3, opens=((greedy[0], close),))),
        # Its first token is not an opener: output starts in content, no cut.
        EngineRequest("content", PROMPT, GREEDY, max_tokens=16, ignore_eos=True,
                      reasoning_budget=ReasoningBudget(max_tokens=3, opens=((other, close),))),
    ])
    assert _tokens(outs["opened"])[:4] == greedy[:4] and _tokens(outs["opened"])[4] == close
    assert _tokens(outs["content"]) == greedy
    assert core.stats().reasoning_budget_cuts == 1


def test_the_forced_close_counts_within_the_output_limit() -> None:
    """max_tokens = budget + 1: the close is the last token (length finish); max_tokens = budget:
    no capacity remains, so nothing is forced."""
    model = tiny_model()
    greedy = _greedy(model)
    close = _unused(greedy)
    budget = ReasoningBudget(max_tokens=4, close_token_id=close)
    core = _core(model)
    outs = run(core, [
        EngineRequest("room", PROMPT, GREEDY, max_tokens=5, ignore_eos=True, reasoning_budget=budget),
        EngineRequest("full", PROMPT, GREEDY, max_tokens=4, ignore_eos=True, reasoning_budget=budget),
    ])
    assert _tokens(outs["room"]) == [*greedy[:4], close] and outs["room"][-1].finish is EngineFinish.LENGTH
    assert _tokens(outs["full"]) == greedy[:4] and outs["full"][-1].finish is EngineFinish.LENGTH
    assert core.stats().reasoning_budget_cuts == 1


def test_a_forced_step_still_reads_the_device_once() -> None:
    model = tiny_model()
    greedy = _greedy(model)
    close = _unused(greedy)
    core = _core(model)
    core.add(EngineRequest("b", PROMPT, GREEDY, max_tokens=8, ignore_eos=True, num_top_logprobs=1,
                           reasoning_budget=ReasoningBudget(max_tokens=2, close_token_id=close)))
    core.add(EngineRequest("o", (1, 2, 3), SamplingParams(temperature=1.0, seed=1), max_tokens=8, ignore_eos=True))
    core.step()  # prefill: the first tokens
    core.step()  # the 2nd reasoning token
    seq = core.scheduler.by_id["b"]
    assert seq.tracker is not None and seq.tracker.forced_token() == close
    with count_host_reads() as reads:
        outputs = core.step()
    assert reads == ["tolist"]
    by_id = {o.request_id: o for o in outputs}
    assert by_id["b"].new_token_ids == (close,) and by_id["b"].forced == (0,) and by_id["b"].logprobs == ()
    assert by_id["o"].forced == ()


def test_a_grammar_that_masks_the_step_or_refuses_the_close_prevents_the_cut() -> None:
    """The tracker's grammar check on the close: no grammar, or one that does not mask this step
    (reasoning is free), allows it; a masking grammar that refuses it prevents the cut."""
    from helios.engine.structured import Envelope, GrammarConstraint

    class Matcher:  # an llguidance matcher whose answer may start with token 9 only
        def deep_copy(self) -> Matcher:
            return self

        def validate_tokens(self, ids: list[int]) -> int:
            return 1 if ids == [9] else 0

    class Vocab:
        eos_token_ids = ()
        whitespace_ids = frozenset()

    def tracker(envelope: Envelope | None, close: int) -> OutputTracker:
        constraint = None if envelope is None else GrammarConstraint(Matcher(), Vocab(), envelope)  # type: ignore[arg-type]
        return OutputTracker(constraint, ReasoningBudget(max_tokens=0, close_token_id=close))

    free = Envelope(reasoning_close=8, starts_in_reasoning=True)
    assert tracker(None, 8).forced_token() == 8 and tracker(free, 8).forced_token() == 8
    assert tracker(Envelope(), 8).is_masking and tracker(Envelope(), 8).forced_token() is None
    assert tracker(Envelope(), 9).forced_token() == 9


def test_preemption_keeps_the_budget_and_recompute_can_carry_the_close() -> None:
    """Under page pressure (recompute preemption), every request's tokens equal a roomy run's: its
    first `budget` tokens, the close, then the rest. A request preempted when its close was due gets
    it on the last chunk of its recompute prefill."""
    model = tiny_model()
    prompts = [tuple((7 * i + 3 * j) % CFG.vocab_size for j in range(n)) for i, n in enumerate((3, 10, 17, 25))]
    greedy = [t for p in prompts for t in _tokens(run(_core(model), [
        EngineRequest("p", p, GREEDY, max_tokens=12, ignore_eos=True)])["p"])]
    close = _unused(greedy)

    def generate(num_pages: int) -> tuple[dict[str, list[int]], EngineCore, list[int]]:
        core = EngineCore(model, EngineConfig(page_size=4, num_pages=num_pages, max_active=8,
                                                   prefill_chunk_size=7, max_model_len=128), torch.float32)
        forced_on_prefill: list[int] = []
        schedule = core.scheduler.schedule

        def watched() -> Any:
            out = schedule()
            forced_on_prefill.extend(c.forced_token_id for c in out.chunks
                                     if c.forced_token_id is not None and c.length > 1)
            return out

        core.scheduler.schedule = watched  # type: ignore[method-assign]
        reqs = [EngineRequest(f"r{i}", p, GREEDY, max_tokens=12, ignore_eos=True,
                              reasoning_budget=ReasoningBudget(max_tokens=3 + i, close_token_id=close))
                for i, p in enumerate(prompts)]
        return {rid: _tokens(o) for rid, o in run(core, reqs).items()}, core, forced_on_prefill

    roomy, _, none_on_prefill = generate(64)
    tight, core, on_prefill = generate(14)  # 14 pages of 4 slots: preemption, one exactly at a cut
    assert core.scheduler.num_preemptions > 0 and on_prefill == [close] and not none_on_prefill
    assert tight == roomy
    for i in range(4):
        assert roomy[f"r{i}"][3 + i] == close and roomy[f"r{i}"].count(close) == 1
    assert core.stats().reasoning_budget_cuts == 4
