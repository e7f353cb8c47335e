"""Tool calls from the real Qwen2.5-Coder-0.5B-Instruct file, greedy, on Chat, Messages and Responses.

One hypercorn process serves the catalog's `qwen2.5-coder:0.5b` (fetched on a fresh machine, about
500 MB). The real model, asked "What's the weather in Paris?" with a `get_weather(city)` tool, does not
write the `<tool_call>` tags its template asks for: it answers with a bare or ```json-fenced
`{"name": "get_weather", "arguments": {"city": "Paris"}}` (the `qwen2_5` output parser takes both).
Each protocol's first turn is sent buffered and streamed (all six at once, so the engine batches
them), then a follow-up turn carrying the tool result (and a user line after it), which the model answers
in text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.server.conftest import LiveServer, _free_port, stop_server, wait_healthy

pytestmark = pytest.mark.slow

QUESTION = "What's the weather in Paris?"
RESULT = "Sunny, 22 degrees Celsius."
# Given the tool's result alone, the 0.5B model calls the tool again (greedy, every wording tried); a
# user line after the result makes it answer.
AFTER = "Answer in one sentence."
DESCRIPTION = "Get the current weather in a city"
PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "City name"}},
    "required": ["city"],
}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": PARAMS}}]
MESSAGES_TOOLS = [{"name": "get_weather", "description": DESCRIPTION, "input_schema": PARAMS}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": DESCRIPTION, "parameters": PARAMS}]
MAX_TOKENS = 64

TOML = """
[model]
path = "@MODEL@"
[engine]
max_active = 8
kv_memory_gib = 0.5
"""


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from helios.loaders import catalog

    model = catalog.ensure("qwen2.5-coder:0.5b")
    tmp = tmp_path_factory.mktemp("qwen")
    port = _free_port()
    cfg = tmp / "qwen.toml"
    cfg.write_text(TOML.replace("@MODEL@", str(model)))
    log = tmp / "qwen.log"
    env = dict(os.environ, HELIOS_CONFIG=str(cfg), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hypercorn", "helios.app:app", "--worker-class", "trio", "--bind", f"127.0.0.1:{port}"],
        env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, log)
    server = LiveServer(url, None, proc, log)
    yield server
    stop_server(server)


# --- one call per protocol and mode, each reduced to (name, arguments, finish reason) -------------------

Call = tuple[str, dict[str, Any], str]


def chat_first(s: LiveServer, stream: bool) -> tuple[Call, str]:
    kw: dict[str, Any] = dict(model="m", messages=[{"role": "user", "content": QUESTION}], tools=CHAT_TOOLS,
                              temperature=0, max_tokens=MAX_TOKENS)
    if not stream:
        choice = s.openai().chat.completions.create(**kw).choices[0]
        assert choice.message.content is None
        (tc,) = choice.message.tool_calls or []
        assert tc.type == "function" and tc.id
        return (tc.function.name, json.loads(tc.function.arguments), str(choice.finish_reason)), tc.id
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    ids: dict[int, str] = {}
    finish = ""
    text = ""
    for chunk in s.openai().chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.id:
                ids[tc.index] = tc.id
            if tc.function and tc.function.name:
                names[tc.index] = names.get(tc.index, "") + tc.function.name
            if tc.function and tc.function.arguments:
                args[tc.index] = args.get(tc.index, "") + tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert text == "" and list(names) == [0]
    return (names[0], json.loads(args[0]), finish), ids[0]


def messages_first(s: LiveServer, stream: bool) -> tuple[Call, str]:
    kw: dict[str, Any] = dict(model="m", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": QUESTION}],
                              tools=MESSAGES_TOOLS, extra_body={"temperature": 0})
    client = s.anthropic()
    if stream:
        with client.messages.stream(**kw) as st:
            kinds = {event.type for event in st}
            message = st.get_final_message()
        assert {"content_block_start", "content_block_delta", "message_stop"} <= kinds
    else:
        message = client.messages.create(**kw)
    (block,) = message.content
    assert block.type == "tool_use" and block.id
    return (block.name, dict(block.input), str(message.stop_reason)), block.id


def responses_first(s: LiveServer, stream: bool) -> tuple[Call, str]:
    kw: dict[str, Any] = dict(model="m", input=QUESTION, tools=RESPONSES_TOOLS, temperature=0,
                              max_output_tokens=MAX_TOKENS)
    client = s.openai()
    if stream:
        with client.responses.stream(**kw) as st:
            kinds = {event.type for event in st}
            response = st.get_final_response()
        assert {"response.output_item.added", "response.function_call_arguments.done",
                "response.completed"} <= kinds
    else:
        response = client.responses.create(**kw)
    (item,) = response.output
    assert item.type == "function_call" and item.call_id
    return (item.name, json.loads(item.arguments), str(response.status)), item.call_id


FIRST: dict[str, Callable[[LiveServer, bool], tuple[Call, str]]] = {
    "chat": chat_first, "messages": messages_first, "responses": responses_first,
}
FINISH = {"chat": "tool_calls", "messages": "tool_use", "responses": "completed"}


@pytest.fixture(scope="module")
def first_turns(qwen: LiveServer) -> dict[tuple[str, bool], tuple[Call, str]]:
    """All six first turns, sent at once."""
    keys = [(protocol, stream) for protocol in FIRST for stream in (False, True)]
    with ThreadPoolExecutor(len(keys)) as pool:
        futures = {key: pool.submit(FIRST[key[0]], qwen, key[1]) for key in keys}
        return {key: future.result() for key, future in futures.items()}


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
@pytest.mark.parametrize("protocol", list(FIRST))
def test_real_greedy_call_is_parsed(first_turns: dict[tuple[str, bool], tuple[Call, str]],
                                    protocol: str, stream: bool) -> None:
    (name, arguments, finish), _ = first_turns[protocol, stream]
    assert name == "get_weather"
    assert arguments == {"city": "Paris"}
    assert finish == FINISH[protocol]


@pytest.mark.parametrize("protocol", list(FIRST))
def test_streamed_and_buffered_agree(first_turns: dict[tuple[str, bool], tuple[Call, str]], protocol: str) -> None:
    assert first_turns[protocol, True][0] == first_turns[protocol, False][0]


# --- the follow-up turn: the tool's result comes back and the model answers in text --------------------


def chat_follow_up(s: LiveServer, call_id: str) -> tuple[str, str]:
    r = s.openai().chat.completions.create(
        model="m", tools=CHAT_TOOLS, temperature=0, max_tokens=MAX_TOKENS,
        messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": RESULT},
            {"role": "user", "content": AFTER},
        ],
    )
    choice = r.choices[0]
    assert not choice.message.tool_calls
    return choice.message.content or "", str(choice.finish_reason)


def messages_follow_up(s: LiveServer, call_id: str) -> tuple[str, str]:
    m = s.anthropic().messages.create(
        model="m", max_tokens=MAX_TOKENS, tools=MESSAGES_TOOLS, extra_body={"temperature": 0},
        messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": call_id, "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": RESULT},
                                         {"type": "text", "text": AFTER}]},
        ],
    )
    assert [b.type for b in m.content] == ["text"]
    return m.content[0].text, str(m.stop_reason)  # type: ignore[union-attr]


def responses_follow_up(s: LiveServer, call_id: str) -> tuple[str, str]:
    r = s.openai().responses.create(
        model="m", tools=RESPONSES_TOOLS, temperature=0, max_output_tokens=MAX_TOKENS,
        input=[
            {"role": "user", "content": QUESTION},
            {"type": "function_call", "call_id": call_id, "name": "get_weather",
             "arguments": json.dumps({"city": "Paris"})},
            {"type": "function_call_output", "call_id": call_id, "output": RESULT},
            {"role": "user", "content": AFTER},
        ],
    )
    assert [item.type for item in r.output] == ["message"]
    return r.output_text, str(r.status)


FOLLOW_UP: dict[str, Callable[[LiveServer, str], tuple[str, str]]] = {
    "chat": chat_follow_up, "messages": messages_follow_up, "responses": responses_follow_up,
}
TEXT_FINISH = {"chat": {"stop", "length"}, "messages": {"end_turn", "max_tokens"},
               "responses": {"completed", "incomplete"}}


def test_follow_up_with_the_result_answers_in_text(
    qwen: LiveServer, first_turns: dict[tuple[str, bool], tuple[Call, str]]
) -> None:
    with ThreadPoolExecutor(len(FOLLOW_UP)) as pool:
        futures = {p: pool.submit(fn, qwen, first_turns[p, False][1]) for p, fn in FOLLOW_UP.items()}
        answers = {p: future.result() for p, future in futures.items()}
    for protocol, (text, finish) in answers.items():
        assert finish in TEXT_FINISH[protocol], (protocol, finish, text)
        assert "22" in text or "sunny" in text.lower(), (protocol, text)


def test_start_log_names_the_recipe(qwen: LiveServer, first_turns: object) -> None:
    assert qwen.log is not None
    assert "recipe plain, output parser qwen2_5" in Path(qwen.log).read_text()
