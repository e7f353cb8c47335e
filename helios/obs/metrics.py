"""Serving metrics: the Prometheus exposition (format 0.0.4, through prometheus_client) and the JSON
snapshot of /metrics (spec: "Health and metrics"; docs/operations.md lists every family).

Each app owns one :class:`ServingMetrics` with its own ``CollectorRegistry`` (never the global one,
so several apps in one process do not clash). Engine-side values (token totals, active/pending,
KV pages, decode weight bytes) are read from the engine thread's latest ``EngineStats`` at scrape
time; request-side values are kept here, fed by the per-request record of helios.obs.access:

- ``completed`` and ``failed`` count HTTP generation requests (those that asked for admission
  slots), each at most once, when the request ends (:func:`request_outcome`);
- time to first token, inter-token latency and end-to-end latency are ``helios_`` histograms;
- ``first_response`` is the median time from HTTP admission to the first offered answer or
  reasoning text over a 60 s sliding window (:class:`SlidingMedian`).

Speculative decoding's counters (verify_steps, verification_drafts, verification_rounds,
accepted_drafts, draft_rounds, and the by-width/by-depth families) come from the engine's
``EngineStats.speculative`` and export while the engine reports them. Fields of features Helios does
not have yet (the learned drafter, CUDA graph replay) read zero in the JSON snapshot, as the spec's
readers take absent fields, and export nothing in Prometheus. The prefix cache's families (reused_tokens, cached_pages)
export while it is on, the host store's (host_*, held/dropped by tier, the three lookup
histograms) while there is one; off, their JSON fields read zero. State checkpoints
(``EngineStats.checkpoints``: captures by role, skips by reason, charged extra work, anchor
reservations) export while the engine has them (a layout with recurrent layers and the prefix
cache on); their JSON fields read zero otherwise.
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric

CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

FIRST_RESPONSE_WINDOW_S = 60.0
FIRST_RESPONSE_CAPACITY = 4096

# JSON field → (Prometheus family, kind, help), for what Helios has. Counter names carry `_total`
# as exposed; prometheus_client's metric family drops and re-appends it.
EXPORTED: dict[str, tuple[str, str, str]] = {
    "prefill_tokens": ("flare_prefill_tokens_total", "counter",
                       "Prompt tokens consumed by completed prefill, excluding padding and prefix reuse"),
    "generated_tokens": ("flare_generated_tokens_total", "counter",
                         "Committed generated tokens, including EOS and tokens withheld by text stops"),
    "decode_weight_bytes": ("flare_decode_weight_bytes", "gauge",
                            "Bytes of weights one decode step reads for one request"),
    "active": ("flare_active_requests", "gauge", "Model slots with a live request"),
    "pending": ("flare_pending_requests", "gauge", "Requests waiting in the model scheduler"),
    "completed": ("flare_requests_completed_total", "counter",
                  "Generation requests that completed successfully"),
    "failed": ("flare_requests_failed_total", "counter",
               "Requests failed by admission, execution, grammar, or output processing"),
    "free_pages": ("flare_free_kv_pages", "gauge", "KV pages free for allocation"),
    "total_pages": ("flare_total_kv_pages", "gauge", "Pages in the KV pool"),
    "page_tokens": ("flare_kv_page_tokens", "gauge", "Tokens per KV page"),
    "http_admission_in_use": ("flare_http_admission_in_use", "gauge",
                              "HTTP admission slots held (one per generated choice)"),
    "http_admission_total": ("flare_http_admission_slots", "gauge", "HTTP admission slots configured"),
    "reasoning_budget_cuts": ("flare_reasoning_budget_cuts_total", "counter",
                              "Requests whose reasoning was closed by their hard token budget"),
}

# Read from the engine's EngineStats.
ENGINE_FIELDS = ("prefill_tokens", "generated_tokens", "decode_weight_bytes", "active", "pending", "free_pages",
                 "total_pages", "page_tokens", "reasoning_budget_cuts")

# The prefix cache (EngineStats.prefix_caching) and its host store (EngineStats.host).
CACHE_EXPORTED: dict[str, tuple[str, str, str]] = {
    "reused_tokens": ("flare_cache_reused_tokens_total", "counter", "Tokens covered by page-pool prefix-cache hits"),
    "cached_pages": ("flare_cached_kv_pages", "gauge", "KV pages registered in the prefix cache"),
}
HOST_EXPORTED: dict[str, tuple[str, str, str]] = {
    "host_hits": ("flare_host_cache_hits_total", "counter", "Host prefix-store lookups whose chain admission fetched"),
    "host_reused_tokens": ("flare_host_cache_reused_tokens_total", "counter",
                           "Tokens covered by host prefix-store chains beyond the page-pool hit"),
    "host_memory_records": ("flare_host_cache_memory_records", "gauge", "Records in the host store's DRAM tier"),
    "host_disk_records": ("flare_host_cache_disk_records", "gauge", "Records in the host store's disk tier"),
    "host_bytes_out": ("flare_host_cache_bytes_out_total", "counter", "Bytes copied from KV pages to the host store"),
    "host_bytes_in": ("flare_host_cache_bytes_in_total", "counter", "Bytes copied from the host store into KV pages"),
}
HOST_HISTOGRAMS = {
    "missing_tokens": ("flare_host_cache_missing_tokens", "Prompt tokens left to prefill per host-store lookup"),
    "transfer_ns": ("flare_host_cache_estimated_transfer_ns",
                    "Time to bring a lookup's host-store pages into the page pool (measured), ns"),
    "prefill_ns": ("flare_host_cache_estimated_prefill_ns",
                   "A lookup's missing tokens times the recent prefill time per token, ns"),
}

# State checkpoints (EngineStats.checkpoints, engine/kv/checkpoints.py), besides the labelled
# captures {role} and skips {reason}.
CHECKPOINT_EXPORTED: dict[str, tuple[str, str, str]] = {
    "checkpoint_extra_work_ns": ("flare_checkpoint_extra_work_nanoseconds_total", "counter",
                                 "Charged predicted extra prefill and copy work of checkpoint captures (not a timing)"),
    "checkpoint_anchor_reservations": ("flare_checkpoint_anchor_reservations", "gauge",
                                       "Anchor checkpoints selected for running requests and not captured yet"),
}
CHECKPOINT_ROLES = ("anchor", "message", "endpoint")
CHECKPOINT_SKIP_REASONS = ("unknown_cost", "work_budget", "storage")

# Speculative decoding (EngineStats.speculative, engine/speculative.py's SpeculativeStats).
# verify_steps is exported by the width of each step's widest verification row (its sum).
SPECULATIVE_EXPORTED: dict[str, tuple[str, str, str]] = {
    "verification_drafts": ("flare_verification_draft_tokens_total", "counter",
                            "Draft positions planned for progressing request rounds, rejected drafts included"),
    "verification_rounds": ("flare_verification_request_rounds_total", "counter",
                            "Progressing decode or verification request rounds, zero-draft rounds included"),
    "accepted_drafts": ("flare_accepted_draft_tokens_total", "counter",
                        "Accepted draft tokens, excluding the bonus token"),
    "draft_rounds": ("flare_draft_request_rounds_total", "counter", "Request rounds that offered at least one draft"),
    "history_draft_rounds": ("flare_history_draft_request_rounds_total", "counter",
                             "Request rounds whose drafts came from the shared decoded history"),
    "history_accepted_drafts": ("flare_history_accepted_draft_tokens_total", "counter",
                                "Accepted draft tokens of rounds drafted from the shared decoded history"),
    "model_draft_rounds": ("flare_draft_model_request_rounds_total", "counter",
                           "Request rounds whose drafts came from the draft model"),
    "model_accepted_drafts": ("flare_draft_model_accepted_draft_tokens_total", "counter",
                              "Accepted draft tokens of rounds drafted by the draft model"),
}
SPECULATIVE_FIELDS = ("verify_steps", *SPECULATIVE_EXPORTED)

# Image input (serving/images.py ImageStore.stats(): JSON name -> value): exported while the loaded
# model takes images; the JSON object always carries them (zero for a text-only model).
def _input_table() -> dict[str, tuple[str, str, str]]:
    rows = {
        "input_decoded_images_total": ("counter", "Full decodes of image data (admission's validation, reloads)"),
        "input_prepared_images_total": ("counter", "Images the vision model's preprocessing ran for"),
        "input_rejected_images_total": ("counter", "Images rejected by validation or a per-image limit"),
        "input_source_cache_entries": ("gauge", "Image source descriptions held"),
        "input_decoded_cache_bytes": ("gauge", "Host bytes of decoded images held"),
        "input_prepared_cache_bytes": ("gauge", "Host bytes of prepared vision inputs held"),
    }
    for cache, what in (("source", "image source descriptions"), ("decoded", "decoded images"),
                        ("prepared", "prepared vision inputs")):
        rows[f"input_{cache}_cache_hits_total"] = ("counter", f"Lookups of {what} that hit")
        rows[f"input_{cache}_cache_misses_total"] = ("counter", f"Lookups of {what} that missed")
        rows[f"input_{cache}_cache_evictions_total"] = ("counter", f"Entries of {what} evicted for space")
    return {k: ("flare_" + k, kind, doc) for k, (kind, doc) in rows.items()}


INPUT_EXPORTED = _input_table()

# Fields of features that do not exist yet: zero in the JSON snapshot, absent from Prometheus.
ABSENT_FEATURE_FIELDS: dict[str, int | bool] = {
    "replay_gpu_ns": 0, "replay_readiness_wait_ns": 0, "replay_readiness_samples": 0,
}

# Failure stages (the label of helios_requests_failed_by_stage_total). `grammar`: the engine's
# structured-output matcher failed a request (rare: masks prevent it), so its series appears only
# once one is counted.
FAILURE_STAGES = ("admission", "execution", "grammar", "output")
_PRESET_STAGES = ("admission", "execution", "output")

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class SlidingMedian:
    """Samples of the last `window_seconds` (at most `capacity` of them) and their median.

    `truncated` says that the window lost samples to the capacity: a sample that would still be
    inside the window was dropped to make room."""

    def __init__(self, window_seconds: float = FIRST_RESPONSE_WINDOW_S, capacity: int = FIRST_RESPONSE_CAPACITY) -> None:
        self.window_seconds = window_seconds
        self.capacity = capacity
        self._samples: collections.deque[tuple[float, float]] = collections.deque()  # (at, value)
        self._dropped_at = -math.inf  # `at` of the newest sample dropped for capacity

    def add(self, value: float, at: float) -> None:
        self._prune(at)
        if len(self._samples) >= self.capacity:
            self._dropped_at = max(self._dropped_at, self._samples.popleft()[0])
        self._samples.append((at, value))

    def _prune(self, now: float) -> None:
        horizon = now - self.window_seconds
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()

    def snapshot(self, now: float) -> dict[str, Any]:
        self._prune(now)
        values = [v for _, v in self._samples]
        return {
            "median_seconds": statistics.median(values) if values else None,
            "samples": len(values),
            "window_seconds": int(self.window_seconds) if float(self.window_seconds).is_integer() else self.window_seconds,
            "capacity": self.capacity,
            "truncated": self._dropped_at >= now - self.window_seconds,
        }


def request_outcome(stats: Any) -> tuple[str, str | None] | None:
    """How one finished HTTP request counts: ("completed", None), ("failed", stage) or None.

    Only requests that asked for HTTP admission count (generation routes; validation errors
    before that are the client's). A request fails when it got 429 or a 5xx, when a started
    stream ended in a terminal error event, or when nothing was sent without a disconnect. Its
    stage: what a seam named (execution: the engine failed one of its children), else admission
    for 429 and 503 (HTTP slots exhausted, the model queue full, admission paused or the engine
    down), else output processing when it reached the engine (tool-choice validation, parsers,
    encoders), else execution. A client that disconnected without a failure is neither, and so is
    a request refused with another 4xx after admission (e.g. its context is too long)."""
    if not stats.admission_attempted:
        return None
    status = stats.status
    server_fault = status is not None and (status >= 500 or status == 429)
    silent = status is None and not stats.disconnected
    if stats.failure is not None or stats.error is not None or server_fault or silent:
        if stats.failure is not None:
            stage = stats.failure
        elif status in (429, 503):
            stage = "admission"
        elif stats.generations:
            stage = "output"
        else:
            stage = "execution"
        return "failed", stage
    if stats.disconnected or status is None:
        return None
    if status < 400 and stats.generations:
        return "completed", None
    return None


class ServingMetrics:
    """One app's metrics: a private registry, request counters, lifecycle histograms, the
    first-response window. `source()` returns (EngineStats or None, AdmissionSlots) at scrape time.
    Everything runs on the trio thread (the histograms are thread-safe anyway)."""

    def __init__(self, source: Callable[[], tuple[Any, Any]] | None = None, *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._source = source or (lambda: (None, None))
        self._clock = clock
        self.started = time.time()
        self.completed = 0
        self.failed_by_stage: dict[str, int] = dict.fromkeys(_PRESET_STAGES, 0)
        self.first_response_window = SlidingMedian()
        # The histograms are not registered themselves: the collector below exposes them without
        # prometheus_client's `_created` series.
        self.ttft = Histogram("helios_time_to_first_token_seconds",
                              "Time from the HTTP request's arrival to its first generated token",
                              buckets=TTFT_BUCKETS, registry=None)
        self.itl = Histogram("helios_inter_token_latency_seconds",
                             "Time between successive generated tokens of one engine child",
                             buckets=ITL_BUCKETS, registry=None)
        self.e2e = Histogram("helios_e2e_request_latency_seconds",
                             "Time from the HTTP request's arrival to its last response byte, completed requests",
                             buckets=E2E_BUCKETS, registry=None)
        self.input_stats: Callable[[], dict[str, int] | None] = lambda: None
        """The image-input caches' counters (serving.images.ImageStore.stats), None: no image input."""
        self.registry = CollectorRegistry()
        self.registry.register(_SnapshotCollector(self))

    # -- the request lifecycle (access.LifecycleSink) ---------------------------------------
    def time_to_first_token(self, seconds: float) -> None:
        self.ttft.observe(max(seconds, 0.0))

    def inter_token_latency(self, seconds: float, tokens: int) -> None:
        """`tokens` arrived together `seconds` after the child's previous token: each counts as
        one gap of `seconds / tokens`."""
        gap = max(seconds, 0.0) / max(tokens, 1)
        for _ in range(max(tokens, 1)):
            self.itl.observe(gap)

    def first_response(self, seconds: float, at: float) -> None:
        self.first_response_window.add(max(seconds, 0.0), at)

    def finish_request(self, stats: Any, now: float | None = None) -> tuple[str, str | None] | None:
        """Count a finished HTTP request (see `request_outcome`); observe its end-to-end latency
        when it completed."""
        outcome = request_outcome(stats)
        if outcome is None:
            return None
        kind, stage = outcome
        if kind == "completed":
            self.completed += 1
            end = self._clock() if now is None else now
            self.e2e.observe(max(end - stats.started, 0.0))
        else:
            key = stage or "execution"
            self.failed_by_stage[key] = self.failed_by_stage.get(key, 0) + 1
        return outcome

    @property
    def failed(self) -> int:
        """Failed requests, all stages."""
        return sum(self.failed_by_stage.values())

    # -- reading ------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The JSON object of /metrics?format=json."""
        return self._snapshot(*self._source())

    def _snapshot(self, engine: Any, slots: Any) -> dict[str, Any]:
        snap: dict[str, Any] = dict.fromkeys(EXPORTED, 0)
        snap.update(ABSENT_FEATURE_FIELDS)
        # The draft model (EngineStats.learned_drafter): draft_steps counts the positions it ran,
        # zero without one, as the spec says; JSON only (the spec names no metric for either).
        snap["learned_drafter"] = bool(getattr(engine, "learned_drafter", False))
        snap["draft_steps"] = int(getattr(engine, "draft_steps", 0))
        if engine is not None:
            for key in ENGINE_FIELDS:
                snap[key] = int(getattr(engine, key, 0))
        spec = getattr(engine, "speculative", None)
        for key in SPECULATIVE_FIELDS:
            snap[key] = int(getattr(spec, key, 0)) if spec is not None else 0
        snap["reused_tokens"] = int(getattr(engine, "reused_tokens", 0))
        snap["cached_pages"] = int(getattr(engine, "cached_pages", 0))
        ckpt = getattr(engine, "checkpoints", None)
        snap["checkpoint_extra_work_ns"] = int(ckpt.extra_work_ns) if ckpt is not None else 0
        snap["checkpoint_anchor_reservations"] = int(ckpt.anchor_reservations) if ckpt is not None else 0
        snap["checkpoint_captures"] = {r: int(ckpt.captures.get(r, 0)) if ckpt is not None else 0
                                       for r in CHECKPOINT_ROLES}
        snap["checkpoint_skips"] = {r: int(ckpt.skips.get(r, 0)) if ckpt is not None else 0
                                    for r in CHECKPOINT_SKIP_REASONS}
        host = getattr(engine, "host", None)
        snap["host_hits"] = host.hits if host is not None else 0
        snap["host_reused_tokens"] = host.reused_tokens if host is not None else 0
        snap["host_memory_records"] = host.memory_records if host is not None else 0
        snap["host_disk_records"] = host.disk_records if host is not None else 0
        snap["host_bytes_out"] = host.bytes_out if host is not None else 0
        snap["host_bytes_in"] = host.bytes_in if host is not None else 0
        inputs = self.input_stats() or {}
        for key in INPUT_EXPORTED:
            snap[key] = int(inputs.get(key, 0))
        ranks = getattr(engine, "data_parallel", ()) or ()
        if ranks:  # JSON only with data parallelism (engine/dp.py)
            snap["data_parallel"] = [{key: int(getattr(r, key)) for key in DP_RANK_FIELDS} for r in ranks]
        snap["completed"] = self.completed
        snap["failed"] = self.failed
        stat = slots.statistics() if slots is not None and hasattr(slots, "statistics") else None
        snap["http_admission_in_use"] = int(getattr(stat, "in_use", 0)) if stat is not None else 0
        snap["http_admission_total"] = int(getattr(stat, "total", 0)) if stat is not None else 0
        snap["uptime_seconds"] = int(time.time() - self.started)
        snap["first_response"] = self.first_response_window.snapshot(self._clock())
        return snap

    def prometheus(self) -> str:
        """The text exposition, format 0.0.4."""
        return generate_latest(self.registry).decode("utf-8")


class _SnapshotCollector:
    """The flare_ counters and gauges, built from one snapshot per scrape."""

    def __init__(self, metrics: ServingMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        engine, slots = m._source()  # one read of the engine's stats per scrape
        snap = m._snapshot(engine, slots)
        for key, (name, kind, doc) in EXPORTED.items():
            if kind == "counter":
                yield CounterMetricFamily(name, doc, value=snap[key])
            else:
                yield GaugeMetricFamily(name, doc, value=snap[key])
        if engine is not None and getattr(engine, "prefix_caching", False):
            yield from _families(CACHE_EXPORTED, snap)
        spec = getattr(engine, "speculative", None)
        if spec is not None and getattr(engine, "speculative_mode", "off") != "off":
            # Like the cache families: exported while the feature runs, not as zeros when it is off.
            yield from _speculative_families(spec, snap)
            yield GaugeMetricFamily("flare_history_drafts_enabled",
                                    "1 when speculating requests also draft from the shared decoded history",
                                    value=int(bool(getattr(engine, "history_drafts", False))))
        if getattr(engine, "checkpoints", None) is not None:
            yield from _checkpoint_families(snap)
        host = getattr(engine, "host", None)
        if host is not None:
            yield from _families(HOST_EXPORTED, snap)
            yield GaugeMetricFamily("flare_host_cache_parked_records",
                                    "Complete DRAM copies awaiting disk writes", value=host.parked_records)
            yield CounterMetricFamily("flare_host_cache_store_skipped", "Host-store puts of records already held",
                                      value=host.skipped)
            held = CounterMetricFamily("flare_host_cache_held", "Records the host store took in, by tier",
                                       labels=["tier"])
            for tier, n in host.held.items():
                held.add_metric([tier], n)
            yield held
            dropped = CounterMetricFamily("flare_host_cache_dropped", "Records the host store dropped, by tier and "
                                          "reason", labels=["tier", "reason"])
            for (tier, reason), n in host.dropped.items():
                dropped.add_metric([tier, reason], n)
            yield dropped
            for attr, (name, doc) in HOST_HISTOGRAMS.items():
                hist = getattr(host, attr)
                if hist is None:
                    continue
                buckets = [(_le(b), c) for b, c in zip(hist.bounds, hist.counts, strict=True)]
                buckets.append(("+Inf", hist.count))
                yield HistogramMetricFamily(name, doc, buckets=buckets, sum_value=hist.total)
        if m.input_stats() is not None:
            yield from _families(INPUT_EXPORTED, snap)
        threads = getattr(engine, "threads", None)
        if threads is not None:
            yield from _thread_families(threads)
        ranks = getattr(engine, "data_parallel", ()) or ()
        if ranks:
            yield from _rank_families(ranks)
        yield GaugeMetricFamily("flare_uptime_seconds", "Seconds since the server started",
                                value=time.time() - m.started)
        by_stage = CounterMetricFamily("helios_requests_failed_by_stage_total",
                                       "Failed requests by the stage that failed them (their sum is "
                                       "flare_requests_failed_total)", labels=["stage"])
        for stage, n in m.failed_by_stage.items():
            by_stage.add_metric([stage], n)
        yield by_stage
        for hist in (m.ttft, m.itl, m.e2e):
            for family in hist.collect():
                family.samples = [x for x in family.samples if not x.name.endswith("_created")]
                yield family


# Data parallelism (EngineStats.data_parallel, engine/dp.py's RankStats): one sample per rank.
DP_RANK_FIELDS = ("rank", "up", "in_flight", "routed", "routed_hit_tokens", "reused_tokens", "restarts",
                  "cached_pages", "pid")
DP_RANK_EXPORTED: dict[str, tuple[str, str, str]] = {
    "up": ("helios_dp_rank_up", "gauge", "1 while the data-parallel rank's process is running and ready"),
    "in_flight": ("helios_dp_rank_in_flight", "gauge", "Requests routed to the rank that have not finished"),
    "routed": ("helios_dp_rank_routed", "counter", "Requests routed to the rank"),
    "routed_hit_tokens": ("helios_dp_rank_routed_hit_tokens", "counter",
                          "Prompt tokens the router found cached on the rank when it routed requests there"),
    "reused_tokens": ("helios_dp_rank_reused_tokens", "counter",
                      "Prompt tokens the rank's engine reused from its prefix cache (since its last start)"),
    "restarts": ("helios_dp_rank_restarts", "counter", "Times the rank's process was started again after it died"),
    "cached_pages": ("helios_dp_rank_cached_pages", "gauge",
                     "Cached pages of the rank as the router's mirror of its KV events holds them"),
}


def _rank_families(ranks: Any) -> Iterator[Metric]:
    for key, (name, kind, doc) in DP_RANK_EXPORTED.items():
        samples = [([str(r.rank)], int(getattr(r, key))) for r in ranks]
        if kind == "counter":
            counter = CounterMetricFamily(name, doc, labels=["rank"])
            for labels, value in samples:
                counter.add_metric(labels, value)
            yield counter
        else:
            gauge = GaugeMetricFamily(name, doc, labels=["rank"])
            for labels, value in samples:
                gauge.add_metric(labels, value)
            yield gauge


def _thread_families(threads: Any) -> Iterator[Metric]:
    """The engine thread's intra-op team (helios/engine/threads.py), while there is an engine thread."""
    yield GaugeMetricFamily("helios_engine_threads", "Intra-op threads the engine's steps run with now",
                            value=threads.threads)
    yield GaugeMetricFamily("helios_engine_threads_max", "Configured intra-op threads ([model] threads)",
                            value=threads.max_threads)
    yield CounterMetricFamily("helios_engine_thread_changes", "Changes of the engine's team size while other "
                              "processes took or freed cores", value=threads.changes)
    if threads.adaptive:
        yield GaugeMetricFamily("helios_cpu_others_cores", "Other processes' load on the engine's CPUs in the "
                                "last measurement window, in cores", value=threads.others_cores)


def _checkpoint_families(snap: dict[str, Any]) -> Iterator[Metric]:
    yield from _families(CHECKPOINT_EXPORTED, snap)
    captures = CounterMetricFamily("flare_checkpoint_captures", "State checkpoints captured, by role",
                                   labels=["role"])
    for role, n in snap["checkpoint_captures"].items():
        captures.add_metric([role], n)
    yield captures
    skips = CounterMetricFamily("flare_checkpoint_skips", "Checkpoint selections or captures rejected, by reason",
                                labels=["reason"])
    for reason, n in snap["checkpoint_skips"].items():
        skips.add_metric([reason], n)
    yield skips


def _speculative_families(spec: Any, snap: dict[str, Any]) -> Iterator[Metric]:
    yield from _families(SPECULATIVE_EXPORTED, snap)
    rounds = CounterMetricFamily("flare_speculative_rounds", "Steps whose forward verified drafts, by the width "
                                 "(drafts + 1) of the step's widest verification row; their sum is verify_steps",
                                 labels=["width"])
    for width, n in sorted(spec.steps_by_width.items()):
        rounds.add_metric([str(width)], n)
    yield rounds
    by_depth = CounterMetricFamily("flare_verification_request_rounds_by_depth",
                                   "Progressing request rounds by planned draft depth", labels=["depth"])
    for depth, n in sorted(spec.rounds_by_depth.items()):
        by_depth.add_metric([str(depth)], n)
    yield by_depth
    accepted = CounterMetricFamily("flare_accepted_draft_tokens_by_depth",
                                   "Accepted draft tokens by the round's planned draft depth", labels=["depth"])
    for depth, n in sorted(spec.accepted_by_depth.items()):
        accepted.add_metric([str(depth)], n)
    yield accepted
    yield CounterMetricFamily("helios_speculative_paused_rounds", "Decode rounds in which a speculating request "
                              "drafted nothing because its drafts had stopped being accepted (adaptive mode)",
                              value=getattr(spec, "paused_rounds", 0))


def _families(table: dict[str, tuple[str, str, str]], snap: dict[str, Any]) -> Iterator[Metric]:
    for key, (name, kind, doc) in table.items():
        if kind == "counter":
            yield CounterMetricFamily(name, doc, value=snap[key])
        else:
            yield GaugeMetricFamily(name, doc, value=snap[key])


def _le(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)
