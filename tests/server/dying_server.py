"""`helios serve` whose engine thread dies on demand: once the file named by $HELIOS_TEST_DEATH_FLAG
exists, the next engine step raises a BaseException that no handler in the engine loop catches (as
a fatal fault would), so the thread dies mid-generation. Used by tests/server/test_shutdown.py.

    python -m tests.server.dying_server serve --config helios.toml
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from helios.cli import main
from helios.engine import core


class InjectedDeath(BaseException):
    """Not an Exception: the engine loop's per-step handler does not catch it."""


def _install(flag: Path) -> None:
    step = core.EngineCore.step

    def dying_step(self: core.EngineCore) -> object:
        if flag.exists():
            raise InjectedDeath("injected by the test")
        return step(self)

    core.EngineCore.step = dying_step  # type: ignore[assignment,method-assign]


if __name__ == "__main__":
    _install(Path(os.environ["HELIOS_TEST_DEATH_FLAG"]))
    sys.exit(main(sys.argv[1:]))
