"""The serving drivers (helios/serving/drive.py) without an engine: the output rules every child's
updates pass through (`OutputRules.screen`), and `run_buffered` / `run_streamed` driving real protocol
encoders over a fake Service whose children yield scripted ChildUpdates."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

import pytest
import trio

from helios.domain.conversation import ToolChoice
from helios.domain.events import Finish, FinishCause, OutputEvent, ReasoningDelta, TextDelta, ToolCall
from helios.domain.generation import (
    ChildUpdate,
    GenerationOptions,
    GenerationRequest,
    PreparedPrompt,
    StreamEvent,
)
from helios.domain.logprobs import TokenLogprob
from helios.domain.model import ModelInfo
from helios.domain.sampling import SamplingParams
from helios.engine.records import EngineRequest
from helios.errors import BadRequest, InternalError
from helios.frontends.anthropic import messages, messages_encoder
from helios.frontends.openai import chat, completions, responses, responses_encoder
from helios.serving.drive import Encoder, OutputRules, failure_error, run_buffered, run_streamed
from helios.serving.pipeline import Prepared, Service
from helios.serving.toolcheck import ToolCallCheck

INFO = ModelInfo(
    model_id="org/model", aliases=("smol",), created=0, max_model_len=8192, vocab_size=1000,
    default_max_tokens=256, max_concurrency=4, prefill_chunk_size=256, max_top_logprobs=20,
    prompt_logprobs=True, sampling_defaults={}, sampling_ranges={}, recipe="qwen38", has_bos=True,
    has_reasoning=True, has_tools=True,
)
USER = [{"role": "user", "content": "Hi"}]
FUNCTIONS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("a", "b")]
PROMPT = PreparedPrompt((5, 6, 7, 8), "Hello")


def update(*events: OutputEvent, ids: Sequence[int] = (1,), finish: Finish | None = None, out: int = 1,
           logprobs: bool = False, reasoning: int = 0) -> ChildUpdate:
    return ChildUpdate(events=list(events), token_ids=tuple(ids),
                       logprobs=tuple(TokenLogprob(t, -0.5, 1, ((t, -0.5),)) for t in ids) if logprobs else None,
                       finish=finish, num_prompt_tokens=len(PROMPT.token_ids), num_output_tokens=out,
                       num_cached_tokens=2, num_reasoning_tokens=reasoning, logprob_offsets=tuple(0 for _ in ids)
                       if logprobs else ())


def call(name: str, arguments: str = "{}", id: str = "call_1") -> ToolCall:
    return ToolCall(id, name, arguments)


EOS = Finish(FinishCause.EOS)


# -- OutputRules.screen -------------------------------------------------------------------------------


def rules(mode: str = "auto", name: str | None = None, parallel: bool = True) -> OutputRules:
    return OutputRules(ToolCallCheck(ToolChoice(mode, name), parallel, frozenset({"a", "b"})))  # type: ignore[arg-type]


def test_an_update_that_breaks_no_rule_passes_as_it_is() -> None:
    for r in (OutputRules(), rules()):
        u = update(ReasoningDelta("r"), TextDelta("t"), call("zzz"), finish=EOS)
        screened, failure = r.screen(u)
        assert failure is None and screened == u


def test_error_and_aborted_finishes_fail_with_or_without_a_conversation() -> None:
    for r in (OutputRules(), rules(), rules("required")):
        screened, failure = r.screen(update(TextDelta("x"), finish=Finish(FinishCause.ERROR, error="parser failed")))
        assert failure == "parser failed"  # the engine's error wins over a required choice's missing call
        assert screened.finish is None and screened.events == [TextDelta("x")]  # what came before still goes out
        screened, failure = r.screen(update(finish=Finish(FinishCause.ERROR)))
        assert failure == "generation failed" and screened.finish is None
        screened, failure = r.screen(update(TextDelta("y"), finish=Finish(FinishCause.ABORTED)))
        assert failure == "generation was aborted" and screened.finish is None and screened.events == [TextDelta("y")]
    # Every other cause ends a request without a conversation normally.
    for cause in (FinishCause.EOS, FinishCause.LENGTH, FinishCause.STOP_STRING, FinishCause.STOP_TOKEN):
        assert OutputRules().screen(update(finish=Finish(cause)))[1] is None


def test_named_choice_drops_text_and_fails_on_another_tool() -> None:
    r = rules("named", "a")
    u = update(ReasoningDelta("r"), TextDelta("chatter"), call("a"), finish=EOS)
    screened, failure = r.screen(u)
    assert failure is None and screened.events == [ReasoningDelta("r"), call("a")] and screened.finish == EOS
    assert u.events == [ReasoningDelta("r"), TextDelta("chatter"), call("a")]  # the input is not changed
    screened, failure = rules("named", "a").screen(update(TextDelta("t"), call("b"), call("a"), finish=EOS))
    assert failure is not None and "tool_choice selects 'a', but the model called 'b'" in failure
    assert screened.events == [] and screened.finish is None  # text dropped, nothing from the violation on


def test_parallel_disabled_fails_at_the_second_call_across_updates() -> None:
    r = rules(parallel=False)
    screened, failure = r.screen(update(call("a")))
    assert failure is None and screened.events == [call("a")]
    screened, failure = r.screen(update(TextDelta("x"), call("b", id="call_2"), TextDelta("y"), finish=EOS))
    assert failure is not None and "second tool call" in failure
    assert screened.events == [TextDelta("x")] and screened.finish is None


@pytest.mark.parametrize("mode, name, message", [
    ("required", None, "requires a call to a declared tool"),
    ("named", "a", "requires a call to 'a'"),
])
def test_required_and_named_need_a_call_at_the_end(mode: str, name: str | None, message: str) -> None:
    r = rules(mode, name)
    assert r.screen(update(ReasoningDelta("thinking")))[1] is None  # not before the end
    screened, failure = r.screen(update(finish=EOS))
    assert failure is not None and message in failure and "output limit" not in failure
    assert screened.finish is None
    _, failure = rules(mode, name).screen(update(finish=Finish(FinishCause.LENGTH)))
    assert failure is not None and message in failure and failure.endswith("before the output limit")
    r = rules(mode, name)
    assert r.screen(update(call("a")))[1] is None
    screened, failure = r.screen(update(finish=EOS))
    assert failure is None and screened.finish == EOS


def test_arguments_that_are_not_a_json_object_fail_before_the_call() -> None:
    for arguments, message in (("[1]", "not a JSON object"), ("{nope", "not valid JSON")):
        screened, failure = rules().screen(update(TextDelta("t"), call("a", arguments), finish=EOS))
        assert failure is not None and message in failure and "'a'" in failure
        assert screened.events == [TextDelta("t")] and screened.finish is None


def test_a_rule_failure_wins_over_the_finish_of_its_update() -> None:
    screened, failure = rules("named", "a").screen(
        update(call("b"), finish=Finish(FinishCause.ERROR, error="parser failed")))
    assert failure is not None and "called 'b'" in failure and screened.finish is None


def prepared(generation: GenerationRequest, prompts: Sequence[PreparedPrompt] = (PROMPT,),
             num_children: int | None = None) -> Prepared:
    """What `Service.prepare` would make of `generation` for these prompts (children = prompts x n)."""
    n = generation.options.n if num_children is None else num_children
    children = tuple(EngineRequest(f"{generation.id_prefix}-{k}", p.token_ids, SamplingParams(), 16)
                     for k, p in enumerate(p for p in prompts for _ in range(n)))
    return Prepared(generation, tuple(prompts), children if num_children != 0 else ())


def test_per_child_rules_follow_the_conversation() -> None:
    plan = chat.decode_chat({"messages": USER, "n": 3, "tools": FUNCTIONS, "tool_choice": "required",
                             "parallel_tool_calls": False}, INFO)
    per_child = OutputRules.per_child(prepared(plan.generation))
    assert len(per_child) == 3 and len({id(r.check) for r in per_child}) == 3  # one state per child
    check = per_child[0].check
    assert check is not None
    assert (check.choice, check.parallel, check.declared) == (ToolChoice("required"), False, frozenset({"a", "b"}))
    plan2 = completions.decode_completion({"prompt": ["x", "y"], "n": 2}, INFO)
    assert [r.check for r in OutputRules.per_child(prepared(plan2.generation, (PROMPT, PROMPT)))] == [None] * 4


# -- the drivers over a fake Service ------------------------------------------------------------------


class ScriptedStream:
    """One child's updates, as `ChildStream` yields them (a checkpoint before each)."""

    def __init__(self, updates: Sequence[ChildUpdate], sink: Sink | None) -> None:
        self.updates = list(updates)
        self.taken = 0
        self.sink = sink
        self.nursery: trio.Nursery | None = None

    def __aiter__(self) -> ScriptedStream:
        return self

    async def __anext__(self) -> ChildUpdate:
        await trio.sleep(0)
        if self.sink is not None:
            assert self.sink.started, "the stream headers go out before the first update"
        if self.taken == len(self.updates):
            raise StopAsyncIteration
        self.taken += 1
        return self.updates[self.taken - 1]


class FakeService:
    """`Service.generate` for scripted children: the streams, in one nursery when there are several
    (what `merged` needs), and the caller's exception surfacing as itself."""

    def __init__(self, *scripts: Sequence[ChildUpdate], sink: Sink | None = None) -> None:
        self.scripts = scripts
        self.sink = sink
        self.calls: list[tuple[int, str]] = []  # children, and the prefix of their request ids
        self.streams: list[ScriptedStream] = []

    @contextlib.asynccontextmanager
    async def generate(self, children: Sequence[EngineRequest], options: GenerationOptions,
                       parser_factory: Any = None) -> AsyncIterator[list[ScriptedStream]]:
        self.calls.append((len(children), children[0].request_id.rsplit("-", 1)[0]))
        assert len(children) == len(self.scripts)
        if self.sink is not None:
            assert not self.sink.started, "the children are enqueued before the headers go out"
        self.streams = [ScriptedStream(s, self.sink) for s in self.scripts]
        if len(self.streams) == 1:
            yield self.streams
            return
        try:
            async with trio.open_nursery() as nursery:
                for s in self.streams:
                    s.nursery = nursery
                try:
                    yield self.streams
                finally:
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise


class Sink:
    def __init__(self) -> None:
        self.started = False
        self.events: list[StreamEvent] = []

    async def start(self) -> None:
        self.started = True

    async def send(self, event: StreamEvent) -> None:
        assert self.started
        self.events.append(event)


def stream(encoder: Encoder, prep: Prepared, *scripts: Sequence[ChildUpdate]) -> tuple[list[StreamEvent], FakeService]:
    sink = Sink()
    svc = FakeService(*scripts, sink=sink)
    trio.run(run_streamed, cast(Service, svc), prep, encoder, sink)
    assert sink.started
    return sink.events, svc


def buffer(encoder: Encoder, prep: Prepared, *scripts: Sequence[ChildUpdate]) -> tuple[dict[str, Any], FakeService]:
    svc = FakeService(*scripts)
    return trio.run(run_buffered, cast(Service, svc), prep, encoder), svc


def fail_buffered(encoder: Encoder, prep: Prepared, *scripts: Sequence[ChildUpdate]) -> InternalError:
    with pytest.raises(InternalError) as err:
        buffer(encoder, prep, *scripts)
    assert err.value.status == 500
    return err.value


class Vocab:
    def token_bytes(self, token_id: int) -> bytes:
        return f"<{token_id}>".encode()


def payloads(events: list[StreamEvent]) -> list[dict[str, Any]]:
    out = []
    for e in events:
        assert isinstance(e.data, dict)
        out.append(e.data)
    return out


def chat_encoder(**fields: Any) -> tuple[chat.ChatEncoder, Prepared]:
    plan = chat.decode_chat({"messages": USER, **fields}, INFO)
    prep = prepared(plan.generation)
    return chat.ChatEncoder(plan, prep.prompts, model="smol", vocab=Vocab()), prep


def assemble_chat(events: list[StreamEvent]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The choices a client builds from Chat chunks (message, finish, logprobs, token ids), and the
    usage chunk's usage."""
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    assert events[-1] == StreamEvent("[DONE]")
    for c in payloads(events[:-1]):
        assert c["object"] == "chat.completion.chunk"
        if not c["choices"]:
            usage = c["usage"]
        for ch in c["choices"]:
            acc = choices.setdefault(ch["index"], {"role": None, "content": "", "reasoning": "", "calls": [],
                                                   "finish_reason": None, "stop_reason": None, "logprobs": [],
                                                   "token_ids": []})
            d = ch["delta"]
            acc["role"] = d.get("role", acc["role"])
            acc["content"] += d.get("content") or ""
            acc["reasoning"] += d.get("reasoning_content") or ""
            assert d.get("reasoning_content") == d.get("reasoning")
            for tc in d.get("tool_calls", []):
                assert tc["index"] == len(acc["calls"])
                acc["calls"].append({k: v for k, v in tc.items() if k != "index"})
            if ch["logprobs"] is not None:
                acc["logprobs"] += ch["logprobs"]["content"]
            acc["token_ids"] += ch.get("token_ids", [])
            if ch["finish_reason"] is not None:
                assert acc["finish_reason"] is None
                acc["finish_reason"], acc["stop_reason"] = ch["finish_reason"], ch["stop_reason"]
    out = []
    for i in sorted(choices):
        acc = choices[i]
        message: dict[str, Any] = {"role": acc["role"],
                                   "content": acc["content"] if acc["content"] or not acc["calls"] else None}
        if acc["reasoning"]:
            message["reasoning_content"] = message["reasoning"] = acc["reasoning"]
        if acc["calls"]:
            message["tool_calls"] = acc["calls"]
        out.append({"index": i, "message": message, "logprobs": {"content": acc["logprobs"]},
                    "finish_reason": acc["finish_reason"], "stop_reason": acc["stop_reason"],
                    "token_ids": acc["token_ids"]})
    return out, usage


CHAT_SCRIPTS = (
    [update(ReasoningDelta("Let me "), ids=(1, 2), out=2, logprobs=True, reasoning=2),
     update(ReasoningDelta("think."), TextDelta("It is"), ids=(3,), out=3, logprobs=True, reasoning=3),
     update(ids=(4,), out=4, logprobs=True, reasoning=3),  # held back: no text yet
     update(TextDelta(" sunny."), ids=(5, 6), out=6, logprobs=True, reasoning=3, finish=EOS)],
    [update(TextDelta("Calling."), ids=(7,), out=1, logprobs=True),
     update(call("a", '{"city": "Paris"}'), ids=(8, 9), out=3, logprobs=True),
     update(call("b", "{}", id="call_2"), ids=(10,), out=4, logprobs=True,
            finish=Finish(FinishCause.EOS, has_tool_calls=True))],
)


def test_chat_stream_builds_the_buffered_body() -> None:
    fields = {"n": 2, "tools": FUNCTIONS, "logprobs": True, "top_logprobs": 1, "return_token_ids": True}
    enc, prep = chat_encoder(**fields)
    body, svc = buffer(enc, prep, *CHAT_SCRIPTS)
    assert svc.calls == [(2, "chatcmpl")]
    enc, prep = chat_encoder(stream=True, stream_options={"include_usage": True}, **fields)
    events, svc = stream(enc, prep, *CHAT_SCRIPTS)
    assert svc.calls == [(2, "chatcmpl")]
    choices, usage = assemble_chat(events)
    assert choices == body["choices"]
    assert usage == body["usage"] == {"prompt_tokens": 4, "completion_tokens": 10, "total_tokens": 14,
                                      "prompt_tokens_details": {"cached_tokens": 2},
                                      "completion_tokens_details": {"reasoning_tokens": 3}}
    first = body["choices"][0]
    assert first["message"] == {"role": "assistant", "content": "It is sunny.", "reasoning_content": "Let me think.",
                                "reasoning": "Let me think."}
    assert first["finish_reason"] == "stop" and first["token_ids"] == [1, 2, 3, 4, 5, 6]
    assert [e["token"] for e in first["logprobs"]["content"]] == [f"<{t}>" for t in (1, 2, 3, 4, 5, 6)]
    second = body["choices"][1]
    assert second["message"]["content"] == "Calling." and second["finish_reason"] == "tool_calls"
    assert [tc["function"]["name"] for tc in second["message"]["tool_calls"]] == ["a", "b"]
    assert body["prompt_token_ids"] == list(PROMPT.token_ids)


def test_messages_stream_builds_the_buffered_body() -> None:
    script = [update(ReasoningDelta("hm"), out=1), update(TextDelta("Hi"), call("a", '{"q": 1}'), out=3),
              update(TextDelta("!"), out=4, finish=EOS)]
    body_plan = messages.decode_request({"max_tokens": 16, "messages": USER,
                                         "tools": [{"name": "a", "input_schema": {}}]}, INFO)
    body, svc = buffer(messages_encoder.MessagesEncoder(body_plan, [PROMPT], model="smol", message_id="msg_1"),
                       prepared(body_plan.generation), script)
    assert svc.calls == [(1, "msg")]
    events, _ = stream(messages_encoder.MessagesEncoder(body_plan, [PROMPT], model="smol", message_id="msg_1"),
                       prepared(body_plan.generation), script)
    assert events[-1].event == "message_stop" and payloads(events)[-2]["delta"]["stop_reason"] == "tool_use"
    built: dict[str, Any] = {}
    for e in payloads(events):
        if e["type"] == "message_start":
            built = e["message"]
        elif e["type"] == "content_block_start":
            built["content"].append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            block, delta = built["content"][e["index"]], e["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            else:
                assert delta["type"] == "input_json_delta"
                block["input"] = json.loads(delta["partial_json"])
        elif e["type"] == "message_delta":
            built.update(e["delta"])
            built["usage"].update(e["usage"])
    assert built == body
    assert [b["type"] for b in body["content"]] == ["thinking", "text", "tool_use", "text"]


def test_responses_stream_builds_the_buffered_body() -> None:
    script = [update(ReasoningDelta("hm"), out=1, reasoning=1), update(TextDelta("Hi"), out=2, reasoning=1),
              update(call("a", '{"q": 1}'), out=3, reasoning=1, finish=EOS)]
    plan = responses.decode_responses({"input": "Hi", "tools": [{"type": "function", "name": "a"}]}, INFO)
    prep = prepared(plan.generation)
    enc = responses_encoder.make_encoder(plan, [PROMPT], SamplingParams(), model="smol", vocab=Vocab())
    body, svc = buffer(enc, prep, script)
    assert svc.calls == [(1, "resp")] and body["status"] == "completed"
    enc = responses_encoder.make_encoder(plan, [PROMPT], SamplingParams(), model="smol", vocab=Vocab())
    events, _ = stream(enc, prep, script)
    final = payloads(events)[-1]
    assert final["type"] == "response.completed" and events[-1].event == "response.completed"
    strip = {"id", "created_at", "completed_at"}

    def comparable(r: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in r.items() if k not in strip} | {
            "output": [{k: v for k, v in o.items() if k not in ("id", "call_id")} for o in r["output"]]}

    assert comparable(final["response"]) == comparable(body)
    assert [o["type"] for o in body["output"]] == ["reasoning", "message", "function_call"]


def test_completions_stream_builds_the_buffered_body_for_several_prompts() -> None:
    plan = completions.decode_completion({"prompt": ["Hello", "World"], "n": 2, "echo": True}, INFO)
    prompts = (PROMPT, PreparedPrompt((9, 10), "World"))
    scripts = [[update(TextDelta(f" {i}a"), out=1), update(TextDelta(f" {i}b"), out=2, finish=EOS)]
               for i in range(4)]
    body, svc = buffer(completions.CompletionEncoder(plan, prompts, model="smol", vocab=Vocab()),
                       prepared(plan.generation, prompts), *scripts)
    assert svc.calls == [(4, "cmpl")]
    plan = completions.decode_completion({"prompt": ["Hello", "World"], "n": 2, "echo": True, "stream": True}, INFO)
    events, _ = stream(completions.CompletionEncoder(plan, prompts, model="smol", vocab=Vocab()),
                       prepared(plan.generation, prompts), *scripts)
    assert events[-1] == StreamEvent("[DONE]")
    texts = [""] * 4
    finishes: list[str | None] = [None] * 4
    for c in payloads(events[:-1]):
        for ch in c["choices"]:
            texts[ch["index"]] += ch["text"]
            finishes[ch["index"]] = ch["finish_reason"] or finishes[ch["index"]]
    assert texts == [ch["text"] for ch in body["choices"]] == [
        "Hello 0a 0b", "Hello 1a 1b", "World 2a 2b", "World 3a 3b"]
    assert finishes == [ch["finish_reason"] for ch in body["choices"]] == ["stop"] * 4


def test_the_driver_stops_reading_once_every_child_finished() -> None:
    enc, prep = chat_encoder()
    body, svc = buffer(enc, prep, [update(TextDelta("Hi"), finish=EOS), update(TextDelta("late"))])
    assert svc.streams[0].taken == 1 and body["choices"][0]["message"]["content"] == "Hi"
    enc, prep = chat_encoder(stream=True)
    events, svc = stream(enc, prep, [update(TextDelta("Hi"), finish=EOS), update(TextDelta("late"))])
    assert svc.streams[0].taken == 1 and events[-1] == StreamEvent("[DONE]")


def test_each_child_has_its_own_rules() -> None:
    # parallel_tool_calls false limits each choice, not the request, to one call.
    fields = {"n": 2, "tools": FUNCTIONS, "tool_choice": "required", "parallel_tool_calls": False}
    scripts = ([update(call("a"), finish=EOS)], [update(call("b"), finish=EOS)])
    enc, prep = chat_encoder(**fields)
    body, _ = buffer(enc, prep, *scripts)
    assert [[tc["function"]["name"] for tc in ch["message"]["tool_calls"]] for ch in body["choices"]] == [["a"], ["b"]]
    # One choice without a call fails the request (required).
    enc, prep = chat_encoder(**fields)
    assert "no completed call" in fail_buffered(enc, prep, scripts[0], [update(TextDelta("no"), finish=EOS)]).message
    enc, prep = chat_encoder(stream=True, **fields)
    events, _ = stream(enc, prep, scripts[0], [update(TextDelta("no"), finish=EOS)])
    assert "no completed call" in payloads(events)[-1]["error"]["message"]
    assert StreamEvent("[DONE]") not in events


# -- failures ------------------------------------------------------------------------------------------


def test_chat_rule_failure_mid_stream() -> None:
    fields = {"tools": FUNCTIONS, "parallel_tool_calls": False}
    script = [update(TextDelta("Hi"), call("a")), update(TextDelta(" more"), call("b", id="call_2"), finish=EOS),
              update(TextDelta("never read"))]
    enc, prep = chat_encoder(stream=True, **fields)
    events, svc = stream(enc, prep, script)
    assert svc.streams[0].taken == 2
    deltas = [c["choices"][0]["delta"] for c in payloads(events[:-1])]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hi"},
                      {"tool_calls": [{"id": "call_1", "type": "function", "index": 0,
                                       "function": {"name": "a", "arguments": "{}"}}]},
                      {"content": " more"}]
    assert all(c["choices"][0]["finish_reason"] is None for c in payloads(events[:-1]))
    error = payloads(events)[-1]
    assert set(error) == {"error"} and error["error"]["type"] == "server_error"
    assert "second tool call" in error["error"]["message"]
    assert StreamEvent("[DONE]") not in events
    enc, prep = chat_encoder(**fields)
    assert "second tool call" in fail_buffered(enc, prep, script).message


def test_messages_error_finish_mid_stream() -> None:
    plan = messages.decode_request({"max_tokens": 16, "messages": USER}, INFO)
    script = [update(TextDelta("Hi")), update(TextDelta(" there"), finish=Finish(FinishCause.ERROR, error="parser failed"))]
    events, _ = stream(messages_encoder.MessagesEncoder(plan, [PROMPT], model="smol"), prepared(plan.generation), script)
    assert [e.event for e in events] == ["message_start", "content_block_start", "content_block_delta",
                                         "content_block_delta", "error"]
    assert [payloads(events)[i]["delta"]["text"] for i in (2, 3)] == ["Hi", " there"]
    assert events[-1] == StreamEvent({"type": "error", "error": {"type": "api_error", "message": "parser failed"}},
                                     "error")
    err = fail_buffered(messages_encoder.MessagesEncoder(plan, [PROMPT], model="smol"), prepared(plan.generation), script)
    assert err.message == "parser failed" and err.to_anthropic()["error"]["type"] == "api_error"


def test_responses_abort_mid_stream() -> None:
    plan = responses.decode_responses({"input": "Hi"}, INFO)
    script = [update(TextDelta("Hi")), update(finish=Finish(FinishCause.ABORTED))]
    enc = responses_encoder.make_encoder(plan, [PROMPT], SamplingParams(), model="smol", vocab=Vocab())
    events, _ = stream(enc, prepared(plan.generation), script)
    assert [e.event for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.failed"]
    final = payloads(events)[-1]["response"]
    assert final["status"] == "failed" and final["error"] == {"code": "server_error",
                                                              "message": "generation was aborted"}
    enc = responses_encoder.make_encoder(plan, [PROMPT], SamplingParams(), model="smol", vocab=Vocab())
    assert fail_buffered(enc, prepared(plan.generation), script).message == "generation was aborted"


def test_completions_error_in_one_of_several_children() -> None:
    plan = completions.decode_completion({"prompt": "Hello", "n": 2, "stream": True}, INFO)
    scripts = ([update(TextDelta("ok"), finish=EOS)],
               [update(TextDelta("x"), finish=Finish(FinishCause.ERROR, error="engine failure"))])
    events, _ = stream(completions.CompletionEncoder(plan, [PROMPT], model="smol", vocab=Vocab()),
                       prepared(plan.generation), *scripts)
    assert payloads(events)[-1] == {"error": InternalError("engine failure").to_openai()["error"]}
    assert StreamEvent("[DONE]") not in events
    assert "x" in [ch["text"] for c in payloads(events[:-1]) for ch in c["choices"]]  # it went out before
    plan = completions.decode_completion({"prompt": "Hello", "n": 2}, INFO)
    err = fail_buffered(completions.CompletionEncoder(plan, [PROMPT], model="smol", vocab=Vocab()),
                        prepared(plan.generation), *scripts)
    assert err.message == "engine failure"


def test_a_stream_that_ends_without_a_terminal_update_fails() -> None:
    enc, prep = chat_encoder(stream=True)
    events, _ = stream(enc, prep, [update(TextDelta("Hi"))])
    assert payloads(events)[-1]["error"]["message"] == "generation ended without a terminal event"
    assert payloads(events)[-2]["choices"][0]["delta"] == {"content": "Hi"}
    assert StreamEvent("[DONE]") not in events
    enc, prep = chat_encoder()
    assert fail_buffered(enc, prep, [update(TextDelta("Hi"))]).message == "generation ended without a terminal event"


def test_a_request_without_children_generates_nothing() -> None:
    # Completions max_tokens 0 without prompt scoring: tokenized and echoed only.
    plan = completions.decode_completion({"prompt": "Hello", "max_tokens": 0, "echo": True, "stream": True}, INFO)
    assert not plan.generation.submit
    prep = prepared(plan.generation, num_children=0)
    events, svc = stream(completions.CompletionEncoder(plan, [PROMPT], model="smol", vocab=Vocab()), prep)
    assert svc.calls == [] and events[-1] == StreamEvent("[DONE]")
    assert [(ch["text"], ch["finish_reason"]) for c in payloads(events[:-1]) for ch in c["choices"]] == [
        ("Hello", None), ("", "length")]
    plan = completions.decode_completion({"prompt": "Hello", "max_tokens": 0, "echo": True}, INFO)
    body, svc = buffer(completions.CompletionEncoder(plan, [PROMPT], model="smol", vocab=Vocab()),
                       prepared(plan.generation, num_children=0))
    assert svc.calls == [] and [(ch["text"], ch["finish_reason"]) for ch in body["choices"]] == [("Hello", "length")]


def test_only_the_engines_client_failure_is_a_400() -> None:
    """An ERROR finish the engine marks as the request's own (a grammar the model cannot follow) ends
    the request with a 400; any other failure, or a rule failure that wins over it, with a 500."""
    mine = Finish(FinishCause.ERROR, error="structured output failed: no token", client_error=True)
    u = update(TextDelta("x"), finish=mine)
    _, failure = OutputRules().screen(u)
    assert failure is not None and isinstance(failure_error(u, failure), BadRequest)
    assert failure_error(u, failure).status == 400 and failure_error(u, failure).message == mine.error
    other = update(finish=Finish(FinishCause.ERROR, error="engine failure"))
    _, failure = OutputRules().screen(other)
    assert failure is not None and type(failure_error(other, failure)) is InternalError
    ruled = update(call("b"), finish=mine)
    _, failure = rules("named", "a").screen(ruled)
    assert failure is not None and "called 'b'" in failure and type(failure_error(ruled, failure)) is InternalError
