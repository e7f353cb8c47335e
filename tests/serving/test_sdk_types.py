"""Every response body and stream event Helios writes validates against the installed OpenAI and
Anthropic SDKs' own types, strictly, over thousands of random valid requests per protocol.

Chat Completions, Completions, Responses and Messages, buffered and streamed, on the scripted model
(harness.py) of two families (Hermes JSON calls with a model-opened <think>; function tags with a
prompt-opened one). Each request is drawn from a seeded generator: a script (plain text with
multi-byte characters, reasoning then text, one or two tool calls, reasoning then calls), tools and
tool_choice auto/none/omitted, max tokens that may cut the script, string stops taken from it,
temperature 0 or seeded sampling, n, logprobs with top alternatives, usage in streams, reasoning on
or off. Each body or event is validated with pydantic's strict mode (``model_validate(strict=True)``:
no coercion, a string is not a number, an int is not a bool) against the SDK class the client
itself would parse it into (`ChatCompletion`, `ChatCompletionChunk`, `Completion`, `Response`, the
`ResponseStreamEvent` union, `Message`, the `RawMessageStreamEvent` union), and every field the SDK
class does not declare must be one of the documented extensions below, by path.

``HELIOS_SDK_TYPE_REQUESTS`` sets the requests per protocol: 500 in the normal suite (about a
minute per protocol on 2 cores), 2,000 and more for the issue's figure; request i of a protocol is
drawn from ``random.Random(f"{protocol}-{i}")``, named in the assertion message.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent

from tests.serving.harness import ScriptedServer, Writer
from tests.serving.protocols import TOOLS

REQUESTS = int(os.environ.get("HELIOS_SDK_TYPE_REQUESTS", "500"))
CONCURRENCY = 8
FAMILY_NAMES = ("qwen3", "qwen3_coder")

# Fields the SDK classes do not declare, by dotted path (list indices dropped; a stream event's path
# starts with its type and a colon, "*:" for any type): documented extensions that vLLM's clients
# read, or fields of OpenAI's wire the SDK classes lack. Anything else is a defect.
EXTENSIONS: dict[str, frozenset[str]] = {
    "chat": frozenset({
        "choices.stop_reason",  # vLLM: the stop string or token that matched
        "choices.message.reasoning_content",  # vLLM's reasoning field (and DeepSeek's)
        "choices.message.reasoning",
        "choices.delta.reasoning_content",
        "choices.delta.reasoning",
        "prompt_logprobs",
        "choices.token_ids",
        "prompt_token_ids",
        "kv_transfer_params",
    }),
    "completions": frozenset({"choices.stop_reason", "choices.prompt_logprobs", "prompt_logprobs",
                              "choices.token_ids", "choices.prompt_token_ids", "kv_transfer_params"}),
    # OpenAI's own Response objects carry `store` (the request's), which the SDK class omits, and its
    # function_call_arguments.done events the call's name (in the API reference, not the SDK class).
    "responses": frozenset({"store", "*:response.store", "response.function_call_arguments.done:name"}),
    "messages": frozenset(),
}

WORDS = ("Paris", "is", "the", "capital", "of", "France", "naïve", "café", "日本語", "🙂", "x = 1;", "done",
         "{\"k\": 2}", "line\nbreak", "tab\there", "Ünïcödé", "🚀🚀", "end")


# -- requests --------------------------------------------------------------------------------------


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _script(rng: random.Random, w: Writer) -> tuple[list[str], int, str]:
    """Script parts, how many tools it calls, and one of its words for a stop string."""
    kind = rng.randrange(4)
    parts: list[str] = []
    if kind in (1, 3):
        parts.append(w.think(_text(rng, rng.randint(1, 6))))
    elif w.prompt_opens_reasoning:
        parts.append(w.think("ok"))  # the prompt opened reasoning: the model closes it
    calls = rng.randint(1, 2) if kind >= 2 else 0
    if calls:
        picks = [("get_weather", {"city": rng.choice(("Paris", "Köln", "東京")), "unit": "celsius"}),
                 ("get_time", {"timezone": "Europe/Paris"})]
        parts.append(w.calls(*picks[:calls]))
    else:
        parts.append(_text(rng, rng.randint(1, 12)))
    return parts, calls, rng.choice(WORDS[:6])


def _tools(protocol: str) -> list[dict[str, Any]]:
    if protocol == "messages":
        return [{"name": n, "description": t["description"], "input_schema": t["parameters"]} for n, t in TOOLS.items()]
    if protocol == "responses":
        return [{"type": "function", "name": n, **t} for n, t in TOOLS.items()]
    return [{"type": "function", "function": {"name": n, **t}} for n, t in TOOLS.items()]


def build_request(server: ScriptedServer, protocol: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
    """(route, body) of one random valid request."""
    w = Writer(server.family.name)
    parts, calls, stop_word = _script(rng, w)
    key = server.book.add(*parts)
    prompt = f"{_text(rng, rng.randint(0, 5))} {key}"
    body: dict[str, Any] = {"model": "scripted", "stream": rng.random() < 0.5}
    max_tokens = rng.choice((4, 16, 64, 256))
    greedy = rng.random() < 0.6
    if not greedy:
        body["temperature"] = 0.7
        body["top_p"] = 0.95
    else:
        body["temperature"] = 0
    with_tools = calls > 0 or rng.random() < 0.3
    if protocol == "completions":
        body.update(prompt=prompt, max_tokens=max_tokens)
        if rng.random() < 0.4:
            body["logprobs"] = rng.randint(0, 3)
        if rng.random() < 0.3:
            body["n"] = 2
        if rng.random() < 0.3:
            body["stop"] = [stop_word]
        if rng.random() < 0.2:
            body["echo"] = True
        if body["stream"] and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        if not greedy:
            body["seed"] = rng.randint(0, 1000)
        return "/v1/completions", body
    if protocol == "chat":
        messages: list[dict[str, Any]] = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": _text(rng, 3)})
        messages.append({"role": "user", "content": prompt})
        body.update(messages=messages, max_completion_tokens=max_tokens)
        if rng.random() < 0.4:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 3)
        if rng.random() < 0.25:
            body["n"] = 2
        if rng.random() < 0.3:
            body["stop"] = [stop_word]
        if body["stream"] and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        if with_tools:
            body["tools"] = _tools(protocol)
            choice = rng.choice((None, "auto", "none"))
            if choice is not None:
                body["tool_choice"] = choice
            if calls < 2 and rng.random() < 0.3:  # a second call would fail the request (api.md)
                body["parallel_tool_calls"] = False
        if not greedy:
            body["seed"] = rng.randint(0, 1000)
        return "/v1/chat/completions", body
    if protocol == "responses":
        body["input"] = prompt if rng.random() < 0.5 else [{"role": "user", "content": prompt}]
        body["max_output_tokens"] = max(max_tokens, 16)
        if rng.random() < 0.3:
            body["instructions"] = _text(rng, 3)
        if with_tools:
            body["tools"] = _tools(protocol)
            choice = rng.choice((None, "auto", "none"))
            if choice is not None:
                body["tool_choice"] = choice
        if rng.random() < 0.2:
            body["store"] = False
        return "/v1/responses", body
    body.update(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens)
    if rng.random() < 0.3:
        body["system"] = _text(rng, 3)
    if rng.random() < 0.3:
        body["stop_sequences"] = [stop_word]
    if with_tools:
        body["tools"] = _tools(protocol)
        choice = rng.choice((None, {"type": "auto"}, {"type": "none"}))
        if choice is not None:
            body["tool_choice"] = choice
    if rng.random() < 0.2:
        body["max_tokens"] = 2048
        body["thinking"] = {"type": "enabled", "budget_tokens": 1024}
    return "/v1/messages", body


# -- validation ------------------------------------------------------------------------------------

def _completion_chunk(data: Any) -> Any:
    """A streamed Completions chunk. The SDK parses chunks into `Completion`, whose finish_reason is
    declared non-null, while OpenAI's own streams send null on every chunk before the last (the SDK
    builds stream objects without validation, so its clients never notice): a null finish_reason is
    checked as absent-but-allowed, everything else strictly."""
    if isinstance(data, dict) and isinstance(data.get("choices"), list):
        data = {**data, "choices": [{**c, "finish_reason": "stop"} if isinstance(c, dict) and "finish_reason" in c
                                    and c["finish_reason"] is None else c for c in data["choices"]]}
    return _completion(data)


def _completion(data: Any) -> Any:
    """A Completions body. With ``echo``, OpenAI (and vLLM) give the prompt's first token a null
    logprob and null alternatives (nothing precedes it), which the SDK's ``List[float]`` does not
    declare: that one null pair is checked as allowed, every other entry strictly."""
    if isinstance(data, dict) and isinstance(data.get("choices"), list):
        choices = []
        for c in data["choices"]:
            lp = c.get("logprobs") if isinstance(c, dict) else None
            if isinstance(lp, dict) and lp.get("token_logprobs") and lp["token_logprobs"][0] is None:
                assert lp.get("top_logprobs") is None or lp["top_logprobs"][0] is None, data
                lp = {**lp, "token_logprobs": [0.0, *lp["token_logprobs"][1:]]}
                if lp.get("top_logprobs") is not None:
                    lp["top_logprobs"] = [{}, *lp["top_logprobs"][1:]]
                c = {**c, "logprobs": lp}
            choices.append(c)
        data = {**data, "choices": choices}
    return Completion.model_validate(data, strict=True)


_EVENT_ADAPTERS: dict[str, pydantic.TypeAdapter[Any]] = {
    "responses": pydantic.TypeAdapter(ResponseStreamEvent),
    "messages": pydantic.TypeAdapter(RawMessageStreamEvent),
}
_BODY: dict[str, Callable[[Any], pydantic.BaseModel]] = {
    "chat": lambda d: ChatCompletion.model_validate(d, strict=True),
    "completions": _completion,
    "responses": lambda d: Response.model_validate(d, strict=True),
    "messages": lambda d: Message.model_validate(d, strict=True),
}
_EVENT: dict[str, Callable[[Any], Any]] = {
    "chat": lambda d: ChatCompletionChunk.model_validate(d, strict=True),
    "completions": _completion_chunk,
    "responses": lambda d: _EVENT_ADAPTERS["responses"].validate_python(d, strict=True),
    "messages": lambda d: _EVENT_ADAPTERS["messages"].validate_python(d, strict=True),
}


def _extras(obj: Any, path: str = "") -> Iterator[str]:
    """Dotted paths of every field a validated SDK object holds that its class does not declare."""
    if isinstance(obj, pydantic.BaseModel):
        for name in (obj.model_extra or {}):
            yield f"{path}{name}"
        for name in type(obj).model_fields:
            yield from _extras(getattr(obj, name), f"{path}{name}.")
    elif isinstance(obj, list | tuple):
        for item in obj:
            yield from _extras(item, path)
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _extras(value, path)


def _check(protocol: str, validate: Callable[[Any], Any], data: Any, where: str) -> None:
    try:
        parsed = validate(data)
    except pydantic.ValidationError as exc:
        raise AssertionError(f"{where}: not a valid SDK object: {exc}\n{json.dumps(data)[:2000]}") from None
    allowed = EXTENSIONS[protocol]
    kind = data.get("type") if isinstance(data, dict) and protocol in ("responses", "messages") else None
    if kind is None:
        unknown = sorted({p for p in _extras(parsed) if p not in allowed})
    else:
        unknown = sorted({f"{kind}:{p}" for p in _extras(parsed)
                          if f"{kind}:{p}" not in allowed and f"*:{p}" not in allowed})
    assert not unknown, f"{where}: fields the SDK type does not declare: {unknown}\n{json.dumps(data)[:2000]}"


def _sse(response: httpx.Response) -> Iterator[tuple[str | None, str]]:
    event: str | None = None
    for line in response.iter_lines():
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            yield event, line[5:].strip()
            event = None


def send_and_check(client: httpx.Client, protocol: str, route: str, body: dict[str, Any], where: str) -> int:
    """Sends one request and validates what comes back; returns the number of objects checked."""
    if not body["stream"]:
        r = client.post(route, json=body)
        assert r.status_code == 200, f"{where}: HTTP {r.status_code}: {r.text[:500]}"
        _check(protocol, _BODY[protocol], r.json(), where)
        return 1
    checked = 0
    with client.stream("POST", route, json=body) as r:
        assert r.status_code == 200, f"{where}: HTTP {r.status_code}: {r.read()[:500]!r}"
        for event, data in _sse(r):
            if data == "[DONE]":
                continue
            obj = json.loads(data)
            if protocol == "messages" and obj.get("type") == "ping":
                continue  # the SDK skips pings; they are not part of RawMessageStreamEvent
            assert obj.get("type") != "error", f"{where}: a stream error: {data[:500]}"
            if event is not None and protocol in ("responses", "messages"):
                assert event == obj.get("type"), f"{where}: event {event!r} carries type {obj.get('type')!r}"
            _check(protocol, _EVENT[protocol], obj, f"{where} event {checked}")
            checked += 1
    assert checked, f"{where}: an empty stream"
    return checked


@pytest.mark.parametrize("protocol", ["chat", "completions", "responses", "messages"])
def test_every_body_and_event_validates_against_the_sdk_types(servers: dict[str, ScriptedServer],
                                                              protocol: str) -> None:
    families = [servers[name] for name in FAMILY_NAMES]
    jobs = []
    for i in range(REQUESTS):
        rng = random.Random(f"{protocol}-{i}")
        server = families[i % len(families)]
        route, body = build_request(server, protocol, rng)
        jobs.append((server, route, body, f"{protocol} request {i} ({server.family.name}, {json.dumps(body)[:300]})"))
    clients = {s.family.name: httpx.Client(base_url=s.url, timeout=60, headers={"anthropic-version": "2023-06-01"},
                                           limits=httpx.Limits(max_connections=CONCURRENCY))
               for s in families}
    try:
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            counts = list(pool.map(lambda j: send_and_check(clients[j[0].family.name], protocol, j[1], j[2], j[3]),
                                   jobs))
    finally:
        for c in clients.values():
            c.close()
    assert len(counts) == REQUESTS and sum(counts) >= REQUESTS
