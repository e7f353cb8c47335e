"""Qwen2.5 / Qwen2.5-Coder tool calls (`qwen2_5`): Hermes tags, and the bare and ```json-fenced call
objects the real Qwen2.5-Coder-0.5B-Instruct writes instead (greedy, "What's the weather in Paris?"
with a get_weather tool; tests/server/test_qwen_tools.py runs the real file)."""

from __future__ import annotations

import pytest

from helios.domain.events import TextDelta, ToolCall
from helios.recipes import detect_parser_family, detect_recipe
from tests.unit.test_parsers import assert_split_invariant, calls, run

# Qwen2.5-Coder-0.5B-Instruct's chat template, from its GGUF (tokenizer.chat_template).
QWEN25_TEMPLATE = '{%- if tools %}\n    {{- \'<|im_start|>system\\n\' }}\n    {%- if messages[0][\'role\'] == \'system\' %}\n        {{- messages[0][\'content\'] }}\n    {%- else %}\n        {{- \'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.\' }}\n    {%- endif %}\n    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n    {%- for tool in tools %}\n        {{- "\\n" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n{%- else %}\n    {%- if messages[0][\'role\'] == \'system\' %}\n        {{- \'<|im_start|>system\\n\' + messages[0][\'content\'] + \'<|im_end|>\\n\' }}\n    {%- else %}\n        {{- \'<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n\' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}\n        {{- \'<|im_start|>\' + message.role + \'\\n\' + message.content + \'<|im_end|>\' + \'\\n\' }}\n    {%- elif message.role == "assistant" %}\n        {{- \'<|im_start|>\' + message.role }}\n        {%- if message.content %}\n            {{- \'\\n\' + message.content }}\n        {%- endif %}\n        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n            {{- \'\\n<tool_call>\\n{"name": "\' }}\n            {{- tool_call.name }}\n            {{- \'", "arguments": \' }}\n            {{- tool_call.arguments | tojson }}\n            {{- \'}\\n</tool_call>\' }}\n        {%- endfor %}\n        {{- \'<|im_end|>\\n\' }}\n    {%- elif message.role == "tool" %}\n        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n            {{- \'<|im_start|>user\' }}\n        {%- endif %}\n        {{- \'\\n<tool_response>\\n\' }}\n        {{- message.content }}\n        {{- \'\\n</tool_response>\' }}\n        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n            {{- \'<|im_end|>\\n\' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- \'<|im_start|>assistant\\n\' }}\n{%- endif %}\n'

# What the real 0.5B file answers, greedy: fenced without a system message, bare with one.
REAL_FENCED = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'
REAL_BARE = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PARIS = [("get_weather", {"city": "Paris"})]


def test_qwen25_template_selects_the_qwen2_5_parser():
    assert detect_parser_family(QWEN25_TEMPLATE) == "qwen2_5"
    assert detect_recipe("Qwen2.5 Coder 0.5B Instruct AWQ", "qwen2", QWEN25_TEMPLATE) == "plain"
    # Hermes templates without Qwen2.5's instruction, and Qwen3's (which thinks), keep their parsers.
    assert detect_parser_family("<|im_start|><tool_call>") == "think_hermes"
    assert detect_parser_family(QWEN25_TEMPLATE + "<think>") == "qwen3"
    mimo_vl = QWEN25_TEMPLATE.replace("You are Qwen, created by Alibaba Cloud.", "You are MiMo.")
    assert detect_parser_family(mimo_vl) == "think_hermes"


@pytest.mark.parametrize("text", [REAL_FENCED, REAL_BARE, HERMES, "```\n" + REAL_BARE + "\n```",
                                  "\n\n" + REAL_FENCED + "\n"], ids=["fenced", "bare", "hermes", "untagged",
                                                                      "spaced"])
def test_real_outputs_are_calls_split_anywhere(text):
    events = assert_split_invariant("qwen2_5", text, {})
    assert calls(events) == PARIS
    assert [e for e in events if not isinstance(e, ToolCall)] == []


def test_several_calls_and_text_after_them():
    two = REAL_BARE + "\n" + '```json\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n```'
    events = assert_split_invariant("qwen2_5", two + "\nDone.", {})
    assert calls(events) == [*PARIS, ("get_time", {"timezone": "Europe/Paris"})]
    assert events[-1] == TextDelta("Done.")
    listed = '```json\n[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time"}]\n```'
    assert calls(run("qwen2_5", [listed])) == [*PARIS, ("get_time", {})]
    assert calls(run("qwen2_5", ['{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}'])) == PARIS


@pytest.mark.parametrize("text", [
    '```json\n{"name": "undeclared", "arguments": {}}\n```',  # not a declared tool
    '{"name": "get_weather", "arguments": {}, "extra": 1}',  # not a call object
    '{"name": "Bob", "age": 3}',
    '{"city": "Paris", "name": "get_weather"}',  # "name" is not the first key
    '```json\n{"a": [1, 2]}\n```',
    "```python\nprint({'name': 1})\n```",
    "```\ncode\n```",
    'Call it as {"name": "get_weather", "arguments": {"city": "Paris"}}.',  # after answer text
    'Use ```json\n{"name": "get_weather", "arguments": {}}\n```',
    '{"name": "get_weather", "arguments": {"city": ',  # braces never balance
    '{"name": "get_weather", "arguments": {"city": "Paris"}} trailing',
])
def test_anything_else_stays_text(text):
    events = assert_split_invariant("qwen2_5", text, {})
    if text.endswith("trailing"):
        assert calls(events) == PARIS and events[-1] == TextDelta("trailing")
        return
    assert events == [TextDelta(text.strip())]


def test_fence_left_open_at_the_end_of_output():
    assert calls(assert_split_invariant("qwen2_5", REAL_FENCED[:-3], {})) == PARIS
    text = '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}'
    assert assert_split_invariant("qwen2_5", text, {}) == [TextDelta(text)]


def test_no_declared_tools_means_no_bare_calls():
    assert run("qwen2_5", [REAL_BARE], tools={}) == [TextDelta(REAL_BARE)]
    assert run("qwen2_5", [REAL_FENCED], parse_tools=False) == [TextDelta(REAL_FENCED)]


def test_truncated_bare_call_is_not_published():
    cut = REAL_FENCED[: REAL_FENCED.index("Paris")]
    assert run("qwen2_5", [cut], truncated=True) == []
    assert run("qwen2_5", [REAL_BARE[:-2]], truncated=True) == []
