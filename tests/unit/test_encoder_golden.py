"""Golden output of every protocol encoder: scripted updates through Chat, Completions, Responses and
Messages encoders (and the HTTP layer's terminal error events), each event and buffered body
serialized exactly as the SSE writer and the JSON response write them, compared byte for byte with
`golden/encoders.json`.

The golden file pins the wire bytes (key order, null versus omitted fields, number formatting), so
a refactoring of how the encoders build their output cannot change what clients receive. Ids and
times are made deterministic (uuid4 counts up, the clock stands still). To re-record after an
intended wire change: HELIOS_WRITE_GOLDEN=1 pytest tests/unit/test_encoder_golden.py.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from helios.asgi.responses import dumps
from helios.domain.events import Finish, FinishCause, OutputEvent, ReasoningDelta, TextDelta, ToolCall
from helios.domain.generation import ChildUpdate, PreparedPrompt, StreamEvent
from helios.domain.logprobs import PromptLogprob, TokenLogprob
from helios.domain.model import ModelInfo
from helios.domain.sampling import SamplingParams
from helios.errors import BadRequest, InternalError, NotFound
from helios.frontends.anthropic import messages, messages_encoder
from helios.frontends.openai import chat, completions, responses, responses_encoder, shapes
from helios.http import dispatch
from helios.serving.drive import Encoder

GOLDEN = Path(__file__).parent / "golden" / "encoders.json"

INFO = ModelInfo(
    model_id="org/model", aliases=("smol",), created=0, max_model_len=8192, vocab_size=1000,
    default_max_tokens=256, max_concurrency=4, prefill_chunk_size=256, max_top_logprobs=20,
    prompt_logprobs=True, sampling_defaults={}, sampling_ranges={}, recipe="qwen38", has_bos=True,
    has_reasoning=True, has_tools=True,
)
USER = [{"role": "user", "content": "Hi"}]
FUNCTIONS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("a", "b")]
PROMPT = PreparedPrompt((5, 6, 7, 8), "Hello")
IMAGE_PROMPT = PreparedPrompt((5, 6, 7, 8, 9, 10), "Look: <image>", image_tokens=2)


TOKENS = {1: b"Hel", 2: b"lo", 3: b"\xc3", 4: b"\xa9", 5: "😀".encode(), 6: b" \"q\""}


class Vocab:
    """Token bytes with a multi-byte character split over two tokens (ids 3 and 4) and an emoji."""

    def token_bytes(self, token_id: int) -> bytes:
        return TOKENS.get(token_id, f"<{token_id}>".encode())


VOCAB = Vocab()


def lp(t: int, top: int = 1) -> TokenLogprob:
    return TokenLogprob(t, -0.25 * t, 1 + t % 3, tuple((t + k, -0.5 - k) for k in range(top)))


def plp(t: int) -> PromptLogprob:
    return PromptLogprob(t, -1.5, 2, ((t + 1, -0.75, 1), (t + 2, -2.0, 3)))


def update(*events: OutputEvent, ids: Sequence[int] = (1,), finish: Finish | None = None, out: int = 1,
           logprobs: bool = False, reasoning: int = 0, prompt_scores: Sequence[PromptLogprob | None] | None = None,
           cached: int = 2, prompt: int = 4, stamps: bool = True) -> ChildUpdate:
    return ChildUpdate(
        events=list(events), token_ids=tuple(ids),
        logprobs=tuple(lp(t) for t in ids) if logprobs else None, finish=finish, num_prompt_tokens=prompt,
        num_output_tokens=out, num_cached_tokens=cached, num_reasoning_tokens=reasoning,
        logprob_offsets=tuple(range(len(ids))) if logprobs else (),
        prompt_logprobs=None if prompt_scores is None else tuple(prompt_scores),
        token_timestamps=tuple(0.125 * t for t in ids) if stamps else (),
    )


EOS = Finish(FinishCause.EOS)
LENGTH = Finish(FinishCause.LENGTH)
STOP_STRING = Finish(FinishCause.STOP_STRING, matched_stop="END")
STOP_TOKEN = Finish(FinishCause.STOP_TOKEN, matched_stop=7)
CALLS_EOS = Finish(FinishCause.EOS, has_tool_calls=True)

Script = Sequence[tuple[int, ChildUpdate]]


def drive(enc: Encoder, script: Script, *, fail: str | None = None) -> list[str]:
    """The encoder's stream (start, each update, then finish or the failure's events) and its body,
    one serialized line each: ``event <name>: <data>`` and ``body: <json>``."""
    events: list[StreamEvent] = list(enc.start())
    for index, u in script:
        events += enc.feed(index, u)
    events += enc.fail(InternalError(fail)) if fail is not None else enc.finish()
    lines = [f"event {e.event}: {e.data if isinstance(e.data, str) else dumps(e.data)}" for e in events]
    if fail is None:
        lines.append("body: " + dumps(enc.body()))
    return lines


# -- Chat -----------------------------------------------------------------------------------------------


def chat_encoder(prompts: Sequence[PreparedPrompt] = (PROMPT,), **fields: Any) -> chat.ChatEncoder:
    plan = chat.decode_chat({"messages": USER, **fields}, INFO)
    return chat.ChatEncoder(plan, prompts, model="smol", vocab=VOCAB)


CHAT_TWO = [
    (0, update(ReasoningDelta("Let me "), ids=(1, 2), out=2, logprobs=True, reasoning=2)),
    (1, update(TextDelta("Calling."), ids=(7,), out=1, logprobs=True)),
    (0, update(ReasoningDelta("think."), TextDelta("It is"), TextDelta(" é"), ids=(3,), out=3, logprobs=True,
               reasoning=3)),
    (0, update(ids=(4,), out=4, logprobs=True, reasoning=3)),  # held back: no text yet
    (1, update(ToolCall("call_1", "a", '{"city": "Paris"}'), ids=(8, 9), out=3, logprobs=True)),
    (0, update(TextDelta(" sunny 😀."), ids=(5, 6), out=6, logprobs=True, reasoning=3, finish=EOS)),
    (1, update(ToolCall("call_2", "b", "{}"), TextDelta("after"), ids=(10,), out=4, logprobs=True,
               finish=CALLS_EOS)),
]


def chat_cases() -> Iterator[tuple[str, Callable[[], list[str]]]]:
    yield "chat n=2 tools logprobs ids usage", lambda: drive(chat_encoder(
        n=2, tools=FUNCTIONS, logprobs=True, top_logprobs=1, return_token_ids=True, stream=True,
        stream_options={"include_usage": True}), CHAT_TWO)
    yield "chat ids timestamps terminal usage", lambda: drive(chat_encoder(
        n=2, tools=FUNCTIONS, return_token_ids=True, return_token_timestamps=True), CHAT_TWO)
    yield "chat continuous usage as token ids", lambda: drive(chat_encoder(
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}, logprobs=True,
        top_logprobs=2, return_tokens_as_token_ids=True, logprob_token_ids=[3, 9]), [
        (0, update(TextDelta("Hello"), ids=(1, 2), out=2, logprobs=True)),
        (0, update(ids=(3,), out=3, logprobs=True)),
        (0, update(TextDelta(" END"), ids=(4,), out=4, finish=STOP_STRING)),
    ])
    yield "chat prompt logprobs images stop token", lambda: drive(chat_encoder(
        (IMAGE_PROMPT,), prompt_logprobs=1, stop_token_ids=[7]), [
        (0, update(ids=(), out=0, prompt_scores=(None, plp(6), plp(7)), prompt=6)),
        (0, update(TextDelta("Hi"), ids=(1,), out=1, prompt_scores=(plp(8), plp(9), plp(10)), prompt=6)),
        (0, update(ids=(7,), out=2, finish=STOP_TOKEN, prompt=6)),
    ])
    yield "chat plain length", lambda: drive(chat_encoder(max_tokens=2), [
        (0, update(TextDelta("a"), out=1)), (0, update(TextDelta("b"), out=2, finish=LENGTH))])
    yield "chat reasoning only, no tokens", lambda: drive(chat_encoder(), [
        (0, update(ReasoningDelta("hmm"), ids=(1,), reasoning=1)), (0, update(ids=(), out=1, finish=EOS))])
    yield "chat fail", lambda: drive(chat_encoder(stream=True), [(0, update(TextDelta("x")))],
                                     fail="parser failed")


# -- Completions ----------------------------------------------------------------------------------------


def completion_encoder(prompts: Sequence[PreparedPrompt] = (PROMPT,), **fields: Any) -> completions.CompletionEncoder:
    plan = completions.decode_completion({"prompt": "Hello", **fields}, INFO)
    return completions.CompletionEncoder(plan, prompts, model="smol", vocab=VOCAB)


def completion_cases() -> Iterator[tuple[str, Callable[[], list[str]]]]:
    two = (PROMPT, PreparedPrompt((1, 2, 3), "Hel\u00e9"))
    yield "completions echo logprobs prompt scores n=2 ids", lambda: drive(completion_encoder(
        two, prompt=["Hello", "Helé"], n=2, echo=True, logprobs=1, return_token_ids=True, stream=True,
        stream_options={"include_usage": True}), [
        (0, update(ids=(), out=0, prompt_scores=(None, plp(6)), logprobs=False)),
        (2, update(TextDelta("x"), ids=(3,), out=1, logprobs=True, prompt_scores=(None, plp(2), plp(3)),
                   prompt=3)),
        (0, update(TextDelta("Hi é"), ids=(1, 3, 4), out=3, logprobs=True, prompt_scores=(plp(7), plp(8)))),
        (1, update(TextDelta("Yo"), ids=(2,), out=1, logprobs=True, prompt_scores=(None, plp(6), plp(7), plp(8)),
                   finish=EOS)),
        (3, update(TextDelta("z"), ids=(5,), out=1, logprobs=True, prompt_scores=(None, plp(2), plp(3)), prompt=3,
                   finish=LENGTH)),
        (0, update(ids=(7,), out=4, logprobs=True, finish=STOP_TOKEN)),
        (2, update(TextDelta(" END"), ids=(6,), out=2, logprobs=True, prompt=3, finish=STOP_STRING)),
    ])
    yield "completions echo max_tokens 0 usage", lambda: drive(completion_encoder(
        two, prompt=["Hello", "Helé"], echo=True, max_tokens=0, stream=True, stream_options={"include_usage": True}),
        [])
    yield "completions explicit ids continuous usage timestamps", lambda: drive(completion_encoder(
        logprobs=2, logprob_token_ids=[4, 2], stream=True, return_token_timestamps=True, return_tokens_as_token_ids=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}), [
        (0, update(TextDelta("Hel"), ids=(1,), logprobs=True)),
        (0, update(ids=(3,), out=2)),
        (0, update(TextDelta("lo"), ids=(2,), out=3, logprobs=True, finish=LENGTH)),
    ])
    yield "completions prompt logprobs buffered ids terminal usage", lambda: drive(completion_encoder(
        prompt_logprobs=1, return_token_ids=True, max_tokens=0), [
        (0, update(ids=(), out=0, prompt_scores=(None, plp(6), plp(7), plp(8)), finish=LENGTH)),
    ])
    yield "completions fail", lambda: drive(completion_encoder(stream=True), [(0, update(TextDelta("x")))],
                                            fail="engine failed")


# -- Responses ------------------------------------------------------------------------------------------

RESPONSE_TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}},
    {"type": "custom", "name": "run_code", "description": "Runs code"},
    {"type": "namespace", "name": "crm", "description": "CRM", "tools": [
        {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}]},
]


def response_encoder(sampling: SamplingParams = SamplingParams(temperature=0.5, top_p=0.75),
                     **fields: Any) -> responses_encoder.ResponseEncoder:
    plan = responses.decode_responses({"input": "hi", **fields}, INFO)
    return responses_encoder.make_encoder(plan, [PROMPT], sampling, model="smol", vocab=VOCAB)


def response_cases() -> Iterator[tuple[str, Callable[[], list[str]]]]:
    flat = "crm" + responses.NAMESPACE_SEPARATOR + "lookup"
    yield "responses reasoning text calls logprobs", lambda: drive(response_encoder(
        tools=RESPONSE_TOOLS, instructions="Be brief.", max_output_tokens=99, metadata={"k": "v"},
        include=["message.output_text.logprobs"], top_logprobs=1, reasoning={"effort": "low"}, user="u1",
        prompt_cache_key="pk", safety_identifier="s", max_tool_calls=3, parallel_tool_calls=True), [
        (0, update(ReasoningDelta("Think "), ids=(1,), out=1, reasoning=1, logprobs=True)),
        (0, update(ReasoningDelta("more."), TextDelta("Hel"), ids=(2, 1), out=3, reasoning=2, logprobs=True)),
        (0, update(TextDelta("lo é"), ids=(2, 3, 4), out=6, reasoning=2, logprobs=True)),
        (0, update(ToolCall("call_1", "get_weather", '{"city": "Paris"}'), ids=(8,), out=7, reasoning=2)),
        (0, update(ToolCall("", "run_code", '{"input": "print(1)"}'), ToolCall("call_1", flat, "{}"),
                   TextDelta("Done"), ids=(9, 10), out=9, reasoning=2, logprobs=True)),
        (0, update(ids=(11,), out=10, reasoning=2, logprobs=True, finish=CALLS_EOS)),
    ])
    yield "responses incomplete as token ids", lambda: drive(response_encoder(
        include=["message.output_text.logprobs"], top_logprobs=0, return_tokens_as_token_ids=True,
        text={"format": {"type": "json_object"}}, tool_choice="none"), [
        (0, update(TextDelta("Hello"), ids=(1, 2), out=2, logprobs=True)),
        (0, update(ids=(3,), out=3, finish=LENGTH)),
    ])
    yield "responses failed", lambda: drive(response_encoder(), [(0, update(TextDelta("x")))],
                                            fail="generation failed")

    def subset_base() -> list[str]:
        base: dict[str, Any] = {
            "background": False, "instructions": None, "max_output_tokens": None, "metadata": {}, "model": "smol",
            "parallel_tool_calls": True, "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": 1.0, "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [],
            "top_p": 1.0, "truncation": "disabled"}
        enc = responses_encoder.ResponseEncoder(
            base=shapes.ResponseParams(**base), toolset=responses.ToolSet(), prompts=[PROMPT],
            logprob_content=lambda records: [{"token": f"t{r.token_id}", "logprob": r.logprob, "bytes": [],
                                              "top_logprobs": []} for r in records],
            token_bytes=VOCAB.token_bytes)
        return drive(enc, [(0, update(TextDelta("Hello"), ids=(1, 2), out=2, logprobs=True, finish=EOS))])

    yield "responses encoder from a base mapping", subset_base


# -- Messages -------------------------------------------------------------------------------------------

QWEN = ModelInfo(
    model_id="org/model", aliases=("m",), created=0, max_model_len=8192, vocab_size=1000, default_max_tokens=256,
    max_concurrency=4, prefill_chunk_size=256, max_top_logprobs=20, prompt_logprobs=False, sampling_defaults={},
    sampling_ranges={}, recipe="qwen38", has_bos=True, has_reasoning=True, has_tools=True,
)
MESSAGE_TOOLS = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}]


def message_encoder(**fields: Any) -> messages_encoder.MessagesEncoder:
    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}], **fields}
    plan = messages.decode_request(body, QWEN)
    return messages_encoder.MessagesEncoder(plan, [IMAGE_PROMPT], model="m")


def message_cases() -> Iterator[tuple[str, Callable[[], list[str]]]]:
    script: Script = [
        (0, update(ReasoningDelta("Let me "), out=1, cached=3, prompt=6)),
        (0, update(ReasoningDelta("think \"é\"."), TextDelta("Sure"), out=2, cached=3, prompt=6)),
        (0, update(TextDelta(" 😀"), ToolCall("call_abc", "get_weather", '{"city": "Paris"}'), out=3, cached=3,
                   prompt=6)),
        (0, update(ToolCall("toolu_x", "get_weather", "  "), TextDelta("after"), out=4, cached=3, prompt=6,
                   finish=CALLS_EOS)),
    ]
    yield "messages thinking text tools", lambda: drive(message_encoder(
        tools=MESSAGE_TOOLS, thinking={"type": "enabled", "budget_tokens": 1024}), script)
    yield "messages hidden thinking stop sequence", lambda: drive(message_encoder(
        stop_sequences=["END"], thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"}), [
        (0, update(ReasoningDelta("secret"), out=1, prompt=6)),
        (0, update(TextDelta("Answer"), out=2, prompt=6, finish=STOP_STRING)),
    ])
    yield "messages max tokens", lambda: drive(message_encoder(), [
        (0, update(TextDelta("a"), out=1, prompt=6)), (0, update(out=2, prompt=6, finish=LENGTH))])
    yield "messages fail", lambda: drive(message_encoder(), [(0, update(TextDelta("x"), prompt=6))],
                                         fail="engine failed")


# -- the HTTP layer's terminal error events -------------------------------------------------------------


def error_cases() -> Iterator[tuple[str, Callable[[], list[str]]]]:
    def events() -> list[str]:
        out = []
        for path in ("/v1/messages", "/v1/responses", "/v1/chat/completions"):
            for exc in (InternalError("boom"), BadRequest("bad value", param="x.y"), NotFound("no such model")):
                e = dispatch._error_event(path, exc)
                out.append(f"event {e.event}: {dumps(e.data)}")
        return out

    yield "dispatch error events", events


CASES = dict([*chat_cases(), *completion_cases(), *response_cases(), *message_cases(), *error_cases()])


@pytest.fixture
def deterministic(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = iter(range(1, 1 << 30))
    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(int=next(counter)))
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.5)


def record() -> dict[str, list[str]]:
    return {name: case() for name, case in CASES.items()}


@pytest.mark.usefixtures("deterministic")
def test_encoder_output_is_byte_for_byte_the_golden_record() -> None:
    got = record()
    if os.environ.get("HELIOS_WRITE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(got, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    want = json.loads(GOLDEN.read_text(encoding="utf-8"))
    assert list(got) == list(want)
    for name in want:
        assert len(got[name]) == len(want[name]), name
        for k, (g, w) in enumerate(zip(got[name], want[name], strict=True)):
            assert g == w, f"{name}, line {k}"


@pytest.mark.usefixtures("deterministic")
def test_the_record_covers_every_event_shape() -> None:
    """The golden cases exercise each protocol's event kinds (so the pin is not vacuous)."""
    text = "\n".join(line for lines in record().values() for line in lines)
    for needle in (
        '"role":"assistant","content":""', '"reasoning_content":', '"tool_calls":[{"id":"call_1","type":"function",'
        '"index":0', '"prompt_token_ids":', '"token_timestamps":', '"multimodal_tokens":{"image":2}',
        '"prompt_logprobs":[null,', '"text_offset":', '"stop_reason":7', '"choices":[],"usage"',
        "event response.reasoning_text.delta", "event response.custom_tool_call_input.done",
        '"namespace":"crm"', "event response.incomplete", "event response.failed", "event response.completed",
        "event content_block_start", '"signature_delta"', '"input_json_delta"', '"stop_sequence":"END"',
        "event error", "[DONE]",
    ):
        assert needle in text, needle
