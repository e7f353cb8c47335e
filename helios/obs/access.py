"""The access log: one `helios.access` INFO line per HTTP request, written when it ends.

    127.0.0.1:51234 "POST /v1/chat/completions" 200 id=req-… prompt=23 output=9 ttft=0.412s total=1.033s

After the client address and the quoted request line come the status the app sent and key=value
fields: `id` (the x-request-id response header), `prompt` and `output` (tokens the engine reported
for this request's children), `ttft` (request start to the first generated token of any child) and
`total`; `-` where a value does not apply. Optional trailing keys: `error=<type>` when a started
stream ended in a terminal error event, `disconnected=true` when the client left before the
response was complete.

The app creates one :class:`RequestStats` per request and makes it current (a contextvar, so it
follows the request into the tasks it spawns); the serving pipeline's child streams report engine
output to it, the app records what it sends. The same record feeds the serving metrics
(helios.obs.metrics): its `sink` receives time to first token, inter-token gaps and the first
offered text as they happen, and the app classifies the finished request as completed or failed.
"""

from __future__ import annotations

import contextvars
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any, Protocol

import attrs

from helios.domain.events import FailureKind, OutputEvent, ReasoningDelta, TextDelta

log = logging.getLogger("helios.access")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_current: contextvars.ContextVar[RequestStats | None] = contextvars.ContextVar("helios_request_stats", default=None)


class EngineOutcome(Protocol):
    """What the access record reads of one engine output (the engine's RequestOutput)."""

    @property
    def failure(self) -> FailureKind | None: ...


class OfferedEvents(Protocol):
    """What it reads of the update the output pipeline made of it (serving's ChildUpdate)."""

    @property
    def events(self) -> Sequence[OutputEvent]: ...


class LifecycleSink(Protocol):
    """Where a request's lifecycle timings go as they happen (the app's ServingMetrics)."""

    def time_to_first_token(self, seconds: float) -> None: ...
    def inter_token_latency(self, seconds: float, tokens: int) -> None: ...
    def first_response(self, seconds: float, at: float) -> None: ...


@attrs.define
class RequestStats:
    """What one HTTP request did, filled in while it runs."""

    started: float = attrs.field(factory=time.perf_counter)
    status: int | None = None  # of the http.response.start sent
    request_id: str | None = None  # the x-request-id header sent
    complete: bool = False  # the last body message went out
    disconnected: bool = False  # http.disconnect arrived before the response was complete
    error: str | None = None  # type of a terminal error event in a started stream
    first_token: float | None = None  # perf_counter of the first generated token of any child
    # Prompt tokens per distinct prompt of each generate() call (children of one prompt share it,
    # as usage counts each input once), output tokens per engine child.
    prompts: dict[tuple[int, int], int] = attrs.field(factory=dict)
    outputs: dict[str, int] = attrs.field(factory=dict)
    _generations: int = 0
    # -- for the serving metrics ----------------------------------------------------------------
    sink: LifecycleSink | None = None
    admission_attempted: bool = False  # the route asked for HTTP admission slots
    admitted: float | None = None  # perf_counter when the slots were granted
    first_text: float | None = None  # perf_counter of the first offered answer or reasoning text
    failure: str | None = None  # a failure stage a seam named (execution: the engine failed a child)
    _last_token: dict[str, float] = attrs.field(factory=dict)  # per child: perf_counter of its last token

    @property
    def generations(self) -> int:
        """Service.generate() calls this request made (0: it never reached the engine)."""
        return self._generations

    def new_generation(self) -> int:
        """A key for one Service.generate() call (a request may make several, e.g. decisions)."""
        self._generations += 1
        return self._generations

    def observe(self, prompt_key: tuple[int, int], child_id: str, num_prompt: int, num_output: int,
                new_tokens: bool) -> None:
        """One engine output of a child: cumulative prompt and output counts so far."""
        now = time.perf_counter()
        if new_tokens and self.first_token is None:
            self.first_token = now
            if self.sink is not None:
                self.sink.time_to_first_token(now - self.started)
        if num_prompt:
            self.prompts[prompt_key] = num_prompt
        added = num_output - self.outputs.get(child_id, 0)
        self.outputs[child_id] = num_output
        if new_tokens and added > 0:
            last = self._last_token.get(child_id)
            self._last_token[child_id] = now
            if last is not None and self.sink is not None:
                self.sink.inter_token_latency(now - last, added)

    def observe_update(self, output: EngineOutcome, update: OfferedEvents | None) -> None:
        """What the output pipeline made of one engine output (a RequestOutput and its ChildUpdate):
        an engine failure (its kind names the stage: grammar, else execution), and the first answer
        or reasoning text offered to the client."""
        kind = output.failure
        if kind is not None and self.failure is None:
            self.failure = "grammar" if kind in (FailureKind.GRAMMAR, FailureKind.UNPRODUCIBLE) else "execution"
        if self.first_text is None and update is not None and any(
            isinstance(e, TextDelta | ReasoningDelta) and e.text for e in update.events
        ):
            self.first_text = now = time.perf_counter()
            if self.admitted is not None and self.sink is not None:
                self.sink.first_response(now - self.admitted, now)

    def admission(self, granted: bool) -> None:
        """The route asked for HTTP admission slots; `granted` when it got them."""
        self.admission_attempted = True
        if granted and self.admitted is None:
            self.admitted = time.perf_counter()

    @property
    def prompt_tokens(self) -> int | None:
        return sum(self.prompts.values()) if self.prompts or self.outputs else None

    @property
    def output_tokens(self) -> int | None:
        return sum(self.outputs.values()) if self.outputs else None

    def sent(self, message: dict[str, Any]) -> None:
        """Record an ASGI send message (before it is sent)."""
        kind = message.get("type")
        if kind == "http.response.start":
            self.status = int(message.get("status", 0))
            for k, v in message.get("headers", ()):
                if bytes(k).lower() == b"x-request-id":
                    self.request_id = bytes(v).decode("latin-1")
        elif kind == "http.response.body" and not message.get("more_body", False):
            self.complete = True

    def received(self, message: dict[str, Any]) -> None:
        if message.get("type") == "http.disconnect" and not self.complete:
            self.disconnected = True

    def stream_event(self, data: Any, event: str | None) -> None:
        """Note a terminal error event in the shapes the frontends write them."""
        if not isinstance(data, dict):
            return
        if event in (None, "error"):
            err = data.get("error")  # OpenAI {"error": {...}}, Anthropic {"type": "error", "error": {...}}
            if isinstance(err, dict):
                self.error = str(err.get("type") or err.get("code") or "error")
        elif event == "response.failed":
            resp = data.get("response")
            err = resp.get("error") if isinstance(resp, dict) else None
            self.error = str(err.get("code") or "error") if isinstance(err, dict) else "error"


def current() -> RequestStats | None:
    """The stats record of the request this task serves (None outside a request)."""
    return _current.get()


def activate(stats: RequestStats) -> contextvars.Token[RequestStats | None]:
    return _current.set(stats)


def deactivate(token: contextvars.Token[RequestStats | None]) -> None:
    _current.reset(token)


def note_admission(granted: bool) -> None:
    """A route asks for HTTP admission slots (granted=False first), and got them (granted=True)."""
    stats = _current.get()
    if stats is not None:
        stats.admission(granted)


def note_stream_event(data: Any, event: str | None = None) -> None:
    stats = _current.get()
    if stats is not None:
        stats.stream_event(data, event)


def format_line(stats: RequestStats, scope: dict[str, Any], now: float | None = None) -> str:
    """The access-log line of one request (pure, but for the clock when `now` is None)."""
    end = time.perf_counter() if now is None else now
    client = scope.get("client")
    if client:
        host = str(client[0])
        addr = f"[{host}]:{client[1]}" if ":" in host else f"{host}:{client[1]}"
    else:
        addr = "-"
    raw_path = scope.get("raw_path") or str(scope.get("path", "/")).encode("utf-8")
    target = bytes(raw_path).decode("latin-1")
    query = bytes(scope.get("query_string") or b"")
    if query:
        target += "?" + query.decode("latin-1")
    method = str(scope.get("method", "-"))
    status: int | None = stats.status
    error = stats.error
    if status is None and not stats.disconnected:
        status, error = 500, error or "no_response"  # what the server sends for an app that sent nothing
    fields = [
        addr,
        f'"{_clean(method)} {_clean(target)}"',
        str(status) if status is not None else "-",
        f"id={_token(stats.request_id)}",
        f"prompt={_num(stats.prompt_tokens)}",
        f"output={_num(stats.output_tokens)}",
        f"ttft={_secs(stats.first_token - stats.started if stats.first_token is not None else None)}",
        f"total={_secs(end - stats.started)}",
    ]
    if error:
        fields.append(f"error={_token(error)}")
    if stats.disconnected:
        fields.append("disconnected=true")
    return " ".join(fields)


def _num(n: int | None) -> str:
    return "-" if n is None else str(n)


def _secs(s: float | None) -> str:
    return "-" if s is None else f"{max(s, 0.0):.3f}s"


def _clean(text: str) -> str:
    """Printable ASCII only; quotes, backslashes and everything else escaped (no log injection)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif " " <= ch <= "~":
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(out)


def _token(value: str | None) -> str:
    """A value for key=value: `-` when absent, no spaces."""
    if not value:
        return "-"
    return _clean(value).replace(" ", "_")


def configure(level: str) -> None:
    """Apply `[server] log_level` to Helios's loggers; give them a stderr handler when nothing in
    the process configured logging (plain `hypercorn helios.app:app`), so INFO lines are seen."""
    helios = logging.getLogger("helios")
    helios.setLevel(level.upper())
    if not logging.getLogger().handlers and not helios.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        helios.addHandler(handler)
