"""The CI-sized soak (issue 10, item 7): about 45 s of seeded mixed load against a live Helios on a
small configuration; tests/server/soak.py holds the load, the checks and the pass criteria, and
`nox -s soak` runs the long version."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server.conftest import EXTERNAL
from tests.server.soak import SoakOptions, run_soak

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(EXTERNAL), reason="starts its own small server")]


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
