"""What clients rely on from the first request: over-context errors in each API's own words, the
default model's short name, and HEAD probes of the base URL.

Claude Code retries with a smaller `max_tokens` when it reads Anthropic's "input length and
`max_tokens` exceed context limit: X + Y > Z"; OpenAI clients key on `context_length_exceeded`.
The `limited` server has a 512-token context.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import LiveServer

LONG = "word " * 700  # well over 512 tokens
ANTHROPIC_OUTPUT = re.compile(r"^input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+), ")
ANTHROPIC_INPUT = re.compile(r"^prompt is too long: (\d+) tokens > (\d+) maximum$")


def _openai_error(exc: pytest.ExceptionInfo[openai.BadRequestError]) -> dict[str, object]:
    body = exc.value.body
    assert isinstance(body, dict)
    return body.get("error", body)  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("field", "param"), [("max_tokens", "max_tokens"), ("max_completion_tokens", "max_completion_tokens")]
)
def test_chat_output_over_context(limited: LiveServer, field: str, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        limited.openai().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], **{field: 32000}  # type: ignore[arg-type]
        )
    assert exc.value.status_code == 400
    err = _openai_error(exc)
    assert err["code"] == "context_length_exceeded" and err["param"] == param
    assert err["type"] == "invalid_request_error"
    assert "maximum context length is 512 tokens" in str(err["message"]) and "32000 output tokens" in str(err["message"])


def test_chat_input_over_context(limited: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        limited.openai().chat.completions.create(model="m", messages=[{"role": "user", "content": LONG}], max_tokens=5)
    err = _openai_error(exc)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert "input tokens" in str(err["message"])


def _over_context_param(call: Callable[[], object]) -> object:
    """The `param` of the context_length_exceeded 400 that `call` raises."""
    with pytest.raises(openai.BadRequestError) as exc:
        call()
    err = _openai_error(exc)
    assert err["code"] == "context_length_exceeded"
    return err["param"]


def test_completions_params(limited: LiveServer) -> None:
    client = limited.openai()
    assert _over_context_param(lambda: client.completions.create(model="m", prompt=LONG, max_tokens=5)) == "prompt"
    assert _over_context_param(
        lambda: client.completions.create(model="m", prompt="hi", max_tokens=5000)) == "max_tokens"


def test_responses_params(limited: LiveServer) -> None:
    client = limited.openai()
    assert _over_context_param(
        lambda: client.responses.create(model="m", input=LONG, max_output_tokens=16)) == "input"
    assert _over_context_param(
        lambda: client.responses.create(model="m", input="hi", max_output_tokens=32000, stream=True)
    ) == "max_output_tokens"


def test_messages_output_over_context_in_anthropic_words_and_recoverable(limited: LiveServer) -> None:
    """Claude Code's recovery: read X + Y > Z back, retry with max_tokens = Z - X; that succeeds."""
    client = limited.anthropic()
    msgs = [{"role": "user", "content": "Say hello."}]
    # The SDK refuses a buffered max_tokens whose worst case exceeds ten minutes; Claude Code streams.
    for stream, wanted in ((False, 20000), (True, 32000)):
        with pytest.raises(anthropic.BadRequestError) as exc:
            if stream:
                with client.messages.stream(model="m", max_tokens=wanted, messages=msgs) as s:  # type: ignore[arg-type]
                    s.get_final_message()
            else:
                client.messages.create(model="m", max_tokens=wanted, messages=msgs)  # type: ignore[arg-type]
        assert exc.value.status_code == 400
        body = exc.value.body
        assert isinstance(body, dict) and body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        m = ANTHROPIC_OUTPUT.match(body["error"]["message"])
        assert m, body["error"]["message"]
        prompt, asked, limit = map(int, m.groups())
        assert (asked, limit) == (wanted, 512)
        counted = client.messages.count_tokens(model="m", messages=msgs)  # type: ignore[arg-type]
        assert prompt == counted.input_tokens
    reply = client.messages.create(model="m", max_tokens=limit - prompt, messages=msgs)  # type: ignore[arg-type]
    assert reply.type == "message"
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == prompt  # a repeat may hit the cache


def test_messages_input_over_context(limited: LiveServer) -> None:
    with pytest.raises(anthropic.BadRequestError) as exc:
        limited.anthropic().messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": LONG}])
    body = exc.value.body
    assert isinstance(body, dict)
    m = ANTHROPIC_INPUT.match(body["error"]["message"])
    assert m, body["error"]["message"]
    assert int(m.group(1)) > 512 and int(m.group(2)) == 512


# -- the default model's short name ---------------------------------------------------------------


def test_default_model_answers_to_smol_without_configured_aliases(limited: LiveServer) -> None:
    """The `limited` server configures no alias; the README's `smol` still works everywhere."""
    with limited.http() as http:
        listed = http.get("/v1/models").json()["data"]
        assert [m["id"] for m in listed] == ["smol"]
        card = http.get("/v1/models/smol")
        assert card.status_code == 200 and card.json()["root"] == "SmolLM2-135M-Instruct.Q4_1"
        assert http.get("/v1/models/SmolLM2-135M-Instruct.Q4_1").json()["id"] == "smol"
        show = http.post("/api/show", json={"model": "smol"})
        assert show.status_code == 200
        assert [t["name"] for t in http.get("/api/tags").json()["models"]] == ["smol"]


# -- HEAD probes ------------------------------------------------------------------------------------


def test_head_answers_every_get_route_without_a_body(limited: LiveServer) -> None:
    """Claude Code sends `HEAD /` to its base URL before the first turn."""
    with limited.http() as http:
        root = http.get("/")
        assert root.status_code == 200 and root.json()["name"] == "helios"
        head = http.head("/")
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-length"] == root.headers["content-length"]
        models = http.get("/v1/models")
        head = http.head("/v1/models")
        assert head.status_code == 200 and head.content == b""
        assert head.headers["content-length"] == str(len(models.content))
        assert http.head("/nope").status_code == 404
        assert http.head("/v1/chat/completions").status_code == 405
    # The base URL is unauthenticated, like /health; the model list is not. Claude Code 2.1 also
    # preconnects with HEAD /api/hello.
    assert httpx.head(limited.url + "/").status_code == 200
    hello = httpx.head(limited.url + "/api/hello")
    assert hello.status_code == 200 and hello.content == b""
    assert httpx.head(limited.url + "/v1/models").status_code == 401
