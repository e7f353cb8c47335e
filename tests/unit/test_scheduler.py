"""Scheduler and KV cache manager bookkeeping with exact page ids."""

from __future__ import annotations

from helios.domain.sampling import SamplingParams
from helios.engine.kv.manager import KVCacheManager
from helios.engine.records import EngineFinish, EngineRequest, RunnerOutput
from helios.engine.scheduler import Scheduler, SeqStatus


def req(rid: str, n_prompt: int, max_tokens: int = 8) -> EngineRequest:
    return EngineRequest(rid, tuple(range(1, n_prompt + 1)), SamplingParams(temperature=0.0), max_tokens)


def run_step(s: Scheduler, token: int = 7):
    """One step with a stand-in runner that samples `token` for every request that samples."""
    out = s.schedule()
    s.update(out, RunnerOutput(sampled={c.seq.request_id: (token,) for c in out.chunks if c.samples}))
    s.check_integrity()
    return out


def test_prefill_is_chunked_and_pages_are_exact() -> None:
    kv = KVCacheManager(num_pages=8, page_size=4)
    s = Scheduler(kv, max_active=4, prefill_chunk_size=5, max_model_len=64)
    seq = s.add(req("a", 10), None)
    out = run_step(s)
    assert [(c.start, c.length, c.samples) for c in out.chunks] == [(0, 5, False)]
    assert kv.block_table(seq.request_id) == [0, 1, 2]  # pages for all 10 prompt tokens reserved at admission
    out = run_step(s)
    assert [(c.start, c.length, c.samples) for c in out.chunks] == [(5, 5, True)]
    assert seq.num_computed == 10 and len(seq.token_ids) == 11
    out = run_step(s)
    assert [(c.start, c.length) for c in out.chunks] == [(10, 1)]
    assert kv.block_table(seq.request_id) == [0, 1, 2]  # token 10 still fits in page 2
    out = run_step(s)
    assert [(c.start, c.length) for c in out.chunks] == [(11, 1)]
    out = run_step(s)
    assert kv.block_table(seq.request_id) == [0, 1, 2, 3]  # token 12 needed a fourth page


def test_decode_and_prefill_share_a_step() -> None:
    kv = KVCacheManager(num_pages=16, page_size=4)
    s = Scheduler(kv, max_active=4, prefill_chunk_size=8, max_model_len=64)
    a = s.add(req("a", 3), None)
    run_step(s)
    b = s.add(req("b", 6), None)
    out = run_step(s)
    assert [(c.seq.request_id, c.start, c.length) for c in out.chunks] == [("a", 3, 1), ("b", 0, 6)]
    assert a.status == SeqStatus.RUNNING and b.status == SeqStatus.RUNNING


def test_finish_and_abort_free_pages() -> None:
    kv = KVCacheManager(num_pages=4, page_size=4)
    s = Scheduler(kv, max_active=4, prefill_chunk_size=16, max_model_len=64)
    a = s.add(req("a", 5), None)
    run_step(s)
    assert kv.num_free == 2
    s.abort(["a"])
    assert kv.num_free == 4 and a.status == SeqStatus.FINISHED
    assert not s.has_work
    s.check_integrity()


def test_preemption_when_pages_run_out_and_recompute() -> None:
    kv = KVCacheManager(num_pages=4, page_size=2)
    s = Scheduler(kv, max_active=4, prefill_chunk_size=16, max_model_len=64)
    s.add(req("a", 3), None)  # 2 pages
    b = s.add(req("b", 3), None)  # 2 pages
    run_step(s)
    assert kv.num_free == 0
    run_step(s)  # both decode token 3, which still fits in their second pages
    # a needs a third page for token 4 → the newest (b) is preempted.
    out = run_step(s)
    assert b.status == SeqStatus.WAITING and b.num_computed == 0 and b.num_preemptions == 1
    assert [c.seq.request_id for c in out.chunks] == ["a"]
    assert len(kv.block_table("a")) == 3


def test_a_sequence_alone_that_cannot_grow_finishes_with_length() -> None:
    kv = KVCacheManager(num_pages=2, page_size=2)
    s = Scheduler(kv, max_active=4, prefill_chunk_size=16, max_model_len=64)
    a = s.add(req("a", 3), None)
    run_step(s)  # prefill 3 tokens (2 pages) + sample → 4 tokens
    run_step(s)  # decode token 3 fits in page 1
    out = s.schedule()  # token 4 needs a third page that does not exist
    assert out.finished_early == ((a, EngineFinish.LENGTH),)
    assert kv.num_free == 2


def test_admission_waits_for_slots() -> None:
    kv = KVCacheManager(num_pages=16, page_size=4)
    s = Scheduler(kv, max_active=1, prefill_chunk_size=16, max_model_len=64)
    s.add(req("a", 2), None)
    s.add(req("b", 2), None)
    out = run_step(s)
    assert [c.seq.request_id for c in out.chunks] == ["a"]
    s.abort(["a"])
    out = run_step(s)
    assert [c.seq.request_id for c in out.chunks] == ["b"]


def test_the_newest_request_needing_a_page_never_evicts_one_already_scheduled() -> None:
    """Regression: when the newest decoding request needed a page and the pool was exhausted, the
    victim was the newest *other* request, already scheduled for decode in the same step: it kept
    its chunk with status WAITING and an empty block table, and the step failed every request.
    Now the requester preempts itself when every other request already runs this step."""
    kv = KVCacheManager(num_pages=2, page_size=4)
    s = Scheduler(kv, max_active=4, prefill_chunk_size=16, max_model_len=64)
    a = s.add(req("a", 2, max_tokens=4), None)  # 1 page
    b = s.add(req("b", 3, max_tokens=4), None)  # 1 page; the pool is now full
    run_step(s)  # prefill both: a has 3 tokens, b 4
    run_step(s)  # both decode within their page: a 4, b 5
    out = run_step(s)  # a still fits; b's 5th token needs a second page
    assert [c.seq.request_id for c in out.chunks] == ["a"]
    assert a.status == SeqStatus.RUNNING and kv.block_table("a") == [0]
    assert b.status == SeqStatus.WAITING and b.num_preemptions == 1 and kv.block_table("b") == []
    for _ in range(10):
        if not s.has_work:
            break
        for c in run_step(s).chunks:
            assert c.seq.status != SeqStatus.WAITING  # nothing scheduled was preempted
    assert not s.has_work and kv.num_free == 2
    assert a.num_output_tokens == 4 and b.num_output_tokens == 4


def test_shared_pages_are_counted_and_freed_by_the_last_holder() -> None:
    kv = KVCacheManager(num_pages=4, page_size=2, enable_caching=True)
    assert kv.allocate_slots("a", 0, 4) == [0, 1]
    kv.cache_full_pages("a", [5, 6, 7, 8], 4)
    pages, hashes = kv.lookup([5, 6, 7, 8, 9])  # b's prompt starts with a's two full pages
    assert pages == [0, 1]
    kv.allocate_cached("b", pages, hashes)
    assert kv.allocate_slots("b", 4, 1) == [2]
    assert kv.ref_counts == [2, 2, 1, 0] and kv.num_free == 1
    kv.check_integrity()
    kv.free("a")
    assert kv.ref_counts == [1, 1, 1, 0] and kv.num_free == 1
    kv.free("b")
    assert kv.num_free == 4 and kv.ref_counts == [0, 0, 0, 0] and kv.num_cached == 2  # kept, evictable
    kv.check_integrity()
    assert kv.allocate_slots("c", 0, 9) is None and kv.block_table("c") == []  # nothing half-allocated
