"""The CI-sized soak (issue 10, item 7): about 45 s of seeded mixed load against a live Helios on a
small configuration; tests/server/soak.py holds the load, the checks and the pass criteria, and
`nox -s soak` runs the long version."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.server.conftest import EXTERNAL
from tests.server.soak import (
    Malformed,
    Plan,
    SoakOptions,
    check_messages_stream,
    check_openai_stream,
    check_responses_stream,
    run_soak,
)


@pytest.mark.slow
@pytest.mark.skipif(bool(EXTERNAL), reason="starts its own small server")
def test_soak_ci(tmp_path: Path) -> None:
    report = run_soak(tmp_path, SoakOptions(duration=45.0))
    print(report.summary())
    assert not report.problems(), report.summary()
    # The load did what it claims: bursts went past the admission limit (429s, all with
    # Retry-After), streams were cut mid-way, paused readers read to the end, every protocol
    # completed requests both buffered and streamed.
    assert report.count("429") > 0
    assert report.count("disconnected") > 0
    assert any(r.reader == "pause" and r.outcome == "ok" for r in report.results)
    for protocol in ("chat", "completions", "messages", "responses"):
        for streamed in (False, True):
            assert any(r.protocol == protocol and (r.reader != "buffered") == streamed and r.outcome == "ok"
                       for r in report.results), (protocol, streamed)
    assert report.log_tracebacks == 0


# -- the checks themselves catch what they claim to (no server) ------------------------------------


def _plan(protocol: str, **kw: object) -> Plan:
    p = Plan(protocol, True, "full", {}, choices=1, max_tokens=2, logprobs=False)
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def _chunk(i: int, text: str, finish: str | None = None) -> tuple[None, str]:
    return None, json.dumps({"id": "c", "object": "chat.completion.chunk",
                             "choices": [{"index": i, "delta": {"content": text}, "finish_reason": finish}]})


def test_openai_stream_check() -> None:
    plan = _plan("chat", choices=2)
    good = [_chunk(0, "a"), _chunk(1, "b"), _chunk(0, "c", "length"), _chunk(1, "", "stop"), (None, "[DONE]")]
    check_openai_stream(plan, good)
    for bad in (good[:-1],  # no [DONE]
                [*good[:2], _chunk(0, "c", "length"), (None, "[DONE]")],  # choice 1 never finishes
                [*good[:3], _chunk(0, "late"), *good[3:]],  # a choice continues after its finish
                [(None, "{not json"), *good]):
        with pytest.raises((Malformed, ValueError)):
            check_openai_stream(plan, bad)


def _ev(kind: str, **data: object) -> tuple[str, str]:
    return kind, json.dumps({"type": kind, **data})


def test_messages_stream_check() -> None:
    good = [_ev("message_start", message={}), _ev("content_block_start", index=0), _ev("ping"),
            _ev("content_block_delta", index=0), _ev("content_block_stop", index=0),
            _ev("message_delta", delta={"stop_reason": "max_tokens"}), _ev("message_stop")]
    check_messages_stream(_plan("messages"), good)
    for bad in (good[1:], good[:-1], [good[0], *good[2:]], [*good[:4], *good[5:]],
                [("message_start", json.dumps({"type": "ping"})), *good[1:]]):
        with pytest.raises(Malformed):
            check_messages_stream(_plan("messages"), bad)


def test_responses_stream_check() -> None:
    kinds = ("response.created", "response.in_progress", "response.output_text.delta", "response.incomplete")
    good = [_ev(k, sequence_number=i) for i, k in enumerate(kinds)]
    check_responses_stream(_plan("responses"), good)
    swapped = [good[0], good[2], good[1], good[3]]
    for bad in (good[:-1], swapped, good[1:], [*good, _ev("response.completed", sequence_number=9)]):
        with pytest.raises(Malformed):
            check_responses_stream(_plan("responses"), bad)
