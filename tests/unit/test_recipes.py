"""Recipes: the spec's sampling table, clamping per parameter, type errors, plain, effort, detection."""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import pytest

from helios.domain.sampling import SamplingParams, SamplingRequest
from helios.parsers import FAMILIES
from helios.recipes import (
    DISTRIBUTION_PARAMETERS,
    RECIPES,
    EffortError,
    Range,
    Recipe,
    SamplingParameterError,
    UnknownRecipeError,
    detect_parser_family,
    detect_recipe,
    effort_score,
    get_recipe,
    numeric_effort,
    plain_recipe,
    recipe_names,
    resolve_effort,
    resolve_sampling,
)
from tests.shared_fixtures import shared_fixtures

# The spec table, written out independently of the catalog: parameter -> (default, (min, max) | None).
# Parameters not listed use the shared defaults below and are fixed (no range).
SPEC: dict[str, dict[str, tuple[float, tuple[float, float] | None]]] = {
    "qwen38": {"temperature": (1, (0.7, 1)), "top_p": (0.95, (0.8, 0.95)), "top_k": (20, None), "presence_penalty": (0, (0, 2))},
    "qwen38_dense": {"temperature": (1, (0.7, 1)), "top_p": (0.95, (0.8, 0.95)), "top_k": (20, None), "presence_penalty": (0, (0, 2))},
    "glm53": {"temperature": (1, (0.95, 1)), "top_p": (0.95, (0.95, 1))},
    "deepseek4": {"top_p": (0.95, None)},
    "deepseek41": {"top_p": (1, None), "repetition_penalty": (1, (1, 1.1))},
    "mimo_v2": {"top_p": (0.95, None)},
    "kimi3": {"top_p": (1, (0.95, 1))},
    "step5": {"top_p": (0.95, None)},
    "nemotron_h": {"top_p": (0.95, None)},
    "kimi31": {"top_p": (0.95, None)},
    "minimax_m3": {"top_p": (0.95, None)},
    "muse_spark": {"top_p": (1, None)},
    "gemma4": {"top_p": (0.95, None), "top_k": (64, None)},
}  # fmt: skip
SHARED: dict[str, tuple[float, None]] = {
    "temperature": (1, None),
    "top_p": (1, None),
    "top_k": (-1, None),
    "min_p": (0, None),
    "repetition_penalty": (1, None),
    "presence_penalty": (0, None),
    "frequency_penalty": (0, None),
}
# Request values far below and far above any declared bound (all of the right type).
LOW = {"temperature": 0.0, "top_p": 0.05, "top_k": 1, "min_p": 0.0, "repetition_penalty": 0.5,
       "presence_penalty": -2.0, "frequency_penalty": -2.0}  # fmt: skip
HIGH = {"temperature": 9.0, "top_p": 1.0, "top_k": 4096, "min_p": 0.9, "repetition_penalty": 3.0,
        "presence_penalty": 2.5, "frequency_penalty": 2.5}  # fmt: skip


def spec_row(recipe: str, parameter: str) -> tuple[float, tuple[float, float] | None]:
    return SPEC[recipe].get(parameter, SHARED[parameter])


CLAMP_TABLE = [(recipe, parameter) for recipe in SPEC for parameter in DISTRIBUTION_PARAMETERS]


def test_catalog_holds_exactly_the_spec_recipes():
    assert set(RECIPES) == set(SPEC)
    assert set(recipe_names()) == {*SPEC, "plain"}


@pytest.mark.parametrize(("recipe_name", "parameter"), CLAMP_TABLE, ids=[f"{r}-{p}" for r, p in CLAMP_TABLE])
def test_clamping_table(recipe_name, parameter):
    recipe = get_recipe(recipe_name)
    default, bounds = spec_row(recipe_name, parameter)
    assert getattr(recipe.defaults, parameter) == default
    assert recipe.sampling_ranges_json()[parameter] == (
        None if bounds is None else {"min": bounds[0], "max": bounds[1]}
    )

    def resolved(value: float) -> float:
        return getattr(resolve_sampling(recipe, SamplingRequest(**{parameter: value})), parameter)

    assert resolved_omitted(recipe, parameter) == default
    if bounds is None:
        assert resolved(LOW[parameter]) == default
        assert resolved(HIGH[parameter]) == default
    else:
        assert resolved(LOW[parameter]) == bounds[0]
        assert resolved(HIGH[parameter]) == bounds[1]
        middle = (bounds[0] + bounds[1]) / 2
        assert resolved(middle) == pytest.approx(middle)


def resolved_omitted(recipe: Recipe, parameter: str) -> float:
    return getattr(resolve_sampling(recipe, SamplingRequest()), parameter)


def test_temperature_zero_becomes_the_declared_minimum_or_the_default():
    assert resolve_sampling(get_recipe("qwen38"), SamplingRequest(temperature=0)).temperature == 0.7
    assert resolve_sampling(get_recipe("glm53"), SamplingRequest(temperature=0)).temperature == 0.95
    assert resolve_sampling(get_recipe("deepseek4"), SamplingRequest(temperature=0)).temperature == 1.0


def test_omitted_fields_take_every_default_and_seed_is_request_controlled():
    recipe = get_recipe("gemma4")
    assert resolve_sampling(recipe, SamplingRequest()) == SamplingParams(
        temperature=1.0, top_p=0.95, top_k=64
    )
    assert resolve_sampling(recipe, SamplingRequest(seed=1234)).seed == 1234
    assert resolve_sampling(recipe, SamplingRequest(seed=-5)).seed == -5
    seeded = attrs.evolve(recipe, defaults=attrs.evolve(recipe.defaults, seed=7))
    assert resolve_sampling(seeded, SamplingRequest()).seed == 7


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "0.7"),
        ("temperature", True),
        ("temperature", math.nan),
        ("top_p", math.inf),
        ("top_p", [0.9]),
        ("top_k", 20.0),
        ("top_k", True),
        ("top_k", "20"),
        ("min_p", b"0.1"),
        ("repetition_penalty", False),
        ("presence_penalty", {"x": 1}),
        ("frequency_penalty", -math.inf),
        ("seed", 1.0),
        ("seed", True),
        ("seed", "7"),
        ("seed", 2**64),
    ],
)
def test_malformed_types_raise_a_value_error(field, value):
    for name in ("qwen38", "deepseek4", "plain"):  # also for parameters fixed at their default
        with pytest.raises(SamplingParameterError) as info:
            resolve_sampling(get_recipe(name), SamplingRequest(**{field: value}))
        assert isinstance(info.value, ValueError)
        assert info.value.parameter == field


def test_defaults_json_shape():
    assert get_recipe("qwen38").sampling_defaults_json() == {
        "seed": None,
        "temperature": 1.0,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
    }


def test_recipes_exported_without_ranges_fix_every_parameter():
    recipe = get_recipe("qwen38").without_ranges()
    assert all(v is None for v in recipe.sampling_ranges_json().values())
    request = SamplingRequest(temperature=0.8, top_p=0.9, presence_penalty=1.5)
    assert resolve_sampling(recipe, request) == get_recipe("qwen38").defaults


def test_ranges_must_contain_defaults_and_valid_values():
    with pytest.raises(ValueError, match="contain its default"):
        Recipe("bad", "", SamplingParams(temperature=1.0), {"temperature": Range(0.2, 0.5)})
    with pytest.raises(ValueError, match="positive"):
        Recipe("bad", "", SamplingParams(temperature=0.5), {"temperature": Range(0.0, 1.0)})
    with pytest.raises(ValueError, match="invalid sampler values"):
        Recipe("bad", "", SamplingParams(top_p=0.5), {"top_p": Range(0.5, 1.5)})
    with pytest.raises(ValueError, match="cannot have a range"):
        Recipe("bad", "", SamplingParams(), {"seed": Range(0, 1)})


def test_every_recipe_names_an_existing_parser_family():
    for recipe in RECIPES.values():
        assert recipe.output_parser in FAMILIES
        assert recipe.reasoning_delimiters is not None


# --- plain -------------------------------------------------------------------------------------------


def test_plain_uses_generation_config_defaults():
    recipe = plain_recipe(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 0, "repetition_penalty": 1.05, "do_sample": True}
    )
    assert recipe.defaults == SamplingParams(temperature=0.6, top_p=0.9, top_k=-1, repetition_penalty=1.05)
    assert plain_recipe(None).defaults == SamplingParams(temperature=1.0, top_p=1.0, top_k=-1)
    bad = plain_recipe({"temperature": "hot", "top_p": 0, "top_k": 2.5, "repetition_penalty": -1})
    assert bad.defaults == SamplingParams()
    assert get_recipe("plain", generation_config={"top_k": 50}).defaults.top_k == 50


def test_plain_accepts_valid_values_as_given_and_rejects_the_rest():
    recipe = plain_recipe()
    request = SamplingRequest(
        temperature=0.0,
        top_p=0.01,
        top_k=0,
        min_p=0.2,
        repetition_penalty=3.0,
        presence_penalty=-2,
        frequency_penalty=2,
    )
    assert resolve_sampling(recipe, request) == SamplingParams(
        temperature=0.0,
        top_p=0.01,
        top_k=-1,
        min_p=0.2,
        repetition_penalty=3.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
    )
    assert resolve_sampling(recipe, SamplingRequest(temperature=2.0, top_k=5)).temperature == 2.0
    for field, value in [
        ("temperature", -0.1),
        ("temperature", 2.01),
        ("top_p", 0.0),
        ("top_p", 0.0009),
        ("top_p", 1.01),
        ("top_k", -2),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 10.5),
        ("top_k", 2**31),
        ("presence_penalty", 2.1),
        ("frequency_penalty", -2.1),
    ]:
        with pytest.raises(SamplingParameterError):
            resolve_sampling(recipe, SamplingRequest(**{field: value}))


def test_plain_ranges_json_are_the_enforced_inclusive_bounds():
    """The card's bounds are inclusive numbers (spec), and exactly what the plain recipe enforces:
    each bound is accepted as given, a step past it is a 400."""
    recipe = plain_recipe()
    ranges = recipe.sampling_ranges_json()
    assert ranges["temperature"] == {"min": 0.0, "max": 2.0}
    assert ranges["presence_penalty"] == {"min": -2.0, "max": 2.0}
    for name, bounds in ranges.items():
        assert bounds is not None and all(isinstance(v, int | float) for v in bounds.values()), name
        step = 1 if name == "top_k" else 1e-6
        lo, hi = (int(bounds["min"]), int(bounds["max"])) if name == "top_k" else (bounds["min"], bounds["max"])
        for end in (lo, hi):
            resolved = getattr(resolve_sampling(recipe, SamplingRequest(**{name: end})), name)
            assert resolved == (-1 if name == "top_k" and end <= 0 else end), name
        for outside in (lo - step, hi + step):
            with pytest.raises(SamplingParameterError):
                resolve_sampling(recipe, SamplingRequest(**{name: outside}))


def test_unknown_recipe_name():
    with pytest.raises(UnknownRecipeError):
        get_recipe("qwen99")


# --- effort ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("recipe", "level", "expected"),
    [
        ("qwen38", "low", "low"),
        ("qwen38", "minimal", "low"),
        ("qwen38", "high", "xhigh"),
        ("qwen38", "max", "xhigh"),
        ("deepseek4", "medium", "high"),
        ("deepseek4", "max", "max"),
        ("kimi3", "xhigh", "max"),
        ("kimi3", "medium", "high"),
        ("gemma4", "high", None),
    ],
)
def test_resolve_effort(recipe, level, expected):
    assert resolve_effort(get_recipe(recipe), level) == expected


def test_effort_defaults_and_numeric_scores():
    assert get_recipe("deepseek4").effort.default == "high"
    assert get_recipe("kimi3").effort.default == "max"
    deepseek41 = get_recipe("deepseek41")
    assert numeric_effort(deepseek41, 80) == 80
    assert [effort_score(deepseek41, level) for level in ("low", "high", "xhigh", "max")] == [50, 75, 75, 100]
    for bad in (80.0, True, "80", 0, 101):
        with pytest.raises(EffortError):
            numeric_effort(deepseek41, bad)
    with pytest.raises(EffortError):
        numeric_effort(get_recipe("deepseek4"), 80)
    with pytest.raises(EffortError):
        resolve_effort(get_recipe("qwen38"), "extreme")


# --- detection ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_id", "arch", "expected"),
    [
        ("Qwen/Qwen3.8-Flash-Next", None, "qwen38"),
        ("Qwen/Qwen3.8-35B-A3B", None, "qwen38"),
        ("Qwen/Qwen3.8-27B", "Qwen3ForCausalLM", "qwen38_dense"),
        ("/models/qwen3_8-27b", None, "qwen38_dense"),
        ("zai-org/GLM-5.3-Flash", None, "glm53"),
        ("deepseek-ai/DeepSeek-V4-Flash-Vision-Exp", None, "deepseek4"),
        ("deepseek-ai/DeepSeek-V4.1-Flash-1017", None, "deepseek41"),
        ("XiaomiMiMo/MiMo-V2.6-Pro-MOPD", None, "mimo_v2"),
        ("moonshotai/Kimi-K3", None, "kimi3"),
        ("moonshotai/Kimi-K3.1-Pro", None, "kimi31"),
        ("stepfun-ai/Step-5-Preview-NVFP4", None, "step5"),
        ("nvidia/Nemotron-3.5-Bolt", None, "nemotron_h"),
        ("local/checkpoint", "NemotronHForCausalLM", "nemotron_h"),
        ("MiniMaxAI/MiniMax-M3.1-Flash", None, "minimax_m3"),
        ("meta/Muse-Spark-Open-816B-A42B-NVFP4", None, "muse_spark"),
        ("google/gemma-4-31B-it", None, "gemma4"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "LlamaForCausalLM", "plain"),
        ("Qwen/Qwen3-0.6B", "Qwen3ForCausalLM", "plain"),
        # Architecture rules (registry name / HF model_type, or the architectures class name).
        ("local/checkpoint", "glm4_moe", "glm53"),
        ("local/checkpoint", "Glm4MoeForCausalLM", "glm53"),
        ("local/checkpoint", "minimax_m2", "minimax_m3"),
        ("local/checkpoint", "MiniMaxM2ForCausalLM", "minimax_m3"),
        ("local/checkpoint", "mimo_v2_flash", "mimo_v2"),
        ("local/checkpoint", "MiMoV2FlashForCausalLM", "mimo_v2"),
        ("local/checkpoint", "gemma4", "gemma4"),
        ("local/checkpoint", "gpt_oss", "plain"),  # no harmony recipe: plain + the harmony parser
        ("local/checkpoint", "qwen3_moe", "plain"),  # Hermes JSON or function tags: the template decides
        ("local/checkpoint", "glm4v_moe", "plain"),
        # deepseek_v3 (DeepSeek-V3 / V3.1, Kimi K2): the syntaxes differ, so the template decides.
        ("deepseek-ai/DeepSeek-V3.1", "deepseek_v3", "plain"),
        ("moonshotai/Kimi-K2-Instruct", "deepseek_v3", "plain"),
        ("Qwen/Qwen3.8-Flash", "qwen3_moe", "qwen38"),  # the model id comes first
        # qwen3_next: a Qwen3.8 id with it is the MoE recipe; Qwen3-Next's own ids, the template decides.
        ("local/qwen3.8-80b", "qwen3_next", "qwen38"),
        ("Qwen/Qwen3-Next-80B-A3B-Instruct", "qwen3_next", "plain"),
        ("zai-org/GLM-5.3-Flash", "glm4_moe", "glm53"),
        ("MiniMaxAI/MiniMax-M3.1-Flash", "minimax_m2", "minimax_m3"),
    ],
)
def test_detect_recipe_by_id_and_arch(model_id, arch, expected):
    assert detect_recipe(model_id, arch) == expected


def test_detect_recipe_by_distinctive_template_markup():
    assert detect_recipe("x", None, '{{ "<|open|>message" }}<|sep|>') == "kimi3"
    assert detect_recipe("x", None, "<｜DSML｜tool_calls>") == "deepseek4"
    assert detect_recipe("x", None, "<|turn>model\n<|channel>thought") == "gemma4"
    assert detect_recipe("x", None, "<|im_start|><tool_call>") == "plain"


def _templates() -> Path | None:
    return shared_fixtures("chat_templates")


TEMPLATE_FAMILIES = {
    "deepseek_v3_1": "deepseek_v3_1",
    "deepseek_v3_2": "deepseek_v3_2",
    "gemma3": "plain",
    "gemma4": "gemma4",
    "glm4_6": "glm",
    "glm4_7_flash": "glm",
    "gpt_oss": "harmony",
    "kimi_k2": "kimi_k2",
    "kimi_k2_thinking": "kimi_k2",
    "mimo_vl": "think_hermes",
    "minimax_m2": "minimax_m2",
    "nemotron3_nano": "qwen3_coder",
    "nemotron_nano_v2": "nemotron_v2",
    "qwen3": "qwen3",
    "qwen3_5": "qwen3_coder",
    "qwen3_coder": "qwen3_coder",
    "qwen3_thinking_2507": "qwen3",
    "smollm3": "qwen3",
}


@pytest.mark.skipif(_templates() is None, reason="shared/fixtures/chat_templates not found")
@pytest.mark.parametrize(("template", "recipe"), [("nemotron3_nano", "nemotron_h"), ("nemotron_nano_v2", "plain")])
def test_nemotron_h_recipe_follows_the_template(template, recipe):
    directory = _templates()
    assert directory is not None
    text = (directory / f"{template}.jinja").read_text(encoding="utf-8")
    assert detect_recipe("local/checkpoint", "nemotron_h", text) == recipe


@pytest.mark.skipif(_templates() is None, reason="shared/fixtures/chat_templates not found")
@pytest.mark.parametrize(("template", "family"), sorted(TEMPLATE_FAMILIES.items()))
def test_detect_parser_family_from_fixture_templates(template, family):
    directory = _templates()
    assert directory is not None
    assert detect_parser_family((directory / f"{template}.jinja").read_text(encoding="utf-8")) == family
