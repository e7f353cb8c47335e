"""State checkpoints (`engine/kv/checkpoints.py`): the prefix cache of a layout with recurrent
layers, on the synthetic hybrid model of `tests/unit/hybrid_model.py` (full attention, a sliding
window and a recurrent layer). A request restored from a checkpoint (the snapshot pool, the host
store's DRAM tier, its disk tier after a restart) is compared with the same request on a fresh
engine without a prefix cache (float32, 1e-5) and with the float64 reference of
`tests/unit/test_hybrid_cache.py`; the pool's ownership directly; the skips under tiny limits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from helios.engine.core import EngineConfig, EngineCore
from helios.engine.kv.checkpoints import SnapshotPool
from helios.engine.kv.coordinator import KVCacheCoordinator
from helios.engine.kv.layout import CacheLayout
from helios.engine.records import EngineRequest, RequestOutput
from helios.engine.speculative import SpeculativeConfig
from helios.models.interface import FullAttentionSpec, RecurrentStateSpec
from helios.obs.metrics import ServingMetrics
from tests.unit.hybrid_model import HybridModel, build_hybrid_model
from tests.unit.test_engine import run
from tests.unit.test_hybrid_cache import check_against_reference, greedy, prompts

PS = 4
EXACT = 1e-5
# Full attention and recurrent layers only (Qwen3-Next's kinds): one paged group, so a host restore
# is never held up by a page one group keeps in its pool and another only in the host store.
FULL_RECURRENT = {"layers": ("full", "recurrent", "full", "recurrent"), "seed": 1}


def engine(model: HybridModel, **overrides: object) -> EngineCore:
    cfg = dict(page_size=PS, num_pages=64, max_active=2, prefill_chunk_size=16, max_model_len=128)
    cfg.update(overrides)
    return EngineCore(model, EngineConfig(**cfg), torch.float32)  # type: ignore[arg-type]


def tokens_of(records: list[RequestOutput]) -> list[int]:
    return [t for o in records for t in o.new_token_ids]


def assert_same(got: list[RequestOutput], want: list[RequestOutput]) -> None:
    """Token for token, logprob for logprob (and the top alternatives) within 1e-5."""
    assert tokens_of(got) == tokens_of(want)
    lp_got = [lp for o in got for lp in (o.logprobs or ())]
    lp_want = [lp for o in want for lp in (o.logprobs or ())]
    assert len(lp_got) == len(lp_want) > 0
    for a, b in zip(lp_got, lp_want, strict=True):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) <= EXACT
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert all(abs(x - y) <= EXACT for (_, x), (_, y) in zip(a.top, b.top, strict=True))


def fresh(model: HybridModel, request: EngineRequest) -> list[RequestOutput]:
    """The request on an engine without a prefix cache: the independent computation."""
    core = engine(model, prefix_caching=False)
    assert core.checkpoints is None and core.kv_manager.enable_caching is False
    return run(core, [request])[request.request_id]


def first_turn(core: EngineCore, prompt: list[int], rid: str = "a", max_tokens: int = 6) -> list[int]:
    """Run one request; return the next turn's prompt head (its prompt and output)."""
    outs = run(core, [greedy(rid, prompt, max_tokens)])
    return prompt + tokens_of(outs[rid])


def test_a_follow_up_turn_restores_the_endpoint_checkpoint() -> None:
    """Turn one: 13 prompt tokens and 6 generated; its anchor (position 12) is skipped (a split's
    cost is unknown before any decode step), its decode completes the page ending at 16 (endpoint).
    Turn two extends its prompt and output by 5 tokens: it restores the checkpoint at 16 (pages and
    state), reports 16 cached tokens and equals a fresh engine's run. Its own anchor (position 24,
    its prompt's end, a split) is captured, and a third turn extending that prompt restores from
    there. (The allowance is all of the step time: a split is charged a whole decode step, which a
    tenth of turn one's few steps may not cover; the default fraction is tested for copies below.)"""
    model = build_hybrid_model()
    core = engine(model, checkpoint_work_fraction=1.0)
    assert core.checkpoints is not None and core.kv_manager.enable_caching
    assert not core.scheduler.speculative.enabled
    head = first_turn(core, prompts((13,))[0])
    st = core.stats().checkpoints
    assert st is not None
    assert st.captures == {"anchor": 0, "message": 0, "endpoint": 1}
    assert st.skips["unknown_cost"] == 1 and st.snapshots == 1 and st.restores == 0

    second = greedy("b", [*head, 3, 1, 4, 1, 5], 6)
    outs = run(core, [second])["b"]
    assert_same(outs, fresh(model, second))
    check_against_reference(model, list(second.prompt_token_ids), outs, 6)
    assert outs[-1].num_cached_tokens == 16 and core.scheduler.reused_tokens == 16
    st = core.stats().checkpoints
    assert st is not None and st.restores == 1 and st.captures["anchor"] == 1 and st.anchor_reservations == 0
    assert 0 < st.extra_work_ns <= core.checkpoints.work_fraction * core.checkpoints.step_ns_total

    third = greedy("c", [*second.prompt_token_ids, 9, 9, 9], 4)
    outs = run(core, [third])["c"]
    assert_same(outs, fresh(model, third))
    # c extends b's prompt, not its output: b's anchor at 24 is the checkpoint it restores.
    assert outs[-1].num_cached_tokens == 24
    # The counts reach the exposition (EngineStats -> ServingMetrics).
    st = core.stats().checkpoints
    assert st is not None
    text = ServingMetrics(lambda: (core.stats(), None)).prometheus()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    captured = {s.labels["role"]: s.value for s in fams["flare_checkpoint_captures"].samples
                if s.name == "flare_checkpoint_captures_total"}
    assert captured == st.captures and captured["endpoint"] >= 2 and captured["anchor"] >= 1
    skipped = {s.labels["reason"]: s.value for s in fams["flare_checkpoint_skips"].samples
               if s.name == "flare_checkpoint_skips_total"}
    assert skipped == st.skips and skipped["unknown_cost"] == 1
    work = fams["flare_checkpoint_extra_work_nanoseconds"].samples[0].value
    assert work == st.extra_work_ns > 0


def test_an_aligned_prompt_anchor_and_a_message_marker() -> None:
    """A 16-token prompt ends on a page boundary: its anchor needs no split (the copy alone is
    charged, known from the timed copy at start). Its marker at 9 tokens floors to the boundary 8
    (a split: unknown cost on a fresh engine, captured once a decode step has been timed; a split
    is charged a whole decode step, so this engine's allowance is all of its step time)."""
    model = build_hybrid_model()
    core = engine(model, checkpoint_work_fraction=1.0)
    base = prompts((16,), vocab=61)[0]
    run(core, [EngineRequest("m0", tuple(base), greedy("m0", base, 3).sampling, max_tokens=3, ignore_eos=True,
                             num_top_logprobs=5, marker_tokens=(9,))])
    st = core.stats().checkpoints
    assert st is not None
    assert st.captures["anchor"] == 1 and st.captures["message"] == 0 and st.skips["unknown_cost"] == 1
    other = [7, *base[1:]]  # another first page: nothing to reuse
    run(core, [EngineRequest("m1", tuple(other), greedy("m1", other, 3).sampling, max_tokens=3, ignore_eos=True,
                             num_top_logprobs=5, marker_tokens=(9,))])
    st = core.stats().checkpoints
    assert st is not None and st.captures["message"] == 1 and st.captures["anchor"] == 2
    # A prompt sharing m1's first 10 tokens only restores m1's message checkpoint at 8.
    probe = greedy("p", [*other[:10], 1, 2, 3, 4, 5], 5)
    outs = run(core, [probe])["p"]
    assert outs[-1].num_cached_tokens == 8
    assert_same(outs, fresh(model, probe))


def test_restore_after_eviction_to_the_host_store() -> None:
    """One snapshot row and a small page pool: turn one's pages and its snapshot are pushed out to
    the host store's DRAM tier by other requests; the follow-up turn restores both from there."""
    model = build_hybrid_model(FULL_RECURRENT)
    core = engine(model, num_pages=14, max_active=1, checkpoint_slots=1, host_memory_bytes=1 << 22)
    assert core.host_store is not None and core.checkpoints is not None
    head = first_turn(core, prompts((13,))[0])
    for i, other in enumerate(prompts((21, 21), vocab=59)):
        run(core, [greedy(f"x{i}", [t + 2 for t in other], 6)])
    kv = core.kv_manager
    assert isinstance(kv, KVCacheCoordinator) and kv.snapshots is not None
    h16 = kv.chain(head, 4)[3]
    assert not kv.snapshots.has(h16) and core.host_store.contains(core.checkpoints.key(h16))
    assert len(kv.primary.lookup(head)[0]) < 4  # pages of its checkpoint left the pool
    second = greedy("b", [*head, 3, 1, 4, 1, 5], 6)
    outs = run(core, [second])["b"]
    assert outs[-1].num_cached_tokens == 16
    assert_same(outs, fresh(model, second))
    st = core.stats().checkpoints
    assert st is not None and st.host_restores == 1 and core.scheduler.host_hits == 1


def test_restore_from_disk_after_a_restart(tmp_path: Path) -> None:
    """Turn one on an engine with a disk tier, closed (its pages and snapshots written out); a new
    engine over the same directory restores the follow-up turn from disk."""
    model = build_hybrid_model(FULL_RECURRENT)
    disk = dict(host_memory_bytes=1 << 20, disk_dir=str(tmp_path), disk_bytes=1 << 24)
    core = engine(model, **disk)
    head = first_turn(core, prompts((13,))[0])
    core.close()
    again = engine(model, **disk)
    assert again.host_store is not None and again.host_store.stats.disk_records > 0
    second = greedy("b", [*head, 3, 1, 4, 1, 5], 6)
    outs = run(again, [second])["b"]
    assert outs[-1].num_cached_tokens == 16
    assert_same(outs, fresh(model, second))
    st = again.stats().checkpoints
    assert st is not None and st.host_restores == 1
    again.close()


def test_a_corrupt_snapshot_record_is_recomputed(tmp_path: Path) -> None:
    """A snapshot record that fails its checksum on disk: the request starts over, exactly."""
    model = build_hybrid_model()
    disk = dict(host_memory_bytes=0, disk_dir=str(tmp_path), disk_bytes=1 << 24)
    core = engine(model, **disk)
    head = first_turn(core, prompts((13,))[0])
    kv = core.kv_manager
    assert isinstance(kv, KVCacheCoordinator) and core.checkpoints is not None
    key = core.checkpoints.key(kv.chain(head, 4)[3])
    core.close()
    record = next(p for p in tmp_path.rglob("*.kv") if int(p.stem, 16) == key)
    data = bytearray(record.read_bytes())
    data[-1] ^= 0xFF
    record.write_bytes(bytes(data))
    again = engine(model, **disk)
    second = greedy("b", [*head, 3, 1, 4, 1, 5], 6)
    outs = run(again, [second])["b"]
    assert outs[-1].num_cached_tokens == 0
    assert_same(outs, fresh(model, second))
    again.close()


@pytest.mark.parametrize(("overrides", "reason"), [({"checkpoint_slots": 0}, "storage"),
                                                  ({"checkpoint_work_fraction": 0.0}, "work_budget")])
def test_tiny_limits_skip_captures(overrides: dict[str, object], reason: str) -> None:
    """No snapshot rows: every capture is a storage skip; no work allowance: a work_budget skip.
    Nothing is captured, the follow-up turn reuses nothing and still matches."""
    model = build_hybrid_model()
    core = engine(model, **overrides)
    head = first_turn(core, prompts((13,))[0])
    second = greedy("b", [*head, 3, 1, 4, 1, 5], 6)
    outs = run(core, [second])["b"]
    assert outs[-1].num_cached_tokens == 0
    assert_same(outs, fresh(model, second))
    st = core.stats().checkpoints
    assert st is not None and sum(st.captures.values()) == 0 and st.snapshots == 0
    assert st.skips[reason] >= 2 and st.extra_work_ns == 0


def test_pending_rows_leave_no_room_for_anchors() -> None:
    """One snapshot row held by a decoding request's endpoint copy: another request's capture finds
    no row (storage), and once the first request finishes its copy is the registered checkpoint."""
    model = build_hybrid_model()
    core = engine(model, checkpoint_slots=1)
    warm = prompts((13,), vocab=53)[0]
    first_turn(core, warm, "w", 3)  # times decode steps (a split's cost is known from here on)
    long_runner = greedy("l", prompts((6,), vocab=47)[0], 20)
    core.add(long_runner)
    for _ in range(6):  # l decodes past position 8: its pending copy takes the only row
        core.step()
        core.scheduler.check_integrity()
    kv = core.kv_manager
    assert isinstance(kv, KVCacheCoordinator) and kv.snapshots is not None and kv.snapshots.pending("l")
    before = core.stats().checkpoints
    assert before is not None
    late = greedy("z", prompts((14,), vocab=43)[0], 2)
    core.add(late)
    outs: list[RequestOutput] = []
    while core.scheduler.has_work:
        outs += [o for o in core.step() if o.request_id == "z"]
        core.scheduler.check_integrity()
    st = core.stats().checkpoints
    assert st is not None and st.skips["storage"] > before.skips["storage"]
    assert_same(outs, fresh(model, late))
    assert kv.snapshots.num_registered == 1 and kv.snapshots.pending("l") is None


def test_snapshot_pool_ownership() -> None:
    evicted: list[tuple[int, int]] = []
    pool = SnapshotPool(2, on_evict=lambda h, row: evicted.append((h, row)))
    a = pool.take()
    assert a == 0 and pool.register(a, 11) and pool.has(11)
    assert pool.hold_pending("r") == 1
    pool.check_integrity({"r"})
    with pytest.raises(AssertionError, match="pending"):
        pool.check_integrity(set())
    pool.fill_pending("r", 12)
    assert not pool.has(12)  # pending: not findable yet
    assert pool.take() == 0 and evicted == [(11, 0)]  # the registered row goes, the pending one stays
    assert pool.take() is None and not pool.can_take()
    pool.give_back(0)
    assert pool.release("r") and pool.has(12)
    assert pool.hold_pending("s") == 0 and not pool.release("s")  # never filled: freed
    row = pool.take()
    assert row is not None and not pool.register(row, 12)  # a duplicate: the row is freed again
    pool.check_integrity(set())
    pool._hash_of[0] = 99
    with pytest.raises(AssertionError):
        pool.check_integrity(set())


def test_coordinator_hits_only_where_a_snapshot_is() -> None:
    layout = CacheLayout.from_specs([FullAttentionSpec(1, 2), RecurrentStateSpec(((3,),))])
    kv = KVCacheCoordinator(layout, 8, PS, enable_caching=True, num_state_slots=2, num_snapshots=2)
    assert kv.enable_caching and kv.snapshots is not None
    tokens = list(range(20))
    kv.allocate_cached("a", [], [])
    kv.allocate_slots("a", 0, 20)
    kv.cache_full_pages("a", tokens, 20)
    assert kv.lookup(tokens)[0] == []  # pages registered, no snapshot: no hit
    hashes = kv.chain(tokens, 4)
    row = kv.snapshots.take()
    assert row is not None
    kv.snapshots.register(row, hashes[1])
    hits, _ = kv.lookup(tokens)
    assert [p[0] for p in hits] == kv.block_table("a")[:2]  # the checkpoint at 8, not the 4 pages
    kv.check_integrity()


def test_every_marker_is_a_candidate_message_checkpoint() -> None:
    """Three markers (5, 9 and 14 tokens: page boundaries 4, 8 and 12) on a 21-token prompt: after
    a first request has timed a decode step, each is captured as a message checkpoint (the anchor,
    20, is left to the work budget); prompts sharing 6, 10 and 13 tokens with it restore the one at 4, 8 and 12, with
    the logprobs of a fresh engine."""
    model = build_hybrid_model()
    core = engine(model, checkpoint_work_fraction=1.0, checkpoint_slots=8)
    warm = prompts((7,), vocab=59)[0]
    run(core, [greedy("w", warm, 24)])  # step time for the allowance: three splits cost three decode steps
    base = prompts((21,), vocab=61)[0]
    run(core, [EngineRequest("m", tuple(base), greedy("m", base, 3).sampling, max_tokens=3, ignore_eos=True,
                             num_top_logprobs=5, marker_tokens=(5, 9, 14))])
    st = core.stats().checkpoints
    assert st is not None and st.captures["message"] == 3
    for shared, cached in ((6, 4), (10, 8), (13, 12)):
        probe = greedy(f"p{shared}", [*base[:shared], 1, 2, 3], 4)
        outs = run(core, [probe])[probe.request_id]
        assert outs[-1].num_cached_tokens == cached, shared
        assert_same(outs, fresh(model, probe))


@pytest.mark.parametrize("mode", ["off", "ngram"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_interleaved_conversations_match_fresh_engines(seed: int, mode: str) -> None:
    """Three conversations of three turns each (every turn extends the previous turn's prompt and
    output, some with a marker), run three at a time on a small pool (14 pages: seeds 0 and 1
    preempt), three snapshot rows and a DRAM host store (snapshots restored from it in every seed),
    on the hybrid model with a sliding window, without speculation or speculating (drafts from the
    conversations' own repeats and the shared history; rejected rounds roll the state back): every
    turn's tokens and logprobs equal its run alone on a fresh engine without a prefix cache or
    speculation, integrity holds after every step, and checkpoints were restored."""
    gen = torch.Generator().manual_seed(seed)
    model = build_hybrid_model()
    core = engine(model, num_pages=14, max_active=3, prefill_chunk_size=8, checkpoint_slots=3,
                  host_memory_bytes=1 << 20, checkpoint_work_fraction=1.0,
                  speculative=SpeculativeConfig(mode=mode, max_depth=3))
    heads = [[int(t) for t in torch.randint(0, 64, (int(torch.randint(5, 14, (1,), generator=gen)),), generator=gen)]
             for _ in range(3)]
    for turn in range(3):
        reqs = []
        for c, head in enumerate(heads):
            extra = [int(t) for t in torch.randint(0, 64, (int(torch.randint(1, 7, (1,), generator=gen)),),
                                                   generator=gen)]
            prompt = [*head, *extra]
            marker = len(head) if turn and c == 1 else 0
            reqs.append(EngineRequest(f"c{c}t{turn}", tuple(prompt), greedy("x", prompt, 1).sampling, max_tokens=5,
                                      ignore_eos=True, num_top_logprobs=5,
                                      marker_tokens=(marker,) if marker else ()))
        outs = run(core, reqs)
        for c, req in enumerate(reqs):
            assert_same(outs[req.request_id], fresh(model, req))
            heads[c] = [*req.prompt_token_ids, *tokens_of(outs[req.request_id])]
    st = core.stats().checkpoints
    assert st is not None and st.restores > 0 and st.host_restores > 0 and sum(st.captures.values()) > 0
    if mode != "off":
        assert core.scheduler.spec_stats.verification_drafts > 0


def test_the_cache_section_sets_the_checkpoint_limits() -> None:
    from helios.config import ConfigError, load_config

    cache = load_config(None, {"cache": {"checkpoint_slots": 4, "checkpoint_work_fraction": 0.25}}).cache
    assert (cache.checkpoint_slots, cache.checkpoint_work_fraction) == (4, 0.25)
    defaults = load_config(None).cache
    assert (defaults.checkpoint_slots, defaults.checkpoint_work_fraction) == (
        EngineConfig().checkpoint_slots, EngineConfig().checkpoint_work_fraction)
    with pytest.raises(ConfigError, match="cache"):
        load_config(None, {"cache": {"checkpoint_slots": -1}})
