"""Data parallelism (issue 30, items 3 and 4) against a real server: two engine processes behind one
hypercorn front end, the default model, one intra-op thread per rank.

- a conversation's second turn goes to the rank that served its first and reports cached tokens
  through the OpenAI SDK; another conversation goes to the other rank;
- greedy output through two ranks equals one engine's;
- `GET /v1/kv_events` streams vLLM-shaped KVEventBatch JSON: stored pages, and removals on eviction;
- a rank killed with SIGKILL mid-stream: the stream ends with its protocol's error event, a buffered
  request on that rank gets a protocol-shaped 500, /health is 503, the other rank keeps serving, and
  the killed rank comes back (restart) with /health 200 again. Nothing waits without a timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helios.engine.kv.events import BlockRemoved, BlockStored, event_from_json
from tests.server.conftest import EXTERNAL, LiveServer, _free_port, stop_server, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(EXTERNAL), reason="starts its own servers")]

COMMON = """
[server]
aliases = ["smol"]
[model]
path = "@MODEL@"
dtype = "float32"
threads = 1
max_model_len = 1024
[engine]
max_active = 8
kv_pages = 96
prefill_chunk_size = 256
"""

# No load term: the kill test puts two requests with one prompt on one rank by their cached prefix.
DP_TOML = COMMON + """
[parallel]
data_parallel_size = 2
kv_events = true
load_weight_tokens = 0
"""


def start_serve(tmp: Path, toml: str, name: str) -> LiveServer:
    """`helios serve --config` (plain hypercorn's worker processes are daemonic and may not start
    rank processes; docs/parallel.md)."""
    from helios.loaders.default_model import ensure_default_model

    port = _free_port()
    cfg = tmp / f"{name}.toml"
    cfg.write_text(toml.replace("@MODEL@", str(ensure_default_model())).replace("[server]", f"[server]\nport = {port}"))
    log = tmp / f"{name}.log"
    proc = subprocess.Popen([sys.executable, "-m", "helios.cli", "serve", "--config", str(cfg)],
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, log, timeout=240)
    return LiveServer(url, None, proc, log)


@pytest.fixture(scope="module")
def dp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    s = start_serve(tmp_path_factory.mktemp("dp"), DP_TOML, "dp")
    yield s
    stop_server(s)


# One engine: rank 1 of an externally routed deployment (its KV events name it).
EXTERNAL_TOML = COMMON + """
[parallel]
data_parallel_mode = "external"
data_parallel_size = 2
data_parallel_rank = 1
kv_events = true
"""


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    s = start_serve(tmp_path_factory.mktemp("one"), EXTERNAL_TOML, "one")
    yield s
    stop_server(s)


def ranks(server: LiveServer) -> list[dict[str, Any]]:
    snap = httpx.get(server.url + "/metrics?format=json", timeout=10).json()
    return list(snap["data_parallel"])


def routed_to(server: LiveServer, before: list[dict[str, Any]]) -> int:
    """The one rank whose routed count grew since ``before``."""
    after = ranks(server)
    grown = [a["rank"] for a, b in zip(after, before, strict=True) if a["routed"] > b["routed"]]
    assert len(grown) == 1, (before, after)
    return grown[0]


def system(topic: str) -> str:
    return (f"You are the assistant of a {topic}. Answer briefly and precisely, in one sentence, and never "
            f"invent facts about the {topic}. ") * 4


@pytest.mark.timeout(300)
def test_later_turn_lands_on_the_rank_holding_its_prefix_and_conversations_spread(dp: LiveServer) -> None:
    client = dp.openai()
    first = [{"role": "system", "content": system("bakery")}, {"role": "user", "content": "Which bread toasts best?"}]
    before = ranks(dp)
    a1 = client.chat.completions.create(model="smol", messages=first, max_tokens=8, temperature=0)
    rank_a = routed_to(dp, before)
    assert a1.usage is not None and a1.usage.prompt_tokens > 64  # more than four pages of 16

    second = [*first, {"role": "assistant", "content": a1.choices[0].message.content or ""},
              {"role": "user", "content": "And which one for sandwiches?"}]
    before = ranks(dp)
    a2 = client.chat.completions.create(model="smol", messages=second, max_tokens=8, temperature=0)
    assert routed_to(dp, before) == rank_a
    assert a2.usage is not None and a2.usage.prompt_tokens_details is not None
    assert a2.usage.prompt_tokens_details.cached_tokens is not None
    assert a2.usage.prompt_tokens_details.cached_tokens > 0
    after = ranks(dp)
    assert after[rank_a]["routed_hit_tokens"] > before[rank_a]["routed_hit_tokens"]

    other = [{"role": "system", "content": system("bicycle repair shop")},
             {"role": "user", "content": "How often should I oil a chain?"}]
    before = ranks(dp)
    client.chat.completions.create(model="smol", messages=other, max_tokens=8, temperature=0)
    assert routed_to(dp, before) != rank_a


@pytest.mark.timeout(300)
def test_greedy_output_through_two_ranks_equals_one_engine(dp: LiveServer, single: LiveServer) -> None:
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    for prompt in prompts:
        texts = [s.openai().completions.create(model="smol", prompt=prompt, max_tokens=24, temperature=0,
                                               extra_body={"ignore_eos": True}).choices[0].text
                 for s in (single, dp, dp)]
        assert texts[0] == texts[1] == texts[2], (prompt, texts)


class EventReader(threading.Thread):
    """Reads GET /v1/kv_events into `batches` (parsed JSON) until stopped."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.batches: list[dict[str, Any]] = []
        self.connected = threading.Event()
        self.stop = threading.Event()
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.Client(timeout=httpx.Timeout(60, read=30)) as client, \
                    client.stream("GET", self.url + "/v1/kv_events") as resp:
                assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
                self.connected.set()
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        self.batches.append(json.loads(line[len("data: "):]))
                    if self.stop.is_set():
                        return
        except BaseException as exc:
            self.failure = exc
        finally:
            self.connected.set()

    def events(self) -> list[tuple[int, Any]]:
        return [(b["data_parallel_rank"], event_from_json(e)) for b in list(self.batches) for e in b["events"]]


@pytest.mark.timeout(300)
def test_kv_events_stream_stored_and_removed_pages(dp: LiveServer) -> None:
    reader = EventReader(dp.url)
    reader.start()
    assert reader.connected.wait(30) and reader.failure is None
    time.sleep(0.5)  # the subscription is registered once the response started
    client = dp.openai()
    prompt = "Here is a list of fruits: " + ", ".join(f"fruit number {i}" for i in range(60))
    out = client.completions.create(model="smol", prompt=prompt, max_tokens=4, temperature=0)
    assert out.usage is not None
    deadline = time.time() + 20
    while time.time() < deadline and not any(isinstance(e, BlockStored) for _r, e in reader.events()):
        time.sleep(0.1)
    stored = [(r, e) for r, e in reader.events() if isinstance(e, BlockStored)]
    assert stored, reader.batches
    for b in reader.batches:
        assert set(b) == {"ts", "events", "data_parallel_rank"} and b["data_parallel_rank"] in (0, 1)
        for e in b["events"]:
            if e["type"] == "BlockStored":
                assert set(e) == {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                                  "lora_id", "medium", "lora_name"}
                assert len(e["token_ids"]) == len(e["block_hashes"]) * e["block_size"] == len(e["block_hashes"]) * 16
    pages = sum(len(e.block_hashes) for _r, e in stored)
    assert pages >= out.usage.prompt_tokens // 16 - 1
    # Distinct long prompts until both ranks' pools (96 pages each) must evict.
    for i in range(8):
        text = f"Document {i}: " + " ".join(f"word{i}x{j}" for j in range(120))
        client.completions.create(model="smol", prompt=text, max_tokens=1, temperature=0)
    deadline = time.time() + 20
    while time.time() < deadline and not any(isinstance(e, BlockRemoved) for _r, e in reader.events()):
        time.sleep(0.1)
    events = reader.events()
    removed = [(r, h) for r, e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed, "no BlockRemoved event after filling both pools"
    stored_hashes = {(r, h) for r, e in events if isinstance(e, BlockStored) for h in e.block_hashes}
    # Pages stored while this stream was open were removed again (earlier pages may go first).
    assert set(removed) & stored_hashes
    reader.stop.set()


@pytest.mark.timeout(120)
def test_external_rank_publishes_its_events_named_by_its_rank(single: LiveServer) -> None:
    reader = EventReader(single.url)
    reader.start()
    assert reader.connected.wait(30) and reader.failure is None
    time.sleep(0.5)
    prompt = "A list of colours: " + ", ".join(f"colour {i}" for i in range(40))
    single.openai().completions.create(model="smol", prompt=prompt, max_tokens=2, temperature=0)
    deadline = time.time() + 20
    while time.time() < deadline and not reader.batches:
        time.sleep(0.1)
    assert reader.batches and {b["data_parallel_rank"] for b in reader.batches} == {1}
    assert any(isinstance(e, BlockStored) for _r, e in reader.events())
    reader.stop.set()
    assert "data_parallel" not in httpx.get(single.url + "/metrics?format=json", timeout=10).json()


@pytest.mark.timeout(120)
def test_structured_output_runs_on_a_rank(dp: LiveServer) -> None:
    """A compiled grammar crosses to a rank as its grammar and compiles again there: a JSON-schema
    answer through two ranks is valid JSON of the schema and equals one engine's."""
    body = {"model": "smol", "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": {
                "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                "additionalProperties": False}}},
            "messages": [{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}]}
    answers = []
    for _ in range(2):  # the second lands on the rank with the cached prompt
        resp = httpx.post(dp.url + "/v1/chat/completions", timeout=60, json=body)
        assert resp.status_code == 200, resp.text
        answers.append(resp.json()["choices"][0]["message"]["content"])
    parsed = json.loads(answers[0])
    assert set(parsed) == {"city"} and isinstance(parsed["city"], str)
    assert answers[0] == answers[1]


@pytest.mark.timeout(400)
def test_killed_rank_fails_its_requests_in_their_shapes_and_the_rest_serves(dp: LiveServer) -> None:
    from tests.server.test_shutdown import StreamReader, chat_body

    reader = StreamReader(dp.url, max_tokens=900)
    reader.start()
    assert reader.first.wait(60) and reader.content, (reader.status, reader.failure, reader.events)
    busy = [r for r in ranks(dp) if r["in_flight"] > 0]
    assert len(busy) == 1, busy
    victim = busy[0]
    # The same prompt goes to the same rank: its prompt's pages are cached there (no load term here).
    buffered: dict[str, Any] = {}

    def post() -> None:
        resp = httpx.post(dp.url + "/v1/chat/completions", json=chat_body(900, stream=False), timeout=120)
        buffered["status"], buffered["body"] = resp.status_code, resp.json()

    poster = threading.Thread(target=post, daemon=True)
    poster.start()
    deadline = time.time() + 20
    while time.time() < deadline and ranks(dp)[victim["rank"]]["in_flight"] < 2:
        time.sleep(0.05)
    assert ranks(dp)[victim["rank"]]["in_flight"] == 2
    os.kill(victim["pid"], signal.SIGKILL)

    reader.join(30)
    assert not reader.is_alive() and reader.failure is None, reader.failure
    assert reader.status == 200 and reader.events and reader.events[-1] != "[DONE]"
    error = reader.events[-1]
    assert isinstance(error, dict) and error["error"]["type"] == "server_error", error
    assert f"data-parallel rank {victim['rank']} died" in error["error"]["message"]
    poster.join(30)
    assert not poster.is_alive()
    assert buffered["status"] == 500 and buffered["body"]["error"]["type"] == "server_error", buffered
    assert "killed by signal 9" in buffered["body"]["error"]["message"]

    health = httpx.get(dp.url + "/health", timeout=5)
    assert health.status_code == 503, health.text
    assert health.json()["error"]["type"] == "server_error"
    assert f"data-parallel rank {victim['rank']}" in health.json()["error"]["message"]
    # The other rank serves meanwhile.
    ok = dp.openai().completions.create(model="smol", prompt="Two plus two is", max_tokens=4, temperature=0)
    assert ok.choices[0].text

    deadline = time.time() + 240
    while time.time() < deadline and httpx.get(dp.url + "/health", timeout=5).status_code != 200:
        time.sleep(0.5)
    assert httpx.get(dp.url + "/health", timeout=5).status_code == 200, "the killed rank did not come back"
    back = ranks(dp)[victim["rank"]]
    assert back["up"] == 1 and back["restarts"] == 1 and back["pid"] not in (0, victim["pid"])
    prom = httpx.get(dp.url + "/metrics", timeout=10).text
    assert f'helios_dp_rank_restarts_total{{rank="{victim["rank"]}"}} 1.0' in prom
    for _ in range(2):  # both ranks serve again
        assert dp.openai().completions.create(model="smol", prompt="Hello", max_tokens=2).choices[0].text is not None
