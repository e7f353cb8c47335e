"""One neutral ask, sent through each chat protocol with its real SDK, read back from the SDK's parsed
objects into one `Outcome`, so a semantic test can run unchanged on Chat Completions, Messages and
Responses, buffered and streamed.

Native shapes stay available: `Outcome.raw` is the SDK's buffered object, `Outcome.events` its list
of streamed chunks or events.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import attrs
import openai

from tests.serving.harness import ScriptedServer

PROTOCOLS = ("chat", "messages", "responses")

TOOLS: dict[str, dict[str, Any]] = {
    "get_weather": {
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                           "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
    "get_time": {
        "description": "Local time in a timezone.",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
    },
}

# The protocol-native names of the neutral outcomes.
FINISH = {
    "tool_calls": {"chat": "tool_calls", "messages": "tool_use", "responses": "completed"},
    "stop": {"chat": "stop", "messages": "end_turn", "responses": "completed"},
    "length": {"chat": "length", "messages": "max_tokens", "responses": "incomplete:max_output_tokens"},
    "stop_string": {"chat": "stop", "messages": "stop_sequence", "responses": "completed"},
}


@attrs.frozen
class Ask:
    """A one-turn request: the user text (carrying the script key) and the tool settings."""

    prompt: str
    tools: tuple[str, ...] = ("get_weather", "get_time")
    choice: str | None = None  # None (omitted), "auto", "none", "required", or a tool name (named)
    parallel: bool | None = None  # False: parallel_tool_calls false / disable_parallel_tool_use
    max_tokens: int = 256
    thinking: bool | None = None  # None: the template's default; False: reasoning disabled
    stop: tuple[str, ...] = ()  # string stops (Messages: stop_sequences)
    budget: int | None = None  # thinking_token_budget (Messages: see budget_field)
    budget_field: str = "thinking_token_budget"  # Messages: or "budget_tokens" (thinking enabled)


@attrs.define
class Outcome:
    protocol: str
    stream: bool
    reasoning: str = ""
    text: str = ""
    calls: list[tuple[str, dict[str, Any]]] = attrs.field(factory=list)
    call_ids: list[str] = attrs.field(factory=list)
    finish: str | None = None  # protocol-native; Responses: status or "incomplete:<reason>"
    error: str | None = None  # the failure message, buffered or streamed
    error_status: int | str | None = None  # HTTP status (buffered) or "stream" / "failed" (streamed)
    terminated: bool = False  # a success terminator arrived (finish chunk, message_stop, completed/incomplete)
    matched_stop: Any = None  # Chat stop_reason (vLLM) / Messages stop_sequence
    output_tokens: int | None = None
    reasoning_tokens: int | None = None  # None where the protocol has no such count (Messages)
    signatures: list[str] = attrs.field(factory=list)  # Messages thinking-block markers
    raw: Any = None
    events: list[Any] = attrs.field(factory=list)

    @property
    def call_names(self) -> list[str]:
        return [name for name, _ in self.calls]


def run(server: ScriptedServer, protocol: str, ask: Ask, *, stream: bool) -> Outcome:
    return {"chat": _chat, "messages": _messages, "responses": _responses}[protocol](server, ask, stream)


# -- Chat Completions -------------------------------------------------------------------------------


def chat_request(ask: Ask) -> dict[str, Any]:
    kw: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": ask.prompt}],
                          "max_tokens": ask.max_tokens}
    if ask.tools:
        kw["tools"] = [{"type": "function", "function": {"name": n, **TOOLS.get(n, _ANY_TOOL)}} for n in ask.tools]
    if ask.choice is not None:
        kw["tool_choice"] = (ask.choice if ask.choice in ("auto", "none", "required")
                             else {"type": "function", "function": {"name": ask.choice}})
    if ask.parallel is not None:
        kw["parallel_tool_calls"] = ask.parallel
    if ask.thinking is False:
        kw["extra_body"] = {"chat_template_kwargs": {"enable_thinking": False}}
    if ask.stop:
        kw["stop"] = list(ask.stop)
    if ask.budget is not None:
        kw["extra_body"] = {**kw.get("extra_body", {}), "thinking_token_budget": ask.budget}
    return kw


def _chat(server: ScriptedServer, ask: Ask, stream: bool) -> Outcome:
    client = server.openai()
    out = Outcome("chat", stream)
    kw = chat_request(ask)
    if not stream:
        try:
            r = client.chat.completions.create(**kw)
        except openai.APIStatusError as exc:
            out.error, out.error_status = exc.message, exc.status_code
            return out
        out.raw = r
        choice = r.choices[0]
        msg = choice.message
        out.text = msg.content or ""
        out.reasoning = getattr(msg, "reasoning_content", None) or ""
        for tc in msg.tool_calls or []:
            out.calls.append((tc.function.name, json.loads(tc.function.arguments)))
            out.call_ids.append(tc.id)
        out.finish = choice.finish_reason
        out.matched_stop = getattr(choice, "stop_reason", None)
        out.terminated = True
        _chat_usage(out, r.usage)
        return out
    calls: dict[int, dict[str, Any]] = {}
    try:
        for c in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
            out.events.append(c)
            if c.usage is not None:
                _chat_usage(out, c.usage)
            for ch in c.choices:
                d = ch.delta
                out.text += d.content or ""
                out.reasoning += getattr(d, "reasoning_content", None) or ""
                for tc in d.tool_calls or []:
                    entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                    entry["id"] += tc.id or ""
                    if tc.function is not None:
                        entry["name"] += tc.function.name or ""
                        entry["arguments"] += tc.function.arguments or ""
                if ch.finish_reason is not None:
                    out.finish = ch.finish_reason
                    out.matched_stop = getattr(ch, "stop_reason", None)
                    out.terminated = True
    except openai.APIError as exc:
        out.error = exc.message
        out.error_status = exc.status_code if isinstance(exc, openai.APIStatusError) else "stream"
    for _, entry in sorted(calls.items()):
        out.calls.append((entry["name"], json.loads(entry["arguments"])))
        out.call_ids.append(entry["id"])
    return out


def _chat_usage(out: Outcome, usage: Any) -> None:
    if usage is None:
        return
    out.output_tokens = usage.completion_tokens
    details = usage.completion_tokens_details
    out.reasoning_tokens = details.reasoning_tokens if details is not None else None


# -- Anthropic Messages ---------------------------------------------------------------------------


def messages_request(ask: Ask) -> dict[str, Any]:
    kw: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": ask.prompt}],
                          "max_tokens": ask.max_tokens}
    if ask.tools:
        kw["tools"] = [{"name": n, "description": TOOLS.get(n, _ANY_TOOL)["description"],
                        "input_schema": TOOLS.get(n, _ANY_TOOL)["parameters"]} for n in ask.tools]
    choice: dict[str, Any] | None = None
    if ask.choice in ("auto", "none"):
        choice = {"type": ask.choice}
    elif ask.choice == "required":
        choice = {"type": "any"}
    elif ask.choice is not None:
        choice = {"type": "tool", "name": ask.choice}
    if ask.parallel is False:
        choice = {**(choice or {"type": "auto"}), "disable_parallel_tool_use": True}
    if choice is not None:
        kw["tool_choice"] = choice
    if ask.thinking is False:
        kw["thinking"] = {"type": "disabled"}
    if ask.stop:
        kw["stop_sequences"] = list(ask.stop)
    if ask.budget is not None and ask.budget_field == "budget_tokens":
        kw["thinking"] = {"type": "enabled", "budget_tokens": ask.budget}
    elif ask.budget is not None:
        kw["extra_body"] = {"thinking_token_budget": ask.budget}
    return kw


def _messages(server: ScriptedServer, ask: Ask, stream: bool) -> Outcome:
    client = server.anthropic()
    out = Outcome("messages", stream)
    kw = messages_request(ask)
    if not stream:
        try:
            r = client.messages.create(**kw)
        except anthropic.APIStatusError as exc:
            out.error, out.error_status = exc.message, exc.status_code
            return out
        out.raw = r
        for b in r.content:
            if b.type == "thinking":
                out.reasoning += b.thinking
                out.signatures.append(b.signature)
            elif b.type == "text":
                out.text += b.text
            elif b.type == "tool_use":
                out.calls.append((b.name, dict(b.input)))  # type: ignore[arg-type]
                out.call_ids.append(b.id)
        out.finish = r.stop_reason
        out.matched_stop = r.stop_sequence
        out.output_tokens = r.usage.output_tokens
        out.terminated = True
        return out
    blocks: dict[int, dict[str, Any]] = {}
    try:
        for ev in client.messages.create(stream=True, **kw):
            out.events.append(ev)
            if ev.type == "content_block_start":
                blocks[ev.index] = {"block": ev.content_block, "json": "", "text": "", "thinking": "", "sig": ""}
            elif ev.type == "content_block_delta":
                d, b = ev.delta, blocks[ev.index]
                if d.type == "text_delta":
                    b["text"] += d.text
                elif d.type == "thinking_delta":
                    b["thinking"] += d.thinking
                elif d.type == "signature_delta":
                    b["sig"] += d.signature
                elif d.type == "input_json_delta":
                    b["json"] += d.partial_json
            elif ev.type == "message_delta":
                out.finish = ev.delta.stop_reason
                out.matched_stop = ev.delta.stop_sequence
                out.output_tokens = ev.usage.output_tokens
            elif ev.type == "message_stop":
                out.terminated = True
    except anthropic.APIError as exc:
        out.error = exc.message
        out.error_status = "stream" if not isinstance(exc, anthropic.APIStatusError) or out.events else exc.status_code
    for _, b in sorted(blocks.items()):
        kind = b["block"].type
        if kind == "thinking":
            out.reasoning += b["thinking"]
            out.signatures.append(b["sig"])
        elif kind == "text":
            out.text += b["text"]
        elif kind == "tool_use":
            out.calls.append((b["block"].name, json.loads(b["json"] or "{}")))
            out.call_ids.append(b["block"].id)
    return out


# -- Responses ------------------------------------------------------------------------------------


def responses_request(ask: Ask) -> dict[str, Any]:
    kw: dict[str, Any] = {"model": "m", "input": [{"role": "user", "content": ask.prompt}],
                          "max_output_tokens": ask.max_tokens}
    if ask.tools:
        kw["tools"] = [{"type": "function", "name": n, **TOOLS.get(n, _ANY_TOOL)} for n in ask.tools]
    if ask.choice is not None:
        kw["tool_choice"] = (ask.choice if ask.choice in ("auto", "none", "required")
                             else {"type": "function", "name": ask.choice})
    if ask.parallel is not None:
        kw["parallel_tool_calls"] = ask.parallel
    if ask.thinking is False:
        kw["reasoning"] = {"effort": "none"}
    if ask.stop:
        kw["extra_body"] = {"stop": list(ask.stop)}  # a native extension on Responses
    if ask.budget is not None:
        kw["extra_body"] = {**kw.get("extra_body", {}), "thinking_token_budget": ask.budget}
    return kw


def _responses(server: ScriptedServer, ask: Ask, stream: bool) -> Outcome:
    client = server.openai()
    out = Outcome("responses", stream)
    kw = responses_request(ask)
    if not stream:
        try:
            r = client.responses.create(**kw)
        except openai.APIStatusError as exc:
            out.error, out.error_status = exc.message, exc.status_code
            return out
        out.raw = r
        _read_response(out, r)
        out.terminated = True
        return out
    final = None
    try:
        for ev in client.responses.create(stream=True, **kw):
            out.events.append(ev)
            if ev.type in ("response.completed", "response.incomplete"):
                final = ev.response
                out.terminated = True
            elif ev.type == "response.failed":
                final = ev.response
                out.error = ev.response.error.message if ev.response.error else "failed"
                out.error_status = "failed"
    except openai.APIError as exc:
        out.error, out.error_status = exc.message, "stream"
    # Deltas, not the terminal snapshot, are what a streaming client sees.
    for ev in out.events:
        if ev.type == "response.reasoning_text.delta":
            out.reasoning += ev.delta
        elif ev.type == "response.output_text.delta":
            out.text += ev.delta
        elif ev.type == "response.output_item.done" and ev.item.type == "function_call":
            out.calls.append((ev.item.name, json.loads(ev.item.arguments)))
            out.call_ids.append(ev.item.call_id)
    if final is not None:
        out.raw = final
        if out.error is None:
            out.finish = _status(final)
        _usage_of(out, final)
    return out


def _read_response(out: Outcome, r: Any) -> None:
    for item in r.output:
        if item.type == "reasoning":
            out.reasoning += "".join(c.text for c in item.content or [] if c.type == "reasoning_text")
        elif item.type == "message":
            out.text += "".join(c.text for c in item.content if c.type == "output_text")
        elif item.type == "function_call":
            out.calls.append((item.name, json.loads(item.arguments)))
            out.call_ids.append(item.call_id)
    out.finish = _status(r)
    _usage_of(out, r)


def _status(r: Any) -> str:
    if r.status == "incomplete":
        return f"incomplete:{r.incomplete_details.reason if r.incomplete_details else None}"
    return str(r.status)


def _usage_of(out: Outcome, r: Any) -> None:
    if r.usage is not None:
        out.output_tokens = r.usage.output_tokens
        out.reasoning_tokens = r.usage.output_tokens_details.reasoning_tokens


_ANY_TOOL: dict[str, Any] = {"description": "A tool.", "parameters": {"type": "object", "properties": {}}}
