"""/metrics and /health on a live server (the scripted model): counters move by what the requests
did, the lifecycle histograms and the first-response window get samples, output failures count as
failed, the Prometheus text parses; /health turns 503 when the engine thread dies or is wedged
(fault injection into the model's forward)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helios.app import HeliosApp
from tests.serving.harness import FAMILIES, ScriptedServer, runtime_factory, serving_config
from tests.serving.protocols import Ask, chat_request, responses_request


def snapshot(server: ScriptedServer) -> dict[str, Any]:
    r = httpx.get(server.url + "/metrics", params={"format": "json"}, timeout=30)
    assert r.status_code == 200
    return dict(r.json())


def prometheus(server: ScriptedServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    r = httpx.get(server.url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(r.text) for s in f.samples}


def delta(after: dict[str, Any], before: dict[str, Any], key: str) -> int:
    return int(after[key]) - int(before[key])


def body(ask: Ask) -> dict[str, Any]:
    b = chat_request(ask)
    b.pop("extra_body", None)
    return b


def test_counters_histograms_and_first_response_move_with_requests(qwen3: ScriptedServer) -> None:
    s0, p0 = snapshot(qwen3), prometheus(qwen3)
    usage: list[dict[str, int]] = []
    with qwen3.http() as h:
        # Buffered: reasoning, then an answer.
        key = qwen3.book.add("<think>\nThe user greets me.\n</think>\n\nHello there, friend.")
        r = h.post("/v1/chat/completions", json=body(Ask(f"Hi {key}", tools=())))
        assert r.status_code == 200, r.text
        usage.append(r.json()["usage"])
        # Streamed, with usage in the last chunk.
        key = qwen3.book.add("<think>\nCounting.\n</think>\n\nOne two three four five.")
        with h.stream("POST", "/v1/chat/completions",
                      json={**body(Ask(f"Count {key}", tools=())), "stream": True,
                            "stream_options": {"include_usage": True}}) as sr:
            assert sr.status_code == 200
            chunks = [json.loads(line[6:]) for line in sr.iter_lines() if line.startswith("data: {")]
        usage.append(next(c["usage"] for c in chunks if c.get("usage")))
    s1, p1 = snapshot(qwen3), prometheus(qwen3)

    assert delta(s1, s0, "generated_tokens") == sum(u["completion_tokens"] for u in usage)
    assert delta(s1, s0, "prefill_tokens") == sum(u["prompt_tokens"] for u in usage)
    assert delta(s1, s0, "completed") == 2 and delta(s1, s0, "failed") == 0
    assert s1["active"] == 0 and s1["pending"] == 0 and s1["free_pages"] == s1["total_pages"] == 2048
    assert s1["page_tokens"] == 16 and s1["http_admission_total"] == 32 and s1["http_admission_in_use"] == 0
    fr0, fr1 = s0["first_response"], s1["first_response"]
    assert fr1["samples"] - fr0["samples"] == 2  # both within the 60 s window
    assert fr1["window_seconds"] == 60 and fr1["capacity"] > 0 and fr1["truncated"] is False
    assert isinstance(fr1["median_seconds"], float) and 0 < fr1["median_seconds"] < 30

    def grew(name: str) -> float:
        return p1.get((name, ()), 0.0) - p0.get((name, ()), 0.0)

    assert grew("flare_generated_tokens_total") == sum(u["completion_tokens"] for u in usage)
    assert grew("flare_requests_completed_total") == 2
    assert grew("helios_time_to_first_token_seconds_count") == 2
    assert grew("helios_e2e_request_latency_seconds_count") == 2
    # Every generated token after a child's first is one inter-token gap.
    assert grew("helios_inter_token_latency_seconds_count") == sum(u["completion_tokens"] - 1 for u in usage)
    assert grew("helios_time_to_first_token_seconds_sum") > 0
    assert p1[("flare_decode_weight_bytes", ())] == 0  # the scripted model has no weights
    assert not any("draft" in name or "host_cache" in name or "replay" in name for name, _ in p1)


def test_output_failures_count_once_each(qwen3: ScriptedServer) -> None:
    """tool_choice "required" without a call: a buffered 500 and a streamed terminal error event."""
    s0, p0 = snapshot(qwen3), prometheus(qwen3)
    key = qwen3.book.add("<think>\nNo tools today.\n</think>\n\nIt is sunny.")
    ask = Ask(f"Weather? {key}", choice="required")
    with qwen3.http() as h:
        r = h.post("/v1/chat/completions", json=body(ask))
        assert r.status_code == 500
        rb = responses_request(ask)
        rb.pop("extra_body", None)
        with h.stream("POST", "/v1/responses", json={**rb, "stream": True}) as sr:
            assert sr.status_code == 200
            events = [line[7:] for line in sr.iter_lines() if line.startswith("event: ")]
        assert events[-1] == "response.failed"
        # A client error after validation is neither completed nor failed.
        too_long = {**body(Ask("x")), "messages": [{"role": "user", "content": "pad " * 5000}]}  # over the context
        assert h.post("/v1/chat/completions", json=too_long).status_code == 400
    s1, p1 = snapshot(qwen3), prometheus(qwen3)
    assert delta(s1, s0, "failed") == 2 and delta(s1, s0, "completed") == 0
    stage = ("helios_requests_failed_by_stage_total", (("stage", "output"),))
    assert p1[stage] - p0[stage] == 2
    assert p1[("flare_requests_failed_total", ())] - p0[("flare_requests_failed_total", ())] == 2


# -- /health under injected engine faults ---------------------------------------------------------------


class Boom(BaseException):
    """Raised by the model's forward: not an Exception, so it kills the engine thread."""


@pytest.fixture
def faulty() -> Iterator[Callable[[Callable[[], None], float], ScriptedServer]]:
    started: list[ScriptedServer] = []

    def start(fault: Callable[[], None], stall_seconds: float) -> ScriptedServer:
        server = ScriptedServer(FAMILIES["qwen3"])
        build = runtime_factory(server.family, server.book)

        def faulty_build(cfg: Any) -> Any:
            rt = build(cfg)
            model = rt.core.model
            forward = model.forward

            def injected(*args: Any, **kwargs: Any) -> Any:
                fault()
                return forward(*args, **kwargs)

            model.forward = injected
            return rt

        cfg = serving_config()
        cfg = attrs.evolve(cfg, server=attrs.evolve(cfg.server, health_stall_seconds=stall_seconds))
        server.app = HeliosApp(cfg, runtime_factory=faulty_build)
        started.append(server.start())
        return server

    yield start
    for server in started:
        server.stop()


def wait_for(predicate: Callable[[], bool], seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_health_503_when_the_engine_thread_dies(faulty: Callable[..., ScriptedServer]) -> None:
    def die() -> None:
        raise Boom("injected engine fault")

    server = faulty(die, 60.0)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    before = snapshot(server)
    with server.http() as h:
        r = h.post("/v1/chat/completions", json=body(Ask("Hello", tools=())))
        assert r.status_code == 500  # the in-flight request fails instead of hanging
        health = h.get("/health")
        assert health.status_code == 503
        error = health.json()["error"]
        assert error["type"] and "engine thread" in error["message"] and "Boom" in error["message"]
        # New requests are refused at admission (the engine is down): 503, counted as admission.
        assert h.post("/v1/chat/completions", json=body(Ask("Again", tools=()))).status_code == 503
    after = snapshot(server)
    assert delta(after, before, "failed") == 2 and delta(after, before, "completed") == 0
    p = prometheus(server)
    assert p[("helios_requests_failed_by_stage_total", (("stage", "execution"),))] == 1
    assert p[("helios_requests_failed_by_stage_total", (("stage", "admission"),))] == 1


def test_health_503_while_the_engine_is_wedged(faulty: Callable[..., ScriptedServer]) -> None:
    release = threading.Event()
    server = faulty(lambda: release.wait(60), 0.5)
    wait_for(lambda: httpx.get(server.url + "/health").status_code == 200)
    result: dict[str, Any] = {}

    def ask() -> None:
        with server.http() as h:
            result["response"] = h.post("/v1/chat/completions", json=body(Ask("Hello", tools=())))

    client = threading.Thread(target=ask)
    client.start()
    try:
        wait_for(lambda: httpx.get(server.url + "/health").status_code == 503)
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "wedged" in health.json()["error"]["message"]
    finally:
        release.set()
    client.join(30)
    assert result["response"].status_code == 200
    wait_for(lambda: httpx.get(server.url + "/health").status_code == 200)
