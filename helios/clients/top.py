"""`helios top`: a terminal dashboard over ``GET /metrics?format=json``.

Three layers, the first two pure:

* :func:`build_view` turns the polls seen so far (a sequence of :class:`Poll`: a monotonic timestamp
  with either a snapshot dict or an error) into a :class:`View`, the numbers the dashboard shows:
  token rates, their history, KV pages, cache reuse, the first-response median, WEIGHTS and DEPTH;
* :func:`render` turns a :class:`View` into a rich renderable;
* :func:`main` polls the server and redraws with :class:`rich.live.Live`.

Fields absent from a snapshot read as zero, as the spec says of the JSON object. Rates come from the
change in a counter between two consecutive successful polls divided by the time between them; an
interval over which a counter went backwards (the server restarted) has no rates.

WEIGHTS follows the spec's definition of ``decode_weight_bytes`` ("bytes of weights one decode step
reads for one request ... Times verification steps per second it is the weight bandwidth the model
consumes"). The step count used is the change in ``verification_rounds``: that counter counts
progressing decode or verification *request* rounds (zero-draft rounds included), which is the unit
``decode_weight_bytes`` is declared in (one step for one request). ``verify_steps`` is not used: it
counts completed graphs, whatever the number of requests in them, so it would not match a per-request
byte count. When ``verification_rounds`` did not move over the interval (a server without speculative
decoding may export it as zero) the change in ``generated_tokens`` stands in for
it: without speculation each progressing decode round of a request commits exactly one token. It
over-counts slightly, by the one token each request samples at the end of its prefill. The view
records which counter it used (``View.weights_counter``) and the dashboard prints it.

DEPTH is the change in ``verification_drafts`` divided by the change in ``verification_rounds`` over
the sampling window (the latest poll interval), and "-" when there were no rounds in it.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

HISTORY = 60  # rate samples kept for the history plot
CHART_ROWS = 3  # text rows of each braille chart (4 dot rows each)

# Cumulative counters: one going backwards means the server restarted.
_COUNTERS = ("prefill_tokens", "generated_tokens", "reused_tokens", "verification_drafts",
             "verification_rounds", "completed", "failed")


@dataclass(frozen=True)
class Poll:
    """One poll of the metrics route: `snapshot` when it answered, else `error` (and `status`)."""

    t: float  # seconds, monotonic
    snapshot: Mapping[str, Any] | None = None
    error: str | None = None
    status: int | None = None  # the HTTP status of a failed poll, None when there was no answer


@dataclass(frozen=True)
class View:
    state: str  # "waiting" (no poll yet), "ok", "unreachable", "unauthorized" or "error"
    message: str | None  # what went wrong on the latest poll
    stale_seconds: float | None  # age of the numbers shown when the latest poll failed
    has_data: bool  # a snapshot has been seen; the figures below are zero until then
    # per-second rates over the latest interval; None without two consecutive good polls
    prefill_rate: float | None
    decode_rate: float | None
    reused_rate: float | None
    reuse_share: float | None  # Δreused / (Δreused + Δprefill) over the interval
    reuse_share_total: float | None  # reused / (reused + prefill) since server start
    prefill_history: tuple[float | None, ...]  # oldest first, one per interval, None where no rate
    decode_history: tuple[float | None, ...]
    depth: float | None  # Δverification_drafts / Δverification_rounds
    rounds_rate: float | None  # decode steps per second used for WEIGHTS
    weights_counter: str | None  # "verification_rounds" or "generated_tokens"
    weights_bps: float | None  # bytes per second; None when undeclared or without a rate
    decode_weight_bytes: int
    active: int
    pending: int
    pages_used: int
    pages_cached: int
    pages_total: int
    page_tokens: int
    completed: int
    failed: int
    uptime_seconds: int
    first_response_median: float | None
    first_response_samples: int
    first_response_window: float


def _num(snap: Mapping[str, Any] | None, key: str) -> float:
    """A numeric field; absent, null or non-numeric reads as zero."""
    if snap is None:
        return 0
    v = snap.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return 0
    return v


def _int(snap: Mapping[str, Any] | None, key: str) -> int:
    return int(_num(snap, key))


def _restarted(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if _num(b, "uptime_seconds") < _num(a, "uptime_seconds"):
        return True
    return any(_num(b, k) < _num(a, k) for k in _COUNTERS)


@dataclass(frozen=True)
class _Interval:
    dt: float
    a: Mapping[str, Any]
    b: Mapping[str, Any]

    def delta(self, key: str) -> float:
        return _num(self.b, key) - _num(self.a, key)

    def rate(self, key: str) -> float:
        return self.delta(key) / self.dt


def _intervals(polls: Sequence[Poll]) -> list[_Interval | None]:
    """One entry per poll after the first: the interval ending at it, None when there is no rate
    (this poll or the one before failed, the clock did not advance, or the counters were reset)."""
    out: list[_Interval | None] = []
    for prev, cur in itertools.pairwise(polls):
        a, b = prev.snapshot, cur.snapshot
        if a is None or b is None or cur.t <= prev.t or _restarted(a, b):
            out.append(None)
        else:
            out.append(_Interval(cur.t - prev.t, a, b))
    return out


def build_view(polls: Sequence[Poll], history: int = HISTORY) -> View:
    """The dashboard's figures from the polls so far, oldest first (a pure function)."""
    last = polls[-1] if polls else None
    good = [p for p in polls if p.snapshot is not None]
    snap = good[-1].snapshot if good else None
    if last is None:
        state, message, stale = "waiting", None, None
    elif last.snapshot is not None:
        state, message, stale = "ok", None, None
    else:
        if last.status == 401:
            state = "unauthorized"
        elif last.status is None:
            state = "unreachable"
        else:
            state = "error"
        message = last.error
        stale = last.t - good[-1].t if good else None

    intervals = _intervals(polls)
    recent = intervals[-history:]
    prefill_hist = tuple(None if iv is None else iv.rate("prefill_tokens") for iv in recent)
    decode_hist = tuple(None if iv is None else iv.rate("generated_tokens") for iv in recent)
    iv = intervals[-1] if intervals else None

    prefill_rate = decode_rate = reused_rate = reuse_share = None
    depth = rounds_rate = weights = None
    weights_counter = None
    dwb = _int(snap, "decode_weight_bytes")
    if iv is not None:
        prefill_rate = iv.rate("prefill_tokens")
        decode_rate = iv.rate("generated_tokens")
        reused_rate = iv.rate("reused_tokens")
        d_reused, d_prefill = iv.delta("reused_tokens"), iv.delta("prefill_tokens")
        reuse_share = d_reused / (d_reused + d_prefill) if d_reused + d_prefill > 0 else None
        d_rounds = iv.delta("verification_rounds")
        depth = iv.delta("verification_drafts") / d_rounds if d_rounds > 0 else None
        weights_counter = "verification_rounds" if d_rounds > 0 else "generated_tokens"
        rounds_rate = iv.rate(weights_counter)
        weights = dwb * rounds_rate if dwb > 0 else None

    reused_total, prefill_total = _num(snap, "reused_tokens"), _num(snap, "prefill_tokens")
    share_total = reused_total / (reused_total + prefill_total) if reused_total + prefill_total > 0 else None
    fr_raw = snap.get("first_response") if snap is not None else None
    fr: Mapping[str, Any] | None = fr_raw if isinstance(fr_raw, Mapping) else None
    median_raw = fr.get("median_seconds") if fr is not None else None
    median = (float(median_raw) if isinstance(median_raw, int | float) and not isinstance(median_raw, bool)
              else None)
    total_pages = _int(snap, "total_pages")
    return View(
        state=state, message=message, stale_seconds=stale, has_data=snap is not None,
        prefill_rate=prefill_rate, decode_rate=decode_rate, reused_rate=reused_rate,
        reuse_share=reuse_share, reuse_share_total=share_total,
        prefill_history=prefill_hist, decode_history=decode_hist,
        depth=depth, rounds_rate=rounds_rate, weights_counter=weights_counter, weights_bps=weights,
        decode_weight_bytes=dwb,
        active=_int(snap, "active"), pending=_int(snap, "pending"),
        pages_used=max(0, total_pages - _int(snap, "free_pages")), pages_cached=_int(snap, "cached_pages"),
        pages_total=total_pages, page_tokens=_int(snap, "page_tokens"),
        completed=_int(snap, "completed"), failed=_int(snap, "failed"),
        uptime_seconds=_int(snap, "uptime_seconds"),
        first_response_median=median, first_response_samples=_int(fr, "samples"),
        first_response_window=_num(fr, "window_seconds"),
    )


# ---------------------------------------------------------------------------------------- rendering

# Braille dots of one cell, bottom row first: (left column bit, right column bit).
_BRAILLE_ROWS = ((0x40, 0x80), (0x04, 0x20), (0x02, 0x10), (0x01, 0x08))


def braille_chart(values: Sequence[float | None], rows: int = CHART_ROWS, width: int = HISTORY // 2,
                  top: float | None = None) -> list[str]:
    """A bar chart of the last ``2 * width`` values, two per braille cell, ``rows`` cells high.

    Bars grow from the bottom, scaled so `top` (default: the largest value) fills the height; any
    value above zero shows at least one dot, zero and None show none. Missing leading samples are
    blank, so the newest value is always at the right edge. Returns the text rows, top row first."""
    recent: list[float | None] = list(values)[-2 * width:]
    vals: list[float | None] = [None] * (2 * width - len(recent))
    vals.extend(recent)
    peak = top if top is not None else max((v for v in vals if v is not None), default=0.0)
    dots = rows * 4
    heights = []
    for v in vals:
        if v is None or v <= 0 or peak <= 0:
            heights.append(0)
        else:
            heights.append(max(1, min(dots, math.ceil(v / peak * dots))))
    lines = []
    for r in range(rows):  # r = 0 is the top text row
        base = (rows - 1 - r) * 4  # dot rows below this cell
        cells = []
        for c in range(width):
            code = 0
            for side in (0, 1):
                h = heights[2 * c + side] - base
                for i in range(min(max(h, 0), 4)):
                    code |= _BRAILLE_ROWS[i][side]
            cells.append(chr(0x2800 + code))
        lines.append("".join(cells))
    return lines


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _bytes(v: float, suffix: str = "") -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(v) < 1000 or unit == "TB":
            return f"{v:,.0f} {unit}{suffix}" if unit == "B" else f"{v:,.2f} {unit}{suffix}"
        v /= 1000
    raise AssertionError  # pragma: no cover


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _history_row(name: str, rate: float | None, hist: Sequence[float | None], style: str) -> Table:
    peak = max((v for v in hist if v is not None), default=0.0)
    chart = braille_chart(hist)
    t = Table.grid(padding=(0, 2))
    t.add_column(width=16)
    t.add_column(justify="right", width=12)
    t.add_column()
    t.add_column()
    for i, line in enumerate(chart):
        label = Text(name, style="bold") if i == 0 else Text("")
        now = Text(f"{_rate(rate)} tok/s") if i == 0 else Text("")
        side = Text(f"max {peak:,.1f}") if i == 0 else (Text("0", style="dim") if i == len(chart) - 1 else Text(""))
        t.add_row(label, now, Text(line, style=style), side)
    return t


def render(view: View, url: str = "") -> RenderableType:
    """The dashboard for one :class:`View`."""
    status_style = {"ok": "green", "waiting": "yellow"}.get(view.state, "bold red")
    status = Text(view.state, style=status_style)
    if view.state not in ("ok", "waiting"):
        if view.message:
            status.append(f": {view.message}", style="red")
        if view.stale_seconds is not None:
            status.append(f" (figures from {view.stale_seconds:.0f} s ago)", style="dim")
    head = Text.assemble(("helios top", "bold"), "  ", url, "  ")
    if view.has_data:
        head.append(f"uptime {_duration(view.uptime_seconds)}  ")
    head.append_text(status)

    kv = Table.grid(padding=(0, 2))
    kv.add_column(width=16, style="bold")
    kv.add_column()
    kv.add_row("requests", f"active {view.active}  pending {view.pending}  "
                           f"completed {view.completed:,}  failed {view.failed:,}")
    used_pct = f" ({100 * view.pages_used / view.pages_total:.1f}%)" if view.pages_total else ""
    kv.add_row("KV pages", f"used {view.pages_used:,} / {view.pages_total:,}{used_pct}  "
                           f"cached {view.pages_cached:,}  ({view.page_tokens} tokens a page)")
    kv.add_row("cache reuse", f"{_rate(view.reused_rate)} tok/s  share {_pct(view.reuse_share)} now, "
                              f"{_pct(view.reuse_share_total)} since start")
    if view.first_response_median is None:
        median = "-"
    else:
        median = f"{view.first_response_median:.3f} s"
    window = f"{view.first_response_window:g} s" if view.first_response_window else "-"
    kv.add_row("first response", f"median {median}  samples {view.first_response_samples}  window {window}")
    if view.weights_bps is not None:
        weights = (f"{_bytes(view.weights_bps, '/s')}  = {_bytes(view.decode_weight_bytes)} "
                   f"x {_rate(view.rounds_rate)} {view.weights_counter}/s")
    elif view.has_data and view.decode_weight_bytes == 0:
        weights = "-  (decode_weight_bytes undeclared)"
    else:
        weights = "-"
    kv.add_row("WEIGHTS", weights)
    kv.add_row("DEPTH", "-" if view.depth is None else f"{view.depth:.2f}")

    body = Group(
        head,
        Text(""),
        _history_row("prefill", view.prefill_rate, view.prefill_history, "cyan"),
        _history_row("decode", view.decode_rate, view.decode_history, "magenta"),
        Text(""),
        kv,
    )
    return Panel(body, title="Helios", title_align="left", border_style=status_style.split()[-1])


# --------------------------------------------------------------------------------------------- CLI


def poll_once(client: Any, url: str, headers: Mapping[str, str], now: float | None = None) -> Poll:
    """GET the JSON snapshot; never raises for transport or HTTP failures."""
    import httpx

    try:
        r = client.get(url.rstrip("/") + "/metrics", params={"format": "json"}, headers=dict(headers))
    except httpx.HTTPError as exc:
        return Poll(time.monotonic() if now is None else now, error=f"{type(exc).__name__}: {exc}" if str(exc)
                    else type(exc).__name__)
    t = time.monotonic() if now is None else now
    if r.status_code == 401:
        hint = "the server wants a key: pass --api-key-file" if "authorization" not in {
            k.lower() for k in headers} else "the key was refused"
        return Poll(t, error=f"HTTP 401, {hint}", status=401)
    if r.status_code != 200:
        return Poll(t, error=f"HTTP {r.status_code}", status=r.status_code)
    try:
        data = r.json()
    except ValueError:
        return Poll(t, error="the answer is not JSON", status=r.status_code)
    if not isinstance(data, dict):
        return Poll(t, error="the answer is not a JSON object", status=r.status_code)
    return Poll(t, snapshot=data)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="helios top", description="live dashboard of a Helios server")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between polls (default 1.0)")
    parser.add_argument("--api-key-file", default=None,
                        help="file holding a key to send as a bearer token (/metrics normally needs none)")
    args = parser.parse_args(argv)
    if not args.interval > 0:
        parser.error("--interval must be positive")
    headers: dict[str, str] = {}
    if args.api_key_file:
        from helios.config import ConfigError, read_api_key_file

        try:
            headers["Authorization"] = f"Bearer {read_api_key_file(args.api_key_file)}"
        except ConfigError as exc:
            print(f"helios top: {exc}", file=sys.stderr)
            return 2

    import logging

    import httpx
    from rich.live import Live

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line a poll would tear the display

    polls: deque[Poll] = deque(maxlen=HISTORY + 1)
    timeout = min(5.0, max(1.0, args.interval))
    with httpx.Client(timeout=timeout) as client, Live(render(build_view([]), args.url), auto_refresh=False,
                                                        screen=False) as live:
        try:
            while True:
                started = time.monotonic()
                polls.append(poll_once(client, args.url, headers))
                live.update(render(build_view(list(polls)), args.url), refresh=True)
                time.sleep(max(0.0, args.interval - (time.monotonic() - started)))
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
