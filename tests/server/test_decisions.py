"""POST /v1/systemone and POST /v1/decisions against the live default-model server.

Both routes share one scorer: the same question about the same state gives the same label
probabilities and usage on both. Shapes, probability sums, Jev confidence, the 422/400/415 rules and
usage are checked here; the formulas themselves are unit-tested in tests/unit/test_decisions.py.
"""

from __future__ import annotations

import gzip
import math
from typing import Any

import httpx
import pytest

from helios.domain.decisions import choice_confidence, score_confidence
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.slow

STATE = "Customer: I was charged twice for my subscription this month and I want my money back today."


def call(server: LiveServer, path: str, body: Any, **kw: Any) -> httpx.Response:
    with server.http() as client:
        if isinstance(body, bytes):
            return client.post(path, content=body, **kw)
        return client.post(path, json=body, **kw)


def ok(server: LiveServer, path: str, body: Any) -> dict[str, Any]:
    r = call(server, path, body)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


# -- System One ---------------------------------------------------------------------------------------


def test_systemone_answers(server: LiveServer) -> None:
    body = {"model": "local", "state": {"message": STATE, "plan": "pro"}, "questions": {
        "refund": {"type": "noul", "instructions": "Is a refund requested?"},
        "team": {"type": "choice", "instructions": {"ask": "Which team handles it?"},
                 "criteria": {"billing": None, "support": "Other help", "sales": {"scope": ["upgrades"]}}},
        "urgency": {"type": "score", "criteria": ["Routine", {"level": "Soon"}, "Urgent"]},
        "only": {"type": "choice", "criteria": {"single": None}},
    }}
    result = ok(server, "/v1/systemone", body)
    assert result["model"] == "smol" and list(result["answers"]) == ["refund", "team", "urgency", "only"]
    a = result["answers"]
    assert a["refund"]["type"] == "noul" and 0.0 <= a["refund"]["noul"] <= 1.0 and set(a["refund"]) == {"type", "noul"}
    team = a["team"]
    probs = team["probabilities"]
    assert list(probs) == ["billing", "support", "sales"] and math.isclose(sum(probs.values()), 1.0, abs_tol=1e-9)
    assert team["choice"] == max(probs, key=lambda k: (probs[k], -list(probs).index(k)))
    assert team["confidence"] == pytest.approx(choice_confidence(list(probs.values())))
    urgency = a["urgency"]
    assert urgency["legend"] == {"0": "Routine", "1": {"level": "Soon"}, "2": "Urgent"}
    p = [urgency["probabilities"][str(i)] for i in range(3)]
    assert math.isclose(sum(p), 1.0, abs_tol=1e-9)
    assert urgency["score"] == pytest.approx(sum(i * x for i, x in enumerate(p)))
    assert urgency["confidence"] == pytest.approx(score_confidence(p))
    assert a["only"] == {"type": "choice", "choice": "single", "probabilities": {"single": 1.0}, "confidence": 1.0}
    usage = result["usage"]
    assert set(usage) == {"input_tokens", "output_tokens"}
    assert usage["output_tokens"] == 4 and usage["input_tokens"] > 4 * 40


def test_systemone_and_decisions_share_the_scorer(server: LiveServer) -> None:
    one = ok(server, "/v1/systemone", {"model": "m", "state": STATE, "questions": {
        "refund": {"type": "noul", "instructions": "Is a refund requested?"},
        "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "Payments", "support": None}},
        "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["Routine", "Urgent"]},
    }})
    two = ok(server, "/v1/decisions", {"model": "m", "input": STATE, "questions": [
        {"type": "predicate", "name": "refund", "instructions": "Is a refund requested?"},
        {"type": "choice", "instructions": "Which team?",
         "choices": [{"value": "billing", "description": "Payments"}, {"value": "support"}]},
        {"type": "score", "name": "urgency", "instructions": "How urgent?",
         "levels": [{"label": "Routine"}, {"label": "Urgent"}]},
    ]})
    a, b = one["answers"], two["answers"]
    # The second route reuses the first's cached state prefix, computed in other batches: float32
    # batch-shape noise (about 1e-6 here), nothing more.
    assert b[0]["probability"] == pytest.approx(a["refund"]["noul"], abs=1e-5)
    assert [x["probability"] for x in b[1]["probabilities"]] == pytest.approx(
        list(a["team"]["probabilities"].values()), abs=1e-5)
    assert b[2]["score"] == pytest.approx(a["urgency"]["score"], abs=1e-5)
    assert one["usage"]["input_tokens"] == two["usage"]["input_tokens"]
    assert one["usage"]["output_tokens"] == two["usage"]["output_tokens"] == 3
    # Decisions confidence is the winner's full-vocabulary probability: never above its normalized share.
    win = max(b[1]["probabilities"], key=lambda x: x["probability"])
    assert b[1]["choice"] == win["value"] and 0.0 < b[1]["confidence"] <= win["probability"] + 1e-12


@pytest.mark.parametrize(("body", "locs"), [
    ([1, 2], [["body"]]),
    ({"state": "s", "questions": {"a": {"type": "noul", "instructions": "x"}}}, [["body", "model"]]),
    ({"model": "m", "questions": {"a": {"type": "noul", "instructions": "x"}}}, [["body", "state"]]),
    ({"model": "m", "state": 3, "questions": {"a": {"type": "noul", "instructions": "x"}}}, [["body", "state"]]),
    ({"model": "m", "state": "s", "questions": {}}, [["body", "questions"]]),
    ({"model": "m", "state": "s", "questions": [{"type": "noul"}]}, [["body", "questions"]]),
    ({"model": "m", "state": "s", "questions": {f"q{i}": {"type": "noul", "instructions": "x"} for i in range(65)}},
     [["body", "questions"]]),
    ({"model": "m", "state": "s", "questions": {"a": {"type": "noul"}}}, [["body", "questions", "a", "noul",
                                                                           "instructions"]]),
    ({"model": "m", "state": "s", "questions": {"a": {"type": "mystery"}}}, [["body", "questions", "a"]]),
    ({"model": "m", "state": "s", "questions": {"a": {"instructions": "x"}}}, [["body", "questions", "a"]]),
    ({"model": "m", "state": "s", "questions": {"a": {"type": "choice", "criteria": {}}}},
     [["body", "questions", "a", "choice", "criteria"]]),
    ({"model": "m", "state": "s", "questions": {"a": {"type": "choice",
                                                      "criteria": {str(i): None for i in range(129)}}}},
     [["body", "questions", "a", "choice", "criteria"]]),
    ({"model": "m", "state": "s", "questions": {"a": {"type": "score", "criteria": ["x", None]}}},
     [["body", "questions", "a", "score", "criteria", 1]]),
    ({"model": "m", "state": "s", "questions": {"a": {"type": "score", "criteria": [str(i) for i in range(11)]}}},
     [["body", "questions", "a", "score", "criteria"]]),
    ({"model": "m", "state": "s", "questions": {"a": {"type": "noul", "instructions": "x", "extra": 1}}, "x": 2},
     [["body", "x"], ["body", "questions", "a", "noul", "extra"]]),
])
def test_systemone_schema_failures_are_jev_422(server: LiveServer, body: Any, locs: list[list[Any]]) -> None:
    r = call(server, "/v1/systemone", body)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert [d["loc"] for d in detail] == locs
    assert all(set(d) == {"type", "loc", "msg", "input"} for d in detail)


def test_systemone_400_and_415(server: LiveServer) -> None:
    good = {"model": "m", "state": "s", "questions": {"a": {"type": "noul", "instructions": "x"}}}
    cases: list[tuple[Any, dict[str, str], int]] = [
        (b"{not json", {}, 400),
        ({**good, "questions": {"a": {"type": "box", "instructions": "x"}}}, {}, 400),
        ({**good, "assets": [{"name": "img", "data_base64": "AAAA"}]}, {"TypeSafe-Danger-Zone-Images": "true"}, 400),
        (b"--x\r\n\r\n{}\r\n--x--", {"content-type": "multipart/form-data; boundary=x"}, 400),
        (gzip.compress(b"--x--"), {"content-type": "multipart/form-data; boundary=x", "content-encoding": "gzip"},
         415),
    ]
    for body, headers, status in cases:
        r = call(server, "/v1/systemone", body, headers=headers)
        assert r.status_code == status, (body, r.text)
        assert set(r.json()["error"]) == {"type", "message", "param", "code"}
    # JSON itself may be compressed.
    r = call(server, "/v1/systemone", gzip.compress(b'{"model": "m", "state": "s", "questions": '
                                                    b'{"a": {"type": "noul", "instructions": "x"}}}'),
             headers={"content-encoding": "gzip", "content-type": "application/json"})
    assert r.status_code == 200, r.text


def test_label_availability_limits_choice_size(server: LiveServer) -> None:
    many = {"model": "m", "state": "s", "questions": {"a": {"type": "choice",
                                                             "criteria": {f"opt{i}": None for i in range(26)}}}}
    result = ok(server, "/v1/systemone", many)
    assert len(result["answers"]["a"]["probabilities"]) == 26
    too_many = {"model": "m", "state": "s", "questions": {"a": {"type": "choice",
                                                                 "criteria": {f"o{i}": None for i in range(100)}}}}
    r = call(server, "/v1/systemone", too_many)
    assert r.status_code == 400 and "label" in r.json()["error"]["message"]


# -- Decisions ------------------------------------------------------------------------------------------


def test_decisions_answers_in_order(server: LiveServer) -> None:
    body = {"model": "m", "safety_identifier": "user-1", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "Order 123"}, {"type": "text", "text": "late"}]},
        {"type": "message", "role": "user", "content": "It has been two weeks."},
    ], "questions": [
        {"type": "score", "name": "dup", "instructions": "Severity?",
         "levels": [{"label": "Low"}, {"label": "Medium", "description": "Some harm"}, {"label": "High"}]},
        {"type": "choice", "name": "dup", "instructions": "Resolution?",
         "choices": [{"value": True, "description": "Refund"}, {"value": "true"}, {"value": False}]},
        {"type": "predicate", "instructions": "Is the order late?"},
    ]}
    result = ok(server, "/v1/decisions", body)
    answers = result["answers"]
    assert [(x["type"], x["name"]) for x in answers] == [("score", "dup"), ("choice", "dup"), ("predicate", None)]
    score, choice, predicate = answers
    assert [x["value"] for x in score["probabilities"]] == [0, 1, 2]
    assert [x["label"] for x in score["probabilities"]] == ["Low", "Medium", "High"]
    p = [x["probability"] for x in score["probabilities"]]
    assert math.isclose(sum(p), 1.0, abs_tol=1e-9)
    assert score["score"] == pytest.approx(sum(i * x for i, x in enumerate(p)))
    assert 0.0 < score["confidence"] <= max(p) + 1e-12
    assert [x["value"] for x in choice["probabilities"]] == [True, "true", False]
    assert math.isclose(sum(x["probability"] for x in choice["probabilities"]), 1.0, abs_tol=1e-9)
    assert choice["choice"] in (True, "true", False)
    assert set(predicate) == {"type", "name", "probability"} and 0.0 <= predicate["probability"] <= 1.0
    usage = result["usage"]
    assert usage["output_tokens"] == 3 and usage["total_tokens"] == usage["input_tokens"] + 3
    # Each question is its own chat with the same leading state message: later questions reuse its pages.
    assert 0 < usage["input_tokens_details"]["cached_tokens"] < usage["input_tokens"]
    assert usage["input_tokens_details"]["cache_write_tokens"] == 0
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}


@pytest.mark.parametrize("body", [
    {"input": "x", "questions": [{"type": "predicate", "instructions": "q"}]},
    {"model": "m", "questions": [{"type": "predicate", "instructions": "q"}]},
    {"model": "m", "input": "x", "questions": []},
    {"model": "m", "input": "x", "questions": [{"type": "predicate", "instructions": "q"}] * 65},
    {"model": "m", "input": "x", "questions": [{"type": "predicate", "instructions": "q"}], "extra": 1},
    {"model": "m", "input": "x", "questions": [{"type": "predicate"}]},
    {"model": "m", "input": "x", "questions": [{"type": "predicate", "instructions": 5}]},
    {"model": "m", "input": "x", "questions": [{"type": "predicate", "name": None, "instructions": "q"}]},
    {"model": "m", "input": "x", "questions": [{"type": "box", "instructions": "q"}]},
    {"model": "m", "input": "x", "questions": [{"type": "choice", "instructions": "q", "choices": [{"value": "a"}]}]},
    {"model": "m", "input": "x", "questions": [{"type": "choice", "instructions": "q",
                                                "choices": [{"value": "a"}, {"value": "a"}]}]},
    {"model": "m", "input": "x", "questions": [{"type": "choice", "instructions": "q",
                                                "choices": [{"value": "a"}, {"value": 3}]}]},
    {"model": "m", "input": "x", "questions": [{"type": "choice", "instructions": "q",
                                                "choices": [{"value": str(i)} for i in range(129)]}]},
    {"model": "m", "input": "x", "questions": [{"type": "score", "instructions": "q", "levels": [{"label": "a"}]}]},
    {"model": "m", "input": "x", "questions": [{"type": "score", "instructions": "q",
                                                "levels": [{"label": str(i)} for i in range(11)]}]},
    {"model": "m", "input": [{"role": "assistant", "content": "x"}],
     "questions": [{"type": "predicate", "instructions": "q"}]},
    {"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}],
     "questions": [{"type": "predicate", "instructions": "q"}]},
    {"model": "m", "input": "x", "safety_identifier": "s" * 129,
     "questions": [{"type": "predicate", "instructions": "q"}]},
])
def test_decisions_400s(server: LiveServer, body: dict[str, Any]) -> None:
    r = call(server, "/v1/decisions", body)
    assert r.status_code == 400, (body, r.text)
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_decisions_multipart_is_400(server: LiveServer) -> None:
    r = call(server, "/v1/decisions", b"--x--", headers={"content-type": "multipart/form-data; boundary=x"})
    assert r.status_code == 400
