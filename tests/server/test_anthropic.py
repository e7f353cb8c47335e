"""SDK conformance for Anthropic Messages: the real Anthropic SDK against a live hypercorn process.

Run against any server with FLARE_API_TEST_URL=http://127.0.0.1:8000 (and FLARE_API_TEST_KEY).
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest

from helios.frontends.anthropic.messages import thinking_signature
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.slow

CAPITAL: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]
POEM: list[Any] = [{"role": "user", "content": "Write a short poem about the sea."}]
VERSION = {"anthropic-version": "2023-06-01"}
GREEDY = {"temperature": 0}  # the SDK no longer types sampling fields; Messages accepts them


def sdk(server: LiveServer) -> anthropic.Anthropic:
    """The SDK client pinned to the API version the spec requires (newer SDKs default to a later one)."""
    return server.anthropic(default_headers=VERSION)  # type: ignore[no-any-return]


def test_create_text_round_trip(server: LiveServer) -> None:
    client = sdk(server)
    r = client.messages.create(model="anything", messages=CAPITAL, max_tokens=20, extra_body=GREEDY)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert r.model == "smol"
    assert [b.type for b in r.content] == ["text"]
    assert r.content[0].text == "The capital of France is Paris."  # type: ignore[union-attr]
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    assert r.usage.output_tokens == 8  # 7 text tokens + <|im_end|>
    assert r.usage.cache_creation_input_tokens == 0
    assert r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) > 0
    # A replay of our own thinking marker is accepted; a tampered one is not.
    history = [*CAPITAL,
               {"role": "assistant", "content": [
                   {"type": "thinking", "thinking": "Recall.", "signature": thinking_signature("Recall.")},
                   {"type": "text", "text": "Paris."}]},
               {"role": "user", "content": "And of Italy?"}]
    client.messages.create(model="m", messages=history, max_tokens=2)
    history[1]["content"][0]["signature"] = thinking_signature("Tampered.")
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="m", messages=history, max_tokens=2)


def test_stream_helpers_equal_buffered(server: LiveServer) -> None:
    client = sdk(server)
    kw: dict[str, Any] = dict(model="m", messages=POEM, max_tokens=30, extra_body={"temperature": 0.9, "top_k": 1},
                              system=[{"type": "text", "text": "You are a poet.", "cache_control": {"type": "ephemeral"}}])
    buffered = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == buffered.content[0].text  # type: ignore[union-attr]
    assert [b.to_dict(exclude_none=True) for b in final.content] == [
        b.to_dict(exclude_none=True) for b in buffered.content]
    assert (final.stop_reason, final.stop_sequence) == (buffered.stop_reason, buffered.stop_sequence)
    assert final.usage.output_tokens == buffered.usage.output_tokens
    assert (final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0)
            == buffered.usage.input_tokens + (buffered.usage.cache_read_input_tokens or 0))


def test_raw_event_order(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as h:
        headers = {**VERSION, "x-api-key": server.key or "unused"}
        body = {"model": "m", "messages": CAPITAL, "max_tokens": 5, "temperature": 0, "stream": True}
        r = h.post("/v1/messages", json=body, headers=headers)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events: list[tuple[str, dict[str, Any]]] = []
    for chunk in r.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.split("\n"))
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        events.append((lines["event"], data))
    names = [e for e, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1:-2] == ["content_block_start", *["content_block_delta"] * (len(names) - 5), "content_block_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["usage"]["cache_read_input_tokens"] == 0
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 5
    assert delta["usage"]["input_tokens"] + delta["usage"]["cache_read_input_tokens"] == start["usage"]["input_tokens"]


def test_stop_sequences_and_max_tokens(server: LiveServer) -> None:
    client = sdk(server)
    r = client.messages.create(model="m", messages=CAPITAL, max_tokens=20, extra_body=GREEDY, stop_sequences=["Paris"])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "Paris"
    assert r.content[0].text == "The capital of France is "  # type: ignore[union-attr]
    with client.messages.stream(model="m", messages=CAPITAL, max_tokens=20, extra_body=GREEDY,
                                stop_sequences=["Paris"]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "Paris")
    r = client.messages.create(model="m", messages=CAPITAL, max_tokens=3, extra_body=GREEDY)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3
    # Assistant prefill continues the final message.
    r = client.messages.create(model="m", max_tokens=8, extra_body=GREEDY,
                               messages=[*CAPITAL, {"role": "assistant", "content": "The capital of France is"}])
    assert r.content[0].text.startswith(" Paris")  # type: ignore[union-attr]


def test_count_tokens_and_usage_match_chat(server: LiveServer) -> None:
    client = sdk(server)
    system = "You are terse."
    counted = client.messages.count_tokens(model="m", system=system, messages=CAPITAL)
    r = client.messages.create(model="m", system=system, messages=CAPITAL, max_tokens=4, extra_body=GREEDY)
    assert counted.input_tokens == r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0)
    chat = server.openai().chat.completions.create(
        model="m", messages=[{"role": "system", "content": system}, *CAPITAL], max_tokens=4, temperature=0)
    assert chat.usage is not None and chat.usage.prompt_tokens == counted.input_tokens
    assert chat.usage.completion_tokens == r.usage.output_tokens
    assert chat.choices[0].message.content == r.content[0].text  # type: ignore[union-attr]


def test_errors_have_anthropic_shape(server: LiveServer) -> None:
    client = sdk(server)
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="m", messages=CAPITAL, max_tokens=5,
                               extra_body={"logprobs": True, "top_logprobs": 2})
    assert err.value.body["type"] == "error"  # type: ignore[index]
    assert err.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    for field in ("top_logprobs", "return_tokens_as_token_ids", "logprob_token_ids"):
        with pytest.raises(anthropic.BadRequestError, match=field):
            client.messages.create(model="m", messages=CAPITAL, max_tokens=5, extra_body={field: 1})
    with pytest.raises(anthropic.BadRequestError, match="anthropic-version"):
        client.messages.create(model="m", messages=CAPITAL, max_tokens=5,
                               extra_headers={"anthropic-version": anthropic.Omit()})  # type: ignore[dict-item]
    with pytest.raises(anthropic.BadRequestError, match="anthropic-version"):
        client.messages.count_tokens(model="m", messages=CAPITAL, extra_headers={"anthropic-version": "2020-01-01"})
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="m", messages=CAPITAL, max_tokens=5, tools=[
            {"name": "f", "input_schema": {"type": "object"}, "strict": True}])
    # An output limit beyond the 8192-token context is cut to the room left ([server]
    # max_tokens_overflow = "clamp"; the live `limited` server checks "reject"'s 400).
    clamped = client.messages.create(model="m", messages=CAPITAL, max_tokens=9000, extra_body=GREEDY,
                                     stop_sequences=["."])
    assert clamped.stop_reason == "stop_sequence" and "Paris" in clamped.content[0].text  # type: ignore[union-attr]
    with pytest.raises(anthropic.NotFoundError) as nf:
        client.post("/v1/messages/nope", cast_to=httpx.Response, body={})
    assert nf.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.APIStatusError) as enc:
        client.messages.create(model="m", messages=CAPITAL, max_tokens=5,
                               extra_headers={"content-encoding": "compress"})
    assert enc.value.status_code == 415 and enc.value.body["type"] == "error"  # type: ignore[index]
    # A required tool call that the model never makes: HTTP 500 api_error, or a terminal error event.
    tool: Any = {"name": "lookup", "description": "Look a city up", "input_schema": {
        "type": "object", "properties": {"city": {"type": "string"}}}}
    with pytest.raises(anthropic.InternalServerError) as ie:
        client.messages.create(model="m", messages=CAPITAL, max_tokens=5, extra_body=GREEDY, tools=[tool],
                               tool_choice={"type": "any"})
    assert ie.value.body["error"]["type"] == "api_error"  # type: ignore[index]
    with pytest.raises(anthropic.APIStatusError), client.messages.stream(
            model="m", messages=CAPITAL, max_tokens=5, extra_body=GREEDY, tools=[tool],
            tool_choice={"type": "tool", "name": "lookup"}) as stream:
        stream.get_final_message()


def test_auth_and_body_limit(limited: LiveServer) -> None:
    bad = anthropic.Anthropic(base_url=limited.url, api_key="wrong", max_retries=0, default_headers=VERSION)
    with pytest.raises(anthropic.AuthenticationError) as err:
        bad.messages.create(model="m", messages=CAPITAL, max_tokens=2)
    assert err.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    client = sdk(limited)
    r = client.messages.create(model="m", messages=CAPITAL, max_tokens=2)
    assert r.usage.output_tokens <= 2
    with pytest.raises(anthropic.APIStatusError) as big:
        client.messages.create(model="m", messages=[{"role": "user", "content": "x" * 70000}], max_tokens=2)
    assert big.value.status_code == 413
    assert big.value.body["error"]["type"] == "request_too_large"  # type: ignore[index]


def test_sdk_default_version_header_is_accepted(server: LiveServer) -> None:
    r = server.anthropic().messages.create(model="m", max_tokens=3, messages=CAPITAL)
    assert r.usage.output_tokens == 3 and r.stop_reason == "max_tokens"
