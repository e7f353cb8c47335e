"""Live servers for the SDK conformance tests: real hypercorn processes on real sockets.

FLARE_API_TEST_URL selects an external server instead of the one started here (FLARE_API_TEST_KEY
supplies its key); tests that need a specially configured server are skipped then.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

EXTERNAL = os.environ.get("FLARE_API_TEST_URL")


class LiveServer:
    def __init__(self, url: str, key: str | None, proc: subprocess.Popen[bytes] | None, log: Path | None) -> None:
        self.url = url.rstrip("/")
        self.key = key
        self.proc = proc
        self.log = log

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def openai(self, **kw):  # type: ignore[no-untyped-def]
        import openai

        return openai.OpenAI(base_url=self.v1, api_key=self.key or "unused", max_retries=0, **kw)

    def anthropic(self, **kw):  # type: ignore[no-untyped-def]
        import anthropic

        return anthropic.Anthropic(base_url=self.url, api_key=self.key or "unused", max_retries=0, **kw)

    def http(self) -> httpx.Client:
        headers = {"authorization": f"Bearer {self.key}"} if self.key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path, timeout: float = 300) -> None:
    """Until `GET /health` answers 200; RuntimeError with the log's tail if the process exits or times out."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not become healthy:\n{log.read_text()[-4000:]}")


def start_server(tmp: Path, toml: str, name: str) -> LiveServer:
    from helios.loaders.default_model import ensure_default_model

    model = ensure_default_model()
    port = _free_port()
    cfg = tmp / f"{name}.toml"
    cfg.write_text(toml.replace("@MODEL@", str(model)).replace("@PORT@", str(port)))
    log = tmp / f"{name}.log"
    env = dict(os.environ, HELIOS_CONFIG=str(cfg), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hypercorn", "helios.app:app", "--worker-class", "trio", "--bind", f"127.0.0.1:{port}",
         "--keep-alive", "75"],
        env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, log)
    key = None
    for line in toml.splitlines():
        if line.strip().startswith("api_key"):
            key = line.split("=", 1)[1].strip().strip('"') or None
    return LiveServer(url, key, proc, log)


def stop_server(s: LiveServer) -> None:
    if s.proc is not None:
        s.proc.terminate()
        try:
            s.proc.wait(20)
        except subprocess.TimeoutExpired:
            s.proc.kill()


MAIN_TOML = """
[server]
aliases = ["smol", "HuggingFaceTB/SmolLM2-135M-Instruct"]
[model]
path = "@MODEL@"
dtype = "float32"
[engine]
max_active = 16
kv_memory_gib = 0.5
prefill_chunk_size = 256
"""


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    if EXTERNAL:
        yield LiveServer(EXTERNAL, os.environ.get("FLARE_API_TEST_KEY"), None, None)
        return
    s = start_server(tmp_path_factory.mktemp("srv"), MAIN_TOML, "main")
    yield s
    stop_server(s)


LIMITED_TOML = """
[server]
api_key = "sekret"
max_concurrency = 3
model_queue_size = 1
max_body_bytes = 65536
# vLLM's rule: an output limit beyond the context is a 400 (test_client_compat reads it back).
max_tokens_overflow = "reject"
[model]
path = "@MODEL@"
dtype = "float32"
max_model_len = 512
[engine]
max_active = 1
kv_memory_gib = 0.25
"""


@pytest.fixture(scope="session")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    if EXTERNAL:
        pytest.skip("needs a specially configured local server")
    s = start_server(tmp_path_factory.mktemp("lim"), LIMITED_TOML, "limited")
    yield s
    stop_server(s)


def provoke_admission_failures(limited: LiveServer) -> None:
    """On the `limited` server (3 HTTP slots, a model queue of 1, one active sequence): hold two
    children in flight, then check that one more request gets 503 (model queue full) and a
    two-choice one 429 (HTTP slots exhausted); the held stream is closed afterwards."""
    import openai

    client = limited.openai()
    stream = client.completions.create(model="m", prompt="Story:", n=2, max_tokens=400,
                                       extra_body={"ignore_eos": True}, stream=True)
    it = iter(stream)
    next(it)  # both children are in flight: 2 of 3 HTTP slots and the whole model queue
    try:
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model="m", prompt="Hi", max_tokens=2)
        assert err.value.status_code == 503
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="m", prompt="Hi", n=2, max_tokens=2)
    finally:
        stream.close()  # a client that leaves is neither completed nor failed
    time.sleep(0.5)
