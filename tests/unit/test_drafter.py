"""Draft-model speculation (helios/engine/drafter.py) on tiny random models.

The target's outputs never depend on the drafter: greedy and seeded sampled tokens are identical with
and without one, whether the drafter is the target itself (every draft accepted) or another random
model (most drafts rejected: rollback on both sides every round). The drafter's state is released
when a request finishes, is aborted or is preempted, and its pool passes its integrity checks
after every step. The real-model pair (Qwen2.5-Coder 1.5B drafted by 0.5B) is in
tests/parity/test_draft_model.py.
"""

from __future__ import annotations

import copy

import attrs
import pytest
import torch

from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.drafter import Drafter
from helios.engine.records import EngineRequest
from helios.engine.speculative import SpeculativeConfig
from helios.models.llama import LlamaForCausalLM
from tests.unit.test_engine import CFG, tiny_model

TARGET = tiny_model()


def other_model(seed: int) -> LlamaForCausalLM:
    """A random model with the target's vocabulary and other weights (a poor drafter)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(attrs.evolve(CFG, num_layers=1))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


def drafter(model: torch.nn.Module, num_pages: int = 64, **kw: object) -> Drafter:
    return Drafter(model, torch.float32, num_pages=num_pages, page_size=4, max_active=4,  # type: ignore[arg-type]
                   max_model_len=96, prefill_chunk_size=16, **kw)  # type: ignore[arg-type]


def engine(mode: str = "off", draft: Drafter | None = None, depth: int = 4, **kw: object) -> EngineCore:
    cfg = EngineConfig(**{"page_size": 4, "num_pages": 64, "max_active": 4, "prefill_chunk_size": 16,
                          "max_model_len": 96, **kw})  # type: ignore[arg-type]
    cfg = attrs.evolve(cfg, speculative=SpeculativeConfig(mode=mode, max_depth=depth))
    return EngineCore(TARGET, cfg, torch.float32, drafter=draft)


def drive(core: EngineCore, requests: list[EngineRequest], abort_at: dict[str, int] | None = None,
          max_steps: int = 2000) -> dict[str, list[int]]:
    """Run to completion (``abort_at``: abort a request once it has that many tokens), checking the
    target's and the drafter's integrity, and that the drafter holds state only for live requests."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for r in requests:
        core.add(r)
    for _ in range(max_steps):
        if not core.scheduler.has_work:
            break
        for o in core.step():
            tokens[o.request_id] += o.new_token_ids
        for rid, at in (abort_at or {}).items():
            if len(tokens[rid]) >= at and rid in core.scheduler.by_id:
                core.abort([rid])
        core.scheduler.check_integrity()
        if core.drafter is not None:
            core.drafter.check_integrity(live=[s.request_id for s in core.scheduler.running])
    assert not core.scheduler.has_work
    return tokens


def requests(sampling: SamplingParams, n: int = 3, max_tokens: int = 30) -> list[EngineRequest]:
    prompts = [(5, 17, 3, 29, 11, 2, 23), (40, 41, 42, 7, 7, 7, 7, 7, 7, 8), tuple(range(60, 90))]
    return [EngineRequest(f"r{i}", prompts[i % 3], sampling, max_tokens=max_tokens, ignore_eos=True)
            for i in range(n)]


GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.9, seed=1234)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("draft_model", ["self", "other"])
@pytest.mark.parametrize("mode", ["ngram", "adaptive"])
def test_outputs_are_identical_with_and_without_a_draft_model(sampling: SamplingParams, draft_model: str,
                                                              mode: str) -> None:
    reqs = requests(sampling)
    want = drive(engine("off"), reqs)
    model = copy.deepcopy(TARGET) if draft_model == "self" else other_model(7)
    core = engine(mode, drafter(model))
    got = drive(core, reqs)
    assert got == want
    spec = core.stats().speculative
    assert spec is not None and spec.model_draft_rounds > 0
    assert core.drafter is not None and core.drafter.num_states == 0
    assert core.drafter.kv.num_free == core.drafter.kv.num_pages  # every page free or evictable
    if draft_model == "self" and sampling is GREEDY:
        # The target drafting itself (float32, same weights): every round's first draft is accepted.
        assert spec.model_accepted_drafts >= spec.model_draft_rounds


def test_the_draft_model_drafts_the_target_s_greedy_continuation() -> None:
    """Asked directly, a drafter over the target's own weights proposes the target's greedy tokens;
    a second call after the target accepted some reuses the drafts made (no forward) and a
    rejected continuation is rolled back."""
    prompt = [5, 17, 3, 29, 11, 2, 23]
    want = drive(engine("off"), [EngineRequest("a", tuple(prompt), GREEDY, max_tokens=12, ignore_eos=True)])["a"]
    d = drafter(copy.deepcopy(TARGET))
    assert d.propose("a", prompt, 6) == tuple(want[:6])
    ran = d.forward_tokens
    assert d.propose("a", prompt + want[:3], 2) == tuple(want[3:5])  # held already: no forward
    assert d.forward_tokens == ran
    # The target "committed" another token than the draft: the drafter drops the rest and continues.
    other = (want[3] + 1) % CFG.vocab_size
    got = d.propose("a", [*prompt, *want[:3], other], 3)
    assert len(got) == 3
    fresh = drafter(copy.deepcopy(TARGET))
    assert fresh.propose("b", [*prompt, *want[:3], other], 3) == got
    d.check_integrity()
    d.release("a")
    d.release("a")  # idempotent
    assert d.num_states == 0 and d.kv.num_free == d.kv.num_pages


def test_drafter_state_is_released_on_abort_and_preemption() -> None:
    """Aborted requests (mid-prefill, mid-decode) and preempted ones (a target pool too small for all
    of them) leave no drafter state behind; the outputs of the others are unchanged."""
    reqs = requests(GREEDY, n=4, max_tokens=40)
    d = drafter(copy.deepcopy(TARGET))
    core = engine("ngram", d)
    got = drive(core, reqs, abort_at={"r0": 0, "r1": 5})
    want = drive(engine("off"), reqs[2:])
    assert {k: got[k] for k in ("r2", "r3")} == want
    assert d.num_states == 0 and d.kv.num_free == d.kv.num_pages
    # Preemption: 16 pages of 4 tokens for four requests growing to ~47 tokens each (compared with
    # the same pool without speculation: a recomputed prefill's float sums differ from decoding's).
    small = engine("ngram", drafter(copy.deepcopy(TARGET)), num_pages=16)
    assert drive(small, reqs) == drive(engine("off", num_pages=16), reqs)
    assert small.scheduler.num_preemptions > 0
    assert small.drafter is not None and small.drafter.num_states == 0


def test_a_full_draft_pool_gives_fewer_drafts_and_never_changes_outputs() -> None:
    """A draft pool too small for every request: a round the pool cannot serve has the drafts made so
    far (maybe none), its state is released, and outputs stay identical."""
    reqs = requests(GREEDY, n=3, max_tokens=40)
    d = drafter(copy.deepcopy(TARGET), num_pages=14)
    core = engine("ngram", d)
    assert drive(core, reqs) == drive(engine("off"), reqs)
    assert d.pool_misses > 0
    assert d.num_states == 0 and d.kv.num_free == d.kv.num_pages


def test_a_draft_model_needs_speculation_on() -> None:
    with pytest.raises(ValueError, match="needs speculative mode ngram or adaptive"):
        engine("off", drafter(copy.deepcopy(TARGET)))
