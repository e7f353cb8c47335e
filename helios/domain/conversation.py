"""The neutral conversation model every chat protocol decodes into (spec: Conversation and tool semantics).

Conversation messages and raw prompts are kept apart. One lowering (serving.prompt) renders a
ConversationRequest through the chat template; no protocol translates through another's JSON.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import attrs

from helios.domain.sampling import SamplingRequest


@attrs.frozen
class TextPart:
    text: str


@attrs.frozen
class ImagePart:
    media_type: str
    """The media type the client declared (``serving/images.py`` checks it against the bytes)."""
    data: bytes = attrs.field(repr=False)
    where: str = attrs.field(default="", eq=False)
    """Where in the request the image was (``messages[0].content[1]``), for error messages; not part
    of the image's identity."""


@attrs.frozen
class ReasoningPart:
    text: str


@attrs.frozen
class ToolCallPart:
    id: str
    name: str
    arguments: dict[str, Any]


@attrs.frozen
class ToolResultPart:
    tool_call_id: str
    content: tuple[TextPart | ImagePart, ...]
    is_error: bool = False


Part = TextPart | ImagePart | ReasoningPart | ToolCallPart | ToolResultPart

Role = Literal["system", "developer", "user", "assistant", "tool"]


@attrs.frozen
class Message:
    role: Role
    parts: tuple[Part, ...]
    name: str | None = None

    @property
    def text(self) -> str:
        """Text parts joined with blank lines (the spec's rule for text blocks)."""
        return "\n\n".join(p.text for p in self.parts if isinstance(p, TextPart))


@attrs.frozen
class ToolGrammar:
    """A Responses custom tool's input grammar: ``syntax`` ``lark`` or ``regex``, and its text."""

    syntax: Literal["lark", "regex"]
    definition: str


@attrs.frozen
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]
    kind: Literal["function", "custom"] = "function"
    grammar: ToolGrammar | None = None
    """Custom tools only: the completed input must match it exactly (validated, not constrained)."""


@attrs.frozen
class ToolChoice:
    mode: Literal["auto", "none", "required", "named"] = "auto"
    name: str | None = None


@attrs.frozen
class ConversationRequest:
    messages: tuple[Message, ...]
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    parallel_tool_calls: bool = True
    sampling: SamplingRequest = SamplingRequest()
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] = attrs.field(factory=dict)
    cache_breakpoints: tuple[str, ...] = ()
    """The text of the (at most four) user blocks a client marked as prefix-checkpoint boundaries
    (Anthropic `cache_control`), in order: the prompt's pages up to the last one are kept in the
    prefix cache with priority. Advisory; they never change the prompt."""


def custom_tool_input(arguments: str) -> str:
    """A custom tool's text input from the {"input": string} function the model saw: the one reading
    both the Responses encoder (the emitted custom call) and the output check (grammar validation) use."""
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    if isinstance(parsed, dict):
        if isinstance(parsed.get("input"), str):
            return str(parsed["input"])
        values = list(parsed.values())
        if len(values) == 1 and isinstance(values[0], str):
            return str(values[0])
    return arguments
