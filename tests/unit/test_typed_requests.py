"""Typed request models (helios/frontends/wire.py): nested shapes decode to the domain conversation,
and a bad value anywhere is one 400 whose param is the value's path."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from helios.domain.conversation import ImagePart, ReasoningPart, TextPart, ToolCallPart, ToolResultPart
from helios.domain.model import ModelInfo
from helios.errors import BadRequest
from helios.frontends.openai import chat, completions

INFO = ModelInfo(
    model_id="org/model", aliases=("m",), created=0, max_model_len=8192, vocab_size=1000,
    default_max_tokens=256, max_concurrency=4, prefill_chunk_size=256, max_top_logprobs=20,
    prompt_logprobs=True, sampling_defaults={}, sampling_ranges={}, recipe="qwen38", has_bos=True,
    has_reasoning=True, has_tools=True,
)
PNG = b"\x89PNG\r\n\x1a\n" + bytes(32)
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
TOOL = {"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}


def _chat(**body: Any) -> chat.ChatPlan:
    return chat.decode_chat({"messages": [{"role": "user", "content": "Hi"}], **body}, INFO)


def test_a_chat_conversation_decodes_to_domain_messages() -> None:
    plan = _chat(messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "name": "ann", "content": [
            {"type": "text", "text": "Look", "cache_control": {"type": "ephemeral"}},  # extension: ignored
            {"type": "image_url", "image_url": {"url": DATA_URL, "detail": "low"}}]},
        {"role": "assistant", "content": None, "reasoning_content": "Read it.", "refusal": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"p": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "42"}]},
    ], tools=[TOOL], tool_choice={"type": "function", "function": {"name": "read"}})
    system, user, assistant, tool = plan.conversation.messages
    assert system.role == "system" and system.parts == (TextPart("Be brief."),)
    assert user.name == "ann" and user.parts[0] == TextPart("Look")
    image = user.parts[1]
    assert isinstance(image, ImagePart) and image.data == PNG and image.where == "messages[1].content[1]"
    assert assistant.parts == (ReasoningPart("Read it."), ToolCallPart("c1", "read", {"p": 1}))
    assert tool.parts == (ToolResultPart("c1", (TextPart("42"),)),)
    assert [t.name for t in plan.conversation.tools] == ["read"]
    assert plan.conversation.tool_choice.mode == "named" and plan.conversation.tool_choice.name == "read"


BAD_CHAT = [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                {"type": "image_url", "image_url": {"url": 5}}]}]},
     "messages[0].content[1].image_url.url", "expected a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]},
     "messages[0].content[0].image_url.url", "remote image downloads are unsupported"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
     "messages[0].content[0].type", "'input_audio' is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text", "missing required parameter"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "'robot' is not supported"),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "is required"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "expected a string or an array"),
    ({"messages": [{"role": "user", "content": "x", "colour": "red"}]}, "messages[0].colour", "colour"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "missing required"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "arguments must be a JSON object"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "", "arguments": "{}"}}]}]},
     "messages[1].tool_calls[0].function.name", "must be a nonempty string"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]},
     "tools[0].function.strict", "strict: true"),
    ({"tools": [TOOL, {"type": "custom", "custom": {"name": "g"}}]}, "tools[1].type", "must be 'function'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[0].function.parameters", "expected an object"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be 'auto', 'none' or 'required'"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "write"}}},
     "tool_choice.function.name", "not a declared tool"),
]


@pytest.mark.parametrize(("body", "param", "message"), BAD_CHAT, ids=[p for _, p, _ in BAD_CHAT])
def test_a_bad_chat_value_names_its_path(body: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(BadRequest) as err:
        _chat(**body)
    assert err.value.param == param and message in err.value.message, (err.value.param, err.value.message)
    assert err.value.status == 400


def test_ignored_keys_of_an_assistant_message_are_accepted_and_unused() -> None:
    plan = _chat(messages=[{"role": "user", "content": "x"},
                           {"role": "assistant", "content": "y", "refusal": "no", "audio": {"id": "a"}}])
    assert plan.conversation.messages[1].parts == (TextPart("y"),)


@pytest.mark.parametrize(("prompt", "expected"), [
    ("hi", ("hi",)), (["a", "b"], ("a", "b")), ([1, 2], ((1, 2),)), ([[1], [2, 3]], ((1,), (2, 3))),
])
def test_completion_prompts(prompt: Any, expected: tuple[Any, ...]) -> None:
    plan = completions.decode_completion({"prompt": prompt}, INFO)
    assert plan.generation.prompts == expected


@pytest.mark.parametrize(("prompt", "param"), [
    ([], "prompt"), ([[]], "prompt[0]"), (["a", 1], "prompt[1]"), ([1, "a"], "prompt[1]"), ([True], "prompt[0]"),
    (5, "prompt"), ([[1], "a"], "prompt[1]"), ([5000], "prompt"), ([[1], [5000]], "prompt[1]"),
])
def test_a_bad_completion_prompt_names_its_path(prompt: Any, param: str) -> None:
    with pytest.raises(BadRequest) as err:
        completions.decode_completion({"prompt": prompt}, INFO)
    assert err.value.param == param, err.value.message
