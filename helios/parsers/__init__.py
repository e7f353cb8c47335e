"""Sans-IO output parsers: reasoning and tool-call markup per model family -> domain events.

    parser = make_output_parser("qwen3_coder", tools=schemas, delimiter_token_ids={"</think>": 151668},
                                starts_in_reasoning=True)
    events = parser.feed(text, token_ids)   # any number of times
    events += parser.finish(truncated=False)

Errors: `ToolParseError` (malformed or, at a natural end, incomplete tool calls). No torch, no trio.
"""

from helios.parsers.arguments import MAX_ARGUMENTS_BYTES, ToolSchemas
from helios.parsers.base import OutputParser, ReasoningSyntax, StreamingParser
from helios.parsers.errors import ToolParseError
from helios.parsers.registry import (
    FAMILIES,
    ParserFamily,
    PlainParser,
    UnknownParserFamilyError,
    family_delimiters,
    get_family,
    make_output_parser,
    prompt_starts_in_reasoning,
)

__all__ = [
    "FAMILIES",
    "MAX_ARGUMENTS_BYTES",
    "OutputParser",
    "ParserFamily",
    "PlainParser",
    "ReasoningSyntax",
    "StreamingParser",
    "ToolParseError",
    "ToolSchemas",
    "UnknownParserFamilyError",
    "family_delimiters",
    "get_family",
    "make_output_parser",
    "prompt_starts_in_reasoning",
]
