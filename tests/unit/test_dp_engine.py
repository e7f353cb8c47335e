"""`engine/dp.py`'s DataParallelEngine with real rank processes (spawn) over a tiny random model:
outputs come back through the sink and equal one in-process engine's, a later prompt extending an
earlier one goes to the rank holding it, a killed rank fails its requests (ERROR, FailureKind.ENGINE)
and is restarted, and shutdown stops every process. No HTTP, no real checkpoint."""

from __future__ import annotations

import functools
import os
import queue
import signal
import time
from collections.abc import Iterator

import pytest

from helios.domain.events import FailureKind
from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.dp import DataParallelEngine, RankEngine
from helios.engine.kv.events import AllBlocksCleared, BlockStored, KVEvent
from helios.engine.records import EngineFinish, EngineRequest, RequestOutput

PAGE = 4


def tiny_core() -> EngineCore:
    import torch

    from tests.unit.test_engine import tiny_model

    return EngineCore(tiny_model(), EngineConfig(page_size=PAGE, num_pages=96, max_active=4, prefill_chunk_size=64,
                                                 max_model_len=256, fingerprint=b"tiny"), torch.float32)


def tiny_rank(rank: int) -> RankEngine:
    return RankEngine(tiny_core(), threads=1, stall_seconds=30.0)


def tiny_builder(rank: int) -> functools.partial[RankEngine]:
    return functools.partial(tiny_rank, rank)


def request(rid: str, prompt: list[int], max_tokens: int = 6) -> EngineRequest:
    return EngineRequest(rid, tuple(prompt), SamplingParams(temperature=0.0), max_tokens, ignore_eos=True)


class Collector:
    def __init__(self) -> None:
        self.outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self.events: list[tuple[int, list[KVEvent]]] = []

    def sink(self, outs: list[RequestOutput]) -> None:
        for o in outs:
            self.outputs.put(o)

    def kv(self, rank: int, events: list[KVEvent]) -> None:
        self.events.append((rank, list(events)))

    def finish(self, rid: str, timeout: float = 60.0) -> tuple[list[int], RequestOutput]:
        """Tokens of ``rid`` up to its finish (outputs of other requests are kept for later)."""
        tokens: list[int] = []
        deadline = time.monotonic() + timeout
        others = []
        try:
            while True:
                o = self.outputs.get(timeout=max(0.01, deadline - time.monotonic()))
                if o.request_id != rid:
                    others.append(o)
                    continue
                tokens.extend(o.new_token_ids)
                if o.finish is not None:
                    return tokens, o
        finally:
            for o in others:
                self.outputs.put(o)


@pytest.fixture
def engine() -> Iterator[tuple[DataParallelEngine, Collector]]:
    c = Collector()
    e = DataParallelEngine(tiny_builder, 2, routing="cache_aware", load_weight_tokens=4, cache_threshold=0.25,
                           kv_listener=c.kv)
    e.launch(timeout=120)
    e.attach(c.sink)
    try:
        yield e, c
    finally:
        e.shutdown(timeout=10)
    assert all(r.process is None or not r.process.is_alive() for r in e._ranks)


@pytest.mark.timeout(240)
def test_outputs_match_one_engine_and_prefixes_stick(engine: tuple[DataParallelEngine, Collector]) -> None:
    e, c = engine
    prompt = [(7 * i + 3) % 90 + 1 for i in range(21)]  # 5 full pages before the last token
    e.submit(request("a", prompt))
    rank_a = e.rank_of("a")
    tokens_a, fin = c.finish("a")
    assert fin.finish is EngineFinish.LENGTH and len(tokens_a) == 6
    # One engine in this process gives the same greedy tokens.
    local = tiny_core()
    local.add(request("a", prompt))
    expected: list[int] = []
    while local.scheduler.has_work:
        for o in local.step():
            expected.extend(o.new_token_ids)
    assert tokens_a == expected

    stored = [ev for r, evs in c.events if r == rank_a for ev in evs if isinstance(ev, BlockStored)]
    assert sum(len(s.block_hashes) for s in stored) >= len(prompt) // PAGE
    # The next turn resends the prompt and the answer: it goes where they are cached.
    e.submit(request("b", [*prompt, *tokens_a, 5, 6, 7]))
    assert e.rank_of("b") == rank_a
    _tokens, fin_b = c.finish("b")
    assert fin_b.num_cached_tokens >= 5 * PAGE
    # Another prompt goes to the other rank (less loaded by cached pages).
    e.submit(request("c", [(11 * i + 5) % 90 + 1 for i in range(21)]))
    assert e.rank_of("c") not in (None, rank_a)
    c.finish("c")
    ranks = e.stats().data_parallel
    assert [r.routed for r in ranks] == ([2, 1] if rank_a == 0 else [1, 2])
    assert ranks[rank_a].routed_hit_tokens >= 5 * PAGE
    assert e.problem(60.0) is None and e.healthy


@pytest.mark.timeout(240)
def test_a_killed_rank_fails_its_requests_and_comes_back(engine: tuple[DataParallelEngine, Collector]) -> None:
    e, c = engine
    e.submit(request("long", [1, 2, 3, 4, 5], max_tokens=200))
    victim = e.rank_of("long")
    assert victim is not None
    first = c.outputs.get(timeout=60)  # it runs
    assert first.request_id == "long"
    pid = e.stats().data_parallel[victim].pid
    assert pid > 0
    os.kill(pid, signal.SIGKILL)
    _tokens, fin = c.finish("long", timeout=30)
    assert fin.finish is EngineFinish.ERROR and fin.failure is FailureKind.ENGINE
    assert fin.error is not None and f"data-parallel rank {victim} died" in fin.error and "signal 9" in fin.error
    problem = e.problem(60.0)
    assert problem is not None and f"data-parallel rank {victim}" in problem
    assert e.healthy  # the other rank serves meanwhile
    e.submit(request("meanwhile", [9, 8, 7, 6, 5]))
    assert e.rank_of("meanwhile") not in (None, victim)
    assert c.finish("meanwhile")[1].finish is EngineFinish.LENGTH
    assert any(r == victim and any(isinstance(ev, AllBlocksCleared) for ev in evs) for r, evs in c.events)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and e.problem(60.0) is not None:
        time.sleep(0.2)
    assert e.problem(60.0) is None, e.problem(60.0)
    back = e.stats().data_parallel[victim]
    assert back.up and back.restarts == 1 and back.pid not in (0, pid)
    for i in range(2):
        e.submit(request(f"after{i}", [3, 1, 4, 1, 5, i]))
        assert c.finish(f"after{i}")[1].finish is EngineFinish.LENGTH
