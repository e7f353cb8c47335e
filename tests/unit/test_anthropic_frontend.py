"""Anthropic Messages frontend without a server: decoding and the SSE event encoder."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from helios.domain.conversation import (
    ImagePart,
    ReasoningPart,
    TextPart,
    ToolCallPart,
    ToolChoice,
    ToolResultPart,
)
from helios.domain.events import Finish, FinishCause, OutputEvent, ReasoningDelta, TextDelta, ToolCall
from helios.domain.generation import ChildUpdate, PreparedPrompt, StreamEvent
from helios.domain.model import ModelInfo
from helios.errors import BadRequest, InternalError
from helios.frontends.anthropic.messages import (
    check_version,
    decode_count_tokens,
    decode_request,
    thinking_signature,
)
from helios.frontends.anthropic.messages_encoder import MessagesEncoder, stop_reason
from helios.serving.drive import OutputRules
from helios.serving.toolcheck import ToolCallCheck


def info(**kw: Any) -> ModelInfo:
    base: dict[str, Any] = dict(
        model_id="org/model", aliases=("smol",), created=0, max_model_len=8192, vocab_size=100,
        default_max_tokens=256, max_concurrency=4, prefill_chunk_size=256, max_top_logprobs=20,
        prompt_logprobs=False, sampling_defaults={}, sampling_ranges={}, recipe="plain", has_bos=True,
    )
    base.update(kw)
    return ModelInfo(**base)


PLAIN = info()
QWEN = info(recipe="qwen38", has_reasoning=True, has_tools=True)


def req(**kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "x", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}
    body.update(kw)
    return body


def bad(body: dict[str, Any], match: str, model: ModelInfo = PLAIN) -> None:
    with pytest.raises(BadRequest, match=match):
        decode_request(body, model)


# -- decoding -------------------------------------------------------------------------------------


def test_decodes_system_blocks_history_and_sampling() -> None:
    png = base64.b64encode(b"\x89PNG...").decode()
    plan = decode_request(req(
        system=[{"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "B"}],
        messages=[
            {"role": "user", "content": [
                {"type": "text", "text": "look"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": thinking_signature("hmm")},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "boom", "is_error": True},
                {"type": "text", "text": "and?"}]},
        ],
        stop_sequences=["END"], temperature=0.5, top_p=0.9, top_k=3, stream=True, metadata={"user_id": "u"},
        tools=[{"name": "f", "input_schema": {"type": "object"}}],
    ), PLAIN)
    conv = plan.conversation
    assert [m.role for m in conv.messages] == ["system", "user", "assistant", "user"]
    assert conv.messages[0].text == "A\n\nB"
    assert isinstance(conv.messages[1].parts[1], ImagePart) and conv.messages[1].parts[1].data == b"\x89PNG..."
    assert conv.messages[2].parts == (ReasoningPart("hmm"), TextPart("calling"), ToolCallPart("toolu_1", "f", {"a": 1}))
    assert conv.messages[3].parts == (ToolResultPart("toolu_1", (TextPart("boom"),), is_error=True), TextPart("and?"))
    assert plan.stops == ("END",) and plan.stream and plan.max_tokens == 16
    assert (conv.sampling.temperature, conv.sampling.top_p, conv.sampling.top_k) == (0.5, 0.9, 3)
    assert conv.tool_choice == ToolChoice("auto") and conv.parallel_tool_calls
    assert conv.add_generation_prompt and not conv.continue_final_message


def test_final_assistant_message_is_a_prefill() -> None:
    plan = decode_request(req(messages=[{"role": "user", "content": "Hi"},
                                        {"role": "assistant", "content": "The answer is"}]), PLAIN)
    assert plan.conversation.continue_final_message and not plan.conversation.add_generation_prompt


def test_tool_choice_modes() -> None:
    tools = [{"name": "a", "input_schema": {}}, {"type": "custom", "name": "b", "input_schema": {}}]
    choice = decode_request(req(tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True}), PLAIN)
    assert choice.conversation.tool_choice == ToolChoice("required") and not choice.conversation.parallel_tool_calls
    named = decode_request(req(tools=tools, tool_choice={"type": "tool", "name": "b"}), PLAIN)
    assert named.conversation.tool_choice == ToolChoice("named", "b")
    assert decode_request(req(tools=tools, tool_choice={"type": "none"}), PLAIN).conversation.tool_choice.mode == "none"
    assert decode_request(req(), PLAIN).conversation.tool_choice.mode == "none"
    bad(req(tools=tools, tool_choice={"type": "tool", "name": "zzz"}), "not a declared tool")
    bad(req(tool_choice={"type": "any"}), "at least one declared tool")
    bad(req(tools=[{"name": "a", "input_schema": {}, "strict": True}]), "strict")
    bad(req(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "not supported")
    bad(req(tools=[{"name": "a", "input_schema": {}}, {"name": "a", "input_schema": {}}]), "unique")


def test_thinking_signatures_and_controls() -> None:
    def history(sig: str) -> dict[str, Any]:
        return req(messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "plan", "signature": sig},
                                              {"type": "text", "text": "ok"}]},
            {"role": "user", "content": "more"}])

    decode_request(history(thinking_signature("plan")), PLAIN)
    decode_request(history("EqQBCkgIARABGAIiQL...from-another-provider"), PLAIN)
    bad(history(thinking_signature("other text")), "signature")
    assert thinking_signature("plan").startswith("flare-thinking-v1:")
    assert thinking_signature("plan") == thinking_signature("plan") != thinking_signature("plan ")

    plan = decode_request(req(thinking={"type": "enabled", "budget_tokens": 4000}), QWEN)
    assert plan.thinking_token_budget == 4000 and plan.effort == "low"
    assert plan.conversation.chat_template_kwargs == {"enable_thinking": True, "reasoning_effort": "low"}
    plan = decode_request(req(thinking={"type": "adaptive"}, output_config={"effort": "max"}), QWEN)
    assert plan.effort == "max" and plan.conversation.chat_template_kwargs["reasoning_effort"] == "xhigh"
    plan = decode_request(req(thinking={"type": "disabled"}), QWEN)
    assert plan.conversation.chat_template_kwargs == {"enable_thinking": False} and plan.thinking_token_budget is None
    assert decode_request(req(thinking={"type": "enabled", "budget_tokens": 2**40}), QWEN).thinking_token_budget is None
    bad(req(thinking={"type": "enabled"}), "budget_tokens is required")
    bad(req(thinking={"type": "sometimes"}), "thinking.type")
    bad(req(thinking_token_budget=100), "no reasoning syntax")
    bad(req(thinking={"type": "enabled", "budget_tokens": 2000}, thinking_token_budget=100), "must match", QWEN)
    bad(req(output_config={"effort": "extreme"}), "effort")


def test_context_management_and_unsupported_fields() -> None:
    decode_request(req(context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}), PLAIN)
    bad(req(context_management={"edits": [{"type": "clear_tool_uses_20250919"}]}), "active context edits")
    bad(req(context_management={"edits": [{"type": "clear_thinking_20251015",
                                            "keep": {"type": "thinking_turns", "value": 1}}]}), "active context edits")
    for field, value in [("logprobs", True), ("top_logprobs", 2), ("return_tokens_as_token_ids", False),
                         ("logprob_token_ids", [1])]:
        bad(req(**{field: value}), field)
    bad(req(service_tier="priority"), "service_tier")
    decode_request(req(service_tier="auto", mcp_servers=[]), PLAIN)
    bad(req(container="c1"), "container")
    bad(req(mcp_servers=[{"type": "url", "url": "http://x", "name": "m"}]), "MCP")
    bad(req(seed=1), "seed")
    bad({"model": "x", "messages": [{"role": "user", "content": "Hi"}]}, "max_tokens")
    bad(req(max_tokens=0), "max_tokens")
    bad(req(max_tokens="5"), "max_tokens")
    bad(req(stop_sequences="END"), "stop_sequences")
    bad(req(stop_sequences=["a", "b", "c", "d", "e"]), "at most 4")
    bad(req(messages=[]), "at least one message")
    bad(req(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]),
        "remote image")
    bad(req(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]), "not supported")
    bad(req(messages=[{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "x"}}]}]),
        "cache_control")
    bad(req(messages=[{"role": "user", "content": "x", "name": "n"}]), "unrecognized")


def test_count_tokens_decoding_has_no_generation_fields() -> None:
    body = {"model": "x", "messages": [{"role": "user", "content": "Hi"}], "system": "S"}
    plan = decode_count_tokens(body, PLAIN)
    assert plan.max_tokens is None and plan.conversation.messages[0].text == "S"
    with pytest.raises(BadRequest, match="max_tokens"):
        decode_count_tokens({**body, "max_tokens": 5}, PLAIN)


def test_version_header() -> None:
    check_version("2023-06-01")
    check_version("2026-10-21")  # what current SDKs send by default
    for value in (None, "2023-01-01", "latest", ""):
        with pytest.raises(BadRequest, match="anthropic-version"):
            check_version(value)


# -- encoding -------------------------------------------------------------------------------------


def update(*events: OutputEvent, out: int, finish: Finish | None = None, cached: int = 0) -> ChildUpdate:
    return ChildUpdate(events=list(events), token_ids=(1,), logprobs=None, finish=finish, num_prompt_tokens=10,
                       num_output_tokens=out, num_cached_tokens=cached)


def encoder(model: ModelInfo = PLAIN, name: str = "m", **body: Any) -> tuple[MessagesEncoder, OutputRules]:
    """The encoder and the output rules the drivers would give a request with these fields (a prompt
    of 10 tokens)."""
    plan = decode_request(req(**body), model)
    assert plan.generation.conversation is not None
    prompts = [PreparedPrompt(tuple(range(10)), "prompt")]
    return MessagesEncoder(plan, prompts, model=name), OutputRules(ToolCallCheck.for_conversation(
        plan.generation.conversation))


def run(enc: MessagesEncoder, rules: OutputRules, updates: list[ChildUpdate]) -> tuple[list[StreamEvent], str | None]:
    """`helios.serving.drive.run_streamed` without IO: each update screened by the output rules, the
    screened update fed; a failure ends the stream with the encoder's `fail` events. Returns the
    events and the failure (what `run_buffered` raises as an InternalError)."""
    events = enc.start()
    for u in updates:
        screened, failure = rules.screen(u)
        events += enc.feed(0, screened)
        if failure is not None:
            return events + enc.fail(InternalError(failure)), failure
        if enc.done:
            break
    if not enc.done:
        failure = "generation ended without a terminal event"
        return events + enc.fail(InternalError(failure)), failure
    return events + enc.finish(), None


def data(ev: StreamEvent) -> dict[str, Any]:
    assert isinstance(ev.data, dict)
    return ev.data


def replay(events: list[StreamEvent]) -> dict[str, Any]:
    """Rebuilds the Message from the event stream the way an SDK accumulator does."""
    msg: dict[str, Any] = {}
    json_bufs: dict[int, str] = {}
    for ev in events:
        d = data(ev)
        if ev.event == "message_start":
            msg = json.loads(json.dumps(d["message"]))
        elif ev.event == "content_block_start":
            assert d["index"] == len(msg["content"])
            msg["content"].append(dict(d["content_block"]))
        elif ev.event == "content_block_delta":
            block, delta = msg["content"][d["index"]], d["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            elif delta["type"] == "input_json_delta":
                json_bufs[d["index"]] = json_bufs.get(d["index"], "") + delta["partial_json"]
                block["input"] = json.loads(json_bufs[d["index"]])
        elif ev.event == "message_delta":
            msg.update(d["delta"])
            msg["usage"].update(d["usage"])
    return msg


def check_failed(events: list[StreamEvent], failure: str | None, match: str) -> None:
    """A failed request: the stream ends in one Anthropic `error` event with the failure (a 500
    `api_error` buffered), and never reaches message_delta or message_stop."""
    assert failure is not None and match in failure
    error = InternalError(failure)
    assert error.status == 500
    assert events[-1] == StreamEvent({"type": "error", "error": {"type": "api_error", "message": failure}}, "error")
    assert data(events[-1])["type"] == events[-1].event
    assert not any(e.event in ("message_delta", "message_stop") for e in events)
    assert sum(e.event == "error" for e in events) == 1


def test_thinking_text_and_tool_use_blocks_in_output_order() -> None:
    enc, rules = encoder(name="smol", tools=[{"name": "lookup", "input_schema": {"type": "object"}}])
    events, failure = run(enc, rules, [
        update(ReasoningDelta("Let me "), out=2),
        update(ReasoningDelta("think."), TextDelta("Checking"), out=4, cached=4),
        update(TextDelta("..."), ToolCall("call_abc", "lookup", '{"q": "x"}'), out=9),
        update(ToolCall("call_def", "other", "{}"), out=12, finish=Finish(FinishCause.EOS, has_tool_calls=True)),
    ])
    assert failure is None and enc.done
    for ev in events:
        assert data(ev)["type"] == ev.event
    assert [(e.event, data(e).get("delta", {}).get("type") or data(e).get("content_block", {}).get("type"))
            for e in events] == [
        ("message_start", None),
        ("content_block_start", "thinking"), ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "thinking_delta"), ("content_block_delta", "signature_delta"),
        ("content_block_stop", None),
        ("content_block_start", "text"), ("content_block_delta", "text_delta"), ("content_block_delta", "text_delta"),
        ("content_block_stop", None),
        ("content_block_start", "tool_use"), ("content_block_delta", "input_json_delta"), ("content_block_stop", None),
        ("content_block_start", "tool_use"), ("content_block_delta", "input_json_delta"), ("content_block_stop", None),
        ("message_delta", None), ("message_stop", None),
    ]
    start = data(events[0])["message"]
    assert start["content"] == [] and start["usage"] == {
        "input_tokens": 10, "output_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    msg = enc.body()
    assert msg["content"] == [
        {"type": "thinking", "thinking": "Let me think.", "signature": thinking_signature("Let me think.")},
        {"type": "text", "text": "Checking..."},
        {"type": "tool_use", "id": "toolu_abc", "name": "lookup", "input": {"q": "x"}},
        {"type": "tool_use", "id": "toolu_def", "name": "other", "input": {}},  # undeclared calls pass in auto
    ]
    assert msg["stop_reason"] == "tool_use" and msg["stop_sequence"] is None
    assert msg["usage"] == {"input_tokens": 6, "output_tokens": 12, "cache_creation_input_tokens": 0,
                            "cache_read_input_tokens": 4}
    assert msg["id"].startswith("msg_") and msg["role"] == "assistant" and msg["model"] == "smol"
    assert replay(events) == msg


def test_stop_reasons() -> None:
    assert stop_reason(FinishCause.LENGTH, True) == "max_tokens"
    assert stop_reason(FinishCause.STOP_STRING, True) == "stop_sequence"
    assert stop_reason(FinishCause.EOS, True) == "tool_use"
    assert stop_reason(FinishCause.STOP_TOKEN, False) == "end_turn"
    enc, rules = encoder(stop_sequences=["END"])
    events, failure = run(enc, rules, [update(TextDelta("Hello"), out=3,
                                              finish=Finish(FinishCause.STOP_STRING, matched_stop="END"))])
    assert failure is None
    assert enc.body()["stop_reason"] == "stop_sequence" and enc.body()["stop_sequence"] == "END"
    assert data(events[-2])["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


TOOLS_AB = [{"name": "a", "input_schema": {}}, {"name": "b", "input_schema": {}}]


def test_tool_choice_output_rules() -> None:
    call_a, call_b = ToolCall("call_1", "a", "{}"), ToolCall("call_2", "b", "{}")
    done = Finish(FinishCause.EOS)
    # Parallel disabled: the second call fails before it is emitted; the first was delivered.
    enc, rules = encoder(tools=TOOLS_AB, tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    events, failure = run(enc, rules, [update(call_a, out=3), update(TextDelta("x"), call_b, out=6, finish=done)])
    check_failed(events, failure, "second tool call")
    assert [data(e)["content_block"]["name"] for e in events if e.event == "content_block_start"
            and data(e)["content_block"]["type"] == "tool_use"] == ["a"]
    # the text before the violating call went out, then the error; no message_stop
    assert events[-2].event == "content_block_delta" and data(events[-2])["delta"] == {"type": "text_delta",
                                                                                         "text": "x"}
    # Required: no completed call fails at the end.
    enc, rules = encoder(tools=TOOLS_AB[:1], tool_choice={"type": "any"})
    events, failure = run(enc, rules, [update(TextDelta("no"), out=2, finish=Finish(FinishCause.LENGTH))])
    check_failed(events, failure, "no completed call")
    # Named: answer text is omitted; another tool fails.
    enc, rules = encoder(tools=TOOLS_AB[:1], tool_choice={"type": "tool", "name": "a"})
    events, failure = run(enc, rules, [update(TextDelta("chatter"), call_a, out=4, finish=done)])
    assert failure is None and [b["type"] for b in enc.body()["content"]] == ["tool_use"]
    assert not any(data(e).get("delta", {}).get("type") == "text_delta" for e in events)
    enc, rules = encoder(tools=TOOLS_AB, tool_choice={"type": "tool", "name": "a"})
    events, failure = run(enc, rules, [update(call_b, out=4, finish=done)])
    check_failed(events, failure, "called 'b'")
    assert not any(e.event == "content_block_start" for e in events)
    # Arguments that are not a JSON object fail before the call is emitted.
    enc, rules = encoder(tools=TOOLS_AB)
    events, failure = run(enc, rules, [update(ToolCall("call_1", "a", "[1]"), out=4, finish=done)])
    check_failed(events, failure, "not a JSON object")
    assert not any(e.event == "content_block_start" for e in events)
    # A generation error.
    enc, rules = encoder()
    events, failure = run(enc, rules, [update(TextDelta("x"), out=1,
                                              finish=Finish(FinishCause.ERROR, error="parser failed"))])
    check_failed(events, failure, "parser failed")
    assert failure == "parser failed"


def test_newer_sdk_fields() -> None:
    plan = decode_request(req(cache_control={"type": "ephemeral", "ttl": "1h"}, speed="standard", inference_geo="us",
                              user_profile_id="p", workspace_id="w", diagnostics={"previous_message_id": None},
                              thinking={"type": "adaptive", "display": "omitted"},
                              tools=[{"name": "a", "input_schema": {}, "eager_input_streaming": True,
                                      "allowed_callers": ["direct"], "input_examples": [{"x": 1}]}]), QWEN)
    assert plan.hide_thinking and plan.conversation.chat_template_kwargs == {"enable_thinking": True}
    assert decode_request(req(thinking={"type": "between_tools"}), QWEN).thinking_token_budget is None
    bad(req(cache_control={"type": "persistent"}), "cache_control")
    bad(req(speed="warp"), "speed")
    bad(req(tools=[{"name": "a", "input_schema": {}, "defer_loading": True}]), "tool search")
    bad(req(tools=[{"name": "a", "input_schema": {}, "allowed_callers": ["code_execution_20250825"]}]), "direct")
    bad(req(thinking={"type": "disabled", "display": "omitted"}), "display")


def test_omitted_thinking_keeps_block_and_marker_without_text() -> None:
    enc, rules = encoder(QWEN, thinking={"type": "adaptive", "display": "omitted"})
    events, failure = run(enc, rules, [update(ReasoningDelta("secret"), TextDelta("Hi"), out=3,
                                              finish=Finish(FinishCause.EOS))])
    assert failure is None
    assert enc.body()["content"] == [{"type": "thinking", "thinking": "", "signature": thinking_signature("")},
                                     {"type": "text", "text": "Hi"}]
    assert not any(data(e).get("delta", {}).get("type") == "thinking_delta" for e in events)
    assert replay(events) == enc.body()
