"""Typed request models (helios/frontends/wire.py): nested shapes decode to the domain conversation,
and a bad value anywhere is one 400 whose param is the value's path (Chat Completions, Completions,
Responses, Anthropic Messages)."""

from __future__ import annotations

import base64
import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helios.domain.conversation import (
    ImagePart,
    ReasoningPart,
    TextPart,
    ToolCallPart,
    ToolChoice,
    ToolGrammar,
    ToolResultPart,
)
from helios.domain.model import ModelInfo
from helios.errors import BadRequest
from helios.frontends.anthropic import messages
from helios.frontends.fields import FieldTable, screen_fields
from helios.frontends.openai import chat, completions, responses
from helios.frontends.wire import DETAILED, FAST

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


# -- Responses ------------------------------------------------------------------------------------------


def _responses(**body: Any) -> responses.ResponsesPlan:
    return responses.decode_responses({"input": "Hi", **body}, INFO)


def test_a_responses_conversation_decodes_to_domain_messages() -> None:
    plan = _responses(instructions="Be brief.", input=[
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Look"}, {"type": "input_image", "image_url": DATA_URL, "detail": "low"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "unused"}],
         "content": [{"type": "reasoning_text", "text": "Read it."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed", "content": [
            {"type": "output_text", "text": "Reading.", "annotations": []}, {"type": "refusal", "refusal": "Not that."}]},
        {"type": "function_call", "call_id": "c1", "name": "read", "namespace": "fs", "arguments": '{"p": 1}'},
        {"type": "custom_tool_call", "call_id": "c2", "name": "patch", "input": "*** Begin"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_text", "text": "42"}, {"type": "input_image", "image_url": DATA_URL}]},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "done"},
    ], tools=[{"type": "namespace", "name": "fs", "description": "files", "tools": [
        {"type": "function", "name": "read", "strict": False, "parameters": {"type": "object"}}]},
        {"type": "custom", "name": "patch", "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}],
        tool_choice={"type": "function", "name": "fs__read"})
    system, developer, user, assistant, out1, out2 = plan.conversation.messages
    assert system.parts == (TextPart("Be brief."),) and developer.parts == (TextPart("Use tools."),)
    image = user.parts[1]
    assert user.parts[0] == TextPart("Look")
    assert isinstance(image, ImagePart) and image.data == PNG and image.where == "input[1].content[1]"
    assert assistant.parts == (ReasoningPart("Read it."), TextPart("Reading."), TextPart("Not that."),
                               ToolCallPart("c1", "fs__read", {"p": 1}), ToolCallPart("c2", "patch", {"input": "*** Begin"}))
    result = out1.parts[0]
    assert isinstance(result, ToolResultPart) and result.tool_call_id == "c1" and result.content[0] == TextPart("42")
    assert isinstance(result.content[1], ImagePart) and result.content[1].where == "input[6].output[1]"
    assert out2.parts == (ToolResultPart("c2", (TextPart("done"),)),)
    tools = plan.conversation.tools
    assert [(t.name, t.kind) for t in tools] == [("fs__read", "function"), ("patch", "custom")]
    assert tools[1].grammar == ToolGrammar("lark", "start: /.+/")
    assert plan.conversation.tool_choice == ToolChoice("named", "fs__read")
    assert plan.toolset.restore("fs__read").namespace == "fs"


R_IMAGE = {"type": "input_image", "image_url": DATA_URL}
R_USER = {"role": "user", "content": [{"type": "input_text", "text": "a"}, R_IMAGE]}
BAD_RESPONSES = [
    ({"input": [R_USER, {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                                     {"type": "input_image", "image_url": 5}]}]},
     "input[1].content[1].image_url", "expected a string"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
     "input[0].content[0].image_url", "input[0].content[0]: images must be base64 data URLs"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/gif;base64,R0lG"}]}]},
     "input[0].content[0].image_url", "base64 PNG, JPEG or WebP"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,!!"}]}]},
     "input[0].content[0].image_url", "invalid base64 image data"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]},
     "input[0].content[0].file_id", "file_id images are unsupported"),
    ({"input": [{"role": "system", "content": [R_IMAGE]}]}, "input[0].content[0].type",
     "images are accepted in user messages and tool outputs only"),
    ({"input": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]}, "input[0].content[0].type",
     "refusal parts belong in assistant messages"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type",
     "file inputs are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "input[0].content[0].type",
     "'input_audio' is not supported; expected 'input_text', 'output_text', 'refusal' or 'input_image'"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text",
     "missing required parameter"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "must be 'user', 'system', 'developer'"),
    ({"input": [{"content": "x"}]}, "input[0].role", "missing required parameter"),
    ({"input": [{"type": None, "role": "user", "content": "x"}]}, "input[0].type", "is required"),  # absent is not null
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content", "expected a string or an array"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "item references need stored responses"),
    ({"input": [{"type": "computer_call"}]}, "input[0].type", "'computer_call' is not supported"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
     "input[0].arguments", "arguments must be a JSON object"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]},
     "input[0].arguments", "must be a JSON string"),
    ({"input": [{"type": "function_call", "call_id": "", "name": "f"}]}, "input[0].call_id",
     "must be a nonempty string"),
    ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "f", "input": 1}]}, "input[0].input",
     "expected a string"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "refusal", "refusal": "x"}]}]},
     "input[0].output[0].type", "expected 'input_text', 'output_text' or 'input_image'"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "opaque"}]}, "input[0].encrypted_content",
     "opaque encrypted reasoning is not supported"),
    ({"input": [{"type": "reasoning", "content": [{"type": "summary_text", "text": "x"}]}]},
     "input[0].content[0].type", "must be 'reasoning_text'"),
    ({"input": []}, "input", "at least one item"),
    ({"input": 5}, "input", "expected a string or an array"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "{}"}]}, "tools[0].parameters", "expected an object"),
    ({"tools": [{"type": "function", "name": "f", "strict": True}]}, "tools[0].strict", "strict: true"),
    ({"tools": [{"type": "function", "name": ""}]}, "tools[0].name", "must be a nonempty string"),
    ({"tools": [{"type": "custom", "name": "g", "format": {"type": "grammar", "syntax": "ebnf", "definition": "a"}}]},
     "tools[0].format.syntax", "must be 'lark' or 'regex'"),
    ({"tools": [{"type": "custom", "name": "g", "format": {"type": "grammar", "syntax": "lark", "definition": " "}}]},
     "tools[0].format.definition", "must be a nonempty string"),
    ({"tools": [{"type": "custom", "name": "g", "format": {"type": "grammar", "syntax": "lark", "definition": "a",
                                                           "flags": 1}}]},
     "tools[0].format.flags", "unrecognized"),
    ({"tools": [{"type": "custom", "name": "g", "format": {"type": "json"}}]}, "tools[0].format.type",
     "'json' is not supported"),
    ({"tools": [{"type": "namespace", "name": "fs", "tools": [{"type": "web_search"}]}]}, "tools[0].tools[0].type",
     "expected 'function' or 'custom'"),
    ({"tools": [{"type": "namespace", "name": "fs", "tools": []}]}, "tools[0].tools", "nonempty array"),
    ({"tools": [{"type": "function", "name": "fs__read"}, {"type": "namespace", "name": "fs", "tools": [
        {"type": "function", "name": "read"}]}]}, "tools[1].tools[0].name", "ambiguous"),
    ({"tools": [{"type": "hosted_thing"}]}, "tools[0].type", "'hosted_thing' is not supported"),
    ({"tool_choice": "required"}, "tool_choice", "needs at least one declared tool"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be 'auto', 'none' or 'required'"),
    ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice.type", "must be 'function' or 'custom'"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "custom", "name": "f"}},
     "tool_choice.type", "is a function tool"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice.name", "not a declared tool"),
    ({"text": {"verbosity": "loud"}}, "text.verbosity", "must be 'low', 'medium' or 'high'"),
    ({"text": {"format": {"type": "text"}, "colour": 1}}, "text.colour", "unrecognized"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", "must be 'none', 'minimal'"),
    ({"reasoning": {"summary": "long"}}, "reasoning.summary", "must be 'auto', 'concise' or 'detailed'"),
    ({"reasoning": {"colour": 1}}, "reasoning.colour", "unrecognized"),
]


@pytest.mark.parametrize(("body", "param", "message"), BAD_RESPONSES, ids=[p for _, p, _ in BAD_RESPONSES])
def test_a_bad_responses_value_names_its_path(body: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(BadRequest) as err:
        _responses(**body)
    assert err.value.param == param and message in err.value.message, (err.value.param, err.value.message)
    assert err.value.status == 400


def test_a_hosted_responses_tool_keeps_the_param_clients_key_on() -> None:
    with pytest.raises(BadRequest) as err:
        _responses(tools=[{"type": "function", "name": "f"}, {"type": "code_interpreter", "container": {}}])
    assert err.value.param == "tools" and err.value.message.startswith("tools[1].type: hosted tool type")


def test_responses_items_and_parts_ignore_keys_helios_does_not_read() -> None:
    plain = _responses(input=[{"role": "user", "content": [{"type": "input_text", "text": "a"}]},
                              {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}],
                       tools=[{"type": "function", "name": "f"}])
    marked = _responses(input=[{"role": "user", "id": "m1", "status": "completed", "content": [
        {"type": "input_text", "text": "a", "annotations": []}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "id": "fc_1", "status": "done"}],
        tools=[{"type": "function", "name": "f", "defer_loading": False}])
    assert marked.conversation == plain.conversation


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


VALID_RESPONSES = {
    "instructions": "S", "tool_choice": "auto", "text": {"verbosity": "low"},  # cross-field checks aside
    "reasoning": {"effort": "low", "summary": "auto"},
    "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object"}},
              {"type": "custom", "name": "patch", "format": {"type": "grammar", "syntax": "lark", "definition": "a"}},
              {"type": "namespace", "name": "fs", "tools": [{"type": "function", "name": "read"}]}],
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, R_IMAGE]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "read", "namespace": "fs", "arguments": "{}"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "patch", "input": "a"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "x"}, R_IMAGE]},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "ok"}]}
VALID_CHAT = {
    "tools": [TOOL], "tool_choice": "auto", "messages": [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": DATA_URL}}]},
        {"role": "assistant", "content": None, "reasoning_content": "r",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "x"}]}]}
PROPERTY_BODIES = {
    "chat": (VALID_CHAT, lambda body: chat.decode_chat(body, INFO)),
    "messages": (VALID, lambda body: messages.decode_request(body, INFO)),
    "responses": (VALID_RESPONSES, lambda body: responses.decode_responses(body, INFO)),
}
WIRES: dict[str, tuple[FieldTable, type]] = {
    "chat": (chat.CHAT_FIELDS, chat.ChatWire),
    "messages": (messages.MESSAGES_FIELDS, messages.MessagesWire),
    "responses": (responses.RESPONSES_FIELDS, responses.ResponsesWire),
}


@pytest.mark.parametrize("protocol", list(PROPERTY_BODIES))
@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.data())
def test_any_value_anywhere_in_a_body_decodes_or_is_a_400_naming_a_path(protocol: str, data: st.DataObject) -> None:
    valid, decode = PROPERTY_BODIES[protocol]
    decode(valid)  # the body itself is valid
    path = data.draw(st.sampled_from(_paths(valid)[1:]), label="path")
    body = _replace(valid, path, data.draw(JSON, label="value"))
    try:
        decode(body)
    except BadRequest as exc:
        assert exc.status == 400 and exc.param is not None
        assert exc.param.split(".")[0].split("[")[0] == path[0], (path, exc.param)  # under the replaced field


@pytest.mark.parametrize("protocol", list(PROPERTY_BODIES))
@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.data())
def test_the_fast_and_detailed_converters_agree(protocol: str, data: st.DataObject) -> None:
    """wire.FAST (its own generated functions, builders called directly) and wire.DETAILED (cattrs'
    functions, then the builders) take the same bodies to equal values, or both refuse them."""
    valid = PROPERTY_BODIES[protocol][0]
    table, wire_class = WIRES[protocol]
    path = data.draw(st.sampled_from(_paths(valid)[1:]), label="path")
    try:
        body = screen_fields(_replace(valid, path, data.draw(JSON, label="value")), table)
    except BadRequest:
        return
    results = []
    for converter in (FAST, DETAILED):
        try:
            results.append(converter.structure(body, wire_class))
        except Exception as exc:  # any failure: both must fail
            results.append(type(exc))
    fast, detailed = results
    assert (isinstance(fast, type) and isinstance(detailed, type)) or fast == detailed, (path, fast, detailed)
