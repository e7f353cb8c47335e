"""docs/grafana-helios.json: valid Grafana dashboard JSON whose every PromQL query names only series
Helios exports (its exposition with every feature on: the prefix cache, the host store, speculation)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from helios.asgi.admission import AdmissionSlots
from helios.engine.records import EngineStats, Histogram, HostCacheStats
from helios.engine.speculative import SpeculativeStats
from helios.obs.metrics import ServingMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-helios.json"
METRIC = re.compile(r"\b(?:flare|helios)_[a-z0-9_]+\b")

def load() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))

def queries(dash: dict[str, Any]) -> list[str]:
    """Every PromQL expression: the panels' targets and the query variables."""
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", ())]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            out.append(var["definition"])
    return out

def exported_series() -> set[str]:
    """Sample names in the exposition of a server with every feature running."""
    ns = Histogram((1e4, 1e6))
    host = HostCacheStats(hits=1, reused_tokens=16, memory_records=1, disk_records=0, parked_records=0, bytes_out=1,
                          bytes_in=1, held={"dram": 1}, dropped={("dram", "end_of_chain"): 1}, skipped=0,
                          missing_tokens=Histogram((0.0, 16.0)), transfer_ns=ns, prefill_ns=ns)
    spec = SpeculativeStats(verify_steps=2, verification_drafts=8, verification_rounds=4, accepted_drafts=5,
                            draft_rounds=2, steps_by_width={5: 2}, rounds_by_depth={0: 2, 4: 2}, accepted_by_depth={4: 5})
    stats = EngineStats(active=1, pending=0, free_pages=90, total_pages=128, page_tokens=16, prefill_tokens=100,
                        generated_tokens=50, prefix_caching=True, reused_tokens=32, cached_pages=4, host=host,
                        speculative_mode="ngram", history_drafts=True, speculative=spec)
    metrics = ServingMetrics(lambda: (stats, AdmissionSlots(8)))
    text = metrics.prometheus()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}

def test_the_dashboard_is_grafana_json_with_unique_panels_on_a_prometheus_datasource() -> None:
    dash = load()
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    panels = dash["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    names = [v["name"] for v in dash["templating"]["list"]]
    assert "datasource" in names and "instance" in names
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) >= 10
    for p in graphs:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert set(p["gridPos"]) == {"h", "w", "x", "y"} and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs))
    # What issue 31 asks the dashboard to show.
    titles = " ".join(p["title"].lower() for p in graphs)
    for topic in ("tokens per second", "time to first token", "queue", "kv pages", "cache", "draft"):
        assert topic in titles, topic

def test_every_metric_a_dashboard_query_names_is_in_the_exposition() -> None:
    series = exported_series()
    named = {m for expr in queries(load()) for m in METRIC.findall(expr)}
    assert named, "no metric names found"
    missing = sorted(named - series)
    assert not missing, f"the dashboard queries series Helios does not export: {missing}"
    # The throughput, TTFT, queue, KV page, cache and speculation series are all used.
    for name in ("flare_generated_tokens_total", "helios_time_to_first_token_seconds_bucket", "flare_pending_requests",
                 "flare_free_kv_pages", "flare_cache_reused_tokens_total", "flare_accepted_draft_tokens_total"):
        assert name in named, name

def test_the_exposition_helper_sees_labelled_and_histogram_series() -> None:
    series = exported_series()
    assert {"flare_speculative_rounds_total", "helios_requests_failed_by_stage_total",
            "flare_host_cache_missing_tokens_bucket", "flare_history_drafts_enabled"} <= series
    # A name that is not exported is not accepted by accident.
    assert "flare_replay_gpu_ns_total" not in series
