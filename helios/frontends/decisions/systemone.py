"""POST /v1/systemone: the TypeSafe System One schema (noul, choice and score questions).

The request is declared once, as attrs classes structured by the strict wire converter
(`helios.frontends.wire`): `SystemOneWire`, its questions as a tagged union on ``type``, and the image
assets. Schema failures are Jev-style HTTP 422 bodies, ``{"detail": [{"type", "loc", "msg", "input"},
...]}`` with every failure found: the detailed converter collects them all, and `_schema_errors`
turns each one's path into its ``loc`` (a question's kind follows its name, as a discriminated
union's tag does). Malformed JSON, image assets without ``TypeSafe-Danger-Zone-Images: true`` or on a
text-only model, malformed or unused assets and unsupported question kinds are 400 in the Chat
Completions error shape.

Image assets (api.md, System One): ``assets`` maps a reference to ``{"type": "image", "format":
"png"|"jpeg", "data_base64": ...}`` or, in a multipart/form-data body, ``{"part": NAME}`` (the part
wins over data_base64; every part belongs to exactly one asset). A reference replaces string values
of the state, instructions and criteria (nonoverlapping matches left to right, the longest reference at
a position, so a value that is a reference is replaced whole); keys remain text and legends keep the
original references. Unused assets are rejected.

Answers: noul is P(yes) normalized over the two labels; choice returns the most probable criterion
(the first on a tie), the named probabilities and the Jev choice confidence; score returns the
probability-weighted zero-based level, the original levels as ``legend``, indexed probabilities and the
Jev score confidence. Normalizing label probabilities is not an empirical calibration.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Literal, NewType, TypeVar, get_origin

import attrs
import cattrs
from cattrs.errors import (
    AttributeValidationNote,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)

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
from helios.domain.images import sniff
from helios.errors import BadRequest, UnprocessableEntity
from helios.frontends.decisions.multipart import FormPart
from helios.frontends.fields import honoured, wire_field
from helios.frontends.wire import (
    DETAILED,
    FAST,
    Base64Bytes,
    Invalid,
    loads_strict,
    register_leaf,
    structure,
)

N = TypeVar("N")

MAX_QUESTIONS = 64
MAX_CRITERIA = 128
MAX_LEVELS = 10


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


ASSET_FORMATS = {"png": "image/png", "jpeg": "image/jpeg", "jpg": "image/jpeg"}
DANGER_ZONE_HEADER = "typesafe-danger-zone-images"

Replace = Callable[[Any], Any]
"""A JSON value with its asset references replaced (`_replacer`), or as it is."""


# -- the schema's leaves: JSON values kept as given, each refused with its own Jev entry ---------------


class SchemaFailure(Invalid):
    """A value the schema refuses: one Jev detail entry's ``type`` (`kind`) and ``msg``."""

    def __init__(self, kind: str, msg: str) -> None:
        super().__init__(msg)
        self.kind = kind


_TEXT = (str, dict, list)
_TEXT_MSG = "Input should be a string, an object or an array"


def _json_leaf(t: Any, kinds: tuple[type, ...], kind: str, msg: str, *, nullable: bool = False,
               null_msg: str | None = None) -> None:
    """`t` takes a JSON value of one of `kinds` (and null where `nullable`) as it is."""

    def hook(v: Any, _t: Any) -> Any:
        if type(v) in kinds or (nullable and v is None):
            return v
        raise SchemaFailure(kind, null_msg if v is None and null_msg is not None else msg)

    register_leaf(t, hook)


State = NewType("State", object)
"""The state: a string, an object or an array (an object or array is shown as JSON)."""
_json_leaf(State, _TEXT, "state_type", _TEXT_MSG)
Instructions = NewType("Instructions", object)
"""A noul question's instructions: a string, an object or an array."""
_json_leaf(Instructions, _TEXT, "instructions_type", _TEXT_MSG, null_msg="Input should not be null")
OptionalInstructions = NewType("OptionalInstructions", object)
"""A choice or score question's instructions: as `Instructions`, or null (a default question)."""
_json_leaf(OptionalInstructions, _TEXT, "instructions_type", _TEXT_MSG, nullable=True)
Description = NewType("Description", object)
"""A choice criterion's description: null, a string, an object or an array."""
_json_leaf(Description, _TEXT, "description_type", "Input should be null, a string, an object or an array",
           nullable=True)
Level = NewType("Level", object)
"""A score level: a string, a number, an object or an array."""
_json_leaf(Level, (*_TEXT, int, float), "level_type", "Input should be a nonnull string, number, object or array")


def _sized(t: Any, most: int) -> None:
    """`t`, a NewType of a dict or list, takes 1 to `most` items (its container and size are checked
    first; in detail, the converter's collection hook then collects every failing item)."""
    whole = t.__supertype__
    container = get_origin(whole)
    noun, after, wrong = (("Dictionary", "", ("dict_type", "Input should be a valid dictionary")) if container is dict
                          else ("List", " after validation", ("list_type", "Input should be a valid list")))

    def factory(_t: Any, converter: cattrs.Converter) -> Callable[[Any, Any], Any]:
        items = converter.get_structure_hook(whole)

        def hook(v: Any, _t: Any) -> Any:
            if type(v) is not container:
                raise SchemaFailure(*wrong)
            if not 1 <= len(v) <= most:
                kind, bound = ("too_short", "at least 1 item") if not v else ("too_long", f"at most {most} items")
                raise SchemaFailure(kind, f"{noun} should have {bound}{after}, not {len(v)}")
            return items(v, whole)

        return hook

    for converter in (FAST, DETAILED):
        converter.register_structure_hook_factory(lambda x: x == t, factory)


# -- the request -------------------------------------------------------------------------------------

Criteria = NewType("Criteria", dict[str, Description])
"""A choice question's criteria: 1 to 128 named options, each with a description or null."""
_sized(Criteria, MAX_CRITERIA)
Levels = NewType("Levels", list[Level])
"""A score question's levels: 1 to 10, lowest first."""
_sized(Levels, MAX_LEVELS)


@attrs.define(kw_only=True)
class NoulQuestion:
    type: Literal["noul"]
    instructions: Instructions

    def named(self, name: str, replace: Replace) -> NamedQuestion:
        return NamedQuestion(name, self.type, DecisionQuestion("binary", render_value(replace(self.instructions))))


@attrs.define(kw_only=True)
class ChoiceQuestion:
    type: Literal["choice"]
    instructions: OptionalInstructions = OptionalInstructions(None)
    criteria: Criteria

    def named(self, name: str, replace: Replace) -> NamedQuestion:
        """Keys remain text: references are replaced in the instructions and descriptions only."""
        options = tuple(key if desc is None else f"{key} — {render_value(replace(desc))}"
                        for key, desc in self.criteria.items())
        text = "Which option fits the state best?" if self.instructions is None else render_value(
            replace(self.instructions))
        return NamedQuestion(name, self.type, DecisionQuestion("options", text, options), keys=tuple(self.criteria))


@attrs.define(kw_only=True)
class ScoreQuestion:
    type: Literal["score"]
    instructions: OptionalInstructions = OptionalInstructions(None)
    criteria: Levels

    def named(self, name: str, replace: Replace) -> NamedQuestion:
        """The legend keeps the levels as supplied, references included."""
        text = "Which level fits the state best?" if self.instructions is None else render_value(
            replace(self.instructions))
        options = tuple(render_value(replace(level)) for level in self.criteria)
        return NamedQuestion(name, self.type, DecisionQuestion("levels", text, options), levels=tuple(self.criteria))


@attrs.define(kw_only=True)
class UnsupportedQuestion:
    """Box, audio/video and custom questions: the schema knows them, this server does not answer
    them (a 400 once the request matches the schema; their other keys are not read)."""

    __wire_lenient__: ClassVar[bool] = True
    type: Literal["box", "audio", "video", "custom"]

    def named(self, name: str, replace: Replace) -> NamedQuestion:
        raise BadRequest(f"question type '{self.type}' is not supported; use noul, choice or score",
                         param="questions")


Question = NoulQuestion | ChoiceQuestion | ScoreQuestion | UnsupportedQuestion
_KINDS = (NoulQuestion, ChoiceQuestion, ScoreQuestion)
Questions = NewType("Questions", dict[str, Question])
"""1 to 64 named questions."""
_sized(Questions, MAX_QUESTIONS)


@attrs.define(kw_only=True)
class SystemOneWire:
    model: str = wire_field(honoured("required; one model is served, and the answer names it"), required=True)
    state: State = wire_field(honoured("what every question is asked about"), required=True)
    questions: Questions = wire_field(honoured("the named questions, answered by name"), required=True)
    assets: Any = wire_field(honoured(
        "image assets: structured after the danger-zone header and the model's vision are checked (400s)"))

    def named(self, replace: Replace) -> tuple[NamedQuestion, ...]:
        return tuple(q.named(name, replace) for name, q in self.questions.items())


# -- image assets ------------------------------------------------------------------------------------

ImageFormat = NewType("ImageFormat", str)
"""An asset's ``format`` (png, jpeg or jpg, in any case), structured as its media type."""


def _image_format(v: Any, _t: Any) -> str:
    media = ASSET_FORMATS.get(v.lower()) if type(v) is str else None
    if media is None:
        raise Invalid("must be png or jpeg")
    return media


register_leaf(ImageFormat, _image_format)


@attrs.define(kw_only=True)
class ImageAsset:
    type: Literal["image"] = "image"
    format: ImageFormat | None = None
    """Absent: the media type the data's signature shows."""
    part: str | None = None
    """The name of a multipart part: the image's bytes."""
    data_base64: Any = None
    """The image's base64 bytes, read only without a part: the part takes precedence (api.md)."""


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
    w = structure(obj, SystemOneWire, failure=lambda exc: SchemaErrors(list(_entries(exc, obj, ["body"], None))))
    plain = w.named(lambda value: value)  # an unsupported question kind is its 400
    if w.assets is None and not parts:
        return SystemOnePlan(render_state(w.state), plain)
    if not danger_zone:
        raise BadRequest("image assets require the TypeSafe-Danger-Zone-Images: true header", param="assets")
    if not vision:
        raise BadRequest(f"model {model} does not accept image input (it is text-only)", param="assets")
    images = _assets(w.assets, parts)
    nonce = secrets.token_hex(8)
    markers = {key: f"\ue000{nonce}#{i}\ue001" for i, key in enumerate(images)}
    used: set[str] = set()
    replace = _replacer(markers, used)
    state, questions = render_state(replace(w.state)), w.named(replace)
    unused = [key for key in images if key not in used]
    if unused:
        raise BadRequest(f"asset '{unused[0]}' is not referenced by the state, instructions or criteria; unused "
                         "assets are rejected", param="assets")
    return SystemOnePlan(state, questions, tuple((markers[key], image) for key, image in images.items()))


def _assets(assets: Any, parts: Sequence[FormPart]) -> dict[str, ImagePart]:
    """Each asset's image, in order: from its multipart part (which takes precedence) or its
    data_base64."""
    if type(assets) is not dict or not assets:
        raise BadRequest("assets must be a nonempty object that maps each reference to an image asset", param="assets")
    by_part: dict[str, FormPart] = {}
    for part in parts:
        if by_part.setdefault(part.name, part) is not part:
            raise BadRequest(f"multipart part names must be unique; '{part.name}' repeats", param="assets")
    owner: dict[str, str] = {}
    images = {key: _image(key, asset, by_part, owner) for key, asset in assets.items()}
    stray = [p.name for p in parts if p.name not in owner]
    if stray:
        raise BadRequest(f"multipart part '{stray[0]}' belongs to no asset; every part must belong to exactly one "
                         "asset", param="assets")
    return images


def _image(key: str, value: Any, by_part: dict[str, FormPart], owner: dict[str, str]) -> ImagePart:
    """One asset's image: the bytes of the part it names, else its decoded data_base64."""
    where = f"assets.{key}"
    if not key:
        raise BadRequest("asset references must be nonempty strings", param="assets")
    asset = structure(value, ImageAsset, failure=lambda exc: _asset_failure(exc, where, value))
    data: bytes
    if asset.part is None:  # owner records which asset took each part (every part belongs to one)
        data = structure(asset.data_base64, Base64Bytes, failure=lambda exc: BadRequest(
            f"{where}.data_base64 is not valid base64" if isinstance(exc, Invalid)
            else f"{where} needs data_base64 (a base64 string) or a multipart part", param="assets"))
    elif asset.part not in by_part:
        raise BadRequest(_ASSET_MESSAGES["part"].format(where=where, value=asset.part), param="assets")
    elif asset.part in owner:
        raise BadRequest(f"multipart part '{asset.part}' belongs to both assets '{owner[asset.part]}' and "
                         f"'{key}'; every part must belong to exactly one asset", param="assets")
    else:
        owner[asset.part] = key
        data = by_part[asset.part].data
    actual = sniff(data)
    if actual not in ("image/png", "image/jpeg"):
        raise BadRequest(f"{where} is not PNG or JPEG data; System One image assets are PNG or JPEG", param="assets")
    return ImagePart(asset.format or actual, data, where)


_ASSET_MESSAGES = {
    "type": "{where}: only image assets are supported, not {value!r}",
    "format": "{where}.format must be png or jpeg",
    "part": "{where}.part names {value!r}, which is not a part of this multipart body",
}


def _asset_failure(exc: BaseException, where: str, asset: Any) -> BadRequest:
    """An asset's first failure as its 400: unknown keys first, then its fields in order."""
    if not isinstance(exc, ClassValidationError):
        return BadRequest(f"{where} must be an object", param="assets")
    extra = sorted(_extra_keys(exc))
    if extra:
        return BadRequest(f"{where}: unknown field(s) {', '.join(extra)}; an image asset has type, format, "
                          "data_base64 or part", param="assets")
    name = _note(exc.exceptions[0], AttributeValidationNote).name
    return BadRequest(_ASSET_MESSAGES[name].format(where=where, value=asset.get(name)), param="assets")


def _replacer(markers: dict[str, str], used: set[str]) -> Replace:
    """References to assets in a JSON value's strings: nonoverlapping matches from left to right, the
    longest reference at a position (so a string that is a reference is replaced whole); each
    reference found is added to `used`."""
    pattern = re.compile("|".join(re.escape(k) for k in sorted(markers, key=len, reverse=True)))

    def marker(match: re.Match[str]) -> str:
        used.add(match.group())
        return markers[match.group()]

    def replace(value: Any) -> Any:
        if isinstance(value, str):
            return pattern.sub(marker, value)
        if isinstance(value, dict):  # keys remain text
            return {k: replace(v) for k, v in value.items()}
        if isinstance(value, list):
            return [replace(v) for v in value]
        return value

    return replace


def encode_systemone(plan: SystemOnePlan, scores: Sequence[QuestionScore], model: str) -> dict[str, Any]:
    """The response body for the label scorer's `scores` of `plan.questions` (in order)."""
    answers = {q.name: _answer(q, s) for q, s in zip(plan.questions, scores, strict=True)}
    usage = {"input_tokens": sum(s.num_prompt_tokens for s in scores),
             "output_tokens": sum(s.num_output_tokens for s in scores)}
    return {"model": model, "answers": answers, "usage": usage}


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


# -- schema failures as Jev detail entries -------------------------------------------------------------


def _entries(exc: BaseException, value: Any, loc: list[Any], expected: Any) -> Iterator[dict[str, Any]]:
    """The detail entries of one failure of the detailed converter (a leaf, or cattrs' group of a
    class's or a collection's failures) for `value` at `loc`; `expected` is its declared type."""
    if isinstance(exc, ClassValidationError):
        yield from _class_entries(exc, value, loc)
    elif isinstance(exc, IterableValidationError):
        for sub in exc.exceptions:
            note = _note(sub, IterableValidationNote)
            yield from _entries(sub, value[note.index], [*loc, note.index], note.type)
    else:
        yield _leaf_entry(exc, value, loc, expected)


def _class_entries(exc: ClassValidationError, value: dict[str, Any], loc: list[Any]) -> Iterator[dict[str, Any]]:
    """An object's unknown keys first (in the body's order), then its fields' failures in field
    order. A question's kind follows its name in the path (the discriminated union's tag)."""
    here = [*loc, value["type"]] if exc.cl in _KINDS else loc
    extra = _extra_keys(exc)
    for key in (k for k in value if k in extra):
        yield _error("extra_forbidden", [*here, key], "Extra inputs are not permitted", value[key])
    for sub in exc.exceptions:
        if not isinstance(sub, ForbiddenExtraKeysError):
            note = _note(sub, AttributeValidationNote)
            # a missing field's input is the object that lacks it
            yield from _entries(sub, value.get(note.name, value), [*here, note.name], note.type)


def _leaf_entry(exc: BaseException, value: Any, loc: list[Any], expected: Any) -> dict[str, Any]:
    if isinstance(exc, SchemaFailure):
        return _error(exc.kind, loc, exc.reason, value)
    if isinstance(exc, KeyError):
        return _error("missing", loc, "Field required", value)
    if isinstance(exc, Invalid) and exc.at == "type":  # the questions' union has no member for the tag
        if "type" not in value:
            return _error("union_tag_not_found", loc, "Unable to extract tag using discriminator 'type'", value)
        return _error("union_tag_invalid", loc, f"Input tag '{value['type']}' found using 'type' does not match any "
                      "of the expected tags: 'noul', 'choice', 'score'", value)
    if isinstance(exc, TypeError):  # a string field's value, or an object's
        return (_error("string_type", loc, "Input should be a valid string", value) if expected is str else
                _error("dict_type", loc, "Input should be a valid dictionary", value))
    raise exc  # not the client's error


def _extra_keys(exc: ClassValidationError) -> set[str]:
    return {key for e in exc.exceptions if isinstance(e, ForbiddenExtraKeysError) for key in e.extra_fields}


def _note(exc: BaseException, kind: type[N]) -> N:
    """The note cattrs' detailed converter left on `exc`: the attribute or index it failed at."""
    return next(n for n in getattr(exc, "__notes__", ()) if isinstance(n, kind))


def _error(kind: str, loc: list[Any], msg: str, value: Any) -> dict[str, Any]:
    return {"type": kind, "loc": loc, "msg": msg, "input": value}
