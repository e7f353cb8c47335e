"""Tool-choice, reasoning and finish semantics (api.md, "Conversation and tool semantics" and
"Reasoning, sampling, and usage") on all three chat protocols, buffered and streamed, through the real
SDKs against a scripted model (harness.py). Each semantic test runs for both Qwen families: Hermes
JSON calls with a model-opened <think> (qwen3) and function-tag calls with a prompt-opened <think>
(qwen3_coder, Qwen3.5 template)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from helios.frontends.anthropic.messages import thinking_signature
from helios.serving.lowering import REQUIRED_SINGLE_TOOL_INSTRUCTION, REQUIRED_TOOL_INSTRUCTION
from tests.serving.harness import ScriptedServer, Writer, pieces
from tests.serving.protocols import FINISH, PROTOCOLS, TOOLS, Ask, Outcome, chat_request, run

FAMILY_NAMES = ("qwen3", "qwen3_coder")
REASON = "The user wants the weather in Paris. I should call get_weather."
WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
TIME = ("get_time", {"timezone": "Europe/Paris"})


class Case:
    """One (family, protocol, stream) combination: writes scripts, sends asks, checks outcomes."""

    def __init__(self, server: ScriptedServer, protocol: str, stream: bool) -> None:
        self.server = server
        self.protocol = protocol
        self.stream = stream
        self.w = Writer(server.family.name)
        self.tok = server.tok

    def script(self, *parts: str | list[int]) -> str:
        return self.server.book.add(*parts)

    def ask(self, key: str, **kw: Any) -> Outcome:
        return run(self.server, self.protocol, Ask(f"Please help. {key}", **kw), stream=self.stream)

    def ids(self, key: str) -> tuple[int, ...]:
        return self.server.book.script(key)

    def prompt(self, key: str) -> str:
        return self.server.book.prompt_text(key)

    def num_output_tokens(self, key: str) -> int:
        return len(self.ids(key)) + 1  # the script, then EOS

    def num_reasoning_tokens(self, key: str) -> int:
        """Tokens the parser publishes as reasoning: from after the opener through the closer."""
        ids = self.ids(key)
        close = ids.index(self._id("</think>"))
        return close + 1 if self.w.prompt_opens_reasoning else close - ids.index(self._id("<think>"))

    def nth_call_token(self, key: str, n: int) -> int:
        """Index of the n-th (0-based) <tool_call> token in the script."""
        tid = self._id("<tool_call>")
        return [i for i, t in enumerate(self.ids(key)) if t == tid][n]

    def _id(self, text: str) -> int:
        tid = self.tok.token_to_id(text)
        assert tid is not None
        return tid

    # -- checks -----------------------------------------------------------------------------------
    def ok(self, out: Outcome, finish: str) -> None:
        assert out.error is None, out.error
        assert out.terminated
        assert out.finish == FINISH[finish][self.protocol]

    def failed(self, out: Outcome, needle: str = "") -> None:
        """Buffered: HTTP 500. Streamed: a terminal error event (Responses: response.failed) and no
        success terminator."""
        assert out.error is not None and needle in out.error, out.error
        assert not out.terminated
        if self.stream:
            assert out.error_status == ("failed" if self.protocol == "responses" else "stream")
        else:
            assert out.error_status == 500

    def usage(self, out: Outcome, key: str, *, reasoning: bool) -> None:
        assert out.output_tokens == self.num_output_tokens(key)
        if self.protocol != "messages":  # Messages has no reasoning-token count
            assert out.reasoning_tokens == (self.num_reasoning_tokens(key) if reasoning else 0)


@pytest.fixture(params=FAMILY_NAMES)
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=PROTOCOLS)
def protocol(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=[False, True], ids=["buffered", "streamed"])
def stream(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture
def case(servers: dict[str, ScriptedServer], family: str, protocol: str, stream: bool) -> Case:
    return Case(servers[family], protocol, stream)


@pytest.fixture
def qcase(servers: dict[str, ScriptedServer], protocol: str, stream: bool) -> Case:
    """Family-independent output rules (they act on neutral events): the Hermes family only."""
    return Case(servers["qwen3"], protocol, stream)


# -- auto -------------------------------------------------------------------------------------------


def test_auto_call_after_reasoning(case: Case) -> None:
    key = case.script(case.w.think(REASON), case.w.call(*WEATHER))
    out = case.ask(key)  # tool_choice omitted: auto
    case.ok(out, "tool_calls")
    assert out.reasoning == REASON
    assert out.text == ""
    assert out.calls == [WEATHER]
    assert all(out.call_ids)
    case.usage(out, key, reasoning=True)
    if case.protocol == "messages":
        assert out.signatures == [thinking_signature(REASON)]
        assert out.signatures[0].startswith("flare-thinking-v1:")


def test_auto_parallel_calls_keep_order(case: Case) -> None:
    key = case.script(case.w.think(REASON), case.w.calls(WEATHER, TIME))
    out = case.ask(key, choice="auto")
    case.ok(out, "tool_calls")
    assert out.calls == [WEATHER, TIME]
    assert len(set(out.call_ids)) == 2


def test_auto_returns_calls_to_undeclared_tools(case: Case) -> None:
    stock = ("get_stock", {"symbol": "ACME"})
    key = case.script(case.w.think(REASON), case.w.calls(stock, WEATHER))
    out = case.ask(key, choice="auto")
    case.ok(out, "tool_calls")
    assert out.calls == [stock, WEATHER]


def test_answer_text_before_a_call_is_kept(case: Case) -> None:
    key = case.script(case.w.think(REASON), "I'll look up the weather in Paris.\n\n", case.w.call(*WEATHER))
    out = case.ask(key)
    case.ok(out, "tool_calls")
    assert out.text == "I'll look up the weather in Paris."
    assert out.calls == [WEATHER]


def test_function_tag_values_follow_the_schema(servers: dict[str, ScriptedServer], protocol: str, stream: bool) -> None:
    case = Case(servers["qwen3_coder"], protocol, stream)
    key = case.script(case.w.think(REASON), case.w.call("get_weather", {"city": "Paris", "days": 3}),
                      "\n", case.w.call("get_stock", {"symbol": "42"}))
    out = case.ask(key)
    case.ok(out, "tool_calls")
    # Declared integer parameter converted; an undeclared tool has no schema to convert by.
    assert out.calls[0] == ("get_weather", {"city": "Paris", "days": 3})
    assert out.calls[1][0] == "get_stock"


# -- none -------------------------------------------------------------------------------------------


def test_choice_none_presents_no_tools_and_leaves_markup_as_text(case: Case) -> None:
    key = case.script(case.w.think(REASON), "Here: ", case.w.call(*WEATHER))
    out = case.ask(key, choice="none")
    case.ok(out, "stop")
    assert out.calls == []
    assert out.reasoning == REASON
    assert out.text.startswith("Here: <tool_call>") and "get_weather" in out.text
    assert TOOLS["get_weather"]["description"] not in case.prompt(key)


# -- required ---------------------------------------------------------------------------------------


def test_required_succeeds_with_a_call_and_instructs_the_model(case: Case) -> None:
    key = case.script(case.w.think(REASON), case.w.call(*WEATHER))
    out = case.ask(key, choice="required")
    case.ok(out, "tool_calls")
    assert out.calls == [WEATHER]
    assert REQUIRED_TOOL_INSTRUCTION in case.prompt(key)


def test_required_without_a_call_fails(qcase: Case) -> None:
    key = qcase.script(qcase.w.think(REASON), "It is sunny in Paris.")
    out = qcase.ask(key, choice="required")
    qcase.failed(out, "tool_choice requires")
    assert out.calls == []


def test_required_fails_when_the_limit_cuts_the_only_call(qcase: Case) -> None:
    key = qcase.script(qcase.w.think(REASON), qcase.w.call(*WEATHER))
    out = qcase.ask(key, choice="required", max_tokens=qcase.nth_call_token(key, 0) + 4)
    qcase.failed(out, "tool_choice requires")
    assert out.calls == []


def test_required_with_parallel_disabled_returns_exactly_one_call(qcase: Case) -> None:
    key = qcase.script(qcase.w.think(REASON), qcase.w.call(*WEATHER))
    out = qcase.ask(key, choice="required", parallel=False)
    qcase.ok(out, "tool_calls")
    assert out.calls == [WEATHER]
    assert REQUIRED_SINGLE_TOOL_INSTRUCTION in qcase.prompt(key)


# -- named ------------------------------------------------------------------------------------------


def test_named_presents_only_the_selected_tool_and_omits_answer_text(case: Case) -> None:
    key = case.script(case.w.think(REASON), "Let me check the weather.\n\n", case.w.call(*WEATHER))
    out = case.ask(key, choice="get_weather")
    case.ok(out, "tool_calls")
    assert out.text == ""
    assert out.reasoning == REASON
    assert out.calls == [WEATHER]
    case.usage(out, key, reasoning=True)  # omitted answer text still counts
    prompt = case.prompt(key)
    assert TOOLS["get_weather"]["description"] in prompt
    assert TOOLS["get_time"]["description"] not in prompt


def test_named_call_to_another_tool_fails_before_it_is_emitted(qcase: Case) -> None:
    key = qcase.script(qcase.w.think(REASON), qcase.w.calls(WEATHER, TIME))
    out = qcase.ask(key, choice="get_weather")
    qcase.failed(out, "get_time")
    assert "get_time" not in out.call_names  # a stream may have delivered the first call


def test_named_without_a_call_fails(qcase: Case) -> None:
    key = qcase.script(qcase.w.think(REASON), "It is sunny.")
    out = qcase.ask(key, choice="get_weather")
    qcase.failed(out, "tool_choice requires")


# -- parallel limits --------------------------------------------------------------------------------


def test_parallel_disabled_fails_before_the_second_call(qcase: Case) -> None:
    key = qcase.script(qcase.w.think(REASON), qcase.w.calls(WEATHER, TIME))
    out = qcase.ask(key, parallel=False)
    qcase.failed(out, "second tool call")
    assert out.calls in ([], [WEATHER]) and (not out.calls or qcase.stream)


# -- truncation and incomplete envelopes ------------------------------------------------------------


def test_truncated_envelope_is_omitted_and_the_limit_reported(case: Case) -> None:
    key = case.script(case.w.think(REASON), case.w.call(*WEATHER))
    limit = case.nth_call_token(key, 0) + 4
    out = case.ask(key, max_tokens=limit)
    case.ok(out, "length")
    assert out.calls == []
    assert out.text == ""
    assert out.reasoning == REASON
    assert out.output_tokens == limit


def test_limit_is_reported_even_after_a_completed_call(case: Case) -> None:
    key = case.script(case.w.think(REASON), case.w.calls(WEATHER, TIME))
    out = case.ask(key, max_tokens=case.nth_call_token(key, 1) + 3)
    case.ok(out, "length")
    assert out.calls == [WEATHER]


def test_incomplete_call_at_natural_end_fails(case: Case) -> None:
    call = case.w.call(*WEATHER)
    key = case.script(case.w.think(REASON), call[: len(call) * 2 // 3])  # then EOS
    out = case.ask(key)
    case.failed(out, "incomplete tool call")
    assert out.calls == []


# -- reasoning --------------------------------------------------------------------------------------


def test_reasoning_and_answer(case: Case) -> None:
    key = case.script(case.w.think(REASON), "It is sunny in Paris.")
    out = case.ask(key, tools=())
    case.ok(out, "stop")
    assert out.reasoning == REASON
    assert out.text == "It is sunny in Paris."
    case.usage(out, key, reasoning=True)
    if case.protocol == "messages":
        assert out.signatures == [thinking_signature(REASON)]
    if case.protocol == "chat" and not case.stream:
        assert getattr(out.raw.choices[0].message, "reasoning", None) == REASON  # vLLM's alias
    if case.protocol == "chat" and case.stream:
        deltas = [c.choices[0].delta for c in out.events if c.choices]
        for d in deltas:
            assert getattr(d, "reasoning", None) == getattr(d, "reasoning_content", None)
    if case.protocol == "responses":
        [item] = [i for i in out.raw.output if i.type == "reasoning"]
        assert item.summary == [] and [c.type for c in item.content] == ["reasoning_text"]
        assert [i.type for i in out.raw.output] == ["reasoning", "message"]
    if case.protocol == "messages" and not case.stream:
        assert [b.type for b in out.raw.content] == ["thinking", "text"]


def test_reasoning_disabled(case: Case) -> None:
    key = case.script("It is sunny in Paris.")
    out = case.ask(key, tools=(), thinking=False)
    case.ok(out, "stop")
    assert out.reasoning == ""
    assert out.text == "It is sunny in Paris."
    assert case.prompt(key).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    case.usage(out, key, reasoning=False)
    assert out.signatures == []


def test_delimiter_text_written_in_pieces_is_not_markup(case: Case) -> None:
    if case.w.prompt_opens_reasoning:  # a closer in pieces keeps reasoning open
        key = case.script("Mentioning ", pieces(case.tok, "</think>"), " is fine.\n</think>\n\nDone.")
        out = case.ask(key, tools=())
        case.ok(out, "stop")
        assert (out.reasoning, out.text) == ("Mentioning </think> is fine.", "Done.")
    else:  # an opener in pieces is answer text
        key = case.script(pieces(case.tok, "<think>"), " opens reasoning.")
        out = case.ask(key, tools=())
        case.ok(out, "stop")
        assert (out.reasoning, out.text) == ("", "<think> opens reasoning.")


# -- native streaming shapes ------------------------------------------------------------------------


def test_chat_stream_shape(qwen3: ScriptedServer) -> None:
    case = Case(qwen3, "chat", True)
    key = case.script(case.w.think(REASON), case.w.calls(WEATHER, TIME))
    out = case.ask(key)
    chunks = out.events
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content == ""
    calls = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert [(tc.index, tc.type, tc.function.name) for tc in calls] == [
        (0, "function", "get_weather"), (1, "function", "get_time")]
    assert all(tc.id and tc.id.startswith("call_") for tc in calls)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0] is chunks[-2] and finals[0].choices[0].delta.content is None
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == case.num_output_tokens(key)


def test_messages_stream_shape(qwen3: ScriptedServer) -> None:
    case = Case(qwen3, "messages", True)
    key = case.script(case.w.think(REASON), "Checking.\n\n", case.w.calls(WEATHER, TIME))
    out = case.ask(key)
    types: list[str] = []
    for ev in out.events:
        label = ev.type
        if ev.type == "content_block_start":
            label += ":" + ev.content_block.type
        elif ev.type == "content_block_delta":
            label += ":" + ev.delta.type
        if not types or types[-1] != label:
            types.append(label)
    assert types == [
        "message_start",
        "content_block_start:thinking", "content_block_delta:thinking_delta", "content_block_delta:signature_delta",
        "content_block_stop",
        "content_block_start:text", "content_block_delta:text_delta", "content_block_stop",
        "content_block_start:tool_use", "content_block_delta:input_json_delta", "content_block_stop",
        "content_block_start:tool_use", "content_block_delta:input_json_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]
    starts = [ev for ev in out.events if ev.type == "content_block_start"]
    assert [ev.index for ev in starts] == [0, 1, 2, 3]
    assert starts[2].content_block.input == {} and starts[2].content_block.id.startswith("toolu_")
    assert out.events[0].message.usage.input_tokens == len(case.server.book.prompts_for(key)[-1])
    assert out.finish == "tool_use" and out.text == "Checking."


def test_responses_stream_shape(qwen3: ScriptedServer) -> None:
    case = Case(qwen3, "responses", True)
    key = case.script(case.w.think(REASON), case.w.call(*WEATHER))
    out = case.ask(key)
    assert [ev.sequence_number for ev in out.events] == list(range(len(out.events)))
    types = [ev.type for ev in out.events if ev.type != "response.reasoning_text.delta"]
    assert types == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]
    added = [ev.item for ev in out.events if ev.type == "response.output_item.added"]
    assert added[1].type == "function_call" and added[1].status == "in_progress" and added[1].arguments == ""
    done = [ev.item for ev in out.events if ev.type == "response.output_item.done"]
    assert done[1].status == "completed" and done[1].id == added[1].id
    assert [i.type for i in out.raw.output] == ["reasoning", "function_call"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_stream_failure_has_no_success_terminator_on_the_wire(qwen3: ScriptedServer, protocol: str) -> None:
    """Raw SSE: a tool-choice failure after streaming began ends in the protocol's error event."""
    key = qwen3.book.add("<think>\nNo tools today.\n</think>\n\nIt is sunny.")
    ask = Ask(f"Weather? {key}", choice="required")
    if protocol == "chat":
        path, body = "/v1/chat/completions", chat_request(ask)
    elif protocol == "messages":
        from tests.serving.protocols import messages_request

        path, body = "/v1/messages", messages_request(ask)
    else:
        from tests.serving.protocols import responses_request

        path, body = "/v1/responses", responses_request(ask)
    body.pop("extra_body", None)
    with qwen3.http() as client, client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    if protocol == "chat":
        assert "[DONE]" not in data and '"error"' in data[-1]
        assert '"finish_reason":"' not in "".join(data).replace(" ", "")
    elif protocol == "messages":
        assert events[-1] == "error" and "message_stop" not in events and "message_delta" not in events
    else:
        assert events[-1] == "response.failed" and "response.completed" not in events


def test_chat_n_choices_are_each_validated(qwen3: ScriptedServer) -> None:
    """n > 1: every child obeys the tool-choice rules; a violating choice fails the request."""
    client = qwen3.openai()
    key = qwen3.book.add(Writer("qwen3").think(REASON), Writer("qwen3").call(*WEATHER))
    r = client.chat.completions.create(**{**chat_request(Ask(key, choice="get_weather")), "n": 2})
    assert [c.finish_reason for c in r.choices] == ["tool_calls", "tool_calls"]
    assert all(c.message.tool_calls and c.message.tool_calls[0].function.name == "get_weather" for c in r.choices)
    key = qwen3.book.add(Writer("qwen3").think(REASON), Writer("qwen3").call(*TIME))
    with pytest.raises(Exception) as err:
        client.chat.completions.create(**{**chat_request(Ask(key, choice="get_weather")), "n": 2})
    assert getattr(err.value, "status_code", None) == 500
    # Streamed, the first violating choice ends the stream early; the server stays healthy.
    chunks: list[Any] = []
    with pytest.raises(Exception) as err:
        chunks.extend(client.chat.completions.create(
            **{**chat_request(Ask(key, choice="get_weather")), "n": 2, "stream": True}))
    assert "get_time" in str(err.value)
    assert not any(c.choices and c.choices[0].finish_reason for c in chunks)
    assert httpx.get(qwen3.url + "/health").status_code == 200


# -- more spec edges --------------------------------------------------------------------------------


def test_a_call_inside_reasoning_ends_it(case: Case) -> None:
    """Qwen treats <tool_call> as an implicit end of reasoning."""
    opener = "" if case.w.prompt_opens_reasoning else "<think>\n"
    key = case.script(opener, "I will call the tool now.\n\n", case.w.call(*WEATHER))
    out = case.ask(key)
    case.ok(out, "tool_calls")
    assert out.reasoning == "I will call the tool now."
    assert out.calls == [WEATHER] and out.text == ""


def test_a_tool_tag_in_prose_stays_text(case: Case) -> None:
    key = case.script(case.w.think(REASON), "Calls are wrapped in <tool_call> tags, like this one.")
    out = case.ask(key)
    case.ok(out, "stop")
    assert out.calls == [] and out.text == "Calls are wrapped in <tool_call> tags, like this one."


def test_a_string_stop_after_a_call_reports_the_stop(case: Case) -> None:
    key = case.script(case.w.think(REASON), case.w.call(*WEATHER), "\nEND OF TURN and more")
    out = case.ask(key, stop=("END OF TURN",))
    case.ok(out, "stop_string")
    assert out.calls == [WEATHER]
    if case.protocol != "responses":
        assert out.matched_stop == "END OF TURN"


def test_a_string_stop_inside_a_call_drops_the_cut_envelope(case: Case) -> None:
    """A user's stop that matches inside a tool envelope ends the output there, as the output limit
    does: the cut call is dropped (not an error), the calls before it are kept, the stop reported."""
    second = ("get_weather", {"city": "Lyon", "unit": "celsius"})
    key = case.script(case.w.think(REASON), case.w.call(*WEATHER), "\n", case.w.call(*second), "\nafter")
    out = case.ask(key, stop=("Lyon",))
    case.ok(out, "stop_string")
    assert out.calls == [WEATHER]
    if case.protocol != "responses":
        assert out.matched_stop == "Lyon"


def test_eos_on_the_last_allowed_token_is_the_cause(case: Case) -> None:
    key = case.script(case.w.think(REASON), case.w.call(*WEATHER))
    out = case.ask(key, max_tokens=case.num_output_tokens(key))
    case.ok(out, "tool_calls")
    assert out.calls == [WEATHER]


def test_required_is_not_satisfied_by_undeclared_tools(qcase: Case) -> None:
    key = qcase.script(qcase.w.think(REASON), qcase.w.call("get_stock", {"symbol": "ACME"}))
    out = qcase.ask(key, choice="required")
    qcase.failed(out, "tool_choice requires")


def test_responses_custom_and_namespaced_tools_are_restored(qwen3: ScriptedServer, stream: bool) -> None:
    w = Writer("qwen3")
    key = qwen3.book.add(w.think(REASON), w.calls(("apply_patch", {"input": "*** Begin Patch"}),
                                                  ("files__read", {"path": "a.txt"})))
    tools = [{"type": "custom", "name": "apply_patch", "description": "Apply a patch."},
             {"type": "namespace", "name": "files", "description": "Files.",
              "tools": [{"type": "function", "name": "read", "parameters": {
                  "type": "object", "properties": {"path": {"type": "string"}}}}]}]
    kw: dict[str, Any] = dict(model="m", input=f"Patch it. {key}", tools=tools)
    client = qwen3.openai()
    if stream:
        events = list(client.responses.create(stream=True, **kw))
        assert events[-1].type == "response.completed"
        assert "response.custom_tool_call_input.delta" in [e.type for e in events]
        r = events[-1].response
    else:
        r = client.responses.create(**kw)
    custom, fn = [i for i in r.output if i.type != "reasoning"]
    assert (custom.type, custom.name, custom.input) == ("custom_tool_call", "apply_patch", "*** Begin Patch")
    assert (fn.type, fn.name, getattr(fn, "namespace", None)) == ("function_call", "read", "files")
    assert json.loads(fn.arguments) == {"path": "a.txt"}
    prompt = qwen3.book.prompt_text(key)
    assert '"files__read"' in prompt and '"apply_patch"' in prompt
