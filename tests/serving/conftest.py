"""Scripted-model servers, one per model family, started once per session (see harness.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.serving.harness import FAMILIES, TEMPLATES, ScriptedServer


@pytest.fixture(scope="session")
def servers() -> Iterator[dict[str, ScriptedServer]]:
    if TEMPLATES is None:
        pytest.skip("shared/fixtures/chat_templates not found (shared/ lies beside the repository)")
    started: dict[str, ScriptedServer] = {}

    class Lazy(dict[str, ScriptedServer]):
        def __missing__(self, name: str) -> ScriptedServer:
            server = started[name] = ScriptedServer(FAMILIES[name]).start()
            self[name] = server
            return server

    yield Lazy()
    for server in started.values():
        server.stop()


@pytest.fixture(scope="session")
def qwen3(servers: dict[str, ScriptedServer]) -> ScriptedServer:
    return servers["qwen3"]


@pytest.fixture(scope="session")
def coder(servers: dict[str, ScriptedServer]) -> ScriptedServer:
    return servers["qwen3_coder"]
