"""ASGI plumbing: errors, routing, auth, admission, Accept, responses, disconnects, lifespan."""

from __future__ import annotations

import json

import pytest
import trio
import trio.testing

from helios.asgi.accept import parse_accept, prefers_json
from helios.asgi.admission import AdmissionSlots
from helios.asgi.auth import check_anthropic, check_bearer
from helios.asgi.request import Headers, Request
from helios.asgi.responses import SSEWriter, format_event, send_json, send_text
from helios.asgi.routing import Router
from helios.asgi.types import Message
from helios.errors import (
    BadRequest,
    HeliosError,
    InternalError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    ServiceUnavailable,
    TooManyRequests,
    Unauthorized,
    UnprocessableEntity,
    UnsupportedMediaType,
)


def _headers(*pairs: tuple[str, str]) -> Headers:
    return Headers.from_raw([(k.encode(), v.encode()) for k, v in pairs])


class _Sent:
    """Collects ASGI messages sent by the code under test."""

    def __init__(self) -> None:
        self.messages: list[Message] = []

    async def __call__(self, message: Message) -> None:
        self.messages.append(message)

    @property
    def start(self) -> Message:
        return self.messages[0]

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.start["headers"])

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:])


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "status", "openai", "anthropic"),
    [
        (BadRequest, 400, "invalid_request_error", "invalid_request_error"),
        (Unauthorized, 401, "authentication_error", "authentication_error"),
        (NotFound, 404, "invalid_request_error", "not_found_error"),
        (PayloadTooLarge, 413, "request_too_large", "request_too_large"),
        (UnsupportedMediaType, 415, "invalid_request_error", "invalid_request_error"),
        (UnprocessableEntity, 422, "invalid_request_error", "invalid_request_error"),
        (TooManyRequests, 429, "rate_limit_error", "rate_limit_error"),
        (InternalError, 500, "server_error", "api_error"),
        (ServiceUnavailable, 503, "server_error", "api_error"),
        (HeliosError, 500, "server_error", "api_error"),
    ],
)
def test_error_shapes(cls: type[HeliosError], status: int, openai: str, anthropic: str) -> None:
    err = cls("boom")
    assert err.status == status
    assert err.to_openai() == {"error": {"type": openai, "message": "boom", "param": None, "code": err.code}}
    assert err.to_anthropic() == {"type": "error", "error": {"type": anthropic, "message": "boom"}}
    assert err.to_ollama() == {"error": "boom"}
    assert str(err) == "boom"


def test_error_param_code_and_model_not_found() -> None:
    err = BadRequest("bad top_k", param="top_k", code="invalid_type")
    assert err.to_openai()["error"] == {
        "type": "invalid_request_error",
        "message": "bad top_k",
        "param": "top_k",
        "code": "invalid_type",
    }
    missing = NotFound.model("org/x")
    assert missing.status == 404
    assert missing.to_openai()["error"]["code"] == "model_not_found"
    assert missing.to_openai()["error"]["param"] is None
    assert "org/x" in missing.message


# --- routing ------------------------------------------------------------------------------------


def _router() -> Router[str]:
    router: Router[str] = Router()
    router.add("GET", "/v1/models", "list")
    router.add("GET", "/v1/models/{model:path}", "card")
    router.add("POST", "/v1/messages/count_tokens", "count")
    router.add("POST", "/v1/messages", "messages")
    router.add("GET", "/v1/items/{item}/parts/{part}", "part")
    return router


def test_router_path_params_with_slashes() -> None:
    router = _router()
    assert router.match("GET", "/v1/models") == ("list", {})
    assert router.match("GET", "/v1/models/Qwen/Qwen3-8B") == ("card", {"model": "Qwen/Qwen3-8B"})
    assert router.match("get", "/v1/models/a/b/c/") == ("card", {"model": "a/b/c/"})
    assert router.match("GET", "/v1/items/7/parts/x.y") == ("part", {"item": "7", "part": "x.y"})
    assert router.match("POST", "/v1/messages/count_tokens") == ("count", {})


def test_router_segment_param_does_not_cross_slashes() -> None:
    with pytest.raises(NotFound):
        _router().match("GET", "/v1/items/7/8/parts/x")
    with pytest.raises(NotFound):
        _router().match("GET", "/v1/items//parts/x")


def test_router_404_vs_405() -> None:
    router = _router()
    with pytest.raises(NotFound) as missing:
        router.match("GET", "/v1/nothing")
    assert missing.value.status == 404
    with pytest.raises(NotFound):
        router.match("GET", "/v1/models/")  # {model:path} needs at least one character
    with pytest.raises(MethodNotAllowed) as wrong:
        router.match("GET", "/v1/messages")
    assert wrong.value.status == 405
    assert wrong.value.allowed == ("POST",)
    assert (b"allow", b"POST") in wrong.value.headers


def test_router_rejects_malformed_patterns() -> None:
    router: Router[str] = Router()
    for bad in ("v1/x", "/v1/{x", "/v1/{x}/{x}", "/v1/{x:int}"):
        with pytest.raises(ValueError):
            router.add("GET", bad, "h")


def test_router_literal_characters_are_escaped() -> None:
    router: Router[str] = Router()
    router.add("GET", "/a.b", "dot")
    with pytest.raises(NotFound):
        router.match("GET", "/aXb")


# --- auth ---------------------------------------------------------------------------------------


def test_bearer() -> None:
    check_bearer(_headers(), None)
    check_bearer(_headers(), "")
    check_bearer(_headers(("authorization", "Bearer sk-1")), "sk-1")
    check_bearer(_headers(("Authorization", "bearer   sk-1 ")), "sk-1")
    for headers in (
        _headers(),
        _headers(("authorization", "Bearer sk-2")),
        _headers(("authorization", "Basic sk-1")),
        _headers(("authorization", "Bearer")),
        _headers(("x-api-key", "sk-1")),
    ):
        with pytest.raises(Unauthorized) as info:
            check_bearer(headers, "sk-1")
        assert info.value.status == 401
        assert info.value.to_anthropic()["error"]["type"] == "authentication_error"


def test_anthropic_auth() -> None:
    key = "sk-ant"
    check_anthropic(_headers(), "")
    check_anthropic(_headers(("x-api-key", key)), key)
    check_anthropic(_headers(("authorization", f"Bearer {key}")), key)
    check_anthropic(_headers(("x-api-key", key), ("authorization", f"Bearer {key}")), key)
    for headers in (
        _headers(),
        _headers(("x-api-key", "nope")),
        _headers(("x-api-key", key), ("authorization", "Bearer nope")),
        _headers(("x-api-key", "nope"), ("authorization", f"Bearer {key}")),
        _headers(("x-api-key", key), ("authorization", f"Basic {key}")),
    ):
        with pytest.raises(Unauthorized):
            check_anthropic(headers, key)


# --- admission ----------------------------------------------------------------------------------


def test_admission_all_or_nothing() -> None:
    slots = AdmissionSlots(4)
    assert slots.try_acquire(3)
    assert not slots.try_acquire(2)  # only one free: no partial grant
    assert slots.in_use == 3
    assert slots.try_acquire(1)
    assert not slots.try_acquire(1)  # full: refused, counted
    slots.release(3)
    assert slots.try_acquire(3)
    stats = slots.statistics()
    assert (stats.in_use, stats.total, stats.free, stats.rejected_total) == (4, 4, 0, 2)


def test_admission_oversized_is_counted_apart_even_when_idle() -> None:
    slots = AdmissionSlots(2)
    assert slots.is_oversized(3)
    assert not slots.try_acquire(3)  # Ctx.admit answers 400 for it (tests/unit/test_admission_retry_after.py)
    assert slots.statistics().oversized_total == 1
    assert slots.in_use == 0


def test_admission_misuse() -> None:
    slots = AdmissionSlots(2)
    with pytest.raises(ValueError):
        slots.try_acquire(0)
    with pytest.raises(ValueError):
        slots.release(1)
    with pytest.raises(ValueError):
        AdmissionSlots(0)


# --- Accept -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("accept", "json_wins"),
    [
        (None, False),
        ("", False),
        ("*/*", False),
        ("application/json", True),
        ("text/plain", False),
        ("application/json, text/plain", True),
        ("text/plain, application/json", False),
        ("text/plain;q=0.5, application/json", True),
        ("application/json;q=0.5, text/plain", False),
        ("application/json;q=0.5, text/plain;q=0.5", True),
        ("text/plain;q=0.5, application/json;q=0.5", False),
        ("application/*, text/*", True),
        ("text/*, application/*", False),
        ("application/json;q=0, */*", False),
        ("application/json;q=0.9, */*;q=0.8", True),
        ("*/*;q=0.8, application/json;q=0.8", False),  # */* is earlier and gives text/plain 0.8
        ("application/json;q=0.8, */*;q=0.8", True),
        ("application/json;q=1.0, text/plain;version=0.0.4;q=1.0", True),
        ("application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.4,*/*;q=0.1", False),
        ("text/html", False),
        ("application/json;q=bogus, text/plain;q=0.1", False),
        ("garbage, ,application/json", True),
    ],
)
def test_prefers_json(accept: str | None, json_wins: bool) -> None:
    assert prefers_json(accept) is json_wins


def test_parse_accept_positions_and_qualities() -> None:
    ranges = parse_accept("text/plain;q=0.4, application/JSON")
    assert [(r.type, r.subtype, r.quality, r.position) for r in ranges] == [
        ("text", "plain", 0.4, 0),
        ("application", "json", 1.0, 1),
    ]


def test_metrics_format_query() -> None:
    from helios.http.ops import wants_json

    assert wants_json("json", "text/plain") is True
    assert wants_json("prometheus", "application/json") is False
    assert wants_json(None, "application/json") is True
    assert wants_json(None, None) is False
    with pytest.raises(BadRequest):
        wants_json("xml", None)


# --- request ------------------------------------------------------------------------------------


def test_request_from_scope() -> None:
    scope = {
        "type": "http",
        "method": "get",
        "path": "/v1/models/org/m",
        "raw_path": b"/v1/models/org%2Fm",
        "query_string": b"format=json&x=1&x=2&empty=",
        "headers": [(b"content-type", b"application/json"), (b"x-multi", b"a"), (b"x-multi", b"b")],
        "client": ("127.0.0.1", 5000),
    }
    request = Request.from_scope(scope)
    assert request.method == "GET"
    assert request.path == "/v1/models/org/m"
    assert request.raw_path == b"/v1/models/org%2Fm"
    assert request.query == {"format": ["json"], "x": ["1", "2"], "empty": [""]}
    assert request.query_value("x") == "1"
    assert request.query_value("missing") is None
    assert request.headers.get("Content-Type") == "application/json"
    assert request.headers.get_all("X-MULTI") == ["a", "b"]
    assert request.headers.get_list("x-multi") == "a, b"
    assert "content-type" in request.headers
    assert "nope" not in request.headers
    assert request.client == ("127.0.0.1", 5000)


# --- responses ----------------------------------------------------------------------------------


def test_send_json_is_compact_utf8() -> None:
    sent = _Sent()
    trio.run(lambda: send_json(sent, 201, {"a": "é✓", "b": [1, 2]}, headers=[(b"x-request-id", b"r1")]))
    assert sent.start["status"] == 201
    assert sent.headers[b"content-type"] == b"application/json"
    assert sent.headers[b"x-request-id"] == b"r1"
    assert sent.body == '{"a":"é✓","b":[1,2]}'.encode()
    assert sent.headers[b"content-length"] == str(len(sent.body)).encode()
    assert sent.messages[-1]["more_body"] is False


def test_send_json_refuses_nan() -> None:
    with pytest.raises(ValueError):
        trio.run(lambda: send_json(_Sent(), 200, {"x": float("-inf")}))


def test_send_text() -> None:
    sent = _Sent()
    trio.run(lambda: send_text(sent, 200, "flare_up 1\n"))
    assert sent.headers[b"content-type"].startswith(b"text/plain")
    assert sent.body == b"flare_up 1\n"


def test_sse_writer() -> None:
    sent = _Sent()

    async def main() -> None:
        sse = SSEWriter(sent)
        with pytest.raises(RuntimeError):
            await sse.event("early")
        await sse.start(headers=[(b"x-request-id", b"r")])
        await sse.event({"delta": "é"})
        await sse.event("line1\nline2", event="message_delta")
        await sse.comment("keepalive")
        await sse.event("[DONE]")  # the OpenAI terminator is a raw data line
        await sse.close()
        await sse.close()
        with pytest.raises(RuntimeError):
            await sse.event("late")

    trio.run(main)
    assert sent.start["status"] == 200
    assert sent.headers[b"content-type"].startswith(b"text/event-stream")
    assert sent.headers[b"cache-control"] == b"no-cache"
    assert sent.headers[b"x-accel-buffering"] == b"no"
    bodies = [m["body"] for m in sent.messages[1:]]
    assert bodies == [
        'data: {"delta":"é"}\n\n'.encode(),
        b"event: message_delta\ndata: line1\ndata: line2\n\n",
        b": keepalive\n\n",
        b"data: [DONE]\n\n",
        b"",
    ]
    assert [m["more_body"] for m in sent.messages[1:]] == [True, True, True, True, False]


def test_format_event() -> None:
    assert format_event("a\r\nb\rc") == "data: a\ndata: b\ndata: c\n\n"
    assert format_event("") == "data: \n\n"
    assert json.loads(format_event('{"x":1}', "e").split("data: ")[1]) == {"x": 1}
    with pytest.raises(ValueError):
        format_event("x", event="bad\nname")


