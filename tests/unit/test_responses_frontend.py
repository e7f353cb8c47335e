"""The Responses frontend without a server: input decoding, rejections, and the SSE encoder fed with
fabricated ChildUpdate sequences (validated against the openai SDK's own models and stream helper)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import pydantic
import pytest
from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from helios.domain.conversation import ReasoningPart, TextPart, ToolCallPart, ToolChoice, ToolResultPart
from helios.domain.events import Finish, FinishCause, OutputEvent, ReasoningDelta, TextDelta, ToolCall
from helios.domain.generation import ChildUpdate, PreparedPrompt, StreamEvent
from helios.domain.logprobs import TokenLogprob
from helios.domain.model import ModelInfo
from helios.domain.sampling import SamplingParams
from helios.errors import BadRequest, InternalError
from helios.frontends.ollama import discovery
from helios.frontends.openai import shapes
from helios.frontends.openai.responses import (
    ResponsesPlan,
    ResponsesWire,
    ToolSet,
    decode_responses,
    toolset_of,
)
from helios.frontends.openai.responses_encoder import ResponseEncoder, make_encoder
from helios.frontends.wire import structure
from helios.serving.drive import OutputRules
from helios.serving.toolcheck import ToolCallCheck


def decode_tools(raw: Any, tool_choice: Any) -> tuple[ToolSet, ToolChoice]:
    """``tools`` and ``tool_choice`` as sent → the declared tools and the choice."""
    w = structure({"input": "", "tools": raw, "tool_choice": tool_choice}, ResponsesWire)
    return toolset_of(w.tools, w.tool_choice)


def info(**kw: Any) -> ModelInfo:
    base: dict[str, Any] = dict(
        model_id="org/model", aliases=("smol", "other"), created=0, max_model_len=8192, vocab_size=1000,
        default_max_tokens=256, max_concurrency=4, prefill_chunk_size=256, max_top_logprobs=20,
        prompt_logprobs=False, sampling_defaults={}, sampling_ranges={}, recipe="plain", has_bos=True,
    )
    base.update(kw)
    return ModelInfo(**base)


def decode(obj: dict[str, Any], **kw: Any) -> ResponsesPlan:
    return decode_responses(obj, info(**kw))


# -- decoding ---------------------------------------------------------------------------------------


def test_string_input_and_instructions() -> None:
    plan = decode({"input": "Hi", "instructions": "Be brief."})
    msgs = plan.conversation.messages
    assert [m.role for m in msgs] == ["system", "user"]
    assert msgs[0].text == "Be brief." and msgs[1].text == "Hi"
    assert plan.conversation.tool_choice == ToolChoice("none") and not plan.stream


def test_items_form_turns() -> None:
    tools = [
        {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}},
        {"type": "custom", "name": "patch", "description": "apply a patch"},
        {"type": "namespace", "name": "fs", "description": "files",
         "tools": [{"type": "function", "name": "read", "strict": False}]},
    ]
    plan = decode({
        "tools": tools,
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                            {"type": "input_text", "text": "b"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": "think"}], "encrypted_content": "opaque"},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
            {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{\"q\": 1}"},
            {"type": "function_call", "call_id": "c2", "name": "read", "namespace": "fs", "arguments": ""},
            {"type": "custom_tool_call", "call_id": "c3", "name": "patch", "input": "*** Begin"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {"type": "function_call_output", "call_id": "c2",
             "output": [{"type": "input_text", "text": "two"}]},
            {"type": "custom_tool_call_output", "call_id": "c3", "output": "done"},
            {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "s"}]},
        ],
    })
    msgs = plan.conversation.messages
    assert [m.role for m in msgs] == ["developer", "user", "assistant", "tool", "tool", "tool", "assistant"]
    assert msgs[1].text == "a\n\nb"
    assert msgs[2].parts == (
        ReasoningPart("think"), TextPart("Let me look."),
        ToolCallPart("c1", "lookup", {"q": 1}), ToolCallPart("c2", "fs__read", {}),
        ToolCallPart("c3", "patch", {"input": "*** Begin"}),
    )
    assert msgs[4].parts == (ToolResultPart("c2", (TextPart("two"),)),)
    assert msgs[6].parts == (ReasoningPart("s"),)
    names = [(t.name, t.kind) for t in plan.conversation.tools]
    assert names == [("lookup", "function"), ("patch", "custom"), ("fs__read", "function")]
    assert plan.conversation.tool_choice == ToolChoice("auto")


def test_assistant_turn_splits_when_order_restarts() -> None:
    plan = decode({"input": [
        {"role": "user", "content": "q"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "again"}]},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
    ]})
    assert [m.role for m in plan.conversation.messages] == ["user", "assistant", "assistant"]


@pytest.mark.parametrize("extra", [
    {"store": True},
    {"previous_response_id": "resp_1"},
    {"conversation": "conv_1"},
    {"background": True},
    {"truncation": "auto"},
    {"prompt_logprobs": 1},
    {"text": {"format": {"type": "json_schema", "name": "x"}}},  # no schema
    {"text": {"format": {"type": "json_object", "schema": {}}}},
    {"text": {"format": {"type": "regex"}}},
    {"tools": [{"type": "web_search"}]},
    {"tools": [{"type": "file_search", "vector_store_ids": []}]},
    {"tools": [{"type": "computer_use_preview"}]},
    {"tools": [{"type": "code_interpreter"}]},
    {"tools": [{"type": "image_generation"}]},
    {"tools": [{"type": "mcp", "server_label": "x"}]},
    {"tools": [{"type": "function", "name": "f", "strict": True}]},
    {"tools": [{"type": "custom", "name": "g", "format": {"type": "grammar", "syntax": "ebnf",
                                                         "definition": "start: \"a\""}}]},
    {"tools": [{"type": "custom", "name": "g", "format": {"type": "grammar", "syntax": "lark"}}]},
    {"tools": [{"type": "function", "name": "a__b"},
               {"type": "namespace", "name": "a", "description": "", "tools": [{"type": "function", "name": "b"}]}]},
    {"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "custom", "name": "f"}},
    {"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
    {"tool_choice": "required"},
    {"reasoning": {"effort": 5}},
    {"reasoning": {"effort": "extreme"}},
    {"top_logprobs": 3},
    {"bogus_field": 1},
    {"max_output_tokens": 0},
    {"input": []},
    {"input": [{"type": "item_reference", "id": "msg_1"}]},
    {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "opaque"}]},
    {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
    {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]},
    {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/gif;base64,R0lG"}]}]},
    {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
    {"input": [{"role": "tool", "content": "x"}]},
])
def test_rejections(extra: dict[str, Any]) -> None:
    obj = {"input": "hi", **extra}
    with pytest.raises(BadRequest):
        decode(obj)


def test_inert_fields_accepted() -> None:
    plan = decode({"input": "hi", "store": False, "metadata": {"k": "v"}, "user": "u", "prompt_cache_key": "p",
                   "safety_identifier": "s", "service_tier": "auto", "truncation": "disabled",
                   "include": ["reasoning.encrypted_content", "message.output_text.logprobs"], "top_logprobs": 2,
                   "text": {"format": {"type": "text"}, "verbosity": "low"}, "stream": True,
                   "reasoning": {"effort": "medium", "summary": "auto"}, "max_tool_calls": 3,
                   "top_k": 1, "seed": 7, "parallel_tool_calls": False})
    assert plan.stream and plan.num_top_logprobs == 2
    assert plan.conversation.sampling.top_k == 1 and not plan.conversation.parallel_tool_calls
    assert plan.text_config == {"format": {"type": "text"}, "verbosity": "low"}


def test_effort_maps_through_the_recipe_vocabulary() -> None:
    qwen = decode({"input": "hi", "reasoning": {"effort": "high"}}, recipe="qwen38")
    assert qwen.conversation.chat_template_kwargs == {"reasoning_effort": "xhigh"}  # ties go up
    plain = decode({"input": "hi", "reasoning": {"effort": "low"}})
    assert plain.conversation.chat_template_kwargs == {}
    none = decode({"input": "hi", "reasoning": {"effort": "none"}}, recipe="qwen38")
    assert none.conversation.chat_template_kwargs == {"enable_thinking": False}
    explicit = decode({"input": "hi", "reasoning": {"effort": "low"},
                       "chat_template_kwargs": {"reasoning_effort": "medium"}}, recipe="qwen38")
    assert explicit.conversation.chat_template_kwargs == {"reasoning_effort": "medium"}


def test_named_choice_resolves_namespaced_and_custom_tools() -> None:
    raw = [{"type": "namespace", "name": "fs", "description": "", "tools": [
        {"type": "function", "name": "read"}, {"type": "custom", "name": "write"}]}]
    toolset, choice = decode_tools(raw, {"type": "function", "name": "fs__read"})
    assert choice == ToolChoice("named", "fs__read")
    assert toolset.restore("fs__write").namespace == "fs" and toolset.restore("fs__write").name == "write"
    assert toolset.restore("unknown").name == "unknown"
    assert decode_tools(raw, {"type": "custom", "name": "fs__write"})[1] == ToolChoice("named", "fs__write")


# -- the encoder ------------------------------------------------------------------------------------

EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def update(events: Sequence[OutputEvent] = (), token_ids: Sequence[int] = (), *, finish: Finish | None = None,
           num_output: int = 0, num_reasoning: int = 0, logprobs: Sequence[TokenLogprob] | None = None,
           ) -> ChildUpdate:
    return ChildUpdate(events=list(events), token_ids=tuple(token_ids),
                       logprobs=None if logprobs is None else tuple(logprobs), finish=finish,
                       num_prompt_tokens=11, num_output_tokens=num_output, num_cached_tokens=3,
                       num_reasoning_tokens=num_reasoning)


class Encoded:
    """An encoder and the output rules the drivers apply to its child (`helios.serving.drive`)."""

    def __init__(self, enc: ResponseEncoder, rules: OutputRules) -> None:
        self.enc, self.rules = enc, rules
        self.failure: str | None = None


def encoder(toolset: ToolSet | None = None, choice: ToolChoice | None = None, *, logprobs: bool = False,
            parallel: bool = True, token_bytes: dict[int, bytes] | None = None) -> Encoded:
    base: dict[str, Any] = {"background": False, "instructions": None, "max_output_tokens": None, "metadata": {}, "model": "smol",
            "parallel_tool_calls": parallel, "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": 1.0, "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [],
            "top_p": 1.0, "truncation": "disabled"}

    def content(records: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        return [{"token": f"t{r.token_id}", "logprob": r.logprob, "bytes": [], "top_logprobs": []} for r in records]

    tb = token_bytes or {}
    toolset = toolset or ToolSet()
    enc = ResponseEncoder(base=shapes.ResponseParams(**base), toolset=toolset, prompts=[PreparedPrompt(tuple(range(11)), "prompt")],
                          logprob_content=content if logprobs else None, token_bytes=lambda t: tb.get(t, b"x"))
    check = ToolCallCheck(choice or ToolChoice("auto"), parallel, frozenset(toolset.declared))
    return Encoded(enc, OutputRules(check))


def run(e: Encoded, updates: Sequence[ChildUpdate]) -> list[dict[str, Any]]:
    """`helios.serving.drive.run_streamed` without IO: each update screened by the output rules and
    fed; a failure (recorded in `e.failure`, what `run_buffered` raises) ends the stream with the
    encoder's `fail` events, as does a stream that ends without a terminal record. Every event is
    named by its type; returns their data."""
    enc = e.enc
    events = enc.start()
    for u in updates:
        screened, failure = e.rules.screen(u)
        events += enc.feed(0, screened)
        if failure is not None:
            e.failure = failure
            return data(events + enc.fail(InternalError(failure)))
        if enc.done:
            break
    if not enc.done:
        e.failure = "generation ended without a terminal event"
        return data(events + enc.fail(InternalError(e.failure)))
    return data(events + enc.finish())


def data(events: list[StreamEvent]) -> list[dict[str, Any]]:
    out = []
    for ev in events:
        assert isinstance(ev.data, dict) and ev.event == ev.data["type"]
        out.append(ev.data)
    return out


def check_failed(e: Encoded, events: list[dict[str, Any]], match: str) -> None:
    """The response failed with `match`: streamed, one terminal response.failed carrying the error;
    buffered, the driver raises it (a 500)."""
    assert e.failure is not None and match in e.failure and InternalError(e.failure).status == 500
    assert events[-1]["type"] == "response.failed"
    assert sum(ev["type"] in ("response.failed", "response.completed", "response.incomplete") for ev in events) == 1
    final = events[-1]["response"]
    assert final["status"] == "failed" and final["error"] == {"code": "server_error", "message": e.failure}
    assert e.enc.body() == final
    check_with_sdk(events)


def check_with_sdk(events: list[dict[str, Any]]) -> Any:
    """Every event validates against the SDK's models and the SDK stream helper accumulates them."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for e in events:
        EVENTS.validate_python(e)
        state.handle_event(cast(Any, construct_type(type_=cast(Any, ResponseStreamEvent), value=e)))
    Response.model_validate(events[-1]["response"])
    return state


def lp(token_id: int) -> TokenLogprob:
    return TokenLogprob(token_id=token_id, logprob=-0.5, rank=1, top=())


def test_reasoning_text_and_two_calls() -> None:
    toolset, _ = decode_tools([{"type": "function", "name": "lookup"}, {"type": "custom", "name": "patch"}], None)
    enc = encoder(toolset)
    events = run(enc, [
        update([ReasoningDelta("Let me ")], [1], num_output=1, num_reasoning=1),
        update([ReasoningDelta("think.")], [2], num_output=2, num_reasoning=2),
        update([TextDelta("Calling")], [3], num_output=3, num_reasoning=2),
        update([TextDelta(" tools.")], [4], num_output=4, num_reasoning=2),
        update([ToolCall("call_a", "lookup", "{\"q\": \"x\"}")], [5], num_output=5, num_reasoning=2),
        update([ToolCall("call_b", "patch", "{\"input\": \"*** Begin Patch\"}", index=1)], [6, 7],
               finish=Finish(FinishCause.EOS, has_tool_calls=True), num_output=7, num_reasoning=2),
    ])
    types = [e["type"] for e in events]
    assert types == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done", "response.output_item.done",
        "response.completed",
    ]
    state = check_with_sdk(events)
    final = events[-1]["response"]
    assert enc.failure is None and enc.enc.body() == final
    assert final["status"] == "completed" and final["incomplete_details"] is None and final["error"] is None
    out = final["output"]
    assert [o["type"] for o in out] == ["reasoning", "message", "function_call", "custom_tool_call"]
    assert out[0]["content"] == [{"type": "reasoning_text", "text": "Let me think."}] and out[0]["summary"] == []
    assert out[1]["content"][0]["text"] == "Calling tools." and out[1]["status"] == "completed"
    assert out[2]["call_id"] == "call_a" and out[2]["arguments"] == "{\"q\": \"x\"}" and out[2]["status"] == "completed"
    assert out[3]["name"] == "patch" and out[3]["input"] == "*** Begin Patch"
    assert out[0]["id"].startswith("rs_") and out[1]["id"].startswith("msg_") and out[2]["id"].startswith("fc_")
    # stable ids and output indices: every item event names the item it belongs to
    for e in events:
        if "output_index" in e:
            assert e.get("item_id", e.get("item", {}).get("id")) == out[e["output_index"]]["id"]
    assert final["usage"] == {"input_tokens": 11, "input_tokens_details": {"cached_tokens": 3, "cache_write_tokens": 0},
                              "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 2},
                              "total_tokens": 18}
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["usage"] is None
    snapshot = state._completed_response
    assert snapshot is not None and snapshot.output_text == "Calling tools."


def test_incomplete_on_length() -> None:
    enc = encoder()
    events = run(enc, [update([TextDelta("Once upon")], [1], num_output=1),
                       update([TextDelta(" a")], [2], finish=Finish(FinishCause.LENGTH), num_output=2)])
    assert events[-1]["type"] == "response.incomplete" and enc.failure is None
    final = events[-1]["response"]
    assert enc.enc.body() == final
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete" and final["output"][0]["content"][0]["text"] == "Once upon a"
    check_with_sdk(events)


def test_failed_on_generation_error() -> None:
    enc = encoder()
    events = run(enc, [update([TextDelta("Hi")], [1], num_output=1),
                       update([], [2], finish=Finish(FinishCause.ERROR, error="model output could not be parsed"),
                              num_output=2)])
    assert [e["type"] for e in events][-3:] == ["response.content_part.done", "response.output_item.done",
                                                 "response.failed"]
    final = events[-1]["response"]
    assert final["status"] == "failed" and final["error"]["message"] == "model output could not be parsed"
    assert final["output"][0]["status"] == "incomplete" and final["output"][0]["content"][0]["text"] == "Hi"
    check_failed(enc, events, "model output could not be parsed")


def test_failed_on_abort() -> None:
    enc = encoder()
    events = run(enc, [update([TextDelta("Hi")], [1], num_output=1, finish=Finish(FinishCause.ABORTED))])
    check_failed(enc, events, "generation was aborted")


def test_stream_without_terminal_record_fails() -> None:
    enc = encoder()
    events = run(enc, [update([TextDelta("Hi")], [1], num_output=1)])
    assert events[-1]["type"] == "response.failed"
    check_failed(enc, events, "generation ended without a terminal event")


def test_logprobs_only_for_answer_tokens() -> None:
    enc = encoder(logprobs=True, token_bytes={1: b"<think>", 2: b"hm", 3: b"</think>", 4: b"Hel", 5: b"lo", 9: b""})
    events = run(enc, [
        update([], [1], logprobs=[lp(1)], num_output=1),  # opening delimiter, content region
        update([ReasoningDelta("hm")], [2], logprobs=[lp(2)], num_output=2, num_reasoning=1),
        update([], [3], logprobs=[lp(3)], num_output=3, num_reasoning=2),  # closing delimiter counts as reasoning
        update([], [4], logprobs=[lp(4)], num_output=4, num_reasoning=2),  # held back (possible stop prefix)
        update([TextDelta("Hello")], [5], logprobs=[lp(5)], num_output=5, num_reasoning=2),
        update([], [9], logprobs=[lp(9)], finish=Finish(FinishCause.EOS), num_output=6, num_reasoning=2),
    ])
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [[x["token"] for x in d["logprobs"]] for d in deltas] == [["t4", "t5"]]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert [x["token"] for x in done["logprobs"]] == ["t4", "t5"]
    final = events[-1]["response"]
    assert [x["token"] for x in final["output"][1]["content"][0]["logprobs"]] == ["t4", "t5"]
    check_with_sdk(events)


def test_named_choice_omits_text_and_rejects_other_tools() -> None:
    toolset, choice = decode_tools([{"type": "function", "name": "a"}, {"type": "function", "name": "b"}],
                                   {"type": "function", "name": "a"})
    enc = encoder(toolset, choice)
    events = run(enc, [
        update([TextDelta("Sure.")], [1]),
        update([ToolCall("call_1", "a", "{}")], [2], finish=Finish(FinishCause.EOS)),
    ])
    assert [o["type"] for o in events[-1]["response"]["output"]] == ["function_call"]
    assert events[-1]["type"] == "response.completed" and enc.failure is None
    assert not any(e["type"] == "response.output_text.delta" for e in events)
    enc = encoder(toolset, choice)
    failed = run(enc, [update([ToolCall("call_1", "b", "{}")], [1])])
    assert failed[-1]["type"] == "response.failed"
    assert not any(e["type"] == "response.output_item.added" for e in failed)
    check_failed(enc, failed, "called 'b'")


def test_required_without_a_call_fails_and_parallel_false_limits_calls() -> None:
    toolset, required = decode_tools([{"type": "function", "name": "a"}], "required")
    enc = encoder(toolset, required)
    events = run(enc, [update([TextDelta("No.")], [1], finish=Finish(FinishCause.EOS))])
    assert events[-1]["type"] == "response.failed"
    check_failed(enc, events, "no completed call")
    enc = encoder(toolset, parallel=False)
    events = run(enc, [
        update([ToolCall("call_1", "a", "{}")], [1]),
        update([ToolCall("call_2", "a", "{}")], [2], finish=Finish(FinishCause.EOS)),
    ])
    assert events[-1]["type"] == "response.failed"
    assert sum(e["type"] == "response.output_item.done" for e in events) == 1
    check_failed(enc, events, "second tool call")


def test_arguments_that_are_not_an_object_fail_before_the_call() -> None:
    toolset, _ = decode_tools([{"type": "function", "name": "a"}], None)
    enc = encoder(toolset)
    events = run(enc, [update([TextDelta("Hi"), ToolCall("call_1", "a", "[1, 2]")], [1],
                              finish=Finish(FinishCause.EOS))])
    assert not any(e["type"] == "response.function_call_arguments.delta" for e in events)
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "Hi"
    check_failed(enc, events, "not a JSON object")


def test_namespaced_call_regains_its_namespace() -> None:
    toolset, _ = decode_tools([{"type": "namespace", "name": "fs", "description": "",
                                "tools": [{"type": "function", "name": "read"}]}], None)
    events = run(encoder(toolset), [update([ToolCall("", "fs__read", "{}")], [1], finish=Finish(FinishCause.EOS))])
    item = events[-1]["response"]["output"][0]
    assert item["name"] == "read" and item["namespace"] == "fs" and item["call_id"].startswith("call_")
    check_with_sdk(events)


class Vocab:
    def token_bytes(self, token_id: int) -> bytes:
        return {1: b"Hel", 2: b"lo"}.get(token_id, b"")


def test_make_encoder_from_a_decoded_plan() -> None:
    """The encoder the HTTP route builds: the request echoed on the Response, logprob entries
    through the vocabulary (as token ids when asked)."""
    plan = decode({"input": "hi", "instructions": "Be brief.", "max_output_tokens": 9, "metadata": {"k": "v"},
                   "include": ["message.output_text.logprobs"], "top_logprobs": 1,
                   "return_tokens_as_token_ids": True})
    sampling = SamplingParams(temperature=0.5, top_p=0.75)
    enc = make_encoder(plan, [PreparedPrompt((1, 2, 3), "hi")], sampling, model="smol", vocab=Vocab())
    events = run(Encoded(enc, OutputRules(ToolCallCheck.for_conversation(plan.conversation))), [
        update([TextDelta("Hello")], [1, 2], logprobs=[lp(1), lp(2)], num_output=2),
        update([], [3], finish=Finish(FinishCause.LENGTH), num_output=3),
    ])
    check_with_sdk(events)
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final == enc.body()
    assert (final["model"], final["instructions"], final["max_output_tokens"]) == ("smol", "Be brief.", 9)
    assert (final["temperature"], final["top_p"], final["metadata"], final["tool_choice"]) == (0.5, 0.75, {"k": "v"},
                                                                                              "none")
    assert [x["token"] for x in final["output"][0]["content"][0]["logprobs"]] == ["token_id:1", "token_id:2"]


# -- Ollama discovery ---------------------------------------------------------------------------------


def test_discovery_shapes() -> None:
    i = info(has_tools=True, has_reasoning=True)
    tags = discovery.tags(i)["models"]
    assert len(tags) == 1 and tags[0]["name"] == tags[0]["model"] == "smol"
    assert tags[0]["size"] == 0 and tags[0]["modified_at"] == "0001-01-01T00:00:00Z"
    assert len(tags[0]["digest"]) == 64 and tags[0]["details"]["format"] == "flare"
    assert tags[0]["details"]["families"] == []
    for name in ("smol", "other", "org/model"):
        show = discovery.show(i, {"model": name, "verbose": True})
        assert show["capabilities"] == ["completion", "tools", "thinking"]
        assert show["model_info"]["flare.context_length"] == 8192 and show["model_info"]["flare.vocab_size"] == 1000
        assert show["model_info"]["general.name"] == "smol"
    assert discovery.show(info(), {"model": "smol"})["capabilities"] == ["completion"]
    assert discovery.digest(info(max_model_len=4096)) != discovery.digest(i)
    assert discovery.digest(i) == discovery.digest(info(has_tools=True, has_reasoning=True))


@pytest.mark.parametrize("body", [{}, {"model": ""}, {"model": 3}, {"model": None}, {"model": "smol", "verbose": 1}])
def test_discovery_show_bad_requests(body: dict[str, Any]) -> None:
    with pytest.raises(BadRequest):
        discovery.show(info(), body)


def test_discovery_show_unknown_model() -> None:
    from helios.errors import NotFound

    with pytest.raises(NotFound) as err:
        discovery.show(info(), {"model": "llama3:latest"})
    assert err.value.to_ollama() == {"error": err.value.message}
