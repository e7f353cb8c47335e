"""CPU hogs beside a benchmark: ``helios bench --hog N`` runs N busy-looping processes for the whole
run, so a figure "with one core taken" can be measured again the same way (issue: speed under CPU
contention; engine/threads.py is what it exercises).

Each hog is a separate Python process spinning in a loop (no syscalls, no memory traffic): the
load a compiler, a test run or a browser tab at full tilt puts on one core. The processes are
started before the first request and killed when the run ends, whatever way it ends."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

_SPIN = "while True:\n    pass\n"


@contextlib.contextmanager
def cpu_hogs(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` busy-looping processes for the duration of the block (none when 0)."""
    if count < 0:
        raise ValueError(f"the hog count must be at least 0, got {count}")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(count):
            procs.append(subprocess.Popen([sys.executable, "-c", _SPIN], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
