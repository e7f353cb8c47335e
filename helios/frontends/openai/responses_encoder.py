"""POST /v1/responses, the output side: the Response object a request echoes and the sans-IO encoder
that turns screened child updates into Responses SSE events and the final Response (the request
side is `helios.frontends.openai.responses`).

One sans-IO `ResponseEncoder` turns ChildUpdate records into Responses SSE events and the final
response object. The buffered route runs the same encoder and keeps only the final object, so a
buffered response and a stream of the same tokens cannot disagree.

Event order for one response (sequence_number counts from 0 over every event):

    response.created, response.in_progress,
    per output item, in output order:
      reasoning:     output_item.added, content_part.added, reasoning_text.delta*,
                     reasoning_text.done, content_part.done, output_item.done
      message:       output_item.added, content_part.added, output_text.delta*,
                     output_text.done, content_part.done, output_item.done
      function_call: output_item.added, function_call_arguments.delta,
                     function_call_arguments.done, output_item.done
      custom call:   output_item.added, custom_tool_call_input.delta,
                     custom_tool_call_input.done, output_item.done
    then exactly one of response.completed | response.incomplete | response.failed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Literal

import attrs

from helios.domain.conversation import custom_tool_input
from helios.domain.events import FinishCause, ReasoningDelta, TextDelta, ToolCall
from helios.domain.generation import Accumulated, ChildUpdate, PreparedPrompt, StreamEvent, usage_of
from helios.domain.model import TokenVocabulary
from helios.domain.sampling import SamplingParams
from helios.domain.shapes import OMIT, Opt, to_json
from helios.errors import HeliosError
from helios.frontends.openai import shapes
from helios.frontends.openai.logprobs import chat_logprobs
from helios.frontends.openai.responses import ECHOED_FIELDS, ResponsesPlan, ToolSet


def response_params(plan: ResponsesPlan, sampling: SamplingParams, model: str) -> shapes.ResponseParams:
    """The request parameters a Response object echoes (the SDK's Response model requires several)."""
    w = plan.wire
    echoed: dict[str, Any] = {name: plan.echo.get(name) for name in ECHOED_FIELDS if name != "metadata"}
    return shapes.ResponseParams(
        **echoed, metadata=dict(plan.echo.get("metadata") or {}),  # as sent: null (metadata {}) where absent
        instructions=w.instructions, max_output_tokens=w.max_output_tokens, top_logprobs=w.top_logprobs or 0,
        model=model, temperature=sampling.temperature, top_p=sampling.top_p,  # as served
        parallel_tool_calls=plan.conversation.parallel_tool_calls, tools=plan.tools_as_sent,
        tool_choice=plan.tool_choice_echo, text=plan.text_config,
        reasoning={"effort": plan.effort, "summary": plan.summary},
        previous_response_id=None, service_tier="default")  # what Helios does


# -- the encoder ----------------------------------------------------------------------------------

TextKind = Literal["reasoning", "message"]

_TEXT_ITEMS: dict[str, tuple[str, str, str]] = {
    "reasoning": ("rs", "response.reasoning_text.delta", "response.reasoning_text.done"),
    "message": ("msg", "response.output_text.delta", "response.output_text.done"),
}
"""A text item's id prefix and the types of its delta and done events."""


@attrs.define
class _OpenItem:
    kind: TextKind
    id: str
    output_index: int
    text: str = ""
    logprobs: list[Any] = attrs.field(factory=list)

    def shapes(self, status: str | None) -> tuple[shapes.OutputItem, shapes.ContentPart]:
        """The item and its content part as they stand: as added (empty, in progress) where `status` is
        None, else done with `status`."""
        if self.kind == "reasoning":
            text = shapes.ReasoningText(text=self.text)
            return shapes.ReasoningItem(id=self.id, summary=[], content=[text] if status else []), text
        part = shapes.OutputText(text=self.text, annotations=[], logprobs=list(self.logprobs))
        content = [part] if status else []
        return shapes.MessageItem(id=self.id, status=status or "in_progress", content=content), part

    def where(self) -> dict[str, Any]:
        """The fields naming this item (and its one content part) on its events."""
        return {"item_id": self.id, "output_index": self.output_index}


class ResponseEncoder:
    """Screened child updates → Responses SSE events (named by their type, with sequence_number) and
    the final response object (`body`). Sans-IO; the tool-choice output rules are the drivers'
    (`helios.serving.drive`): a call that breaks one never reaches the encoder, and `fail` ends the
    response with `response.failed`.

    `logprob_content` turns engine logprob records into Chat-shaped entries (None: logprobs were not
    requested); `token_bytes` gives a token's exact bytes, used to attribute tokens to output text:
    a token receives an entry when its first byte belongs to answer text. Tokens the parser counted
    as reasoning, tokens of tool envelopes and delimiters, and a terminating EOS or stop token get none.
    """

    def __init__(self, *, base: shapes.ResponseParams, toolset: ToolSet, prompts: Sequence[PreparedPrompt],
                 logprob_content: Callable[[Sequence[Any]], shapes.LogprobEntries] | None,
                 token_bytes: Callable[[int], bytes]) -> None:
        self._response = shapes.Response(id=_new_id("resp"), created_at=int(time.time()), params=base)
        """The Response as it stands; `response` copies it."""
        self._toolset = toolset
        self._lp = logprob_content
        self._token_bytes = token_bytes
        self._events: list[shapes.ResponseStreamEvent] = []  # made since the last public call
        self._seq = 0
        self._open: _OpenItem | None = None
        self._call_ids: set[str] = set()
        # logprob attribution
        self._pending: list[Any] = []
        self._owed = 0
        self._reasoning_seen = 0
        # usage: counted from the updates, the prompt as prepared
        self._prompts = tuple(prompts)
        self._acc = Accumulated()

    # -- public ---------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._response.status != "in_progress"

    def start(self) -> list[StreamEvent]:
        for status in ("created", "in_progress"):
            self._emit(shapes.ResponseEvent, type=f"response.{status}", response=self.response())
        return self._sent()

    def feed(self, index: int, u: ChildUpdate) -> list[StreamEvent]:
        if self.done:
            return []
        self._acc.add_counts(u)  # the items are built here; the accumulator only counts
        self._queue_logprobs(u)
        for e in u.events:
            if isinstance(e, TextDelta) and e.text:
                self._delta("message", e.text, self._attribute(e.text))
            elif isinstance(e, ReasoningDelta | ToolCall):
                self._pending.clear()  # a token's entry needs answer text right after it
                self._owed = 0
                if isinstance(e, ToolCall):
                    self._call(e)
                elif e.text:
                    self._delta("reasoning", e.text)
        if u.finish is not None:
            self._terminal("incomplete" if u.finish.cause is FinishCause.LENGTH else "completed")
        return self._sent()

    def finish(self) -> list[StreamEvent]:
        return []  # the terminal response event went out with the terminal update

    def fail(self, error: HeliosError) -> list[StreamEvent]:
        if not self.done:
            self._response.error = shapes.ResponseError(code="server_error", message=error.message)
            self._terminal("failed")
        return self._sent()

    def body(self) -> dict[str, Any]:
        return to_json(self.response())  # type: ignore[no-any-return]

    def response(self) -> shapes.Response:
        """The Response as it stands (a snapshot: later events do not change it)."""
        r = self._response  # mypy does not see that a @shape class is an attrs class
        return attrs.evolve(r, output=list(r.output))  # type: ignore[misc]

    # -- items ----------------------------------------------------------------------------------
    def _delta(self, kind: TextKind, text: str, entries: Opt[shapes.LogprobEntries] = OMIT) -> None:
        """Text of the open `kind` item (opened here where another is open); `entries`: its logprobs."""
        item = self._open
        if item is None or item.kind != kind:
            self._close_open()
            self._open = item = _OpenItem(kind, _new_id(_TEXT_ITEMS[kind][0]), len(self._response.output))
            added, part = item.shapes(None)
            self._put(item.output_index, added, "added")
            self._emit(shapes.ContentPartEvent, type="response.content_part.added", **item.where(), part=part)
        item.text += text
        if entries is not OMIT:
            item.logprobs.extend(entries)
        self._emit(shapes.TextDeltaEvent, type=_TEXT_ITEMS[kind][1], **item.where(), delta=text,
                   logprobs=entries)

    def _close_open(self, status: str = "completed") -> None:
        item, self._open = self._open, None
        if item is None:
            return
        done, part = item.shapes(status)
        logprobs = item.logprobs if item.kind == "message" else OMIT
        self._emit(shapes.TextDoneEvent, type=_TEXT_ITEMS[item.kind][2], **item.where(), text=item.text,
                   logprobs=logprobs)
        self._emit(shapes.ContentPartEvent, type="response.content_part.done", **item.where(), part=part)
        self._put(item.output_index, done, "done")

    def _call(self, tc: ToolCall) -> None:
        """A call's item, added with an empty value, its value in one delta, and the item done."""
        self._close_open()
        tool = self._toolset.restore(tc.name)
        call_id = tc.id if tc.id and tc.id not in self._call_ids else _new_id("call")  # ids stay unique
        self._call_ids.add(call_id)
        index = len(self._response.output)
        custom = tool.kind == "custom"
        item_id = _new_id("ctc" if custom else "fc")
        where = {"item_id": item_id, "output_index": index}
        item: Callable[..., shapes.OutputItem] = partial(
            shapes.CustomToolCallItem if custom else shapes.FunctionCallItem, id=item_id, call_id=call_id,
            name=tool.name, namespace=tool.namespace or OMIT)
        finish: Callable[..., shapes.ResponseStreamEvent]  # the done event, but for its type and place
        if custom:
            value, event = custom_tool_input(tc.arguments), "response.custom_tool_call_input"
            added, done = item(input=""), item(input=value)
            finish = partial(shapes.CustomToolCallDoneEvent, input=value)
        else:
            value, event = tc.arguments, "response.function_call_arguments"
            added, done = item(arguments="", status="in_progress"), item(arguments=value, status="completed")
            finish = partial(shapes.FunctionCallDoneEvent, name=tool.name, arguments=value)
        self._put(index, added, "added")
        self._emit(shapes.CallDeltaEvent, type=f"{event}.delta", **where, delta=value)
        self._emit(finish, type=f"{event}.done", **where)
        self._put(index, done, "done")

    def _put(self, index: int, item: shapes.OutputItem, stage: Literal["added", "done"]) -> None:
        """Output item `index` (a new one at the end) as it now stands, and its output_item event."""
        self._response.output[index:index + 1] = [item]
        self._emit(shapes.OutputItemEvent, type=f"response.output_item.{stage}", output_index=index,
                   item=item)

    def _terminal(self, status: Literal["completed", "incomplete", "failed"]) -> None:
        """End the response with its usage; it is incomplete only at the output limit."""
        self._close_open("completed" if status == "completed" else "incomplete")
        u = usage_of(self._prompts, [self._acc], 1)  # later updates are not fed
        self._response.usage = shapes.ResponseUsage(
            input_tokens=u.prompt_tokens, output_tokens=u.completion_tokens, total_tokens=u.total_tokens,
            input_tokens_details=shapes.InputTokensDetails(cached_tokens=u.cached_tokens, cache_write_tokens=0),
            output_tokens_details=shapes.OutputTokensDetails(reasoning_tokens=u.reasoning_tokens))
        self._response.status = status
        if status == "incomplete":
            self._response.incomplete_details = shapes.IncompleteDetails(reason="max_output_tokens")
        if status == "completed":
            self._response.completed_at = int(time.time())
        self._emit(shapes.ResponseEvent, type=f"response.{status}", response=self.response())

    # -- logprob attribution ---------------------------------------------------------------------
    def _queue_logprobs(self, u: ChildUpdate) -> None:
        if self._lp is None:
            return
        records = list(u.logprobs or ())
        num_reasoning = max(0, u.num_reasoning_tokens - self._reasoning_seen)
        self._reasoning_seen = max(self._reasoning_seen, u.num_reasoning_tokens)
        if (u.finish is not None and u.finish.cause in (FinishCause.EOS, FinishCause.STOP_TOKEN)
                and records and len(records) == len(u.token_ids)):
            records = records[:-1]  # a terminating EOS or stop token has no entry
        self._pending.extend(records[num_reasoning:])

    def _attribute(self, text: str) -> shapes.LogprobEntries:
        """Pending tokens whose first byte falls within newly released answer text."""
        if self._lp is None:
            return []
        self._owed += len(text.encode("utf-8"))
        taken: list[Any] = []
        while self._pending and self._owed > 0:
            record = self._pending.pop(0)
            taken.append(record)
            self._owed -= max(1, len(self._token_bytes(record.token_id)))
        return self._lp(taken) if taken else []

    # -- helpers ---------------------------------------------------------------------------------
    def _emit(self, cls: Callable[..., shapes.ResponseStreamEvent], **fields: Any) -> None:
        self._events.append(cls(sequence_number=self._seq, **fields))
        self._seq += 1

    def _sent(self) -> list[StreamEvent]:
        """The events made since the last public call, named by their type."""
        events, self._events = self._events, []
        return [StreamEvent(e, e.type) for e in events]


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def make_encoder(plan: ResponsesPlan, prompts: Sequence[PreparedPrompt], sampling: SamplingParams, *, model: str,
                 vocab: TokenVocabulary) -> ResponseEncoder:
    as_ids = plan.wire.return_tokens_as_token_ids
    content = None if plan.num_top_logprobs is None else partial(chat_logprobs, vocab=vocab, as_ids=as_ids)
    return ResponseEncoder(base=response_params(plan, sampling, model), toolset=plan.toolset, prompts=prompts,
                           logprob_content=content, token_bytes=vocab.token_bytes)
