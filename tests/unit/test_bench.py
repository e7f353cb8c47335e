"""helios.bench against a tiny in-process OpenAI-compatible SSE server (plain trio sockets)."""

from __future__ import annotations

import contextlib
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

from helios import bench

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
    prompt = body["messages"][0]["content"] if chat else body["prompt"]
    prompt_tokens = len(prompt.split()) * cfg.tokens_per_word + cfg.prompt_overhead
    total = body["max_tokens"] if cfg.eos_at is None else min(cfg.eos_at, body["max_tokens"])
    options = body.get("stream_options") or {}
    continuous = cfg.send_usage and bool(options.get("continuous_usage_stats"))
    await stream.send_all(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
        b"Connection: close\r\n\r\n"
    )
    await trio.sleep(cfg.ttft)
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
            chunk["timings"] = {"prompt_n": prompt_tokens, "predicted_n": total, "predicted_ms": 1.0}
        if continuous:
            chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": sent}
        await stream.send_all(f"data: {json.dumps(chunk)}\n\n".encode())
        if not done:
            await trio.sleep(cfg.itl)
    if cfg.send_usage and options.get("include_usage"):
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": total,
            "total_tokens": prompt_tokens + total,
        }
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
    prompt = bench.make_prompt("abc", 5)
    assert prompt.startswith("abc ") and len(prompt.split()) == 6
    rec = bench.StreamRecord(t_send=0.0, chunks=[(0.1, 1), (0.2, 2), (0.3, 1)])
    assert rec.ttft == pytest.approx(0.1)
    assert rec.output_tokens == 4
    assert rec.inter_token_latencies() == pytest.approx([0.05, 0.05, 0.1])
    summary = bench.summarize([rec, bench.StreamRecord(t_send=0.0, error="x")], max_tokens=4, wall=2.0)
    assert summary["output_tok_s"] == 2.0 and summary["errors"] == 1 and summary["error_samples"] == ["x"]
    ratio = bench.ratios({"streams": 1, "output_tok_s": 10.0}, {"streams": 1, "output_tok_s": 5.0})
    assert ratio["output_tok_s"] == 2.0 and ratio["ttft_median"] is None
