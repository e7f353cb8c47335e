"""Fuzz invariant for logprob request shapes against a live server: a request whose logprob options are
valid gets HTTP 200 with a complete response (buffered or streamed), an invalid one gets HTTP 400 in its
protocol's error shape, and nothing ever gets a 500 or hangs.

Options are drawn from valid values, out-of-range values and wrong types for every logprob field of
Chat Completions, Completions, Responses and Messages; `expected_*` state the spec's rules, so the
test also fails when a valid shape is refused.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import LiveServer, server  # noqa: F401  (the live server fixture)

pytestmark = pytest.mark.slow

VOCAB = 49152
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
ABSENT = object()

wrong_type = st.sampled_from(["3", 1.5, [1], {"a": 1}])
counts = st.integers(min_value=-2, max_value=22)
maybe_count = st.one_of(st.just(ABSENT), st.none(), counts, counts, wrong_type, st.booleans())
flags = st.one_of(st.just(ABSENT), st.none(), st.booleans(), st.booleans(), st.sampled_from(["yes", 1]))
token_ids = st.integers(min_value=-2, max_value=VOCAB + 1)
id_lists = st.one_of(
    st.just(ABSENT), st.none(), st.just([]),
    st.lists(st.integers(min_value=0, max_value=VOCAB - 1), min_size=1, max_size=6),
    st.lists(token_ids, min_size=1, max_size=6),
    st.integers(min_value=126, max_value=131).map(lambda n: [i % 50 for i in range(n)]),
    st.sampled_from(["1,2", [1.5], [True], [None]]),
)


def _body(base: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {**base, **{k: v for k, v in fields.items() if v is not ABSENT}}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _given(v: Any) -> bool:
    return v is not ABSENT and v is not None


def _ids_ok(v: Any) -> bool | None:
    """None: no explicit ids (absent, null or empty); True/False: a valid/invalid nonempty selection."""
    if v is ABSENT or v is None:
        return None
    if not isinstance(v, list):
        return False
    if not v:
        return None
    return len(v) <= 128 and all(_is_int(i) and 0 <= i < VOCAB for i in v)


def _count_ok(v: Any, low: int = 0, high: int = 20) -> bool:
    return not _given(v) or (_is_int(v) and low <= v <= high)


def _flag_ok(v: Any) -> bool:
    return not _given(v) or isinstance(v, bool)


def expected_chat(f: dict[str, Any]) -> int:
    logprobs, top, ids, prompt = f["logprobs"], f["top_logprobs"], f["logprob_token_ids"], f["prompt_logprobs"]
    if not (_flag_ok(logprobs) and _flag_ok(f["return_tokens_as_token_ids"]) and _count_ok(top)
            and _count_ok(prompt)):
        return 400
    enabled = logprobs is True
    if _given(top) and top > 0 and not enabled:
        return 400
    explicit = _ids_ok(ids)
    if explicit is False or (explicit and not enabled):
        return 400
    if _given(prompt) and f["stream"]:
        return 400
    return 200


def expected_completion(f: dict[str, Any]) -> int:
    logprobs, ids, prompt = f["logprobs"], f["logprob_token_ids"], f["prompt_logprobs"]
    if not (_count_ok(logprobs) and _count_ok(prompt) and _flag_ok(f["echo"])
            and _flag_ok(f["return_tokens_as_token_ids"])):
        return 400
    explicit = _ids_ok(ids)
    if explicit is False or (explicit and not _given(logprobs)):
        return 400
    if _given(prompt) and f["stream"]:
        return 400
    return 200


def expected_responses(f: dict[str, Any]) -> int:
    include, top, ids = f["include"], f["top_logprobs"], f["logprob_token_ids"]
    if _given(f["prompt_logprobs"]):
        return 400
    if include is not ABSENT and include is not None and not (
            isinstance(include, list) and all(isinstance(x, str) for x in include)):
        return 400
    if not (_count_ok(top) and _flag_ok(f["return_tokens_as_token_ids"])):
        return 400
    enabled = isinstance(include, list) and "message.output_text.logprobs" in include
    if _given(top) and top > 0 and not enabled:
        return 400
    explicit = _ids_ok(ids)
    if explicit is False or (explicit and not enabled):
        return 400
    return 200


def _send(live: LiveServer, path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
          ) -> tuple[int, str]:
    with live.http() as client:
        r = client.post(path, json=body, headers=headers or {})
        return r.status_code, r.text


def _check_openai(status: int, text: str, expected: int, body: dict[str, Any]) -> None:
    assert status != 500 and status == expected, (body, status, text[:500])
    if status == 400:
        err = json.loads(text)["error"]
        assert set(err) == {"type", "message", "param", "code"} and err["type"] == "invalid_request_error"
    elif body.get("stream"):
        failed = 'data: {"error"' in text or "event: error" in text or "response.failed" in text
        assert not failed and ("[DONE]" in text or "response.completed" in text
                                          or "response.incomplete" in text), text[-500:]


@FUZZ
@given(logprobs=flags, top_logprobs=maybe_count, logprob_token_ids=id_lists, prompt_logprobs=maybe_count,
       return_tokens_as_token_ids=flags, stream=st.booleans())
def test_chat_logprob_shapes(server: LiveServer, **f: Any) -> None:  # noqa: F811
    body = _body({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, **f)
    status, text = _send(server, "/v1/chat/completions", body)
    _check_openai(status, text, expected_chat(f), body)
    if status == 200 and not f["stream"]:
        result = json.loads(text)
        lp = result["choices"][0]["logprobs"]
        assert (lp is not None) == (f["logprobs"] is True)
        if lp is not None:
            assert len(lp["content"]) <= 2
        assert (result["prompt_logprobs"] is not None) == _given(f["prompt_logprobs"])


@FUZZ
@given(logprobs=maybe_count, echo=flags, logprob_token_ids=id_lists, prompt_logprobs=maybe_count,
       return_tokens_as_token_ids=flags, stream=st.booleans(), max_tokens=st.integers(min_value=0, max_value=2))
def test_completion_logprob_shapes(server: LiveServer, **f: Any) -> None:  # noqa: F811
    body = _body({"prompt": "Hello there"}, **f)
    status, text = _send(server, "/v1/completions", body)
    _check_openai(status, text, expected_completion(f), body)
    if status == 200 and not f["stream"]:
        choice = json.loads(text)["choices"][0]
        if _given(f["logprobs"]):
            arrays = choice["logprobs"]
            assert len({len(arrays[k]) for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}) == 1
        if _given(f["prompt_logprobs"]) or (f["echo"] is True and _given(f["logprobs"])):
            assert choice["prompt_logprobs"][0] is None


@FUZZ
@given(include=st.one_of(st.just(ABSENT), st.none(), st.just([]), st.just(["message.output_text.logprobs"]),
                         st.just(["reasoning.encrypted_content"]), st.just("message.output_text.logprobs")),
       top_logprobs=maybe_count, logprob_token_ids=id_lists, prompt_logprobs=maybe_count,
       return_tokens_as_token_ids=flags, stream=st.booleans())
def test_responses_logprob_shapes(server: LiveServer, **f: Any) -> None:  # noqa: F811
    body = _body({"input": "Hi", "max_output_tokens": 2}, **f)
    status, text = _send(server, "/v1/responses", body)
    _check_openai(status, text, expected_responses(f), body)


@FUZZ
@given(field=st.sampled_from(["logprobs", "top_logprobs", "return_tokens_as_token_ids", "logprob_token_ids",
                              "prompt_logprobs", None]),
       value=st.one_of(st.booleans(), st.integers(min_value=-1, max_value=21), st.just([1, 2]), st.none()))
def test_messages_reject_logprob_fields(server: LiveServer, field: str | None, value: Any) -> None:  # noqa: F811
    body: dict[str, Any] = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    if field is not None:
        body[field] = value
    status, text = _send(server, "/v1/messages", body, {"anthropic-version": "2023-06-01"})
    assert status == (200 if field is None else 400), (body, status, text[:300])
    if status == 400:
        err = json.loads(text)
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
