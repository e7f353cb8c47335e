"""Graceful shutdown (issue 10, item 6) against real `helios serve` and hypercorn processes.

SIGTERM stops admission at once (new generation requests and /health get 503), lets in-flight
requests finish within `[server] shutdown_grace_seconds`, then aborts the rest (a started stream ends
with its protocol's terminal error event, a response not yet started gets 503), frees every KV page
and stops the engine; the process exits 0 and logs `shutdown: drained N, aborted M, free pages X/Y`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import EXTERNAL, _free_port, wait_healthy

pytestmark = pytest.mark.skipif(bool(EXTERNAL), reason="starts and stops its own servers")

TOML = """
[server]
aliases = ["smol"]
port = @PORT@
[model]
path = "@MODEL@"
dtype = "float32"
max_model_len = 512
[engine]
max_active = 4
kv_pages = 128
prefill_chunk_size = 256
"""

SHUTDOWN_LINE = re.compile(r"shutdown: drained (\d+), aborted (\d+), free pages (\d+)/(\d+)")


class Proc:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def sigterm(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"the server did not exit within {timeout} s:\n{self.text()[-3000:]}")

    def shutdown_line(self) -> tuple[int, int, int, int]:
        m = SHUTDOWN_LINE.search(self.text())
        assert m, f"no shutdown line in the log:\n{self.text()[-3000:]}"
        drained, aborted, free, total = (int(g) for g in m.groups())
        return drained, aborted, free, total


def start(tmp: Path, name: str, *, plain_hypercorn: bool = False, grace: float = 30,
          env_extra: dict[str, str] | None = None, module: str = "helios.cli") -> Proc:
    from helios.loaders.default_model import ensure_default_model

    port = _free_port()
    cfg = tmp / f"{name}.toml"
    cfg.write_text(TOML.replace("@MODEL@", str(ensure_default_model())).replace("@PORT@", str(port)))
    log = tmp / f"{name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    if plain_hypercorn:
        env["HELIOS_CONFIG"] = str(cfg)
        cmd = [sys.executable, "-m", "hypercorn", "helios.app:app", "--worker-class", "trio",
               "--bind", f"127.0.0.1:{port}", "--graceful-timeout", str(grace), "--keep-alive", "75"]
    else:
        cmd = [sys.executable, "-m", module, "serve", "--config", str(cfg), "--shutdown-grace", str(grace)]
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, log, timeout=180)
    return Proc(proc, url, log)


def chat_body(max_tokens: int, *, stream: bool) -> dict[str, Any]:
    return {"model": "smol", "messages": [{"role": "user", "content": "Count from one to one thousand."}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": stream}


class StreamReader(threading.Thread):
    """Reads one chat stream; `first` is set once a content chunk arrived (or the stream ended)."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.first = threading.Event()
        self.status = 0
        self.content = False
        self.events: list[Any] = []  # parsed data lines; "[DONE]" as a string
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.Client(timeout=60) as client, client.stream(
                "POST", self.url + "/v1/chat/completions", json=chat_body(self.max_tokens, stream=True)
            ) as resp:
                self.status = resp.status_code
                for line in resp.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    event = data if data == "[DONE]" else json.loads(data)
                    self.events.append(event)
                    if isinstance(event, dict) and any(c.get("delta", {}).get("content")
                                                       for c in event.get("choices", [])):
                        self.content = True
                        self.first.set()
        except BaseException as exc:
            self.failure = exc
        finally:
            self.first.set()

    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for e in self.events if isinstance(e, dict)
                for c in e.get("choices", []) if c.get("finish_reason")]


def wait_draining(url: str) -> None:
    """Until /health answers 503: the signal has been handled and admission is paused."""
    deadline = time.time() + 10
    while time.time() < deadline:
        if httpx.get(url + "/health", timeout=5).status_code == 503:
            return
        time.sleep(0.02)
    pytest.fail("/health never reported 503 after SIGTERM")


def test_sigterm_drains_in_flight_stream_and_refuses_new_requests(tmp_path: Path) -> None:
    srv = start(tmp_path, "drain")
    try:
        reader = StreamReader(srv.url, max_tokens=120)
        reader.start()
        assert reader.first.wait(60) and reader.content, (reader.status, reader.failure, reader.events)
        srv.sigterm()
        wait_draining(srv.url)
        health = httpx.get(srv.url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["error"]["type"] == "server_error"
        # New generation requests during the drain: 503 in each protocol's error shape.
        chat = httpx.post(srv.url + "/v1/chat/completions", json=chat_body(4, stream=False), timeout=10)
        assert chat.status_code == 503, chat.text
        assert chat.json()["error"]["type"] == "server_error"
        assert "shutting down" in chat.json()["error"]["message"]
        msg = httpx.post(srv.url + "/v1/messages", timeout=10, headers={"anthropic-version": "2023-06-01"},
                         json={"model": "smol", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert msg.status_code == 503, msg.text
        assert msg.json()["type"] == "error" and msg.json()["error"]["type"] == "api_error"
        assert reader.is_alive(), "the stream ended before the drain could be observed"
        # The stream in flight completes normally.
        reader.join(60)
        assert reader.failure is None, reader.failure
        assert reader.status == 200
        assert reader.finish_reasons() == ["length"]
        assert reader.events[-1] == "[DONE]"
        assert not any(isinstance(e, dict) and "error" in e for e in reader.events)
        assert srv.wait(30) == 0
        drained, aborted, free, total = srv.shutdown_line()
        assert (drained, aborted) == (1, 0)
        assert free == total > 0
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()


def test_grace_expiry_aborts_with_terminal_error_and_frees_every_page(tmp_path: Path) -> None:
    srv = start(tmp_path, "abort", grace=1)
    try:
        buffered: dict[str, Any] = {}

        def post_buffered() -> None:
            try:
                r = httpx.post(srv.url + "/v1/chat/completions", json=chat_body(400, stream=False), timeout=60)
                buffered.update(status=r.status_code, body=r.json())
            except BaseException as exc:
                buffered["failure"] = exc

        poster = threading.Thread(target=post_buffered, daemon=True)
        poster.start()
        reader = StreamReader(srv.url, max_tokens=400)
        reader.start()
        assert reader.first.wait(60) and reader.content, (reader.status, reader.failure, reader.events)
        time.sleep(0.3)  # the buffered request is generating too
        t0 = time.monotonic()
        srv.sigterm()
        reader.join(30)
        poster.join(30)
        assert srv.wait(30) == 0
        elapsed = time.monotonic() - t0
        # The stream got its tokens so far, then the protocol's terminal error event (no [DONE]).
        assert reader.failure is None, reader.failure
        assert reader.status == 200
        assert reader.first.is_set() and reader.finish_reasons() == []
        last = reader.events[-1]
        assert isinstance(last, dict) and last["error"]["type"] == "server_error", reader.events[-3:]
        assert "[DONE]" not in reader.events
        # The buffered request had not started its response: 503.
        assert "failure" not in buffered, buffered
        assert buffered["status"] == 503 and buffered["body"]["error"]["type"] == "server_error"
        drained, aborted, free, total = srv.shutdown_line()
        assert (drained, aborted) == (0, 2)
        assert free == total > 0
        assert elapsed < 15, f"shutdown took {elapsed:.1f} s with a 1 s grace"
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()


def test_plain_hypercorn_sigterm_finishes_stream_and_frees_pages(tmp_path: Path) -> None:
    """Under plain hypercorn, hypercorn handles SIGTERM (stop accepting, --graceful-timeout for open
    requests); the app's lifespan shutdown then checks the engine and logs the same line."""
    srv = start(tmp_path, "hyper", plain_hypercorn=True, grace=30)
    try:
        reader = StreamReader(srv.url, max_tokens=60)
        reader.start()
        assert reader.first.wait(60) and reader.content, (reader.status, reader.failure, reader.events)
        srv.sigterm()
        reader.join(60)
        assert reader.failure is None, reader.failure
        assert reader.finish_reasons() == ["length"] and reader.events[-1] == "[DONE]"
        assert srv.wait(30) == 0
        _, aborted, free, total = srv.shutdown_line()
        assert aborted == 0 and free == total > 0
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()


def test_engine_death_fails_requests_in_their_shapes_and_exits_nonzero(tmp_path: Path) -> None:
    """An exception escapes the engine loop mid-stream: the stream ends with its protocol's terminal
    error event (no [DONE]), /health is 503 at once, a new request is refused in its shape, and the
    process drains and exits with status 70 (EX_SOFTWARE) for a supervisor to restart it."""
    from helios.cli import ENGINE_DIED_STATUS

    flag = tmp_path / "die"
    srv = start(tmp_path, "death", module="tests.server.dying_server",
                env_extra={"HELIOS_TEST_DEATH_FLAG": str(flag), "PYTHONPATH": str(Path(__file__).parents[2])})
    try:
        reader = StreamReader(srv.url, max_tokens=400)
        reader.start()
        assert reader.first.wait(60) and reader.content, (reader.status, reader.failure, reader.events)
        flag.touch()
        reader.join(30)
        assert not reader.is_alive() and reader.failure is None, reader.failure
        assert reader.status == 200 and reader.events and reader.events[-1] != "[DONE]"
        error = reader.events[-1]
        assert isinstance(error, dict) and error["error"]["type"] == "server_error", error
        assert "engine thread died" in error["error"]["message"] and "InjectedDeath" in error["error"]["message"]
        try:
            health = httpx.get(srv.url + "/health", timeout=5)
            assert health.status_code == 503 and health.json()["error"]["type"] == "server_error"
            msg = httpx.post(srv.url + "/v1/messages", timeout=10, headers={"anthropic-version": "2023-06-01"},
                             json={"model": "smol", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
            assert msg.status_code == 503 and msg.json()["error"]["type"] == "api_error", msg.text
        except httpx.TransportError:
            pass  # the drain (nothing left in flight) already ended and the listener closed
        assert srv.wait(30) == ENGINE_DIED_STATUS
        text = srv.text()
        assert "engine thread died: InjectedDeath: injected by the test; draining, then exiting with status 70" in text
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()


def test_shutdown_grace_config() -> None:
    from helios.config import ConfigError, HeliosConfig, load_config

    assert HeliosConfig().server.shutdown_grace_seconds == 30
    assert load_config(None, {"server": {"shutdown_grace_seconds": 2}}).server.shutdown_grace_seconds == 2.0
    assert load_config(None, {"server": {"shutdown_grace_seconds": 0}}).server.shutdown_grace_seconds == 0.0
    for bad in (-1, float("nan"), float("inf"), True, "5"):
        with pytest.raises(ConfigError, match="shutdown_grace_seconds"):
            load_config(None, {"server": {"shutdown_grace_seconds": bad}})
