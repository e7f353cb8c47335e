"""One conversation, three protocols, one prompt (api.md, "Conversation and tool semantics": protocol
decoders populate the neutral types directly and one lowering renders them).

System + user + assistant tool call (with reasoning) + tool result + user arrives through Chat
Completions, Messages and Responses; the scripted model records the exact prompt token ids it was
given for each, and they must be identical. The neutral conversations the three decoders build are
compared too, to point at the decoder when the prompts differ."""

from __future__ import annotations

import json
from typing import Any

import pytest

from helios.frontends.anthropic import messages as anthropic_frontend
from helios.frontends.openai import chat as chat_frontend
from helios.frontends.openai import responses as responses_frontend
from helios.serving.lowering import lower_messages
from tests.serving.harness import ScriptedServer, Writer
from tests.serving.protocols import TOOLS

SYSTEM = "You are a weather assistant. Answer briefly."
QUESTION = "What is the weather in Paris?"
THOUGHT = "I should call get_weather for Paris."
ARGS = {"city": "Paris", "unit": "celsius"}
RESULT = "18 degrees and sunny"
CALL_ID = "call_0001"


def chat_body(follow_up: str) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 64,
        "tools": [{"type": "function", "function": {"name": n, **t}} for n, t in TOOLS.items()],
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": None, "reasoning_content": THOUGHT,
             "tool_calls": [{"id": CALL_ID, "type": "function",
                             "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
            {"role": "tool", "tool_call_id": CALL_ID, "content": RESULT},
            {"role": "user", "content": follow_up},
        ],
    }


def messages_body(follow_up: str) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 64,
        "system": SYSTEM,
        "tools": [{"name": n, "description": t["description"], "input_schema": t["parameters"]}
                  for n, t in TOOLS.items()],
        "messages": [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": THOUGHT, "signature": anthropic_frontend.thinking_signature(THOUGHT)},
                {"type": "tool_use", "id": CALL_ID, "name": "get_weather", "input": ARGS},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": CALL_ID, "content": RESULT},
                {"type": "text", "text": follow_up},
            ]},
        ],
    }


def responses_body(follow_up: str) -> dict[str, Any]:
    return {
        "model": "m",
        "max_output_tokens": 64,
        "instructions": SYSTEM,
        "tools": [{"type": "function", "name": n, **t} for n, t in TOOLS.items()],
        "input": [
            {"role": "user", "content": QUESTION},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": THOUGHT}]},
            {"type": "function_call", "call_id": CALL_ID, "name": "get_weather", "arguments": json.dumps(ARGS)},
            {"type": "function_call_output", "call_id": CALL_ID, "output": RESULT},
            {"role": "user", "content": follow_up},
        ],
    }


@pytest.mark.parametrize("family", ["qwen3", "qwen3_coder"])
def test_one_conversation_renders_one_prompt(servers: dict[str, ScriptedServer], family: str) -> None:
    server = servers[family]
    key = server.book.add(Writer(family).think("Same city."), "Tomorrow looks similar.")
    follow_up = f"Thanks. And tomorrow? {key}"

    chat = server.openai().chat.completions.create(**chat_body(follow_up))
    anth = server.anthropic().messages.create(**messages_body(follow_up))
    resp = server.openai().responses.create(**responses_body(follow_up))
    anth_text = "".join(b.text for b in anth.content if b.type == "text")
    assert chat.choices[0].message.content == anth_text == resp.output_text == "Tomorrow looks similar."

    prompts = server.book.prompts_for(key)
    assert len(prompts) == 3
    chat_ids, anth_ids, resp_ids = prompts
    assert chat_ids == anth_ids, _diff(server, chat_ids, anth_ids)
    assert chat_ids == resp_ids, _diff(server, chat_ids, resp_ids)

    text = server.book.prompt_text(key)
    for needle in (SYSTEM, QUESTION, RESULT, "get_weather", "Paris", follow_up):
        assert needle in text
    # Usage and count_tokens report that same prompt.
    assert chat.usage is not None and chat.usage.prompt_tokens == len(chat_ids)
    assert anth.usage.input_tokens + (anth.usage.cache_read_input_tokens or 0) == len(chat_ids)
    assert resp.usage is not None and resp.usage.input_tokens == len(chat_ids)
    with server.http() as client:
        counted = client.post("/v1/messages/count_tokens", json={
            k: v for k, v in messages_body(follow_up).items() if k != "max_tokens"}).json()
    assert counted == {"input_tokens": len(chat_ids)}


def test_the_three_decoders_build_the_same_conversation(servers: dict[str, ScriptedServer]) -> None:
    server = servers["qwen3"]
    svc = server.service
    plans = (chat_frontend.decode_chat(chat_body("And tomorrow?"), svc.info),
             anthropic_frontend.decode_request(messages_body("And tomorrow?"), svc.info),
             responses_frontend.decode_responses(responses_body("And tomorrow?"), svc.info))
    chat_conv, anth_conv, resp_conv = (p.conversation for p in plans)
    # The neutral messages may be shaped differently (a Messages user turn carries its tool result and
    # text together); the template messages they lower to may not.
    lowered = [lower_messages(c, svc.chat_template) for c in (chat_conv, anth_conv, resp_conv)]
    assert lowered[0] == lowered[1] == lowered[2]
    assert [m["role"] for m in lowered[0]] == ["system", "user", "assistant", "tool", "user"]
    assert lowered[0][2]["reasoning_content"] == THOUGHT
    assert chat_conv.tools == anth_conv.tools == resp_conv.tools
    assert chat_conv.tool_choice == anth_conv.tool_choice == resp_conv.tool_choice
    # And the service prepares each to the same prompt (the same path the HTTP routes take).
    prepared = [server.run_in_server(svc.prepare, p.generation) for p in plans]
    assert [len(p.prompts) for p in prepared] == [len(p.children) for p in prepared] == [1, 1, 1]
    assert prepared[0].prompts[0] == prepared[1].prompts[0] == prepared[2].prompts[0]
    assert all(p.children[0].prompt_token_ids == p.prompts[0].token_ids for p in prepared)
    rendered = [server.run_in_server(svc.render_chat, c)[1] for c in (chat_conv, anth_conv, resp_conv)]
    assert rendered[0] == rendered[1] == rendered[2] == list(prepared[0].prompts[0].token_ids)


def _diff(server: ScriptedServer, a: tuple[int, ...], b: tuple[int, ...]) -> str:
    ta = server.tok.decode(list(a), skip_special_tokens=False)
    tb = server.tok.decode(list(b), skip_special_tokens=False)
    at = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), min(len(ta), len(tb)))
    return f"prompts differ at char {at}:\n{ta[max(0, at - 80):at + 80]!r}\n---\n{tb[max(0, at - 80):at + 80]!r}"
