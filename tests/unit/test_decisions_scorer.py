"""System One / Decisions pieces without a model: the Jev confidence formulas and the request decoders."""

from __future__ import annotations

import pytest

from helios.domain.decisions import (
    QuestionScore,
    choice_confidence,
    expected_level,
    first_argmax,
    score_confidence,
)
from helios.errors import BadRequest
from helios.frontends.decisions.decisions import decode_decisions
from helios.frontends.decisions.systemone import SchemaErrors, decode_systemone


def test_choice_confidence() -> None:
    assert choice_confidence([0.91, 0.02, 0.03, 0.04]) == pytest.approx(0.88)
    for k in range(2, 11):
        assert choice_confidence([1.0 / k] * k) == pytest.approx(0.0, abs=1e-12)
        certain = [0.0] * k
        certain[k // 2] = 1.0
        assert choice_confidence(certain) == pytest.approx(1.0)
    assert choice_confidence([1.0]) == 1.0


def test_score_confidence() -> None:
    for k in range(2, 11):
        certain = [0.0] * k
        certain[k - 1] = 1.0
        assert score_confidence(certain) == pytest.approx(1.0)
    assert score_confidence([0.5, 0.5]) == pytest.approx(0.0)  # the first level wins the tie
    p = [0.1, 0.6, 0.2, 0.1]
    assert score_confidence(p) == pytest.approx(score_confidence(p[::-1]))  # mirror symmetric
    assert score_confidence([0.05, 0.9, 0.05]) > score_confidence([0.3, 0.4, 0.3])
    # 1 - sum(p_i |i - m|) / mean |i - centre|: m = 1, dist = 0.1 + 0.2 + 0.2 = 0.5, uniform = 1.0
    assert score_confidence(p) == pytest.approx(0.5)
    assert score_confidence([1.0]) == 1.0
    assert expected_level(p) == pytest.approx(1.3)
    assert first_argmax([0.4, 0.4, 0.2]) == 0


def test_question_score_normalization() -> None:
    s = QuestionScore((0.2, 0.6), ("A", "B"), 10, 1, 0)
    assert s.normalized == pytest.approx((0.25, 0.75)) and s.mass == pytest.approx(0.8)
    assert QuestionScore((0.0, 0.0), ("A", "B"), 1, 1, 0).normalized == (0.5, 0.5)


def test_systemone_decoder() -> None:
    plan = decode_systemone({"model": "m", "state": {"a": [1, "é"]}, "questions": {
        "q": {"type": "choice", "instructions": {"x": 1}, "criteria": {"a": None, "b": {"d": 2}}},
        "s": {"type": "score", "criteria": ["lo", 3]},
    }})
    assert '"é"' in plan.state
    q, s = plan.questions
    assert q.question.instructions == '{"x": 1}' and q.question.options == ("a", 'b — {"d": 2}')
    assert q.keys == ("a", "b") and s.levels == ("lo", 3) and s.question.options == ("lo", "3")
    with pytest.raises(SchemaErrors) as err:
        decode_systemone({"model": 1, "state": None, "questions": {"a": 5}})
    assert [d["loc"] for d in err.value.details] == [["body", "model"], ["body", "state"], ["body", "questions", "a"]]
    with pytest.raises(BadRequest):
        decode_systemone({"model": "m", "state": "s", "questions": {"a": {"type": "video"}}})


def test_decisions_decoder() -> None:
    plan = decode_decisions({"model": "m", "input": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]}, {"role": "user", "content": "c"}],
        "questions": [{"type": "choice", "instructions": "q", "choices": [{"value": True}, {"value": "x",
                                                                                              "description": "d"}]}]})
    assert plan.input == "a\nb\n\nc"
    (q,) = plan.questions
    assert q.name is None and q.values == (True, "x") and q.question.options == ("true", "x — d")
    with pytest.raises(BadRequest):
        decode_decisions({"model": "m", "input": "x", "questions": [
            {"type": "choice", "instructions": "q", "choices": [{"value": "a", "description": None}, {"value": "b"}]}]})
