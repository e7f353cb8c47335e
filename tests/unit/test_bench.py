"""helios.clients.bench against a tiny in-process OpenAI-compatible SSE server (plain trio sockets)."""

from __future__ import annotations

import contextlib
import itertools
import json
import queue
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pytest
import trio

from helios.clients import bench, bench_cache
from helios.clients.stream import make_prompt

MODEL = "fake-model"


@dataclass
class FakeConfig:
    ttft: float = 0.03  # seconds before the first token
    itl: float = 0.003  # seconds between chunks
    tokens_per_chunk: int = 1
    prompt_overhead: int = 3  # prompt tokens besides the words (template, BOS)
    tokens_per_word: int = 1
    eos_at: int | None = None  # stop early, ignoring ignore_eos
    reject: frozenset[str] = frozenset()  # request fields answered with HTTP 400
    send_usage: bool = True  # honour stream_options
    send_timings: bool = False  # llama-server's "timings" object on the last chunk
    fail_every: int = 0  # answer every n-th request of max_tokens > 1 with HTTP 500
    model: str = MODEL
    bodies: list[dict[str, Any]] = field(default_factory=list)
    counter: int = 0
    # A toy prefix cache: reuse the longest word prefix shared with an earlier prompt, in pages of
    # `page_words`; report it as prompt_tokens_details.cached_tokens (or llama-server's cache_n).
    prefix_cache: bool = False
    page_words: int = 4
    prefill_s_per_token: float = 0.0  # added to ttft per prompt token not reused
    metrics: bool = False  # answer GET /metrics?format=json with Helios's counters
    seen: list[list[str]] = field(default_factory=list)
    prefill_tokens: int = 0
    reused_tokens: int = 0


def _has_field(body: dict[str, Any], name: str) -> bool:
    if "." in name:
        outer, inner = name.split(".", 1)
        value = body.get(outer)
        return isinstance(value, dict) and inner in value
    return name in body


async def _send(stream: trio.SocketStream, status: str, content_type: str, payload: bytes) -> None:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(payload)}\r\n"
        "Connection: close\r\n\r\n"
    )
    await stream.send_all(head.encode() + payload)


async def _read_request(stream: trio.SocketStream) -> tuple[str, str, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise EOFError
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    while len(body) < length:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise EOFError
        body += chunk
    return method, path, body


async def _handle(cfg: FakeConfig, stream: trio.SocketStream) -> None:
    try:
        method, path, raw = await _read_request(stream)
        if method == "GET" and path == "/metrics?format=json" and cfg.metrics:
            payload = {"prefill_tokens": cfg.prefill_tokens, "reused_tokens": cfg.reused_tokens}
            await _send(stream, "200 OK", "application/json", json.dumps(payload).encode())
            return
        if method == "GET" and path == "/v1/models":
            payload = {"object": "list", "data": [{"id": cfg.model, "object": "model"}]}
            await _send(stream, "200 OK", "application/json", json.dumps(payload).encode())
            return
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
            await _send(stream, "404 Not Found", "text/plain", b"no such route")
            return
        body = json.loads(raw)
        cfg.bodies.append(body)
        bad = [name for name in cfg.reject if _has_field(body, name)]
        if bad:
            await _send(stream, "400 Bad Request", "application/json", json.dumps({"error": bad}).encode())
            return
        if cfg.fail_every and body["max_tokens"] > 1:
            cfg.counter += 1
            if cfg.counter % cfg.fail_every == 0:
                await _send(stream, "500 Internal Server Error", "text/plain", b"boom")
                return
        await _stream_completion(cfg, stream, body, chat=path.endswith("chat/completions"))
    except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await stream.aclose()


async def _stream_completion(
    cfg: FakeConfig, stream: trio.SocketStream, body: dict[str, Any], chat: bool
) -> None:
    if chat:
        parts = [json.dumps(body["tools"])] if body.get("tools") else []
        for message in body["messages"]:
            parts.append(message.get("content") or "")
            parts.extend(json.dumps(call) for call in message.get("tool_calls") or [])
        words = " ".join(parts).split()
    else:
        words = body["prompt"].split()
    prompt_tokens = len(words) * cfg.tokens_per_word + cfg.prompt_overhead
    cached = 0
    if cfg.prefix_cache:
        for old in cfg.seen:
            n = 0
            while n < min(len(old), len(words)) and old[n] == words[n]:
                n += 1
            cached = max(cached, n // cfg.page_words * cfg.page_words * cfg.tokens_per_word)
        cfg.seen.append(words)
    cfg.prefill_tokens += prompt_tokens - cached
    cfg.reused_tokens += cached
    total = body["max_tokens"] if cfg.eos_at is None else min(cfg.eos_at, body["max_tokens"])
    options = body.get("stream_options") or {}
    continuous = cfg.send_usage and bool(options.get("continuous_usage_stats"))
    await stream.send_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
        b"Connection: close\r\n\r\n"
    )
    await trio.sleep(cfg.ttft + (prompt_tokens - cached) * cfg.prefill_s_per_token)
    sent = 0
    while sent < total:
        n = min(cfg.tokens_per_chunk, total - sent)
        sent += n
        text = " tok" * n
        done = sent == total
        choice: dict[str, Any] = (
            {"index": 0, "delta": {"content": text}, "finish_reason": "length" if done else None}
            if chat
            else {"index": 0, "text": text, "finish_reason": "length" if done else None}
        )
        chunk: dict[str, Any] = {"id": "x", "object": "chunk", "model": cfg.model, "choices": [choice]}
        if done and cfg.send_timings:
            chunk["timings"] = {"prompt_n": prompt_tokens - cached, "predicted_n": total, "predicted_ms": 1.0}
            if cfg.prefix_cache:
                chunk["timings"]["cache_n"] = cached
        if continuous:
            chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": sent}
        await stream.send_all(f"data: {json.dumps(chunk)}\n\n".encode())
        if not done:
            await trio.sleep(cfg.itl)
    if cfg.send_usage and options.get("include_usage"):
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": total,
            "total_tokens": prompt_tokens + total,
        }
        if cfg.prefix_cache:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        final = {"id": "x", "object": "chunk", "model": cfg.model, "choices": [], "usage": usage}
        await stream.send_all(f"data: {json.dumps(final)}\n\n".encode())
    await stream.send_all(b"data: [DONE]\n\n")


@contextlib.contextmanager
def fake_server(cfg: FakeConfig) -> Iterator[str]:
    """Serve ``cfg`` on 127.0.0.1 from a thread with its own trio loop; yields the base URL."""
    ready: queue.Queue[tuple[int, trio.lowlevel.TrioToken, trio.CancelScope]] = queue.Queue()

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                partial(trio.serve_tcp, partial(_handle, cfg), 0, host="127.0.0.1")
            )
            port = listeners[0].socket.getsockname()[1]
            ready.put((port, trio.lowlevel.current_trio_token(), nursery.cancel_scope))

    thread = threading.Thread(target=trio.run, args=(serve,), daemon=True)
    thread.start()
    port, token, scope = ready.get(timeout=5)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        token.run_sync_soon(scope.cancel)
        thread.join(5)


def _bench(url: str, **kwargs: Any) -> dict[str, Any]:
    return trio.run(partial(bench.run_bench, url, **kwargs))


def _measured(cfg: FakeConfig, max_tokens: int) -> list[dict[str, Any]]:
    return [b for b in cfg.bodies if b["max_tokens"] == max_tokens]


def test_counts_ttft_and_shape() -> None:
    cfg = FakeConfig()
    with fake_server(cfg) as url:
        result = _bench(url + "/v1/", streams=4, max_tokens=12)
    json.dumps(result)  # JSON-ready
    assert result["model"] == MODEL
    assert result["url"] == url
    assert (result["requests"], result["completed"], result["errors"]) == (4, 4, 0)
    assert result["output_tokens"] == 48
    assert result["short_streams"] == 0
    assert result["usage_reported"] is True
    assert result["continuous_usage"] is True
    assert result["dropped_fields"] == []
    assert result["output_tok_s"] == pytest.approx(48 / result["wall_s"], rel=1e-2)
    ttft, itl = result["ttft_ms"], result["itl_ms"]
    assert ttft["median"] >= cfg.ttft * 1e3
    assert ttft["min"] <= ttft["median"] <= ttft["p99"] <= ttft["max"]
    assert itl["median"] >= cfg.itl * 1e3 * 0.9
    assert itl["median"] < ttft["median"]
    assert result["decode_tok_s_per_stream"]["median"] > 0
    assert result["prompt_tokens"]["min"] >= cfg.prompt_overhead

    measured = _measured(cfg, 12)
    assert len(measured) == 4
    for body in measured:
        assert body["stream"] is True and body["ignore_eos"] is True
        assert body["min_tokens"] == 12 and body["temperature"] == 0.0 and body["seed"] == 0
        assert body["stream_options"]["include_usage"] is True
        assert body["model"] == MODEL
    nonces = [body["prompt"].split()[0] for body in cfg.bodies]
    assert len(set(nonces)) == len(nonces)  # probes and warm-ups too: no shared prefix


def test_multi_token_chunks_divide_the_gap() -> None:
    cfg = FakeConfig(tokens_per_chunk=3, itl=0.012)
    with fake_server(cfg) as url:
        result = _bench(url, streams=2, max_tokens=12, warmup=False)
    assert result["output_tokens"] == 24
    assert result["continuous_usage"] is True
    # Each 12 ms gap carries 3 tokens: about 4 ms per token.
    assert 3.0 <= result["itl_ms"]["median"] < 12.0


def test_without_usage_falls_back_to_chunk_count() -> None:
    cfg = FakeConfig(reject=frozenset({"stream_options"}))
    with fake_server(cfg) as url:
        result = _bench(url, streams=2, max_tokens=6, warmup=False)
    assert result["dropped_fields"] == [
        "stream_options.continuous_usage_stats",
        "min_tokens",
        "stream_options",
    ]
    assert result["errors"] == 0
    assert result["usage_reported"] is False
    assert result["output_tokens"] == 12
    assert result["prompt_tokens"] is None


def test_llama_server_timings_stand_in_for_usage() -> None:
    cfg = FakeConfig(send_usage=False, send_timings=True, tokens_per_chunk=2, ttft=0.005)
    with fake_server(cfg) as url:
        result = _bench(url, streams=2, max_tokens=6, prompt_tokens=40, warmup=False)
    assert result["usage_reported"] is True and result["continuous_usage"] is False
    assert result["output_tokens"] == 12  # from predicted_n, not the 3 chunks per stream
    assert result["prompt_tokens"]["mean"] == 40


def test_rejected_optional_fields_are_dropped() -> None:
    cfg = FakeConfig(reject=frozenset({"min_tokens"}))
    with fake_server(cfg) as url:
        result = _bench(url, streams=2, max_tokens=5, warmup=False)
    assert result["dropped_fields"] == ["stream_options.continuous_usage_stats", "min_tokens"]
    assert result["errors"] == 0
    assert result["continuous_usage"] is False
    assert all("min_tokens" not in b for b in _measured(cfg, 5))


@pytest.mark.parametrize("tokens_per_word", [1, 2])
def test_prompt_tokens_calibration(tokens_per_word: int) -> None:
    cfg = FakeConfig(tokens_per_word=tokens_per_word, prompt_overhead=5, ttft=0.005)
    with fake_server(cfg) as url:
        result = _bench(url, streams=2, max_tokens=4, prompt_tokens=101, warmup=False)
    assert abs(result["prompt_tokens"]["mean"] - 101) <= tokens_per_word
    assert result["prompt_tokens_target"] == 101


def test_errors_and_short_streams_are_counted() -> None:
    cfg = FakeConfig(fail_every=2, eos_at=3, ttft=0.005)
    with fake_server(cfg) as url:
        result = _bench(url, streams=2, max_tokens=8, requests_per_stream=2, warmup=False)
    assert result["requests"] == 4
    assert result["errors"] == 2 and result["completed"] == 2
    assert any("HTTP 500" in s for s in result["error_samples"])
    assert result["short_streams"] == 2
    assert result["output_tokens"] == 6


def test_chat_endpoint_and_explicit_model() -> None:
    cfg = FakeConfig(ttft=0.005)
    with fake_server(cfg) as url:
        result = _bench(
            url,
            streams=3,
            max_tokens=4,
            endpoint="chat",
            model="other",
            extra_body={"seed": None, "top_k": 1},
        )
    assert result["model"] == "other"
    assert result["output_tokens"] == 12 and result["errors"] == 0
    body = _measured(cfg, 4)[0]
    assert body["messages"][0]["role"] == "user"
    assert "seed" not in body and body["top_k"] == 1


def test_cli_baseline_json(capsys: pytest.CaptureFixture[str]) -> None:
    fast, slow = FakeConfig(ttft=0.005, itl=0.001), FakeConfig(ttft=0.03, itl=0.004, model="smol")
    with fake_server(fast) as url, fake_server(slow) as baseline:
        code = bench.main(
            ["--url", url, "--baseline-url", baseline, "--streams", "1,3", "--max-tokens", "6", "--json"]
        )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["target"]["model"] == MODEL and report["baseline"]["model"] == "smol"
    assert [r["streams"] for r in report["target"]["runs"]] == [1, 3]
    assert [r["streams"] for r in report["baseline"]["runs"]] == [1, 3]
    assert [r["streams"] for r in report["ratios"]] == [1, 3]
    for ratio in report["ratios"]:
        assert ratio["ttft_median"] < 1.0  # the target answers faster
        assert ratio["output_tok_s"] > 1.0


@pytest.mark.parametrize(("argv", "prompt", "max_tokens", "levels"), [
    (["--workload", "ttfb"], 512, 1, [1]),
    (["--workload", "long-context"], 4000, 256, [1, 8]),
    (["--workload", "long-context", "--prompt-tokens", "60", "--max-tokens", "4", "--streams", "2"], 60, 4, [2]),
])
def test_throughput_presets(capsys: pytest.CaptureFixture[str], argv: list[str], prompt: int, max_tokens: int,
                            levels: list[int]) -> None:
    """The issue's long-context and time-to-first-byte workloads are presets of throughput; flags win."""
    with fake_server(FakeConfig(ttft=0.001, itl=0.0)) as url:
        assert bench.main(["--url", url, "--json", "--no-warmup", *argv]) == 0
    runs = json.loads(capsys.readouterr().out)["target"]["runs"]
    assert [r["streams"] for r in runs] == levels
    assert all(r["prompt_tokens_target"] == prompt and r["max_tokens"] == max_tokens for r in runs)


def test_cli_table_and_unreachable(capsys: pytest.CaptureFixture[str]) -> None:
    with fake_server(FakeConfig(ttft=0.005)) as url:
        assert bench.main(["--url", url, "--streams", "2", "--max-tokens", "3", "--no-warmup"]) == 0
    out = capsys.readouterr().out
    assert "tok/s" in out and "target" in out
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert bench.main(["--url", f"127.0.0.1:{port}", "--streams", "1", "--timeout", "5"]) == 1
    assert "cannot reach" in capsys.readouterr().err


def test_helpers() -> None:
    assert bench.base_url("localhost:8000/v1/") == "http://localhost:8000"
    assert bench.base_url("https://h/v1") == "https://h"
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert bench.percentile([5.0], 99) == 5.0
    assert bench.parse_streams("1, 8,32") == [1, 8, 32]
    prompt = make_prompt("abc", 5)
    assert prompt.startswith("abc ") and len(prompt.split()) == 6
    rec = bench.StreamRecord(t_send=0.0, chunks=[(0.1, 1), (0.2, 2), (0.3, 1)])
    assert rec.ttft == pytest.approx(0.1)
    assert rec.output_tokens == 4
    assert rec.inter_token_latencies() == pytest.approx([0.05, 0.05, 0.1])
    summary = bench.summarize([rec, bench.StreamRecord(t_send=0.0, error="x")], max_tokens=4, wall=2.0)
    assert summary["output_tok_s"] == 2.0 and summary["errors"] == 1 and summary["error_samples"] == ["x"]
    ratio = bench.ratios({"streams": 1, "output_tok_s": 10.0}, {"streams": 1, "output_tok_s": 5.0})
    assert ratio["output_tok_s"] == 2.0 and ratio["ttft_median"] is None


def test_decode_rate_counts_the_tokens_of_multi_token_chunks() -> None:
    """A speculative step sends several tokens in one chunk: without per-chunk usage the rate comes
    from the final usage (less the first chunk's token), not from the chunk count."""
    chunks = [(1.0, 1), (1.5, 1), (2.0, 1)]  # 3 chunks, 1 s apart at the ends
    plain = bench.StreamRecord(t_send=0.0, chunks=list(chunks))
    assert plain.decode_rate() == pytest.approx(2.0)  # no usage: one token per chunk
    bursts = bench.StreamRecord(t_send=0.0, chunks=list(chunks), usage_completion_tokens=9)
    assert bursts.decode_rate() == pytest.approx(8.0)
    # Per-chunk usage (vLLM's continuous_usage_stats) already counts each chunk's tokens.
    counted = bench.StreamRecord(t_send=0.0, chunks=[(1.0, 1), (1.5, 4), (2.0, 4)], usage_completion_tokens=9,
                                 continuous_usage=True)
    assert counted.decode_rate() == pytest.approx(8.0)


# ------------------------------------------------------------------- prefix-cache workloads


def _chat_bodies(cfg: FakeConfig, max_tokens: int) -> list[dict[str, Any]]:
    return [b for b in _measured(cfg, max_tokens) if "messages" in b]


def test_agent_conversation_data() -> None:
    conv = bench_cache.load_agent_conversation()
    assert conv.turns == 12
    assert {t["function"]["name"] for t in conv.tools} >= {"shell", "read_file", "apply_patch"}
    sizes = conv.rough_turn_tokens()
    assert sizes == sorted(sizes) and len(set(sizes)) == 12  # every turn adds to the history
    assert sizes[0] >= 1200  # system prompt and tool definitions
    assert 5000 <= sizes[-1] <= 7500  # grows to about 6,000 tokens
    calls = [m for m in conv.messages if m.get("tool_calls")]
    assert len(calls) == 11 and conv.messages[-1]["role"] == "assistant"
    assert all(json.loads(c["tool_calls"][0]["function"]["arguments"]) for c in calls)
    turns = [conv.turn_messages(k, "abc") for k in range(conv.turns)]
    for earlier, later in itertools.pairwise(turns):
        assert later[: len(earlier)] == earlier  # each turn resends the whole history
        assert later[len(earlier)]["role"] == "assistant"  # starting with the previous turn's answer
    assert turns[0][0]["content"].startswith("[session abc] ")
    assert turns[0][1]["role"] == "user" and len(turns[0]) == 2
    assert 1000 <= bench_cache.rough_tokens(bench_cache.load_shared_prefix()) <= 2500
    turn = bench_cache.restart_turn(conv)
    assert abs(sizes[turn] - 4000) <= 600


def test_bad_conversation_is_refused(tmp_path: Any) -> None:
    path = tmp_path / "conv.json"
    path.write_text(
        json.dumps(
            {
                "system": "s",
                "tools": [],
                "messages": [
                    {"role": "user", "content": "u"},
                    {"role": "assistant", "content": None, "tool_calls": [{"id": "a", "function": {}}]},
                    {"role": "user", "content": "too early"},
                ],
            }
        )
    )
    with pytest.raises(ValueError, match="answered"):
        bench_cache.load_agent_conversation(path)


def test_ratio_math() -> None:
    assert bench_cache.ttft_ratio([1.0, 3.0, 2.0], [0.1, 0.3, 0.2, 0.2]) == pytest.approx(0.1)
    assert bench_cache.ttft_ratio([], [0.1]) is None
    assert bench_cache.prefilled_share(1000, 850) == pytest.approx(0.15)
    assert bench_cache.prefilled_share(1000, None) is None and bench_cache.prefilled_share(0, 0) is None
    before = {"prefill_tokens": 10, "reused_tokens": 5, "host_hits": 0}
    after = {"prefill_tokens": 110, "reused_tokens": 905, "host_hits": 2}
    assert bench_cache.metrics_delta(before, after) == {
        "prefill_tokens": 100,
        "reused_tokens": 900,
        "host_hits": 2,
    }
    assert bench_cache.metrics_delta(None, after) is None
    assert bench_cache.summary_ratios(
        {"wall_s": 2.0, "x": None, "errors": 0}, {"wall_s": 8.0, "errors": 1}
    ) == {"wall_s": 0.25}
    recs = [
        bench.StreamRecord(t_send=0.0, chunks=[(0.5, 1)], usage_prompt_tokens=100, usage_cached_tokens=0),
        bench.StreamRecord(t_send=1.0, chunks=[(1.1, 1)], usage_prompt_tokens=300, usage_cached_tokens=96),
    ]
    run = bench_cache.summarize_replay(recs, 2.0, {"prefill_tokens": 204, "reused_tokens": 96})
    assert run["prompt_tokens"] == 400 and run["cached_tokens"] == 96
    assert run["prefilled_share"] == pytest.approx(0.76) and run["metrics_prefilled_share"] == pytest.approx(
        0.51
    )
    assert run["ttft_ms"] == [500.0, pytest.approx(100.0)]
    recs[1].usage_cached_tokens = None  # a server that reports no reuse: no share, not a wrong one
    assert bench_cache.summarize_replay(recs, 2.0, None)["prefilled_share"] is None
    summary = bench_cache.summarize_replays([run, {**run, "wall_s": 4.0}])
    assert summary["wall_s"] == 3.0 and summary["first_turn_ttft_ms"] == 500.0


def test_cached_tokens_from_usage_and_llama_timings(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workload", "shared-prefix", "--rounds", "1", "--warm-requests", "2", "--json"]
    for cfg in (
        FakeConfig(prefix_cache=True, ttft=0.002),
        # llama-server without usage: timings.prompt_n counts only the tokens it evaluated
        FakeConfig(prefix_cache=True, ttft=0.002, send_usage=False, send_timings=True),
    ):
        with fake_server(cfg) as url:
            assert bench.main(["--url", url, *argv]) == 0
        run = json.loads(capsys.readouterr().out)["target"]["runs"][0]
        assert run["cold_cached_tokens"] == 0
        assert run["prompt_tokens"] > 1000
        assert all(run["prompt_tokens"] - 40 < c < run["prompt_tokens"] for c in run["warm_cached_tokens"])


def test_shared_prefix_workload(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = FakeConfig(prefix_cache=True, ttft=0.002, prefill_s_per_token=0.0001)
    with fake_server(cfg) as url:
        code = bench.main(["--url", url, "--workload", "shared-prefix", "--rounds", "2", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"] == "shared-prefix" and report["endpoint"] == "chat"
    runs = report["target"]["runs"]
    assert len(runs) == 2 and all(len(r["warm_ttft_ms"]) == 4 for r in runs)
    assert all(r["cold_cached_tokens"] == 0 for r in runs)  # a fresh nonce per round: never a hit
    assert all(c > 1000 for r in runs for c in r["warm_cached_tokens"])
    summary = report["target"]["summary"]
    assert summary["warm_over_cold"] < 0.5
    assert summary["prompt_tokens"] > 1000 and summary["errors"] == 0
    bodies = _chat_bodies(cfg, 16)
    measured = bodies[-10:]  # 2 rounds x (1 cold + 4 warm), after the warm-up request
    systems = [b["messages"][0]["content"] for b in measured]
    assert len(set(systems[:5])) == 1 and len(set(systems[5:])) == 1 and systems[0] != systems[5]
    assert len({b["messages"][1]["content"] for b in measured[:5]}) == 5  # distinct questions
    assert bodies[0]["messages"][0]["content"] not in systems  # the warm-up shares nothing
    assert all(b["stream"] and b["temperature"] == 0.0 for b in measured)


def test_shared_prefix_completions_table(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = FakeConfig(prefix_cache=True, ttft=0.002)
    with fake_server(cfg) as url:
        code = bench.main(
            ["--url", url, "--workload", "shared-prefix", "--endpoint", "completions", "--rounds", "1"]
        )
    assert code == 0
    out = capsys.readouterr().out
    assert "warm/cold" in out and "completions" in out
    prompts = [b["prompt"] for b in _measured(cfg, 16)]
    assert prompts[-1].startswith("[run ") and "Question:" in prompts[-1]


def test_agent_replay_resends_history_with_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    fast = FakeConfig(prefix_cache=True, metrics=True, ttft=0.001, itl=0.0005, prefill_s_per_token=0.00002)
    slow = FakeConfig(prefix_cache=False, ttft=0.001, itl=0.0005, prefill_s_per_token=0.0001, model="smol")
    with fake_server(fast) as url, fake_server(slow) as baseline:
        code = bench.main(
            [
                "--url",
                url,
                "--baseline-url",
                baseline,
                "--workload",
                "agent-replay",
                "--rounds",
                "2",
                "--json",
            ]
        )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["turns"] == 12 and report["max_tokens"] == 32
    for cfg in (fast, slow):
        bodies = _chat_bodies(cfg, 32)
        assert len(bodies) == 24
        for replay in (bodies[:12], bodies[12:]):
            assert len({b["messages"][0]["content"] for b in replay}) == 1  # one nonce per replay
            for earlier, later in itertools.pairwise(replay):
                assert later["messages"][: len(earlier["messages"])] == earlier["messages"]
            assert all(b["tools"] and b["tools"][0]["type"] == "function" for b in replay)
        assert bodies[0]["messages"][0]["content"] != bodies[12]["messages"][0]["content"]
    target, base = report["target"], report["baseline"]
    run = target["runs"][0]
    assert len(run["ttft_ms"]) == 12 and run["errors"] == []
    assert run["prompt_tokens"] == sum(t["prompt_tokens"] for t in run["turns"])
    assert run["cached_tokens"] == sum(t["cached_tokens"] for t in run["turns"])
    assert run["prefilled_share"] == pytest.approx(1 - run["cached_tokens"] / run["prompt_tokens"], abs=1e-4)
    assert run["prefilled_share"] < 0.25  # the history is reused turn after turn
    assert run["metrics"] == {
        "prefill_tokens": run["prompt_tokens"] - run["cached_tokens"],
        "reused_tokens": run["cached_tokens"],
    }
    assert run["metrics_prefilled_share"] == pytest.approx(run["prefilled_share"], abs=1e-3)
    assert base["runs"][0]["cached_tokens"] is None and base["runs"][0]["metrics"] is None
    assert base["summary"]["prefilled_share"] is None
    assert report["ratios"]["wall_s"] < 1.0
    assert report["ratios"]["wall_s"] == pytest.approx(
        target["summary"]["wall_s"] / base["summary"]["wall_s"], abs=2e-3
    )


def test_restart_workload_two_phases(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state.json"
    cfg = FakeConfig(prefix_cache=True, ttft=0.002, prefill_s_per_token=0.0001)
    argv = ["--workload", "restart", "--rounds", "2", "--state-file", str(state), "--json"]
    with fake_server(cfg) as url:
        assert bench.main(["--url", url, *argv]) == 0
        cold = json.loads(capsys.readouterr().out)["target"]
        assert cold["phase"] == "cold" and state.exists()
        assert cold["summary"]["warm_over_cold"] < 0.5
        assert cold["summary"]["prompt_tokens"] > 1000  # words here: about 4,000 real tokens
        assert bench.main(["--url", url, *argv]) == 0
    repeat = json.loads(capsys.readouterr().out)["target"]
    assert repeat["phase"] == "repeat" and not state.exists()
    assert repeat["nonces"] == cold["nonces"]
    assert repeat["summary"]["repeat_over_cold"] < 0.5 and repeat["summary"]["cold_ttft_ms"] is not None
    bodies = _chat_bodies(cfg, 16)
    assert [b["messages"] for b in bodies[-2:]] == [b["messages"] for b in bodies[:4:2]]


def test_agent_text_format() -> None:
    conv = bench_cache.load_agent_conversation()
    assert conv.request_tools("text") is None and conv.request_tools("tools") == conv.tools
    turns = [conv.turn_messages(k, "abc", "text") for k in range(conv.turns)]
    for earlier, later in itertools.pairwise(turns):
        assert later[: len(earlier)] == earlier  # still a growing prefix
    last = turns[-1]
    assert {m["role"] for m in last} == {"system", "user", "assistant"}
    assert last[0]["content"].startswith("[session abc] ") and '{"name":"apply_patch"' in last[0]["content"]
    calls = [m["content"] for m in last if m["role"] == "assistant"]
    assert len(calls) == 11 and all("<tool_call>\n{" in c for c in calls)
    first_call = calls[0].split("<tool_call>\n", 1)[1].split("\n</tool_call>")[0]
    assert json.loads(first_call)["name"] == "shell"
    results = [m["content"] for m in last[2:] if m["role"] == "user"]
    assert len(results) == 11 and all(r.startswith("<tool_response>\n") for r in results)
    sizes = [bench_cache.rough_request_tokens(t) for t in turns]
    assert 5000 <= sizes[-1] <= 7500


def test_agent_replay_text_format_sends_no_tools(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = FakeConfig(prefix_cache=True, ttft=0.001, itl=0.0005)
    with fake_server(cfg) as url:
        argv = ["--workload", "agent-replay", "--agent-format", "text", "--rounds", "1", "--max-tokens", "4"]
        assert bench.main(["--url", url, *argv]) == 0
    assert "text format" in capsys.readouterr().out
    bodies = _chat_bodies(cfg, 4)
    assert len(bodies) == 12 and all("tools" not in b for b in bodies)
    assert all(m["role"] != "tool" for b in bodies for m in b["messages"])


# -- replaying a coding client's recorded requests ---------------------------------------------------


def _recording(tmp_path: Any, requests: list[dict[str, Any]], client: str = "opencode") -> Any:
    path = tmp_path / f"{client}.json"
    path.write_text(json.dumps({"client": client, "requests": requests}))
    return path


def test_replay_file_sends_the_recorded_requests_in_order(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    system = {"role": "system", "content": "You are opencode. " * 20}
    turns = [[system, {"role": "user", "content": "Fix calc.py please"}]]
    for i in range(3):
        turns.append([*turns[-1], {"role": "assistant", "content": f"step {i} done"},
                      {"role": "user", "content": f"result {i}"}])
    recorded = [{"path": "/v1/chat/completions",
                 "body": {"model": "scripted", "messages": m, "max_tokens": 1024, "stream": True}} for m in turns]
    path = _recording(tmp_path, recorded)
    cfg = FakeConfig(prefix_cache=True, metrics=True, ttft=0.001, itl=0.0005)
    with fake_server(cfg) as url:
        code = bench.main(["--url", url, "--workload", "agent-replay", "--replay-file", str(path), "--rounds", "1",
                           "--max-tokens", "4", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["client"], report["requests"]) == ("opencode", 4)
    warmup, *replayed = cfg.bodies[-5:]  # after the one-token probes of the setup
    assert warmup["max_tokens"] == 1 and warmup["messages"][1:] == turns[0][1:]
    nonce = replayed[0]["messages"][0]["content"][: len("[session 0123456789ab] ")]
    assert nonce.startswith("[session ") and not warmup["messages"][0]["content"].startswith(nonce)
    for sent, recorded in zip(replayed, turns, strict=True):  # one nonce for the replay, before the system text
        assert sent["messages"] == [{**recorded[0], "content": nonce + recorded[0]["content"]}, *recorded[1:]]
    assert all(b["model"] == MODEL and b["max_tokens"] == 4 and b["stream_options"] == {"include_usage": True}
               for b in replayed)
    run = report["target"]["runs"][0]
    assert [r["status"] for r in run["requests"]] == [200] * 4 and run["errors"] == []
    cached = [r["cached_tokens"] for r in run["requests"]]
    assert cached[0] == 0 and cached == sorted(cached) and cached[1] > 0  # a cold start, then reuse
    assert run["prompt_tokens"] == sum(r["prompt_tokens"] for r in run["requests"])
    assert run["prefilled_tokens"] == run["prompt_tokens"] - run["cached_tokens"]  # the server's own count
    assert report["target"]["summary"]["wall_s"] == run["wall_s"]


def test_replay_body_sets_the_model_and_each_routes_output_limit() -> None:
    body = {"model": "scripted", "input": [], "stream": True}
    responses = bench_cache.replay_body(bench_cache.RecordedRequest("/v1/responses", body), "smol", 8)
    assert responses == {"model": "smol", "input": [], "stream": True, "max_output_tokens": 8}
    assert body == {"model": "scripted", "input": [], "stream": True}  # the recording is left alone
    messages = bench_cache.RecordedRequest("/v1/messages?beta=true", {"model": "x", "max_tokens": 1024})
    assert bench_cache.replay_body(messages, "smol", 8) == {"model": "smol", "max_tokens": 8}
    assert bench_cache.replay_body(messages, "smol", None) == {"model": "smol", "max_tokens": 1024}
    chat = bench_cache.RecordedRequest("/v1/chat/completions", {"model": "x", "max_completion_tokens": 5})
    assert bench_cache.replay_body(chat, "smol", 8) == {"model": "smol", "max_tokens": 8}


@pytest.mark.parametrize(("path", "body", "expected"), [
    ("/v1/messages", {"system": [{"type": "text", "text": "You are Claude Code."}], "messages": []},
     {"system": [{"type": "text", "text": "[session n] You are Claude Code."}], "messages": []}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]},
     {"messages": [{"role": "user", "content": "[session n] hi"}]}),
    ("/v1/responses", {"instructions": "Be Codex.", "input": "hi"}, {"instructions": "[session n] Be Codex.",
                                                                    "input": "hi"}),
    ("/v1/responses", {"input": [{"role": "developer", "content": [{"type": "input_text", "text": "Be Codex."}]}]},
     {"input": [{"role": "developer", "content": [{"type": "input_text", "text": "[session n] Be Codex."}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be OpenCode."}]},
     {"messages": [{"role": "system", "content": "[session n] Be OpenCode."}]}),
])
def test_replay_nonce_starts_the_prompt(path: str, body: dict[str, Any], expected: dict[str, Any]) -> None:
    sent = bench_cache.replay_body(bench_cache.RecordedRequest(path, body), "m", None, "n")
    assert sent == {"model": "m", **expected}


def test_response_usage_reads_every_protocol() -> None:
    def sse(*events: dict[str, Any]) -> bytes:
        return "".join(f"event: {e.get('type', 'x')}\ndata: {json.dumps(e)}\n\n" for e in events).encode()

    responses = sse({"type": "response.created", "response": {"usage": None}},
                    {"type": "response.completed", "response": {"usage": {
                        "input_tokens": 2753, "input_tokens_details": {"cached_tokens": 2700}, "output_tokens": 35}}})
    assert bench_cache.response_usage(responses) == bench_cache.ResponseUsage(2753, 2700, 35)
    messages = sse({"type": "message_start", "message": {"usage": {
                        "input_tokens": 66, "cache_read_input_tokens": 16816, "cache_creation_input_tokens": 0,
                        "output_tokens": 1}}},
                   {"type": "message_delta", "usage": {"output_tokens": 51}})
    assert bench_cache.response_usage(messages) == bench_cache.ResponseUsage(16882, 16816, 51)
    chat = (b'data: {"choices": [{"delta": {"content": "x"}}], "usage": null}\n\n'
            b'data: {"choices": [], "usage": {"prompt_tokens": 5429, "completion_tokens": 28, '
            b'"prompt_tokens_details": {"cached_tokens": 5376}}}\n\ndata: [DONE]\n\n')
    assert bench_cache.response_usage(chat) == bench_cache.ResponseUsage(5429, 5376, 28)
    body = json.dumps({"usage": {"input_tokens": 12, "output_tokens": 3}}).encode()
    assert bench_cache.response_usage(body) == bench_cache.ResponseUsage(12, None, 3)
    assert bench_cache.response_usage(b"not json") == bench_cache.ResponseUsage()


def test_recordings_are_checked_and_llama_metrics_read(tmp_path: Any) -> None:
    ok = _recording(tmp_path, [{"path": "/v1/messages?beta=true", "body": {"model": "m"}}], "claude")
    assert bench_cache.load_recording(ok).requests[0].path == "/v1/messages?beta=true"
    for bad in ([], [{"path": "/v1/models", "body": {}}], [{"path": "/v1/responses"}]):
        with pytest.raises(ValueError):
            bench_cache.load_recording(_recording(tmp_path, bad))
    text = ("# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n"
            "# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 1234\n"
            "llamacpp:tokens_predicted_total 56\nllamacpp:requests_processing 0\n")
    assert bench_cache.parse_prometheus_counters(text) == {"prefill_tokens": 1234, "generated_tokens": 56}
