"""The tool-choice output rules every chat protocol gets (spec, "Conversation and tool semantics").

One `ToolCallCheck` per generated child. The drivers ask it about each parsed call before the encoder
emits it, and about the terminal cause before the encoder emits a success terminator:

- named choice: every call must target the selected tool; a call to another tool fails the response
  before that call is emitted. Ordinary answer text is omitted (reasoning and calls are kept).
- ``parallel_tool_calls: false`` (Anthropic ``disable_parallel_tool_use``): a second call fails the
  response before it is emitted.
- required and named choices: the output needs at least one completed call to a declared tool (the
  selected one, when named). Missing calls, including output truncated before a call completed,
  fail the response at its end: HTTP 500 buffered, a terminal error event streamed.

Every protocol: a call whose arguments are not a JSON object fails the response before it is emitted.
Under "auto", calls to undeclared tools are returned as generated. Sans-IO; the serving drivers
(`helios.serving.drive`) apply it to every child of a conversation and turn a failure into the
protocol's error (HTTP 500 buffered, the encoder's terminal error events streamed).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence

import attrs

from helios.domain.conversation import ConversationRequest, ToolChoice, custom_tool_input
from helios.domain.events import FinishCause, OutputEvent, TextDelta, ToolCall


@attrs.define
class ToolCallCheck:
    choice: ToolChoice = ToolChoice()
    parallel: bool = True
    declared: frozenset[str] = frozenset()
    num_calls: int = 0  # calls accepted for emission
    num_satisfying: int = 0  # accepted calls that satisfy a required or named choice
    validators: Mapping[str, Callable[[str], str | None]] = attrs.field(factory=dict)
    """Custom tools with a grammar: name -> validator of the call's input (None: it matches)."""

    @classmethod
    def for_conversation(cls, conv: ConversationRequest, declared: Iterable[str] | None = None,
                         validators: Mapping[str, Callable[[str], str | None]] | None = None) -> ToolCallCheck:
        names = frozenset(t.name for t in conv.tools) if declared is None else frozenset(declared)
        return cls(conv.tool_choice, conv.parallel_tool_calls, names, validators=dict(validators or {}))

    @property
    def omits_text(self) -> bool:
        """Named selection drops ordinary answer text from buffered and streamed responses."""
        return self.choice.mode == "named"

    def check_call(self, call: ToolCall) -> str | None:
        """None when `call` may be emitted (it is counted); otherwise why the response fails."""
        try:
            args = json.loads(call.arguments) if call.arguments.strip() else {}
        except json.JSONDecodeError:
            return f"the model's arguments for '{call.name}' are not valid JSON"
        if not isinstance(args, dict):
            return f"the model's arguments for '{call.name}' are not a JSON object"
        validate = self.validators.get(call.name)
        if validate is not None:  # a custom tool's grammar: the exact input bytes, no repair
            problem = validate(custom_tool_input(call.arguments))
            if problem is not None:
                return problem
        if self.choice.mode == "named" and call.name != self.choice.name:
            return f"tool_choice selects '{self.choice.name}', but the model called '{call.name}'"
        if not self.parallel and self.num_calls >= 1:
            return "parallel tool calls are disabled, but the model began a second tool call"
        self.num_calls += 1
        if call.name in self.declared:
            self.num_satisfying += 1
        return None

    def check_finish(self, cause: FinishCause) -> str | None:
        """At a terminal cause other than ERROR/ABORTED: None, or why the response fails."""
        if cause in (FinishCause.ERROR, FinishCause.ABORTED):
            return None
        if self.choice.mode in ("required", "named") and self.num_satisfying == 0:
            target = "a declared tool" if self.choice.mode == "required" else f"'{self.choice.name}'"
            truncated = " before the output limit" if cause is FinishCause.LENGTH else ""
            return (f"tool_choice requires a call to {target}, but the model produced no completed call"
                    f"{truncated}")
        return None

    def screen(self, events: Sequence[OutputEvent]) -> tuple[list[OutputEvent], str | None]:
        """The events an encoder may emit, in order, up to the first violation; and that violation."""
        out: list[OutputEvent] = []
        for e in events:
            if isinstance(e, TextDelta) and self.omits_text:
                continue
            if isinstance(e, ToolCall):
                failure = self.check_call(e)
                if failure is not None:
                    return out, failure
            out.append(e)
        return out, None
