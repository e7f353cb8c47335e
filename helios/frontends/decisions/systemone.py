"""POST /v1/systemone: the TypeSafe System One schema (noul, choice and score questions).

Schema failures are Jev-style HTTP 422 bodies, ``{"detail": [{"type", "loc", "msg", "input"}, ...]}``
with every failure found; malformed JSON, image assets without ``TypeSafe-Danger-Zone-Images: true``
or on a text-only model, malformed or unused assets and unsupported question kinds are 400 in the
Chat Completions error shape.

Image assets (api.md, System One): ``assets`` maps a reference to ``{"type": "image", "format":
"png"|"jpeg", "data_base64": ...}`` or, in a multipart/form-data body, ``{"part": NAME}`` (the part
wins over data_base64; every part belongs to exactly one asset). A reference replaces string values
of the state, instructions and criteria (a whole-value match first, then nonoverlapping matches left
to right); keys remain text and legends keep the original references. Unused assets are rejected.

Answers: noul is P(yes) normalized over the two labels; choice returns the most probable criterion
(the first on a tie), the named probabilities and the Jev choice confidence; score returns the
probability-weighted zero-based level, the original levels as ``legend``, indexed probabilities and the
Jev score confidence. Normalizing label probabilities is not an empirical calibration.
"""

from __future__ import annotations

import base64
import binascii
import re
import secrets
from collections.abc import Sequence
from typing import Any

import attrs

from helios.domain.conversation import ImagePart
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
from helios.frontends.decisions.multipart import FormPart
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
    images: tuple[tuple[str, ImagePart], ...] = ()
    """Image assets: the marker text that stands for each asset wherever a reference replaced a
    value in ``state`` and the questions' texts (a private-use delimiter and a per-request nonce, so
    no client text can forge one), and the asset's image. The scorer presents an image at each
    marker."""


ASSET_FIELDS = frozenset({"type", "format", "data_base64", "part"})
ASSET_FORMATS = {"png": "image/png", "jpeg": "image/jpeg", "jpg": "image/jpeg"}
_MAGIC = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"))
DANGER_ZONE_HEADER = "typesafe-danger-zone-images"


def parse_body(body: bytes) -> Any:
    if not body:
        raise BadRequest("the request body is empty; expected a JSON object")
    try:
        return loads_strict(body)
    except (UnicodeDecodeError, RecursionError, ValueError) as exc:
        raise BadRequest(f"malformed JSON body: {exc}") from None


def decode_systemone(obj: Any, *, model: str = "", vision: bool = False, danger_zone: bool = False,
                     parts: Sequence[FormPart] = ()) -> SystemOnePlan:
    """The request's plan. ``vision``: the loaded model takes images; ``danger_zone``: the request
    carried ``TypeSafe-Danger-Zone-Images: true``; ``parts``: the image parts of a multipart body
    (after its JSON part)."""
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
    if assets is None and not parts:
        return SystemOnePlan(render_state(obj["state"]), tuple(questions))
    if not danger_zone:
        raise BadRequest("image assets require the TypeSafe-Danger-Zone-Images: true header", param="assets")
    if not vision:
        raise BadRequest(f"model {model} does not accept image input (it is text-only)", param="assets")
    images = _assets(assets, parts)
    nonce = secrets.token_hex(8)
    markers = {key: f"\ue000{nonce}#{i}\ue001" for i, key in enumerate(images)}
    used: set[str] = set()
    replaced = _with_references(obj, _Replacer(markers, used))
    unused = [key for key in images if key not in used]
    if unused:
        raise BadRequest(f"asset '{unused[0]}' is not referenced by the state, instructions or criteria; unused "
                         "assets are rejected", param="assets")
    by_name = {q.name: q for q in questions}
    again: list[NamedQuestion] = []
    for name, q in replaced["questions"].items():
        decoded = _question(name, q, errors, unsupported)
        assert decoded is not None  # replacing strings keeps a valid question valid
        # Keys remain text, and a legend keeps the original levels (references included).
        again.append(attrs.evolve(decoded, keys=by_name[name].keys, levels=by_name[name].levels))
    return SystemOnePlan(render_state(replaced["state"]), tuple(again),
                         tuple((markers[key], image) for key, image in images.items()))


def _assets(assets: Any, parts: Sequence[FormPart]) -> dict[str, ImagePart]:
    """Each asset's image: from its multipart part (which takes precedence) or its data_base64."""
    if not isinstance(assets, dict) or not assets:
        raise BadRequest("assets must be a nonempty object that maps each reference to an image asset", param="assets")
    by_part: dict[str, FormPart] = {}
    for part in parts:
        if part.name in by_part:
            raise BadRequest(f"multipart part names must be unique; '{part.name}' repeats", param="assets")
        by_part[part.name] = part
    owner: dict[str, str] = {}
    images: dict[str, ImagePart] = {}
    for key, asset in assets.items():
        where = f"assets.{key}"
        if not key:
            raise BadRequest("asset references must be nonempty strings", param="assets")
        if not isinstance(asset, dict):
            raise BadRequest(f"{where} must be an object", param="assets")
        extra = sorted(set(asset) - ASSET_FIELDS)
        if extra:
            raise BadRequest(f"{where}: unknown field(s) {', '.join(extra)}; an image asset has type, format, "
                             "data_base64 or part", param="assets")
        if asset.get("type", "image") != "image":
            raise BadRequest(f"{where}: only image assets are supported, not {asset.get('type')!r}", param="assets")
        fmt = asset.get("format")
        if fmt is not None and (not isinstance(fmt, str) or fmt.lower() not in ASSET_FORMATS):
            raise BadRequest(f"{where}.format must be png or jpeg", param="assets")
        name, encoded = asset.get("part"), asset.get("data_base64")
        if name is not None:
            if not isinstance(name, str) or name not in by_part:
                raise BadRequest(f"{where}.part names {name!r}, which is not a part of this multipart body",
                                 param="assets")
            if name in owner:
                raise BadRequest(f"multipart part '{name}' belongs to both assets '{owner[name]}' and '{key}'; every "
                                 "part must belong to exactly one asset", param="assets")
            owner[name] = key
            data = by_part[name].data
        elif isinstance(encoded, str):
            try:
                data = base64.b64decode(encoded, validate=True)
            except (ValueError, binascii.Error):
                raise BadRequest(f"{where}.data_base64 is not valid base64", param="assets") from None
        else:
            raise BadRequest(f"{where} needs data_base64 (a base64 string) or a multipart part", param="assets")
        actual = next((media for magic, media in _MAGIC if data.startswith(magic)), None)
        if actual is None:
            raise BadRequest(f"{where} is not PNG or JPEG data; System One image assets are PNG or JPEG",
                             param="assets")
        declared = ASSET_FORMATS[fmt.lower()] if isinstance(fmt, str) else actual
        images[key] = ImagePart(declared, data, where)
    stray = [p.name for p in parts if p.name not in owner]
    if stray:
        raise BadRequest(f"multipart part '{stray[0]}' belongs to no asset; every part must belong to exactly one "
                         "asset", param="assets")
    return images


class _Replacer:
    """References to assets in one string value: a whole-value match first, then nonoverlapping
    matches from left to right (the longest reference at a position)."""

    def __init__(self, markers: dict[str, str], used: set[str]) -> None:
        self.markers = markers
        self.used = used
        self.pattern = re.compile("|".join(re.escape(k) for k in sorted(markers, key=len, reverse=True)))

    def __call__(self, value: Any) -> Any:
        if isinstance(value, str):
            if value in self.markers:
                self.used.add(value)
                return self.markers[value]
            return self.pattern.sub(self._one, value)
        if isinstance(value, dict):  # keys remain text
            return {k: self(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self(v) for v in value]
        return value

    def _one(self, match: re.Match[str]) -> str:
        self.used.add(match.group())
        return self.markers[match.group()]


def _with_references(obj: dict[str, Any], replace: _Replacer) -> dict[str, Any]:
    """The request with references replaced in the state and in each question's instructions and
    criteria values (criteria keys remain text)."""
    questions = {}
    for name, q in obj["questions"].items():
        q = dict(q)
        if "instructions" in q:
            q["instructions"] = replace(q["instructions"])
        if isinstance(q.get("criteria"), dict):
            q["criteria"] = {k: replace(v) for k, v in q["criteria"].items()}
        elif isinstance(q.get("criteria"), list):
            q["criteria"] = [replace(v) for v in q["criteria"]]
        questions[name] = q
    return {**obj, "state": replace(obj["state"]), "questions": questions}


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
