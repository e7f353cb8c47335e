"""POST /v1/systemone: the TypeSafe System One schema (noul, choice and score questions).

Schema failures are Jev-style HTTP 422 bodies, ``{"detail": [{"type", "loc", "msg", "input"}, ...]}``
with every failure found; malformed JSON, image assets on this text-only core and unsupported question
kinds are 400 in the Chat Completions error shape.

Answers: noul is P(yes) normalized over the two labels; choice returns the most probable criterion
(the first on a tie), the named probabilities and the Jev choice confidence; score returns the
probability-weighted zero-based level, the original levels as ``legend``, indexed probabilities and the
Jev score confidence. Normalizing label probabilities is not an empirical calibration.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from helios.domain.decisions import (
    DecisionQuestion,
    QuestionScore,
    choice_confidence,
    expected_level,
    first_argmax,
    render_state,
    render_value,
    score_confidence,
)
from helios.errors import BadRequest, UnprocessableEntity
from helios.frontends.wire import loads_strict

MAX_QUESTIONS = 64
MAX_CRITERIA = 128
MAX_LEVELS = 10
UNSUPPORTED_TYPES = ("box", "audio", "video", "custom")
_STRUCTURED = (str, dict, list)


class SchemaErrors(UnprocessableEntity):
    """A request that does not match the System One schema; rendered as ``{"detail": [...]}``."""

    def __init__(self, details: list[dict[str, Any]]) -> None:
        super().__init__("the request does not match the System One schema")
        self.details = details

    def body(self) -> dict[str, Any]:
        return {"detail": self.details}


@attrs.frozen
class NamedQuestion:
    name: str
    kind: str  # noul | choice | score
    question: DecisionQuestion
    keys: tuple[str, ...] = ()  # choice criteria names
    levels: tuple[Any, ...] = ()  # score levels as supplied


@attrs.frozen
class SystemOnePlan:
    state: str
    questions: tuple[NamedQuestion, ...]


def parse_body(body: bytes) -> Any:
    if not body:
        raise BadRequest("the request body is empty; expected a JSON object")
    try:
        return loads_strict(body)
    except (UnicodeDecodeError, RecursionError, ValueError) as exc:
        raise BadRequest(f"malformed JSON body: {exc}") from None


def decode_systemone(obj: Any) -> SystemOnePlan:
    errors: list[dict[str, Any]] = []
    if not isinstance(obj, dict):
        raise SchemaErrors([_error("dict_type", ["body"], "Input should be a valid dictionary", obj)])
    for key in obj:
        if key not in ("model", "state", "questions", "assets"):
            errors.append(_error("extra_forbidden", ["body", key], "Extra inputs are not permitted", obj[key]))
    if "model" not in obj:
        errors.append(_missing(["body", "model"], obj))
    elif not isinstance(obj["model"], str):
        errors.append(_error("string_type", ["body", "model"], "Input should be a valid string", obj["model"]))
    if "state" not in obj:
        errors.append(_missing(["body", "state"], obj))
    elif not isinstance(obj["state"], _STRUCTURED):
        errors.append(_error("state_type", ["body", "state"], "Input should be a string, an object or an array",
                             obj["state"]))
    questions: list[NamedQuestion] = []
    unsupported: list[str] = []
    raw = obj.get("questions")
    if "questions" not in obj:
        errors.append(_missing(["body", "questions"], obj))
    elif not isinstance(raw, dict):
        errors.append(_error("dict_type", ["body", "questions"], "Input should be a valid dictionary", raw))
    elif not 1 <= len(raw) <= MAX_QUESTIONS:
        kind, bound = ("too_short", "at least 1 item") if not raw else ("too_long", f"at most {MAX_QUESTIONS} items")
        errors.append(_error(kind, ["body", "questions"], f"Dictionary should have {bound}, not {len(raw)}", raw))
    else:
        for name, q in raw.items():
            decoded = _question(name, q, errors, unsupported)
            if decoded is not None:
                questions.append(decoded)
    if errors:
        raise SchemaErrors(errors)
    if unsupported:
        raise BadRequest(f"question type '{unsupported[0]}' is not supported; use noul, choice or score",
                         param="questions")
    assets = obj.get("assets")
    if assets:
        raise BadRequest("image assets need TypeSafe-Danger-Zone-Images: true and a vision core; this model is "
                         "text-only", param="assets")
    return SystemOnePlan(render_state(obj["state"]), tuple(questions))


def encode_systemone(plan: SystemOnePlan, scores: Sequence[QuestionScore], model: str) -> dict[str, Any]:
    """The response body for the label scorer's `scores` of `plan.questions` (in order)."""
    answers = {q.name: _answer(q, s) for q, s in zip(plan.questions, scores, strict=True)}
    return {
        "model": model,
        "answers": answers,
        "usage": {"input_tokens": sum(s.num_prompt_tokens for s in scores),
                  "output_tokens": sum(s.num_output_tokens for s in scores)},
    }


# -- helpers ---------------------------------------------------------------------------------------


def _answer(q: NamedQuestion, s: QuestionScore) -> dict[str, Any]:
    p = s.normalized
    if q.kind == "noul":
        return {"type": "noul", "noul": p[0]}
    if q.kind == "choice":
        return {"type": "choice", "choice": q.keys[first_argmax(p)],
                "probabilities": dict(zip(q.keys, p, strict=True)), "confidence": choice_confidence(p)}
    return {"type": "score", "score": expected_level(p),
            "legend": {str(i): level for i, level in enumerate(q.levels)},
            "probabilities": {str(i): v for i, v in enumerate(p)}, "confidence": score_confidence(p)}


def _question(name: str, q: Any, errors: list[dict[str, Any]], unsupported: list[str]) -> NamedQuestion | None:
    loc: list[str | int] = ["body", "questions", name]
    if not isinstance(q, dict):
        errors.append(_error("dict_type", loc, "Input should be a valid dictionary", q))
        return None
    kind = q.get("type")
    if "type" not in q:
        errors.append(_error("union_tag_not_found", loc, "Unable to extract tag using discriminator 'type'", q))
        return None
    if kind in UNSUPPORTED_TYPES:
        unsupported.append(str(kind))
        return None
    if kind not in ("noul", "choice", "score"):
        errors.append(_error("union_tag_invalid", loc,
                             f"Input tag '{kind}' found using 'type' does not match any of the expected tags: "
                             "'noul', 'choice', 'score'", q))
        return None
    loc = [*loc, kind]
    allowed = {"type", "instructions"} | ({"criteria"} if kind != "noul" else set())
    for key in q:
        if key not in allowed:
            errors.append(_error("extra_forbidden", [*loc, key], "Extra inputs are not permitted", q[key]))
    before = len(errors)
    instructions = q.get("instructions")
    if kind == "noul" and instructions is None:
        errors.append(_missing([*loc, "instructions"], q) if "instructions" not in q else
                      _error("instructions_type", [*loc, "instructions"], "Input should not be null", None))
    elif instructions is not None and not isinstance(instructions, _STRUCTURED):
        errors.append(_error("instructions_type", [*loc, "instructions"],
                             "Input should be a string, an object or an array", instructions))
    if kind == "noul":
        if len(errors) > before:
            return None
        return NamedQuestion(name, kind, DecisionQuestion("binary", render_value(instructions)))
    criteria = q.get("criteria")
    if "criteria" not in q:
        errors.append(_missing([*loc, "criteria"], q))
        return None
    if kind == "choice":
        return _choice(name, instructions, criteria, loc, errors, before)
    return _score(name, instructions, criteria, loc, errors, before)


def _choice(name: str, instructions: Any, criteria: Any, loc: list[str | int], errors: list[dict[str, Any]],
            before: int) -> NamedQuestion | None:
    where = [*loc, "criteria"]
    if not isinstance(criteria, dict):
        errors.append(_error("dict_type", where, "Input should be a valid dictionary", criteria))
        return None
    if not 1 <= len(criteria) <= MAX_CRITERIA:
        kind, bound = ("too_short", "at least 1 item") if not criteria else ("too_long", f"at most {MAX_CRITERIA} items")
        errors.append(_error(kind, where, f"Dictionary should have {bound}, not {len(criteria)}", criteria))
        return None
    for key, desc in criteria.items():
        if desc is not None and not isinstance(desc, _STRUCTURED):
            errors.append(_error("description_type", [*where, key],
                                 "Input should be null, a string, an object or an array", desc))
    if len(errors) > before:
        return None
    options = tuple(key if desc is None else f"{key} — {render_value(desc)}" for key, desc in criteria.items())
    text = render_value(instructions) if instructions is not None else "Which option fits the state best?"
    return NamedQuestion(name, "choice", DecisionQuestion("options", text, options), keys=tuple(criteria))


def _score(name: str, instructions: Any, criteria: Any, loc: list[str | int], errors: list[dict[str, Any]],
           before: int) -> NamedQuestion | None:
    where = [*loc, "criteria"]
    if not isinstance(criteria, list):
        errors.append(_error("list_type", where, "Input should be a valid list", criteria))
        return None
    if not 1 <= len(criteria) <= MAX_LEVELS:
        kind, bound = ("too_short", "at least 1 item") if not criteria else ("too_long", f"at most {MAX_LEVELS} items")
        errors.append(_error(kind, where, f"List should have {bound} after validation, not {len(criteria)}", criteria))
        return None
    for i, level in enumerate(criteria):
        if level is None or isinstance(level, bool) or not isinstance(level, (*_STRUCTURED, int, float)):
            errors.append(_error("level_type", [*where, i], "Input should be a nonnull string, number, object or "
                                 "array", level))
    if len(errors) > before:
        return None
    text = render_value(instructions) if instructions is not None else "Which level fits the state best?"
    return NamedQuestion(name, "score", DecisionQuestion("levels", text, tuple(render_value(v) for v in criteria)),
                         levels=tuple(criteria))


def _error(kind: str, loc: list[Any], msg: str, value: Any) -> dict[str, Any]:
    return {"type": kind, "loc": loc, "msg": msg, "input": value}


def _missing(loc: list[Any], parent: Any) -> dict[str, Any]:
    return _error("missing", loc, "Field required", parent)
