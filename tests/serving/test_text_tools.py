"""Tools on a model whose chat template cannot present them (SmolLM2, the default model).

Helios writes the tool prompt itself (lowering rule 8): the tool list and the `<tool_call>` JSON
convention go into the leading system message, history is written in the same convention, and the
Hermes JSON parser reads the model's calls back. Nothing is dropped silently. The scripted model
serves SmolLM2's real template through the real engine and all three chat protocols.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from helios.serving.lowering import TOOL_PROMPT_HEAD, TOOL_PROMPT_TAIL
from tests.serving.harness import ScriptedServer, Writer
from tests.serving.protocols import FINISH, PROTOCOLS, Ask, run

WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
TIME = ("get_time", {"timezone": "Europe/Paris"})


@pytest.fixture(scope="module")
def smol(servers: dict[str, ScriptedServer]) -> ScriptedServer:
    return servers["smollm2"]


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_calls_come_back_as_tool_calls(smol: ScriptedServer, protocol: str, stream: bool) -> None:
    w = Writer("smollm2")
    key = smol.book.add("Let me check.\n", w.calls(WEATHER, TIME))
    out = run(smol, protocol, Ask(f"Weather and time in Paris? {key}"), stream=stream)
    assert out.error is None, out.error
    assert out.calls == [WEATHER, TIME]
    assert out.finish == FINISH["tool_calls"][protocol]
    assert "<tool_call>" not in out.text and out.text.strip() == "Let me check."


def test_the_prompt_presents_every_tool_in_the_system_turn(smol: ScriptedServer) -> None:
    key = smol.book.add("It is sunny.")
    out = run(smol, "chat", Ask(f"Weather? {key}"), stream=False)
    assert out.error is None and out.text == "It is sunny." and not out.calls
    prompt = smol.book.prompt_text(key)
    system = prompt.split("<|im_start|>system\n", 1)[1].split("<|im_end|>", 1)[0]
    assert TOOL_PROMPT_HEAD in system and TOOL_PROMPT_TAIL in system
    listed = system.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].splitlines()
    assert [json.loads(line)["name"] for line in listed] == ["get_weather", "get_time"]
    assert json.loads(listed[0])["parameters"]["properties"]["city"]["type"] == "string"


def test_named_choice_presents_only_that_tool(smol: ScriptedServer) -> None:
    w = Writer("smollm2")
    key = smol.book.add(w.call(*TIME))
    out = run(smol, "responses", Ask(f"Time? {key}", choice="get_time"), stream=False)
    assert out.error is None and out.calls == [TIME]
    listed = smol.book.prompt_text(key).split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].splitlines()
    assert [json.loads(line)["name"] for line in listed] == ["get_time"]


def test_choice_none_presents_no_tools_and_calls_stay_text(smol: ScriptedServer) -> None:
    w = Writer("smollm2")
    key = smol.book.add(w.call(*WEATHER))
    out = run(smol, "chat", Ask(f"Weather? {key}", choice="none"), stream=False)
    assert out.error is None and not out.calls and "<tool_call>" in out.text
    assert "<tools>" not in smol.book.prompt_text(key)


def test_without_tools_the_markup_is_plain_text(smol: ScriptedServer) -> None:
    w = Writer("smollm2")
    key = smol.book.add(w.call(*WEATHER))
    out = run(smol, "messages", Ask(f"Weather? {key}", tools=()), stream=True)
    assert out.error is None and not out.calls and "get_weather" in out.text
    assert out.finish == FINISH["stop"]["messages"]


def test_required_without_a_call_fails_as_the_spec_says(smol: ScriptedServer) -> None:
    key = smol.book.add("No tools today.")
    out = run(smol, "chat", Ask(f"Weather? {key}", choice="required"), stream=False)
    assert out.error is not None and out.error_status == 500
    assert "calling at least one of the provided tools" in smol.book.prompt_text(key)


def test_history_is_written_in_the_same_convention(smol: ScriptedServer) -> None:
    """An assistant's calls become <tool_call> blocks; its results one user turn of
    <tool_response> blocks in call order (results sent out of order are put back)."""
    key = smol.book.add("It is 18 degrees and noon in Paris.")
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather and time in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(WEATHER[1])}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": json.dumps(TIME[1])}},
        ]},
        {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "user", "content": f"Thanks. {key}"},
    ]
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("get_weather", "get_time")]
    r = smol.openai().chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=64)
    assert r.choices[0].message.content == "It is 18 degrees and noon in Paris."
    prompt = smol.book.prompt_text(key)
    calls = "\n".join(
        "<tool_call>\n" + json.dumps({"name": n, "arguments": a}) + "\n</tool_call>" for n, a in (WEATHER, TIME)
    )
    assert f"<|im_start|>assistant\n{calls}<|im_end|>" in prompt
    assert (
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n12:00\n</tool_response><|im_end|>"
        in prompt
    )
    assert "<|im_start|>tool" not in prompt


def test_discovery_reports_tools(smol: ScriptedServer) -> None:
    with smol.http() as http:
        show = http.post("/api/show", json={"model": "scripted"}).json()
    assert "tools" in show["capabilities"]
