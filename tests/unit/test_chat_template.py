"""ChatTemplate: HF-compatible rendering of the fixture templates, probes, continuation, errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import pytest

from helios.loaders.chat_template import ChatTemplate, ChatTemplateError, TemplateRaisedError
from tests.shared_fixtures import shared_fixtures


def _fixture_dir() -> Path | None:
    return shared_fixtures("chat_templates")


FIXTURES = _fixture_dir()
needs_fixtures = pytest.mark.skipif(FIXTURES is None, reason="shared/fixtures/chat_templates not found")
FIXTURE_NAMES = sorted(p.stem for p in FIXTURES.glob("*.jinja")) if FIXTURES else []


def load(name: str) -> ChatTemplate:
    assert FIXTURES is not None
    return ChatTemplate((FIXTURES / f"{name}.jinja").read_text(encoding="utf-8"))


TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
PLAIN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Weather in Paris?"},
]


def tool_history(arguments: Any) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I need the weather.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"},
        {"role": "assistant", "content": "It is 18C.", "reasoning_content": "Got it."},
        {"role": "user", "content": "Thanks"},
    ]


# -- every fixture ------------------------------------------------------------------------------


@needs_fixtures
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_every_fixture_renders_plain_and_with_tools(name: str) -> None:
    template = load(name)
    plain = template.render(PLAIN, bos_token="<s>", eos_token="</s>")
    assert "Weather in Paris?" in plain
    with_tools = template.render(PLAIN, tools=TOOLS, bos_token="<s>", eos_token="</s>")
    assert "Weather in Paris?" in with_tools


# gemma3 has no tool role: its alternation check rejects a tool message (HF behaves the same).
TOOL_HISTORY_FIXTURES = [n for n in FIXTURE_NAMES if n != "gemma3"]


@needs_fixtures
@pytest.mark.parametrize("name", TOOL_HISTORY_FIXTURES)
def test_every_fixture_renders_tool_history(name: str) -> None:
    template = load(name)
    arguments: Any = {"city": "Paris", "unit": "celsius"}
    if not template.accepts_dict_tool_arguments():
        arguments = json.dumps(arguments)
    text = template.render(tool_history(arguments), tools=TOOLS)
    assert "18C, sunny" in text
    assert "Paris" in text
    assert "{'city'" not in text  # never a Python repr of the arguments


@needs_fixtures
def test_gemma3_rejects_tool_messages_through_its_own_raise() -> None:
    with pytest.raises(TemplateRaisedError, match="alternate"):
        load("gemma3").render(tool_history({"city": "Paris"}))


@needs_fixtures
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_matches_transformers(name: str) -> None:
    """transformers' own renderer is the reference wherever it can render the conversation."""
    hf = pytest.importorskip("transformers.utils.chat_template_utils")
    assert FIXTURES is not None
    source = (FIXTURES / f"{name}.jinja").read_text(encoding="utf-8")
    template = ChatTemplate(source)
    arguments: Any = {"city": "Paris"}
    if not template.accepts_dict_tool_arguments():
        arguments = json.dumps(arguments)
    cases: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]] = [
        (PLAIN, None, {"add_generation_prompt": True}),
        (PLAIN, TOOLS, {"add_generation_prompt": True}),
        (tool_history(arguments), TOOLS, {"add_generation_prompt": True}),
        (
            [*PLAIN, {"role": "assistant", "content": "It is "}],
            None,
            {"add_generation_prompt": False, "continue_final_message": True},
        ),
    ]
    compared = 0
    for messages, tools, flags in cases:
        try:
            expected = hf.render_jinja_template(
                [messages], tools=tools, chat_template=source, bos_token="<s>", eos_token="</s>", **flags
            )[0][0]
        except (jinja2.exceptions.TemplateError, ValueError, TypeError):
            continue  # e.g. kimi's list.append in HF's immutable sandbox, gemma3's tool role
        assert template.render(messages, tools=tools, bos_token="<s>", eos_token="</s>", **flags) == expected
        compared += 1
    assert compared >= 3


# -- golden renders -----------------------------------------------------------------------------


@needs_fixtures
def test_smollm2_golden() -> None:
    text = load("smollm2").render([{"role": "user", "content": "Hi"}])
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@needs_fixtures
def test_qwen3_golden_tool_history_and_thinking_switch() -> None:
    template = load("qwen3")
    text = template.render(tool_history({"city": "Paris"}), tools=TOOLS, enable_thinking=False)
    tool_json = json.dumps(TOOLS[0], ensure_ascii=False)
    assert text == (
        "<|im_start|>system\nYou are terse.\n\n# Tools\n\nYou may call one or more functions to assist with "
        "the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{tool_json}\n</tools>\n\nFor each function call, return a json object with function name "
        "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18C, sunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nIt is 18C.<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


@needs_fixtures
def test_qwen3_renders_reasoning_after_the_last_query() -> None:
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Easy."},
    ]
    text = load("qwen3").render(messages, add_generation_prompt=False)
    assert (
        text
        == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nEasy.\n</think>\n\n4<|im_end|>\n"
    )


@needs_fixtures
def test_gemma3_golden_folds_system_into_first_user_turn() -> None:
    text = load("gemma3").render(PLAIN, bos_token="<bos>")
    assert text == (
        "<bos><start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nWeather in Paris?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


@needs_fixtures
def test_deepseek_v3_1_golden_with_string_arguments() -> None:
    template = load("deepseek_v3_1")
    assert not template.accepts_dict_tool_arguments()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "R"},
    ]
    text = template.render(messages, bos_token="<｜begin▁of▁sentence｜>")
    assert text == (
        "<｜begin▁of▁sentence｜>S<｜User｜>Q<｜Assistant｜></think>"
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{"a": 1}<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁output▁begin｜>R<｜tool▁output▁end｜>"
    )


@needs_fixtures
def test_kimi_template_may_mutate_its_own_lists() -> None:
    # HF's immutable sandbox refuses `ids.append`; Helios allows it on template-local containers.
    text = load("kimi_k2").render(tool_history({"city": "Paris"}), tools=TOOLS)
    assert "<|tool_call_begin|>call_1<|tool_call_argument_begin|>" in text
    assert "## Return of call_1\n18C, sunny" in text


# -- probes -------------------------------------------------------------------------------------


INLINE_SYSTEM = {
    # renders every message with its own role
    "smollm2": True,
    "qwen3": True,
    # collects every system message into its system prompt
    "deepseek_v3_1": True,
    # raise on a non-initial system message
    "qwen3_5": False,
    "gemma3": False,
    # render only messages[0] as system and drop the rest
    "minimax_m2": False,
    "smollm3": False,
    "gpt_oss": False,
}


@needs_fixtures
@pytest.mark.parametrize(("name", "expected"), sorted(INLINE_SYSTEM.items()))
def test_supports_inline_system_probe(name: str, expected: bool) -> None:
    template = load(name)
    assert template.supports_inline_system() is expected
    assert template.supports_inline_system() is expected  # cached


def test_supports_inline_system_on_small_templates() -> None:
    every_role = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    first_only = "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% endif %}"
    first_only += "{% for m in messages if m.role != 'system' %}{{ m.content }}{% endfor %}"
    strict = "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    strict += "{{ raise_exception('no') }}{% endif %}{{ m.content }}{% endfor %}"
    assert ChatTemplate(every_role).supports_inline_system()
    assert not ChatTemplate(first_only).supports_inline_system()
    assert not ChatTemplate(strict).supports_inline_system()


def test_accepts_dict_tool_arguments_probe() -> None:
    loop = "{% for m in messages %}{% for c in m.tool_calls or [] %}"
    concatenates = ChatTemplate(loop + "{{ 'x' + c.function.arguments }}{% endfor %}{% endfor %}")
    stringifies = ChatTemplate(loop + "{{ c.function.arguments }}{% endfor %}{% endfor %}")
    serializes = ChatTemplate(loop + "{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}")
    no_tools = ChatTemplate("{{ raise_exception('never') }}")
    assert not concatenates.accepts_dict_tool_arguments()
    assert not stringifies.accepts_dict_tool_arguments()
    assert serializes.accepts_dict_tool_arguments()
    assert no_tools.accepts_dict_tool_arguments()  # nothing renders: keep the neutral default


# -- HF globals, filters and sandbox ------------------------------------------------------------


def test_raise_exception_is_a_template_error_with_status_400() -> None:
    template = ChatTemplate("{{ raise_exception('Roles must alternate') }}")
    with pytest.raises(TemplateRaisedError, match="Roles must alternate") as info:
        template.render([{"role": "user", "content": "x"}])
    assert isinstance(info.value, ChatTemplateError)
    assert isinstance(info.value, jinja2.exceptions.TemplateError)
    assert info.value.http_status == 400


def test_template_failures_become_chat_template_errors() -> None:
    with pytest.raises(ChatTemplateError, match="TypeError"):
        ChatTemplate("{{ 'a' + messages[0].content }}").render([{"role": "user", "content": 3}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_tojson_has_hf_semantics() -> None:
    template = ChatTemplate(
        "{{ tools | tojson }}|{{ tools | tojson(indent=2) }}|"
        "{{ tools | tojson(separators=(',', ':'), sort_keys=true) }}"
    )
    tools = [{"b": "é<&>", "a": 1}]
    plain, indented, compact = template.render([], tools=tools).split("|")
    assert plain == '[{"b": "é<&>", "a": 1}]'  # no ASCII escapes, no HTML escapes
    assert indented == json.dumps(tools, indent=2, ensure_ascii=False)
    assert compact == '[{"a":1,"b":"é<&>"}]'


def test_strftime_now_and_hf_variables() -> None:
    template = ChatTemplate(
        "{{ strftime_now('%Y') | length }} {{ bos_token }}{{ eos_token }} {{ add_generation_prompt }} "
        "{{ tools is none }} {{ documents is none }} {{ enable_thinking }}"
    )
    text = template.render([], bos_token="<s>", eos_token="</s>", enable_thinking=False)
    assert text == "4 <s></s> True True True False"


def test_trim_blocks_lstrip_blocks_and_loop_controls() -> None:
    template = ChatTemplate(
        "{% for m in messages %}\n    {% if m.role == 'tool' %}{% continue %}{% endif %}\n"
        "{{ m.content }};\n{% endfor %}"
    )
    messages = [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]
    assert template.render(messages) == "a;\n"


def test_generation_tag_renders_its_body() -> None:
    template = ChatTemplate(
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    assert template.render([{"role": "assistant", "content": "x"}]) == "x"


def test_inputs_stay_immutable_and_uncopied_back() -> None:
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="unsafe"):
        ChatTemplate("{{ messages.append(1) }}").render(messages)
    with pytest.raises(ChatTemplateError, match="unsafe"):
        ChatTemplate("{{ messages[0].update({'content': 'y'}) }}").render(messages)
    local = ChatTemplate("{% set ns = namespace(ids=[]) %}{% set _ = ns.ids.append(1) %}{{ ns.ids }}")
    assert local.render(messages) == "[1]"
    assert messages == [{"role": "user", "content": "x"}]


def test_sandbox_refuses_internals() -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ ''.__class__.__mro__ }}").render([])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render([])


def test_none_values_are_dropped_and_reasoning_is_aliased() -> None:
    template = ChatTemplate(
        "{% for m in messages %}{{ m.content is defined }} {{ m.thinking }} {{ m.reasoning_content }}{% endfor %}"
    )
    text = template.render([{"role": "assistant", "content": None, "reasoning_content": "r"}])
    assert text == "False r r"


# -- continue_final_message ---------------------------------------------------------------------


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_continue_final_message_cuts_after_its_content() -> None:
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "The answer is"}]
    text = ChatTemplate(CHATML).render(messages, add_generation_prompt=False, continue_final_message=True)
    assert text == "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nThe answer is"


def test_continue_final_message_keeps_or_trims_trailing_space_like_the_template() -> None:
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "Hi "}]
    kept = ChatTemplate(CHATML).render(messages, add_generation_prompt=False, continue_final_message=True)
    assert kept.endswith("assistant\nHi ")
    trimming = ChatTemplate("{% for m in messages %}[{{ m.content | trim }}]{% endfor %}")
    trimmed = trimming.render(messages, add_generation_prompt=False, continue_final_message=True)
    assert trimmed == "[Q][Hi"


def test_continue_final_message_errors() -> None:
    template = ChatTemplate(CHATML)
    user_last = [{"role": "user", "content": "Q"}]
    assistant_last = [*user_last, {"role": "assistant", "content": "A"}]
    with pytest.raises(ChatTemplateError, match="add_generation_prompt"):
        template.render(assistant_last, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="final assistant"):
        template.render(user_last, add_generation_prompt=False, continue_final_message=True)
    dropping = ChatTemplate("{% for m in messages if m.role == 'user' %}{{ m.content }}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="does not render"):
        dropping.render(assistant_last, add_generation_prompt=False, continue_final_message=True)


@needs_fixtures
def test_qwen3_continue_final_message() -> None:
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "Partial"}]
    text = load("qwen3").render(messages, add_generation_prompt=False, continue_final_message=True)
    assert text == "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nPartial"
