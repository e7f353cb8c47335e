"""Real coding clients' request bodies over HTTP (field tables: helios/frontends/fields.py).

Codex's POST /v1/responses and Claude Code's POST /v1/messages?beta=true, with every field those
clients send, stream to a successful end; refused fields are 400s in each protocol's error shape."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.serving.harness import ScriptedServer, Writer
from tests.unit.test_request_fields import claude_code_body, codex_body


def sse(server: ScriptedServer, path: str, body: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    with server.http() as client, client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    return events, data


def test_codex_body_streams_a_response(coder: ScriptedServer) -> None:
    key = coder.book.add(Writer("qwen3_coder").think("Read the test first."), "Fixed.")
    body = codex_body()
    body["input"][-1]["content"][0]["text"] += f" {key}"
    events, data = sse(coder, "/v1/responses", body)
    assert events[-1] == "response.completed", events
    done = data[-1]["response"]
    assert done["status"] == "completed" and done["prompt_cache_key"] == "019a2b3c-session"
    assert [o["type"] for o in done["output"]] == ["reasoning", "message"]
    assert done["output"][-1]["content"][0]["text"] == "Fixed."


def test_claude_code_body_streams_a_message(coder: ScriptedServer) -> None:
    key = coder.book.add(Writer("qwen3_coder").think("Read the test first."), "Fixed.")
    body = {**claude_code_body(), "max_tokens": 1024}  # the scripted server's context is 4096 tokens
    body["messages"][0]["content"][-1]["text"] += f" {key}"
    events, data = sse(coder, "/v1/messages?beta=true", body)
    assert events[0] == "message_start" and events[-1] == "message_stop", events
    text = "".join(d["delta"].get("text", "") for d in data if d["type"] == "content_block_delta")
    thinking = [d for d in data if d["type"] == "content_block_start" and d["content_block"]["type"] == "thinking"]
    assert text == "Fixed." and thinking  # display "omitted": the block keeps its place, without text


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "audio": {"voice": "alloy"}},
     "audio"),
    ("/v1/completions", {"prompt": "Hi", "suffix": "end"}, "suffix"),
    ("/v1/responses", {"input": "Hi", "background": True}, "background"),
    ("/v1/responses", {"input": "Hi", "client_metadata": {}, "no_such_field": 1}, "no_such_field"),
])
def test_openai_refusals_name_the_field(coder: ScriptedServer, path: str, body: dict[str, Any], param: str) -> None:
    with coder.http() as client:
        r = client.post(path, json={"model": "scripted", **body})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and param in error["message"]


def test_messages_refusals_use_the_anthropic_shape(coder: ScriptedServer) -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}],
            "thread": {"type": "create"}}
    with coder.http() as client:
        r = client.post("/v1/messages?beta=true", json=body)
    assert r.status_code == 400
    payload = r.json()
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
    assert "thread is not supported" in payload["error"]["message"]
