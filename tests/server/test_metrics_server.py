"""/metrics on real hypercorn servers with the default model: real token counts and decode weight
bytes, and admission failures (429, the full model queue's 503) counted as failed requests."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import EXTERNAL, LiveServer, provoke_admission_failures

pytestmark = pytest.mark.slow


def snapshot(server: LiveServer) -> dict[str, Any]:
    return dict(httpx.get(server.url + "/metrics", params={"format": "json"}, timeout=30).json())


def samples(server: LiveServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_default_model_metrics(server: LiveServer) -> None:
    before = snapshot(server)
    client = server.openai()
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Name a colour."}],
                                       max_tokens=8, temperature=0)
    c = client.completions.create(model="m", prompt="Once upon a time", max_tokens=5, temperature=0)
    after = snapshot(server)
    assert r.usage is not None and c.usage is not None
    assert after["generated_tokens"] - before["generated_tokens"] == r.usage.completion_tokens + c.usage.completion_tokens
    # Prefill excludes prefix reuse (spec): what a request's cached_tokens covered was not prefilled.
    reused = sum(u.prompt_tokens_details.cached_tokens for u in (r.usage, c.usage) if u.prompt_tokens_details)
    assert after["prefill_tokens"] - before["prefill_tokens"] == r.usage.prompt_tokens + c.usage.prompt_tokens - reused
    assert after["reused_tokens"] - before["reused_tokens"] == reused
    assert after["completed"] - before["completed"] == 2 and after["failed"] == before["failed"]
    if not EXTERNAL:  # SmolLM2-135M in float32, embeddings tied: ~106M layer parameters plus the 49152 x 576 head
        assert 400e6 < after["decode_weight_bytes"] < 700e6
    s = samples(server)
    assert s[("flare_decode_weight_bytes", ())] == after["decode_weight_bytes"]
    assert s[("helios_time_to_first_token_seconds_count", ())] >= 2
    assert after["first_response"]["samples"] >= 2 and after["first_response"]["median_seconds"] > 0


def test_admission_failures_are_counted(limited: LiveServer) -> None:
    before = samples(limited)
    provoke_admission_failures(limited)
    after = samples(limited)
    stage = ("helios_requests_failed_by_stage_total", (("stage", "admission"),))
    assert after[stage] - before[stage] == 2
    assert after[("flare_requests_failed_total", ())] - before[("flare_requests_failed_total", ())] == 2
    assert after[("flare_requests_completed_total", ())] == before[("flare_requests_completed_total", ())]
