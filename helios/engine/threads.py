"""The engine thread's intra-op team, sized to the cores other processes leave free.

Helios runs where its clients run: beside a coding agent, an editor and a browser. A step is a few
hundred parallel regions (every linear layer, attention, the norms), each split evenly over the
team and ended by a barrier. When another process takes one of the team's cores, the thread that
shares it runs only part of the time, and every region waits at its barrier for that thread's
next time slice: on 2 cores with one busy-looping process, one 128-token greedy request of the
default model took 5.6-6.7x its quiet time, where losing one of two cores should cost at most 2x.
A smaller team that fits the free cores does not wait for anybody.

`CpuMeter` reads, from /proc, the busy time of the CPUs this process may run on and the process's
own CPU time; what is left is the other processes' load on our cores (steal time counts as
taken). `ThreadGovernor` turns one measurement window into a team size:

    free  = cores - others                   (others: cores' worth of the others' load)
    want  = clamp(floor(free + 0.4), 1, max_threads)

so a thread is dropped once others take more than 0.4 of a core per dropped thread (a process
using a whole core, or a steady 40% share that would stall every barrier that often), and a quiet
machine keeps the whole team.

A window is a stretch in which the engine was either stepping (busy) or waiting for work (idle): it
ends after ``interval_s`` or where the engine starts or stops stepping, and a stretch shorter than
``min_window_s`` is not judged. A change waits for windows that agree, counted in seconds of them:

- a shrink, for ``shrink_after`` intervals of busy windows that want fewer threads, an idle window
  counting ``shrink_after / idle_shrink_after`` of its length (quarter-second intervals, 1 and 12: a
  quarter second of contention while the engine computes, three seconds while it waits). Contention
  matters while the engine computes; what other processes do while it waits is a weak sign of it,
  since a client typically works, sends its request, then waits for the answer. Counted like busy
  ones (every half-second window alike, two of them to shrink), the benchmark client's own start
  (Python imports, about 0.3 s of CPU while the server waits) shrinks a quiet two-core server's team
  before its measured request: 5 of 24 runs took 293-312 ms for a 512-token prompt instead of 162-182
  (2026-12-06, the Zen 5 VM; docs/operations.md, "CPU contention"). A late shrink costs more than a
  wrong one (a step that waits at every barrier for a descheduled thread runs several times slower;
  half the team, at most twice), hence a quarter second while busy.
- a grow, for ``grow_after`` intervals of windows that want more threads (4: a hog that pauses for
  less than a second does not make the team oscillate); a busy window that does not want more starts
  the count again, an idle one does not (a client's start while the engine waits would hold a smaller
  team back).

A hog that keeps running while the engine waits still shrinks the team before the next request.
The engine's own threads (HTTP, tokenization) count as ours, not as others.

Where /proc is absent (not Linux) the meter reads nothing and the team keeps its configured size.
The governor is engine-thread state: `tick` is called before each step and while waiting, saying
whether the engine has work; `torch.set_num_threads` is called on the engine thread only (OpenMP's
team size is a per-thread setting).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import attrs

# /proc/stat's per-CPU columns: user nice system idle iowait irq softirq steal guest guest_nice.
# Busy: all but idle and iowait (guest time is already inside user and nice).
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@attrs.frozen
class CpuSample:
    wall: float
    """time.monotonic() at the read."""
    busy_ticks: int
    """Busy clock ticks of the measured CPUs, every process together."""
    own_ticks: int
    """This process's user + system clock ticks (every thread)."""


class CpuMeter:
    """Reads the load other processes put on this process's CPUs."""

    def __init__(self, cpus: frozenset[int] | None = None, proc: Path = Path("/proc"),
                 clock: Callable[[], float] = time.monotonic) -> None:
        if cpus is None:
            cpus = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
        self.cpus = cpus
        self._proc = proc
        self._clock = clock

    def sample(self) -> CpuSample | None:
        """One reading, or None where /proc cannot be read (or lists none of our CPUs)."""
        try:
            stat = (self._proc / "stat").read_text()
            own = (self._proc / "self" / "stat").read_text()
        except OSError:
            return None
        busy = 0
        seen = 0
        for line in stat.splitlines():
            if not line.startswith("cpu") or line.startswith("cpu "):
                continue
            name, *cols = line.split()
            try:
                cpu = int(name[3:])
            except ValueError:
                continue
            if cpu not in self.cpus:
                continue
            values = [int(c) for c in cols]
            busy += sum(values[i] for i in _BUSY_COLUMNS if i < len(values))
            seen += 1
        if not seen:
            return None
        # /proc/self/stat: "pid (comm) state ..."; comm may hold spaces and parentheses, so split
        # after the last ')'. utime and stime are fields 14 and 15 (1-based), 12 and 13 after it.
        fields = own[own.rindex(")") + 2 :].split()
        return CpuSample(self._clock(), busy, int(fields[11]) + int(fields[12]))

    @staticmethod
    def others_cores(before: CpuSample, after: CpuSample) -> float:
        """Cores' worth of CPU time other processes used between two samples (never negative)."""
        wall = after.wall - before.wall
        if wall <= 0:
            return 0.0
        ticks = (after.busy_ticks - before.busy_ticks) - (after.own_ticks - before.own_ticks)
        return max(0.0, ticks / _CLOCK_TICKS / wall)


@attrs.frozen
class ThreadStats:
    threads: int
    """The engine's intra-op team size now."""
    max_threads: int
    """The configured size (``[model] threads``, all cores when 0)."""
    adaptive: bool
    """``[model] adapt_threads``: the team follows the free cores."""
    changes: int
    """Team size changes so far."""
    others_cores: float
    """Other processes' load on our cores in the last window, in cores."""


def team_size(cores: int, others: float, max_threads: int) -> int:
    """The team for ``cores`` CPUs of which ``others`` cores' worth are taken by other processes."""
    return max(1, min(max_threads, math.floor(cores - others + 0.4)))


class ThreadGovernor:
    """Decides the engine's intra-op team size between steps (see the module docstring)."""

    def __init__(self, max_threads: int, *, adaptive: bool = True, meter: CpuMeter | None = None,
                 interval_s: float = 0.25, shrink_after: int = 1, grow_after: int = 4,
                 idle_shrink_after: int = 12, min_window_s: float = 0.1,
                 set_threads: Callable[[int], None] | None = None) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be at least 1, got {max_threads}")
        if min(shrink_after, grow_after, idle_shrink_after) < 1:
            raise ValueError("shrink_after, grow_after and idle_shrink_after must be at least 1")
        self.max_threads = max_threads
        self.meter = meter if meter is not None else (CpuMeter() if adaptive else None)
        self.adaptive = adaptive and self.meter is not None and bool(self.meter.cpus)
        self.interval_s = interval_s
        self.shrink_after = shrink_after
        self.grow_after = grow_after
        self.idle_shrink_after = idle_shrink_after
        self.min_window_s = min_window_s
        self._set_threads = set_threads
        self.threads = max_threads
        self.changes = 0
        self.others = 0.0
        self._last: CpuSample | None = None
        self._busy = False  # whether the engine has been stepping since the last reading
        self._shrink_s = 0.0  # seconds of windows that want fewer threads (idle ones weighed less)
        self._grow_s = 0.0  # seconds of windows that want more

    def start(self) -> None:
        """Apply the configured size (on the engine thread) and take the first reading."""
        self._apply(self.max_threads)
        if self.adaptive:
            assert self.meter is not None
            self._last = self.meter.sample()
            if self._last is None:
                self.adaptive = False

    def tick(self, busy: bool = True) -> int:
        """Called before each step (``busy``) and while the engine waits for work (not ``busy``): at
        the end of a window, resize the team to the free cores. Returns the team size the step runs
        with."""
        if not self.adaptive:
            return self.threads
        assert self.meter is not None
        last = self._last
        was_busy = self._busy
        flip = last is not None and busy != was_busy
        if last is not None and not flip and self.meter._clock() - last.wall < self.interval_s:
            return self.threads
        sample = self.meter.sample()
        if sample is None:
            return self.threads
        self._last = sample
        self._busy = busy
        if last is None or sample.wall - last.wall < self.min_window_s:
            return self.threads
        self._judge(CpuMeter.others_cores(last, sample), sample.wall - last.wall, was_busy)
        return self.threads

    def _judge(self, others: float, wall: float, busy: bool) -> None:
        """One window of ``wall`` seconds, the engine ``busy`` or waiting, others taking ``others`` cores."""
        assert self.meter is not None
        self.others = others
        want = team_size(len(self.meter.cpus), others, self.max_threads)
        if busy and want <= self.threads:
            self._grow_s = 0.0  # (an idle window does not hold a grow back: see the module docstring)
        if want < self.threads:
            self._shrink_s += wall if busy else wall * self.shrink_after / self.idle_shrink_after
            if self._shrink_s >= self.shrink_after * self.interval_s * (1 - 1e-9):
                self._apply(want)
        elif want > self.threads:
            self._shrink_s = 0.0
            self._grow_s += wall
            if self._grow_s >= self.grow_after * self.interval_s * (1 - 1e-9):
                self._apply(want)
        else:
            self._shrink_s = 0.0

    def _apply(self, threads: int) -> None:
        self._grow_s = self._shrink_s = 0.0
        if threads != self.threads:
            self.changes += 1
        self.threads = threads
        if self._set_threads is not None:
            self._set_threads(threads)

    def snapshot(self) -> ThreadStats:
        return ThreadStats(self.threads, self.max_threads, self.adaptive, self.changes, round(self.others, 3))
