"""POST /v1/decisions: the vLLM Decisions text protocol on the System One scorer.

The request is declared once, as attrs classes structured by the strict wire converter
(`helios.frontends.wire`): input is a string, or user messages whose content is a string or ``text`` /
``input_text`` parts (parts join with newlines, messages with blank lines); questions are a tagged
union on ``type``, in order: predicates, choices with 2..128 distinct string or boolean values, and
scores with 2..10 labelled levels. Everything else is an OpenAI-style 400 whose message names the
value's path (``questions[2].levels[0].label``) and whose ``param`` is its top-level field.

Answers keep the request order and each carries its name (null when omitted). Choice and score
confidence is the winning label's full-vocabulary probability: its normalized probability times the
labels' total raw mass. Usage sums the questions' logical input and generated read tokens.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, ClassVar, Literal, NewType

import attrs

from helios.domain.decisions import DecisionQuestion, QuestionScore, expected_level, first_argmax
from helios.errors import BadRequest
from helios.frontends.fields import FieldTable, field_table, honoured, ignored, screen_fields, wire_field
from helios.frontends.wire import DETAILED, FAST, Invalid, structure

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


# -- the request's shapes ------------------------------------------------------------------------------

PresentStr = NewType("PresentStr", str)
Omittable = PresentStr | None
"""A string that may be omitted (None) but not null: names and descriptions."""


def _present_str(v: Any, _t: Any) -> str:
    if type(v) is not str:
        raise Invalid("must be a string when present")
    return v


for _converter in (FAST, DETAILED):
    _converter.register_structure_hook_func(lambda t: t == Omittable, _present_str)


@attrs.define(kw_only=True)
class TextContent:
    type: Literal["text", "input_text"]
    text: str


@attrs.define(kw_only=True)
class MediaContent:
    __wire_refused__: ClassVar[str] = "images and assets are not supported on /v1/decisions"
    type: Literal["input_image", "image_url", "image", "input_file", "file"]


@attrs.define(kw_only=True)
class UserMessage:
    type: Literal["message"] = "message"
    role: Literal["user"]
    content: str | list[TextContent | MediaContent]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content if isinstance(p, TextContent))  # media is refused


@attrs.define(kw_only=True)
class BaseQuestion:
    """What every question has (its ``type`` aside): an optional name and the instructions."""

    name: Omittable = None
    instructions: str


@attrs.define(kw_only=True)
class PredicateQuestion(BaseQuestion):
    type: Literal["predicate"]

    def ordered(self, where: str) -> OrderedQuestion:
        return OrderedQuestion(self.name, self.type, DecisionQuestion("binary", self.instructions))


@attrs.define(kw_only=True)
class Choice:
    value: str | bool
    description: Omittable = None

    def option(self) -> str:
        shown = self.value if isinstance(self.value, str) else ("true" if self.value else "false")
        return shown if self.description is None else f"{shown} — {self.description}"


@attrs.define(kw_only=True)
class ChoiceQuestion(BaseQuestion):
    type: Literal["choice"]
    choices: list[Choice]

    def ordered(self, where: str) -> OrderedQuestion:
        if not 2 <= len(self.choices) <= MAX_CHOICES:
            raise BadRequest(f"{where}.choices must be an array of 2 to {MAX_CHOICES} choices", param="questions")
        values = tuple(c.value for c in self.choices)
        if len({(type(v), v) for v in values}) < len(values):  # True and "true" differ
            raise BadRequest(f"{where}.choices values must be distinct", param="questions")
        options = tuple(c.option() for c in self.choices)
        return OrderedQuestion(self.name, self.type, DecisionQuestion("options", self.instructions, options), values)


@attrs.define(kw_only=True)
class Level:
    label: str
    description: Omittable = None


@attrs.define(kw_only=True)
class ScoreQuestion(BaseQuestion):
    type: Literal["score"]
    levels: list[Level]

    def ordered(self, where: str) -> OrderedQuestion:
        if not 2 <= len(self.levels) <= MAX_LEVELS:
            raise BadRequest(f"{where}.levels must be an array of 2 to {MAX_LEVELS} levels", param="questions")
        labels = tuple(lv.label for lv in self.levels)
        options = tuple(lv.label if lv.description is None else f"{lv.label} — {lv.description}" for lv in self.levels)
        return OrderedQuestion(self.name, self.type, DecisionQuestion("levels", self.instructions, options), labels)


Question = PredicateQuestion | ChoiceQuestion | ScoreQuestion


@attrs.define(kw_only=True)
class DecisionsWire:
    model: str = wire_field(honoured("required; one model is served, and the response names it"), required=True)
    input: str | list[UserMessage] = wire_field(honoured("text, or user messages of text parts"), required=True)
    questions: list[Question] = wire_field(honoured("1 to 64 questions, answered in order"), required=True)

    def text(self) -> str:
        if isinstance(self.input, str):
            return self.input
        if not self.input:
            raise BadRequest("input must be a string or a nonempty array of user messages", param="input")
        return "\n\n".join(m.text() for m in self.input)


DECISIONS_FIELDS: FieldTable = field_table(DecisionsWire, safety_identifier=ignored(
    "inert caller metadata; nothing is monitored locally",
    allows=lambda v: type(v) is str and len(v) <= MAX_SAFETY_IDENTIFIER,
    message=f"safety_identifier must be a string of at most {MAX_SAFETY_IDENTIFIER} characters"))


def decode_decisions(obj: dict[str, Any]) -> DecisionsPlan:
    try:
        w = structure(screen_fields(obj, DECISIONS_FIELDS), DecisionsWire)
    except BadRequest as exc:  # this route's param is the top-level field; the message names the path
        raise BadRequest(exc.message, param=None if exc.param is None else re.split(r"[.\[]", exc.param)[0]) from None
    text = w.text()
    if not 1 <= len(w.questions) <= MAX_QUESTIONS:
        raise BadRequest(f"questions must be an array of 1 to {MAX_QUESTIONS} questions", param="questions")
    return DecisionsPlan(text, tuple(q.ordered(f"questions[{i}]") for i, q in enumerate(w.questions)))


def encode_decisions(plan: DecisionsPlan, scores: Sequence[QuestionScore], model: str) -> dict[str, Any]:
    """The response body for the label scorer's `scores` of `plan.questions` (in order)."""
    answers = [_answer(q, s) for q, s in zip(plan.questions, scores, strict=True)]
    inputs, outputs = sum(s.num_prompt_tokens for s in scores), sum(s.num_output_tokens for s in scores)
    cached = sum(s.num_cached_tokens for s in scores)
    usage = {"input_tokens": inputs, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
             "output_tokens": outputs, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": inputs + outputs}
    return {"model": model, "answers": answers, "usage": usage}


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
