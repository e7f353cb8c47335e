"""One streamed OpenAI-compatible request and what it did: the piece every `helios bench` workload
shares (bench.py's throughput runs, bench_cache.py's prefix-cache workloads, bench_edit.py's
editing workload). A request body (`build_body`: a nonce-led prompt with filler words, EOS
suppressed where the server accepts it), one timed stream (`stream_once` -> `StreamRecord`), the
model a server serves (`discover_model`), and `_Target`, one server under test with its negotiated
optional fields and calibrated filler length.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import trio

if TYPE_CHECKING:
    import httpx

Endpoint = Literal["completions", "chat"]
ENDPOINTS: tuple[Endpoint, ...] = ("completions", "chat")
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
