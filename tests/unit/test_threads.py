"""The engine's intra-op team follows the cores other processes leave free (helios/engine/threads.py)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from helios.clients.hog import cpu_hogs
from helios.engine.core import EngineThread
from helios.engine.records import EngineStats
from helios.engine.threads import CpuMeter, CpuSample, ThreadGovernor, team_size
from helios.obs.metrics import ServingMetrics

TICKS = os.sysconf("SC_CLK_TCK")


class FakeProc:
    """A /proc with two CPUs whose counters the test advances by hand."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "self").mkdir(parents=True)
        self.busy = [0, 0]
        self.own = 0
        self.now = 0.0
        self.write()

    def write(self) -> None:
        lines = [f"cpu  {sum(self.busy)} 0 0 999 0 0 0 0 0 0"]
        for i, b in enumerate(self.busy):
            # user nice system idle iowait irq softirq steal: split the busy ticks over counted columns,
            # and put noise in idle and iowait, which must not count.
            lines.append(f"cpu{i} {b - b // 2} {b // 4} {b // 2 - b // 4} 5000 700 0 0 0 0 0")
        (self.root / "stat").write_text("\n".join(lines) + "\nintr 1 2 3\nctxt 9\n")
        # comm with a space and a parenthesis: the parser must split after the last ')'
        fields = ["S"] + ["0"] * 10 + [str(self.own - self.own // 3), str(self.own // 3)] + ["0"] * 30
        (self.root / "self" / "stat").write_text(f"1234 (helios (x) y) {' '.join(fields)}\n")

    def advance(self, seconds: float, ours: float, others: float) -> None:
        """``seconds`` of wall time in which we used ``ours`` cores and other processes ``others``."""
        self.now += seconds
        mine = round(ours * seconds * TICKS)
        theirs = round(others * seconds * TICKS)
        self.busy[0] += mine // 2 + theirs // 2
        self.busy[1] += mine - mine // 2 + theirs - theirs // 2
        self.own += mine
        self.write()

    def meter(self) -> CpuMeter:
        return CpuMeter(frozenset({0, 1}), proc=self.root, clock=lambda: self.now)


class SharedProc:
    """A FakeProc whose clock and counters the engine thread reads while the test advances them."""

    def __init__(self, root: Path) -> None:
        self._proc = FakeProc(root)
        self._lock = threading.Lock()
        self._now = 0.0

    def now(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float, ours: float, others: float) -> None:
        with self._lock:
            self._proc.advance(seconds, ours=ours, others=others)
            self._now = self._proc.now

    def meter(self) -> CpuMeter:
        return CpuMeter(frozenset({0, 1}), proc=self._proc.root, clock=self.now)


def test_meter_reads_our_cpus_and_subtracts_our_own_time(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path)
    meter = proc.meter()
    a = meter.sample()
    proc.advance(2.0, ours=1.5, others=0.75)
    b = meter.sample()
    assert a is not None and b is not None
    assert b.own_ticks - a.own_ticks == 3 * TICKS
    assert CpuMeter.others_cores(a, b) == pytest.approx(0.75, abs=2 / TICKS)
    # Only the CPUs in the mask count: CPU 1 alone holds half of everything.
    one = CpuMeter(frozenset({1}), proc=tmp_path, clock=lambda: proc.now).sample()
    assert one is not None and one.busy_ticks == proc.busy[1]
    assert CpuMeter(frozenset({7}), proc=tmp_path).sample() is None
    assert CpuMeter(frozenset({0}), proc=tmp_path / "absent").sample() is None


def test_others_never_negative_and_zero_wall() -> None:
    a = CpuSample(1.0, 100, 0)
    assert CpuMeter.others_cores(a, CpuSample(2.0, 100, 50)) == 0.0
    assert CpuMeter.others_cores(a, CpuSample(1.0, 500, 0)) == 0.0


@pytest.mark.parametrize(("cores", "others", "max_threads", "want"), [
    (2, 0.0, 2, 2), (2, 0.3, 2, 2), (2, 0.45, 2, 1), (2, 1.0, 2, 1), (2, 2.0, 2, 1),
    (8, 1.0, 8, 7), (8, 0.2, 8, 8), (8, 3.9, 8, 4), (8, 0.0, 4, 4), (1, 0.9, 1, 1),
])
def test_team_size(cores: int, others: float, max_threads: int, want: int) -> None:
    assert team_size(cores, others, max_threads) == want


def test_governor_resizes_after_agreeing_windows(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path)
    applied: list[int] = []
    gov = ThreadGovernor(2, meter=proc.meter(), interval_s=0.5, shrink_after=2, grow_after=2,
                         set_threads=applied.append)
    gov.start()
    assert applied == [2] and gov.threads == 2
    proc.advance(0.6, ours=1.5, others=0.9)  # a burst for one busy window
    assert gov.tick() == 2
    proc.advance(0.6, ours=2.0, others=0.0)
    assert gov.tick() == 2
    proc.advance(0.2, ours=1.6, others=0.6)  # a hog shares a core with us
    assert gov.tick() == 2  # inside the window: no reading yet
    proc.advance(0.4, ours=1.6, others=0.6)
    assert gov.tick() == 2  # one window wants fewer
    proc.advance(0.6, ours=1.6, others=0.6)
    assert gov.tick() == 1 and applied == [2, 1]  # the second agrees
    proc.advance(0.6, ours=1.0, others=1.0)  # the hog keeps its core
    assert gov.tick() == 1
    proc.advance(0.6, ours=1.0, others=0.0)  # gone: one window is not enough to grow back
    assert gov.tick() == 1
    proc.advance(0.6, ours=1.0, others=1.0)  # back again: the vote resets
    assert gov.tick() == 1
    proc.advance(0.6, ours=1.0, others=0.05)
    assert gov.tick() == 1
    proc.advance(0.6, ours=1.0, others=0.05)
    assert gov.tick() == 2 and applied == [2, 1, 2]
    snap = gov.snapshot()
    assert (snap.threads, snap.max_threads, snap.adaptive, snap.changes) == (2, 2, True, 2)
    assert snap.others_cores == pytest.approx(0.05, abs=0.02)


def test_idle_windows_weigh_a_twelfth_toward_a_shrink(tmp_path: Path) -> None:
    """A client that works while the engine waits (then sends its request and waits itself) does not
    shrink the team; a hog that keeps running while the engine waits does, after three seconds.
    (As in the engine's loop, each tick says whether the engine has work from then on.)"""
    proc = FakeProc(tmp_path)
    gov = ThreadGovernor(2, meter=proc.meter())
    gov.start()
    assert gov.tick(busy=False) == 2
    for _ in range(5):  # 2.5 s of a client's work at a whole core, the engine waiting
        proc.advance(0.5, ours=0.0, others=1.0)
        assert gov.tick(busy=False) == 2
    assert gov.tick(busy=True) == 2  # its request arrives
    proc.advance(0.5, ours=2.0, others=0.0)  # computed with the whole team, the client waiting
    assert gov.tick(busy=False) == 2
    for _ in range(5):  # the progress toward a shrink started again
        proc.advance(0.5, ours=0.0, others=1.0)
        assert gov.tick(busy=False) == 2
    proc.advance(0.5, ours=0.0, others=1.0)  # the third idle second of a hog
    assert gov.tick(busy=False) == 1 and gov.changes == 1
    proc.advance(0.5, ours=0.0, others=0.0)  # gone
    assert gov.tick(busy=False) == 1
    proc.advance(0.5, ours=0.0, others=0.0)
    assert gov.tick(busy=False) == 2 and gov.changes == 2
    # Idle windows count toward a busy shrink at their weight: 2.4 s idle (0.2 s) + 0.12 s busy
    for _ in range(4):
        proc.advance(0.6, ours=0.0, others=1.0)
        assert gov.tick(busy=False) == 2
    assert gov.tick(busy=True) == 2
    proc.advance(0.12, ours=1.0, others=1.0)
    assert gov.tick(busy=False) == 1 and gov.changes == 3


def test_windows_end_where_the_engine_starts_or_stops_stepping(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path)
    gov = ThreadGovernor(2, meter=proc.meter())
    gov.start()
    proc.advance(0.4, ours=0.0, others=1.0)  # a client works 0.4 s while the engine waits...
    assert gov.tick(busy=True) == 2  # ...and its request arrives: that stretch is an idle window
    proc.advance(0.4, ours=2.0, others=0.0)  # the engine computes, the client waits
    assert gov.tick(busy=False) == 2 and gov.snapshot().others_cores == pytest.approx(0.0, abs=0.03)
    # a stretch shorter than min_window_s is not judged (and not counted in the next one)
    proc.advance(0.05, ours=0.0, others=2.0)
    assert gov.tick(busy=True) == 2
    proc.advance(0.45, ours=2.0, others=0.0)
    assert gov.tick(busy=True) == 2 and gov.snapshot().others_cores == pytest.approx(0.0, abs=0.05)


def test_busy_contention_shrinks_in_a_quarter_second_and_idle_windows_hold_no_grow_back(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path)
    gov = ThreadGovernor(2, meter=proc.meter())
    gov.start()
    assert gov.tick(busy=True) == 2  # the engine has work from the start (no window yet)
    proc.advance(0.15, ours=1.0, others=1.0)
    assert gov.tick(busy=True) == 2  # inside the first interval: no reading yet
    proc.advance(0.15, ours=1.0, others=1.0)
    assert gov.tick(busy=True) == 1 and gov.changes == 1
    proc.advance(0.5, ours=1.0, others=0.0)  # the hog is gone
    assert gov.tick(busy=False) == 1
    proc.advance(0.5, ours=0.0, others=1.0)  # a client's start while the engine waits
    assert gov.tick(busy=True) == 1
    proc.advance(0.5, ours=1.0, others=0.0)
    assert gov.tick(busy=True) == 2 and gov.changes == 2
    proc.advance(0.5, ours=1.0, others=1.0)
    assert gov.tick(busy=True) == 1
    proc.advance(0.5, ours=1.0, others=0.0)
    assert gov.tick(busy=True) == 1
    proc.advance(0.5, ours=1.0, others=1.0)  # a busy window that wants no more starts the count again
    assert gov.tick(busy=True) == 1
    proc.advance(0.5, ours=1.0, others=0.0)
    assert gov.tick(busy=True) == 1 and gov.changes == 3


def test_fixed_team_and_no_proc(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path)
    fixed = ThreadGovernor(2, adaptive=False, meter=proc.meter())
    fixed.start()
    proc.advance(1.0, ours=1.0, others=2.0)
    assert fixed.tick() == 2 and fixed.snapshot().adaptive is False
    blind = ThreadGovernor(2, meter=CpuMeter(frozenset({0, 1}), proc=tmp_path / "absent"))
    blind.start()
    assert blind.adaptive is False and blind.tick() == 2
    with pytest.raises(ValueError, match="at least 1"):
        ThreadGovernor(0)
    with pytest.raises(ValueError, match="at least 1"):
        ThreadGovernor(2, idle_shrink_after=0)


def test_real_proc_sees_a_real_hog() -> None:
    """On this machine's /proc: a busy-looping process shows as about one core of others' load."""
    meter = CpuMeter()
    if meter.sample() is None:
        pytest.skip("no /proc/stat here")
    with cpu_hogs(1):
        time.sleep(0.3)  # the process starts
        a = meter.sample()
        time.sleep(1.0)
        b = meter.sample()
    assert a is not None and b is not None
    assert CpuMeter.others_cores(a, b) > 0.6


class _Scheduler:
    def __init__(self) -> None:
        self.has_work = False
        self.running: list[Any] = []
        self.waiting: list[Any] = []


class _Core:
    """Enough of EngineCore: each step records the torch team size the engine thread runs with."""

    def __init__(self) -> None:
        self.scheduler = _Scheduler()
        self.seen: list[int] = []
        self.stats_threads: list[Any] = []

    def stats(self, threads: Any = None) -> EngineStats:
        self.stats_threads.append(threads)
        return EngineStats(active=0, pending=0, free_pages=0, total_pages=0, page_tokens=16, prefill_tokens=0,
                           generated_tokens=0, threads=threads)

    def close(self) -> None:
        pass

    def add(self, request: Any) -> None:
        self.scheduler.has_work = True

    def run_between_steps(self) -> None:
        pass

    def step(self) -> list[Any]:
        self.seen.append(torch.get_num_threads())
        time.sleep(0.01)
        return []


def test_engine_thread_runs_steps_with_the_governor_team(tmp_path: Path) -> None:
    proc = SharedProc(tmp_path)
    gov = ThreadGovernor(2, meter=proc.meter(), interval_s=0.5, shrink_after=1, grow_after=1,
                         set_threads=torch.set_num_threads)
    core = _Core()
    thread = EngineThread(core, lambda outs: None, governor=gov)  # type: ignore[arg-type]
    thread.start()
    try:
        thread.submit(object())  # type: ignore[arg-type]
        deadline = time.monotonic() + 10
        while not core.seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert core.seen and core.seen[-1] == 2
        proc.advance(1.0, ours=1.0, others=1.0)
        while core.seen[-1] != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert core.seen[-1] == 1
        while (t := thread.stats().threads) is not None and t.threads != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = thread.stats()
        assert stats.threads is not None and stats.threads.threads == 1 and stats.threads.changes == 1
        proc.advance(1.0, ours=1.0, others=0.0)
        while core.seen[-1] != 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert core.seen[-1] == 2
    finally:
        thread.shutdown()


def test_engine_thread_counts_its_waits_as_idle_windows(tmp_path: Path) -> None:
    """The loop tells the governor when it waits: others' load then weighs a twelfth, so a second of it
    leaves the team whole and three seconds shrink it."""
    proc = SharedProc(tmp_path)
    gov = ThreadGovernor(2, meter=proc.meter(), set_threads=torch.set_num_threads)
    core = _Core()
    thread = EngineThread(core, lambda outs: None, governor=gov)  # type: ignore[arg-type]
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while gov._last is None and time.monotonic() < deadline:  # the engine thread's first reading
            time.sleep(0.01)
        time.sleep(0.7)  # past one wait for work (0.5 s), so that the loop has ticked since that reading
        proc.advance(1.0, ours=0.0, others=1.0)
        while gov.snapshot().others_cores < 0.9 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gov.snapshot().others_cores == pytest.approx(1.0, abs=0.05)
        assert gov.snapshot().threads == 2
        proc.advance(2.5, ours=0.0, others=1.0)
        while gov.snapshot().threads != 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gov.snapshot().threads == 1 and not core.seen  # no step ran: the engine waited throughout
    finally:
        thread.shutdown()


def test_metrics_export_the_team() -> None:
    gov = ThreadGovernor(2, adaptive=False)
    stats = EngineStats(active=0, pending=0, free_pages=0, total_pages=0, page_tokens=16, prefill_tokens=0,
                        generated_tokens=0, threads=gov.snapshot())
    metrics = ServingMetrics(lambda: (stats, None))
    text = metrics.prometheus()
    assert "helios_engine_threads 2.0" in text
    assert "helios_engine_threads_max 2.0" in text
    assert "helios_engine_thread_changes_total 0.0" in text
    assert "helios_cpu_others_cores" not in text  # not measured when the team is fixed
