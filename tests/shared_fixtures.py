"""Where the project's shared fixtures are: $HELIOS_SHARED_DIR, or a `shared/` folder beside or above
the repository (CI lays it beside the clone). None when absent; tests that need it skip."""

from __future__ import annotations

import os
from pathlib import Path


def shared_fixtures(subdir: str) -> Path | None:
    """`<shared>/fixtures/<subdir>` if it exists."""
    env = os.environ.get("HELIOS_SHARED_DIR")
    candidates = [Path(env)] if env else []
    candidates += [parent / "shared" for parent in Path(__file__).resolve().parents]
    for shared in candidates:
        if (shared / "fixtures" / subdir).is_dir():
            return shared / "fixtures" / subdir
    return None
