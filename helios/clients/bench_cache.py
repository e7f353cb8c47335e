"""Prefix-cache workloads for ``helios bench``: ``shared-prefix``, ``agent-replay`` and ``restart``.

These complement the throughput workload of :mod:`helios.clients.bench` (which defeats every prefix cache)
by measuring what a prefix cache saves. They drive any OpenAI-compatible server with streamed,
greedy requests, one at a time; with ``--baseline-url`` the same rounds alternate between the two
servers, never concurrently.

- ``shared-prefix``: a fixed ~1,500-token document (``bench_data/shared_prefix.txt``) as the system
  prompt, then a short distinct question per request. Each round starts the document with a fresh
  random nonce, so a round never hits an earlier round's (or run's) cache, while the requests of
  one round share it: the first is cold, the rest are warm. Reports median cold and warm TTFT and
  warm / cold.
- ``agent-replay``: a recorded 12-turn coding-agent session with tool calls
  (``bench_data/agent_replay.json``). Turn k sends the system prompt, the tools and every message
  before the k-th assistant message as one Chat Completions request, as Codex and OpenCode do. The
  system prompt starts with a fresh nonce per replay. Reports the replay's wall time, per-turn TTFT,
  the prompt tokens sent, the tokens the server says it reused (``cached_tokens``; llama-server's
  ``timings.cache_n`` when it sends no usage details) and the share actually prefilled, plus the
  ``prefill_tokens``/``reused_tokens`` deltas of ``/metrics?format=json`` where the server has them.
  With ``--replay-file`` it replays a coding client's recorded requests instead
  (:class:`Recording`: what ``tests/server/test_coding_clients.py`` writes with
  ``HELIOS_CLIENT_RECORD_DIR``): each request is sent as the client sent it, to its own route
  (Responses, Messages or Chat Completions), with the server's model name, the output limit set
  to ``--max-tokens`` and a fresh nonce starting the prompt per replay (each replay starts cold,
  as the client's session did). Reports the replay's wall time, each request's prompt and cached tokens from
  the response's usage, and the tokens each server says it prefilled: Helios's
  ``/metrics?format=json`` ``prefill_tokens``, llama-server's ``llamacpp:prompt_tokens_total``
  (``--metrics``).
- ``restart``: a ~4,000-token prompt (the agent session's turn of about that size) sent cold, then,
  in a second invocation after the server was restarted with the same disk store, sent again. The
  first invocation stores the nonces and cold TTFTs in ``--state-file``; the second reads them and
  reports the first repeat's TTFT against the cold one.

EOS is suppressed where the server accepts it (as in :mod:`helios.clients.bench`) so both servers decode
the same number of tokens per request.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from helios.clients.stream import (
    BenchError,
    Endpoint,
    StreamRecord,
    _Setup,
    _Target,
    base_url,
    build_body,
    discover_model,
    stream_once,
)

if TYPE_CHECKING:
    import httpx

CACHE_WORKLOADS: tuple[str, ...] = ("long-context", "ttfb", "shared-prefix", "agent-replay", "restart")
DEFAULT_MAX_TOKENS: dict[str, int] = {
    "throughput": 256,
    "shared-prefix": 16,
    "agent-replay": 32,
    "restart": 16,
}
DEFAULT_ROUNDS: dict[str, int] = {"shared-prefix": 3, "agent-replay": 2, "restart": 3}
DEFAULT_WARM_REQUESTS = 4
RESTART_PROMPT_TOKENS = 4000
METRIC_KEYS: tuple[str, ...] = (
    "prefill_tokens",
    "reused_tokens",
    "generated_tokens",
    "host_hits",
    "host_reused_tokens",
    "host_bytes_in",
)

DATA_DIR = Path(__file__).with_name("bench_data")
SHARED_PREFIX_FILE = DATA_DIR / "shared_prefix.txt"
AGENT_REPLAY_FILE = DATA_DIR / "agent_replay.json"

# Short, distinct questions about the shared document: one per request of a round.
QUESTIONS: tuple[str, ...] = (
    "Until what time must an express parcel be handed over to count for the same day?",
    "What is the heaviest parcel Tidewater accepts?",
    "Which depots accept dangerous goods?",
    "What does damage code D2 mean?",
    "How long does an undeliverable parcel wait at the depot?",
    "When is the Rotterdam depot open?",
    "Within how many days must a customer claim for damage?",
    "What is the liability limit for express shipments?",
    "How much does the express surcharge cost?",
    "Where can customers pay in cash?",
    "How long are camera recordings kept?",
    "How long may a line-haul driver drive in one day?",
    "Who owns the section on customer claims?",
    "When does an incident owner write the review?",
)


def new_nonce() -> str:
    return secrets.token_hex(6)


def rough_tokens(value: Any) -> int:
    """A rough token count (about 3.3 characters per token for prose, code and JSON alike)."""
    text = value if isinstance(value, str) else json.dumps(value)
    return round(len(text) / 3.3)


def rough_request_tokens(messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None) -> int:
    """A rough prompt size of a chat request: tool definitions, message texts, tool calls, framing."""
    total = rough_tokens(list(tools)) if tools else 0
    for message in messages:
        total += 4 + rough_tokens(message.get("content") or "")
        for call in message.get("tool_calls") or []:
            total += rough_tokens(call.get("function", {}))
    return total


# ------------------------------------------------------------------------------------------- data


def load_shared_prefix(path: Path = SHARED_PREFIX_FILE) -> str:
    return path.read_text(encoding="utf-8").strip()


def shared_prefix_messages(nonce: str, document: str, question: str) -> list[dict[str, Any]]:
    """The nonce starts the shared system prompt: one round shares it, other rounds never do."""
    return [
        {"role": "system", "content": f"[run {nonce}]\n{document}"},
        {"role": "user", "content": question},
    ]


def shared_prefix_prompt(nonce: str, document: str, question: str) -> str:
    """The Completions form of :func:`shared_prefix_messages`."""
    return f"[run {nonce}]\n{document}\n\nQuestion: {question}\nAnswer:"


@dataclass(frozen=True)
class AgentConversation:
    """A recorded agent session: system prompt, OpenAI tool definitions, and the messages."""

    system: str
    tools: list[dict[str, Any]]
    messages: list[dict[str, Any]]

    @property
    def turn_starts(self) -> list[int]:
        """Index into ``messages`` of each assistant message: turn k sends everything before it."""
        return [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]

    @property
    def turns(self) -> int:
        return len(self.turn_starts)

    def turn_messages(self, turn: int, nonce: str, fmt: str = "tools") -> list[dict[str, Any]]:
        """The whole history turn ``turn`` (0-based) resends, the system prompt starting with the nonce.

        ``fmt="text"`` writes the tools and the calls into the messages (:func:`tools_as_text`), for
        servers whose chat template drops OpenAI tools; the request then carries no ``tools``.
        """
        end = self.turn_starts[turn]
        system = {"role": "system", "content": f"[session {nonce}] {self.system}"}
        messages = [system, *(json.loads(json.dumps(m)) for m in self.messages[:end])]
        return tools_as_text(messages, self.tools) if fmt == "text" else messages

    def request_tools(self, fmt: str = "tools") -> list[dict[str, Any]] | None:
        return self.tools if fmt == "tools" else None

    def rough_turn_tokens(self) -> list[int]:
        return [rough_request_tokens(self.turn_messages(k, "0" * 12), self.tools) for k in range(self.turns)]


AGENT_FORMATS: tuple[str, ...] = ("tools", "text")
_TOOLS_HEAD = (
    "# Tools\n\nYou can call the functions listed below. Each line inside <tools></tools> describes "
    "one function as JSON.\n<tools>"
)
_TOOLS_TAIL = (
    "</tools>\n\nTo call a function, write a <tool_call></tool_call> block holding one JSON object "
    'with its name and arguments:\n<tool_call>\n{"name": "function_name", "arguments": {}}\n</tool_call>\n'
    "Results come back inside <tool_response></tool_response> blocks."
)


def tools_as_text(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The conversation with tools written as text (Hermes style): the tool list closes the system
    prompt, calls become ``<tool_call>`` blocks after the assistant's text, and each run of tool
    results becomes one user message of ``<tool_response>`` blocks. Every server then sees the same
    prompt text, whatever its template does with OpenAI tools."""
    listing = "\n".join(json.dumps(t.get("function", t), separators=(",", ":")) for t in tools)
    out: list[dict[str, Any]] = []
    results = False  # the last message out is a run of tool results
    for i, message in enumerate(messages):
        role, content = message["role"], message.get("content") or ""
        if i == 0 and role == "system":
            out.append({"role": "system", "content": f"{content}\n\n{_TOOLS_HEAD}\n{listing}\n{_TOOLS_TAIL}"})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if results:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            results = True
            continue
        elif role == "assistant" and message.get("tool_calls"):
            blocks = []
            for call in message["tool_calls"]:
                function = call["function"]
                arguments = json.loads(function["arguments"] or "{}")
                blocks.append(
                    f"<tool_call>\n{json.dumps({'name': function['name'], 'arguments': arguments})}\n</tool_call>"
                )
            text = "\n".join(blocks)
            out.append({"role": "assistant", "content": f"{content}\n{text}" if content else text})
        else:
            out.append({"role": role, "content": content})
        results = False
    return out


def load_agent_conversation(path: Path = AGENT_REPLAY_FILE) -> AgentConversation:
    """Load and check the recorded session: every tool call is answered by the next tool messages."""
    raw = json.loads(path.read_text(encoding="utf-8"))
    system, tools, messages = raw.get("system"), raw.get("tools"), raw.get("messages")
    if not isinstance(system, str) or not isinstance(tools, list) or not isinstance(messages, list):
        raise ValueError(f"{path}: wants a system string, a tools list and a messages list")
    pending: list[str] = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "tool":
            if not pending or message.get("tool_call_id") != pending.pop(0):
                raise ValueError(f"{path}: message {i} answers no pending tool call")
            continue
        if pending:
            raise ValueError(f"{path}: message {i} comes before tool calls {pending} were answered")
        if role not in ("user", "assistant"):
            raise ValueError(f"{path}: message {i} has role {role!r}")
        pending = [call["id"] for call in message.get("tool_calls") or []]
    if not any(m.get("role") == "assistant" for m in messages):
        raise ValueError(f"{path}: no assistant turn")
    return AgentConversation(system, tools, messages)


def restart_turn(conversation: AgentConversation, target_tokens: int = RESTART_PROMPT_TOKENS) -> int:
    """The turn whose prompt is roughly closest to ``target_tokens``."""
    sizes = conversation.rough_turn_tokens()
    return min(range(len(sizes)), key=lambda k: abs(sizes[k] - target_tokens))


def chat_body(
    model: str,
    messages: Sequence[Mapping[str, Any]],
    max_tokens: int,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    features: frozenset[str],
    seed: int = 0,
    extra_body: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A greedy streaming Chat Completions request with these messages (and tools)."""
    body = build_body("chat", model, "", max_tokens, features=features, seed=seed, extra_body=extra_body)
    body["messages"] = [dict(m) for m in messages]
    if tools:
        body["tools"] = [dict(t) for t in tools]
    return body


# ---------------------------------------------------------------------------------- client replays


@dataclass(frozen=True)
class RecordedRequest:
    """One request a coding client sent: its route (with any query) and its JSON body."""

    path: str
    body: dict[str, Any]


@dataclass(frozen=True)
class Recording:
    """A coding client's requests during one task, in the order it sent them."""

    client: str
    requests: list[RecordedRequest]


REPLAY_ROUTES: tuple[str, ...] = ("/v1/chat/completions", "/v1/responses", "/v1/messages")


def load_recording(path: Path) -> Recording:
    """``{"client": str, "requests": [{"path": str, "body": {...}}, ...]}``; only generation routes."""
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(raw, dict) or not isinstance(raw.get("requests"), list):
        raise ValueError(f"{path}: wants an object with a requests list")
    requests = []
    for i, item in enumerate(raw["requests"]):
        if not isinstance(item, dict) or not isinstance(item.get("path"), str) or not isinstance(item.get("body"), dict):
            raise ValueError(f"{path}: request {i} wants a path string and a body object")
        if item["path"].split("?")[0] not in REPLAY_ROUTES:
            raise ValueError(f"{path}: request {i} goes to {item['path']}, not one of {', '.join(REPLAY_ROUTES)}")
        requests.append(RecordedRequest(item["path"], item["body"]))
    if not requests:
        raise ValueError(f"{path}: no requests")
    return Recording(str(raw.get("client") or Path(path).stem), requests)


def replay_body(
    request: RecordedRequest, model: str, max_tokens: int | None, nonce: str | None = None
) -> dict[str, Any]:
    """The recorded body for another server: its model name, the output limit in the route's own
    field (when given), usage asked for on a streamed Chat Completions request, and ``[session
    nonce]`` at the start of the prompt (when given), so that a replay shares no prefix with an
    earlier one while its requests share theirs as the client's did."""
    body = json.loads(json.dumps(request.body))
    body["model"] = model
    route = request.path.split("?")[0]
    if route == "/v1/chat/completions":
        if max_tokens is not None:
            body.pop("max_completion_tokens", None)
            body["max_tokens"] = max_tokens
        if body.get("stream"):
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    elif max_tokens is not None:
        body["max_output_tokens" if route == "/v1/responses" else "max_tokens"] = max_tokens
    if nonce is not None:
        _prefix_prompt(body, route, f"[session {nonce}] ")
    return body


def _prefix_prompt(body: dict[str, Any], route: str, prefix: str) -> None:
    """Put ``prefix`` before the first text of the prompt: Messages' ``system``, Responses'
    ``instructions``, else the first message's (or input item's) first text."""
    first_key = {"/v1/messages": "system", "/v1/responses": "instructions"}.get(route)
    if first_key and body.get(first_key):
        holder: Any = body
        key: Any = first_key
    else:
        items = body.get("input" if route == "/v1/responses" else "messages")
        if isinstance(items, str):
            body["input"] = prefix + items
            return
        if not isinstance(items, list) or not items or not isinstance(items[0], dict):
            return
        holder, key = items[0], "content"
    value = holder.get(key)
    if isinstance(value, str):
        holder[key] = prefix + value
        return
    for part in value if isinstance(value, list) else []:
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            part["text"] = prefix + part["text"]
            return


@dataclass
class ResponseUsage:
    """Token counts a response reported, whatever its protocol (None where it said nothing)."""

    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int | None = None

    def absorb(self, usage: Mapping[str, Any]) -> None:
        """One ``usage`` object: Chat Completions, Responses or Anthropic Messages (whose
        ``input_tokens`` leave out the cache reads and writes)."""

        def num(key: str, within: Mapping[str, Any] = usage) -> int | None:
            value = within.get(key)
            return value if isinstance(value, int) else None

        if "prompt_tokens" in usage:
            self.prompt_tokens = num("prompt_tokens")
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and num("cached_tokens", details) is not None:
                self.cached_tokens = num("cached_tokens", details)
        elif "cache_read_input_tokens" in usage or "cache_creation_input_tokens" in usage:
            parts = [num(k) for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")]
            self.prompt_tokens = sum(p or 0 for p in parts)
            self.cached_tokens = parts[1] or 0
        elif num("input_tokens") is not None:
            self.prompt_tokens = num("input_tokens")
            details = usage.get("input_tokens_details")
            if isinstance(details, dict) and num("cached_tokens", details) is not None:
                self.cached_tokens = num("cached_tokens", details)
        output = num("completion_tokens") if "completion_tokens" in usage else num("output_tokens")
        if output is not None:
            self.output_tokens = output


def _usage_objects(obj: Any) -> Iterator[Mapping[str, Any]]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key == "usage" and isinstance(value, dict):
                yield value
            else:
                yield from _usage_objects(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from _usage_objects(value)


def response_usage(payload: bytes | str) -> ResponseUsage:
    """The usage a response reported: a JSON body, or the last counts of a server-sent event stream."""
    text = payload.decode("utf-8", errors="replace") if isinstance(payload, bytes) else payload
    objects: list[Any] = []
    if text.lstrip().startswith("{"):
        try:
            objects.append(json.loads(text))
        except ValueError:
            pass
    else:
        for line in text.splitlines():
            data = line[len("data:"):].strip() if line.startswith("data:") else ""
            if data and data != "[DONE]":
                try:
                    objects.append(json.loads(data))
                except ValueError:
                    continue
    usage = ResponseUsage()
    for obj in objects:
        for found in _usage_objects(obj):
            usage.absorb(found)
    return usage


@dataclass
class ReplayRecord:
    status: int | None
    seconds: float
    usage: ResponseUsage
    error: str | None = None


async def _post_recorded(
    client: httpx.AsyncClient, url: str, body: Mapping[str, Any], headers: Mapping[str, str], timeout: float
) -> ReplayRecord:
    """Send one recorded request and read its whole answer (a stream or one body)."""
    import httpx
    import trio

    t0 = time.perf_counter()
    status: int | None = None
    try:
        with trio.fail_after(timeout):
            async with client.stream("POST", url, json=body, headers=headers) as resp:
                status = resp.status_code
                payload = await resp.aread()
    except trio.TooSlowError:
        return ReplayRecord(status, time.perf_counter() - t0, ResponseUsage(), f"timed out after {timeout:g} s")
    except httpx.HTTPError as exc:
        return ReplayRecord(status, time.perf_counter() - t0, ResponseUsage(), f"{type(exc).__name__}: {exc}")
    seconds = time.perf_counter() - t0
    error = None if status == 200 else f"HTTP {status}: {payload.decode('utf-8', errors='replace')[:300]}"
    if error is None and any(f"event: {e}".encode() in payload for e in ("error", "response.failed")):
        error = f"stream error: {payload.decode('utf-8', errors='replace')[-300:]}"
    return ReplayRecord(status, seconds, response_usage(payload), error)


def summarize_recorded(
    records: Sequence[ReplayRecord], wall: float, metrics: Mapping[str, int] | None
) -> dict[str, Any]:
    """One replay of a recording: wall time, per-request figures, totals, and the server's own
    count of prefilled tokens where it has one."""
    prompt = _sum_or_none([r.usage.prompt_tokens for r in records])
    cached = _sum_or_none([r.usage.cached_tokens for r in records])
    prefilled = metrics.get("prefill_tokens") if metrics else None
    return {
        "wall_s": round(wall, 3),
        "requests": [
            {
                "seconds": round(r.seconds, 3),
                "status": r.status,
                "prompt_tokens": r.usage.prompt_tokens,
                "cached_tokens": r.usage.cached_tokens,
                "output_tokens": r.usage.output_tokens,
                "error": r.error,
            }
            for r in records
        ],
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefilled_share": prefilled_share(prompt, cached),
        "prefilled_tokens": prefilled,
        "output_tokens": _sum_or_none([r.usage.output_tokens for r in records]),
        "metrics": dict(metrics) if metrics is not None else None,
        "errors": [r.error for r in records if r.error is not None],
    }


def summarize_recorded_replays(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians over replays of a recording."""

    def med(key: str) -> float | None:
        return median([r[key] for r in runs if r[key] is not None])

    return {
        "wall_s": med("wall_s"),
        "prompt_tokens": med("prompt_tokens"),
        "cached_tokens": med("cached_tokens"),
        "prefilled_share": med("prefilled_share"),
        "prefilled_tokens": med("prefilled_tokens"),
        "output_tokens": med("output_tokens"),
        "errors": sum(len(r["errors"]) for r in runs),
    }


def parse_prometheus_counters(text: str) -> dict[str, int]:
    """llama-server's ``/metrics`` (``--metrics``) as the JSON snapshot's names: prompt tokens it
    evaluated (``prefill_tokens``) and tokens it generated."""
    names = {"llamacpp:prompt_tokens_total": "prefill_tokens", "llamacpp:tokens_predicted_total": "generated_tokens"}
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in names:
            try:
                out[names[parts[0]]] = int(float(parts[1]))
            except ValueError:
                continue
    return out


# ------------------------------------------------------------------------------------------- math


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(numerator: float | None, denominator: float | None, digits: int = 3) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, digits)


def ttft_ratio(cold: Sequence[float], warm: Sequence[float]) -> float | None:
    """Median warm TTFT over median cold TTFT."""
    return ratio(median(warm), median(cold))


def prefilled_share(prompt_tokens: int | None, cached_tokens: int | None) -> float | None:
    """The share of the prompt tokens sent that the server actually prefilled: 1 - cached/prompt."""
    if prompt_tokens is None or cached_tokens is None or prompt_tokens <= 0:
        return None
    return round(1.0 - cached_tokens / prompt_tokens, 4)


def metrics_delta(before: Mapping[str, Any] | None, after: Mapping[str, Any] | None) -> dict[str, int] | None:
    """Counter increases between two ``/metrics?format=json`` snapshots (None without both)."""
    if before is None or after is None:
        return None
    out: dict[str, int] = {}
    for key in METRIC_KEYS:
        a, b = before.get(key), after.get(key)
        if isinstance(a, int) and isinstance(b, int):
            out[key] = b - a
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


def _sum_or_none(values: Sequence[int | None]) -> int | None:
    return None if not values or any(v is None for v in values) else sum(v for v in values if v is not None)


def _errors(records: Sequence[StreamRecord]) -> list[str]:
    return [r.error for r in records if r.error is not None]


def summarize_shared_round(cold: StreamRecord, warm: Sequence[StreamRecord]) -> dict[str, Any]:
    """One shared-prefix round: the cold request, then the warm ones sharing its prefix."""
    warm_ttfts = [t for r in warm if r.error is None and (t := r.ttft) is not None]
    cold_ttft = cold.ttft if cold.error is None else None
    return {
        "cold_ttft_ms": _ms(cold_ttft),
        "warm_ttft_ms": [_ms(t) for t in warm_ttfts],
        "warm_over_cold": ttft_ratio([cold_ttft] if cold_ttft is not None else [], warm_ttfts),
        "prompt_tokens": cold.usage_prompt_tokens,
        "cold_cached_tokens": cold.usage_cached_tokens,
        "warm_cached_tokens": [r.usage_cached_tokens for r in warm],
        "errors": _errors([cold, *warm]),
    }


def summarize_shared(rounds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians over rounds: cold TTFT (one per round), warm TTFT (all warm requests), and warm / cold."""
    cold = [r["cold_ttft_ms"] for r in rounds if r["cold_ttft_ms"] is not None]
    warm = [t for r in rounds for t in r["warm_ttft_ms"]]
    cached = [c for r in rounds for c in r["warm_cached_tokens"] if c is not None]
    prompts = [r["prompt_tokens"] for r in rounds if r["prompt_tokens"] is not None]
    return {
        "cold_ttft_ms": median(cold),
        "warm_ttft_ms": median(warm),
        "warm_over_cold": ttft_ratio(cold, warm),
        "prompt_tokens": median(prompts),
        "warm_cached_tokens": median(cached),
        "errors": sum(len(r["errors"]) for r in rounds),
    }


def summarize_replay(
    records: Sequence[StreamRecord], wall: float, metrics: Mapping[str, int] | None
) -> dict[str, Any]:
    """One replay: wall time, per-turn figures, totals and the share of the prompt tokens prefilled."""
    prompt = _sum_or_none([r.usage_prompt_tokens for r in records])
    cached = _sum_or_none([r.usage_cached_tokens for r in records])
    metric_share = None
    if metrics and prompt and "prefill_tokens" in metrics:
        metric_share = round(metrics["prefill_tokens"] / prompt, 4)
    return {
        "wall_s": round(wall, 3),
        "turns": [
            {
                "ttft_ms": _ms(r.ttft),
                "prompt_tokens": r.usage_prompt_tokens,
                "cached_tokens": r.usage_cached_tokens,
                "output_tokens": r.output_tokens if r.error is None else None,
                "error": r.error,
            }
            for r in records
        ],
        "ttft_ms": [_ms(r.ttft) for r in records],
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefilled_share": prefilled_share(prompt, cached),
        "output_tokens": sum(r.output_tokens for r in records if r.error is None),
        "metrics": dict(metrics) if metrics is not None else None,
        "metrics_prefilled_share": metric_share,
        "errors": _errors(records),
    }


def summarize_replays(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians over replays."""

    def med(key: str) -> float | None:
        return median([r[key] for r in runs if r[key] is not None])

    first = [t for r in runs if (t := r["ttft_ms"][0]) is not None] if runs else []
    later = [t for r in runs for t in r["ttft_ms"][1:] if t is not None]
    return {
        "wall_s": med("wall_s"),
        "prompt_tokens": med("prompt_tokens"),
        "cached_tokens": med("cached_tokens"),
        "prefilled_share": med("prefilled_share"),
        "metrics_prefilled_share": med("metrics_prefilled_share"),
        "first_turn_ttft_ms": median(first),
        "later_turn_ttft_ms": median(later),
        "output_tokens": med("output_tokens"),
        "errors": sum(len(r["errors"]) for r in runs),
    }


# ---------------------------------------------------------------------------------------- servers


@dataclass
class _Server:
    role: str
    url: str
    model: str | None
    api_key: str | None
    endpoint: Endpoint = "chat"
    target: _Target | None = None
    setup: _Setup | None = None
    runs: list[dict[str, Any]] = field(default_factory=list)

    async def open(self, client: httpx.AsyncClient, args: argparse.Namespace) -> None:
        """Discover the model and negotiate the optional fields (short one-token probes)."""
        base = base_url(self.url)
        self.url = base
        if self.model is None:
            self.model = await discover_model(client, base, self.api_key)
        self.target = _Target(
            client, base, self.model, self.api_key, self.endpoint, args.timeout, args.seed, args.extra_body
        )
        self.setup = await self.target.prepare(None)

    async def send(self, body: Mapping[str, Any]) -> StreamRecord:
        assert self.target is not None
        t = self.target
        return await stream_once(t.client, t.url, body, t.headers, t.endpoint, t.timeout)

    async def send_recorded(
        self, request: RecordedRequest, max_tokens: int | None, nonce: str | None = None
    ) -> ReplayRecord:
        assert self.target is not None and self.model is not None
        headers = {**self.target.headers, "anthropic-version": "2023-06-01"}
        body = replay_body(request, self.model, max_tokens, nonce)
        return await _post_recorded(self.target.client, self.url + request.path, body, headers, self.target.timeout)

    def chat(
        self, messages: Sequence[Mapping[str, Any]], max_tokens: int, tools: Any = None
    ) -> dict[str, Any]:
        assert self.target is not None and self.setup is not None and self.model is not None
        return chat_body(
            self.model,
            messages,
            max_tokens,
            tools=tools,
            features=self.setup.features,
            seed=self.target.seed,
            extra_body=self.target.extra_body,
        )

    def shared_body(self, nonce: str, document: str, question: str, max_tokens: int) -> dict[str, Any]:
        if self.endpoint == "chat":
            return self.chat(shared_prefix_messages(nonce, document, question), max_tokens)
        assert self.target is not None and self.setup is not None and self.model is not None
        return build_body(
            "completions",
            self.model,
            shared_prefix_prompt(nonce, document, question),
            max_tokens,
            features=self.setup.features,
            seed=self.target.seed,
            extra_body=self.target.extra_body,
        )

    async def metrics(self) -> dict[str, Any] | None:
        """``/metrics?format=json`` when the server has it (Helios); None otherwise."""
        import httpx

        assert self.target is not None
        try:
            resp = await self.target.client.get(
                f"{self.url}/metrics", params={"format": "json"}, headers=self.target.headers
            )
            if resp.status_code != 200:
                return None
            if "json" not in resp.headers.get("content-type", ""):
                counters = parse_prometheus_counters(resp.text)  # llama-server --metrics
                return dict(counters) if "prefill_tokens" in counters else None
            data = resp.json()
        except (httpx.HTTPError, ValueError):
            return None
        if not isinstance(data, dict) or not isinstance(data.get("prefill_tokens"), int):
            return None
        return data

    def describe(self) -> dict[str, Any]:
        dropped = self.setup.dropped if self.setup else []
        return {"url": self.url, "model": self.model, "dropped_fields": dropped, "runs": self.runs}


def _progress(text: str) -> None:
    import sys

    print(text, file=sys.stderr, flush=True)


async def _shared_round(
    server: _Server, document: str, warm_requests: int, max_tokens: int
) -> dict[str, Any]:
    nonce = new_nonce()
    cold = await server.send(server.shared_body(nonce, document, QUESTIONS[0], max_tokens))
    warm = []
    for i in range(1, warm_requests + 1):
        question = QUESTIONS[i % len(QUESTIONS)]
        warm.append(await server.send(server.shared_body(nonce, document, question, max_tokens)))
    return summarize_shared_round(cold, warm)


async def _replay(
    server: _Server, conversation: AgentConversation, max_tokens: int, fmt: str
) -> dict[str, Any]:
    nonce = new_nonce()
    before = await server.metrics()
    records: list[StreamRecord] = []
    t_start = time.perf_counter()
    for turn in range(conversation.turns):
        messages = conversation.turn_messages(turn, nonce, fmt)
        records.append(await server.send(server.chat(messages, max_tokens, conversation.request_tools(fmt))))
    wall = time.perf_counter() - t_start
    after = await server.metrics()
    return summarize_replay(records, wall, metrics_delta(before, after))


async def _replay_recorded(server: _Server, recording: Recording, max_tokens: int | None) -> dict[str, Any]:
    assert server.target is not None and server.model is not None
    headers = {**server.target.headers, "anthropic-version": "2023-06-01"}
    nonce = new_nonce()
    before = await server.metrics()
    records: list[ReplayRecord] = []
    t_start = time.perf_counter()
    for request in recording.requests:
        body = replay_body(request, server.model, max_tokens, nonce)
        records.append(
            await _post_recorded(server.target.client, server.url + request.path, body, headers, server.target.timeout)
        )
    wall = time.perf_counter() - t_start
    after = await server.metrics()
    return summarize_recorded(records, wall, metrics_delta(before, after))


def _server_list(args: argparse.Namespace) -> list[_Server]:
    endpoint: Endpoint = args.endpoint if args.workload == "shared-prefix" else "chat"
    servers = [_Server("target", args.url, args.model, args.api_key, endpoint)]
    if args.baseline_url:
        servers.append(
            _Server("baseline", args.baseline_url, args.baseline_model, args.baseline_api_key, endpoint)
        )
    return servers


def _client(args: argparse.Namespace) -> httpx.AsyncClient:
    import httpx

    http_timeout = httpx.Timeout(args.timeout, connect=min(args.timeout, 30.0))
    limits = httpx.Limits(max_connections=4, max_keepalive_connections=4)
    return httpx.AsyncClient(limits=limits, timeout=http_timeout, trust_env=False)


async def run_workload(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``args.workload`` (one of CACHE_WORKLOADS) and return a JSON-ready report."""
    if args.workload == "restart":
        return await _run_restart(args)
    servers = _server_list(args)
    max_tokens: int = args.max_tokens
    rounds: int = args.rounds
    report: dict[str, Any] = {"workload": args.workload, "max_tokens": max_tokens, "rounds": rounds}
    summarize: Callable[[Sequence[Mapping[str, Any]]], dict[str, Any]]
    async with _client(args) as client:
        for server in servers:
            await server.open(client, args)
        if args.workload == "shared-prefix":
            document = load_shared_prefix()
            report["warm_requests"] = args.warm_requests
            report["endpoint"] = servers[0].endpoint
            if not args.no_warmup:  # same shapes, a throwaway nonce: shares nothing with the rounds
                for server in servers:
                    await server.send(server.shared_body(new_nonce(), document, QUESTIONS[-1], max_tokens))
            for r in range(rounds):  # alternate servers round by round: both see the same machine
                for server in servers:
                    _progress(f"{server.role} {server.url}: shared-prefix round {r + 1}/{rounds} ...")
                    server.runs.append(await _shared_round(server, document, args.warm_requests, max_tokens))
            summarize = summarize_shared
        elif getattr(args, "replay_file", None):
            recording = load_recording(Path(args.replay_file))
            report["replay_file"] = str(args.replay_file)
            report["client"] = recording.client
            report["requests"] = len(recording.requests)
            if not args.no_warmup:  # the first request for one token, with a nonce no replay shares
                for server in servers:
                    await server.send_recorded(recording.requests[0], 1, new_nonce())
            for r in range(rounds):
                for server in servers:
                    _progress(f"{server.role} {server.url}: {recording.client} replay {r + 1}/{rounds} ...")
                    server.runs.append(await _replay_recorded(server, recording, max_tokens))
            summarize = summarize_recorded_replays
        else:
            conversation = load_agent_conversation()
            report["turns"] = conversation.turns
            report["agent_format"] = fmt = args.agent_format
            if not args.no_warmup:
                for server in servers:
                    warmup = conversation.turn_messages(0, new_nonce(), fmt)
                    await server.send(server.chat(warmup, 1, conversation.request_tools(fmt)))
            for r in range(rounds):
                for server in servers:
                    _progress(f"{server.role} {server.url}: agent replay {r + 1}/{rounds} ...")
                    server.runs.append(await _replay(server, conversation, max_tokens, fmt))
            summarize = summarize_replays
    for server in servers:
        report[server.role] = {**server.describe(), "summary": summarize(server.runs)}
    if len(servers) == 2:
        report["ratios"] = summary_ratios(report["target"]["summary"], report["baseline"]["summary"])
    return report


def summary_ratios(target: Mapping[str, Any], baseline: Mapping[str, Any]) -> dict[str, float | None]:
    """target / baseline for every numeric summary field both servers report."""
    out: dict[str, float | None] = {}
    for key, value in target.items():
        other = baseline.get(key)
        if key != "errors" and isinstance(value, int | float) and isinstance(other, int | float):
            out[key] = ratio(float(value), float(other))
    return out


# ---------------------------------------------------------------------------------------- restart


def _load_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except ValueError as exc:
        raise BenchError(f"{path} is not a restart state file: {exc}") from exc
    return state if isinstance(state, dict) else {}


async def _run_restart(args: argparse.Namespace) -> dict[str, Any]:
    """Cold phase (no state for the server): cold and in-memory warm TTFT of ``--rounds`` prompts of
    about 4,000 tokens, nonces saved. Repeat phase (state found): the same prompts once each, on the
    restarted server; the state is then cleared so the next invocation starts a new cold phase."""
    path = Path(args.state_file)
    state = _load_state(path)
    conversation = load_agent_conversation()
    turn = restart_turn(conversation)
    servers = _server_list(args)
    fmt: str = args.agent_format
    tools = conversation.request_tools(fmt)
    report: dict[str, Any] = {
        "workload": "restart",
        "state_file": str(path),
        "max_tokens": args.max_tokens,
        "agent_format": fmt,
    }
    async with _client(args) as client:
        for server in servers:
            await server.open(client, args)
            saved = state.get(server.role)
            if not isinstance(saved, dict) or saved.get("url") != server.url:
                saved = None
            if not args.no_warmup:
                await server.send(server.chat(conversation.turn_messages(turn, new_nonce(), fmt), 1, tools))
            before = await server.metrics()
            if saved is None:
                nonces = [new_nonce() for _ in range(args.rounds)]
                cold, warm = [], []
                for nonce in nonces:
                    _progress(f"{server.role} {server.url}: restart workload, cold prompt ...")
                    body = server.chat(conversation.turn_messages(turn, nonce, fmt), args.max_tokens, tools)
                    cold.append(await server.send(body))
                    warm.append(await server.send(body))
                entry = {
                    "phase": "cold",
                    "url": server.url,
                    "nonces": nonces,
                    "turn": turn,
                    "agent_format": fmt,
                    "prompt_tokens": [r.usage_prompt_tokens for r in cold],
                    "cold_ttft_ms": [_ms(r.ttft) for r in cold],
                    "warm_ttft_ms": [_ms(r.ttft) for r in warm],
                    "warm_cached_tokens": [r.usage_cached_tokens for r in warm],
                    "errors": _errors([*cold, *warm]),
                }
                entry["summary"] = restart_summary(entry)
                state[server.role] = {k: v for k, v in entry.items() if k != "phase"}
            else:
                repeats = []
                for nonce in saved["nonces"]:
                    _progress(f"{server.role} {server.url}: restart workload, first repeat ...")
                    messages = conversation.turn_messages(
                        saved["turn"], nonce, saved.get("agent_format", fmt)
                    )
                    body = server.chat(
                        messages, args.max_tokens, conversation.request_tools(saved.get("agent_format", fmt))
                    )
                    repeats.append(await server.send(body))
                entry = {
                    **saved,
                    "phase": "repeat",
                    "repeat_ttft_ms": [_ms(r.ttft) for r in repeats],
                    "repeat_cached_tokens": [r.usage_cached_tokens for r in repeats],
                    "errors": saved.get("errors", []) + _errors(repeats),
                }
                entry["summary"] = restart_summary(entry)
                state.pop(server.role, None)
            entry["metrics"] = metrics_delta(before, await server.metrics())
            entry["model"] = server.model
            report[server.role] = entry
    if state:
        path.write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")
    elif path.exists():
        path.unlink()
    if len(servers) == 2:
        report["ratios"] = summary_ratios(report["target"]["summary"], report["baseline"]["summary"])
    return report


def restart_summary(entry: Mapping[str, Any]) -> dict[str, Any]:
    """Medians of the cold, in-memory warm and (after the restart) first-repeat TTFTs, and the ratios."""

    def med(key: str) -> float | None:
        return median([v for v in entry.get(key) or [] if v is not None])

    cold, warm, repeat = med("cold_ttft_ms"), med("warm_ttft_ms"), med("repeat_ttft_ms")
    return {
        "prompt_tokens": med("prompt_tokens"),
        "cold_ttft_ms": cold,
        "warm_ttft_ms": warm,
        "warm_over_cold": ratio(warm, cold),
        "repeat_ttft_ms": repeat,
        "repeat_over_cold": ratio(repeat, cold),
        "repeat_cached_tokens": med("repeat_cached_tokens"),
        "errors": len(entry.get("errors") or []),
    }


# ------------------------------------------------------------------------------------------ table


def _f(value: Any, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def format_report(report: Mapping[str, Any]) -> str:
    """A human-readable table for a CACHE_WORKLOADS report (latencies in ms)."""
    roles = [r for r in ("target", "baseline") if r in report]
    lines = [f"{role}: {report[role]['url']} (model {report[role]['model']})" for role in roles]
    workload = report["workload"]
    ratios = report.get("ratios")
    if workload == "shared-prefix":
        lines.append(
            f"shared-prefix: {report['rounds']} round(s) x (1 cold + {report['warm_requests']} warm), "
            f"max_tokens {report['max_tokens']}, {report['endpoint']}; TTFT medians in ms"
        )
        lines.append(
            f"{'server':<9}{'prompt':>8}{'cold TTFT':>11}{'warm TTFT':>11}{'warm/cold':>11}{'cached':>8}{'errors':>8}"
        )
        for role in roles:
            s = report[role]["summary"]
            lines.append(
                f"{role:<9}{_f(s['prompt_tokens'], '.0f'):>8}{_f(s['cold_ttft_ms']):>11}{_f(s['warm_ttft_ms']):>11}"
                f"{_f(s['warm_over_cold'], '.3f'):>11}{_f(s['warm_cached_tokens'], '.0f'):>8}{s['errors']:>8}"
            )
        if ratios:
            lines.append(
                f"{'ratio':<9}{'':>8}{_f(ratios.get('cold_ttft_ms'), '.2f'):>11}"
                f"{_f(ratios.get('warm_ttft_ms'), '.2f'):>11}{_f(ratios.get('warm_over_cold'), '.2f'):>11}"
            )
    elif workload == "agent-replay" and "replay_file" in report:
        lines.append(
            f"agent-replay of {report['replay_file']} ({report['client']}, {report['requests']} requests), "
            f"max_tokens {report['max_tokens']}, {report['rounds']} replay(s); medians; "
            "prefilled = the server's own count (Helios prefill_tokens, llama-server prompt_tokens_total)"
        )
        lines.append(
            f"{'server':<9}{'wall s':>8}{'prompt':>8}{'cached':>8}{'prefilled':>10}{'output':>8}{'errors':>8}"
        )
        for role in roles:
            s = report[role]["summary"]
            lines.append(
                f"{role:<9}{_f(s['wall_s'], '.2f'):>8}{_f(s['prompt_tokens'], '.0f'):>8}"
                f"{_f(s['cached_tokens'], '.0f'):>8}{_f(s['prefilled_tokens'], '.0f'):>10}"
                f"{_f(s['output_tokens'], '.0f'):>8}{s['errors']:>8}"
            )
        if ratios:
            lines.append(f"{'ratio':<9}{_f(ratios.get('wall_s'), '.2f'):>8}")
        for role in roles:
            for i, run in enumerate(report[role]["runs"]):
                cells = " ".join(
                    f"{_f(r['prompt_tokens'], '.0f')}/{_f(r['cached_tokens'], '.0f')}" for r in run["requests"]
                )
                lines.append(f"{role} replay {i + 1} per-request prompt/cached tokens: {cells}")
    elif workload == "agent-replay":
        lines.append(
            f"agent-replay: {report['turns']} turns ({report['agent_format']} format), max_tokens {report['max_tokens']}, "
            f"{report['rounds']} replay(s); medians; prefilled = 1 - cached/prompt (metrics: prefill_tokens/prompt)"
        )
        lines.append(
            f"{'server':<9}{'wall s':>8}{'TTFT 1st':>10}{'TTFT later':>11}{'prompt':>8}{'cached':>8}"
            f"{'prefilled':>10}{'metrics':>9}{'errors':>8}"
        )
        for role in roles:
            s = report[role]["summary"]
            lines.append(
                f"{role:<9}{_f(s['wall_s'], '.2f'):>8}{_f(s['first_turn_ttft_ms']):>10}{_f(s['later_turn_ttft_ms']):>11}"
                f"{_f(s['prompt_tokens'], '.0f'):>8}{_f(s['cached_tokens'], '.0f'):>8}"
                f"{_f(s['prefilled_share'], '.3f'):>10}{_f(s['metrics_prefilled_share'], '.3f'):>9}{s['errors']:>8}"
            )
        if ratios:
            lines.append(
                f"{'ratio':<9}{_f(ratios.get('wall_s'), '.2f'):>8}{_f(ratios.get('first_turn_ttft_ms'), '.2f'):>10}"
                f"{_f(ratios.get('later_turn_ttft_ms'), '.2f'):>11}"
            )
        for role in roles:
            for i, run in enumerate(report[role]["runs"]):
                ttfts = " ".join(_f(t, ".0f") for t in run["ttft_ms"])
                lines.append(f"{role} replay {i + 1} per-turn TTFT ms: {ttfts}")
    else:
        lines.append(f"restart: state file {report['state_file']}; TTFT medians in ms")
        lines.append(
            f"{'server':<9}{'phase':>7}{'prompt':>8}{'cold':>9}{'warm':>9}{'repeat':>9}{'rep/cold':>10}"
            f"{'cached':>8}{'errors':>8}"
        )
        for role in roles:
            s = report[role]["summary"]
            lines.append(
                f"{role:<9}{report[role]['phase']:>7}{_f(s['prompt_tokens'], '.0f'):>8}{_f(s['cold_ttft_ms']):>9}"
                f"{_f(s['warm_ttft_ms']):>9}{_f(s['repeat_ttft_ms']):>9}{_f(s['repeat_over_cold'], '.3f'):>10}"
                f"{_f(s['repeat_cached_tokens'], '.0f'):>8}{s['errors']:>8}"
            )
        if any(report[role]["phase"] == "cold" for role in roles):
            lines.append(
                "cold phase stored; restart the server(s) (same disk store) and run the same command again"
            )
    for role in roles:
        errors = report[role].get("errors")
        if errors is None:
            errors = [e for run in report[role]["runs"] for e in run["errors"]]
        for sample in list(dict.fromkeys(errors))[:5]:
            lines.append(f"error: {role}: {sample}")
    return "\n".join(lines)


def count_errors(report: Mapping[str, Any]) -> int:
    total = 0
    for role in ("target", "baseline"):
        if role in report:
            total += int(report[role]["summary"]["errors"])
    return total
