"""The runner changes no request state: `ModelRunner.execute` reads the scheduled chunks and returns
plain values; every change to a `RequestState` (tokens, computed positions, prompt-scoring progress,
the output tracker) is made by `Scheduler.update`."""

from __future__ import annotations

from typing import Any

import torch

from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.records import EngineRequest, ReasoningBudget
from helios.engine.scheduler import RequestState
from tests.unit.test_engine import CFG, tiny_model


def _snapshot(seq: RequestState) -> tuple[Any, ...]:
    tracker = None if seq.tracker is None else dict(vars(seq.tracker))
    return (list(seq.token_ids), seq.num_computed, seq.num_prompt_scored, seq.status, seq.num_preemptions,
            list(seq.block_hashes), tracker)


def test_execute_changes_no_request_state() -> None:
    """Prompt scoring over several chunks, a reasoning budget's forced close, seeded and greedy rows:
    every step's `execute` leaves each request as `schedule` left it, and `update` then advances it."""
    core = EngineCore(tiny_model(), EngineConfig(page_size=4, num_pages=64, max_active=4, prefill_chunk_size=6,
                                                      max_model_len=128), torch.float32)
    prompt = tuple((5 * j + 3) % CFG.vocab_size for j in range(11))
    core.add(EngineRequest("score", prompt, SamplingParams(temperature=0.7, seed=1), 6, ignore_eos=True,
                           prompt_logprobs=2, num_top_logprobs=1))
    core.add(EngineRequest("budget", (4, 5, 6), SamplingParams(temperature=0.0), 6, ignore_eos=True,
                           reasoning_budget=ReasoningBudget(max_tokens=2, close_token_id=1)))
    core.add(EngineRequest("only", prompt, SamplingParams(), 0, prompt_logprobs=0))
    scheduler = core.scheduler
    scored: dict[str, int] = {}
    forced = 0
    while scheduler.has_work:
        sched = scheduler.schedule()
        before = {c.seq.request_id: _snapshot(c.seq) for c in sched.chunks}
        result = core.runner.execute(sched)
        assert {c.seq.request_id: _snapshot(c.seq) for c in sched.chunks} == before
        forced += sum(c.forced_token_id is not None for c in sched.chunks)
        for o in scheduler.update(sched, result):
            scored[o.request_id] = scored.get(o.request_id, 0) + len(o.prompt_logprobs or ())
    assert scored["score"] == scored["only"] == len(prompt) and forced == 1
