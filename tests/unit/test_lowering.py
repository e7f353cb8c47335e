"""lower_conversation: one lowering of the neutral conversation for every chat protocol."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from helios.domain.conversation import (
    ConversationRequest,
    ImagePart,
    Message,
    ReasoningPart,
    Role,
    TextPart,
    Tool,
    ToolCallPart,
    ToolChoice,
    ToolResultPart,
)
from helios.loaders.chat_template import ChatTemplate, ChatTemplateError, TemplateRaisedError
from helios.serving.lowering import (
    REQUIRED_SINGLE_TOOL_INSTRUCTION,
    REQUIRED_TOOL_INSTRUCTION,
    LoweringError,
    lower_conversation,
    reorder_tool_results,
)
from tests.shared_fixtures import shared_fixtures


def _fixture_dir() -> Path | None:
    return shared_fixtures("chat_templates")


FIXTURES = _fixture_dir()
needs_fixtures = pytest.mark.skipif(FIXTURES is None, reason="shared/fixtures/chat_templates not found")
FIXTURE_NAMES = sorted(p.stem for p in FIXTURES.glob("*.jinja")) if FIXTURES else []


def load(name: str) -> ChatTemplate:
    assert FIXTURES is not None
    return ChatTemplate((FIXTURES / f"{name}.jinja").read_text(encoding="utf-8"))


# A ChatML template that renders every message, tool calls and the tool list: easy to read in tests.
CHATML = ChatTemplate(
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call id={{ c.id }}>{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}</call>{% endfor %}"
    "{% if m.tool_call_id %}[for {{ m.tool_call_id }}]{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Renders only messages[0] as a system message; other system messages vanish.
FIRST_SYSTEM_ONLY = ChatTemplate(
    "{% for m in messages %}{% if m.role != 'system' or loop.first %}<|{{ m.role }}|>{{ m.content }}{{ '\\n' }}"
    "{% endif %}{% endfor %}"
)


def msg(role: Role, *parts: str | Any, name: str | None = None) -> Message:
    return Message(role, tuple(TextPart(p) if isinstance(p, str) else p for p in parts), name=name)


def call(call_id: str, name: str = "get_weather", **arguments: Any) -> ToolCallPart:
    return ToolCallPart(call_id, name, arguments)


def result(call_id: str, *content: str | ImagePart) -> ToolResultPart:
    return ToolResultPart(call_id, tuple(TextPart(c) if isinstance(c, str) else c for c in content))


WEATHER = Tool(
    "get_weather", "Current weather", {"type": "object", "properties": {"city": {"type": "string"}}}
)
TIME = Tool("get_time", None, {"type": "object", "properties": {"tz": {"type": "string"}}})


def request(*messages: Message, **kwargs: Any) -> ConversationRequest:
    return ConversationRequest(messages=messages, **kwargs)


def roles(messages: list[dict[str, Any]]) -> list[str]:
    return [m["role"] for m in messages]


# -- golden renders with fixture templates ------------------------------------------------------


@needs_fixtures
def test_smollm2_golden() -> None:
    req = request(msg("user", "Hi"), msg("assistant", "Hello!"), msg("user", "Bye"))
    prompt = lower_conversation(req, load("smollm2"))
    assert prompt.text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )


@needs_fixtures
def test_qwen3_golden_tools_reasoning_and_parallel_results() -> None:
    req = request(
        msg("system", "Be brief."),
        msg("user", "Weather and time in Paris?"),
        msg(
            "assistant", ReasoningPart("Two calls."), call("a", city="Paris"), call("b", "get_time", tz="CET")
        ),
        # supplied out of order: normalized to call order before rendering
        msg("tool", result("b", "12:00")),
        msg("tool", result("a", "18C")),
        tools=(WEATHER, TIME),
        chat_template_kwargs={"enable_thinking": False},
    )
    prompt = lower_conversation(req, load("qwen3"))
    tools_json = "\n".join(json.dumps(t, ensure_ascii=False) for t in prompt.tools or [])
    assert prompt.text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with "
        "the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{tools_json}\n</tools>\n\nFor each function call, return a json object with function name "
        "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather and time in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nTwo calls.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n12:00\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert prompt.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        },
        {
            "type": "function",
            "function": {
                "name": "get_time",
                "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}},
            },
        },
    ]


@needs_fixtures
def test_gemma3_golden() -> None:
    req = request(msg("system", "Be brief."), msg("user", "Part one.", "Part two."))
    prompt = lower_conversation(req, load("gemma3"), bos_token="<bos>")
    assert prompt.text == (
        "<bos><start_of_turn>user\nBe brief.\n\nPart one.\n\nPart two.<end_of_turn>\n<start_of_turn>model\n"
    )


@needs_fixtures
def test_deepseek_v3_1_gets_json_text_arguments() -> None:
    req = request(
        msg("user", "Q"),
        msg("assistant", call("c1", city="Paris")),
        msg("tool", result("c1", "R")),
    )
    prompt = lower_conversation(req, load("deepseek_v3_1"), bos_token="<BOS>")
    assert prompt.messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert prompt.text == (
        "<BOS><｜User｜>Q<｜Assistant｜></think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather"
        '<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'
        "<｜tool▁output▁begin｜>R<｜tool▁output▁end｜>"
    )


# gemma3 has no tool role (its own alternation check rejects it).
@needs_fixtures
@pytest.mark.parametrize("name", [n for n in FIXTURE_NAMES if n != "gemma3"])
def test_every_fixture_lowers_a_full_conversation(name: str) -> None:
    req = request(
        msg("system", "Be brief."),
        msg("user", "Weather in Paris?"),
        msg("assistant", ReasoningPart("Call it."), call("c1", city="Paris")),
        msg("tool", result("c1", "18C")),
        msg("assistant", "It is 18C."),
        msg("user", "Thanks"),
        tools=(WEATHER,),
    )
    prompt = lower_conversation(req, load(name))
    assert "18C" in prompt.text
    assert "Thanks" in prompt.text
    assert "{'city'" not in prompt.text


@needs_fixtures
def test_template_raise_exception_surfaces_as_template_error() -> None:
    req = request(msg("user", "a"), msg("user", "b"))
    with pytest.raises(TemplateRaisedError, match="alternate") as info:
        lower_conversation(req, load("gemma3"))
    assert info.value.http_status == 400


# -- system and developer instructions ----------------------------------------------------------


def test_developer_messages_merge_all_instructions_into_one_leading_system_message() -> None:
    req = request(
        msg("system", "S1"),
        msg("user", "u1"),
        msg("developer", "D1", "D1b"),
        msg("assistant", "a1"),
        msg("system", "S2"),
        msg("system", "   "),  # empty: produces nothing
        msg("user", "u2"),
    )
    prompt = lower_conversation(req, CHATML)
    assert prompt.messages == [
        {"role": "system", "content": "System:\nS1\n\nDeveloper:\nD1\n\nD1b\n\nSystem:\nS2"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u2"},
    ]


def test_developer_only_is_labelled_too() -> None:
    req = request(msg("user", "u"), msg("developer", "D"))
    assert lower_conversation(req, CHATML).messages[0] == {"role": "system", "content": "Developer:\nD"}


@needs_fixtures
def test_developer_merge_golden_qwen3() -> None:
    req = request(msg("developer", "Answer in French."), msg("system", "Be brief."), msg("user", "Hi"))
    prompt = lower_conversation(req, load("qwen3"))
    assert prompt.text == (
        "<|im_start|>system\nDeveloper:\nAnswer in French.\n\nSystem:\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_empty_developer_and_system_messages_produce_nothing() -> None:
    req = request(msg("system", ""), msg("developer"), msg("user", "u"))
    prompt = lower_conversation(req, CHATML)
    assert prompt.messages == [{"role": "user", "content": "u"}]
    assert prompt.text == "<|user|>u\n<|assistant|>"


def test_without_developer_system_messages_stay_in_place_when_inline_is_supported() -> None:
    assert CHATML.supports_inline_system()
    req = request(msg("system", "S"), msg("user", "u"), msg("system", "S2"), msg("user", "v"))
    prompt = lower_conversation(req, CHATML)
    assert roles(prompt.messages) == ["system", "user", "system", "user"]
    assert prompt.messages[2] == {"role": "system", "content": "S2"}


def test_inline_system_becomes_wrapped_user_message_when_unsupported() -> None:
    assert not FIRST_SYSTEM_ONLY.supports_inline_system()
    req = request(
        msg("system", "Lead"),
        msg("user", "u"),
        msg("assistant", "a"),
        msg("system", "Now ", "be formal."),
        msg("user", "v"),
    )
    prompt = lower_conversation(req, FIRST_SYSTEM_ONLY)
    assert prompt.messages == [
        {"role": "system", "content": "Lead"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "<system>Now \n\nbe formal.</system>"},
        {"role": "user", "content": "v"},
    ]


def test_first_message_system_is_the_only_leading_one() -> None:
    req = request(msg("user", "u"), msg("system", "S"))
    assert lower_conversation(req, FIRST_SYSTEM_ONLY).messages == [
        {"role": "user", "content": "u"},
        {"role": "user", "content": "<system>S</system>"},
    ]


@needs_fixtures
@pytest.mark.parametrize(("name", "wrapped"), [("qwen3", False), ("smollm2", False), ("qwen3_5", True)])
def test_inline_system_on_fixtures(name: str, wrapped: bool) -> None:
    req = request(
        msg("system", "Lead"),
        msg("user", "u"),
        msg("assistant", "a"),
        msg("system", "Late"),
        msg("user", "v"),
    )
    prompt = lower_conversation(req, load(name))
    if wrapped:  # qwen3_5 raises "System message must be at the beginning."
        assert prompt.messages[3] == {"role": "user", "content": "<system>Late</system>"}
        assert "<|im_start|>user\n<system>Late</system><|im_end|>" in prompt.text
    else:
        assert prompt.messages[3] == {"role": "system", "content": "Late"}
        assert "<|im_start|>system\nLate<|im_end|>" in prompt.text
    assert prompt.messages[0] == {"role": "system", "content": "Lead"}


# -- parts ---------------------------------------------------------------------------------------


def test_text_parts_join_with_blank_lines_and_names_pass_through() -> None:
    req = request(msg("user", "a", "b", name="ann"))
    assert lower_conversation(req, CHATML).messages == [{"role": "user", "content": "a\n\nb", "name": "ann"}]


def test_assistant_parts() -> None:
    req = request(
        msg("user", "u"),
        msg("assistant", ReasoningPart("r1"), ReasoningPart("r2"), "text", call("c1", city="Paris")),
        msg("tool", result("c1", "ok")),
    )
    messages = lower_conversation(req, CHATML).messages
    assert messages[1] == {
        "role": "assistant",
        "content": "text",
        "reasoning_content": "r1\n\nr2",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    }
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "ok"}


def test_tool_results_inside_a_user_message_split_in_place() -> None:
    # Anthropic: one user message holding tool_result blocks, then text.
    req = request(
        msg("user", "u"),
        msg("assistant", call("a"), call("b")),
        msg("user", result("a", "A"), result("b", "B"), "And now?"),
    )
    messages = lower_conversation(req, CHATML).messages
    assert messages[2:] == [
        {"role": "tool", "tool_call_id": "a", "content": "A"},
        {"role": "tool", "tool_call_id": "b", "content": "B"},
        {"role": "user", "content": "And now?"},
    ]


def test_images_become_content_blocks_and_are_listed_in_prompt_order() -> None:
    img1, img2, img3 = (ImagePart("image/png", bytes([i])) for i in range(3))
    req = request(
        msg("user", "look", img1),
        msg("assistant", call("a"), call("b")),
        msg("tool", result("b", "second", img3)),
        msg("tool", result("a", img2)),
    )
    prompt = lower_conversation(req, CHATML)
    assert prompt.messages[0]["content"] == [{"type": "text", "text": "look"}, {"type": "image"}]
    assert prompt.messages[2] == {"role": "tool", "tool_call_id": "a", "content": [{"type": "image"}]}
    assert prompt.images == (img1, img2, img3)  # results moved with their images


# -- tool-result reordering ---------------------------------------------------------------------


def tool_msg(call_id: str, content: str | None = None) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": content or f"result {call_id}"}


def assistant_calls(*ids: str) -> dict[str, Any]:
    calls = [{"id": i, "type": "function", "function": {"name": "f", "arguments": {}}} for i in ids]
    return {"role": "assistant", "content": "", "tool_calls": calls}


USER = {"role": "user", "content": "u"}


def test_results_are_put_in_call_order() -> None:
    messages = [USER, assistant_calls("a", "b", "c"), tool_msg("c"), tool_msg("a"), tool_msg("b")]
    assert reorder_tool_results(messages) == [USER, messages[1], tool_msg("a"), tool_msg("b"), tool_msg("c")]


def test_intervening_messages_keep_their_positions() -> None:
    note = {"role": "user", "content": "note"}
    messages = [USER, assistant_calls("a", "b"), tool_msg("b"), note, tool_msg("a")]
    assert reorder_tool_results(messages) == [USER, messages[1], tool_msg("a"), note, tool_msg("b")]


def test_a_subset_of_the_calls_is_still_ordered() -> None:
    messages = [USER, assistant_calls("a", "b", "c"), tool_msg("c"), tool_msg("a")]
    assert reorder_tool_results(messages)[2:] == [tool_msg("a"), tool_msg("c")]


@pytest.mark.parametrize(
    "results",
    [
        [tool_msg("b"), tool_msg("b"), tool_msg("a")],  # duplicate id
        [tool_msg("b"), tool_msg("zzz")],  # unknown id
        [tool_msg("b"), tool_msg("")],  # missing id
        [tool_msg("b"), {"role": "tool", "content": "no id"}],  # missing id key
    ],
)
def test_ambiguous_groups_stay_as_supplied(results: list[dict[str, Any]]) -> None:
    messages = [USER, assistant_calls("a", "b"), *results]
    assert reorder_tool_results(messages) == messages


def test_duplicate_call_ids_leave_the_group_as_supplied() -> None:
    messages = [USER, assistant_calls("a", "a", "b"), tool_msg("b"), tool_msg("a")]
    assert reorder_tool_results(messages) == messages


def test_results_never_move_across_another_assistant_message() -> None:
    later = {"role": "assistant", "content": "partial"}
    messages = [USER, assistant_calls("a", "b"), tool_msg("b"), later, tool_msg("a")]
    assert reorder_tool_results(messages) == messages


def test_each_assistant_orders_its_own_group() -> None:
    messages = [
        USER,
        assistant_calls("a", "b"),
        tool_msg("b"),
        tool_msg("a"),
        assistant_calls("c", "d"),
        tool_msg("d"),
        tool_msg("c"),
    ]
    out = reorder_tool_results(messages)
    assert [m.get("tool_call_id") for m in out] == [None, None, "a", "b", None, "c", "d"]


def test_reordering_applies_in_lower_conversation() -> None:
    req = request(
        msg("user", "u"),
        msg("assistant", call("a"), call("b")),
        msg("tool", result("b", "B")),
        msg("user", "meanwhile"),
        msg("tool", result("a", "A")),
    )
    messages = lower_conversation(req, CHATML).messages
    assert [(m["role"], m.get("tool_call_id")) for m in messages[2:]] == [
        ("tool", "a"),
        ("user", None),
        ("tool", "b"),
    ]
    assert messages[2]["content"] == "A"


# -- tools and tool_choice ----------------------------------------------------------------------


def test_auto_presents_every_tool() -> None:
    prompt = lower_conversation(request(msg("user", "u"), tools=(WEATHER, TIME)), CHATML)
    assert prompt.text.startswith("<tools>get_weather;get_time;</tools>\n")


def test_none_presents_no_tools_unless_asked() -> None:
    req = request(msg("user", "u"), tools=(WEATHER,), tool_choice=ToolChoice("none"))
    prompt = lower_conversation(req, CHATML)
    assert prompt.tools is None
    assert "<tools>" not in prompt.text
    kept = lower_conversation(req, CHATML, present_tools_when_none=True)
    assert kept.text.startswith("<tools>get_weather;</tools>")


def test_named_presents_only_the_selected_tool_and_adds_no_instruction() -> None:
    req = request(msg("user", "u"), tools=(WEATHER, TIME), tool_choice=ToolChoice("named", "get_time"))
    prompt = lower_conversation(req, CHATML)
    assert prompt.text == "<tools>get_time;</tools>\n<|user|>u\n<|assistant|>"


def test_named_unknown_tool_is_rejected() -> None:
    req = request(msg("user", "u"), tools=(WEATHER,), tool_choice=ToolChoice("named", "nope"))
    with pytest.raises(LoweringError) as info:
        lower_conversation(req, CHATML)
    assert info.value.http_status == 400


def test_required_adds_the_instruction_to_the_leading_system_message() -> None:
    req = request(msg("system", "S"), msg("user", "u"), tools=(WEATHER,), tool_choice=ToolChoice("required"))
    assert lower_conversation(req, CHATML).messages[0] == {
        "role": "system",
        "content": f"S\n\n{REQUIRED_TOOL_INSTRUCTION}",
    }
    single = request(
        msg("user", "u"), tools=(WEATHER,), tool_choice=ToolChoice("required"), parallel_tool_calls=False
    )
    assert lower_conversation(single, CHATML).messages[0] == {
        "role": "system",
        "content": REQUIRED_SINGLE_TOOL_INSTRUCTION,
    }


def test_required_with_developer_messages_adds_a_labelled_section() -> None:
    req = request(
        msg("developer", "D"), msg("user", "u"), tools=(WEATHER,), tool_choice=ToolChoice("required")
    )
    assert lower_conversation(req, CHATML).messages[0]["content"] == (
        f"Developer:\nD\n\nSystem:\n{REQUIRED_TOOL_INSTRUCTION}"
    )


def test_required_without_tools_is_rejected() -> None:
    with pytest.raises(LoweringError, match="required"):
        lower_conversation(request(msg("user", "u"), tool_choice=ToolChoice("required")), CHATML)


def test_custom_tools_without_a_schema_take_an_input_string() -> None:
    patch = Tool("apply_patch", "Apply a patch", {}, kind="custom")
    bare = Tool("ping", None, {})
    prompt = lower_conversation(request(msg("user", "u"), tools=(patch, bare)), CHATML)
    assert prompt.tools == [
        {
            "type": "function",
            "function": {
                "name": "apply_patch",
                "description": "Apply a patch",
                "parameters": {
                    "type": "object",
                    "properties": {"input": {"type": "string"}},
                    "required": ["input"],
                },
            },
        },
        {
            "type": "function",
            "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}},
        },
    ]


# -- pass-through flags ---------------------------------------------------------------------------


def test_add_generation_prompt_passes_through() -> None:
    req = request(msg("user", "u"), add_generation_prompt=False)
    assert lower_conversation(req, CHATML).text == "<|user|>u\n"


def test_continue_final_message() -> None:
    req = request(
        msg("user", "u"),
        msg("assistant", "The answer is"),
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert lower_conversation(req, CHATML).text == "<|user|>u\n<|assistant|>The answer is"


@needs_fixtures
def test_continue_final_message_qwen3() -> None:
    req = request(
        msg("user", "u"),
        msg("assistant", "Bonjour"),
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert lower_conversation(req, load("qwen3")).text == (
        "<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nBonjour"
    )


def test_continue_final_message_with_generation_prompt_is_an_error() -> None:
    req = request(msg("user", "u"), msg("assistant", "x"), continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="add_generation_prompt"):
        lower_conversation(req, CHATML)


def test_template_kwargs_request_overrides_server_defaults() -> None:
    template = ChatTemplate("{{ enable_thinking }} {{ effort }}")
    req = request(msg("user", "u"), chat_template_kwargs={"enable_thinking": False})
    text = lower_conversation(req, template, extra_kwargs={"enable_thinking": True, "effort": "low"}).text
    assert text == "False low"


def test_template_kwargs_cannot_replace_lowering_variables() -> None:
    req = request(msg("user", "u"), chat_template_kwargs={"messages": []})
    with pytest.raises(LoweringError, match="messages"):
        lower_conversation(req, CHATML)


def test_bos_and_eos_tokens_pass_through() -> None:
    template = ChatTemplate("{{ bos_token }}{{ messages[0].content }}{{ eos_token }}")
    prompt = lower_conversation(request(msg("user", "u")), template, bos_token="<s>", eos_token="</s>")
    assert prompt.text == "<s>u</s>"


# -- rule 8: text tools for templates that cannot present tools ------------------------------------

# Whether each fixture template presents `tools`, and how Helios then takes tools.
TOOL_SUPPORT = {
    "smollm2": ("text", "hermes"),  # ChatML that ignores tools: Helios writes the prompt
    "gemma3": ("text", "hermes"),
    "smollm3": ("text", "qwen3"),  # its template reads other variables; Hermes JSON calls
    "deepseek_v3_1": (None, "deepseek_v3_1"),  # renders no tools, and its syntax has no written prompt
    "qwen3": ("native", "qwen3"),
    "qwen3_5": ("native", "qwen3_coder"),
    "glm4_6": ("native", "glm"),
    "gpt_oss": ("native", "harmony"),
    "gemma4": ("native", "gemma4"),
}


@needs_fixtures
@pytest.mark.parametrize("name", sorted(TOOL_SUPPORT))
def test_tool_support_per_template(name: str) -> None:
    from helios.recipes import detect_parser_family
    from helios.serving.service_factory import tool_support

    assert FIXTURES is not None
    source = (FIXTURES / f"{name}.jinja").read_text(encoding="utf-8")
    support = tool_support(ChatTemplate(source), detect_parser_family(source))
    assert (support.mode, support.parser_family) == TOOL_SUPPORT[name]
    assert (support.mode is None) == bool(support.reason)


def test_unknown_tool_syntax_on_a_template_that_presents_tools_is_refused() -> None:
    from helios.serving.service_factory import tool_support

    source = "{% for t in tools or [] %}{{ t.function.name }}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    support = tool_support(ChatTemplate(source), "plain")
    assert support.mode is None and "recipe" in support.reason
    assert tool_support(None, "hermes").mode is None


def test_text_tools_history_keeps_image_blocks_and_merges_result_runs() -> None:
    from helios.serving.lowering import tools_as_text

    messages: list[dict[str, Any]] = [
        {"role": "assistant", "content": [{"type": "image"}], "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "one"},
        {"role": "tool", "tool_call_id": "b", "content": [{"type": "image"}, {"type": "text", "text": "two"}]},
        {"role": "user", "content": "next"},
    ]
    out = tools_as_text(messages)
    assert out[0] == {"role": "assistant", "content": [
        {"type": "image"}, {"type": "text", "text": "\n"},
        {"type": "text", "text": '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'}]}
    assert out[1]["role"] == "user" and out[1]["content"] == [
        {"type": "text", "text": "<tool_response>\none\n</tool_response>"},
        {"type": "text", "text": "\n"},
        {"type": "text", "text": "<tool_response>\n"}, {"type": "image"}, {"type": "text", "text": "two"},
        {"type": "text", "text": "\n</tool_response>"},
    ]
    assert out[2] == {"role": "user", "content": "next"} and len(out) == 3
