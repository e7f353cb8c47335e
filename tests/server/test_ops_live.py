"""Operations tools against a live Helios (a real hypercorn process, the default model, the prefix
cache on, n-gram speculation on, a serving key):

- a real Prometheus (Debian's `prometheus`) scrapes /metrics every second: every `flare_` family of
  the spec for the features that run is there with its type, a PromQL rate over generated tokens is
  non-zero after a request, and every query of docs/grafana-helios.json evaluates;
- the chat page (GET /ui) in headless Chromium (Debian's `chromium`, driven over the DevTools
  protocol): a key, two streamed turns with tokens/s and cached tokens, a stopped stream,
  conversations to switch between, kept across a reload.

Each part skips when its binary is absent (`.ci/run` installs both where it can)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import EXTERNAL, LiveServer, _free_port, start_server, stop_server

pytestmark = pytest.mark.slow

PROMETHEUS = shutil.which("prometheus")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
WEBSOCKETS = importlib.util.find_spec("websockets") is not None
DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-helios.json"
KEY = "ops-secret"

OPS_TOML = f"""
[server]
api_key = "{KEY}"
aliases = ["smol"]
[model]
path = "@MODEL@"
dtype = "float32"
max_model_len = 2048
[engine]
max_active = 4
kv_memory_gib = 0.25
prefill_chunk_size = 256
[speculative]
mode = "ngram"
"""

# The spec's families for what this server runs (docs/operations.md, "Families exported"): the core
# counters and gauges, the prefix cache, the host store, speculation. name -> Prometheus type.
SPEC_FAMILIES = {
    **dict.fromkeys(["flare_prefill_tokens_total", "flare_generated_tokens_total", "flare_requests_completed_total",
                     "flare_requests_failed_total", "flare_reasoning_budget_cuts_total",
                     "flare_cache_reused_tokens_total", "flare_host_cache_hits_total",
                     "flare_host_cache_reused_tokens_total", "flare_host_cache_bytes_out_total",
                     "flare_host_cache_bytes_in_total", "flare_verification_draft_tokens_total",
                     "flare_verification_request_rounds_total", "flare_accepted_draft_tokens_total",
                     "flare_draft_request_rounds_total", "flare_verification_request_rounds_by_depth_total",
                     "flare_accepted_draft_tokens_by_depth_total"], "counter"),
    **dict.fromkeys(["flare_decode_weight_bytes", "flare_active_requests", "flare_pending_requests",
                     "flare_free_kv_pages", "flare_total_kv_pages", "flare_kv_page_tokens",
                     "flare_http_admission_in_use", "flare_http_admission_slots", "flare_uptime_seconds",
                     "flare_cached_kv_pages", "flare_host_cache_memory_records", "flare_host_cache_disk_records",
                     "flare_host_cache_parked_records", "flare_history_drafts_enabled"], "gauge"),
    **dict.fromkeys(["flare_host_cache_missing_tokens", "flare_host_cache_estimated_transfer_ns",
                     "flare_host_cache_estimated_prefill_ns"], "histogram"),
}


@pytest.fixture(scope="module")
def ops_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    if EXTERNAL:
        pytest.skip("needs a specially configured local server")
    s = start_server(tmp_path_factory.mktemp("ops"), OPS_TOML, "ops")
    yield s
    stop_server(s)


def chat(server: LiveServer, messages: list[dict[str, str]], max_tokens: int = 24) -> dict[str, Any]:
    with server.http() as h:
        r = h.post("/v1/chat/completions", json={"model": "smol", "messages": messages, "max_tokens": max_tokens,
                                                 "temperature": 0})
    assert r.status_code == 200, r.text
    return dict(r.json())


def wait_until(check: Callable[[], Any], timeout: float, what: str, every: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


# -- Prometheus ----------------------------------------------------------------------------------


class Prometheus:
    """Debian's prometheus on a loopback port, scraping one target every second, with its own TSDB."""

    def __init__(self, target: str, workdir: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: helios\n    metrics_path: /metrics\n"
            f"    static_configs:\n      - targets: ['{target}']\n")
        self.log = workdir / "prometheus.log"
        assert PROMETHEUS is not None
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT)

    def api(self, path: str, **params: str) -> Any:
        r = httpx.get(self.url + "/api/v1/" + path, params=params, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (path, params, r.text[:2000])
        return body["data"]

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited:\n{self.log.read_text()[-3000:]}")
        try:
            return httpx.get(self.url + "/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def target_up(self) -> bool:
        targets = self.api("targets")["activeTargets"]
        return bool(targets) and all(t["health"] == "up" for t in targets)

    def value(self, query: str) -> float | None:
        result = self.api("query", query=query)["result"]
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", ())]


@pytest.mark.skipif(PROMETHEUS is None, reason="needs Debian's prometheus binary (apt-get install prometheus)")
def test_prometheus_scrapes_every_family_and_rates_generated_tokens(ops_server: LiveServer, tmp_path: Path) -> None:
    target = ops_server.url.removeprefix("http://")
    prom = Prometheus(target, tmp_path)
    try:
        wait_until(prom.ready, 60, "prometheus to be ready")
        wait_until(prom.target_up, 30, "the Helios target to be up")
        wait_until(lambda: prom.value("flare_generated_tokens_total") is not None, 15, "a first scrape")
        # A conversation whose second turn repeats the first (prefix-cache hits) and text the model
        # copies (n-gram drafts from the prompt).
        text = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"
        first = [{"role": "user", "content": f"Repeat exactly: {text}"}]
        r1 = chat(ops_server, first)
        second = [*first, {"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
                  {"role": "user", "content": f"Again, repeat exactly: {text}"}]
        r2 = chat(ops_server, second)
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        generated = r1["usage"]["completion_tokens"] + r2["usage"]["completion_tokens"]

        # PromQL over the scraped counter: a non-zero rate, and the increase the requests made.
        rate = wait_until(lambda: (prom.value("sum(rate(flare_generated_tokens_total[10s]))") or 0) > 0 and
                          prom.value("sum(rate(flare_generated_tokens_total[10s]))"), 20, "a non-zero rate")
        assert rate > 0
        total = wait_until(lambda: (prom.value("max(flare_generated_tokens_total)") or 0) >= generated and
                           prom.value("max(flare_generated_tokens_total)"), 10, "the counter to include the requests")
        assert total >= generated
        assert (prom.value("max(flare_cache_reused_tokens_total)") or 0) > 0
        assert (prom.value("max(flare_verification_request_rounds_total)") or 0) > 0

        # Every family: in Helios's exposition, in Prometheus's metadata with the same type, with series.
        with httpx.Client(timeout=30) as h:
            exposition = {f.name: f for f in text_string_to_metric_families(h.get(ops_server.url + "/metrics").text)}
        exposed = {(f.name + "_total" if f.type == "counter" else f.name): f.type
                   for f in exposition.values() if f.samples}
        missing = sorted(set(SPEC_FAMILIES) - set(exposed))
        assert not missing, f"the server does not export {missing}"
        assert all(exposed[n] == t for n, t in SPEC_FAMILIES.items())
        metadata = prom.api("metadata")
        names = {row["__name__"] for row in prom.api(
            "query", query='group by (__name__) ({__name__=~"flare_.+|helios_.+"})')["result"]
            for row in [row["metric"]]}
        for name, kind in exposed.items():
            assert name in metadata, f"prometheus has no metadata for {name}"
            assert {m["type"] for m in metadata[name]} == {kind}, (name, metadata[name])
            samples = {name} if kind != "histogram" else {name + "_bucket", name + "_sum", name + "_count"}
            assert samples <= names, (name, samples - names)

        # The Grafana dashboard's queries: each evaluates; throughput, TTFT, queue, KV, cache and
        # speculation panels have data.
        has_data = set()
        for title, expr in dashboard_queries():
            query = expr.replace("$__rate_interval", "1m").replace('instance=~"$instance"', 'instance=~".*"')
            if prom.api("query", query=query)["result"]:
                has_data.add(title)
        for title in ("Tokens per second", "Time to first token", "Queue", "KV pages",
                      "Prefix-cache hit share of prompt tokens", "Draft depth"):
            assert title in has_data, (title, sorted(has_data))
    finally:
        prom.stop()


# -- the chat page in headless Chromium ------------------------------------------------------------


class Browser:
    """Headless Chromium with one page, driven over the DevTools protocol (websockets)."""

    def __init__(self, workdir: Path) -> None:
        from websockets.sync.client import connect

        assert CHROMIUM is not None
        port = _free_port()
        self.log = workdir / "chromium.log"
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-dev-shm-usage", f"--user-data-dir={workdir / 'profile'}",
             f"--remote-debugging-port={port}", "--remote-debugging-address=127.0.0.1", "about:blank"],
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)

        def page_target() -> str | None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited:\n{self.log.read_text()[-3000:]}")
            try:
                targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=2).json()
            except (httpx.HTTPError, ValueError):
                return None
            pages = [t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page"]
            return pages[0] if pages else None

        url = wait_until(page_target, 60, "chromium's DevTools endpoint")
        self.ws = connect(url, max_size=None, open_timeout=30)
        self._ids = itertools.count(1)
        self.call("Page.enable")
        self.call("Runtime.enable")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        ident = next(self._ids)
        self.ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == ident:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))

    def js(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        time.sleep(0.2)
        wait_until(lambda: self.js("document.readyState === 'complete' && document.body.dataset.ready === '1'"),
                   30, f"{url} to load")

    def close(self) -> None:
        """Stops Chromium and every helper process it started (they share its process group): a helper
        left running still writes into the profile while the test's temporary folder is removed."""
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(15)


def send(page: Browser, text: str) -> dict[str, Any]:
    """Types `text`, sends it, waits for the answer to finish; the last message's state, text and stats."""
    before = page.js("document.querySelectorAll('#messages .message').length")
    page.js(f"document.getElementById('prompt').value = {json.dumps(text)}; document.getElementById('send').click()")
    last = "document.querySelector('#messages .message:last-child')"
    wait_until(lambda: page.js(f"document.querySelectorAll('#messages .message').length === {before + 2} && "
                               f"{last}.dataset.state !== 'streaming'"), 120, "the answer")
    return dict(page.js(f"(() => {{ const m = {last}; return {{state: m.dataset.state, "
                        f"content: m.querySelector('.content').textContent, "
                        f"statsText: m.querySelector('.stats').textContent, "
                        f"stats: Object.assign({{}}, m.querySelector('.stats').dataset)}}; }})()"))


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium)")
@pytest.mark.skipif(not WEBSOCKETS, reason="needs the websockets package (the test extras)")
def test_chat_page_streams_answers_and_keeps_conversations(ops_server: LiveServer) -> None:
    r = httpx.get(ops_server.url + "/ui", timeout=10)  # public, like / and /health
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in r.headers["content-security-policy"]
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as workdir:
        page = Browser(Path(workdir))
        try:
            page.goto(ops_server.url + "/ui")
            # Without the key the server refuses the page's request, and the page says so.
            refused = send(page, "Hello")
            assert refused["state"] == "error" and "401" in refused["content"], refused
            page.js("document.querySelector('#conversations li.active .delete').click()")
            assert page.js("document.querySelectorAll('#conversations li').length") == 0
            page.js(f"const k = document.getElementById('api-key'); k.value = {json.dumps(KEY)}; "
                    "k.dispatchEvent(new Event('change'))")
            page.js("document.getElementById('max-tokens').value = '32'; "
                    "const t = document.getElementById('temperature'); t.value = '0'; t.dispatchEvent(new Event('change'))")

            first = send(page, "What is the capital of France?")
            assert first["state"] == "done" and "Paris" in first["content"], first
            stats = first["stats"]
            assert int(stats["completionTokens"]) > 0 and float(stats["tokensPerSecond"]) > 0, stats
            assert int(stats["chunks"]) > 2, stats  # streamed: role, text chunks, the usage chunk
            assert "tok/s" in first["statsText"] and "cached" in first["statsText"]
            # The second turn's prompt begins with the first's: the prefix cache covers part of it.
            second = send(page, "And what is the capital of Germany?")
            assert second["state"] == "done" and second["content"].strip(), second
            assert int(second["stats"]["cachedTokens"]) > 0, second["stats"]
            assert int(second["stats"]["promptTokens"]) > int(second["stats"]["cachedTokens"])
            assert f"{second['stats']['cachedTokens']} cached" in second["statsText"]

            # A second conversation, then back to the first: the sidebar switches between them.
            page.js("document.getElementById('new-chat').click()")
            assert page.js("document.querySelectorAll('#conversations li').length") == 2
            assert page.js("document.querySelectorAll('#messages .message').length") == 0
            other = send(page, "Say hello.")
            assert other["state"] == "done"
            # Stop: the stream in flight is aborted, what arrived stays.
            page.js("document.getElementById('max-tokens').value = '400'; "
                    "document.getElementById('prompt').value = 'Tell me a long story about a dragon.'; "
                    "document.getElementById('send').click()")
            last = "document.querySelector('#messages .message:last-child')"
            wait_until(lambda: page.js(f"{last}.dataset.state === 'streaming' && "
                                       f"{last}.querySelector('.content').textContent.length > 0"), 60, "streamed text")
            page.js("document.getElementById('stop').click()")
            wait_until(lambda: page.js(f"{last}.dataset.state === 'stopped'"), 30, "the stop")
            assert page.js(f"{last}.querySelector('.content').textContent.length") > 0
            assert page.js("document.getElementById('send').disabled") is False
            page.js("document.querySelectorAll('#conversations li .pick')[1].click()")
            assert page.js("document.querySelectorAll('#messages .message').length") == 4
            assert page.js("document.querySelector('#conversations li.active .pick').textContent") == \
                "What is the capital of France?"

            # Kept in the browser: a reload shows the same conversations, the key stays for the tab.
            page.call("Page.reload")
            time.sleep(0.2)
            wait_until(lambda: page.js("document.readyState === 'complete' && document.body.dataset.ready === '1'"),
                       30, "the reload")
            assert page.js("document.querySelectorAll('#conversations li').length") == 2
            assert page.js("document.querySelectorAll('#messages .message').length") == 4
            assert page.js("document.getElementById('api-key').value") == KEY
            assert page.js("document.querySelector('#messages .message:last-child .stats').dataset.cachedTokens") == \
                second["stats"]["cachedTokens"]
        finally:
            page.close()
