"""Benchmark client for any OpenAI-compatible streaming server (Helios, llama-server, vLLM, ...).

Drives N concurrent streaming requests against ``/v1/completions`` or ``/v1/chat/completions`` and
reports output throughput, time to first token and inter-token latency. Every prompt starts with a
random nonce so no prefix cache can hit, and EOS is suppressed (``ignore_eos`` plus ``min_tokens``)
so every stream yields exactly ``max_tokens`` tokens; ``short_streams`` in the result counts the
streams where the server did not honour that.

Before measuring, a few one-token probes (a) find which optional request fields the server accepts
(a 400/422 drops ``stream_options.continuous_usage_stats``, then ``min_tokens``, then
``stream_options``), (b) calibrate the filler length so the prompt is about ``prompt_tokens`` tokens
long by the server's own usage count, and (c) a short round at full concurrency warms the server up.

Run ``python -m helios.clients.bench --url http://127.0.0.1:8000 --streams 1,8`` (``helios bench`` once
hooked into the CLI). ``--baseline-url`` runs the same workload against a second server, level by
level and never concurrently, and adds target/baseline ratios (machines are noisy: compare ratios).

``--workload shared-prefix | agent-replay | restart`` runs the prefix-cache workloads of
:mod:`helios.clients.bench_cache` instead, which share prefixes on purpose; ``--workload editing`` runs
:mod:`helios.clients.bench_edit` (one stream repeats a ~1,100-token source file with a few edits: the case
prompt-lookup speculation is for).
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast

import trio

if TYPE_CHECKING:
    import httpx

Endpoint = Literal["completions", "chat"]
ENDPOINTS: tuple[Endpoint, ...] = ("completions", "chat")
# "throughput" is this module's workload; the others are bench_cache's prefix-cache workloads.
WORKLOADS: tuple[str, ...] = ("throughput", "long-context", "ttfb", "shared-prefix", "agent-replay", "restart")
# Presets of the throughput workload (issue 11's targets): (prompt tokens, output tokens, stream levels).
# Flags given on the command line override them.
THROUGHPUT_PRESETS: dict[str, tuple[int, int, list[int]]] = {
    "long-context": (4000, 256, [1, 8]),  # decode over a ~4,000-token history
    "ttfb": (512, 1, [1]),  # time to first byte of a 512-token prompt
}

# Optional request features, in the order they are dropped when the server rejects the request.
_CONTINUOUS_USAGE = "stream_options.continuous_usage_stats"
_MIN_TOKENS = "min_tokens"
_STREAM_OPTIONS = "stream_options"
_OPTIONAL_FEATURES: tuple[str, ...] = (_CONTINUOUS_USAGE, _MIN_TOKENS, _STREAM_OPTIONS)

# Common English words that are one token (with their leading space) in the usual BPE vocabularies;
# the calibration probe measures the real tokens-per-word anyway.
_FILLER_WORDS: tuple[str, ...] = tuple(
    (
        "time year people way day man thing woman life child world school state family student group "
        "country problem hand part place case week company system program question work number night "
        "point home water room mother area money story fact month right study book eye job word business "
        "side kind head house service friend father power hour game line end member law car city name "
        "team minute idea body back parent face level office door health person art war history party "
        "result change morning reason research girl moment air teacher force education"
    ).split()
)
_DEFAULT_TASK = "Write a long story about a lighthouse keeper who finds a map in a bottle."
_GUESSED_OVERHEAD = 8  # prompt tokens besides the filler when the server reports no usage
_WARMUP_TOKENS = 8
_ERROR_SAMPLES = 5


class BenchError(Exception):
    """The benchmark could not start: server unreachable, no model listed, bad arguments."""


def _nonce() -> str:
    return secrets.token_hex(6)


def make_prompt(nonce: str, filler_words: int | None) -> str:
    """The nonce first (defeats prefix caches), then a fixed task or ``filler_words`` filler words."""
    if filler_words is None:
        return f"{nonce} {_DEFAULT_TASK}"
    words = (_FILLER_WORDS[i % len(_FILLER_WORDS)] for i in range(max(filler_words, 0)))
    return f"{nonce} " + " ".join(words)


def base_url(url: str) -> str:
    """``host:port``, ``http://host:port/`` and ``http://host:port/v1`` all name the same server."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    return url


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def build_body(
    endpoint: Endpoint,
    model: str,
    prompt: str,
    max_tokens: int,
    *,
    features: frozenset[str] = frozenset(_OPTIONAL_FEATURES),
    seed: int = 0,
    extra_body: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A greedy streaming request with EOS suppressed; ``extra_body`` keys set to None are removed."""
    body: dict[str, Any] = {"model": model}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body.update(max_tokens=max_tokens, temperature=0.0, seed=seed, stream=True, ignore_eos=True)
    if _MIN_TOKENS in features:
        body["min_tokens"] = max_tokens
    if _STREAM_OPTIONS in features:
        options: dict[str, Any] = {"include_usage": True}
        if _CONTINUOUS_USAGE in features:
            options["continuous_usage_stats"] = True
        body["stream_options"] = options
    return merge_extra_body(body, extra_body)


def merge_extra_body(body: dict[str, Any], extra_body: Mapping[str, Any] | None) -> dict[str, Any]:
    """``extra_body`` merged into ``body`` in place: a key set to None is removed."""
    for key, value in (extra_body or {}).items():
        if value is None:
            body.pop(key, None)
        else:
            body[key] = value
    return body


@dataclass
class StreamRecord:
    """What one streaming request did, with ``time.perf_counter`` timestamps."""

    t_send: float
    t_end: float = 0.0
    status: int | None = None
    error: str | None = None
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens) per content chunk
    usage_completion_tokens: int | None = None
    usage_prompt_tokens: int | None = None
    usage_cached_tokens: int | None = None  # prompt tokens the server reused from its prefix cache
    continuous_usage: bool = False
    finish_reason: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunks[0][0] - self.t_send if self.chunks else None

    @property
    def output_tokens(self) -> int:
        if self.usage_completion_tokens is not None:
            return self.usage_completion_tokens
        return sum(n for _, n in self.chunks)

    def inter_token_latencies(self) -> list[float]:
        """Gap between consecutive content chunks divided by that chunk's tokens, once per token."""
        out: list[float] = []
        for (t_prev, _), (t_cur, n) in zip(self.chunks, self.chunks[1:], strict=False):
            n = max(n, 1)
            out.extend([(t_cur - t_prev) / n] * n)
        return out

    def decode_rate(self) -> float | None:
        """Tokens per second after the first content chunk.

        Without per-chunk usage a chunk counts as one token, but a chunk may carry several (a
        speculative step commits several tokens at once, and servers send them as one chunk): when
        the final usage reports more tokens than that, the tokens after the first chunk are the
        usage's total less one (the first chunk is the first step's one token)."""
        if len(self.chunks) < 2:
            return None
        span = self.chunks[-1][0] - self.chunks[0][0]
        tokens = sum(max(n, 1) for _, n in self.chunks[1:])
        if not self.continuous_usage and self.usage_completion_tokens is not None:
            tokens = max(tokens, self.usage_completion_tokens - 1)
        return tokens / span if span > 0 else None


def _chunk_text(obj: Mapping[str, Any], endpoint: Endpoint) -> str:
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    if endpoint == "chat":
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return ""
        parts = [delta.get(key) for key in ("content", "reasoning_content", "reasoning")]
        calls = delta.get("tool_calls")
        if isinstance(calls, list):  # a tool call's name and argument text count as output too
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict):
                    parts.extend(function.get(key) for key in ("name", "arguments"))
        return "".join(p for p in parts if isinstance(p, str))
    text = choice.get("text")
    return text if isinstance(text, str) else ""


def _finish_reason(obj: Mapping[str, Any]) -> str | None:
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        reason = choices[0].get("finish_reason")
        return reason if isinstance(reason, str) else None
    return None


async def stream_once(
    client: httpx.AsyncClient,
    url: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    endpoint: Endpoint,
    timeout: float,
) -> StreamRecord:
    """Send one streaming request and time its content chunks; never raises for server trouble."""
    import httpx

    rec = StreamRecord(t_send=time.perf_counter())
    try:
        with trio.fail_after(timeout):
            async with client.stream("POST", url, json=body, headers=headers) as resp:
                rec.status = resp.status_code
                if resp.status_code != 200:
                    text = (await resp.aread()).decode("utf-8", errors="replace")
                    rec.error = f"HTTP {resp.status_code}: {text.strip()[:300]}"
                    return rec
                await _read_events(resp, rec, endpoint)
    except trio.TooSlowError:
        rec.error = f"timed out after {timeout:g} s"
    except httpx.HTTPError as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    finally:
        rec.t_end = time.perf_counter()
    return rec


async def _read_events(resp: httpx.Response, rec: StreamRecord, endpoint: Endpoint) -> None:
    seen_completion = 0
    done = False
    timing_prompt: Any = None
    timing_cached: Any = None
    timing_completion: Any = None
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            done = True
            break
        now = time.perf_counter()
        try:
            obj = json.loads(data)
        except ValueError:
            rec.error = f"malformed SSE data: {data[:200]}"
            return
        if not isinstance(obj, dict):
            continue
        if obj.get("error"):
            rec.error = f"stream error: {json.dumps(obj['error'])[:300]}"
            return
        timings = obj.get("timings")  # llama-server's own counters, used when it sends no usage
        if isinstance(timings, dict):
            timing_prompt = timings.get("prompt_n")  # tokens evaluated, without cache_n
            timing_cached = timings.get("cache_n")
            timing_completion = timings.get("predicted_n")
        delta_tokens: int | None = None
        usage = obj.get("usage")
        if isinstance(usage, dict):
            completion = usage.get("completion_tokens")
            prompt = usage.get("prompt_tokens")
            if isinstance(prompt, int):
                rec.usage_prompt_tokens = prompt
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                rec.usage_cached_tokens = details["cached_tokens"]
            if isinstance(completion, int):
                delta_tokens = completion - seen_completion
                seen_completion = max(seen_completion, completion)
                rec.usage_completion_tokens = completion
        text = _chunk_text(obj, endpoint)
        if text:
            if delta_tokens is not None and delta_tokens > 0:
                rec.continuous_usage = True
                rec.chunks.append((now, delta_tokens))
            else:
                rec.chunks.append((now, 1))
        reason = _finish_reason(obj)
        if reason is not None:
            rec.finish_reason = reason
    if not done and rec.error is None and not rec.chunks:
        rec.error = "stream ended without data"
    cached = timing_cached if isinstance(timing_cached, int) else None
    if rec.usage_prompt_tokens is None and isinstance(timing_prompt, int):
        rec.usage_prompt_tokens = timing_prompt + (cached or 0)
    if rec.usage_cached_tokens is None and cached is not None:
        rec.usage_cached_tokens = cached
    if rec.usage_completion_tokens is None and isinstance(timing_completion, int):
        rec.usage_completion_tokens = timing_completion


async def discover_model(client: httpx.AsyncClient, base: str, api_key: str | None) -> str:
    """The first model ``/v1/models`` lists."""
    import httpx

    try:
        resp = await client.get(f"{base}/v1/models", headers=_headers(api_key))
    except httpx.HTTPError as exc:
        raise BenchError(f"cannot reach {base}/v1/models: {type(exc).__name__}: {exc}") from exc
    if resp.status_code != 200:
        raise BenchError(f"{base}/v1/models answered HTTP {resp.status_code}: {resp.text[:200]}")
    try:
        data = resp.json().get("data")
        model = data[0]["id"]
    except (ValueError, AttributeError, LookupError, TypeError) as exc:
        raise BenchError(f"{base}/v1/models lists no model: {resp.text[:200]}") from exc
    if not isinstance(model, str):
        raise BenchError(f"{base}/v1/models lists a model id that is not a string: {model!r}")
    return model


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, ``q`` in [0, 100] (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _ms_stats(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "median": round(statistics.median(values) * 1e3, 3),
        "p99": round(percentile(values, 99) * 1e3, 3),
        "mean": round(statistics.fmean(values) * 1e3, 3),
        "min": round(min(values) * 1e3, 3),
        "max": round(max(values) * 1e3, 3),
    }


@dataclass
class _Setup:
    features: frozenset[str]
    dropped: list[str]
    filler_words: int | None
    probe_prompt_tokens: int | None


class _Target:
    """One server under test: its client, URL, model and request options."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        base: str,
        model: str,
        api_key: str | None,
        endpoint: Endpoint,
        timeout: float,
        seed: int,
        extra_body: Mapping[str, Any] | None,
    ) -> None:
        self.client = client
        self.model = model
        self.endpoint = endpoint
        self.timeout = timeout
        self.seed = seed
        self.extra_body = extra_body
        self.headers = _headers(api_key)
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        self.url = base + path

    async def request(
        self, filler_words: int | None, max_tokens: int, features: frozenset[str]
    ) -> StreamRecord:
        prompt = make_prompt(_nonce(), filler_words)
        body = build_body(
            self.endpoint,
            self.model,
            prompt,
            max_tokens,
            features=features,
            seed=self.seed,
            extra_body=self.extra_body,
        )
        return await stream_once(self.client, self.url, body, self.headers, self.endpoint, self.timeout)

    async def prepare(self, prompt_tokens: int | None) -> _Setup:
        """Negotiate optional fields and calibrate the filler length with one-token probes."""
        features = frozenset(_OPTIONAL_FEATURES)
        dropped: list[str] = []
        first_words = None if prompt_tokens is None else 0
        rec = await self.request(first_words, 1, features)
        for feature in _OPTIONAL_FEATURES:
            if rec.status not in (400, 422):
                break
            features = features - {feature}
            dropped.append(feature)
            rec = await self.request(first_words, 1, features)
        if rec.error is not None:
            # Not a field problem (or nothing helped): measure with the full request and let the
            # run's error count show what is wrong.
            features, dropped = frozenset(_OPTIONAL_FEATURES), []
        if prompt_tokens is None:
            return _Setup(features, dropped, None, rec.usage_prompt_tokens)
        overhead = rec.usage_prompt_tokens
        if overhead is None:
            return _Setup(features, dropped, max(prompt_tokens - _GUESSED_OVERHEAD, 0), None)
        trial = max(prompt_tokens - overhead, 1)
        rec2 = await self.request(trial, 1, features)
        measured = rec2.usage_prompt_tokens
        if measured is None or measured <= overhead:
            return _Setup(features, dropped, trial, measured)
        per_word = (measured - overhead) / trial
        words = max(round((prompt_tokens - overhead) / per_word), 0)
        if words == trial:
            return _Setup(features, dropped, words, measured)
        rec3 = await self.request(words, 1, features)
        return _Setup(features, dropped, words, rec3.usage_prompt_tokens)


async def run_bench(
    url: str,
    *,
    streams: int,
    max_tokens: int = 256,
    prompt_tokens: int | None = None,
    model: str | None = None,
    api_key: str | None = None,
    endpoint: Endpoint = "completions",
    requests_per_stream: int = 1,
    timeout: float = 600,
    warmup: bool = True,
    seed: int = 0,
    extra_body: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Run ``streams`` concurrent workers, each sending ``requests_per_stream`` streaming requests
    one after another, and return the measurements as a JSON-ready dict. Runs under trio.

    Raises BenchError when the server cannot be reached for model discovery or arguments are bad;
    request failures during the run are counted in ``errors`` instead.
    """
    import httpx

    if streams < 1 or max_tokens < 1 or requests_per_stream < 1:
        raise BenchError("streams, max_tokens and requests_per_stream must be at least 1")
    if prompt_tokens is not None and prompt_tokens < 1:
        raise BenchError("prompt_tokens must be at least 1")
    if endpoint not in ENDPOINTS:
        raise BenchError(f"endpoint must be one of {ENDPOINTS}, not {endpoint!r}")
    base = base_url(url)
    pool = streams + 4
    limits = httpx.Limits(max_connections=pool, max_keepalive_connections=pool)
    http_timeout = httpx.Timeout(timeout, connect=min(timeout, 30.0))
    # trust_env=False: benchmark the server directly, never through an environment proxy.
    async with httpx.AsyncClient(limits=limits, timeout=http_timeout, trust_env=False) as client:
        if model is None:
            model = await discover_model(client, base, api_key)
        target = _Target(client, base, model, api_key, endpoint, timeout, seed, extra_body)
        setup = await target.prepare(prompt_tokens)
        if warmup:
            async with trio.open_nursery() as nursery:
                for _ in range(streams):
                    nursery.start_soon(
                        target.request, setup.filler_words, min(max_tokens, _WARMUP_TOKENS), setup.features
                    )

        records: list[StreamRecord] = []

        async def worker() -> None:
            for _ in range(requests_per_stream):
                records.append(await target.request(setup.filler_words, max_tokens, setup.features))

        t_start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(streams):
                nursery.start_soon(worker)
        t_stop = time.perf_counter()

    result = summarize(records, max_tokens=max_tokens, wall=t_stop - t_start)
    result = {
        "url": base,
        "endpoint": endpoint,
        "model": model,
        "streams": streams,
        "requests_per_stream": requests_per_stream,
        "max_tokens": max_tokens,
        "prompt_tokens_target": prompt_tokens,
        "prompt_filler_words": setup.filler_words,
        "dropped_fields": setup.dropped,
        **result,
    }
    return result


def summarize(records: Sequence[StreamRecord], *, max_tokens: int, wall: float) -> dict[str, Any]:
    """Aggregate stream records; ``wall`` runs from the first request sent to the last stream done."""
    ok = [r for r in records if r.error is None]
    failed = [r for r in records if r.error is not None]
    samples: list[str] = []
    for r in failed:
        if r.error is not None and r.error not in samples:
            samples.append(r.error)
        if len(samples) >= _ERROR_SAMPLES:
            break
    output_tokens = sum(r.output_tokens for r in ok)
    ttfts = [t for r in ok if (t := r.ttft) is not None]
    itls = [x for r in ok for x in r.inter_token_latencies()]
    rates = [x for r in ok if (x := r.decode_rate()) is not None]
    prompts = [r.usage_prompt_tokens for r in ok if r.usage_prompt_tokens is not None]
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": len(failed),
        "error_samples": samples,
        "short_streams": sum(1 for r in ok if r.output_tokens < max_tokens),
        "wall_s": round(wall, 4),
        "output_tokens": output_tokens,
        "output_tok_s": round(output_tokens / wall, 3) if wall > 0 else None,
        "prompt_tokens": (
            {"mean": round(statistics.fmean(prompts), 1), "min": min(prompts), "max": max(prompts)}
            if prompts
            else None
        ),
        "ttft_ms": _ms_stats(ttfts),
        "itl_ms": _ms_stats(itls),
        "decode_tok_s_per_stream": (
            {
                "median": round(statistics.median(rates), 3),
                "min": round(min(rates), 3),
                "max": round(max(rates), 3),
            }
            if rates
            else None
        ),
        "usage_reported": bool(ok) and all(r.usage_completion_tokens is not None for r in ok),
        "continuous_usage": bool(ok) and all(r.continuous_usage for r in ok),
    }


# --------------------------------------------------------------------------------------------- CLI

_RATIO_KEYS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("output_tok_s", ("output_tok_s",)),
    ("ttft_median", ("ttft_ms", "median")),
    ("ttft_p99", ("ttft_ms", "p99")),
    ("itl_median", ("itl_ms", "median")),
    ("itl_p99", ("itl_ms", "p99")),
)


def _dig(result: Mapping[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = result
    for key in path:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return float(value) if isinstance(value, int | float) else None


def ratios(target: Mapping[str, Any], baseline: Mapping[str, Any]) -> dict[str, Any]:
    """target / baseline for throughput (higher is better) and latencies (lower is better)."""
    out: dict[str, Any] = {"streams": target.get("streams")}
    for name, path in _RATIO_KEYS:
        t, b = _dig(target, path), _dig(baseline, path)
        out[name] = round(t / b, 3) if t is not None and b else None
    return out


def parse_streams(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--streams wants integers like 1,8,32, not {text!r}") from exc
    if not levels or any(n < 1 for n in levels):
        raise argparse.ArgumentTypeError(f"--streams wants positive integers like 1,8,32, not {text!r}")
    return levels


def _parse_json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--extra-body wants a JSON object")
    return cast(dict[str, Any], value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``helios bench`` flags, for a subcommand parser."""
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--workload",
        choices=(*WORKLOADS, "editing"),
        default="throughput",
        help="throughput (default: concurrent streams, no prefix shared); long-context (throughput with a "
        "~4,000-token prompt, 256 tokens, 1 and 8 streams); ttfb (a 512-token prompt, one token, one stream); "
        "shared-prefix (cold vs warm TTFT "
        "of a ~1,500-token shared prefix); agent-replay (a recorded 12-turn agent session, each turn "
        "resending the history); restart (a ~4,000-token prompt cold, then again after a server restart: "
        "run twice with --state-file); editing (one stream repeats a ~1,100-token source file with three "
        "edits, greedy: speculative decoding's case; --rounds, default 2; --max-tokens, default 1400)",
    )
    parser.add_argument(
        "--streams",
        type=parse_streams,
        default=None,
        help="comma-separated concurrency levels, run one after another (default 1,8,32; long-context 1,8; "
        "ttfb 1)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="output tokens per request (default 256; shared-prefix 16, agent-replay 32, restart 16)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="approximate prompt length in tokens (default: short task)",
    )
    parser.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    parser.add_argument("--api-key", default=None, help="bearer token for --url")
    parser.add_argument(
        "--endpoint",
        choices=ENDPOINTS,
        default=None,
        help="API to drive (default completions; shared-prefix: chat; agent-replay and restart are chat only)",
    )
    parser.add_argument(
        "--requests-per-stream", type=int, default=1, help="sequential requests per concurrent stream"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed sent with every request")
    parser.add_argument(
        "--extra-body",
        type=_parse_json_object,
        default=None,
        help="JSON object merged into every request body; null removes a key, e.g. '{\"min_tokens\": null}'",
    )
    parser.add_argument("--no-warmup", action="store_true", help="skip the short warm-up round per level")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="shared-prefix rounds (fresh prefix each, default 3), agent replays (default 2), "
        "restart prompts (default 3)",
    )
    parser.add_argument(
        "--agent-format",
        choices=("tools", "text"),
        default="tools",
        help="agent-replay and restart: send OpenAI tools (default), or write tools and calls into the "
        "messages as <tool_call>/<tool_response> text, for servers whose template drops tools",
    )
    parser.add_argument(
        "--replay-file",
        default=None,
        help="agent-replay: replay a coding client's recorded requests (JSON: client, requests of path "
        "and body; tests/server/test_coding_clients.py writes them) on their own routes instead of the "
        "built-in session",
    )
    parser.add_argument(
        "--warm-requests",
        type=int,
        default=4,
        help="shared-prefix: warm requests after each round's cold one (default 4)",
    )
    parser.add_argument(
        "--state-file",
        default="helios-bench-restart.json",
        help="restart: where the cold phase leaves its nonces and TTFTs for the repeat phase",
    )
    parser.add_argument("--baseline-url", default=None, help="second server to run the same workload on")
    parser.add_argument("--baseline-model", default=None, help="model name on the baseline server")
    parser.add_argument("--baseline-api-key", default=None, help="bearer token for --baseline-url")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="helios bench", description="Benchmark an OpenAI-compatible streaming server."
    )
    add_arguments(parser)
    return parser


async def _bench_all(args: argparse.Namespace) -> dict[str, Any]:
    servers: list[tuple[str, str, str | None, str | None]] = [("target", args.url, args.model, args.api_key)]
    if args.baseline_url:
        servers.append(("baseline", args.baseline_url, args.baseline_model, args.baseline_api_key))
    report: dict[str, Any] = {}
    for role, url, _, _ in servers:
        report[role] = {"url": base_url(url), "model": None, "runs": []}
    for level in args.streams:
        # Target then baseline at each level, so both see the machine in about the same state.
        for role, url, model, api_key in servers:
            entry = report[role]
            _progress(f"{role} {entry['url']}: {level} stream(s) x {args.max_tokens} tokens ...")
            result = await run_bench(
                url,
                streams=level,
                max_tokens=args.max_tokens,
                prompt_tokens=args.prompt_tokens,
                model=entry["model"] or model,
                api_key=api_key,
                endpoint=args.endpoint,
                requests_per_stream=args.requests_per_stream,
                timeout=args.timeout,
                warmup=not args.no_warmup,
                seed=args.seed,
                extra_body=args.extra_body,
            )
            entry["model"] = result["model"]
            entry["runs"].append(result)
            _progress(_row(role, result))
    if args.baseline_url:
        report["ratios"] = [
            ratios(t, b) for t, b in zip(report["target"]["runs"], report["baseline"]["runs"], strict=True)
        ]
    return report


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


_HEADER = (
    f"{'server':<9}{'streams':>8}{'tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}"
    f"{'ITL p50':>9}{'ITL p99':>9}{'prompt':>8}{'errors':>8}"
)


def _row(role: str, result: Mapping[str, Any]) -> str:
    prompt = _dig(result, ("prompt_tokens", "mean"))
    return (
        f"{role:<9}{result['streams']:>8}{_fmt(_dig(result, ('output_tok_s',))):>10}"
        f"{_fmt(_dig(result, ('ttft_ms', 'median'))):>10}{_fmt(_dig(result, ('ttft_ms', 'p99'))):>10}"
        f"{_fmt(_dig(result, ('itl_ms', 'median')), '.2f'):>9}{_fmt(_dig(result, ('itl_ms', 'p99')), '.2f'):>9}"
        f"{_fmt(prompt, '.0f'):>8}{result['errors']:>8}"
    )


def format_table(report: Mapping[str, Any]) -> str:
    """A human-readable table: milliseconds for latencies, ratios as target / baseline."""
    lines = [f"target:   {report['target']['url']} (model {report['target']['model']})"]
    if "baseline" in report:
        lines.append(f"baseline: {report['baseline']['url']} (model {report['baseline']['model']})")
    lines.append("latencies in ms; ratio = target / baseline (tok/s: higher is better, latency: lower)")
    lines.append(_HEADER)
    baseline_runs = report["baseline"]["runs"] if "baseline" in report else []
    for i, run in enumerate(report["target"]["runs"]):
        lines.append(_row("target", run))
        if i < len(baseline_runs):
            lines.append(_row("baseline", baseline_runs[i]))
            r = report["ratios"][i]
            lines.append(
                f"{'ratio':<9}{'':>8}{_fmt(r['output_tok_s'], '.2f'):>10}{_fmt(r['ttft_median'], '.2f'):>10}"
                f"{_fmt(r['ttft_p99'], '.2f'):>10}{_fmt(r['itl_median'], '.2f'):>9}{_fmt(r['itl_p99'], '.2f'):>9}"
            )
    for role in ("target", "baseline"):
        for run in report.get(role, {}).get("runs", []):
            if run["short_streams"]:
                lines.append(
                    f"warning: {role} at {run['streams']} stream(s): {run['short_streams']} stream(s) "
                    f"ended before {run['max_tokens']} tokens (EOS not suppressed?)"
                )
            for sample in run["error_samples"]:
                lines.append(f"error: {role} at {run['streams']} stream(s): {sample}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``helios bench``: 0 when every request succeeded, 1 on request errors or a failed start."""
    return run_cli(build_parser().parse_args(argv))


def run_cli(args: argparse.Namespace) -> int:
    """Run parsed ``add_arguments`` flags (for a ``helios`` subcommand parser); same codes as main."""
    from helios.clients import bench_cache

    if args.workload == "editing":
        return _run_editing(args)
    preset = THROUGHPUT_PRESETS.get(args.workload)
    if preset is not None:
        prompt_tokens, max_tokens, streams = preset
        args.workload = "throughput"
        args.prompt_tokens = prompt_tokens if args.prompt_tokens is None else args.prompt_tokens
        args.max_tokens = max_tokens if args.max_tokens is None else args.max_tokens
        args.streams = streams if args.streams is None else args.streams
    if args.streams is None:
        args.streams = [1, 8, 32]
    if args.max_tokens is None:
        args.max_tokens = bench_cache.DEFAULT_MAX_TOKENS[args.workload]
    if args.rounds is None:
        args.rounds = bench_cache.DEFAULT_ROUNDS.get(args.workload, 1)
    if args.endpoint is None:
        args.endpoint = "completions" if args.workload == "throughput" else "chat"
    for flag, value in (
        ("--max-tokens", args.max_tokens),
        ("--requests-per-stream", args.requests_per_stream),
        ("--rounds", args.rounds),
        ("--warm-requests", args.warm_requests),
    ):
        if value < 1:
            print(f"helios bench: {flag} must be at least 1", file=sys.stderr)
            return 2
    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        print("helios bench: --prompt-tokens must be at least 1", file=sys.stderr)
        return 2
    if args.workload in bench_cache.CACHE_WORKLOADS:
        try:
            cache_report = trio.run(bench_cache.run_workload, args)
        except (BenchError, ValueError, OSError) as exc:
            print(f"helios bench: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
        text = json.dumps(cache_report, indent=2) if args.json else bench_cache.format_report(cache_report)
        print(text, flush=True)
        return 1 if bench_cache.count_errors(cache_report) else 0
    try:
        report = trio.run(_bench_all, args)
    except BenchError as exc:
        print(f"helios bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(json.dumps(report, indent=2) if args.json else format_table(report), flush=True)
    errors = sum(
        run["errors"] for role in ("target", "baseline") for run in report.get(role, {}).get("runs", [])
    )
    return 1 if errors else 0


def _run_editing(args: argparse.Namespace) -> int:
    from helios.clients import bench_edit

    args.max_tokens = bench_edit.DEFAULT_MAX_TOKENS if args.max_tokens is None else args.max_tokens
    args.rounds = bench_edit.DEFAULT_ROUNDS if args.rounds is None else args.rounds
    if args.max_tokens < 1 or args.rounds < 1:
        print("helios bench: --max-tokens and --rounds must be at least 1", file=sys.stderr)
        return 2
    try:
        report = trio.run(bench_edit.run_workload, args)
    except BenchError as exc:
        print(f"helios bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(json.dumps(report, indent=2) if args.json else bench_edit.format_report(report), flush=True)
    return 1 if bench_edit.count_errors(report) else 0


if __name__ == "__main__":
    sys.exit(main())
