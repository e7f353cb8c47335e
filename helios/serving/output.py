"""Per-child output processing: incremental detokenization, string stops, model output parsers.

One OutputProcessor per engine child turns RequestOutput records into ChildUpdate records that carry
domain events (text, reasoning, tool calls) and the terminal Finish. Every protocol encoder
consumes these, buffered or streamed, so the two can never disagree.

Token stops and the text they leave. The engine ends a request at the generated token that
completes a token stop (a `stop_token_ids` entry, or a `stop_token_sequences` entry the generated
tokens end with; `Scheduler._commit`). The matched stop leaves no text: a one-token stop (like EOS)
is never decoded, and the whole of a multi-token sequence is withheld. So that no part of a
sequence is ever published, text is held back while the generated tail is a proper prefix of some
stop sequence (as text that could still become a string stop is held back) and released as soon as
the tail stops being one, or when the request ends another way. When several sequences end at the
terminating token, the longest is withheld. Text is cut where the detokenizer stood before the
sequence's first token, so a character whose bytes straddle that boundary goes with the sequence.
Token ids, usage and logprobs are unchanged by the withholding: every generated token counts and is
reported in `ChildUpdate.token_ids`, and every token but the terminating one keeps its logprob entry
(the terminating token has none, as EOS has none; nor has a token the engine forced,
`RequestOutput.forced`), so a sequence's tokens before its last keep
theirs although their text is withheld, as vLLM keeps the logprobs of a string stop's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from helios.domain.events import FailureKind, Finish, FinishCause, OutputEvent
from helios.domain.generation import ChildUpdate
from helios.engine.records import EngineFinish, RequestOutput
from helios.parsers import OutputParser, PlainParser

_CAUSES = {
    EngineFinish.EOS: FinishCause.EOS,
    EngineFinish.STOP_TOKEN: FinishCause.STOP_TOKEN,
    EngineFinish.LENGTH: FinishCause.LENGTH,
    EngineFinish.ABORTED: FinishCause.ABORTED,
    EngineFinish.ERROR: FinishCause.ERROR,
}
# Ends that cut the model's output short (the parser drops an incomplete tool envelope at them).
_CUT_CAUSES = frozenset({FinishCause.LENGTH, FinishCause.STOP_STRING, FinishCause.STOP_TOKEN})


class Detokenizer(Protocol):
    def push(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


class OutputProcessor:
    def __init__(
        self,
        detokenizer: Detokenizer,
        *,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        parser: OutputParser | None = None,
        stop_token_sequences: Sequence[Sequence[int]] = (),
        origin: float | None = None,
        min_tokens: int = 0,
    ) -> None:
        self.detok = detokenizer
        self.stop = tuple(s for s in stop if s)
        # vLLM's min_tokens: no string stop matches while the output has at most this many tokens
        # (the engine masks EOS and token stops until then).
        self.min_tokens = min_tokens
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.include_stop = include_stop_str_in_output
        # Raw completions and models without reasoning or tool syntax: text is answer text.
        self.parser: OutputParser = parser or PlainParser()
        # Token stops (one-token ones included) that the engine may end the request on; the text of
        # a matched one is withheld (module docstring).
        self.token_stops = tuple(tuple(t) for t in stop_token_sequences if t)
        self._holding_stops = tuple(t for t in self.token_stops if len(t) > 1)
        self._tail_len = max((len(t) for t in self.token_stops), default=0)
        self._tail: list[int] = []  # the last generated ids, up to the longest token stop
        self._starts: list[int] = []  # per `_tail` entry: len(self.text) before its text was decoded
        self._held = 0  # trailing generated tokens whose text is held: a proper prefix of a sequence
        # Generated ids not yet fed to the parser, each with len(self.text) after its text: an id goes
        # to the parser with the release of the text it ends, never before (held text, by a string
        # stop's lookahead or a token stop's prefix, keeps its ids back with it).
        self._unfed: list[tuple[int, int]] = []
        self.origin = origin  # perf_counter of the request's admission (token timestamps)
        self.text = ""  # all text produced so far (after stop truncation)
        self.emitted = 0  # chars of self.text handed to the parser
        self.num_output_tokens = 0
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.num_decoded_chars = 0  # everything the detokenizer released, before stop truncation
        self.finished: Finish | None = None

    def process(self, out: RequestOutput) -> ChildUpdate:
        assert self.finished is None, "output after the terminal event"
        self.num_prompt_tokens = out.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens or self.num_cached_tokens
        finish: Finish | None = None
        matched: str | None = None
        token_ids = out.new_token_ids
        offsets: list[int] = []
        for i, tid in enumerate(token_ids):
            self.num_output_tokens += 1
            terminal = out.finish is not None and i == len(token_ids) - 1
            if self._tail_len:
                self._tail.append(tid)
                self._starts.append(len(self.text))
                if len(self._tail) > self._tail_len:
                    del self._tail[0], self._starts[0]
            if terminal and out.finish in (EngineFinish.EOS, EngineFinish.STOP_TOKEN):
                self._unfed.append((len(self.text), tid))
                continue  # the terminating token has no text
            before = len(self.text)
            if i not in out.forced:  # a forced token (a reasoning budget's close) has no logprob entry
                offsets.append(self.num_decoded_chars)
            piece = self.detok.push(tid)
            self.num_decoded_chars += len(piece)
            self.text += piece
            self._unfed.append((len(self.text), tid))
            if self._holding_stops:
                self._held = self._held_tokens()
            if self.stop and self.num_output_tokens > self.min_tokens:
                matched = self._match_stop(before)
                if matched is not None:
                    finish = Finish(FinishCause.STOP_STRING, matched_stop=matched)
                    token_ids = token_ids[: i + 1]
                    break
        if finish is None and out.finish is not None:
            tail = self.detok.flush()
            self.num_decoded_chars += len(tail)
            self.text += tail
            if self.stop and self.num_output_tokens > self.min_tokens:
                matched = self._match_stop(max(0, len(self.text) - 1))
                if matched is not None:
                    finish = Finish(FinishCause.STOP_STRING, matched_stop=matched)
            if finish is None:
                stop_id = token_ids[-1] if out.finish == EngineFinish.STOP_TOKEN and token_ids else None
                if stop_id is not None:
                    matched_len = self._matched_token_stop_len()
                    if matched_len > 1:  # withhold the whole sequence, not only its last token
                        self.text = self.text[: self._starts[-matched_len]]
                        self.emitted = min(self.emitted, len(self.text))
                finish = Finish(_CAUSES[out.finish], matched_stop=stop_id, error=out.error,
                                client_error=out.failure is FailureKind.UNPRODUCIBLE)
        if finish is not None:
            self._held = 0
        # Release text: everything when finished, else all but a possible stop prefix.
        limit = len(self.text) if finish is not None else len(self.text) - max(self.max_stop - 1, 0)
        if self._held:
            limit = min(limit, self._starts[-self._held])
        # The ids fed with the released text: those whose text ends within it (all, at the end).
        num_fed = len(self._unfed) if finish is not None else next(
            (k for k, (end, _) in enumerate(self._unfed) if end > limit), len(self._unfed))
        feed_ids = [tid for _, tid in self._unfed[:num_fed]]
        del self._unfed[:num_fed]
        events: list[OutputEvent] = []
        try:
            if limit > self.emitted:
                piece = self.text[self.emitted : limit]
                self.emitted = limit
                events.extend(self.parser.feed(piece, feed_ids))
            elif feed_ids:
                events.extend(self.parser.feed("", feed_ids))
            if finish is not None and finish.cause is not FinishCause.ERROR:
                # The output limit or a user stop (string or token id) that cut a tool envelope drops
                # it, as the limit does; only an incomplete call at the model's own end is an error.
                events.extend(self.parser.finish(truncated=finish.cause in _CUT_CAUSES))
        except Exception as exc:  # a model output the family parser rejects: the request fails
            events.extend(getattr(exc, "events", ()) or ())
            finish = Finish(FinishCause.ERROR, error=f"model output could not be parsed: {exc}")
        if finish is not None:
            self.finished = finish
        num_terminal = self._terminal(out, token_ids)
        num_forced = sum(1 for i in out.forced if i < len(token_ids) - num_terminal)
        num_entries = len(token_ids) - num_terminal - num_forced
        return ChildUpdate(
            events=events,
            token_ids=tuple(token_ids),
            logprobs=None if out.logprobs is None else out.logprobs[:num_entries],
            logprob_offsets=tuple(offsets[:num_entries]) if out.logprobs is not None else (),
            prompt_logprobs=out.prompt_logprobs,
            finish=finish,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            num_cached_tokens=self.num_cached_tokens,
            abort_engine=finish is not None and out.finish is None,
            num_reasoning_tokens=getattr(self.parser, "num_reasoning_tokens", 0),
            token_timestamps=() if self.origin is None else
            (round(max(out.produced_at - self.origin, 0.0), 6),) * len(token_ids),
        )

    def _held_tokens(self) -> int:
        """The longest generated tail that is a proper prefix of a multi-token stop (0: none).

        It can grow by at most one token per token (a held tail minus its last token was held
        before), so only lengths up to the previous one plus one are tried."""
        tail = self._tail
        best = 0
        for stop in self._holding_stops:
            for k in range(min(len(stop) - 1, self._held + 1, len(tail)), best, -1):
                if tail[-k:] == list(stop[:k]):
                    best = k
                    break
        return best

    def _matched_token_stop_len(self) -> int:
        """Tokens of the longest token stop the generated tokens end with (0: none matches)."""
        tail = self._tail
        return max((len(t) for t in self.token_stops if len(t) <= len(tail) and tail[-len(t):] == list(t)),
                   default=0)

    @staticmethod
    def _terminal(out: RequestOutput, token_ids: Sequence[int]) -> int:
        """1 when the last token is a terminating EOS or token-id stop (it gets no logprob entry)."""
        return int(bool(token_ids) and len(token_ids) == len(out.new_token_ids)
                   and out.finish in (EngineFinish.EOS, EngineFinish.STOP_TOKEN))

    def _match_stop(self, new_from: int) -> str | None:
        """Find the earliest stop string that ends in the new text; truncate self.text there."""
        start = max(0, new_from - self.max_stop + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            j = self.text.find(s, start)
            if j != -1 and (best is None or j < best[0]):
                best = (j, s)
        if best is None:
            return None
        j, s = best
        self.text = self.text[: j + len(s)] if self.include_stop else self.text[:j]
        self.emitted = min(self.emitted, len(self.text))
        return s
