"""The recipe table (spec, "Reasoning, sampling, and usage") and the `plain` fallback.

All recipes default to min_p 0, repetition_penalty 1 and zero presence/frequency penalties; disabled
top-k is stored as -1 (Step 5's recommended 0 means the same). Ranges span the model cards' task and
mode presets; a parameter without a range is fixed at its default.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from helios.domain.sampling import SamplingParams
from helios.recipes.base import EffortVocabulary, Range, Recipe

THINK = ("<think>", "</think>")

_QWEN_RANGES = {
    "temperature": Range(0.7, 1.0),
    "top_p": Range(0.8, 0.95),
    "presence_penalty": Range(0.0, 2.0),
}
_QWEN_EFFORT = EffortVocabulary(levels=("low", "medium", "xhigh"))
_DEEPSEEK_EFFORT = EffortVocabulary(levels=("low", "high", "xhigh", "max"), default="high")
_KIMI_EFFORT = EffortVocabulary(levels=("low", "high", "max"), default="max")


def _params(temperature: float, top_p: float, top_k: int = -1) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)


RECIPES: dict[str, Recipe] = {
    recipe.name: recipe
    for recipe in (
        Recipe(
            "qwen38",
            "Qwen3.8-Flash-Next thinking/instruct presets",
            _params(1.0, 0.95, 20),
            _QWEN_RANGES,
            output_parser="qwen3_coder",
            reasoning_parser="think",
            tool_parser="qwen3_coder",
            reasoning_delimiters=THINK,
            effort=_QWEN_EFFORT,
        ),
        Recipe(
            "qwen38_dense",
            "Qwen3.8-27B thinking/instruct presets",
            _params(1.0, 0.95, 20),
            _QWEN_RANGES,
            output_parser="qwen3_coder",
            reasoning_parser="think",
            tool_parser="qwen3_coder",
            reasoning_delimiters=THINK,
            effort=_QWEN_EFFORT,
        ),
        Recipe(
            "glm53",
            "GLM-5.3-Flash evaluation presets",
            _params(1.0, 0.95),
            {"temperature": Range(0.95, 1.0), "top_p": Range(0.95, 1.0)},
            output_parser="glm",
            reasoning_parser="think",
            tool_parser="glm",
            reasoning_delimiters=THINK,
        ),
        Recipe(
            "deepseek4",
            "DeepSeek-V4-Flash-Vision-Exp agent evaluations",
            _params(1.0, 0.95),
            output_parser="deepseek_v4",
            reasoning_parser="think_text",
            tool_parser="dsml",
            reasoning_delimiters=THINK,
            effort=_DEEPSEEK_EFFORT,
        ),
        Recipe(
            "deepseek41",
            "DeepSeek-V4.1-Flash-1017 recommendations (repetition-penalty range from measured use)",
            _params(1.0, 1.0),
            {"repetition_penalty": Range(1.0, 1.1)},
            output_parser="deepseek_v4",
            reasoning_parser="think_text",
            tool_parser="dsml",
            reasoning_delimiters=THINK,
            effort=EffortVocabulary(
                levels=("low", "high", "xhigh", "max"),
                default="high",
                numeric=(1, 100),
                scores={"low": 50, "high": 75, "xhigh": 75, "max": 100},
            ),
        ),
        Recipe(
            "mimo_v2",
            "MiMo-V2.6-Pro-MOPD deployment; MiMo-V2.6-Flash-RL deployment",
            _params(1.0, 0.95),
            output_parser="mimo",
            reasoning_parser="mimo_think",
            tool_parser="mimo_function_tags",
            reasoning_delimiters=THINK,
        ),
        Recipe(
            "kimi3",
            "Kimi-K3 single-step/agentic evaluations",
            _params(1.0, 1.0),
            {"top_p": Range(0.95, 1.0)},
            output_parser="kimi_k3",
            reasoning_parser="xtml",
            tool_parser="xtml",
            reasoning_delimiters=("<|open|>think<|sep|>", "<|close|>think<|sep|>"),
            effort=_KIMI_EFFORT,
        ),
        Recipe(
            "step5",
            "Step-5-Preview-NVFP4 inference recommendations",
            _params(1.0, 0.95),
            output_parser="function_tags",
            reasoning_parser="think",
            tool_parser="function_tags",
            reasoning_delimiters=THINK,
        ),
        Recipe(
            "nemotron_h",
            "Nemotron-3.5-Bolt text recommendations",
            _params(1.0, 0.95),
            output_parser="function_tags",
            reasoning_parser="think",
            tool_parser="function_tags",
            reasoning_delimiters=THINK,
        ),
        Recipe(
            "kimi31",
            "Kimi-K3.1-Pro evaluation settings",
            _params(1.0, 0.95),
            output_parser="kimi_k3",
            reasoning_parser="xtml",
            tool_parser="xtml",
            reasoning_delimiters=("<|open|>think<|sep|>", "<|close|>think<|sep|>"),
            effort=_KIMI_EFFORT,
        ),
        Recipe(
            "minimax_m3",
            "MiniMax-M3.1-Flash usage recommendations",
            _params(1.0, 0.95),
            output_parser="minimax_m2",
            reasoning_parser="think",
            tool_parser="minimax",
            reasoning_delimiters=THINK,
        ),
        Recipe(
            "muse_spark",
            "Muse-Spark-Open-816B-A42B-NVFP4 model card",
            _params(1.0, 1.0),
            output_parser="think_hermes",
            reasoning_parser="think",
            tool_parser="hermes",
            reasoning_delimiters=THINK,
        ),
        Recipe(
            "gemma4",
            "Gemma 4 model card sampling recommendations",
            _params(1.0, 0.95, 64),
            output_parser="gemma4",
            reasoning_parser="gemma4_channel",
            tool_parser="gemma4",
            reasoning_delimiters=("<|channel>thought", "<channel|>"),
        ),
    )
}

PLAIN_RANGES = {
    # Inclusive, finite, and every value within is a valid sampler value (spec: a card's ranges are
    # inclusive numeric bounds). Where the OpenAI API documents a range it is the one used
    # (temperature 0..2, penalties -2..2); elsewhere the widest useful values: top_p down to 0.001
    # (0 is not a nucleus), top_k up to the 32-bit maximum (-1 and 0 turn it off), a repetition
    # penalty 0.01..10.
    "temperature": Range(0.0, 2.0),
    "top_p": Range(0.001, 1.0),
    "top_k": Range(-1, 2**31 - 1),
    "min_p": Range(0.0, 1.0),
    "repetition_penalty": Range(0.01, 10.0),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
}


def plain_recipe(
    generation_config: Mapping[str, Any] | None = None, *, output_parser: str = "plain"
) -> Recipe:
    """The recipe for models without a declared one.

    Defaults come from the model's generation_config (temperature, top_p, top_k, repetition_penalty,
    min_p when present and valid), else vLLM's neutral defaults (temperature 1, top_p 1, top-k off).
    There are no author recommendations to clamp to, so — as vLLM does — every request value inside
    `PLAIN_RANGES` is used as given (temperature 0..2 with 0 greedy, top_p 0.001..1, top_k -1/0 (off)
    or 1..2**31-1, min_p 0..1, repetition_penalty 0.01..10, presence and frequency penalties -2..2)
    and a value outside them is rejected with HTTP 400 rather than clamped. The card publishes the
    same inclusive bounds.
    `output_parser` selects the output syntax (see `detect_parser_family`).
    """
    config = generation_config or {}
    defaults = SamplingParams(
        temperature=_config_float(config, "temperature", 1.0, lambda v: v >= 0),
        top_p=_config_float(config, "top_p", 1.0, lambda v: 0 < v <= 1),
        top_k=_config_top_k(config),
        min_p=_config_float(config, "min_p", 0.0, lambda v: 0 <= v <= 1),
        repetition_penalty=_config_float(config, "repetition_penalty", 1.0, lambda v: v > 0),
    )
    return Recipe(
        "plain",
        "the model's generation_config, else neutral defaults",
        defaults,
        PLAIN_RANGES,
        output_parser=output_parser,
        out_of_range="reject",
    )


def _config_float(config: Mapping[str, Any], key: str, fallback: float, valid: Any) -> float:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return fallback
    return float(value) if valid(value) else fallback


def _config_top_k(config: Mapping[str, Any]) -> int:
    value = config.get("top_k")
    if isinstance(value, bool) or not isinstance(value, int):
        return -1
    return value if value >= 1 else -1
