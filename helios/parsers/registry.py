"""Model-family output parsers by name: reasoning syntax + tool syntax, composed.

Recipes name a family (`helios.recipes.Recipe.output_parser`); the serving pipeline builds one parser
per generated sequence with `make_output_parser`. `family_delimiters(name)` lists the reasoning
delimiters whose single-token ids the pipeline should look up and pass as `delimiter_token_ids`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs

from helios.domain.events import OutputEvent, TextDelta
from helios.parsers.arguments import ToolSchemas
from helios.parsers.base import MarkerAction, OutputParser, ReasoningSyntax, StreamingParser, ToolSyntax
from helios.parsers.tools import (
    DsmlSyntax,
    FunctionTagSyntax,
    Gemma4Syntax,
    GlmSyntax,
    HarmonySyntax,
    JsonEnvelopeSyntax,
    MiniMaxSyntax,
    Qwen25Syntax,
    SectionSyntax,
    XtmlSyntax,
)

THINK = ReasoningSyntax(open=("<think>",), close=("</think>",))
THINK_TEXT = ReasoningSyntax(open=("<think>",), close=("</think>",), gated=False)
MIMO_THINK = ReasoningSyntax(open=("<think>", "<mm:think>"), close=("</think>", "</mm:think>"))
GEMMA4_CHANNEL = ReasoningSyntax(open=("<|channel>thought",), close=("<channel|>",))
XTML_THINK = ReasoningSyntax(open=("<|open|>think<|sep|>",), close=("<|close|>think<|sep|>",), gated=False)
HARMONY_ANALYSIS = ReasoningSyntax(open=(), close=("<|end|>",), gated=False)


@attrs.frozen
class ParserFamily:
    name: str
    summary: str
    reasoning: ReasoningSyntax | None = None
    tools: Callable[[ToolSchemas], ToolSyntax] | None = None
    markers: Mapping[str, MarkerAction] = attrs.field(factory=dict)
    tool_call_ends_reasoning: bool = False
    verbatim_structured_answer: bool = False
    structural_tools: bool = False  # the tool syntax also frames messages (harmony): never disabled

    @property
    def delimiters(self) -> tuple[str, ...]:
        """Reasoning delimiters that the pipeline should gate when they are single tokens."""
        if self.reasoning is None or not self.reasoning.gated:
            return ()
        return (*self.reasoning.open, *self.reasoning.close)


def _family(*families: ParserFamily) -> dict[str, ParserFamily]:
    return {family.name: family for family in families}


_XTML_MARKERS = {
    "<|open|>response<|sep|>": MarkerAction.SWALLOW,
    "<|close|>response<|sep|>": MarkerAction.SWALLOW,
    "<|close|>message<|sep|>": MarkerAction.END,
    "<|end_of_msg|>": MarkerAction.END,
}
_HARMONY_MARKERS = {
    "<|end|>": MarkerAction.SWALLOW,
    "<|call|>": MarkerAction.SWALLOW,
    "<|return|>": MarkerAction.END,
}

FAMILIES: dict[str, ParserFamily] = _family(
    ParserFamily("plain", "text passes through unchanged as answer text"),
    ParserFamily(
        "qwen3",
        "Qwen3 / Qwen3-2507: <think> reasoning, Hermes JSON <tool_call>; a call ends reasoning",
        THINK,
        lambda tools: JsonEnvelopeSyntax(),
        tool_call_ends_reasoning=True,
    ),
    ParserFamily(
        "qwen3_coder",
        "Qwen3-Coder / Qwen3.5+: <think> reasoning, <function=…> tags; a call ends reasoning",
        THINK,
        lambda tools: FunctionTagSyntax(tools),
        tool_call_ends_reasoning=True,
    ),
    ParserFamily(
        "function_tags",
        "Nemotron 3 / Step: <think> reasoning, Qwen3-Coder <function=…> tags",
        THINK,
        lambda tools: FunctionTagSyntax(tools),
    ),
    ParserFamily(
        "mimo",
        "MiMo V2: <think>/<mm:think> reasoning, compact function tags with verbatim values",
        MIMO_THINK,
        lambda tools: FunctionTagSyntax(tools, trim_newlines=False),
    ),
    ParserFamily(
        "hermes",
        "Hermes JSON <tool_call> (object or list), no reasoning",
        None,
        lambda tools: JsonEnvelopeSyntax(),
    ),
    ParserFamily(
        "qwen2_5",
        "Qwen2.5 / Qwen2.5-Coder: Hermes JSON <tool_call>, or a leading bare / ```json-fenced call object"
        " naming a declared tool; no reasoning",
        None,
        Qwen25Syntax,
    ),
    ParserFamily(
        "think_hermes",
        "<think> reasoning and Hermes JSON <tool_call> (MiMo-VL, SmolLM3)",
        THINK,
        lambda tools: JsonEnvelopeSyntax(),
    ),
    ParserFamily(
        "nemotron_v2",
        "Nemotron Nano 2: <think> reasoning, <TOOLCALL>[…]</TOOLCALL>",
        THINK,
        lambda tools: JsonEnvelopeSyntax(open_tag="<TOOLCALL>", close_tag="</TOOLCALL>"),
    ),
    ParserFamily("glm", "GLM 4.5-5.x: <think> reasoning, <tool_call>NAME<arg_key>…", THINK, GlmSyntax),
    ParserFamily(
        "deepseek_v3_1",
        "DeepSeek V3.1: text-matched <think>, <｜tool▁calls▁begin｜> sections",
        THINK_TEXT,
        lambda tools: SectionSyntax(
            section_open="<｜tool▁calls▁begin｜>",
            section_close="<｜tool▁calls▁end｜>",
            call_open="<｜tool▁call▁begin｜>",
            separator="<｜tool▁sep｜>",
            call_close="<｜tool▁call▁end｜>",
            head_is_id=False,
        ),
    ),
    ParserFamily(
        "deepseek_v3_2",
        "DeepSeek V3.2: text-matched <think>, DSML function_calls",
        THINK_TEXT,
        lambda tools: DsmlSyntax(tools, block="function_calls"),
        verbatim_structured_answer=True,
    ),
    ParserFamily(
        "deepseek_v4",
        "DeepSeek V4 / V4.1: text-matched <think>, DSML tool_calls",
        THINK_TEXT,
        lambda tools: DsmlSyntax(tools, block="tool_calls"),
        verbatim_structured_answer=True,
    ),
    ParserFamily(
        "gemma4",
        "Gemma 4: <|channel>thought … <channel|> reasoning, <|tool_call>call:NAME{…}<tool_call|>",
        GEMMA4_CHANNEL,
        lambda tools: Gemma4Syntax(),
    ),
    ParserFamily(
        "minimax_m2",
        "MiniMax M2/M3: <think> reasoning, <minimax:tool_call><invoke …> blocks",
        THINK,
        MiniMaxSyntax,
    ),
    ParserFamily(
        "kimi_k2",
        "Kimi K2: <think> reasoning, <|tool_calls_section_begin|> token sections",
        THINK,
        lambda tools: SectionSyntax(
            section_open="<|tool_calls_section_begin|>",
            section_close="<|tool_calls_section_end|>",
            call_open="<|tool_call_begin|>",
            separator="<|tool_call_argument_begin|>",
            call_close="<|tool_call_end|>",
            head_is_id=True,
        ),
    ),
    ParserFamily(
        "kimi_k3",
        "Kimi K3 XTML: think/response/tools tags of <|open|>…<|sep|> … <|close|>…<|sep|>",
        XTML_THINK,
        XtmlSyntax,
        markers=_XTML_MARKERS,
    ),
    ParserFamily(
        "harmony",
        "gpt-oss harmony: analysis channel reasoning, to=functions.NAME calls ending <|call|>",
        HARMONY_ANALYSIS,
        lambda tools: HarmonySyntax(),
        markers=_HARMONY_MARKERS,
        tool_call_ends_reasoning=True,
        structural_tools=True,
    ),
)


class UnknownParserFamilyError(KeyError):
    """No output parser family of that name (a configuration error, found at start-up)."""


class PlainParser(OutputParser):
    """Passes text through unchanged; no reasoning, no tools."""

    def __init__(self) -> None:
        self.num_reasoning_tokens = 0
        self._finished = False

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> list[OutputEvent]:
        if self._finished:
            raise RuntimeError("output parser used after finish()")
        return [TextDelta(text)] if text else []

    def finish(self, *, truncated: bool = False) -> list[OutputEvent]:
        if self._finished:
            raise RuntimeError("output parser used after finish()")
        self._finished = True
        return []

    @property
    def in_reasoning(self) -> bool:
        return False

    @property
    def is_tool_call_pending(self) -> bool:
        return False

    @property
    def num_tool_calls(self) -> int:
        return 0


def get_family(name: str) -> ParserFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise UnknownParserFamilyError(name) from None


def family_delimiters(name: str) -> tuple[str, ...]:
    """The reasoning delimiters of a family that act only as generated single tokens."""
    return get_family(name).delimiters


def make_output_parser(
    family: str,
    *,
    tools: ToolSchemas | None = None,
    delimiter_token_ids: Mapping[str, int] | None = None,
    starts_in_reasoning: bool = False,
    parse_tools: bool = True,
    structured_output: bool = False,
    make_call_id: Callable[[], str] | None = None,
) -> OutputParser:
    """A fresh parser for one generated sequence.

    - tools: declared tools, name -> parameters JSON schema (guides tag-value conversion only;
      undeclared names are still returned).
    - delimiter_token_ids: reasoning delimiter text -> token id, for delimiters the tokenizer encodes
      as one token (see `family_delimiters`); those act only when generated as that token.
    - starts_in_reasoning: the prompt already opened reasoning (see `prompt_starts_in_reasoning`).
    - parse_tools: False leaves tool markup as text (tool_choice "none", or no tools declared).
    - structured_output: an output constraint is active; DeepSeek DSML answers become verbatim text
      once ordinary answer content begins.
    - make_call_id: call-id factory (default `call_` + 24 random hex digits).
    """
    spec = get_family(family)
    if spec.name == "plain":
        return PlainParser()
    syntax = None
    if spec.tools is not None and (parse_tools or spec.structural_tools):
        syntax = spec.tools(tools or {})
    return StreamingParser(
        reasoning=spec.reasoning,
        tools=syntax,
        markers=spec.markers,
        delimiter_token_ids=delimiter_token_ids,
        starts_in_reasoning=starts_in_reasoning,
        tool_call_ends_reasoning=spec.tool_call_ends_reasoning,
        verbatim_structured_answer=spec.verbatim_structured_answer and structured_output,
        make_call_id=make_call_id,
    )


def prompt_starts_in_reasoning(family: str, prompt: str) -> bool:
    """Whether a rendered generation prompt leaves reasoning open (it ends with an opening delimiter,
    e.g. Qwen3-2507's `<think>\\n`), so the output starts inside reasoning."""
    spec = get_family(family)
    if spec.reasoning is None:
        return False
    tail = prompt.rstrip()
    return any(tail.endswith(literal) for literal in spec.reasoning.open)
