"""Fuzz invariant for the output parsers: any text, split anywhere, with any token ids, either parses or
raises ToolParseError (never anything else, never a hang); ungated parsing does not depend on where
the text was split."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helios.domain.events import OutputEvent, ReasoningDelta, TextDelta
from helios.parsers import FAMILIES, ToolParseError, family_delimiters, make_output_parser

FRAGMENTS = [
    "<think>", "</think>", "<mm:think>", "</mm:think>", "\n", " ", "  \n", "text", "é", "{", "}", "[", "]",
    ",", ":", '"', "'", "=", ">", "<", "/", "<tool_call>", "</tool_call>", "<function=", "<function=f>",
    "</function>", "<parameter=", "<parameter=a>", "</parameter>", "<arg_key>", "</arg_key>", "<arg_value>",
    "</arg_value>", '{"name": "f", "arguments": {"a": 1}}', '{"name": "', '"arguments": ', "<TOOLCALL>",
    "</TOOLCALL>", "<|channel>thought", "<channel|>", "<|tool_call>", "call:f{", "<tool_call|>", '<|"|>',
    "<|tool_response>", "<minimax:tool_call>", "</minimax:tool_call>", '<invoke name="f">', "</invoke>",
    '<parameter name="a">', "<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>", "<｜DSML｜function_calls>",
    '<｜DSML｜invoke name="f">', "</｜DSML｜invoke>", '<｜DSML｜parameter name="a" string="false">',
    '<｜DSML｜parameter name="b" string="true">', "</｜DSML｜parameter>", "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>",
    "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "functions.f:0", "<|tool_call_argument_begin|>",
    "<|tool_call_end|>", "<|tool_calls_section_end|>", "<|open|>", "<|close|>", "<|sep|>", "think", "response",
    "tools", 'call tool="f"', 'argument key="a" type="number"', "json", "message", "<|end_of_msg|>",
    "<|start|>", "assistant", "<|channel|>", "analysis", "final", "commentary", " to=functions.f", "<|message|>",
    "<|end|>", "<|call|>", "<|return|>", "<|constrain|>", "1", "true", "null", "NaN", "```", "```json\n",
    '{"name": "f", "arguments": {"a": 1}}\n```',
]  # fmt: skip

text_strategy = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=6)), max_size=40).map("".join)
FAMILY_NAMES = sorted(FAMILIES)


def _run(
    family: str, chunks: list[tuple[str, list[int]]], truncated: bool, **kwargs
) -> tuple[list[OutputEvent], bool]:
    counter = itertools.count()
    parser = make_output_parser(family, make_call_id=lambda: f"call_{next(counter)}", **kwargs)
    events: list[OutputEvent] = []
    try:
        for text, ids in chunks:
            events += parser.feed(text, ids)
        events += parser.finish(truncated=truncated)
    except ToolParseError as exc:
        return _merge([*events, *exc.events]), True
    return _merge(events), False


def _merge(events: list[OutputEvent]) -> list[OutputEvent]:
    merged: list[OutputEvent] = []
    for event in events:
        if merged and isinstance(event, TextDelta | ReasoningDelta) and type(merged[-1]) is type(event):
            last = merged[-1]
            assert isinstance(last, TextDelta | ReasoningDelta)
            merged[-1] = type(event)(last.text + event.text)
        else:
            merged.append(event)
    return merged


def _split(text: str, cuts: list[int]) -> list[tuple[str, list[int]]]:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [(text[a:b], [1] * (b - a)) for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("family", FAMILY_NAMES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=text_strategy,
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6),
    truncated=st.booleans(),
    starts=st.booleans(),
    structured=st.booleans(),
)
def test_any_text_parses_or_raises_tool_parse_error_independent_of_splits(
    family: str, text: str, cuts: list[int], truncated: bool, starts: bool, structured: bool
) -> None:
    kwargs = {"starts_in_reasoning": starts, "structured_output": structured, "tools": {"f": {}}}
    whole = _run(family, [(text, [1])], truncated, **kwargs)
    assert _run(family, _split(text, cuts), truncated, **kwargs) == whole


@pytest.mark.parametrize("family", FAMILY_NAMES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pieces=st.lists(
        st.tuples(
            st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=6)),
            st.lists(st.integers(min_value=0, max_value=12), max_size=3),
        ),
        max_size=30,
    ),
    truncated=st.booleans(),
    starts=st.booleans(),
)
def test_gated_parsing_with_arbitrary_token_ids_only_raises_tool_parse_error(
    family: str, pieces: list[tuple[str, list[int]]], truncated: bool, starts: bool
) -> None:
    ids = {delimiter: 10 + i for i, delimiter in enumerate(family_delimiters(family))}
    _run(family, pieces, truncated, starts_in_reasoning=starts, delimiter_token_ids=ids)
