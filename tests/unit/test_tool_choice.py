"""The one tool-choice check (`common.decide_tool_choice`) as each protocol's decoder reaches it:
the neutral choice per protocol, and each protocol's own 400 wording and param."""

from __future__ import annotations

from typing import Any

import pytest

from helios.domain.conversation import ToolChoice
from helios.domain.model import ModelInfo
from helios.errors import BadRequest
from helios.frontends.anthropic import messages
from helios.frontends.common import decide_tool_choice
from helios.frontends.openai import chat, responses

INFO = ModelInfo(model_id="org/model", aliases=(), created=0, max_model_len=8192, vocab_size=100,
                 default_max_tokens=256, max_concurrency=4, prefill_chunk_size=256, max_top_logprobs=20,
                 prompt_logprobs=False, sampling_defaults={}, sampling_ranges={}, recipe="plain", has_bos=True)


def _chat(choice: Any, tools: bool) -> ToolChoice:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "tool_choice": choice}
    if tools:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    return chat.decode_chat(body, INFO).conversation.tool_choice


def _responses(choice: Any, tools: bool) -> ToolChoice:
    body: dict[str, Any] = {"input": "hi", "tool_choice": choice}
    if tools:
        body["tools"] = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    return responses.decode_responses(body, INFO).conversation.tool_choice


def _messages(choice: Any, tools: bool) -> ToolChoice:
    body: dict[str, Any] = {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tool_choice": choice}
    if tools:
        body["tools"] = [{"name": "f", "input_schema": {"type": "object"}}]
    return messages.decode_request(body, INFO).conversation.tool_choice


# (decoder, its wire choices for auto / none / required / named "f" and named "g")
PROTOCOLS = {
    "chat": (_chat, "auto", "none", "required", {"type": "function", "function": {"name": "f"}},
             {"type": "function", "function": {"name": "g'h"}}),
    "responses": (_responses, "auto", "none", "required", {"type": "function", "name": "f"},
                  {"type": "function", "name": "g'h"}),
    "messages": (_messages, {"type": "auto"}, {"type": "none"}, {"type": "any"}, {"type": "tool", "name": "f"},
                 {"type": "tool", "name": "g'h"}),
}


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_declared_tools(protocol: str) -> None:
    decode, auto, none, required, named, _ = PROTOCOLS[protocol]
    assert decode(None, True) == ToolChoice("auto")
    assert decode(auto, True) == ToolChoice("auto")
    assert decode(none, True) == ToolChoice("none")
    assert decode(required, True) == ToolChoice("required")
    assert decode(named, True) == ToolChoice("named", "f")


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_no_declared_tool(protocol: str) -> None:
    decode, auto, none, required, named, _ = PROTOCOLS[protocol]
    assert decode(None, False) == ToolChoice("none")
    assert decode(none, False) == ToolChoice("none")
    # An explicit auto stays auto on the OpenAI protocols; Messages has no tool to choose: none.
    assert decode(auto, False) == ToolChoice("none" if protocol == "messages" else "auto")
    word = "any" if protocol == "messages" else "required"
    with pytest.raises(BadRequest) as exc:
        decode(required, False)
    assert (exc.value.message, exc.value.param) == (f"tool_choice '{word}' needs at least one declared tool",
                                                     "tool_choice")
    with pytest.raises(BadRequest, match="which is not a declared tool"):
        decode(named, False)


@pytest.mark.parametrize(("protocol", "message", "param"), [
    ("chat", "tool_choice names 'g'h', which is not a declared tool", "tool_choice.function.name"),
    ("responses", "tool_choice names 'g'h', which is not a declared tool", "tool_choice.name"),
    ("messages", "tool_choice names \"g'h\", which is not a declared tool", "tool_choice.name"),
])
def test_undeclared_name_wording(protocol: str, message: str, param: str) -> None:
    decode, *_, undeclared = PROTOCOLS[protocol]
    for tools in (True, False):
        with pytest.raises(BadRequest) as exc:
            decode(undeclared, tools)
        assert (exc.value.message, exc.value.param) == (message, param)


def test_every_protocol_has_wording() -> None:
    for protocol in PROTOCOLS:
        assert decide_tool_choice(protocol, {"f"}, name="f") == ToolChoice("named", "f")
    with pytest.raises(KeyError):
        decide_tool_choice("ollama", {"f"})
