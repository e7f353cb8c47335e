"""The access log of a live server: the shared hypercorn process (its output goes to `server.log`)
logs one line per request, with the response's token usage; `helios serve --no-access-log` logs none."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import EXTERNAL, LiveServer, _free_port, stop_server

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "Say hi."}]
LINE = re.compile(
    r'^(?P<client>\S+) "(?P<method>[A-Z]+) (?P<target>\S+)" (?P<status>\d{3}|-) id=(?P<id>\S+) '
    r"prompt=(?P<prompt>\d+|-) output=(?P<output>\d+|-) ttft=(?P<ttft>[\d.]+s|-) total=(?P<total>[\d.]+s)"
    r"(?: error=(?P<error>\S+))?(?: disconnected=true)?$"
)


@pytest.fixture(scope="module")
def logged(server: LiveServer) -> LiveServer:
    if server.log is None:
        pytest.skip("needs the local server's log")
    return server


def access_line(server: LiveServer, request_id: str, timeout: float = 10.0) -> re.Match[str]:
    """The access line of one request (found by its x-request-id), once the server has written it."""
    assert server.log is not None
    deadline = time.time() + timeout
    while True:
        for line in server.log.read_text(errors="replace").splitlines():
            _, sep, message = line.partition(" INFO helios.access: ")
            if sep and f" id={request_id} " in message:
                m = LINE.match(message)
                assert m, message
                return m
        if time.time() > deadline:
            raise AssertionError(f"no access line for {request_id}")
        time.sleep(0.1)


def test_chat_logs_status_usage_and_ttft(logged: LiveServer) -> None:
    with logged.http() as http:
        r = http.post("/v1/chat/completions", json={"model": "smol", "messages": HI, "max_tokens": 8, "n": 2})
    assert r.status_code == 200
    usage = r.json()["usage"]
    m = access_line(logged, r.headers["x-request-id"])
    assert (m["method"], m["target"], m["status"]) == ("POST", "/v1/chat/completions", "200")
    assert m["client"].startswith("127.0.0.1:")
    assert int(m["prompt"]) == usage["prompt_tokens"] > 0
    assert int(m["output"]) == usage["completion_tokens"] > 0
    assert m["ttft"] != "-" and float(m["ttft"][:-1]) <= float(m["total"][:-1])
    assert m["error"] is None


def test_streamed_chat_logs_the_streamed_usage(logged: LiveServer) -> None:
    body = {"model": "smol", "messages": HI, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
    with logged.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        rid = r.headers["x-request-id"]
    usage = events[-1]["usage"]
    m = access_line(logged, rid)
    assert m["status"] == "200"
    assert (int(m["prompt"]), int(m["output"])) == (usage["prompt_tokens"], usage["completion_tokens"])


def test_stream_ending_in_an_error_event_logs_its_type(logged: LiveServer) -> None:
    body = {"model": "smol", "messages": HI, "max_tokens": 4, "stream": True, "temperature": 0,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "tool_choice": "required"}
    with logged.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        text = r.read().decode()
        rid = r.headers["x-request-id"]
    m = access_line(logged, rid)
    if '"error"' not in text:
        pytest.skip("the model completed a tool call within 4 tokens")
    assert (m["status"], m["error"]) == ("200", "server_error")


def test_validation_error_logs_400(logged: LiveServer) -> None:
    with logged.http() as http:
        r = http.post("/v1/chat/completions", json={"model": "smol", "messages": HI, "bogus_field": 1})
    assert r.status_code == 400
    m = access_line(logged, r.headers["x-request-id"])
    assert (m["status"], m["prompt"], m["output"], m["ttft"]) == ("400", "-", "-", "-")


def test_models_logs_200_without_tokens(logged: LiveServer) -> None:
    with logged.http() as http:
        r = http.get("/v1/models", params={"limit": "5"})
    assert r.status_code == 200
    m = access_line(logged, r.headers["x-request-id"])
    assert (m["method"], m["target"], m["status"]) == ("GET", "/v1/models?limit=5", "200")
    assert (m["prompt"], m["output"], m["ttft"]) == ("-", "-", "-")


# -- helios serve --no-access-log -------------------------------------------------------------------


@pytest.fixture(scope="module")
def quiet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    if EXTERNAL:
        pytest.skip("needs a locally started server")
    from helios.loaders.default_model import ensure_default_model

    tmp = tmp_path_factory.mktemp("quiet")
    cfg = tmp / "quiet.toml"
    cfg.write_text("[engine]\nmax_active = 4\nkv_memory_gib = 0.25\nprefill_chunk_size = 256\n")
    log = tmp / "quiet.log"
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "helios.cli", "serve", str(ensure_default_model()), "--port", str(port),
         "--dtype", "float32", "--config", str(cfg), "--no-access-log"],
        env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )
    s = LiveServer(f"http://127.0.0.1:{port}", None, proc, log)
    deadline = time.time() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(s.url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            stop_server(s)
            raise RuntimeError(f"server did not become healthy:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)
    yield s
    stop_server(s)


def test_no_access_log_logs_no_request_lines(quiet: LiveServer) -> None:
    assert quiet.log is not None
    with quiet.http() as http:
        ok = http.post("/v1/chat/completions", json={"model": "smol", "messages": HI, "max_tokens": 4})
        bad = http.post("/v1/chat/completions", json={"model": "smol", "messages": HI, "bogus_field": 1})
        models = http.get("/v1/models")
    assert (ok.status_code, bad.status_code, models.status_code) == (200, 400, 200)
    time.sleep(1.0)
    text = quiet.log.read_text(errors="replace")
    assert "Helios serving on" in text
    assert "helios.access" not in text
    assert ok.headers["x-request-id"] not in text and "/v1/models" not in text
