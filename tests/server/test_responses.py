"""SDK conformance for POST /v1/responses and Ollama discovery, against a live hypercorn process.

Run against any server with FLARE_API_TEST_URL=http://127.0.0.1:8000 (and FLARE_API_TEST_KEY).
"""

from __future__ import annotations

import gzip
import json
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import LiveServer

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"

SDK_EVENT_TYPES = {
    "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    "response.output_text.delta", "response.output_text.done", "response.content_part.done",
    "response.output_item.done", "response.completed",
}


def model_id(server: LiveServer) -> str:
    return server.openai().models.list().data[0].id


def test_create_text_round_trip(server: LiveServer) -> None:
    r = server.openai().responses.create(model="anything", input=QUESTION, temperature=0, max_output_tokens=20)
    assert r.status == "completed" and r.error is None and r.incomplete_details is None
    assert r.output_text == "The capital of France is Paris."
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model_id(server)
    assert len(r.output) == 1 and r.output[0].type == "message"
    msg = r.output[0]
    assert msg.id.startswith("msg_") and msg.status == "completed" and msg.role == "assistant"
    assert msg.content[0].type == "output_text" and msg.content[0].annotations == []
    assert r.usage is not None and r.usage.output_tokens == 8  # 7 text tokens + <|im_end|>
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.store is False and r.max_output_tokens == 20 and r.parallel_tool_calls is True


def test_stream_equals_buffered_and_event_order(server: LiveServer) -> None:
    client = server.openai()
    kw: dict[str, Any] = dict(model="m", input="Write a short poem about the sea.", temperature=0.9,
                              max_output_tokens=16, extra_body={"seed": 1234})
    buffered = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    final = events[-1].response  # type: ignore[union-attr]
    assert final.status == buffered.status
    assert final.output[0].content[0].text == buffered.output_text and buffered.output_text  # type: ignore[union-attr]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == buffered.output_text
    types = [e.type for e in events]
    assert SDK_EVENT_TYPES - {"response.completed"} <= set(types)
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    terminal = "response.completed" if buffered.status == "completed" else "response.incomplete"
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          terminal]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1  # type: ignore[union-attr]
    item_id = final.output[0].id
    assert all(e.item_id == item_id and e.output_index == 0 for e in events if hasattr(e, "item_id"))  # type: ignore[union-attr]
    assert final.usage is not None and buffered.usage is not None
    assert final.usage.output_tokens == buffered.usage.output_tokens
    assert final.usage.input_tokens == buffered.usage.input_tokens


def test_stream_has_no_done_sentinel(server: LiveServer) -> None:
    body = {"model": "m", "input": "Hi", "max_output_tokens": 3, "stream": True}
    with httpx.Client(base_url=server.url, headers=_auth(server), timeout=60) as h:
        r = h.post("/v1/responses", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-request-id"]
    assert "[DONE]" not in r.text
    names = [line[len("event: "):] for line in r.text.splitlines() if line.startswith("event: ")]
    data = [json.loads(line[len("data: "):]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert names == [d["type"] for d in data] and names[-1] == "response.incomplete"


def test_usage_matches_chat_completions(server: LiveServer) -> None:
    client = server.openai()
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
               {"role": "user", "content": QUESTION}]
    r = client.responses.create(model="m", instructions="Answer briefly.", input=history,  # type: ignore[arg-type]
                                temperature=0, max_output_tokens=20)
    c = client.chat.completions.create(model="m", messages=[{"role": "system", "content": "Answer briefly."},
                                                            *history],  # type: ignore[list-item]
                                       temperature=0, max_tokens=20)
    assert r.usage is not None and c.usage is not None
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == c.usage.completion_tokens
    assert r.output_text == c.choices[0].message.content


def test_max_output_tokens_is_incomplete(server: LiveServer) -> None:
    client = server.openai()
    r = client.responses.create(model="m", input="Tell me a long story.", max_output_tokens=3)
    assert r.status == "incomplete"
    assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 3
    assert r.output[0].type == "message" and r.output[0].status == "incomplete"
    with client.responses.stream(model="m", input="Tell me a long story.", max_output_tokens=3) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details is not None  # type: ignore[union-attr]
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]


def test_output_text_logprobs(server: LiveServer) -> None:
    client = server.openai()
    kw: dict[str, Any] = dict(model="m", input=QUESTION, temperature=0, max_output_tokens=20,
                              include=["message.output_text.logprobs"], top_logprobs=2)
    r = client.responses.create(**kw)
    part = r.output[0].content[0]  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs is not None
    assert r.usage is not None and len(part.logprobs) == r.usage.output_tokens - 1  # the terminating EOS has none
    assert "".join(bytes(e.bytes).decode() for e in part.logprobs) == r.output_text
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in part.logprobs)
    with client.responses.stream(**kw) as stream:
        streamed = [lp for e in stream if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [e.token for e in streamed] == [e.token for e in part.logprobs]


def test_tool_history_and_required_tool_choice(server: LiveServer) -> None:
    client = server.openai()
    tools: Any = [{"type": "function", "name": "lookup", "strict": False,
                   "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]
    history: Any = [
        {"role": "user", "content": "Look up Paris."},
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{\"q\": \"Paris\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "Paris is the capital of France."},
    ]
    r = client.responses.create(model="m", input=history, tools=tools, max_output_tokens=5)
    assert r.status in ("completed", "incomplete") and r.tools[0].type == "function"
    # The default model has no tool syntax, so a required call can never appear: 500, or response.failed.
    with pytest.raises(openai.InternalServerError):
        client.responses.create(model="m", input="Look up Paris.", tools=tools, tool_choice="required",
                                max_output_tokens=5)
    with client.responses.stream(model="m", input="Look up Paris.", tools=tools, tool_choice="required",
                                 max_output_tokens=5) as stream:
        events = list(stream)
    assert events[-1].type == "response.failed" and events[-1].response.error is not None  # type: ignore[union-attr]


@pytest.mark.parametrize("kw", [
    {"store": True},
    {"previous_response_id": "resp_123"},
    {"background": True},
    {"truncation": "auto"},
    {"conversation": "conv_123"},
    {"input": [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA"},
               {"role": "user", "content": "Hi"}]},
    {"tools": [{"type": "web_search"}]},
    {"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]},
    {"tools": [{"type": "function", "name": "f", "parameters": {}, "strict": True}]},
    # text.format json_object is served now (structured output); a schema llguidance cannot compile is not.
    {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "no-such-type"}}}},
    {"extra_body": {"prompt_logprobs": 1}},
    {"extra_body": {"no_such_field": 1}},
])
def test_rejections(server: LiveServer, kw: dict[str, Any]) -> None:
    args: dict[str, Any] = {"model": "m", "input": "Hi", "max_output_tokens": 5, **kw}
    with pytest.raises(openai.BadRequestError) as err:
        server.openai().responses.create(**args)
    body = err.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error"


def test_auth_and_body_limits(limited: LiveServer) -> None:
    bad = openai.OpenAI(base_url=limited.v1, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.responses.create(model="m", input="Hi", max_output_tokens=2)
    r = limited.openai().responses.create(model="m", input="Hi", max_output_tokens=2)
    assert r.status in ("completed", "incomplete")
    with httpx.Client(base_url=limited.url, timeout=60) as anon:
        assert anon.post("/v1/responses", json={"input": "Hi"}).status_code == 401
    with limited.http() as h:
        big = json.dumps({"model": "m", "input": "x" * 70000}).encode()
        r2 = h.post("/v1/responses", content=big, headers={"content-type": "application/json"})
        assert r2.status_code == 413 and r2.json()["error"]["type"] == "request_too_large"
        r3 = h.post("/v1/responses", content=b"{}", headers={"content-encoding": "compress"})
        assert r3.status_code == 415 and "error" in r3.json()


def test_discovery_auth(limited: LiveServer) -> None:
    with httpx.Client(base_url=limited.url, timeout=30) as anon:
        r = anon.get("/api/tags")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = anon.post("/api/show", json={"model": "x"}, headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with limited.http() as h:
        name = h.get("/api/tags").json()["models"][0]["name"]
        assert h.post("/api/show", json={"model": name}).status_code == 200
        r = h.post("/api/show", content=gzip.compress(json.dumps({"model": name}).encode()),
                   headers={"content-encoding": "gzip", "content-type": "application/json"})
        assert r.status_code == 415 and isinstance(r.json()["error"], str)
        r = h.post("/api/show", content=json.dumps({"model": "x" * 70000}).encode())
        assert r.status_code == 413 and isinstance(r.json()["error"], str)


def test_ollama_discovery(server: LiveServer) -> None:
    card = server.openai().models.list().data[0]
    root = (card.model_extra or {})["root"]
    with httpx.Client(base_url=server.url, headers=_auth(server), timeout=30) as h:
        tags = h.get("/api/tags").json()
        assert len(tags["models"]) == 1
        entry = tags["models"][0]
        assert entry["name"] == entry["model"] == card.id
        assert entry["size"] == 0 and entry["modified_at"] == "0001-01-01T00:00:00Z"
        assert len(entry["digest"]) == 64 and int(entry["digest"], 16) >= 0
        assert entry["details"] == {"parent_model": "", "format": "flare", "family": "", "families": [],
                                    "parameter_size": "", "quantization_level": ""}
        assert h.get("/api/tags").json()["models"][0]["digest"] == entry["digest"]
        for name in (card.id, root, "HuggingFaceTB/SmolLM2-135M-Instruct"):
            for verbose in (None, True, False):
                body: dict[str, Any] = {"model": name} if verbose is None else {"model": name, "verbose": verbose}
                show = h.post("/api/show", json=body)
                assert show.status_code == 200, show.text
                info = show.json()
                assert info["capabilities"][0] == "completion"
                assert info["model_info"]["general.name"] == card.id
                assert info["model_info"]["flare.context_length"] == (card.model_extra or {})["max_model_len"]
                assert info["model_info"]["flare.vocab_size"] == (card.model_extra or {})["flare"]["vocab_size"]
                assert info["details"]["format"] == "flare" and "template" not in info
        for bad in ({}, {"model": ""}, {"model": 7}, {"model": ["smol"]}, {"model": "smol", "verbose": "yes"}):
            r = h.post("/api/show", json=bad)
            assert r.status_code == 400 and isinstance(r.json()["error"], str), bad
        r = h.post("/api/show", json={"model": "llama3:latest"})
        assert r.status_code == 404 and isinstance(r.json()["error"], str)
        r = h.post("/api/show", content=b"not json")
        assert r.status_code == 400 and isinstance(r.json()["error"], str)


def _auth(server: LiveServer) -> dict[str, str]:
    return {"authorization": f"Bearer {server.key}"} if server.key else {}
