"""Output parsers: fixture replays split at every boundary, prose rules, gating, truncation, errors."""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Sequence
from pathlib import Path

import pytest

from helios.domain.events import OutputEvent, ReasoningDelta, TextDelta, ToolCall
from helios.parsers import (
    FAMILIES,
    MAX_ARGUMENTS_BYTES,
    ToolParseError,
    family_delimiters,
    make_output_parser,
    prompt_starts_in_reasoning,
)
from tests.shared_fixtures import shared_fixtures


def _fixture_dir() -> Path | None:
    outputs = shared_fixtures("outputs")
    return outputs.parent if outputs else None


FIXTURES = _fixture_dir()
needs_fixtures = pytest.mark.skipif(FIXTURES is None, reason="shared/fixtures/outputs not found")

TOOLS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
    },
    "get_time": {"type": "object", "properties": {"timezone": {"type": "string"}}},
    "typed": {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "x": {"type": "number"},
            "flag": {"type": "boolean"},
            "obj": {"type": "object"},
            "items": {"type": "array"},
            "maybe": {"type": ["integer", "null"]},
            "text": {"type": "string"},
        },
    },
}

QWEN_IDS = {"<think>": 151667, "</think>": 151668}

# Single-token strings of each fixture family (they are never split, and carry their id when the
# family gates them). Ids other than Qwen's are made up: only their presence matters.
QWEN_ATOMS = {"<think>": 151667, "</think>": 151668, "<tool_call>": 151657, "</tool_call>": 151658}
THINK_ATOMS = {"<think>": 900001, "</think>": 900002}
GEMMA_ATOMS = {
    "<|channel>": 900010,
    "<channel|>": 900011,
    "<|tool_call>": 900012,
    "<tool_call|>": 900013,
    '<|"|>': 900014,
    "<|tool_response>": 900015,
}
KIMI_ATOMS = {
    "<think>": 900020,
    "</think>": 900021,
    "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596,
    "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598,
    "<|tool_call_end|>": 163599,
}
HARMONY_ATOMS = {
    "<|start|>": 200006,
    "<|end|>": 200007,
    "<|message|>": 200008,
    "<|channel|>": 200005,
    "<|constrain|>": 200003,
    "<|return|>": 200002,
    "<|call|>": 200012,
}
DEEPSEEK_V31_ATOMS = {
    "<think>": 128798,
    "</think>": 128799,
    "<｜tool▁calls▁begin｜>": 900030,
    "<｜tool▁calls▁end｜>": 900031,
    "<｜tool▁call▁begin｜>": 900032,
    "<｜tool▁call▁end｜>": 900033,
    "<｜tool▁sep｜>": 900034,
}

# fixture file, parser family, starts in reasoning, atoms, expected content text
CASES = [
    ("qwen3", "qwen3", False, QWEN_ATOMS, None),
    ("qwen3_thinking_2507", "qwen3", True, QWEN_ATOMS, None),
    ("qwen3_5", "qwen3_coder", True, QWEN_ATOMS, None),
    ("qwen3_coder", "qwen3_coder", False, QWEN_ATOMS, "I'll look up the"),
    ("glm4_6", "glm", False, THINK_ATOMS, None),
    ("glm4_7", "glm", True, THINK_ATOMS, None),
    ("deepseek_v3_1", "deepseek_v3_1", True, DEEPSEEK_V31_ATOMS, None),
    ("deepseek_v3_2", "deepseek_v3_2", True, {}, None),
    ("deepseek_v4", "deepseek_v4", True, {}, None),
    ("gemma4", "gemma4", False, GEMMA_ATOMS, None),
    ("minimax_m2", "minimax_m2", True, THINK_ATOMS, None),
    ("kimi_k2", "kimi_k2", False, KIMI_ATOMS, None),
    ("mimo", "think_hermes", False, THINK_ATOMS, None),
    ("nemotron3_nano", "function_tags", True, THINK_ATOMS, None),
    ("nemotron_nano_v2", "nemotron_v2", True, THINK_ATOMS, None),
    ("gpt_oss", "harmony", False, HARMONY_ATOMS, None),
    ("smollm3", "think_hermes", False, THINK_ATOMS, None),
    ("smollm2", "hermes", False, {}, None),
]

EXPECTED_CALLS = {
    "one_call": [("get_weather", {"city": "Paris", "unit": "celsius"})],
    "two_calls": [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"timezone": "Europe/Paris"}),
    ],
}
EXPECTED_REASONING = {
    "one_call": "The user wants the weather in Paris. I should call get_weather.",
    "two_calls": "The user wants the weather and the local time in Paris. I will call get_weather and get_time.",
}


# --- helpers ---------------------------------------------------------------------------------------

Piece = tuple[str, tuple[int, ...]]


def load_samples(name: str) -> dict[str, str]:
    assert FIXTURES is not None
    text = (FIXTURES / "outputs" / f"{name}.txt").read_text(encoding="utf-8")
    body = text.split("\n<<<END>>>", 1)[0]
    parts = re.split(r"(?:^|\n)<<<SAMPLE (\w+)>>>\n", body)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def atomize(text: str, atoms: dict[str, int]) -> list[Piece]:
    """Splits text into single characters and unsplittable special-token atoms (with their id)."""
    pieces: list[Piece] = []
    pos = 0
    ordered = sorted(atoms, key=len, reverse=True)
    while pos < len(text):
        for atom in ordered:
            if text.startswith(atom, pos):
                pieces.append((atom, (atoms[atom],)))
                pos += len(atom)
                break
        else:
            pieces.append((text[pos], (7,)))
            pos += 1
    return pieces


def join(pieces: Sequence[Piece]) -> Piece:
    return "".join(p[0] for p in pieces), tuple(itertools.chain.from_iterable(p[1] for p in pieces))


def counter_ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def run(
    family: str,
    chunks: Sequence[Piece | str],
    *,
    truncated: bool = False,
    **kwargs,
) -> list[OutputEvent | str]:
    """Feeds chunks, finishes, and returns merged events (an error becomes a trailing 'ERROR' entry)."""
    kwargs.setdefault("make_call_id", counter_ids())
    kwargs.setdefault("tools", TOOLS)
    parser = make_output_parser(family, **kwargs)
    events: list[OutputEvent | str] = []
    try:
        for chunk in chunks:
            text, ids = (chunk, ()) if isinstance(chunk, str) else chunk
            events += parser.feed(text, ids)
        events += parser.finish(truncated=truncated)
    except ToolParseError as exc:
        events += exc.events
        events.append("ERROR")
    return merge(events)


def merge(events: Sequence[OutputEvent | str]) -> list[OutputEvent | str]:
    merged: list[OutputEvent | str] = []
    for event in events:
        if merged and isinstance(event, TextDelta | ReasoningDelta) and type(merged[-1]) is type(event):
            last = merged[-1]
            assert isinstance(last, TextDelta | ReasoningDelta)
            merged[-1] = type(event)(last.text + event.text)
        else:
            merged.append(event)
    return merged


def calls(events: Sequence[OutputEvent | str]) -> list[tuple[str, dict]]:
    return [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)]


def text_of(events: Sequence[OutputEvent | str], kind: type) -> str:
    return "".join(e.text for e in events if isinstance(e, kind))


def gate_ids(family: str, atoms: dict[str, int]) -> dict[str, int]:
    return {d: atoms[d] for d in family_delimiters(family) if d in atoms}


def assert_split_invariant(
    family: str, text: str, atoms: dict[str, int], **kwargs
) -> list[OutputEvent | str]:
    pieces = atomize(text, atoms)
    kwargs.setdefault("delimiter_token_ids", gate_ids(family, atoms))
    whole = run(family, [join(pieces)], **kwargs)
    for cut in range(1, len(pieces)):
        assert run(family, [join(pieces[:cut]), join(pieces[cut:])], **kwargs) == whole, (family, cut)
    assert run(family, pieces, **kwargs) == whole, (family, "one piece at a time")
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(pieces)), min(4, len(pieces) - 1)))
        bounds = [0, *cuts, len(pieces)]
        chunks = [join(pieces[a:b]) for a, b in itertools.pairwise(bounds)]
        assert run(family, chunks, **kwargs) == whole, (family, cuts)
    return whole


# --- fixture replays -------------------------------------------------------------------------------


@needs_fixtures
@pytest.mark.parametrize(
    ("fixture", "family", "starts", "atoms", "content"), CASES, ids=[c[0] for c in CASES]
)
def test_fixture_replays_split_at_every_boundary(fixture, family, starts, atoms, content):
    for sample, text in load_samples(fixture).items():
        events = assert_split_invariant(family, text, atoms, starts_in_reasoning=starts)
        assert "ERROR" not in events
        assert calls(events) == EXPECTED_CALLS[sample]
        if family != "hermes":
            assert text_of(events, ReasoningDelta) == ("" if content else EXPECTED_REASONING[sample])
        answer = text_of(events, TextDelta)
        assert answer.startswith(content) if content else answer == ""
        assert [e.index for e in events if isinstance(e, ToolCall)] == list(
            range(len(EXPECTED_CALLS[sample]))
        )


@needs_fixtures
def test_fixture_calls_in_one_delta_keep_order_and_ids():
    text = load_samples("kimi_k2")["two_calls"]
    events = run("kimi_k2", [text])
    assert [(e.id, e.name, e.index) for e in events if isinstance(e, ToolCall)] == [
        ("functions.get_weather:0", "get_weather", 0),
        ("functions.get_time:1", "get_time", 1),
    ]
    events = run("qwen3_coder", [load_samples("qwen3_coder")["two_calls"]])
    assert [e.id for e in events if isinstance(e, ToolCall)] == ["call_0", "call_1"]


@needs_fixtures
@pytest.mark.parametrize(
    ("fixture", "family", "starts", "atoms", "content"), CASES, ids=[c[0] for c in CASES]
)
def test_truncated_fixture_envelopes_are_not_published(fixture, family, starts, atoms, content):
    text = load_samples(fixture)["two_calls"]
    # Cut inside the second call's arguments: only the first call may be published.
    cut = text.rindex("Europe/Paris") + 3
    kwargs = {"starts_in_reasoning": starts, "delimiter_token_ids": gate_ids(family, atoms)}
    truncated = run(family, [join(atomize(text[:cut], atoms))], truncated=True, **kwargs)
    assert "ERROR" not in truncated
    # Nemotron Nano 2 and SmolLM2 put both calls in one JSON list: one envelope, cut as a whole.
    one_envelope = family in ("nemotron_v2", "hermes")
    assert calls(truncated) == ([] if one_envelope else EXPECTED_CALLS["one_call"])
    natural = run(family, [join(atomize(text[:cut], atoms))], **kwargs)
    assert natural[-1] == "ERROR"


# --- gating ------------------------------------------------------------------------------------------


def test_single_token_delimiters_act_only_with_their_token_id():
    text = "<think>\nabc\n</think>\n\nHi"
    gated = run(
        "qwen3",
        [("<think>", (151667,)), ("\nabc\n", (1,)), ("</think>", (151668,)), ("\n\nHi", (2,))],
        delimiter_token_ids=QWEN_IDS,
    )
    assert gated == [ReasoningDelta("abc"), TextDelta("Hi")]
    assert run("qwen3", [(text, (1, 2, 3))], delimiter_token_ids=QWEN_IDS) == [TextDelta(text)]
    # Without ids configured (delimiter spans tokens in this tokenizer) the text itself delimits.
    assert run("qwen3", [text]) == [ReasoningDelta("abc"), TextDelta("Hi")]


def test_delimiter_written_in_ordinary_pieces_stays_reasoning():
    chunks = [
        ("abc ", (1,)),
        ("</", (2,)),
        ("think", (3,)),
        (">", (4,)),
        (" more", (5,)),
        ("</think>", (151668,)),
        ("Hi", (6,)),
    ]
    events = run("qwen3", chunks, delimiter_token_ids=QWEN_IDS, starts_in_reasoning=True)
    assert events == [ReasoningDelta("abc </think> more"), TextDelta("Hi")]


def test_gated_delimiter_counts_occurrences_per_piece():
    chunk = ("x</think>y</think>z", (5, 151668))  # one real close: the first occurrence
    events = run("qwen3", [chunk], delimiter_token_ids=QWEN_IDS, starts_in_reasoning=True)
    assert events == [ReasoningDelta("x"), TextDelta("y</think>z")]


def test_gemma_channel_close_is_gated():
    text = "<|channel>thought\nplan\n<channel|>Answer"
    assert run("gemma4", [(text, (1,))], delimiter_token_ids={"<channel|>": 9}) == [
        ReasoningDelta("plan\n<channel|>Answer")
    ]
    assert run("gemma4", [(text, (9,))], delimiter_token_ids={"<channel|>": 9}) == [
        ReasoningDelta("plan"),
        TextDelta("Answer"),
    ]


def test_deepseek_delimiters_are_text_matched_even_with_ids():
    events = run(
        "deepseek_v4",
        [("plan</think>answer", (1,))],
        starts_in_reasoning=True,
        delimiter_token_ids={"</think>": 128799},
    )
    assert events == [ReasoningDelta("plan"), TextDelta("answer")]
    assert family_delimiters("deepseek_v4") == ()


def test_structured_answer_returns_a_stray_close_token_as_text():
    events = run(
        "qwen3",
        [("</think>", (151668,)), ("Hi</think>", (1, 151668))],
        delimiter_token_ids=QWEN_IDS,
        starts_in_reasoning=True,
    )
    assert events == [TextDelta("Hi</think>")]


# --- Qwen function tags ----------------------------------------------------------------------------

PROSE = [
    ("qwen3_coder", "Use the <tool_call> tag to call tools."),
    ("qwen3_coder", "Write <function=name> then parameters."),
    ("qwen3_coder", "The <tool_call>\n<function=get_weather> header is followed by parameters."),
    ("qwen3_coder", "A <function=a<b> tag and <function=\n> and <tool_call><tool_call> stay text."),
    ("glm", "GLM writes <tool_call> then a name."),
    ("glm", "The <tool_call>get weather<arg_key> form needs a name without spaces."),
    ("glm", "Empty <tool_call><arg_key> names stay text."),
    ("qwen3", "The <tool_call> tag wraps JSON."),
    ("think_hermes", "Quote <tool_call> and </tool_call> freely."),
    ("minimax_m2", "MiniMax uses <invoke name=x> inside blocks only."),
    ("deepseek_v4", 'DSML uses <｜DSML｜invoke name="x"> inside blocks only.'),
]


@pytest.mark.parametrize(("family", "text"), PROSE)
def test_prose_mentions_of_tags_stay_text(family, text):
    events = run(family, [text + " Done."])
    assert events == [TextDelta(text + " Done.")]


def test_prose_mention_in_reasoning_stays_reasoning():
    text = "I could write <tool_call> or <function=x> here.</think>Answer"
    events = assert_split_invariant("qwen3_coder", text, {}, starts_in_reasoning=True)
    assert events == [ReasoningDelta("I could write <tool_call> or <function=x> here."), TextDelta("Answer")]


def test_complete_call_in_reasoning_prose_ends_reasoning():
    text = "Let me call <function=get_weather><parameter=city>Paris</parameter></function> now"
    events = assert_split_invariant("qwen3_coder", text, {}, starts_in_reasoning=True)
    assert events == [
        ReasoningDelta("Let me call"),
        ToolCall("call_0", "get_weather", '{"city": "Paris"}', 0),
        TextDelta("now"),
    ]


def test_hermes_tool_call_ends_qwen_reasoning():
    text = 'Thinking <tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'
    events = assert_split_invariant("qwen3", text, {}, starts_in_reasoning=True)
    assert events == [ReasoningDelta("Thinking"), ToolCall("call_0", "get_time", '{"timezone": "UTC"}', 0)]


def test_non_qwen_families_keep_tool_markup_inside_reasoning():
    text = "<function=get_time><parameter=timezone>UTC</parameter></function></think>ok"
    events = run("function_tags", [text], starts_in_reasoning=True)
    assert events == [ReasoningDelta(text.split("</think>")[0]), TextDelta("ok")]


def test_omitted_outer_tags_and_inline_calls():
    text = "Sure: <function=get_time>\n<parameter=timezone>\nUTC\n</parameter>\n</function> and done"
    events = assert_split_invariant("qwen3_coder", text, {})
    assert events == [
        TextDelta("Sure:"),
        ToolCall("call_0", "get_time", '{"timezone": "UTC"}', 0),
        TextDelta("and done"),
    ]


def test_missing_parameter_close_is_closed_by_next_boundary():
    text = (
        "<tool_call>\n<function=typed>\n<parameter=n>\n5\n<parameter=text>\nhello\n</function>\n</tool_call>"
    )
    events = assert_split_invariant("qwen3_coder", text, {})
    assert calls(events) == [("typed", {"n": 5, "text": "hello"})]


def test_one_wrapping_newline_is_trimmed_from_each_side():
    text = "<function=typed><parameter=text>\n\n  indented\n\n</parameter></function>"
    assert calls(run("qwen3_coder", [text])) == [("typed", {"text": "\n  indented\n"})]


def test_mimo_compact_tags_keep_values_verbatim():
    text = "<tool_call><function=typed><parameter=text>\n  indented\n</parameter><parameter=n>7</parameter></function></tool_call>"
    events = assert_split_invariant("mimo", text, {})
    assert calls(events) == [("typed", {"text": "\n  indented\n", "n": 7})]


@pytest.mark.parametrize(
    ("key", "raw", "expected"),
    [
        ("n", "42", 42),
        ("n", "4.0", 4),
        ("n", "forty", "forty"),
        ("x", "2.5", 2.5),
        ("x", "1e3", 1000.0),
        ("flag", "True", True),
        ("flag", "false", False),
        ("flag", "maybe", "maybe"),
        ("obj", '{"a": [1, 2]}', {"a": [1, 2]}),
        ("obj", "{broken", "{broken"),
        ("items", '[1, "b"]', [1, "b"]),
        ("maybe", "null", None),
        ("maybe", "3", 3),
        ("text", "123", "123"),
        ("undeclared", "123", "123"),
    ],
)
def test_schema_guided_conversion_is_best_effort(key, raw, expected):
    text = f"<function=typed><parameter={key}>{raw}</parameter></function>"
    assert calls(run("qwen3_coder", [text])) == [("typed", {key: expected})]


def test_unknown_tools_are_returned_with_string_values():
    text = "<function=not_declared><parameter=n>5</parameter></function>"
    assert calls(run("qwen3_coder", [text])) == [("not_declared", {"n": "5"})]


def test_call_without_parameters_and_trailing_close_tag():
    text = "<tool_call>\n<function=get_time>\n</function>\n</tool_call>\nAfter </tool_call> text"
    events = assert_split_invariant("qwen3_coder", text, {})
    assert events == [ToolCall("call_0", "get_time", "{}", 0), TextDelta("After </tool_call> text")]


# --- other syntaxes -------------------------------------------------------------------------------


def test_glm_tolerates_missing_value_close_and_converts():
    text = "<tool_call>typed\n<arg_key>n</arg_key>\n<arg_value>3<arg_key>text</arg_key><arg_value> a b </arg_value>\n</tool_call>"
    events = assert_split_invariant("glm", text, {})
    assert calls(events) == [("typed", {"n": 3, "text": " a b "})]


def test_gemma_values_nest_and_quote():
    text = '<|tool_call>call:typed{obj:{k:<|"|>v, w<|"|>},items:[1,2.5,true,null],text:<|"|>a:b{c}<|"|>,n:-3}<tool_call|>'
    events = assert_split_invariant("gemma4", text, {})
    assert calls(events) == [
        ("typed", {"obj": {"k": "v, w"}, "items": [1, 2.5, True, None], "text": "a:b{c}", "n": -3})
    ]


def test_minimax_block_and_text_after_it():
    text = (
        '<minimax:tool_call>\n<invoke name="typed">\n<parameter name="n">4</parameter>\n'
        '<parameter name="text">x\ny</parameter>\n</invoke>\n</minimax:tool_call>\nThen text'
    )
    events = assert_split_invariant("minimax_m2", text, {})
    assert events[0] == ToolCall("call_0", "typed", '{"n": 4, "text": "x\\ny"}', 0)
    assert events[1:] == [TextDelta("Then text")]


def test_dsml_string_flags_and_end_of_output():
    text = (
        'plan</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="typed">\n'
        '<｜DSML｜parameter name="obj" string="false">{"a": [1, 2]}</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="text" string="true">  <b>raw</b> </｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>\nignored trailing text"
    )
    events = assert_split_invariant("deepseek_v4", text, {}, starts_in_reasoning=True)
    assert events[0] == ReasoningDelta("plan")
    assert calls(events) == [("typed", {"obj": {"a": [1, 2]}, "text": "  <b>raw</b> "})]
    assert len(events) == 2


def test_dsml_v32_block_name_differs_from_v4():
    text = (
        '<｜DSML｜function_calls><｜DSML｜invoke name="get_time"></｜DSML｜invoke></｜DSML｜function_calls>'
    )
    assert calls(run("deepseek_v3_2", [text])) == [("get_time", {})]
    assert calls(run("deepseek_v4", [text])) == []


def test_dsml_rejects_duplicate_and_invalid_arguments():
    dup = (
        '<｜DSML｜tool_calls><｜DSML｜invoke name="f"><｜DSML｜parameter name="a" string="true">1</｜DSML｜parameter>'
        '<｜DSML｜parameter name="a" string="true">2</｜DSML｜parameter></｜DSML｜invoke>'
    )
    assert run("deepseek_v4", [dup])[-1] == "ERROR"
    bad = '<｜DSML｜tool_calls><｜DSML｜invoke name="f"><｜DSML｜parameter name="a" string="false">{x</｜DSML｜parameter></｜DSML｜invoke>'
    assert run("deepseek_v4", [bad])[-1] == "ERROR"


def test_structured_deepseek_answer_is_verbatim():
    text = 'plan</think>{"markup": "<｜DSML｜tool_calls><｜DSML｜invoke name=\\"f\\">"}'
    events = assert_split_invariant("deepseek_v4", text, {}, starts_in_reasoning=True, structured_output=True)
    assert events == [
        ReasoningDelta("plan"),
        TextDelta('{"markup": "<｜DSML｜tool_calls><｜DSML｜invoke name=\\"f\\">"}'),
    ]
    # Without an output constraint the same markup is parsed (and here fails as unterminated).
    assert run("deepseek_v4", [text], starts_in_reasoning=True)[-1] == "ERROR"


def test_kimi_k3_xtml_message():
    text = (
        "Reasoning<|close|>think<|sep|><|open|>response<|sep|>Answer<|close|>response<|sep|>"
        '<|open|>tools<|sep|><|open|>call tool="typed" index="1"<|sep|>'
        '<|open|>argument key="text" type="string"<|sep|> a &amp; b <|close|>argument<|sep|>'
        '<|open|>argument key="n" type="number"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>'
        '<|open|>call tool="get_time" index="2"<|sep|><|open|>json type="object"<|sep|>{"timezone": "UTC"}'
        "<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>junk"
    )
    events = assert_split_invariant("kimi_k3", text, {}, starts_in_reasoning=True)
    assert events[:2] == [ReasoningDelta("Reasoning"), TextDelta("Answer")]
    assert calls(events) == [("typed", {"text": " a &amp; b ", "n": 3}), ("get_time", {"timezone": "UTC"})]
    assert len(events) == 4


def test_harmony_final_channel_and_commentary_preamble():
    text = (
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>commentary<|message|>"
        "Checking.<|end|><|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>"
        '{"timezone": "UTC"}<|call|>'
    )
    events = assert_split_invariant("harmony", text, HARMONY_ATOMS)
    assert events == [
        ReasoningDelta("Think."),
        TextDelta("Checking."),
        ToolCall("call_0", "get_time", '{"timezone": "UTC"}', 0),
    ]
    final = "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>B<|return|>x"
    assert run("harmony", [final]) == [ReasoningDelta("a"), TextDelta("B")]


def test_deepseek_v31_section():
    text = 'r</think>Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"timezone": "UTC"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    events = assert_split_invariant("deepseek_v3_1", text, DEEPSEEK_V31_ATOMS, starts_in_reasoning=True)
    assert events == [
        ReasoningDelta("r"),
        TextDelta("Sure."),
        ToolCall("call_0", "get_time", '{"timezone": "UTC"}', 0),
    ]


def test_hermes_list_and_arguments_given_as_string():
    text = '<tool_call>[{"name": "a", "arguments": "{\\"x\\": 1}"}, {"name": "b"}]</tool_call>'
    assert calls(run("hermes", [text])) == [("a", {"x": 1}), ("b", {})]


def test_hermes_complete_json_accepted_without_close_tag_at_natural_end():
    text = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n'
    assert calls(run("qwen3", [text])) == [("get_time", {"timezone": "UTC"})]
    assert run("qwen3", [text], truncated=True) == []


# --- errors ------------------------------------------------------------------------------------------

MALFORMED = [
    ("qwen3", 'Before <tool_call>{"name": "get_time", "arguments": [1]}</tool_call>'),
    ("qwen3", "Before <tool_call>{not json}</tool_call>"),
    ("qwen3", 'Before <tool_call>{"name": "", "arguments": {}}</tool_call>'),
    ("qwen3", 'Before <tool_call>{"name": "f", "arguments": {"a": 1, "a": 2}}</tool_call>'),
    ("qwen3", 'Before <tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>'),
    ("qwen3_coder", "Before <function= ><parameter=a>1</parameter></function>"),
    ("qwen3_coder", "Before <function=f><parameter=a>1</parameter><parameter=a>2</parameter></function>"),
    ("qwen3_coder", "Before <function=f><parameter= >1</parameter></function>"),
    ("gemma4", "Before <|tool_call>call:f{a:}<tool_call|>"),
    ("gemma4", "Before <|tool_call>nocall<tool_call|>"),
    (
        "kimi_k2",
        "Before <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>[1]<|tool_call_end|>",
    ),
    ("harmony", "Before<|start|>assistant to=functions.f<|channel|>commentary<|message|>nope<|call|>"),
]


@pytest.mark.parametrize(("family", "text"), MALFORMED)
def test_malformed_envelopes_raise_with_preceding_events(family, text):
    events = assert_split_invariant(family, text, {})
    assert events == [TextDelta("Before"), "ERROR"]


def test_parser_is_spent_after_an_error():
    parser = make_output_parser("qwen3")
    with pytest.raises(ToolParseError):
        parser.feed("<tool_call>{bad}</tool_call>")
    with pytest.raises(ToolParseError) as info:
        parser.feed("more")
    assert info.value.events == ()
    with pytest.raises(ToolParseError):
        parser.finish()


def test_undecided_tag_at_natural_end_is_an_incomplete_call():
    assert run("qwen3_coder", ["Hello <tool_call>"]) == [TextDelta("Hello"), "ERROR"]
    assert run("qwen3_coder", ["Hello <tool_call>"], truncated=True) == [TextDelta("Hello")]
    assert run("qwen3_coder", ["Hello <tool_c"]) == [TextDelta("Hello <tool_c")]


def test_arguments_over_8_mib_fail():
    big = "x" * (MAX_ARGUMENTS_BYTES + 10)
    text = f"<function=f><parameter=a>{big}</parameter></function>"
    assert run("qwen3_coder", [text[:1000], text[1000:]]) == ["ERROR"]
    fits = "y" * (MAX_ARGUMENTS_BYTES - 100)
    events = run("qwen3_coder", [f"<function=f><parameter=a>{fits}</parameter></function>"])
    assert len(events) == 1 and isinstance(events[0], ToolCall)


def test_unbounded_envelope_fails_before_memory_grows():
    parser = make_output_parser("gemma4")
    parser.feed('<|tool_call>call:f{a:<|"|>')
    chunk = "z" * (1 << 20)
    with pytest.raises(ToolParseError):
        for _ in range(40):
            parser.feed(chunk)


# --- state for the serving pipeline ------------------------------------------------------------------


def test_reasoning_state_and_token_accounting():
    parser = make_output_parser("qwen3", delimiter_token_ids=QWEN_IDS, starts_in_reasoning=True)
    assert parser.in_reasoning
    parser.feed("abc", [1, 2])
    assert parser.in_reasoning and parser.num_reasoning_tokens == 2
    parser.feed("</think>", [151668])
    assert not parser.in_reasoning and parser.num_reasoning_tokens == 3
    parser.feed("\n<tool_call>", [5, 151657])
    assert parser.is_tool_call_pending
    parser.feed('{"name": "f"}</tool_call>', [6, 151658])
    assert not parser.is_tool_call_pending and parser.num_tool_calls == 1
    assert parser.num_reasoning_tokens == 3


def test_held_text_makes_reasoning_ambiguous():
    parser = make_output_parser("deepseek_v4", starts_in_reasoning=True)
    parser.feed("abc </thi")
    assert not parser.in_reasoning
    parser.feed("s")
    assert parser.in_reasoning


def test_prompt_starts_in_reasoning():
    assert prompt_starts_in_reasoning("qwen3", "<|im_start|>assistant\n<think>\n")
    assert not prompt_starts_in_reasoning("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_starts_in_reasoning("gemma4", "<|turn>model\n<|channel>thought\n<channel|>")
    assert prompt_starts_in_reasoning(
        "kimi_k3", '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )
    assert not prompt_starts_in_reasoning("plain", "<think>")


def test_plain_passes_text_through_and_tools_can_be_disabled():
    assert run("plain", ["  <think>x</think> ", "\n"]) == [TextDelta("  <think>x</think> \n")]
    text = "<tool_call>\n<function=get_time>\n</function>"
    assert run("qwen3_coder", [text], parse_tools=False) == [TextDelta(text)]


def test_every_family_builds():
    for name in FAMILIES:
        parser = make_output_parser(name)
        assert parser.feed("hello") + parser.finish() in ([TextDelta("hello")], [ReasoningDelta("hello")])


def test_undecided_lookahead_is_bounded_and_split_independent():
    text = "<tool_call>" + " " * 5000 + "<function=get_time></function> tail"
    whole = run("qwen3_coder", [text])
    # The opener is undecided for too long: it stays text; the bare <function=…> after it is a call.
    assert whole == [TextDelta("<tool_call>"), ToolCall("call_0", "get_time", "{}", 0), TextDelta("tail")]
    assert run("qwen3_coder", [text[:100], text[100:4500], text[4500:]]) == whole
    near = "<tool_call>" + " " * 3000 + "<function=get_time></function> tail"
    assert calls(run("qwen3_coder", [near[:50], near[50:]])) == [("get_time", {})]
