"""thinking_token_budget (api.md, "Reasoning, sampling, and usage") on all three chat protocols,
buffered and streamed, through the real SDKs against a scripted model (harness.py), for both Qwen
families: a prompt-opened <think> (qwen3_coder, Qwen3.5 template) and a model-opened one (qwen3).

The scripted model emits its script by position whatever was committed before, so a script whose
token N (counted after the opener) is a throwaway `Z` shows the forced close exactly there: the
budget's close replaces `Z`, and what follows is answer text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import attrs
import httpx
import pytest

from helios.app import HeliosApp
from helios.serving.service_factory import make_service
from tests.serving.harness import (
    FAMILIES,
    ScriptBook,
    ScriptedServer,
    pieces,
    runtime_factory,
    serving_config,
)
from tests.serving.protocols import FINISH, PROTOCOLS, Ask, Outcome, run

BUDGET = 5
REASONING = "abcde"  # BUDGET one-token pieces
ANSWER = "Done."


def _id(server: ScriptedServer, text: str) -> int:
    tid = server.tok.token_to_id(text)
    assert tid is not None
    return tid


def _opener(server: ScriptedServer) -> list[int]:
    """What the model writes before its reasoning: nothing where the prompt opened it."""
    return [] if server.family.name == "qwen3_coder" else [_id(server, "<think>")]


def _cuts(server: ScriptedServer) -> int:
    return int(httpx.get(server.url + "/metrics", params={"format": "json"}).json()["reasoning_budget_cuts"])


class Case:
    def __init__(self, server: ScriptedServer, protocol: str, stream: bool) -> None:
        self.server = server
        self.protocol = protocol
        self.stream = stream

    def script(self, *parts: str | list[int]) -> str:
        return self.server.book.add(*parts)

    def ask(self, key: str, **kw: Any) -> Outcome:
        return run(self.server, self.protocol, Ask(f"Think briefly. {key}", tools=(), **kw), stream=self.stream)

    def ok(self, out: Outcome) -> None:
        assert out.error is None, out.error
        assert out.terminated and out.finish == FINISH["stop"][self.protocol]

    def num_output_tokens(self, key: str) -> int:
        return len(self.server.book.script(key)) + 1  # the script (one token forced), then EOS


@pytest.fixture(params=("qwen3", "qwen3_coder"))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=PROTOCOLS)
def protocol(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=[False, True], ids=["buffered", "streamed"])
def stream(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture
def case(servers: dict[str, ScriptedServer], family: str, protocol: str, stream: bool) -> Case:
    return Case(servers[family], protocol, stream)


def _cut_script(case: Case) -> str:
    return case.script(_opener(case.server), pieces(case.server.tok, REASONING + "Z" + ANSWER))


# -- the cut ----------------------------------------------------------------------------------------


def test_budget_cuts_reasoning_exactly_at_n_tokens(case: Case) -> None:
    key = _cut_script(case)
    before = _cuts(case.server)
    out = case.ask(key, budget=BUDGET)
    case.ok(out)
    assert out.reasoning == REASONING  # N reasoning tokens, then the close
    assert out.text == ANSWER  # the close replaced the N+1-th token (Z); generation went on
    # Usage: the forced close is a generated token, and the parser counts it as reasoning's last.
    assert out.output_tokens == case.num_output_tokens(key)
    if case.protocol != "messages":
        assert out.reasoning_tokens == BUDGET + 1
    assert _cuts(case.server) == before + 1


def test_messages_thinking_budget_tokens_cut_too(servers: dict[str, ScriptedServer], family: str,
                                                  stream: bool) -> None:
    case = Case(servers[family], "messages", stream)
    key = _cut_script(case)
    out = case.ask(key, budget=BUDGET, budget_field="budget_tokens")
    case.ok(out)
    assert (out.reasoning, out.text) == (REASONING, ANSWER)
    assert out.output_tokens == case.num_output_tokens(key)


def test_without_a_budget_nothing_is_cut(case: Case) -> None:
    key = _cut_script(case)
    before = _cuts(case.server)
    out = case.ask(key)
    case.ok(out)
    assert out.reasoning == REASONING + "Z" + ANSWER and out.text == ""
    assert _cuts(case.server) == before


def test_no_cut_when_reasoning_closed_earlier(case: Case) -> None:
    tok = case.server.tok
    answer = "The answer is longer than the budget."
    key = case.script(_opener(case.server), pieces(tok, "abc"), [_id(case.server, "</think>")], pieces(tok, answer))
    before = _cuts(case.server)
    out = case.ask(key, budget=BUDGET)
    case.ok(out)
    assert (out.reasoning, out.text) == ("abc", answer)
    assert out.output_tokens == case.num_output_tokens(key)
    assert _cuts(case.server) == before


def test_no_cut_when_output_starts_in_content(case: Case) -> None:
    """Reasoning disabled: the prompt closes it (Qwen3.5), or the model's first token is answer
    text (Qwen3): the budget is accepted and never cuts."""
    answer = "Plain answer text, much longer than the budget."
    key = case.script(pieces(case.server.tok, answer))
    before = _cuts(case.server)
    out = case.ask(key, budget=2, thinking=False)
    case.ok(out)
    assert (out.reasoning, out.text) == ("", answer)
    assert out.output_tokens == case.num_output_tokens(key)
    assert _cuts(case.server) == before


# -- logprobs ---------------------------------------------------------------------------------------


def _chat_body(key: str, stream: bool) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": f"Think. {key}"}], "max_tokens": 64,
            "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True, "return_token_ids": True,
            "thinking_token_budget": BUDGET, "stream": stream}


def _sse(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])


@pytest.mark.parametrize("family", ["qwen3", "qwen3_coder"])
@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
def test_chat_logprobs_omit_the_forced_close(servers: dict[str, ScriptedServer], family: str, stream: bool) -> None:
    server = servers[family]
    key = server.book.add(_opener(server), pieces(server.tok, REASONING + "Z" + ANSWER))
    close = _id(server, "</think>")
    body = _chat_body(key, stream)
    if stream:
        entries: list[dict[str, Any]] = []
        token_ids: list[int] = []
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for chunk in _sse(r):
                for ch in chunk["choices"]:
                    entries += (ch.get("logprobs") or {}).get("content") or []
                    token_ids += ch.get("token_ids") or []
    else:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        entries, token_ids = choice["logprobs"]["content"], choice["token_ids"]
    script = list(server.book.script(key))
    expected = [*script[: len(_opener(server)) + BUDGET], close, *script[len(_opener(server)) + BUDGET + 1:]]
    assert token_ids[:-1] == expected  # every generated token, the forced close included, then EOS
    logged = [int(e["token"].removeprefix("token_id:")) for e in entries]
    # One entry per generated token except the forced close (and the terminating EOS, as always).
    assert logged == [t for i, t in enumerate(expected) if i != len(_opener(server)) + BUDGET]
    assert close not in logged


# -- validation -------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_explicit_budget_on_a_model_without_reasoning_syntax_is_400(servers: dict[str, ScriptedServer],
                                                                    protocol: str) -> None:
    server = servers["smollm2"]
    key = server.book.add(pieces(server.tok, "Hello."))
    out = run(server, protocol, Ask(f"Hi {key}", tools=(), budget=100), stream=False)
    assert out.error_status == 400 and out.error is not None and "thinking_token_budget" in out.error
    if protocol != "messages":
        assert out.raw is None


def test_messages_budget_tokens_are_advisory_without_reasoning_syntax(servers: dict[str, ScriptedServer]) -> None:
    server = servers["smollm2"]
    key = server.book.add(pieces(server.tok, "Hello."))
    out = run(server, "messages", Ask(f"Hi {key}", tools=(), budget=2000, budget_field="budget_tokens"), stream=False)
    assert out.error is None and out.text == "Hello."


@pytest.mark.parametrize("route,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "thinking_token_budget": 0}),
    ("/v1/responses", {"input": "x", "thinking_token_budget": 2**31}),
    ("/v1/completions", {"prompt": "x", "thinking_token_budget": 10}),
])
def test_bad_or_refused_budgets_name_the_field(servers: dict[str, ScriptedServer], route: str,
                                               body: dict[str, Any]) -> None:
    r = httpx.post(servers["qwen3_coder"].url + route, json={"model": "m", **body}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "thinking_token_budget"


# -- the [server] default ---------------------------------------------------------------------------


def _runtime(family: str, budget: int | None) -> Any:
    book = ScriptBook(ScriptedServer(FAMILIES[family]).tok)
    cfg = serving_config()
    cfg = attrs.evolve(cfg, server=attrs.evolve(cfg.server, thinking_token_budget=budget))
    return runtime_factory(FAMILIES[family], book)(cfg)


def test_startup_refuses_a_default_on_a_model_without_reasoning_syntax(servers: dict[str, ScriptedServer]) -> None:
    assert servers  # the shared fixtures exist (templates)
    with pytest.raises(ValueError, match="thinking_token_budget"):
        make_service(_runtime("smollm2", 100))
    for family in ("qwen3", "qwen3_coder"):  # a prompt-opened or a single-token model-opened <think>
        assert make_service(_runtime(family, 100)).info.thinking_token_budget == 100


@pytest.fixture(scope="module")
def default_server(servers: dict[str, ScriptedServer]) -> Iterator[ScriptedServer]:
    assert servers
    server = ScriptedServer(FAMILIES["qwen3_coder"])
    cfg = serving_config()
    cfg = attrs.evolve(cfg, server=attrs.evolve(cfg.server, thinking_token_budget=BUDGET))
    server.app = HeliosApp(cfg, runtime_factory=runtime_factory(server.family, server.book))
    server.start()
    yield server
    server.stop()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_server_default_applies_when_the_request_gives_none(default_server: ScriptedServer, protocol: str) -> None:
    server = default_server
    key = server.book.add(pieces(server.tok, REASONING + "Z" + ANSWER))
    out = run(server, protocol, Ask(f"Think. {key}", tools=()), stream=False)
    assert out.error is None, out.error
    assert (out.reasoning, out.text) == (REASONING, ANSWER)
    # An explicit budget wins over the default.
    out = run(server, protocol, Ask(f"Think. {key}", tools=(), budget=50), stream=False)
    assert out.error is None, out.error
    assert out.reasoning == REASONING + "Z" + ANSWER and out.text == ""
    models = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert models["flare"]["thinking_token_budget"] == BUDGET
