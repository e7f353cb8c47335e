"""The runner's persistent input batch and the one-read rule of a decode step.

A decode step reads device values into Python once: the sampled ids (logprob records included in
the same read). `count_host_reads` counts every tensor-to-Python conversion while it is active, so
on the CPU it sees each place that would be a device sync on an accelerator.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from helios.domain.sampling import SamplingParams
from helios.engine.core import EngineConfig, EngineCore
from helios.engine.records import EngineRequest
from helios.engine.sampling import Sampler
from tests.unit.test_engine import run, tiny_model
from tests.unit.test_sampler import GREEDY, _row

_TENSOR_READS = ("tolist", "item", "numpy", "cpu", "equal", "__bool__", "__int__", "__float__", "__index__",
                 "__array__")
_TORCH_READS = ("equal", "allclose", "is_nonzero")


@contextlib.contextmanager
def count_host_reads() -> Iterator[list[str]]:
    """Records the name of every tensor-to-host conversion made while active."""
    reads: list[str] = []
    patches: list[tuple[Any, str, Any, bool]] = []

    def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def read(*args: Any, **kwargs: Any) -> Any:
            reads.append(name)
            return fn(*args, **kwargs)

        return read

    for owner, names in ((torch.Tensor, _TENSOR_READS), (torch, _TORCH_READS)):
        for name in names:
            patches.append((owner, name, getattr(owner, name), name in vars(owner)))
            setattr(owner, name, counting(name, getattr(owner, name)))
    try:
        yield reads
    finally:
        for owner, name, original, own in reversed(patches):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


def test_the_counter_sees_reads() -> None:
    t = torch.arange(3)
    with count_host_reads() as reads:
        t.tolist()
        int(t[0])
        bool(t[1])
        torch.equal(t, t)
    assert reads == ["tolist", "__int__", "__bool__", "equal"]
    assert "tolist" not in vars(torch.Tensor)  # restored


def test_sampler_reads_the_device_once() -> None:
    """Plain rows (greedy, seeded and unseeded temperature, min-p), with and without logprob records:
    the one read is the final ``tolist``."""
    vocab_size = 800
    logits = torch.randn(10, vocab_size, generator=torch.Generator().manual_seed(9))
    rows = [
        _row(GREEDY),
        _row(SamplingParams(temperature=1e-7), seed=1),
        _row(SamplingParams(temperature=1.0), seed=2),
        _row(SamplingParams(temperature=0.7)),
        _row(SamplingParams(temperature=1.3), seed=3, num_top_logprobs=3),
        _row(SamplingParams(temperature=0.9, min_p=0.05), seed=4),
        _row(SamplingParams(min_p=0.2)),
        _row(GREEDY, logprob_token_ids=(4, 1, 4)),
        _row(SamplingParams(temperature=0.5), num_top_logprobs=0),
        _row(GREEDY, seed=5),
    ]
    with count_host_reads() as reads:
        Sampler(vocab_size).sample(logits, rows)
    assert reads == ["tolist"]
    plain = [_row(SamplingParams(temperature=0.8), seed=i) for i in range(6)] + [_row(GREEDY)]
    with count_host_reads() as reads:
        Sampler(vocab_size).sample(logits[:7], plain)
    assert reads == ["tolist"]


def _core(max_active: int = 8) -> EngineCore:
    return EngineCore(tiny_model(), EngineConfig(page_size=4, num_pages=128, max_active=max_active,
                                                      prefill_chunk_size=64, max_model_len=128), torch.float32)


def _decoding(core: EngineCore) -> bool:
    sched = core.scheduler
    return not sched.waiting and all(not s.is_prefilling and s.num_computed > 0 for s in sched.running)


def test_a_decode_step_reads_the_device_once() -> None:
    core = _core()
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.2, min_p=0.05, seed=4),
        SamplingParams(temperature=0.9, seed=5),
    ]
    for i, params in enumerate(kinds):
        core.add(EngineRequest(f"r{i}", tuple(range(1 + i, 9 + 2 * i)), params, max_tokens=30, ignore_eos=True,
                               num_top_logprobs=2 if i == 4 else None,
                               logprob_token_ids=(1, 2) if i == 3 else None))
    while not _decoding(core):
        core.step()
    for _ in range(6):  # page boundaries pass: new block-table entries are staged too
        with count_host_reads() as reads:
            outputs = core.step()
        assert len(outputs) == len(kinds)
        assert reads == ["tolist"]


def test_rows_persist_and_block_tables_follow_the_manager() -> None:
    """A request keeps its batch row from step to step, its row of the block table equals the KV
    cache manager's table after every step, and a finished request's row is handed out again."""
    core = _core(max_active=3)
    batch = core.runner.batch
    table_tensor = batch.block_table
    reqs = [EngineRequest(f"r{i}", tuple(range(2, 4 + 3 * i)), SamplingParams(temperature=1.0, seed=i),
                          max_tokens=4 + 5 * i, ignore_eos=True) for i in range(5)]
    for r in reqs:
        core.add(r)
    rows_seen: dict[str, int] = {}
    while core.scheduler.has_work:
        core.step()
        for seq in core.scheduler.running:
            row = batch.row_of(seq.request_id)
            if row is None:
                continue  # admitted but not yet run
            assert rows_seen.setdefault(seq.request_id, row) == row
            table = core.kv_manager.block_table(seq.request_id)
            assert batch.block_table[row, : len(table)].tolist() == table
        assert batch.num_rows <= 3
    assert batch.block_table is table_tensor  # updated in place, never rebuilt
    assert len(rows_seen) == 5 and set(rows_seen.values()) == {0, 1, 2}  # rows were reused


def test_penalties_see_every_token_generated_so_far() -> None:
    """The batch builds a request's SamplingRow once; its output ids are a live view, so a presence
    penalty large enough to forbid repeats still forbids them many steps later."""
    core = _core()
    prompt = (5, 6, 7)
    plain = run(core, [EngineRequest("plain", prompt, GREEDY, max_tokens=40, ignore_eos=True)])["plain"]
    tokens = [t for o in plain for t in o.new_token_ids]
    assert len(set(tokens)) < len(tokens)  # greedy alone repeats itself on this model
    penalised = SamplingParams(temperature=0.0, presence_penalty=1000.0)
    outs = run(core, [EngineRequest("p", prompt, penalised, max_tokens=40, ignore_eos=True)])["p"]
    tokens = [t for o in outs for t in o.new_token_ids]
    assert len(tokens) == 40 and len(set(tokens)) == 40
