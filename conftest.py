"""Test-wide settings. Under CI, hypothesis replays a fixed example sequence (derandomize) so that a
submission's result never depends on which examples a run happened to draw; local runs explore."""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")
