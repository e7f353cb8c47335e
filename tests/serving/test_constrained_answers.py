"""Structured output through the serving stack (api.md, "Reasoning, sampling, and usage": output
constraints; "Conversation and tool semantics": custom tool grammars), with the scripted model on
the three chat protocols, buffered and streamed.

The scripted model puts all its mass on its script's next token; under a constraint the engine
masks every token the answer grammar forbids, so a script that breaks the schema still yields a
valid answer, and a script that keeps to it comes out verbatim. Reasoning and tool calls are free.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.serving import protocols
from tests.serving.harness import (
    Family,
    ScriptBook,
    ScriptedServer,
    Writer,
    runtime_factory,
    scripted_tokenizer,
    serving_config,
)
from tests.serving.protocols import FINISH, PROTOCOLS, Ask, Outcome, run

CITY = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 9}}}
REASON = "The user wants JSON. Not JSON: <b>plain text</b> {unbalanced"
MODES = [(p, s) for p in PROTOCOLS for s in (False, True)]
IDS = [f"{p}-{'stream' if s else 'buffered'}" for p, s in MODES]


def _format(protocol: str, schema: dict[str, Any]) -> dict[str, Any]:
    """The protocol's own structured-output field for `schema`."""
    if protocol == "chat":
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "answer", "schema": schema, "strict": True}}}
    if protocol == "responses":
        return {"text": {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}}
    return {"extra_body": {"output_config": {"format": {"type": "json_schema", "schema": schema}}}}


@pytest.fixture
def constrained(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Adds the current test's `fields` (set by the test) to every protocol's request."""
    fields: dict[str, Any] = {}
    for name in ("chat_request", "messages_request", "responses_request"):
        build = getattr(protocols, name)

        def patched(ask: Ask, _build: Any = build) -> dict[str, Any]:
            kw = _build(ask)
            extra = {**kw.pop("extra_body", {}), **fields.get("extra_body", {})}
            kw.update({k: v for k, v in fields.items() if k != "extra_body"})
            if extra:
                kw["extra_body"] = extra
            return kw

        monkeypatch.setattr(protocols, name, patched)
    yield fields


def _ask(server: ScriptedServer, protocol: str, stream: bool, key: str, **kw: Any) -> Outcome:
    return run(server, protocol, Ask(f"Weather as JSON please. {key}", **kw), stream=stream)


@pytest.mark.parametrize("protocol, stream", MODES, ids=IDS)
def test_answer_follows_the_schema_while_reasoning_stays_free(
        qwen3: ScriptedServer, constrained: dict[str, Any], protocol: str, stream: bool) -> None:
    constrained.update(_format(protocol, CITY))
    w = Writer("qwen3")
    answer = '{"city": "Paris", "days": 3}'
    key = qwen3.book.add(w.think(REASON), answer)
    out = _ask(qwen3, protocol, stream, key)
    assert out.error is None, out.error
    assert out.finish == FINISH["stop"][protocol]
    assert out.reasoning.strip() == REASON  # free text, not JSON
    assert json.loads(out.text) == {"city": "Paris", "days": 3}
    # The schema and a JSON-only instruction are in the system prompt as well.
    prompt = qwen3.book.prompt_text(key)
    assert "Respond only with a single JSON value" in prompt and '"days"' in prompt


@pytest.mark.parametrize("protocol, stream", MODES, ids=IDS)
def test_an_answer_that_breaks_the_schema_is_masked_into_it(
        qwen3: ScriptedServer, constrained: dict[str, Any], protocol: str, stream: bool) -> None:
    schema = {"type": "boolean"}
    constrained.update(_format(protocol, schema))
    w = Writer("qwen3")
    key = qwen3.book.add(w.think("Thinking freely."), "Sure! It is sunny in Paris.")
    # No tools: the scripted model's masked row draws uniformly among the allowed tokens, which with
    # tools would include the (free) tool-call opener.
    out = _ask(qwen3, protocol, stream, key, tools=())
    assert out.error is None, out.error
    assert out.reasoning.strip() == "Thinking freely."
    assert json.loads(out.text) in (True, False), out.text  # the script's prose never got through


@pytest.mark.parametrize("protocol, stream", MODES, ids=IDS)
def test_tool_calls_stay_free_under_a_constraint(
        qwen3: ScriptedServer, constrained: dict[str, Any], protocol: str, stream: bool) -> None:
    constrained.update(_format(protocol, CITY))
    w = Writer("qwen3")
    key = qwen3.book.add(w.think("I need the tool."), w.call("get_weather", {"city": "Paris"}))
    out = _ask(qwen3, protocol, stream, key)
    assert out.error is None, out.error
    assert out.calls == [("get_weather", {"city": "Paris"})]
    assert out.finish == FINISH["tool_calls"][protocol]
    assert out.text == ""


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "stream"])
def test_prompt_opened_reasoning_and_function_tags_under_a_regex(coder: ScriptedServer, stream: bool,
                                                                 constrained: dict[str, Any]) -> None:
    """Qwen3.5's template opens <think> in the prompt: the gate starts in reasoning."""
    constrained.update({"extra_body": {"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}}})
    w = Writer("qwen3_coder")
    key = coder.book.add(w.think("free < > { text"), "ABC-12")
    out = _ask(coder, "chat", stream, key)
    assert out.error is None, out.error
    assert out.reasoning.strip() == "free < > { text" and out.text.strip() == "ABC-12"


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "stream"])
def test_raw_completions_follow_structured_outputs(qwen3: ScriptedServer, stream: bool) -> None:
    """Raw prompts have no envelope: the regex applies from the first token, and a script that
    breaks it is masked into it."""
    key = qwen3.book.add("not digits at all")
    client = qwen3.openai()
    kw: dict[str, Any] = {"model": "m", "prompt": f"Three digits: {key}", "max_tokens": 16,
                          "extra_body": {"structured_outputs": {"regex": "[0-9]{3}"}}}
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    else:
        text = client.completions.create(**kw).choices[0].text
    assert len(text) == 3 and text.isdigit(), text


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_conflicts_with_a_constraint_are_400s(qwen3: ScriptedServer, protocol: str) -> None:
    fmt = _format(protocol, CITY)
    body: dict[str, Any] = {"model": "m", "max_tokens": 32}
    messages = [{"role": "user", "content": "hi"}]
    if protocol == "chat":
        body.update(messages=messages, **fmt)
        route, stop_field = "/v1/chat/completions", "stop"
    elif protocol == "responses":
        body = {"model": "m", "input": "hi", "max_output_tokens": 32, **fmt}
        route, stop_field = "/v1/responses", "stop"
    else:
        body.update(messages=messages, **fmt["extra_body"])
        route, stop_field = "/v1/messages", "stop_sequences"
    headers = {"anthropic-version": "2023-06-01"}
    stop = httpx.post(qwen3.url + route, json={**body, stop_field: ["END"]}, headers=headers, timeout=30)
    assert stop.status_code == 400, stop.text
    assert stop_field in stop.text
    if protocol != "responses":
        prefill = {**body, "messages": [*messages, {"role": "assistant", "content": "{"}]}
        if protocol == "chat":
            prefill.update(continue_final_message=True, add_generation_prompt=False)
        r = httpx.post(qwen3.url + route, json=prefill, headers=headers, timeout=30)
        assert r.status_code == 400 and "continuation" in r.text, r.text
    if protocol == "chat":
        r = httpx.post(qwen3.url + route, json={**body, "ignore_eos": True}, timeout=30)
        assert r.status_code == 400 and "ignore_eos" in r.text
        r = httpx.post(qwen3.url + route, json={**body, "min_tokens": 4}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
        bad = {**body, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "strict": True, "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}}}
        r = httpx.post(qwen3.url + route, json=bad, timeout=30)
        assert r.status_code == 400 and "additionalProperties" in r.text
        r = httpx.post(qwen3.url + route, json={**body, "response_format": None,
                                                 "structured_outputs": {"regex": "[a-"}}, timeout=30)
        assert r.status_code == 400 and "structured_outputs.regex" in r.text and "regex" in r.json()["error"]["param"]
        prefills = len(qwen3.book.prefills)
        for hostile in ({"json": '{"enum": ["\\ud800"]}'}, {"json": "[" * 3000 + "]" * 3000},
                        {"grammar": "start: " + "(" * 400 + '"a"' + ")" * 400}, {"choice": ["a", ""]}):
            r = httpx.post(qwen3.url + route, json={**body, "response_format": None, "structured_outputs": hostile},
                           timeout=30)
            assert r.status_code in (200, 400), (hostile, r.status_code, r.text)
            if r.status_code == 400:
                assert r.json()["error"]["param"].startswith("structured_outputs"), r.text
        assert len(qwen3.book.prefills) <= prefills + 1  # only a valid one may reach the engine


def test_the_parsers_structured_output_mode_is_on_under_a_constraint(servers: dict[str, ScriptedServer]) -> None:
    """DeepSeek DSML families: under a constraint, markup inside the structured answer stays answer
    text (the parser's structured-output mode, which `Service.prepare` turns on)."""
    from helios.domain.conversation import ConversationRequest, Message, TextPart
    from helios.domain.events import TextDelta
    from helios.parsers.errors import ToolParseError
    from helios.recipes import plain_recipe
    from helios.serving.service_factory import make_service

    assert servers is not None  # the fixture skips when the template fixtures are absent
    family = Family("deepseek_v4", "qwen3.jinja", lambda: plain_recipe(output_parser="deepseek_v4"))
    service = make_service(runtime_factory(family, ScriptBook(scripted_tokenizer()))(serving_config()))
    conv = ConversationRequest(messages=(Message("user", (TextPart("hi"),)),))
    answer = '{"m": "<｜DSML｜tool_calls><｜DSML｜invoke name=\\"f\\">"}'
    factory = service.parser_factory(conv, "prompt<think>", structured=True)
    assert factory is not None
    parser = factory()
    events = parser.feed("plan</think>" + answer, ()) + parser.finish()
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == answer
    plain = service.parser_factory(conv, "prompt<think>")
    assert plain is not None
    with pytest.raises(ToolParseError):  # without a constraint the markup is parsed (unterminated here)
        parser = plain()
        parser.feed("plan</think>" + answer, ())
        parser.finish()


# -- Codex's freeform apply_patch: a custom tool with a Lark grammar ---------------------------------------

APPLY_PATCH_LARK = r'''start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
'''
APPLY_PATCH = {"type": "custom", "name": "apply_patch",
               "description": "Use the `apply_patch` tool to edit files.",
               "format": {"type": "grammar", "syntax": "lark", "definition": APPLY_PATCH_LARK}}
GOOD_PATCH = "*** Begin Patch\n*** Update File: hello.py\n@@\n-print('hi')\n+print('hello')\n*** End Patch\n"
BAD_PATCH = "*** Begin Patch\n*** Rewrite hello.py please\n*** End Patch\n"


def _patch_call(w: Writer, patch: str) -> str:
    return w.call("apply_patch", {"input": patch})


def _codex(server: ScriptedServer, key: str, stream: bool) -> tuple[Any, list[Any], str | None]:
    client = server.openai()
    kw = {"model": "m", "input": [{"role": "user", "content": f"Fix hello.py. {key}"}], "tools": [APPLY_PATCH],
          "max_output_tokens": 512}
    if not stream:
        try:
            return client.responses.create(**kw), [], None
        except openai.APIStatusError as exc:
            return None, [], f"{exc.status_code}: {exc.message}"
    events = list(client.responses.create(stream=True, **kw))
    final = next((e.response for e in events if e.type in ("response.completed", "response.failed")), None)
    failed = next((e for e in events if e.type == "response.failed"), None)
    error = None if failed is None else f"failed: {failed.response.error.message if failed.response.error else ''}"
    return final, events, error


def _failed_total(server: ScriptedServer) -> int:
    return int(httpx.get(server.url + "/metrics", params={"format": "json"}, timeout=10).json()["failed"])


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "stream"])
def test_codex_apply_patch_is_accepted_when_its_input_matches_the_grammar(qwen3: ScriptedServer,
                                                                          stream: bool) -> None:
    w = Writer("qwen3")
    key = qwen3.book.add(w.think("Patch it."), _patch_call(w, GOOD_PATCH))
    final, events, error = _codex(qwen3, key, stream)
    assert error is None, error
    calls = [item for item in final.output if item.type == "custom_tool_call"]
    assert [(c.name, c.input) for c in calls] == [("apply_patch", GOOD_PATCH)]
    if stream:
        done = [e for e in events if e.type == "response.custom_tool_call_input.done"]
        assert [e.input for e in done] == [GOOD_PATCH]
    # The grammar contract is in the tool description the model saw.
    prompt = qwen3.book.prompt_text(key)
    assert "The input must match this Lark grammar exactly" in prompt and "*** Begin Patch" in prompt


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "stream"])
def test_codex_apply_patch_fails_the_response_when_its_input_does_not_match(qwen3: ScriptedServer,
                                                                           stream: bool) -> None:
    w = Writer("qwen3")
    key = qwen3.book.add(w.think("Patch it."), _patch_call(w, BAD_PATCH))
    before = _failed_total(qwen3)
    _, events, error = _codex(qwen3, key, stream)
    assert error is not None and "apply_patch" in error and "grammar" in error, error
    if stream:  # the invalid call was never emitted
        assert not any(e.type == "response.output_item.added" and e.item.type == "custom_tool_call" for e in events)
    else:
        assert error.startswith("500")
    assert _failed_total(qwen3) == before + 1  # the failed counter counts output-validation failures


def test_an_invalid_custom_tool_grammar_is_a_400_before_admission(qwen3: ScriptedServer) -> None:
    tool = {**APPLY_PATCH, "format": {"type": "grammar", "syntax": "lark", "definition": "start: undefined_rule"}}
    prefills = len(qwen3.book.prefills)
    r = httpx.post(qwen3.url + "/v1/responses", json={"model": "m", "input": "hi", "tools": [tool]}, timeout=30)
    assert r.status_code == 400, r.text
    assert "apply_patch" in r.json()["error"]["message"] and r.json()["error"]["param"] == "tools"
    regex_tool = {**APPLY_PATCH, "format": {"type": "grammar", "syntax": "regex", "definition": "(unclosed"}}
    r = httpx.post(qwen3.url + "/v1/responses", json={"model": "m", "input": "hi", "tools": [regex_tool]}, timeout=30)
    assert r.status_code == 400, r.text
    assert len(qwen3.book.prefills) == prefills  # nothing reached the engine
