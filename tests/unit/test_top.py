"""`helios top`: the view model from a hand-written series of snapshots, and its rendering."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
from rich.console import Console

from helios import cli
from helios.clients.top import Poll, braille_chart, build_view, poll_once, render


def _snap(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "prefill_tokens": 0, "generated_tokens": 0, "reused_tokens": 0, "verification_drafts": 0,
        "verification_rounds": 0, "total_pages": 1000, "free_pages": 1000, "cached_pages": 0,
        "page_tokens": 16, "decode_weight_bytes": 1_000_000, "active": 0, "pending": 0, "completed": 0,
        "failed": 0, "uptime_seconds": 10,
        "first_response": {"median_seconds": None, "samples": 0, "window_seconds": 60, "capacity": 0,
                           "truncated": False},
    }
    base.update(fields)
    return base


# Deltas by interval:        t=0→1        t=1→2          t=2→4 (2 s)
#   prefill_tokens           +500         +0             +400  (200/s)
#   generated_tokens         +20          +40            +40   (20/s)
#   reused_tokens            +100         +0             +400  (200/s)
#   verification_drafts      +0           +30            +0
#   verification_rounds      absent (0)   +10            +0
_S1 = _snap(prefill_tokens=500, generated_tokens=20, reused_tokens=100, free_pages=960, cached_pages=8,
            active=2, pending=1, uptime_seconds=11)
del _S1["verification_rounds"]  # absent reads as zero
SERIES = [
    Poll(0.0, _snap()),
    Poll(1.0, _S1),
    Poll(2.0, _snap(prefill_tokens=500, generated_tokens=60, reused_tokens=100, verification_drafts=30,
                    verification_rounds=10, free_pages=950, cached_pages=8, active=2, uptime_seconds=12)),
    Poll(4.0, _snap(prefill_tokens=900, generated_tokens=100, reused_tokens=500, verification_drafts=30,
                    verification_rounds=10, free_pages=900, cached_pages=40, active=1, pending=0, completed=3,
                    failed=1, uptime_seconds=14,
                    first_response={"median_seconds": 0.25, "samples": 3, "window_seconds": 60, "capacity": 1024,
                                    "truncated": False})),
]


def _text(view: Any, url: str = "http://h:1") -> str:
    console = Console(record=True, width=100)
    console.print(render(view, url))
    return console.export_text()


def test_rates_and_history() -> None:
    v = build_view(SERIES)
    assert v.state == "ok" and v.message is None
    assert v.prefill_rate == pytest.approx(200.0)
    assert v.decode_rate == pytest.approx(20.0)
    assert v.reused_rate == pytest.approx(200.0)
    assert v.reuse_share == pytest.approx(0.5)  # 400 / (400 + 400)
    assert v.reuse_share_total == pytest.approx(500 / 1400)
    assert v.prefill_history == pytest.approx((500.0, 0.0, 200.0))
    assert v.decode_history == pytest.approx((20.0, 40.0, 20.0))


def test_pages_requests_and_first_response() -> None:
    v = build_view(SERIES)
    assert (v.pages_used, v.pages_cached, v.pages_total, v.page_tokens) == (100, 40, 1000, 16)
    assert (v.active, v.pending, v.completed, v.failed, v.uptime_seconds) == (1, 0, 3, 1, 14)
    assert (v.first_response_median, v.first_response_samples, v.first_response_window) == (0.25, 3, 60)


def test_depth_and_weights_per_interval() -> None:
    # t=0→1: no verification rounds (the field is even absent): DEPTH "-", WEIGHTS from generated tokens
    v = build_view(SERIES[:2])
    assert v.depth is None
    assert v.weights_counter == "generated_tokens"
    assert v.weights_bps == pytest.approx(1_000_000 * 20)
    # t=1→2: 30 drafts over 10 rounds; WEIGHTS from the 10 rounds/s, not the 40 generated tokens/s
    v = build_view(SERIES[:3])
    assert v.depth == pytest.approx(3.0)
    assert v.weights_counter == "verification_rounds"
    assert v.rounds_rate == pytest.approx(10.0)
    assert v.weights_bps == pytest.approx(1_000_000 * 10)
    # t=2→4: rounds did not move again
    v = build_view(SERIES)
    assert v.depth is None
    assert v.weights_counter == "generated_tokens"
    assert v.weights_bps == pytest.approx(1_000_000 * 20)


def test_rendered_numbers() -> None:
    text = _text(build_view(SERIES))
    for expected in ("http://h:1", "ok", "uptime 0:00:14", "200.0 tok/s", "20.0 tok/s", "max 500.0",
                     "max 40.0", "active 1  pending 0  completed 3  failed 1",
                     "used 100 / 1,000 (10.0%)  cached 40  (16 tokens a page)",
                     "share 50.0% now, 35.7% since start", "median 0.250 s  samples 3  window 60 s",
                     "20.00 MB/s  = 1.00 MB x 20.0 generated_tokens/s"):
        assert expected in text, (expected, text)
    assert re.search(r"DEPTH +- ", text)
    text = _text(build_view(SERIES[:3]))
    assert re.search(r"DEPTH +3\.00 ", text)
    assert "10.00 MB/s  = 1.00 MB x 10.0 verification_rounds/s" in text
    assert "40.0 tok/s" in text


def test_absent_fields_read_as_zero() -> None:
    v = build_view([Poll(0.0, {}), Poll(1.0, {"generated_tokens": 5})])
    assert v.state == "ok"
    assert v.decode_rate == 5.0 and v.prefill_rate == 0.0
    assert v.reuse_share is None and v.depth is None
    assert v.weights_bps is None  # decode_weight_bytes absent: undeclared
    assert (v.pages_used, v.pages_total, v.first_response_median, v.first_response_samples) == (0, 0, None, 0)
    text = _text(v)
    assert "median -  samples 0  window -" in text
    assert "(decode_weight_bytes undeclared)" in text


def test_unreachable_keeps_the_last_figures() -> None:
    polls = [*SERIES, Poll(5.5, error="ConnectError: [Errno 111] Connection refused")]
    v = build_view(polls)
    assert v.state == "unreachable"
    assert v.stale_seconds == pytest.approx(1.5)
    assert v.prefill_rate is None and v.decode_rate is None and v.depth is None and v.weights_bps is None
    assert v.pages_used == 100 and v.completed == 3
    assert v.prefill_history == pytest.approx((500.0, 0.0, 200.0, None))
    text = _text(v)
    assert "unreachable: ConnectError" in text
    assert "used 100 / 1,000" in text
    # back again: rates resume from the next pair of good polls
    v = build_view([*polls, Poll(6.5, _snap(prefill_tokens=1000)), Poll(7.5, _snap(prefill_tokens=1100))])
    assert v.state == "ok" and v.prefill_rate == pytest.approx(100.0)


def test_never_reached() -> None:
    v = build_view([Poll(0.0, error="ConnectError"), Poll(1.0, error="ConnectError")])
    assert v.state == "unreachable" and not v.has_data and v.stale_seconds is None
    text = _text(v)
    assert "unreachable: ConnectError" in text and "uptime" not in text
    assert build_view([]).state == "waiting"
    assert "waiting" in _text(build_view([]))


def test_restart_gives_no_rate() -> None:
    v = build_view([Poll(0.0, _snap(generated_tokens=500, uptime_seconds=100)),
                    Poll(1.0, _snap(generated_tokens=3, uptime_seconds=1))])
    assert v.decode_rate is None and v.decode_history == (None,)


def test_poll_once_statuses() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/metrics" and request.url.params["format"] == "json"
        if request.headers.get("authorization") == "Bearer good":
            return httpx.Response(200, json={"generated_tokens": 7})
        return httpx.Response(401, json={"error": {"message": "no"}})

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        p = poll_once(client, "http://x/", {"Authorization": "Bearer good"}, now=1.0)
        assert p.snapshot == {"generated_tokens": 7} and p.t == 1.0
        p = poll_once(client, "http://x", {}, now=2.0)
    assert p.status == 401 and p.snapshot is None and "--api-key-file" in (p.error or "")
    v = build_view([p])
    assert v.state == "unauthorized"
    assert "unauthorized: HTTP 401" in _text(v)


def test_poll_once_connection_refused() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("Connection refused", request=request)

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        p = poll_once(client, "http://x", {}, now=3.0)
    assert p.status is None and p.error == "ConnectError: Connection refused"
    assert build_view([p]).state == "unreachable"


def test_braille_chart() -> None:
    # heights 0, 4, 8, 12 dots out of 12: two cells, three rows
    assert braille_chart([0, 4, 8, 12], rows=3, width=2, top=12) == ["\u2800\u28b8", "\u2800\u28ff", "\u28b8\u28ff"]
    # fewer samples than the width: blank on the left, newest at the right; tiny values show one dot
    assert braille_chart([0.001, None], rows=1, width=2, top=100) == ["\u2800\u2840"]
    assert braille_chart([], rows=2, width=3) == ["\u2800" * 3] * 2


def test_cli_dispatch(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["top", "--help"])
    assert exc.value.code == 0
    assert "--api-key-file" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["top", "--interval", "0"])
