"""Speculative decoding on a real server: the default model (float32) with `[speculative] mode =
"adaptive"` and depth 6 answers an editing-style greedy request (repeat a source file) with the same
tokens and logprobs as a server with `mode = "off"`, drafts were verified and accepted (/metrics), and
the model cards say what is active (the main server runs the default, adaptive)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.server.conftest import EXTERNAL, MAIN_TOML, LiveServer, start_server, stop_server

pytestmark = pytest.mark.skipif(bool(EXTERNAL), reason="compares two local servers")

SOURCE = '''def area(width, height):
    """The area of a rectangle."""
    return width * height


def perimeter(width, height):
    """The perimeter of a rectangle."""
    return 2 * (width + height)


def describe(width, height):
    return f"{width} x {height}: area {area(width, height)}, perimeter {perimeter(width, height)}"
'''

MESSAGES = [{"role": "user", "content": f"Repeat this file exactly, with no other text:\n\n{SOURCE}"}]


@pytest.fixture(scope="module")
def speculative(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    toml = MAIN_TOML + '[speculative]\nmode = "adaptive"\nmax_depth = 6\n'
    s = start_server(tmp_path_factory.mktemp("spec"), toml, "speculative")
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    s = start_server(tmp_path_factory.mktemp("nospec"), MAIN_TOML + '[speculative]\nmode = "off"\n', "no-speculation")
    yield s
    stop_server(s)


def answer(server: LiveServer) -> Any:
    return server.openai().chat.completions.create(model="smol", messages=MESSAGES, temperature=0, max_tokens=96,
                                                   logprobs=True, top_logprobs=2)


def test_speculation_gives_the_same_greedy_answer_over_http(server: LiveServer, speculative: LiveServer,
                                                            plain: LiveServer) -> None:
    with speculative.http() as http:
        card = http.get("/v1/models").json()["data"][0]["flare"]["speculative"]
        before = http.get("/metrics?format=json").json()
    assert card["mode"] == "adaptive" and card["max_depth"] == 6 and card["proposers"] == ["ngram", "history"]
    assert card["history_drafts"] is True
    want = answer(plain)
    got = answer(speculative)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage.completion_tokens == want.usage.completion_tokens
    have_lp, want_lp = got.choices[0].logprobs.content, want.choices[0].logprobs.content
    assert [t.token for t in have_lp] == [t.token for t in want_lp]
    assert all(abs(a.logprob - b.logprob) <= 1e-4 for a, b in zip(have_lp, want_lp, strict=True))
    with speculative.http() as http:
        after = http.get("/metrics?format=json").json()
    accepted = after["accepted_drafts"] - before["accepted_drafts"]
    rounds = after["verification_rounds"] - before["verification_rounds"]
    assert accepted > 0 and after["verify_steps"] > before["verify_steps"]
    # Every committed token after the first came from a decode or verification round.
    assert rounds + accepted == got.usage.completion_tokens - 1
    with plain.http() as http:
        assert http.get("/v1/models").json()["data"][0]["flare"]["speculative"]["mode"] == "off"
    with server.http() as http:  # the default
        assert http.get("/v1/models").json()["data"][0]["flare"]["speculative"]["mode"] == "adaptive"
