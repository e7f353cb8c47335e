"""POST /v1/decisions: the vLLM Decisions text protocol on the System One scorer.

Input is a string, or user messages whose content is a string or ``text`` / ``input_text`` parts
(parts join with newlines, messages with blank lines). Questions are ordered: predicates, choices with
2..128 distinct string or boolean values, and scores with 2..10 labelled levels. Everything else is an
OpenAI-style 400.

Answers keep the request order and each carries its name (null when omitted). Choice and score
confidence is the winning label's full-vocabulary probability: its normalized probability times the
labels' total raw mass. Usage sums the questions' logical input and generated read tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from helios.domain.decisions import (
    DecisionQuestion,
    QuestionScore,
    expected_level,
    first_argmax,
)
from helios.errors import BadRequest

MAX_QUESTIONS = 64
MAX_CHOICES = 128
MAX_LEVELS = 10
MAX_SAFETY_IDENTIFIER = 128


@attrs.frozen
class OrderedQuestion:
    name: str | None
    kind: str  # predicate | choice | score
    question: DecisionQuestion
    values: tuple[Any, ...] = ()  # choice values (str or bool) or score labels


@attrs.frozen
class DecisionsPlan:
    input: str
    questions: tuple[OrderedQuestion, ...]


def decode_decisions(obj: dict[str, Any]) -> DecisionsPlan:
    for key in obj:
        if key not in ("model", "input", "questions", "safety_identifier"):
            raise BadRequest(f"unrecognized request argument: {key}", param=key)
    if not isinstance(obj.get("model"), str):
        raise BadRequest("model is required and must be a string", param="model")
    sid = obj.get("safety_identifier")
    if sid is not None and (not isinstance(sid, str) or len(sid) > MAX_SAFETY_IDENTIFIER):
        raise BadRequest(f"safety_identifier must be a string of at most {MAX_SAFETY_IDENTIFIER} characters",
                         param="safety_identifier")
    if "input" not in obj:
        raise BadRequest("input is required", param="input")
    text = _input_text(obj["input"])
    raw = obj.get("questions")
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_QUESTIONS:
        raise BadRequest(f"questions must be an array of 1 to {MAX_QUESTIONS} questions", param="questions")
    return DecisionsPlan(text, tuple(_question(i, q) for i, q in enumerate(raw)))


def encode_decisions(plan: DecisionsPlan, scores: Sequence[QuestionScore], model: str) -> dict[str, Any]:
    """The response body for the label scorer's `scores` of `plan.questions` (in order)."""
    answers = [_answer(q, s) for q, s in zip(plan.questions, scores, strict=True)]
    input_tokens = sum(s.num_prompt_tokens for s in scores)
    output_tokens = sum(s.num_output_tokens for s in scores)
    return {
        "model": model,
        "answers": answers,
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": sum(s.num_cached_tokens for s in scores),
                                     "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        },
    }


# -- helpers ---------------------------------------------------------------------------------------


def _answer(q: OrderedQuestion, s: QuestionScore) -> dict[str, Any]:
    p = s.normalized
    if q.kind == "predicate":
        return {"type": "predicate", "name": q.name, "probability": p[0]}
    win = first_argmax(p)
    confidence = min(s.probabilities[win], 1.0)  # == p[win] * total raw label mass
    if q.kind == "choice":
        return {"type": "choice", "name": q.name, "choice": q.values[win], "confidence": confidence,
                "probabilities": [{"value": v, "probability": x} for v, x in zip(q.values, p, strict=True)]}
    return {"type": "score", "name": q.name, "score": expected_level(p), "confidence": confidence,
            "probabilities": [{"value": i, "label": label, "probability": x}
                              for i, (label, x) in enumerate(zip(q.values, p, strict=True))]}


def _input_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise BadRequest("input must be a string or a nonempty array of user messages", param="input")
    messages = []
    for i, m in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be a message object", param="input")
        for key in m:
            if key not in ("role", "content", "type"):
                raise BadRequest(f"unrecognized field {key} in {where}", param="input")
        if m.get("type", "message") != "message":
            raise BadRequest(f"{where}.type must be 'message'", param="input")
        if m.get("role") != "user":
            raise BadRequest(f"{where}.role must be 'user'; other roles are not supported", param="input")
        messages.append(_content_text(m.get("content"), where))
    return "\n\n".join(messages)


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or an array of text parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "image_url", "image", "input_file", "file"):
            raise BadRequest("images and assets are not supported on /v1/decisions", param="input")
        if kind not in ("text", "input_text") or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
            raise BadRequest(f"{where}.content[{j}] must be a text or input_text part", param="input")
        texts.append(part["text"])
    return "\n".join(texts)


def _question(i: int, q: Any) -> OrderedQuestion:
    where = f"questions[{i}]"
    if not isinstance(q, dict):
        raise BadRequest(f"{where} must be an object", param="questions")
    kind = q.get("type")
    fields = {"predicate": {"levels", "choices"}, "choice": {"levels"}, "score": {"choices"}}
    if not isinstance(kind, str) or kind not in fields:  # an array or object is not hashable
        raise BadRequest(f"{where}.type must be predicate, choice or score", param="questions")
    allowed = {"type", "name", "instructions", "choices", "levels"} - fields[kind]
    for key in q:
        if key not in allowed:
            raise BadRequest(f"unrecognized field {key} in {where}", param="questions")
    if "name" in q and not isinstance(q["name"], str):
        raise BadRequest(f"{where}.name must be a string when present", param="questions")
    name = q.get("name")
    instructions = q.get("instructions")
    if not isinstance(instructions, str):
        raise BadRequest(f"{where}.instructions is required and must be a string", param="questions")
    if kind == "predicate":
        return OrderedQuestion(name, kind, DecisionQuestion("binary", instructions))
    if kind == "choice":
        values, options = _choices(q.get("choices"), where)
        return OrderedQuestion(name, kind, DecisionQuestion("options", instructions, options), values)
    labels, options = _levels(q.get("levels"), where)
    return OrderedQuestion(name, kind, DecisionQuestion("levels", instructions, options), labels)


def _choices(raw: Any, where: str) -> tuple[tuple[Any, ...], tuple[str, ...]]:
    if not isinstance(raw, list) or not 2 <= len(raw) <= MAX_CHOICES:
        raise BadRequest(f"{where}.choices must be an array of 2 to {MAX_CHOICES} choices", param="questions")
    values: list[Any] = []
    options: list[str] = []
    seen: set[tuple[type, Any]] = set()
    for j, c in enumerate(raw):
        if not isinstance(c, dict) or set(c) - {"value", "description"} or "value" not in c:
            raise BadRequest(f"{where}.choices[{j}] must be an object with a value and an optional description",
                             param="questions")
        value, desc = c["value"], c.get("description")
        if not isinstance(value, str | bool) or (desc is not None and not isinstance(desc, str)) \
                or ("description" in c and desc is None):
            raise BadRequest(f"{where}.choices[{j}]: value must be a string or boolean and description a string",
                             param="questions")
        if (type(value), value) in seen:
            raise BadRequest(f"{where}.choices values must be distinct", param="questions")
        seen.add((type(value), value))
        shown = value if isinstance(value, str) else ("true" if value else "false")
        values.append(value)
        options.append(shown if desc is None else f"{shown} — {desc}")
    return tuple(values), tuple(options)


def _levels(raw: Any, where: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if not isinstance(raw, list) or not 2 <= len(raw) <= MAX_LEVELS:
        raise BadRequest(f"{where}.levels must be an array of 2 to {MAX_LEVELS} levels", param="questions")
    labels: list[str] = []
    options: list[str] = []
    for j, lv in enumerate(raw):
        if not isinstance(lv, dict) or set(lv) - {"label", "description"} or not isinstance(lv.get("label"), str) \
                or ("description" in lv and not isinstance(lv["description"], str)):
            raise BadRequest(f"{where}.levels[{j}] must be an object with a string label and an optional string "
                             "description", param="questions")
        labels.append(lv["label"])
        desc = lv.get("description")
        options.append(lv["label"] if desc is None else f"{lv['label']} — {desc}")
    return tuple(labels), tuple(options)
