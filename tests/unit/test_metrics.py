"""Serving metrics (helios.obs.metrics): the collector's values, the first-response window, how a
finished request counts, decode weight bytes, and the engine thread's health check."""

from __future__ import annotations

import threading
import time
from typing import Any

import attrs
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from helios.asgi.admission import AdmissionSlots
from helios.domain.events import FailureKind
from helios.engine.core import EngineThread
from helios.engine.records import (
    GRAMMAR_FAILURE,
    CheckpointStats,
    EngineFinish,
    EngineStats,
    Histogram,
    HostCacheStats,
    RequestOutput,
)
from helios.models.config import ModelConfig
from helios.models.llama import LlamaForCausalLM
from helios.obs.access import RequestStats
from helios.obs.metrics import (
    ABSENT_FEATURE_FIELDS,
    EXPORTED,
    ServingMetrics,
    SlidingMedian,
    request_outcome,
)

STATS = EngineStats(active=2, pending=3, free_pages=90, total_pages=128, page_tokens=16, prefill_tokens=1234,
                    generated_tokens=567, decode_weight_bytes=4096)


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict[str, Any], name: str, sample: str | None = None, **labels: str) -> float:
    for s in fams[name].samples:
        if s.name == (sample or name) and s.labels == labels:
            return float(s.value)
    raise KeyError((name, sample, labels))


# -- the collector ------------------------------------------------------------------------------------


def _host_stats() -> HostCacheStats:
    tokens = Histogram((0.0, 16.0, 64.0))
    for v in (0, 10, 40, 100):
        tokens.observe(v)
    ns = Histogram((1e4, 1e6))
    ns.observe(5e5)
    return HostCacheStats(
        hits=3, reused_tokens=48, memory_records=5, disk_records=7, parked_records=1, bytes_out=9000, bytes_in=4000,
        held={"dram": 9, "nvme": 7}, dropped={("dram", "end_of_chain"): 0, ("nvme", "io_error"): 2}, skipped=1,
        missing_tokens=tokens, transfer_ns=ns, prefill_ns=ns)


def test_the_prefix_cache_and_host_store_export_their_families_with_real_values() -> None:
    stats = attrs.evolve(STATS, prefix_caching=True, reused_tokens=320, cached_pages=40, host=_host_stats())
    m = ServingMetrics(lambda: (stats, AdmissionSlots(8)))
    snap = m.snapshot()
    assert (snap["reused_tokens"], snap["cached_pages"], snap["host_hits"], snap["host_reused_tokens"]) == (320, 40, 3, 48)
    assert (snap["host_memory_records"], snap["host_disk_records"], snap["host_bytes_out"], snap["host_bytes_in"]) == (
        5, 7, 9000, 4000)
    fams = families(m.prometheus())
    assert value(fams, "flare_cache_reused_tokens", "flare_cache_reused_tokens_total") == 320
    assert value(fams, "flare_cached_kv_pages") == 40
    assert value(fams, "flare_host_cache_hits", "flare_host_cache_hits_total") == 3
    assert value(fams, "flare_host_cache_disk_records") == 7
    assert value(fams, "flare_host_cache_held", "flare_host_cache_held_total", tier="nvme") == 7
    assert value(fams, "flare_host_cache_dropped", "flare_host_cache_dropped_total", tier="nvme",
                 reason="io_error") == 2
    hist = "flare_host_cache_missing_tokens"
    assert fams[hist].type == "histogram"
    assert [value(fams, hist, hist + "_bucket", le=le) for le in ("0", "16", "64", "+Inf")] == [1, 2, 3, 4]
    assert value(fams, hist, hist + "_sum") == 150 and value(fams, hist, hist + "_count") == 4
    assert value(fams, "flare_host_cache_estimated_transfer_ns", "flare_host_cache_estimated_transfer_ns_count") == 1
    # The cache without a host store: its own families only.
    bare = ServingMetrics(lambda: (attrs.evolve(stats, host=None), None))
    names = {s.name for f in families(bare.prometheus()).values() for s in f.samples}
    assert "flare_cached_kv_pages" in names and not any("host_cache" in n for n in names)


def test_state_checkpoints_export_their_families_with_real_values() -> None:
    ckpt = CheckpointStats(captures={"anchor": 4, "message": 1, "endpoint": 6},
                           skips={"unknown_cost": 1, "work_budget": 2, "storage": 3}, extra_work_ns=123456,
                           anchor_reservations=2, restores=5, host_restores=1, snapshots=7, slots=16)
    m = ServingMetrics(lambda: (attrs.evolve(STATS, prefix_caching=True, checkpoints=ckpt), None))
    snap = m.snapshot()
    assert snap["checkpoint_captures"] == {"anchor": 4, "message": 1, "endpoint": 6}
    assert snap["checkpoint_skips"] == {"unknown_cost": 1, "work_budget": 2, "storage": 3}
    assert (snap["checkpoint_extra_work_ns"], snap["checkpoint_anchor_reservations"]) == (123456, 2)
    fams = families(m.prometheus())
    for role, n in ckpt.captures.items():
        assert value(fams, "flare_checkpoint_captures", "flare_checkpoint_captures_total", role=role) == n
    for reason, n in ckpt.skips.items():
        assert value(fams, "flare_checkpoint_skips", "flare_checkpoint_skips_total", reason=reason) == n
    assert value(fams, "flare_checkpoint_extra_work_nanoseconds",
                 "flare_checkpoint_extra_work_nanoseconds_total") == 123456
    assert value(fams, "flare_checkpoint_anchor_reservations") == 2
    # Without checkpoints (no recurrent layout): nothing exported, zeros in the JSON object.
    plain = ServingMetrics(lambda: (STATS, None))
    assert not any("checkpoint" in s.name for f in families(plain.prometheus()).values() for s in f.samples)
    assert plain.snapshot()["checkpoint_captures"] == {"anchor": 0, "message": 0, "endpoint": 0}


def test_snapshot_reads_the_engine_and_admission_and_keeps_every_table_field() -> None:
    slots = AdmissionSlots(8)
    assert slots.try_acquire(3)
    m = ServingMetrics(lambda: (STATS, slots))
    snap = m.snapshot()
    for key in ("prefill_tokens", "generated_tokens", "active", "pending", "free_pages", "total_pages",
                "page_tokens", "decode_weight_bytes"):
        assert snap[key] == getattr(STATS, key), key
    # completed / failed count HTTP requests here, not the engine's children.
    assert snap["completed"] == 0 and snap["failed"] == 0
    assert snap["http_admission_in_use"] == 3 and snap["http_admission_total"] == 8
    for key, zero in ABSENT_FEATURE_FIELDS.items():
        assert snap[key] == zero and type(snap[key]) is type(zero), key
    assert snap["learned_drafter"] is False
    assert snap["first_response"] == {"median_seconds": None, "samples": 0, "window_seconds": 60,
                                      "capacity": 4096, "truncated": False}
    assert isinstance(snap["uptime_seconds"], int)
    # Before start-up there is no engine: zeros, not an error.
    assert ServingMetrics().snapshot()["total_pages"] == 0


def test_prometheus_text_parses_and_exports_only_what_exists() -> None:
    slots = AdmissionSlots(8)
    m = ServingMetrics(lambda: (STATS, slots))
    text = m.prometheus()
    assert "# TYPE flare_generated_tokens_total counter" in text
    fams = families(text)
    assert value(fams, "flare_prefill_tokens", "flare_prefill_tokens_total") == 1234
    assert value(fams, "flare_generated_tokens", "flare_generated_tokens_total") == 567
    assert value(fams, "flare_active_requests") == 2
    assert value(fams, "flare_pending_requests") == 3
    assert value(fams, "flare_free_kv_pages") == 90
    assert value(fams, "flare_total_kv_pages") == 128
    assert value(fams, "flare_kv_page_tokens") == 16
    assert value(fams, "flare_decode_weight_bytes") == 4096
    assert value(fams, "flare_http_admission_slots") == 8
    assert value(fams, "flare_http_admission_in_use") == 0
    assert value(fams, "flare_uptime_seconds") >= 0
    assert value(fams, "flare_requests_completed", "flare_requests_completed_total") == 0
    assert value(fams, "flare_requests_failed", "flare_requests_failed_total") == 0
    for stage in ("admission", "execution", "output"):
        assert value(fams, "helios_requests_failed_by_stage", "helios_requests_failed_by_stage_total", stage=stage) == 0
    for hist in ("helios_time_to_first_token_seconds", "helios_inter_token_latency_seconds",
                 "helios_e2e_request_latency_seconds"):
        assert fams[hist].type == "histogram"
        assert value(fams, hist, hist + "_count") == 0
    # Every table field Helios has is exported under its spec name, and nothing of absent features.
    names = {s.name for f in fams.values() for s in f.samples}
    for _key, (name, _kind, _doc) in EXPORTED.items():
        assert name in names, name
    for absent in ("draft", "verif", "speculative", "replay", "host_", "cached_kv_pages", "cache_reused",
                   "checkpoint", "learned", "graph"):
        assert not any(absent in n for n in names), absent
    # Every counter and gauge is flare_-prefixed; histograms and the stage breakdown are helios_.
    assert all(n.startswith(("flare_", "helios_")) for n in names)
    assert {f.name for f in fams.values() if f.type == "histogram"} == {
        "helios_time_to_first_token_seconds", "helios_inter_token_latency_seconds", "helios_e2e_request_latency_seconds"}


def test_two_apps_have_separate_registries() -> None:
    a, b = ServingMetrics(), ServingMetrics()
    a.time_to_first_token(0.5)
    assert value(families(a.prometheus()), "helios_time_to_first_token_seconds",
                 "helios_time_to_first_token_seconds_count") == 1
    assert value(families(b.prometheus()), "helios_time_to_first_token_seconds",
                 "helios_time_to_first_token_seconds_count") == 0


def test_lifecycle_histograms_from_a_request_record() -> None:
    m = ServingMetrics()
    s = RequestStats(started=time.perf_counter() - 0.25, sink=m)
    s.admission(granted=False)
    s.admission(granted=True)
    s.observe((1, 0), "c1", 10, 1, True)  # the prefill's token: time to first token, no gap yet
    s.observe((1, 0), "c1", 10, 2, True)  # a gap of one token
    s.observe((1, 0), "c1", 10, 5, True)  # three tokens at once: three gaps
    s.observe((1, 0), "c2", 10, 1, True)  # another child's first token: no gap, no second TTFT
    s.sent({"type": "http.response.start", "status": 200, "headers": []})
    s.sent({"type": "http.response.body", "body": b"{}"})
    s.new_generation()
    assert m.finish_request(s) == ("completed", None)
    fams = families(m.prometheus())
    assert value(fams, "helios_time_to_first_token_seconds", "helios_time_to_first_token_seconds_count") == 1
    assert value(fams, "helios_time_to_first_token_seconds", "helios_time_to_first_token_seconds_sum") >= 0.25
    assert value(fams, "helios_inter_token_latency_seconds", "helios_inter_token_latency_seconds_count") == 4
    assert value(fams, "helios_e2e_request_latency_seconds", "helios_e2e_request_latency_seconds_count") == 1
    assert value(fams, "helios_e2e_request_latency_seconds", "helios_e2e_request_latency_seconds_sum") >= 0.25
    assert m.snapshot()["completed"] == 1


def test_first_response_from_admission_to_first_offered_text() -> None:
    from helios.domain.events import ReasoningDelta, TextDelta, ToolCall

    m = ServingMetrics()
    s = RequestStats(sink=m)
    s.admission(granted=True)
    s.admitted = time.perf_counter() - 0.5

    @attrs.define
    class Update:
        events: list[Any]

    @attrs.define
    class Out:
        finish: Any = None
        failure: Any = None

    s.observe_update(Out(), Update([TextDelta("")]))  # nothing offered yet
    s.observe_update(Out(), Update([ToolCall("id", "f", "{}")]))  # a tool call is not answer text
    assert m.snapshot()["first_response"]["samples"] == 0
    s.observe_update(Out(), Update([ReasoningDelta("Hm")]))
    s.observe_update(Out(), Update([TextDelta("Hi")]))  # once per request
    fr = m.snapshot()["first_response"]
    assert fr["samples"] == 1 and 0.5 <= fr["median_seconds"] < 5


def test_sliding_median_window_and_capacity() -> None:
    w = SlidingMedian(window_seconds=60, capacity=3)
    assert w.snapshot(0.0)["median_seconds"] is None
    w.add(1.0, at=0.0)
    w.add(3.0, at=10.0)
    snap = w.snapshot(20.0)
    assert snap == {"median_seconds": 2.0, "samples": 2, "window_seconds": 60, "capacity": 3, "truncated": False}
    assert w.snapshot(65.0)["samples"] == 1  # the first sample left the window
    w.add(5.0, at=66.0)
    w.add(7.0, at=67.0)
    w.add(9.0, at=68.0)  # the capacity drops the sample of t=10, still inside the window
    snap = w.snapshot(68.0)
    assert snap["samples"] == 3 and snap["median_seconds"] == 7.0 and snap["truncated"] is True
    assert w.snapshot(200.0) == {"median_seconds": None, "samples": 0, "window_seconds": 60, "capacity": 3,
                                 "truncated": False}


# -- how a finished request counts ------------------------------------------------------------------


def finished(status: int | None, *, admission: bool = True, generations: int = 1, error: str | None = None,
             failure: str | None = None, disconnected: bool = False) -> RequestStats:
    s = RequestStats()
    if admission:
        s.admission(granted=status != 429)
    for _ in range(generations):
        s.new_generation()
    if status is not None:
        s.sent({"type": "http.response.start", "status": status, "headers": []})
    s.error, s.failure, s.disconnected = error, failure, disconnected
    return s


@pytest.mark.parametrize(("stats", "outcome"), [
    (finished(200), ("completed", None)),
    (finished(200, admission=False), None),  # /v1/models, /health: not a generation request
    (finished(503, admission=False, generations=0), None),  # /health 503 is no failed request
    (finished(400, generations=0), None),  # refused as the client's error after admission
    (finished(429, generations=0), ("failed", "admission")),
    (finished(503, generations=0), ("failed", "admission")),  # the model queue is full
    (finished(500), ("failed", "output")),  # tool-choice validation: a buffered 500
    (finished(200, error="server_error"), ("failed", "output")),  # ... or a stream's terminal error event
    (finished(500, failure="execution"), ("failed", "execution")),  # the engine failed a child
    (finished(200, error="server_error", failure="execution"), ("failed", "execution")),
    (finished(500, generations=0), ("failed", "execution")),  # an unexpected exception before the engine
    (finished(None, disconnected=True), None),  # the client went away
    (finished(200, disconnected=True), None),
    (finished(None, generations=0), ("failed", "execution")),  # nothing sent, no disconnect: the server's fault
    (finished(200, generations=0), None),  # max_tokens 0: nothing generated
])
def test_request_outcome(stats: RequestStats, outcome: Any) -> None:
    assert request_outcome(stats) == outcome


def test_each_failed_request_counts_once_by_stage() -> None:
    m = ServingMetrics()
    for s in (finished(429, generations=0), finished(500), finished(200, error="x", failure="execution"),
              finished(200), finished(400, generations=0)):
        m.finish_request(s)
    snap = m.snapshot()
    assert snap["failed"] == 3 and snap["completed"] == 1
    fams = families(m.prometheus())
    total = "helios_requests_failed_by_stage_total"
    assert value(fams, "helios_requests_failed_by_stage", total, stage="admission") == 1
    assert value(fams, "helios_requests_failed_by_stage", total, stage="output") == 1
    assert value(fams, "helios_requests_failed_by_stage", total, stage="execution") == 1
    assert value(fams, "flare_requests_failed", "flare_requests_failed_total") == 3


def test_grammar_failures_count_in_failed_under_their_own_stage() -> None:
    """An engine child ended by its structured-output grammar is a grammar failure; another engine
    error stays an execution one; both count in `failed`."""
    m = ServingMetrics()
    for error, kind in ((f"{GRAMMAR_FAILURE}: token 5 is not allowed", FailureKind.GRAMMAR),
                        ("engine failure: boom", FailureKind.ENGINE)):
        s = finished(500)
        s.observe_update(RequestOutput("r", (), finish=EngineFinish.ERROR, error=error, failure=kind), None)
        m.finish_request(s)
    snap = m.snapshot()
    assert snap["failed"] == 2
    fams = families(m.prometheus())
    total = "helios_requests_failed_by_stage_total"
    assert value(fams, "helios_requests_failed_by_stage", total, stage="grammar") == 1
    assert value(fams, "helios_requests_failed_by_stage", total, stage="execution") == 1


# -- decode weight bytes ------------------------------------------------------------------------------


def tiny(tied: bool) -> ModelConfig:
    return ModelConfig(arch="llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=2,
                       num_heads=2, num_kv_heads=1, head_dim=8, tie_word_embeddings=tied)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_weight_bytes(tied: bool, dtype: torch.dtype) -> None:
    cfg = tiny(tied)
    model = LlamaForCausalLM(cfg, dtype=dtype)
    if dtype != torch.float32:
        model._lm_head_fp32 = model.lm_head.detach().float()  # what load_weights keeps
    es = torch.tensor([], dtype=dtype).element_size()
    embed = cfg.vocab_size * cfg.hidden_size
    everything = sum(p.numel() * p.element_size() for p in model.parameters())  # tied ones once; norms fp32
    head = embed * (4 if dtype != torch.float32 else es)  # what the logits read
    if tied:
        expected = everything - embed * es + cfg.hidden_size * es + head
    else:
        expected = everything - 2 * embed * es + cfg.hidden_size * es + head
    assert model.decode_weight_bytes() == expected
    # The layers dominate nothing here, but a decode step never reads the whole embedding table.
    assert model.decode_weight_bytes() < everything + head


# -- the engine thread's health ---------------------------------------------------------------------


class _Scheduler:
    def __init__(self) -> None:
        self.has_work = False
        self.running: list[Any] = []
        self.waiting: list[Any] = []


class _Core:
    """Just enough of EngineCore for EngineThread: `step` runs `behaviour` once there is work."""

    def __init__(self, behaviour: Any) -> None:
        self.scheduler = _Scheduler()
        self.behaviour = behaviour
        self.failed = 0

    def stats(self, threads: Any = None) -> EngineStats:
        return STATS

    def close(self) -> None:
        pass

    def add(self, request: Any) -> None:
        self.scheduler.has_work = True

    def step(self) -> list[Any]:
        self.behaviour()
        return []


class Boom(BaseException):
    """Not an Exception: the engine loop's `except Exception` does not catch it, so the thread dies."""


def test_engine_thread_death_is_reported() -> None:
    def die() -> None:
        raise Boom("injected")

    thread = EngineThread(_Core(die), lambda outs: None)  # type: ignore[arg-type]
    thread.start()
    assert thread.problem(60.0) is None
    thread.submit(object())  # type: ignore[arg-type]
    deadline = time.monotonic() + 10
    while thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    problem = thread.problem(60.0)
    assert problem is not None and "died" in problem and "Boom" in problem
    assert thread.healthy is False


def test_engine_thread_wedge_is_reported_and_clears() -> None:
    release = threading.Event()

    def block() -> None:  # a forward that hangs until released, then the work is done
        release.wait(10)
        core.scheduler.has_work = False

    core = _Core(block)
    thread = EngineThread(core, lambda outs: None)  # type: ignore[arg-type]
    thread.start()
    try:
        for _ in range(10):  # idle: waiting for work is never a stall, even past the threshold
            time.sleep(0.07)
            assert thread.problem(0.05) is None
        thread.submit(object())  # type: ignore[arg-type]
        deadline = time.monotonic() + 10
        while thread.problem(0.3) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        problem = thread.problem(0.3)
        assert problem is not None and "wedged" in problem
        assert thread.problem(60.0) is None  # a generous threshold does not call it wedged yet
    finally:
        release.set()
    deadline = time.monotonic() + 10
    while thread.problem(0.3) is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert thread.problem(0.3) is None
    thread.shutdown()
    assert not thread.is_alive() and thread.problem(60.0) is not None  # stopped: not serving
