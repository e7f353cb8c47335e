"""Soak (issue 10, item 7): a bounded, seeded, self-terminating load against a live Helios.

The load runs on loopback against a `hypercorn helios.app:app` process started the way
tests/server/conftest.py `start_server` starts one, on a small configuration (`SOAK_TOML`: 8 HTTP
admission slots, 4 model slots, a model queue of 2) so that bursts hit 429 and 503. It mixes:

- the four generation protocols (Chat Completions, Completions, Messages, Responses), buffered and
  streamed, `n` > 1 (and two-prompt batches) on Chat and Completions, generation logprobs on some,
  `max_tokens` 8-32;
- streamed readers of three kinds: plain readers, readers that close the connection after a random
  number of events (30% of streams), and paused readers (read a few events, sleep 1-2 s, read on);
- bursts of more concurrent requests than `max_concurrency`.

Pass criteria (`SoakReport.problems`): no 5xx except the spec's 503s (model queue full, paused
admission), every 429 carries `Retry-After`, no other unexpected status, every completed response
and stream well-formed for its protocol, no KV page, model slot, queue entry or HTTP admission slot
held once the server is idle (`/metrics?format=json`), `/health` 200 then, and the server's RSS flat:
the median of the last quarter of the samples less than 5% above the median of the second quarter.

CI-sized: tests/server/test_soak.py. Long: `nox -s soak` (`python -m tests.server.soak`), e.g.
`nox -s soak -- --duration 600` or `-- --requests 3000`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

SOAK_TOML = """
[server]
aliases = ["smol"]
max_concurrency = @CONCURRENCY@
model_queue_size = 2
[model]
path = "@MODEL@"
dtype = "float32"
max_model_len = 512
[engine]
max_active = 4
kv_pages = 192
prefill_chunk_size = 256
# The whole pool resident from the start: pages first touched during the load are not a leak.
kv_prefault = true
[cache]
# A small host store: the prefix cache evicts into it all through the soak, and it fills within the
# first quarter, so its growth (bounded by this budget) is not read as a leak by the RSS check.
host_memory_gib = 0.02
"""

MAX_CONCURRENCY = 8
PROTOCOLS = ("chat", "completions", "messages", "responses")
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "messages": "/v1/messages",
         "responses": "/v1/responses"}
# The spec's 503s: "a full model request queue, paused admission, or an unavailable runtime"; a
# runtime that became unavailable during a soak is a failure, so only the first two pass.
ADMISSION_503 = ("request queue is full", "admission is paused")

PROMPTS = (
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "List three colours.",
    "Explain what a hash table is in one sentence.",
    "Tell me a short story about a robot who learns to paint.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Give me a recipe title for a quick pasta dinner.",
)
LONG = ("The history of computing is a story of people who wanted to calculate faster, from the abacus "
        "through mechanical calculators to electronic machines that fill rooms and then pockets. ")


@dataclass
class Plan:
    """One request the generator will send, fully decided by the seeded generator."""

    protocol: str
    stream: bool
    reader: str  # buffered | full | disconnect | pause
    body: dict[str, Any]
    choices: int  # generated choices the request asks for
    max_tokens: int
    logprobs: bool
    disconnect_after: int = 0
    pause_after: int = 0
    pause_s: float = 0.0
    burst: bool = False


@dataclass
class Result:
    protocol: str
    reader: str
    outcome: str  # ok | disconnected | 429 | 503 | error
    status: int
    seconds: float
    events: int = 0
    detail: str = ""
    burst: bool = False
    retry_after: str | None = None


def make_plan(rng: random.Random, *, burst: bool = False) -> Plan:
    protocol = rng.choice(PROTOCOLS)
    stream = rng.random() < 0.6
    reader = "buffered"
    if stream:
        r = rng.random()
        reader = "disconnect" if r < 0.3 else "pause" if r < 0.5 else "full"
    max_tokens = rng.randint(8, 32)
    prompt = rng.choice(PROMPTS)
    if rng.random() < 0.2:
        prompt = LONG * rng.randint(2, 5) + prompt
    temperature = rng.choice((0.0, 0.7, 1.0))
    seed = rng.randrange(1 << 30)
    logprobs = protocol != "messages" and rng.random() < 0.3
    choices = 1
    body: dict[str, Any] = {"model": "smol", "stream": stream, "temperature": temperature}
    if protocol == "chat":
        n = rng.choice((1, 1, 1, 2, 2, 3))
        choices = n
        body.update(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, n=n, seed=seed)
        if logprobs:
            body.update(logprobs=True, top_logprobs=2)
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        if rng.random() < 0.5:
            body["ignore_eos"] = True
    elif protocol == "completions":
        n = rng.choice((1, 1, 1, 2, 2, 3))
        prompts: str | list[str] = prompt
        if n <= 2 and rng.random() < 0.2:
            prompts = [prompt, rng.choice(PROMPTS)]
        choices = n * (len(prompts) if isinstance(prompts, list) else 1)
        body.update(prompt=prompts, max_tokens=max_tokens, n=n, seed=seed)
        if logprobs:
            body["logprobs"] = 2
        if rng.random() < 0.5:
            body["ignore_eos"] = True
    elif protocol == "messages":
        body.update(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens)
        if rng.random() < 0.3:
            body["system"] = "You are terse."
    else:
        body.update(input=prompt, max_output_tokens=max_tokens)
        if rng.random() < 0.3:
            body["instructions"] = "Answer briefly."
        if logprobs:
            body.update(include=["message.output_text.logprobs"], top_logprobs=2)
    plan = Plan(protocol, stream, reader, body, choices, max_tokens, logprobs, burst=burst)
    if reader == "disconnect":
        plan.disconnect_after = rng.randint(1, 8)
    elif reader == "pause":
        plan.pause_after = rng.randint(1, 4)
        plan.pause_s = rng.uniform(1.0, 2.0)
    return plan


# -- well-formedness ------------------------------------------------------------------------------


class Malformed(Exception):
    pass


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise Malformed(what)


def _stream_error(protocol: str, event: str | None, data: Any) -> str | None:
    """The message of a terminal error event, or None when `data` is not one."""
    if not isinstance(data, dict):
        return None
    if protocol == "messages":
        if event == "error" or data.get("type") == "error":
            return str(data.get("error", {}).get("message", data))
        return None
    if protocol == "responses":
        if data.get("type") == "error":
            return str(data.get("message", data))
        if data.get("type") == "response.failed":
            err = (data.get("response") or {}).get("error") or {}
            return str(err.get("message", "response.failed"))
        return None
    if "error" in data:
        return str((data["error"] or {}).get("message", data))
    return None


def check_openai_stream(plan: Plan, events: list[tuple[str | None, str]]) -> None:
    """Chat and Completions chunks: JSON, one finish_reason per choice, then `[DONE]` and nothing after."""
    _need(bool(events) and events[-1][1] == "[DONE]", "does not end with [DONE]")
    obj = "chat.completion.chunk" if plan.protocol == "chat" else "text_completion"
    finish: dict[int, str] = {}
    entries: Counter[int] = Counter()
    usage = None
    ids = set()
    for _, raw in events[:-1]:
        _need(raw != "[DONE]", "[DONE] before the end")
        chunk = json.loads(raw)
        _need(chunk.get("object") == obj, f"object {chunk.get('object')!r}")
        ids.add(chunk.get("id"))
        if chunk.get("usage"):
            usage = chunk["usage"]
        for c in chunk.get("choices", []):
            i = c["index"]
            _need(0 <= i < plan.choices, f"choice index {i}")
            _need(i not in finish, f"choice {i} continues after its finish_reason")
            lp = c.get("logprobs")
            if lp:
                entries[i] += len(lp["content"]) if plan.protocol == "chat" else len(lp["tokens"])
            if c.get("finish_reason") is not None:
                finish[i] = c["finish_reason"]
    _need(len(ids) == 1, f"{len(ids)} ids in one stream")
    _need(sorted(finish) == list(range(plan.choices)), f"finish_reason for {sorted(finish)} of {plan.choices}")
    _need(all(r in ("stop", "length") for r in finish.values()), f"finish reasons {finish}")
    if plan.logprobs:
        for i, r in finish.items():
            if r == "length":
                _need(entries[i] == plan.max_tokens, f"choice {i}: {entries[i]} logprob entries for {plan.max_tokens} tokens")
    if (plan.body.get("stream_options") or {}).get("include_usage"):
        _need(usage is not None and usage["completion_tokens"] >= 1, "no usage chunk")


def check_messages_stream(plan: Plan, events: list[tuple[str | None, str]]) -> None:
    """message_start, content blocks each opened and closed, message_delta with a stop_reason, message_stop."""
    names = []
    open_blocks: set[int] = set()
    stop_reason = None
    for event, raw in events:
        data = json.loads(raw)
        _need(event == data.get("type"), f"event {event!r} carries {data.get('type')!r}")
        if event == "ping":
            continue
        names.append(event)
        if event == "content_block_start":
            _need(data["index"] not in open_blocks, "block opened twice")
            open_blocks.add(data["index"])
        elif event == "content_block_delta":
            _need(data["index"] in open_blocks, "delta outside its block")
        elif event == "content_block_stop":
            _need(data["index"] in open_blocks, "stop of a block not open")
            open_blocks.discard(data["index"])
        elif event == "message_delta":
            stop_reason = data["delta"].get("stop_reason")
    _need(names[:1] == ["message_start"], f"starts with {names[:1]}")
    _need(names[-1:] == ["message_stop"], f"ends with {names[-1:]}")
    _need(names.count("message_start") == 1 and names.count("message_stop") == 1, "start/stop repeated")
    _need(not open_blocks, f"blocks left open: {open_blocks}")
    _need(names[-2:-1] == ["message_delta"], "message_delta is not right before message_stop")
    _need(stop_reason in ("end_turn", "max_tokens", "stop_sequence"), f"stop_reason {stop_reason!r}")


def check_responses_stream(plan: Plan, events: list[tuple[str | None, str]]) -> None:
    """sequence_number strictly increasing from 0, response.created first, completed/incomplete last."""
    types = []
    last = -1
    for event, raw in events:
        data = json.loads(raw)
        _need(event is None or event == data.get("type"), f"event {event!r} carries {data.get('type')!r}")
        seq = data.get("sequence_number")
        _need(isinstance(seq, int) and seq > last, f"sequence_number {seq} after {last}")
        _need(last >= 0 or seq == 0, f"first sequence_number {seq}")
        last = seq
        types.append(data["type"])
    _need(types[:1] == ["response.created"], f"starts with {types[:1]}")
    _need(types[-1:] in (["response.completed"], ["response.incomplete"]), f"ends with {types[-1:]}")
    _need(sum(t in ("response.completed", "response.incomplete") for t in types) == 1, "terminal event repeated")


def check_buffered(plan: Plan, obj: dict[str, Any]) -> None:
    p = plan.protocol
    if p in ("chat", "completions"):
        _need(obj.get("object") == ("chat.completion" if p == "chat" else "text_completion"), f"object {obj.get('object')!r}")
        choices = obj["choices"]
        _need(sorted(c["index"] for c in choices) == list(range(plan.choices)), f"{len(choices)} choices of {plan.choices}")
        for c in choices:
            _need(c["finish_reason"] in ("stop", "length"), f"finish_reason {c['finish_reason']!r}")
            if plan.logprobs and c["finish_reason"] == "length":
                lp = c["logprobs"]
                got = len(lp["content"]) if p == "chat" else len(lp["tokens"])
                _need(got == plan.max_tokens, f"{got} logprob entries for {plan.max_tokens} tokens")
        _need(obj["usage"]["completion_tokens"] >= 1, "no completion tokens")
    elif p == "messages":
        _need(obj.get("type") == "message" and obj.get("role") == "assistant", "not an assistant message")
        _need(obj.get("stop_reason") in ("end_turn", "max_tokens", "stop_sequence"), f"stop_reason {obj.get('stop_reason')!r}")
        _need(isinstance(obj.get("content"), list), "no content list")
    else:
        _need(obj.get("object") == "response", f"object {obj.get('object')!r}")
        _need(obj.get("status") in ("completed", "incomplete"), f"status {obj.get('status')!r}")
        _need(isinstance(obj.get("output"), list), "no output list")


STREAM_CHECKS = {"chat": check_openai_stream, "completions": check_openai_stream,
                 "messages": check_messages_stream, "responses": check_responses_stream}


# -- the load ----------------------------------------------------------------------------------------


async def _sse(resp: httpx.Response) -> AsyncIterator[tuple[str | None, str]]:
    """(event name, data) per `data:` line; comments (keepalives) skipped. Every Helios event is one data line."""
    event = None
    async for line in resp.aiter_lines():
        if not line or line.startswith(":"):
            if not line:
                event = None
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            event = value
        elif name == "data":
            yield event, value
            event = None


def _error_message(body: bytes) -> str:
    try:
        obj = json.loads(body)
    except ValueError:
        return body[:200].decode(errors="replace")
    err = obj.get("error") if isinstance(obj, dict) else None
    return str(err.get("message") if isinstance(err, dict) else obj)


async def run_one(client: httpx.AsyncClient, plan: Plan) -> Result:
    """One planned request. A reader that disconnects mid-stream uses a connection of its own (a
    client without keep-alive): closing a response early under load could otherwise leave its
    connection for httpx's pool to hand to a concurrent request, which then fails with a ReadError
    that no server behaviour caused (seen once in a full-suite run: the server logged a request
    that disconnected 4 ms after arriving, while the client reported a transport error)."""
    if plan.reader != "disconnect":
        return await _run_one(client, plan)
    async with httpx.AsyncClient(base_url=client.base_url, timeout=client.timeout,
                                 limits=httpx.Limits(max_connections=1, max_keepalive_connections=0)) as own:
        return await _run_one(own, plan)


async def _run_one(client: httpx.AsyncClient, plan: Plan) -> Result:
    t0 = time.perf_counter()
    headers = {"anthropic-version": "2023-06-01"} if plan.protocol == "messages" else {}
    res = Result(plan.protocol, plan.reader, "error", 0, 0.0, burst=plan.burst)
    try:
        async with client.stream("POST", PATHS[plan.protocol], json=plan.body, headers=headers) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                body = await resp.aread()
                res.retry_after = resp.headers.get("retry-after")
                res.detail = _error_message(body)
                if resp.status_code == 429:
                    res.outcome = "429"
                elif resp.status_code == 503:
                    res.outcome = "503"
                return res
            if not plan.stream:
                obj = json.loads(await resp.aread())
                check_buffered(plan, obj)
                res.outcome = "ok"
                return res
            events: list[tuple[str | None, str]] = []
            async for event, data in _sse(resp):
                events.append((event, data))
                parsed = None if data == "[DONE]" else json.loads(data)
                msg = _stream_error(plan.protocol, event, parsed)
                if msg is not None:
                    res.events = len(events)
                    res.detail = f"terminal error event: {msg}"
                    res.outcome = "503" if any(s in msg for s in ADMISSION_503) else "error"
                    return res
                if plan.reader == "disconnect" and len(events) >= plan.disconnect_after:
                    res.events = len(events)
                    res.outcome = "disconnected"
                    return res  # leaving the block closes the connection mid-stream
                if plan.reader == "pause" and len(events) == plan.pause_after:
                    await asyncio.sleep(plan.pause_s)
            res.events = len(events)
            STREAM_CHECKS[plan.protocol](plan, events)
            res.outcome = "ok"
            return res
    except Malformed as exc:
        res.outcome, res.detail = "error", f"malformed: {exc}"
    except (ValueError, KeyError, TypeError) as exc:
        res.outcome, res.detail = "error", f"malformed: {type(exc).__name__}: {exc}"
    except httpx.HTTPError as exc:
        res.outcome, res.detail = "error", f"transport: {type(exc).__name__}: {exc}"
    finally:
        res.seconds = time.perf_counter() - t0
    return res


# -- the server process -------------------------------------------------------------------------------


def _vm_rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _descendants(pid: int) -> list[int]:
    try:
        import psutil

        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except ImportError:
        pass
    parents: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def server_pid(root: int) -> int:
    """The process that serves: hypercorn runs its worker as a child of the started process."""
    best, best_rss = root, _vm_rss_kib(root) or 0
    for pid in _descendants(root):
        rss = _vm_rss_kib(pid) or 0
        if rss > best_rss:
            best, best_rss = pid, rss
    return best


def rss_bytes(pid: int) -> int | None:
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except ImportError:
        kib = _vm_rss_kib(pid)
        return None if kib is None else kib * 1024
    except Exception:
        return None


# -- one soak -----------------------------------------------------------------------------------------


@dataclass
class SoakOptions:
    seed: int = 20240610
    model: str = ""  # a GGUF file, a folder or a catalog name (`helios models`); empty: the default model
    duration: float = 45.0  # seconds of load (ignored when `requests` is set)
    requests: int | None = None  # stop after this many requests (steady and burst together)
    workers: int = 3  # steady closed-loop clients
    burst_every: float = 6.0
    burst_size: int = 20  # > MAX_CONCURRENCY
    rss_interval: float = 0.5
    idle_timeout: float = 60.0


@dataclass
class SoakReport:
    options: SoakOptions
    results: list[Result] = field(default_factory=list)
    seconds: float = 0.0
    bursts: int = 0
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds into the load, bytes)
    rss_pid: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    idle_wait: float = 0.0
    health: int = 0  # GET /health status once idle
    log_tracebacks: int = 0

    # -- figures
    def count(self, outcome: str) -> int:
        return sum(r.outcome == outcome for r in self.results)

    def rss_quarters(self) -> list[float]:
        vals = [b for _, b in self.rss]
        q = len(vals) // 4
        if q == 0:
            return []
        return [statistics.median(vals[i * q:(i + 1) * q] if i < 3 else vals[3 * q:]) for i in range(4)]

    def rss_growth(self) -> float | None:
        qs = self.rss_quarters()
        return None if not qs else qs[3] / qs[1] - 1.0

    def leaked(self) -> dict[str, int]:
        m = self.metrics
        if not m:
            return {"metrics": -1}
        return {"pages": int(m["total_pages"]) - int(m["free_pages"]), "active": int(m["active"]),
                "pending": int(m["pending"]), "http_slots": int(m.get("http_admission_in_use", 0))}

    def problems(self) -> list[str]:
        out = []
        for r in self.results:
            where = f"{r.protocol}/{r.reader}{' (burst)' if r.burst else ''}"
            if r.outcome == "error":
                out.append(f"{where}: HTTP {r.status}: {r.detail}")
            elif r.outcome == "503" and not any(s in r.detail for s in ADMISSION_503):
                out.append(f"{where}: 503 that is not queue-full or paused admission: {r.detail}")
            elif r.outcome == "429" and not r.retry_after:
                out.append(f"{where}: 429 without Retry-After")
        if self.health != 200:
            out.append(f"GET /health answered {self.health} once idle")
        leaked = self.leaked()
        if any(leaked.values()):
            out.append(f"leaked once idle: {leaked} (metrics {self.metrics})")
        growth = self.rss_growth()
        if growth is None:
            out.append(f"too few RSS samples ({len(self.rss)})")
        elif growth >= 0.05:
            out.append(f"RSS grew {growth:.1%} between the second and the last quarter ({self.rss_quarters()})")
        return out

    def summary(self) -> str:
        lines = [f"soak: seed {self.options.seed}, {self.seconds:.1f} s of load, {len(self.results)} requests "
                 f"({self.bursts} bursts of {self.options.burst_size}, {self.options.workers} steady clients), "
                 f"idle after {self.idle_wait:.1f} s"]
        outcomes = ("ok", "disconnected", "429", "503", "error")
        lines.append(f"  {'protocol':<12}{'reader':<12}" + "".join(f"{o:>14}" for o in outcomes))
        for p in PROTOCOLS:
            for reader in ("buffered", "full", "pause", "disconnect"):
                rs = [r for r in self.results if r.protocol == p and r.reader == reader]
                if rs:
                    c = Counter(r.outcome for r in rs)
                    lines.append(f"  {p:<12}{reader:<12}" + "".join(f"{c[o]:>14}" for o in outcomes))
        c = Counter(r.outcome for r in self.results)
        lines.append(f"  {'total':<24}" + "".join(f"{c[o]:>14}" for o in outcomes))
        streams = [r for r in self.results if r.reader != "buffered"]
        planned = sum(r.reader == "disconnect" for r in self.results)
        admitted = [r for r in streams if r.outcome in ("ok", "disconnected")]
        share = c["disconnected"] / len(admitted) if admitted else 0.0
        lines.append(f"  streams: {len(streams)} ({len(admitted)} admitted); disconnect planned {planned}, closed "
                     f"mid-stream {c['disconnected']} ({share:.0%} of admitted streams); paused readers {sum(r.reader == 'pause' for r in self.results)} "
                     f"({sum(r.reader == 'pause' and r.outcome == 'ok' for r in self.results)} read to the end)")
        r429 = [r for r in self.results if r.outcome == "429"]
        lines.append(f"  429: {len(r429)} ({sum(bool(r.retry_after) for r in r429)} with Retry-After, values "
                     f"{sorted({r.retry_after for r in r429 if r.retry_after})}); in bursts {sum(r.burst for r in r429)}")
        r503 = Counter(r.detail for r in self.results if r.outcome == "503")
        lines.append(f"  503: {sum(r503.values())} {dict(r503)}; in bursts "
                     f"{sum(r.burst for r in self.results if r.outcome == '503')}")
        by_status = Counter(r.status for r in self.results)
        lines.append(f"  HTTP statuses: {dict(sorted(by_status.items()))}")
        ok = [r.seconds for r in self.results if r.outcome == "ok"]
        if ok:
            lines.append(f"  completed latency: median {statistics.median(ok):.2f} s, max {max(ok):.2f} s")
        m = self.metrics
        lines.append(f"  idle: free_pages {m.get('free_pages')}/{m.get('total_pages')}, active {m.get('active')}, "
                     f"pending {m.get('pending')}, http_admission_in_use {m.get('http_admission_in_use')}; "
                     f"leaked {self.leaked()}; completed {m.get('completed')}, failed {m.get('failed')}, "
                     f"generated_tokens {m.get('generated_tokens')}; /health {self.health}")
        qs = self.rss_quarters()
        growth = self.rss_growth()
        mib = [f"{b / 2**20:.0f}" for b in qs]
        curve = [f"{b / 2**20:.0f}" for _, b in self.rss[:: max(1, len(self.rss) // 12)]]
        lines.append(f"  RSS (pid {self.rss_pid}, {len(self.rss)} samples, MiB): quarter medians {mib}; "
                     f"growth Q2->Q4 {'n/a' if growth is None else f'{growth:+.2%}'}; curve {curve}")
        lines.append(f"  server log tracebacks: {self.log_tracebacks}")
        problems = self.problems()
        lines.append(f"  result: {'PASS' if not problems else 'FAIL'}")
        lines += [f"  problem: {p}" for p in problems[:20]]
        return "\n".join(lines)


async def _idle_metrics(client: httpx.AsyncClient, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    m: dict[str, Any] = {}
    while True:
        m = (await client.get("/metrics", params={"format": "json"})).json()
        idle = (m["free_pages"] == m["total_pages"] and m["active"] == 0 and m["pending"] == 0
                and m.get("http_admission_in_use", 0) == 0)
        if idle or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.25)


async def drive(url: str, root_pid: int | None, opts: SoakOptions) -> SoakReport:
    report = SoakReport(opts)
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    timeout = httpx.Timeout(120.0, connect=10.0)
    started = 0
    start = time.monotonic()
    deadline = start + opts.duration

    def more() -> bool:
        nonlocal started
        if opts.requests is not None:
            if started >= opts.requests:
                return False
        elif time.monotonic() >= deadline:
            return False
        started += 1
        return True

    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        pid = server_pid(root_pid) if root_pid else 0
        report.rss_pid = pid
        done = asyncio.Event()

        async def sample_rss() -> None:
            while not done.is_set():
                b = rss_bytes(pid) if pid else None
                if b is not None:
                    report.rss.append((time.monotonic() - start, b))
                try:
                    await asyncio.wait_for(done.wait(), opts.rss_interval)
                except TimeoutError:
                    pass

        async def worker(i: int) -> None:
            rng = random.Random(f"{opts.seed}-worker-{i}")
            while more():
                r = await run_one(client, make_plan(rng))
                report.results.append(r)
                if r.outcome in ("429", "503"):
                    await asyncio.sleep(rng.uniform(0.1, 0.5))

        async def bursts() -> None:
            rng = random.Random(f"{opts.seed}-bursts")
            j = 0
            while True:
                await asyncio.sleep(opts.burst_every * rng.uniform(0.7, 1.3))
                plans = []
                while len(plans) < opts.burst_size and more():
                    plans.append(make_plan(rng, burst=True))
                if not plans:
                    return
                j += 1
                report.bursts = j
                report.results.extend(await asyncio.gather(*(run_one(client, p) for p in plans)))

        sampler = asyncio.create_task(sample_rss())
        await asyncio.gather(bursts(), *(worker(i) for i in range(opts.workers)))
        report.seconds = time.monotonic() - start
        done.set()
        await sampler
        t = time.monotonic()
        report.metrics = await _idle_metrics(client, opts.idle_timeout)
        report.idle_wait = time.monotonic() - t
        report.health = (await client.get("/health")).status_code
    return report


def run_soak(tmp: Path, opts: SoakOptions) -> SoakReport:
    """Start a server (conftest's `start_server`) on `SOAK_TOML`, drive it, stop it."""
    from tests.server.conftest import start_server, stop_server

    toml = SOAK_TOML.replace("@CONCURRENCY@", str(MAX_CONCURRENCY))
    if opts.model:
        toml = toml.replace("@MODEL@", opts.model)
    server = start_server(tmp, toml, "soak")
    try:
        assert server.proc is not None
        report = asyncio.run(drive(server.url, server.proc.pid, opts))
    finally:
        stop_server(server)
    if server.log is not None:
        report.log_tracebacks = server.log.read_text(errors="replace").count("Traceback")
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.server.soak", description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    ap.add_argument("--requests", type=int, default=None, help="stop after this many requests instead")
    ap.add_argument("--seed", type=int, default=SoakOptions.seed)
    ap.add_argument("--workers", type=int, default=SoakOptions.workers)
    ap.add_argument("--burst-every", type=float, default=SoakOptions.burst_every)
    ap.add_argument("--burst-size", type=int, default=SoakOptions.burst_size)
    ap.add_argument("--model", default="", help="a GGUF file, a model folder or a catalog name, e.g. "
                    "qwen2.5-coder:0.5b (default: the default model)")
    ap.add_argument("--keep", action="store_true", help="keep the server's config and log")
    a = ap.parse_args(argv)
    opts = SoakOptions(seed=a.seed, duration=a.duration, requests=a.requests, workers=a.workers,
                       burst_every=a.burst_every, burst_size=a.burst_size, model=a.model)
    tmp = Path(tempfile.mkdtemp(prefix="helios-soak-"))
    t0 = time.monotonic()
    report = run_soak(tmp, opts)
    print(report.summary())
    print(f"  wall time {time.monotonic() - t0:.1f} s (server start and stop included); server log {tmp / 'soak.log'}")
    if not a.keep and not report.problems():
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    return 1 if report.problems() else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
