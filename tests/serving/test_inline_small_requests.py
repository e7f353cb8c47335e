"""Small requests are prepared on the event loop (`http.context.INLINE_BODY_BYTES`): through a real
socket, a chat request or a completion whose JSON body is under 4 KiB is rendered and tokenized on
the server's trio thread, a larger one on a frontend pool worker; both answer the same way."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from helios.http.context import INLINE_BODY_BYTES
from tests.serving.harness import ScriptedServer


def _record_threads(server: ScriptedServer, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads the served model's tokenizer encodes prompts on, from now on (the
    scripted model's own encoding on the engine thread left out)."""
    tokenizer = server.service.tokenizer
    encode: Callable[..., Any] = tokenizer.encode
    seen: list[str] = []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        name = threading.current_thread().name
        if name != "helios-engine":
            seen.append(name)
        return encode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", recorded)
    return seen


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_small_bodies_are_prepared_on_the_event_loop(qwen3: ScriptedServer, monkeypatch: pytest.MonkeyPatch,
                                                     route: str) -> None:
    seen = _record_threads(qwen3, monkeypatch)
    loop = qwen3._thread.name if qwen3._thread is not None else ""
    assert loop.startswith("hypercorn-")
    answers = []
    with httpx.Client(base_url=qwen3.url, timeout=60) as client:
        for words in (8, INLINE_BODY_BYTES // 4):  # a short text, then ~5 KiB of it
            text = " ".join(["word"] * words)
            if route == "chat":
                body = {"model": "scripted", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
                r = client.post("/v1/chat/completions", json=body)
            else:
                body = {"model": "scripted", "prompt": text, "max_tokens": 4}
                r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            answers.append(r.json()["usage"])
    assert len(seen) == 2, seen
    assert seen[0] == loop  # under 4 KiB: on the event loop
    assert seen[1] != loop and not seen[1].startswith("hypercorn-")  # over: a frontend pool worker
    assert answers[0]["completion_tokens"] == answers[1]["completion_tokens"] > 0
    assert answers[1]["prompt_tokens"] > answers[0]["prompt_tokens"]
