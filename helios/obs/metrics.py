"""Prometheus text (format 0.0.4) and the JSON snapshot of the serving state."""

from __future__ import annotations

import time
from typing import Any

_START = time.time()

# JSON field → (Prometheus name, kind)
_FIELDS: dict[str, tuple[str, str]] = {
    "prefill_tokens": ("flare_prefill_tokens_total", "counter"),
    "generated_tokens": ("flare_generated_tokens_total", "counter"),
    "active": ("flare_active_requests", "gauge"),
    "pending": ("flare_pending_requests", "gauge"),
    "completed": ("flare_requests_completed_total", "counter"),
    "failed": ("flare_requests_failed_total", "counter"),
    "free_pages": ("flare_free_kv_pages", "gauge"),
    "total_pages": ("flare_total_kv_pages", "gauge"),
    "page_tokens": ("flare_kv_page_tokens", "gauge"),
    "cached_pages": ("flare_cached_kv_pages", "gauge"),
    "reused_tokens": ("flare_cache_reused_tokens_total", "counter"),
    "reasoning_budget_cuts": ("flare_reasoning_budget_cuts_total", "counter"),
    "decode_weight_bytes": ("flare_decode_weight_bytes", "gauge"),
}


def snapshot(stats: Any, slots: Any, created: int) -> dict[str, Any]:
    snap: dict[str, Any] = dict.fromkeys(_FIELDS, 0)
    snap.update({
        "draft_steps": 0, "verify_steps": 0, "verification_drafts": 0, "verification_rounds": 0,
        "accepted_drafts": 0, "draft_rounds": 0, "replay_gpu_ns": 0, "replay_readiness_wait_ns": 0,
        "replay_readiness_samples": 0, "host_hits": 0, "host_reused_tokens": 0, "host_memory_records": 0,
        "host_disk_records": 0, "host_bytes_out": 0, "host_bytes_in": 0, "learned_drafter": False,
    })
    if stats is not None:
        for k in ("prefill_tokens", "generated_tokens", "active", "pending", "completed", "failed", "free_pages",
                  "total_pages", "page_tokens"):
            snap[k] = int(getattr(stats, k))
    stat = slots.statistics() if hasattr(slots, "statistics") else None
    snap["http_admission_in_use"] = int(getattr(stat, "in_use", 0)) if stat is not None else 0
    snap["http_admission_total"] = int(getattr(stat, "total", 0)) if stat is not None else 0
    snap["uptime_seconds"] = int(time.time() - _START)
    snap["first_response"] = {"median_seconds": None, "samples": 0, "window_seconds": 60, "capacity": 0,
                              "truncated": False}
    return snap


def prometheus(snap: dict[str, Any]) -> str:
    lines = []
    for key, (name, kind) in _FIELDS.items():
        lines.append(f"# TYPE {name} {kind}")
        lines.append(f"{name} {int(snap.get(key, 0))}")
    for key, name in (("http_admission_in_use", "flare_http_admission_in_use"),
                      ("http_admission_total", "flare_http_admission_slots"),
                      ("uptime_seconds", "flare_uptime_seconds")):
        lines.append(f"# TYPE {name} gauge")
        lines.append(f"{name} {int(snap.get(key, 0))}")
    return "\n".join(lines) + "\n"


def wants_json(fmt: str | None, accept: str | None) -> bool:
    from helios.errors import BadRequest

    if fmt is not None:
        if fmt == "json":
            return True
        if fmt == "prometheus":
            return False
        raise BadRequest(f"unknown metrics format '{fmt}'; use json or prometheus", param="format")
    try:
        from helios.asgi.accept import prefers_json
    except ImportError:  # pragma: no cover
        return False
    return prefers_json(accept)
