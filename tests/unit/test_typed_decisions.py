"""Typed request models of System One, decisions and Ollama discovery (helios/frontends/decisions,
helios/frontends/ollama/discovery.py): a bad value deep inside a body is reported at its path, in each
route's own error shape (System One's 422 detail entries with every failure, decisions' OpenAI 400,
Ollama's 400), and any JSON value anywhere in a valid body decodes or gives that shape."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helios.domain.model import ModelInfo
from helios.errors import BadRequest, NotFound
from helios.frontends.decisions.decisions import DecisionsPlan, decode_decisions
from helios.frontends.decisions.multipart import FormPart
from helios.frontends.decisions.systemone import SchemaErrors, SystemOnePlan, decode_systemone
from helios.frontends.ollama import discovery

PNG = b"\x89PNG\r\n\x1a\n" + bytes(24)
JPEG = b"\xff\xd8\xff" + bytes(24)
B64 = base64.b64encode(PNG).decode()
INFO = ModelInfo(
    model_id="org/model", aliases=("m",), created=0, max_model_len=8192, vocab_size=1000,
    default_max_tokens=256, max_concurrency=4, prefill_chunk_size=256, max_top_logprobs=20,
    prompt_logprobs=True, sampling_defaults={}, sampling_ranges={}, recipe="qwen38", has_bos=True,
)


def _schema_errors(body: Any) -> list[dict[str, Any]]:
    with pytest.raises(SchemaErrors) as err:
        decode_systemone(body)
    assert err.value.status == 422 and err.value.body() == {"detail": err.value.details}
    return err.value.details


# -- System One: every failure, each at its loc ------------------------------------------------------------


def test_every_nested_system_one_failure_is_listed_at_its_loc() -> None:
    body = {"model": "m", "state": "s", "colour": "red", "questions": {
        "ok": {"type": "noul", "instructions": "x"},
        "team": {"type": "choice", "instructions": 5, "criteria": {"billing": None, "support": True, "sales": "S"}},
        "urgency": {"type": "score", "criteria": ["low", None, {"x": 1}, False], "extra": 1},
        "broken": [1],
    }}
    assert _schema_errors(body) == [
        {"type": "extra_forbidden", "loc": ["body", "colour"], "msg": "Extra inputs are not permitted", "input": "red"},
        {"type": "instructions_type", "loc": ["body", "questions", "team", "choice", "instructions"],
         "msg": "Input should be a string, an object or an array", "input": 5},
        {"type": "description_type", "loc": ["body", "questions", "team", "choice", "criteria", "support"],
         "msg": "Input should be null, a string, an object or an array", "input": True},
        {"type": "extra_forbidden", "loc": ["body", "questions", "urgency", "score", "extra"],
         "msg": "Extra inputs are not permitted", "input": 1},
        {"type": "level_type", "loc": ["body", "questions", "urgency", "score", "criteria", 1],
         "msg": "Input should be a nonnull string, number, object or array", "input": None},
        {"type": "level_type", "loc": ["body", "questions", "urgency", "score", "criteria", 3],
         "msg": "Input should be a nonnull string, number, object or array", "input": False},
        {"type": "dict_type", "loc": ["body", "questions", "broken"], "msg": "Input should be a valid dictionary",
         "input": [1]},
    ]


@pytest.mark.parametrize(("question", "entry"), [
    ({"instructions": "x"}, {"type": "union_tag_not_found", "loc": ["body", "questions", "q"],
                             "msg": "Unable to extract tag using discriminator 'type'"}),
    ({"type": None}, {"type": "union_tag_invalid", "loc": ["body", "questions", "q"],
                      "msg": "Input tag 'None' found using 'type' does not match any of the expected tags: 'noul', "
                             "'choice', 'score'"}),
    ({"type": "noul"}, {"type": "missing", "loc": ["body", "questions", "q", "noul", "instructions"],
                        "msg": "Field required"}),
    ({"type": "noul", "instructions": None}, {"type": "instructions_type", "input": None,
                                              "loc": ["body", "questions", "q", "noul", "instructions"],
                                              "msg": "Input should not be null"}),
    ({"type": "choice", "criteria": []}, {"type": "dict_type", "loc": ["body", "questions", "q", "choice", "criteria"],
                                          "msg": "Input should be a valid dictionary", "input": []}),
    ({"type": "score", "criteria": {}}, {"type": "list_type", "loc": ["body", "questions", "q", "score", "criteria"],
                                         "msg": "Input should be a valid list", "input": {}}),
    ({"type": "score", "criteria": []}, {"type": "too_short", "loc": ["body", "questions", "q", "score", "criteria"],
                                         "msg": "List should have at least 1 item after validation, not 0",
                                         "input": []}),
])
def test_a_system_one_question_failure(question: dict[str, Any], entry: dict[str, Any]) -> None:
    (detail,) = _schema_errors({"model": "m", "state": "s", "questions": {"q": question}})
    assert {k: detail[k] for k in entry} == entry
    if "input" not in entry:  # the object that holds the failure
        assert detail["input"] == question


def test_a_system_one_body_that_is_no_object_and_a_missing_field() -> None:
    assert _schema_errors([1]) == [{"type": "dict_type", "loc": ["body"], "msg": "Input should be a valid dictionary",
                                    "input": [1]}]
    body = {"model": ["m"], "questions": {"q": {"type": "noul", "instructions": "x"}}}
    assert [(d["type"], d["loc"]) for d in _schema_errors(body)] == [
        ("string_type", ["body", "model"]), ("missing", ["body", "state"])]


def test_the_422_comes_before_an_unsupported_kind_and_an_asset_problem() -> None:
    body = {"model": "m", "state": "s", "assets": 5,
            "questions": {"a": {"type": "box"}, "b": {"type": "choice", "criteria": {}}}}
    assert [d["loc"] for d in _schema_errors(body)] == [["body", "questions", "b", "choice", "criteria"]]
    with pytest.raises(BadRequest) as err:
        decode_systemone({**body, "questions": {"a": {"type": "box", "anything": 1}}})
    assert (err.value.message, err.value.param) == (
        "question type 'box' is not supported; use noul, choice or score", "questions")


@pytest.mark.parametrize(("asset", "message"), [
    ({"part": ["p"]}, "assets.img.part names ['p'], which is not a part of this multipart body"),
    ({"data_base64": B64, "format": 5}, "assets.img.format must be png or jpeg"),
    ({"data_base64": None}, "assets.img needs data_base64 (a base64 string) or a multipart part"),
    ({"type": None, "url": "x", "data_base64": B64}, "assets.img: unknown field(s) url; an image asset has type, "
                                                      "format, data_base64 or part"),
    ({"type": None, "data_base64": B64}, "assets.img: only image assets are supported, not None"),
    ("img.png", "assets.img must be an object"),
])
def test_an_asset_failure_names_its_path(asset: Any, message: str) -> None:
    body = {"model": "m", "state": "img", "questions": {"q": {"type": "noul", "instructions": "x"}},
            "assets": {"img": asset}}
    with pytest.raises(BadRequest) as err:
        decode_systemone(body, vision=True, danger_zone=True)
    assert (err.value.message, err.value.param, err.value.status) == (message, "assets", 400)


def test_a_part_wins_over_data_base64_which_is_then_not_read() -> None:
    body = {"model": "m", "state": "img", "questions": {"q": {"type": "noul", "instructions": "x"}},
            "assets": {"img": {"part": "p", "data_base64": 5, "format": "JPG"}}}
    plan = decode_systemone(body, vision=True, danger_zone=True, parts=[FormPart("p", "image/jpeg", JPEG)])
    ((_, image),) = plan.images
    assert (image.media_type, image.data, image.where) == ("image/jpeg", JPEG, "assets.img")


# -- decisions: the message names the path, param the top-level field ---------------------------------------

PREDICATE = {"type": "predicate", "instructions": "Refund?"}
CHOICE = {"type": "choice", "instructions": "Team?", "choices": [{"value": "a"}, {"value": True, "description": "d"}]}
SCORE = {"type": "score", "instructions": "Urgency?", "levels": [{"label": "low"}, {"label": "high"}]}


def _decisions(**body: Any) -> DecisionsPlan:
    return decode_decisions({"model": "m", "input": "x", "questions": [PREDICATE, CHOICE, SCORE], **body})


BAD_DECISIONS = [
    ({"questions": [PREDICATE, {**CHOICE, "choices": [{"value": "a"}, {"value": 3}]}]}, "questions",
     "invalid value for questions[1].choices[1].value: expected a string or a boolean, got integer"),
    ({"questions": [PREDICATE, {**SCORE, "levels": [{"label": "a"}, {"label": "b", "description": None}]}]},
     "questions", "questions[1].levels[1].description must be a string when present"),
    ({"questions": [{**PREDICATE, "name": None}]}, "questions", "questions[0].name must be a string when present"),
    ({"questions": [PREDICATE, {**SCORE, "levels": [{"label": "a"}, {"label": "b", "colour": 1}]}]}, "questions",
     "unrecognized request argument(s): colour in questions[1].levels[1]"),
    ({"questions": [PREDICATE, {**PREDICATE, "choices": []}]}, "questions",
     "unrecognized request argument(s): choices in questions[1]"),
    ({"questions": [{**PREDICATE, "type": ["predicate"]}]}, "questions",
     "questions[0].type: ['predicate'] is not supported; expected 'predicate', 'choice' or 'score'"),
    ({"questions": [PREDICATE, {**CHOICE, "choices": [{"value": "a"}, {"value": "a"}]}]}, "questions",
     "questions[1].choices values must be distinct"),
    ({"questions": [PREDICATE, {**SCORE, "levels": [{"label": "a"}]}]}, "questions",
     "questions[1].levels must be an array of 2 to 10 levels"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "user", "content": [
        {"type": "text", "text": "b"}, {"type": "input_image", "image_url": "data:,"}]}]}, "input",
     "input[1].content[1].type: images and assets are not supported on /v1/decisions"),
    ({"input": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "input",
     "invalid value for input[0].content[0].text: expected a string, got int"),
    ({"input": [{"role": "assistant", "content": "a"}]}, "input", "input[0].role must be 'user'"),
    ({"input": []}, "input", "input must be a string or a nonempty array of user messages"),
    ({"safety_identifier": "s" * 129}, "safety_identifier",
     "safety_identifier must be a string of at most 128 characters"),
    ({"model": None}, "model", "invalid value for model: expected a string, got NoneType"),
]


@pytest.mark.parametrize(("body", "param", "message"), BAD_DECISIONS, ids=[m[:40] for _, _, m in BAD_DECISIONS])
def test_a_bad_decisions_value_names_its_path(body: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(BadRequest) as err:
        _decisions(**body)
    assert (err.value.param, err.value.message, err.value.status) == (param, message, 400)


def test_a_decisions_body_decodes_to_ordered_questions() -> None:
    plan = _decisions(safety_identifier=None, input=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "text",
                                                                                              "text": "b"}]},
        {"role": "user", "content": "c"}])
    assert plan.input == "a\nb\n\nc"
    predicate, choice, score = plan.questions
    assert (predicate.kind, predicate.name, predicate.question.kind) == ("predicate", None, "binary")
    assert choice.values == ("a", True) and choice.question.options == ("a", "true — d")
    assert score.values == ("low", "high") and score.question.kind == "levels"


# -- Ollama /api/show --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "param"), [({}, "model"), ({"model": ""}, "model"), ({"model": ["m"]}, "model"),
                                             ({"model": "m", "verbose": "yes"}, "verbose")])
def test_a_bad_show_body_names_its_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as err:
        discovery.show(INFO, body)
    assert err.value.param == param and param in err.value.message
    assert err.value.to_ollama() == {"error": err.value.message}


def test_show_ignores_keys_it_does_not_read() -> None:
    assert discovery.show(INFO, {"model": "m", "name": "x", "options": {}})["capabilities"] == ["completion"]


# -- any JSON value anywhere ----------------------------------------------------------------------------

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=8) | st.sampled_from(["noul", "choice", "score", "box", "image", "png", B64,
                                                             "p", "predicate", "user", "text", "input_image"]),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=8)
SYSTEM_ONE = {"model": "m", "state": {"photo": "receipt", "note": ["see receipt2"]}, "questions": {
    "refund": {"type": "noul", "instructions": "Is receipt a refund?"},
    "team": {"type": "choice", "instructions": {"ask": "Team?"}, "criteria": {"billing": None, "support": "receipt2"}},
    "urgency": {"type": "score", "criteria": ["low", {"level": 2}, 3]}},
    "assets": {"receipt": {"type": "image", "format": "png", "data_base64": B64},
               "receipt2": {"format": "jpeg", "part": "p"}}}
DECISIONS = {"model": "m", "safety_identifier": "u", "input": [
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "text", "text": "b"}]},
    {"role": "user", "content": "c"}], "questions": [{**PREDICATE, "name": "p"}, CHOICE, SCORE]}


def _paths(value: Any, here: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [here]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*here, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*here, i))
    return out


def _replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    out = copy.copy(value)
    out[path[0]] = _replace(value[path[0]], path[1:], new)
    return out


@settings(max_examples=400, deadline=None, derandomize=True)
@given(data=st.data())
def test_any_value_anywhere_in_a_system_one_body_decodes_or_is_its_422_or_400(data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(_paths(SYSTEM_ONE)[1:]), label="path")
    body = _replace(SYSTEM_ONE, path, data.draw(JSON, label="value"))
    try:
        plan = decode_systemone(body, model="vlm", vision=True, danger_zone=True,
                                parts=[FormPart("p", "image/jpeg", JPEG)])
    except SchemaErrors as exc:
        assert exc.status == 422 and exc.details
        for entry in exc.details:
            assert set(entry) == {"type", "loc", "msg", "input"} and entry["loc"][:2] == ["body", path[0]], (path, entry)
        json.dumps(exc.body())  # the entries' inputs are the body's own JSON values
    except BadRequest as exc:
        assert exc.status == 400 and exc.param in ("assets", "questions"), (path, exc.param, exc.message)
    else:
        assert isinstance(plan, SystemOnePlan) and len(plan.questions) == len(body["questions"])


@settings(max_examples=400, deadline=None, derandomize=True)
@given(data=st.data())
def test_any_value_anywhere_in_a_decisions_body_decodes_or_is_a_400_naming_its_field(data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(_paths(DECISIONS)[1:]), label="path")
    body = _replace(DECISIONS, path, data.draw(JSON, label="value"))
    try:
        plan = decode_decisions(body)
    except BadRequest as exc:
        assert exc.status == 400 and exc.param == path[0], (path, exc.param, exc.message)
        assert exc.message.startswith(path[0]) or f" {path[0]}" in exc.message, (path, exc.message)
    else:
        assert isinstance(plan, DecisionsPlan) and len(plan.questions) == len(body["questions"])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(field=st.sampled_from(["model", "verbose", "other"]), value=JSON)
def test_any_value_in_a_show_body_is_metadata_or_a_400_or_404(field: str, value: Any) -> None:
    try:
        shown = discovery.show(INFO, {"model": "m", "verbose": True, field: value})
    except NotFound as exc:
        assert field == "model" and exc.status == 404
    except BadRequest as exc:
        assert exc.param == field and exc.status == 400
    else:
        assert shown["details"]["format"] == "flare"
