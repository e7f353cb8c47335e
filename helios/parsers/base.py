"""Sans-IO streaming output parsing: the shared machine every model family plugs into.

A parser is fed the generated text piece by piece, each piece with the token ids that produced it,
and returns neutral output events (`TextDelta`, `ReasoningDelta`, `ToolCall`). Reasoning and answer
text stream as soon as nothing held back could still turn out to be markup; tool envelopes are
buffered until complete and published whole. Feeding the same text split at any boundary produces
the same events once adjacent deltas are joined.

Token-id gating. A reasoning delimiter the tokenizer encodes as one token (`<think>`, `</think>`,
`</mm:think>`, Gemma 4's `<channel|>`) acts only where the model generated that token: the parser is
built with `delimiter_token_ids` (delimiter text -> token id) and an occurrence of the text counts
only when it lies inside one fed piece whose `token_ids` include that id (the n-th occurrence in the
piece is real only if the id occurs at least n times). The serving pipeline must decode these
delimiter tokens to their text. Delimiters without an id (several tokens, or families such as
DeepSeek whose official parser matches text) are matched as text, held back while a piece could still
complete them.

Whitespace. Leading and trailing whitespace of each text run next to structure (the start and end of
output, reasoning delimiters, tool envelopes) is dropped, so `<think>\\nx\\n</think>\\n\\nHi` gives
reasoning "x" and answer "Hi". Whitespace inside a run is kept verbatim.
"""

from __future__ import annotations

import abc
import enum
import secrets
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from helios.domain.events import OutputEvent, ReasoningDelta, TextDelta, ToolCall
from helios.parsers.arguments import MAX_ARGUMENTS_BYTES, dump_arguments
from helios.parsers.errors import ToolParseError

MAX_ENVELOPE_CHARS = 2 * MAX_ARGUMENTS_BYTES + 65536
"""Buffered envelope text past which a call fails before it completes (bounded memory)."""

MAX_UNDECIDED_CHARS = 4096
"""Lookahead after an opener that cannot be decided within this many characters is not a call."""


class Region(enum.Enum):
    """Where the scanner is in the output."""

    CONTENT = "content"
    REASONING = "reasoning"
    BLOCK = "block"  # inside an outer tool-calls block (MiniMax, DSML, Kimi, DeepSeek V3.1, XTML)
    VERBATIM = "verbatim"  # structured DeepSeek answer: everything left is answer text
    DONE = "done"  # output ended (DSML block closed, XTML message closed): the rest is discarded


class MarkerAction(enum.Enum):
    SWALLOW = "swallow"  # framing markup that carries no content (XTML response tags)
    END = "end"  # the end of parsed output; later text is discarded


@attrs.frozen
class ReasoningSyntax:
    """Reasoning delimiters. `open` is recognized only before any answer text or call."""

    open: tuple[str, ...]
    close: tuple[str, ...]
    gated: bool = True  # False: always matched as text, whatever ids are given (DeepSeek)


@attrs.frozen
class ParsedCall:
    name: str
    arguments: Mapping[str, Any]
    call_id: str | None = None  # the model's own id where the syntax carries one (Kimi)


class _Undecided:
    def __repr__(self) -> str:
        return "UNDECIDED"


class _NotCall:
    def __repr__(self) -> str:
        return "NOT_CALL"


class _LeaveBlock:
    def __repr__(self) -> str:
        return "LEAVE_BLOCK"


UNDECIDED = _Undecided()
"""The text after the opener cannot yet tell a call from a prose mention; feed more."""
NOT_CALL = _NotCall()
"""The opener is prose: it stays text."""
LEAVE_BLOCK = _LeaveBlock()
"""Inside a block, the text here is not a call: the block ends and the text is answer content."""


@attrs.frozen
class Waiting:
    """A recognized call that completes once `closer` appears at or after `search_from`."""

    closer: str
    search_from: int = 0


@attrs.frozen
class Parsed:
    """The envelope spans `[0, end)`; publish `calls`, then continue in `region`."""

    end: int
    calls: tuple[ParsedCall, ...] = ()
    region: Region = Region.CONTENT


Step = _Undecided | _NotCall | _LeaveBlock | Waiting | Parsed


class ToolSyntax:
    """One family's tool-call markup. Envelopes always start at `text[0]`.

    `parse` is called with the text from an opener on; `parse_block` with the text from the first
    non-whitespace character inside a block. Both return a Step and must consume at least one
    character when they return Parsed. `final` is True at the natural end of generation: the last
    chance to accept a tolerated ending.
    """

    openers: tuple[str, ...] = ()
    trailing: tuple[str, ...] = ()  # closing tags swallowed right after a call (`</tool_call>`)
    leading: tuple[str, ...] = ()  # openers that start a call only before any answer text (Qwen2.5 JSON)

    def parse(self, text: str, final: bool) -> Step:
        raise NotImplementedError

    def parse_block(self, text: str, final: bool) -> Step:
        return LEAVE_BLOCK


class OutputParser(abc.ABC):
    """The interface the serving pipeline drives, one instance per generated sequence."""

    num_reasoning_tokens: int
    """Tokens fed while reasoning was open (the closing delimiter counts, the opening one does not)."""

    @abc.abstractmethod
    def feed(self, text: str, token_ids: Sequence[int] = ()) -> list[OutputEvent]:
        """Consumes one piece of output; returns the events it completes."""

    @abc.abstractmethod
    def finish(self, *, truncated: bool = False) -> list[OutputEvent]:
        """Ends the output. `truncated`: the output limit or a user stop cut it, so an incomplete
        envelope is dropped silently; otherwise an incomplete or undecided call raises ToolParseError."""

    @property
    @abc.abstractmethod
    def in_reasoning(self) -> bool:
        """Reasoning is unambiguously open (no held-back text could close it)."""

    @property
    @abc.abstractmethod
    def is_tool_call_pending(self) -> bool:
        """A tool opener is buffered: undecided, or recognized and waiting for its end."""

    @property
    @abc.abstractmethod
    def num_tool_calls(self) -> int:
        """Calls published so far."""


def random_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class StreamingParser(OutputParser):
    """Reasoning syntax + tool syntax + framing markers, composed into one scanner."""

    def __init__(
        self,
        *,
        reasoning: ReasoningSyntax | None,
        tools: ToolSyntax | None,
        markers: Mapping[str, MarkerAction] | None = None,
        delimiter_token_ids: Mapping[str, int] | None = None,
        starts_in_reasoning: bool = False,
        tool_call_ends_reasoning: bool = False,
        verbatim_structured_answer: bool = False,
        make_call_id: Callable[[], str] | None = None,
    ) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._markers = dict(markers or {})
        self._tool_ends_reasoning = tool_call_ends_reasoning
        self._verbatim_answer = verbatim_structured_answer
        self._make_call_id = make_call_id or random_call_id
        self._gate_ids: dict[str, int] = {}
        if reasoning is not None and reasoning.gated and delimiter_token_ids:
            for literal in (*reasoning.open, *reasoning.close):
                token_id = delimiter_token_ids.get(literal)
                if token_id is not None:
                    self._gate_ids[literal] = token_id
        self._real: dict[str, deque[int]] = {literal: deque() for literal in self._gate_ids}
        self._buf = ""
        self._base = 0  # absolute offset of _buf[0]
        self._end = 0  # absolute offset just past everything fed
        self._chunks: list[str] = []  # text fed while a Waiting envelope looks for its closer
        self._chunks_len = 0
        self._probe = ""  # tail of the text seen while waiting, to find a closer split across pieces
        self._region = Region.REASONING if starts_in_reasoning and reasoning else Region.CONTENT
        self._reasoning_done = False
        self._pending: _Undecided | Waiting | None = None
        self._pending_in_block = False
        self._pending_opener_len = 0
        self._after_call = False
        self._incomplete = False
        self._failed: ToolParseError | None = None
        self._finished = False
        self._num_calls = 0
        self._emitter = _Emitter()
        self.num_reasoning_tokens = 0

    # --- public interface --------------------------------------------------------------------

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> list[OutputEvent]:
        self._check_usable()
        counts_as_reasoning = self._region is Region.REASONING
        if text:
            if self._gate_ids and token_ids:
                self._note_gated(text, token_ids)
            self._end += len(text)
            try:
                if isinstance(self._pending, Waiting):
                    self._append_waiting(text)
                else:
                    self._buf += text
                    self._run(final=False)
            except ToolParseError as exc:
                raise self._fail(exc) from None
        if counts_as_reasoning:
            self.num_reasoning_tokens += len(token_ids)
        return self._emitter.take()

    def finish(self, *, truncated: bool = False) -> list[OutputEvent]:
        self._check_usable()
        self._finished = True
        try:
            self._join_chunks()
            if truncated and self._pending is not None:
                self._pending = None
                self._consume(len(self._buf))
            else:
                self._run(final=True)
            if self._incomplete and not truncated:
                raise ToolParseError("incomplete tool call at the end of generation")
            self._emitter.boundary()
        except ToolParseError as exc:
            raise self._fail(exc) from None
        return self._emitter.take()

    @property
    def in_reasoning(self) -> bool:
        return self._region is Region.REASONING and self._pending is None and not self._buf

    @property
    def is_tool_call_pending(self) -> bool:
        return self._pending is not None

    @property
    def num_tool_calls(self) -> int:
        return self._num_calls

    # --- the scanner ---------------------------------------------------------------------------

    def _run(self, final: bool) -> None:
        while True:
            if self._pending is not None:
                if not self._resume_pending(final):
                    return
                continue
            buf = self._buf
            if not buf:
                return
            region = self._region
            if region is Region.DONE:
                self._consume(len(buf))
                return
            if region is Region.VERBATIM:
                self._text(buf)
                self._consume(len(buf))
                return
            if region is Region.BLOCK:
                assert self._tools is not None
                skip = _skip_ws(buf, 0)
                if skip:
                    self._consume(skip)
                    continue
                if not self._handle_step(self._parse_envelope(True, final), True, 0, final):
                    return
                continue
            kind, literal, start, hold = self._next_trigger(final)
            if kind is None:
                if hold:
                    self._text(buf[:hold])
                    self._consume(hold)
                return
            if start:
                self._text(buf[:start])
                self._consume(start)
                continue
            if not self._handle_trigger(kind, literal, final):
                return

    def _handle_trigger(self, kind: _Kind, literal: str, final: bool) -> bool:
        if kind is _Kind.TOOL:
            return self._handle_step(self._parse_envelope(False, final), False, len(literal), final)
        self._consume(len(literal))
        self._emitter.boundary()
        if kind is _Kind.OPEN:
            self._region = Region.REASONING
        elif kind is _Kind.CLOSE:
            self._region = Region.CONTENT
            self._reasoning_done = True
        elif kind is _Kind.END:
            self._region = Region.DONE
        return True

    def _handle_step(self, step: Step, in_block: bool, opener_len: int, final: bool) -> bool:
        if isinstance(step, Parsed):
            if step.end <= 0:
                raise ToolParseError("internal: a tool syntax consumed nothing")
            if self._region is Region.REASONING:
                self._reasoning_done = True  # a call ends reasoning (Qwen)
            self._emitter.boundary()
            for call in step.calls:
                self._publish(call)
            self._consume(step.end)
            self._region = step.region
            self._after_call = True
            return True
        if step is NOT_CALL and not in_block:
            self._text(self._buf[:opener_len])
            self._consume(opener_len)
            return True
        if step is NOT_CALL or step is LEAVE_BLOCK:
            self._region = Region.CONTENT
            return True
        assert isinstance(step, _Undecided | Waiting)
        if final:
            self._incomplete = True
            self._consume(len(self._buf))
            return False
        self._pending = step
        self._pending_in_block = in_block
        self._pending_opener_len = opener_len
        if isinstance(step, Waiting):
            if len(self._buf) > MAX_ENVELOPE_CHARS:
                raise ToolParseError("tool call exceeds 8 MiB")
            self._probe = self._buf[len(self._buf) - len(step.closer) + 1 :] if len(step.closer) > 1 else ""
        return False

    def _resume_pending(self, final: bool) -> bool:
        pending = self._pending
        assert pending is not None and self._tools is not None
        if isinstance(pending, Waiting):
            self._join_chunks()
            if not final and self._buf.find(pending.closer, pending.search_from) < 0:
                return False
        self._pending = None
        if isinstance(pending, Waiting):  # already recognized as a call
            parse = self._tools.parse_block if self._pending_in_block else self._tools.parse
            step = parse(self._buf, final)
        else:
            step = self._parse_envelope(self._pending_in_block, final)
        return self._handle_step(step, self._pending_in_block, self._pending_opener_len, final)

    def _parse_envelope(self, in_block: bool, final: bool) -> Step:
        """Parses the envelope at buf[0]. Whether an opener starts a call is decided from its first
        MAX_UNDECIDED_CHARS characters alone, so the outcome never depends on how text was split."""
        assert self._tools is not None
        parse = self._tools.parse_block if in_block else self._tools.parse
        if len(self._buf) > MAX_UNDECIDED_CHARS:
            if parse(self._buf[:MAX_UNDECIDED_CHARS], False) is UNDECIDED:
                return LEAVE_BLOCK if in_block else NOT_CALL
        return parse(self._buf, final)

    def _append_waiting(self, text: str) -> None:
        pending = self._pending
        assert isinstance(pending, Waiting)
        window = self._probe + text
        self._chunks.append(text)
        self._chunks_len += len(text)
        if len(self._buf) + self._chunks_len > MAX_ENVELOPE_CHARS:
            raise ToolParseError("tool call exceeds 8 MiB")
        if pending.closer in window:
            self._join_chunks()
            self._run(final=False)
        else:
            keep = len(pending.closer) - 1
            self._probe = window[len(window) - keep :] if keep > 0 else ""

    def _join_chunks(self) -> None:
        if self._chunks:
            self._buf += "".join(self._chunks)
            self._chunks.clear()
            self._chunks_len = 0

    def _next_trigger(self, final: bool) -> tuple[_Kind | None, str, int, int]:
        buf = self._buf
        best_kind: _Kind | None = None
        best_literal = ""
        best_start = -1
        hold = len(buf)
        for literal, kind in self._active_literals():
            gated = literal in self._gate_ids
            start = self._find_gated(literal) if gated else buf.find(literal)
            if start >= 0 and (
                best_kind is None
                or start < best_start
                or (start == best_start and len(literal) > len(best_literal))
            ):
                best_kind, best_literal, best_start = kind, literal, start
            if not gated and not final:
                hold = min(hold, _partial_suffix(buf, literal))
        if best_kind is not None and best_start < hold:
            return best_kind, best_literal, best_start, hold
        return None, "", -1, hold

    def _active_literals(self) -> list[tuple[str, _Kind]]:
        found: list[tuple[str, _Kind]] = []
        if self._region is Region.REASONING:
            assert self._reasoning is not None
            found.extend((literal, _Kind.CLOSE) for literal in self._reasoning.close)
            if self._tools is not None and self._tool_ends_reasoning:
                found.extend((literal, _Kind.TOOL) for literal in self._tools.openers)
            return found
        if (
            self._reasoning is not None
            and not self._reasoning_done
            and not self._emitter.has_output
            and self._num_calls == 0
        ):
            found.extend((literal, _Kind.OPEN) for literal in self._reasoning.open)
        if self._tools is not None:
            found.extend((literal, _Kind.TOOL) for literal in self._tools.openers)
            if not self._emitter.has_text:
                found.extend((literal, _Kind.TOOL) for literal in self._tools.leading)
            if self._after_call:
                found.extend((literal, _Kind.TRAILING) for literal in self._tools.trailing)
        for literal, action in self._markers.items():
            found.append((literal, _Kind.END if action is MarkerAction.END else _Kind.SWALLOW))
        return found

    # --- gating ----------------------------------------------------------------------------------

    def _note_gated(self, text: str, token_ids: Sequence[int]) -> None:
        ids = list(token_ids)
        for literal, token_id in self._gate_ids.items():
            count = ids.count(token_id)
            pos = text.find(literal)
            while count and pos >= 0:
                self._real[literal].append(self._end + pos)
                count -= 1
                pos = text.find(literal, pos + len(literal))

    def _find_gated(self, literal: str) -> int:
        real = self._real[literal]
        while real and real[0] < self._base:
            real.popleft()
        if real:
            pos = real[0] - self._base
            if pos + len(literal) <= len(self._buf):
                return pos
        return -1

    # --- output --------------------------------------------------------------------------------

    def _text(self, text: str) -> None:
        reasoning = self._region is Region.REASONING
        if self._emitter.text(reasoning, text):
            self._after_call = False
            if self._verbatim_answer and self._region is Region.CONTENT:
                self._region = Region.VERBATIM

    def _publish(self, call: ParsedCall) -> None:
        name = call.name.strip()
        if not name:
            raise ToolParseError("tool call with an empty name")
        arguments = dump_arguments(call.arguments)
        index = self._num_calls
        call_id = call.call_id or self._make_call_id()
        self._emitter.call(ToolCall(id=call_id, name=name, arguments=arguments, index=index))
        self._num_calls += 1

    def _consume(self, count: int) -> None:
        if count:
            self._buf = self._buf[count:]
            self._base += count

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise ToolParseError(self._failed.message)
        if self._finished:
            raise RuntimeError("output parser used after finish()")

    def _fail(self, exc: ToolParseError) -> ToolParseError:
        error = ToolParseError(exc.message, self._emitter.take())
        self._failed = error
        self._pending = None
        return error


class _Kind(enum.Enum):
    OPEN = "open"
    CLOSE = "close"
    TOOL = "tool"
    TRAILING = "trailing"
    SWALLOW = "swallow"
    END = "end"


class _Emitter:
    """Collects deltas, joining adjacent ones, and drops whitespace next to structure."""

    def __init__(self) -> None:
        self._events: list[OutputEvent] = []
        self._ws = ""
        self._reasoning: bool | None = None
        self._at_boundary = True
        self.has_output = False  # answer text or a call was published
        self.has_text = False  # answer text was published

    def text(self, reasoning: bool, text: str) -> bool:
        """Returns True when non-whitespace text was emitted."""
        if not text:
            return False
        if reasoning is not self._reasoning:
            self.boundary()
            self._reasoning = reasoning
        if self._at_boundary:
            text = text.lstrip()
            if not text:
                return False
            self._at_boundary = False
        body = text.rstrip()
        if not body:
            self._ws += text
            return False
        out = self._ws + body
        self._ws = text[len(body) :]
        self._append(ReasoningDelta(out) if reasoning else TextDelta(out))
        if not reasoning:
            self.has_output = True
            self.has_text = True
        return True

    def call(self, event: ToolCall) -> None:
        self.boundary()
        self._events.append(event)
        self.has_output = True

    def boundary(self) -> None:
        self._ws = ""
        self._at_boundary = True

    def take(self) -> list[OutputEvent]:
        events, self._events = self._events, []
        return events

    def _append(self, event: TextDelta | ReasoningDelta) -> None:
        if self._events:
            last = self._events[-1]
            if type(last) is type(event):
                assert isinstance(last, TextDelta | ReasoningDelta)
                self._events[-1] = type(event)(last.text + event.text)
                return
        self._events.append(event)


def _skip_ws(text: str, pos: int, end: int | None = None) -> int:
    stop = len(text) if end is None else end
    while pos < stop and text[pos].isspace():
        pos += 1
    return pos


def _partial_suffix(buf: str, literal: str) -> int:
    """Start of the longest suffix of `buf` that is a proper prefix of `literal`, else len(buf)."""
    size = len(buf)
    first = literal[0]
    lo = max(0, size - len(literal) + 1)
    pos = buf.find(first, lo)
    while pos >= 0:
        if literal.startswith(buf[pos:]):
            return pos
        pos = buf.find(first, pos + 1)
    return size


def skip_ws(text: str, pos: int, end: int | None = None) -> int:
    """Index of the first non-whitespace character at or after `pos` (before `end`)."""
    return _skip_ws(text, pos, end)


def prefix_state(text: str, pos: int, literals: Sequence[str]) -> str:
    """'match' when a literal starts at pos, 'partial' when the rest of text could still start one
    (it is a proper prefix of a literal, including the empty rest), else 'no'."""
    rest_len = len(text) - pos
    partial = False
    for literal in literals:
        if text.startswith(literal, pos):
            return "match"
        if rest_len < len(literal) and literal.startswith(text[pos:]):
            partial = True
    return "partial" if partial else "no"
