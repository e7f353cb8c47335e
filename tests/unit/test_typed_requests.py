"""Typed request models (helios/frontends/wire.py): nested shapes decode to the domain conversation,
and a bad value anywhere is one 400 whose param is the value's path (Chat Completions, Completions,
Anthropic Messages)."""

from __future__ import annotations

import base64
import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helios.domain.conversation import ImagePart, ReasoningPart, TextPart, ToolCallPart, ToolResultPart
from helios.domain.model import ModelInfo
from helios.errors import BadRequest
from helios.frontends.anthropic import messages
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


# -- Anthropic Messages ---------------------------------------------------------------------------------

B64 = base64.b64encode(PNG).decode()
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}}
CLIENT_TOOL = {"name": "read", "input_schema": {"type": "object"}}


def _messages(**body: Any) -> messages.MessagesPlan:
    return messages.decode_request({"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], **body}, INFO)


def test_a_messages_conversation_decodes_to_domain_messages() -> None:
    plan = _messages(system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}], messages=[
        {"role": "user", "content": [{"type": "text", "text": "Look", "cache_control": {"type": "ephemeral"}},
                                     IMAGE]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Read it.", "signature": messages.thinking_signature("Read it.")},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "tool_use", "id": "t1", "name": "read", "input": {"p": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "42"}, IMAGE], "cache_control": {"type": "ephemeral"}}]},
    ], tools=[CLIENT_TOOL], tool_choice={"type": "tool", "name": "read", "disable_parallel_tool_use": True})
    conv = plan.conversation
    system, user, assistant, tool = conv.messages
    assert system.role == "system" and system.parts == (TextPart("Be brief."),)
    image = user.parts[1]
    assert isinstance(image, ImagePart) and image.data == PNG and image.where == "messages[0].content[1]"
    assert assistant.parts == (ReasoningPart("Read it."), ToolCallPart("t1", "read", {"p": 1}))
    result = tool.parts[0]
    assert isinstance(result, ToolResultPart) and result.content[0] == TextPart("42")
    assert isinstance(result.content[1], ImagePart) and result.content[1].where == "messages[2].content[0].content[1]"
    assert conv.tool_choice.mode == "named" and conv.tool_choice.name == "read" and not conv.parallel_tool_calls
    assert conv.cache_breakpoints == ("Look", "42")  # the marked user blocks' texts; the system's is not one


BAD_MESSAGES = [
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                   {"role": "user", "content": [{"type": "text", "text": "a"},
                                                {**IMAGE, "source": {**IMAGE["source"], "data": "!!"}}]}]},
     "messages[2].content[1].source.data", "is not valid base64 data"),
    ({"messages": [{"role": "user", "content": [{**IMAGE, "source": {**IMAGE["source"], "media_type": "image/gif"}}]}]},
     "messages[0].content[0].source.media_type", "must be 'image/png', 'image/jpeg' or 'image/webp'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://x"}}]}]},
     "messages[0].content[0].source.type", "remote image downloads are unsupported"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages[0].content[0].type", "'tool_use' blocks belong in assistant messages"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [IMAGE]}]},
     "messages[1].content[0].type", "'image' blocks belong in user messages"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages[0].content[0].type", "'document' is not supported; expected 'text', 'image' or 'tool_result'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "text", "text": "a"}, {"type": "search_result"}]}]}]},
     "messages[0].content[0].content[1].type", "expected 'text' or 'image'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {"type": "forever"}}]}]},
     "messages[0].content[0].cache_control.type", "must be 'ephemeral'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "citations": [{"cited_text": "b"}]}]}]},
     "messages[0].content[0].citations", "citations are not supported"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "a", "signature": messages.thinking_signature("b")}]}]},
     "messages[1].content[0].signature", "does not match"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}, "caller": {"type": "code_execution_20250825"}}]}]},
     "messages[1].content[0].caller", "only direct tool calls"),
    ({"messages": [{"role": "user", "content": "x", "colour": "red"}]}, "messages[0].colour", "colour"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "'robot' is not supported"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "missing required parameter"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]}, "tools[0].type",
     "hosted and server tools are unsupported"),
    ({"tools": [CLIENT_TOOL, {"name": "g", "input_schema": {}, "strict": True}]}, "tools[1].strict", "strict: true"),
    ({"tools": [CLIENT_TOOL, CLIENT_TOOL]}, "tools[1].name", "declared twice"),
    ({"tool_choice": {"type": "none", "disable_parallel_tool_use": True}},
     "tool_choice.disable_parallel_tool_use", "unrecognized"),
    ({"tools": [CLIENT_TOOL], "tool_choice": {"type": "tool", "name": "write"}}, "tool_choice.name",
     "not a declared tool"),
    ({"system": [{"type": "image"}]}, "system[0].type", "must be 'text'"),
    ({"cache_control": {"type": "ephemeral", "ttl": "2h"}}, "cache_control.ttl", "must be '5m' or '1h'"),
]


@pytest.mark.parametrize(("body", "param", "message"), BAD_MESSAGES, ids=[p for _, p, _ in BAD_MESSAGES])
def test_a_bad_messages_value_names_its_path(body: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(BadRequest) as err:
        _messages(**body)
    assert err.value.param == param and message in err.value.message, (err.value.param, err.value.message)
    assert err.value.status == 400


def test_message_level_control_metadata_is_ignored() -> None:
    plain = _messages()
    marked = _messages(messages=[{"role": "user", "content": "Hi", "output_config": {"effort": "low"},
                                  "cache_control": {"type": "anything"}, "metadata": 5}])
    assert marked == plain


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=8)
VALID = {"max_tokens": 8, "system": [{"type": "text", "text": "S"}], "tools": [CLIENT_TOOL],
         "tool_choice": {"type": "auto"}, "messages": [
             {"role": "user", "content": [{"type": "text", "text": "a"}, IMAGE]},
             {"role": "assistant", "content": [{"type": "thinking", "thinking": "t"},
                                               {"type": "tool_use", "id": "t1", "name": "read", "input": {}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [IMAGE]}]}]}


def _paths(value: Any, here: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [here]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*here, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*here, i))
    return out


def _replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    out = copy.copy(value)
    out[path[0]] = _replace(value[path[0]], path[1:], new)
    return out


@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.data())
def test_any_value_anywhere_in_a_messages_body_decodes_or_is_a_400_naming_a_path(data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(_paths(VALID)[1:]), label="path")
    body = _replace(VALID, path, data.draw(JSON, label="value"))
    try:
        messages.decode_request(body, INFO)
    except BadRequest as exc:
        assert exc.status == 400 and exc.param is not None
        assert exc.param.split(".")[0].split("[")[0] == path[0], (path, exc.param)  # under the replaced field
