"""Recipe selection: by explicit name, else by model id / architecture, else by template markup.

The architecture is the registry name the runtime passes (the HF ``model_type``: ``glm4_moe``,
``minimax_m2``, ``mimo_v2_flash``, ``gemma4``) or an HF architectures class name; a family has a
rule only when all its checkpoints write one syntax (`_ARCH_RULES`).

Template markup only selects a recipe for unmistakable syntaxes (XTML, DSML `tool_calls`, Gemma 4
channels, MiniMax namespaced calls); other models fall back to `plain`, whose output parser family
`detect_parser_family` infers from the chat template.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from helios.recipes.base import Recipe
from helios.recipes.catalog import RECIPES, plain_recipe


class UnknownRecipeError(KeyError):
    """A configured recipe name that does not exist (a start-up configuration error)."""


_SEP = r"[-_. ]?"
_ID_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("gemma4", re.compile(rf"gemma{_SEP}4")),
    ("deepseek41", re.compile(rf"deepseek{_SEP}v4{_SEP}1(?!\d)")),
    ("deepseek4", re.compile(rf"deepseek{_SEP}v4(?!\d)")),
    ("kimi31", re.compile(rf"kimi{_SEP}k3{_SEP}1(?!\d)")),
    ("kimi3", re.compile(rf"kimi{_SEP}k3(?!\d)")),
    ("glm53", re.compile(rf"glm{_SEP}5{_SEP}3(?!\d)")),
    ("mimo_v2", re.compile(rf"mimo{_SEP}v2")),
    ("step5", re.compile(rf"step{_SEP}5(?!\d)")),
    ("nemotron_h", re.compile(rf"nemotron{_SEP}3{_SEP}5(?!\d)|nemotron.*bolt")),
    ("minimax_m3", re.compile(rf"minimax{_SEP}m3(?!\d)")),
    ("muse_spark", re.compile(rf"muse{_SEP}spark")),
)
_QWEN38 = re.compile(rf"qwen{_SEP}3{_SEP}8(?!\d)")
_MOE_HINT = re.compile(r"flash|next|moe|(?<![a-z0-9])a\d+(\.\d+)?b")
# Qwen2.5's tools instruction and default identity. Qwen3 templates repeat both but also mention
# <think>; MiMo-VL's (Qwen2.5-VL-derived, reasoning without <think> in its template) has the
# instruction under its own identity.
_QWEN25_TOOLS = "return a json object with function name and arguments within <tool_call>"
_QWEN25_IDENTITY = "You are Qwen, created by Alibaba Cloud"
# Architecture needles, matched against the registry name / HF model_type or architectures class
# with separators dropped ("glm4_moe", "Glm4MoeForCausalLM" -> "glm4moe..."). Only families whose
# every checkpoint writes one syntax have a rule: GLM-4.5-4.7 (glm4_moe) all use the GLM
# <arg_key> calls, MiniMax-M2 (minimax_m2) the namespaced <minimax:tool_call>, MiMo-V2-Flash
# (mimo_v2_flash) MiMo V2's function tags. qwen3_moe has none: Qwen3-30B-A3B writes Hermes JSON,
# Qwen3-Coder-30B-A3B function tags, so its template decides (`plain` + `detect_parser_family`);
# gpt_oss has none either (no harmony recipe in the catalog: `plain` + the harmony parser), nor
# deepseek_v3 (DeepSeek-V3's and V3.1's tool markup differ, Kimi K2 has its own section tokens:
# `plain` + `detect_parser_family`, which reads deepseek_v3_1 / kimi_k2 from the template).
_ARCH_RULES: tuple[tuple[str, str], ...] = (
    ("gemma4", "gemma4"),
    ("nemotronh", "nemotron_h"),
    ("glm4moe", "glm53"),
    ("minimaxm2", "minimax_m3"),
    ("mimov2", "mimo_v2"),
)
_ARCH_SEP = re.compile(r"[-_. ]")


def get_recipe(name: str, *, generation_config: Mapping[str, Any] | None = None) -> Recipe:
    """A recipe by name; `plain` is built from the model's generation_config."""
    if name == "plain":
        return plain_recipe(generation_config)
    try:
        return RECIPES[name]
    except KeyError:
        raise UnknownRecipeError(name) from None


def recipe_names() -> tuple[str, ...]:
    return (*RECIPES, "plain")


def detect_recipe(model_id: str, arch: str | None = None, chat_template: str | None = None) -> str:
    """Heuristic recipe name for a checkpoint (operators can always name one explicitly)."""
    name = model_id.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1].lower()
    arch_key = (arch or "").lower()
    arch_compact = _ARCH_SEP.sub("", arch_key)
    if _QWEN38.search(name):
        moe = bool(_MOE_HINT.search(name)) or "moe" in arch_key or "next" in arch_key
        return "qwen38" if moe else "qwen38_dense"
    for recipe, pattern in _ID_RULES:
        if pattern.search(name):
            return recipe
    template = chat_template or ""
    for needle, recipe in _ARCH_RULES:
        # nemotron_h also runs Nemotron Nano v2, whose template writes <TOOLCALL> JSON (`plain` +
        # the nemotron_v2 parser); Nemotron 3's writes function tags (the nemotron_h recipe).
        if needle in arch_compact and not (recipe == "nemotron_h" and "<TOOLCALL>" in template):
            return recipe
    if "<|open|>" in template and "<|sep|>" in template:
        return "kimi3"
    if "｜DSML｜tool_calls" in template:
        return "deepseek4"
    if "<|tool_call>" in template or "<|channel>thought" in template:
        return "gemma4"
    if "<minimax:tool_call>" in template:
        return "minimax_m3"
    return "plain"


def detect_parser_family(chat_template: str | None) -> str:
    """The output parser family a chat template's markup implies (for the `plain` recipe)."""
    t = chat_template or ""
    if "<|open|>" in t and "<|sep|>" in t:
        return "kimi_k3"
    if "｜DSML｜tool_calls" in t:
        return "deepseek_v4"
    if "｜DSML｜" in t:
        return "deepseek_v3_2"
    if "<｜tool▁calls▁begin｜>" in t:
        return "deepseek_v3_1"
    if "<|tool_call>" in t or "<|channel>" in t:
        return "gemma4"
    if "<minimax:tool_call>" in t:
        return "minimax_m2"
    if "<|tool_calls_section_begin|>" in t:
        return "kimi_k2"
    if "<|channel|>" in t and "<|message|>" in t:
        return "harmony"
    if "<arg_key>" in t:
        return "glm"
    if "<TOOLCALL>" in t:
        return "nemotron_v2"
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if "<tool_call>" in t and "<think>" not in t and _QWEN25_TOOLS in t and _QWEN25_IDENTITY in t:
        return "qwen2_5"
    if "<tool_call>" in t:
        # Reasoning tags are harmless when a model never writes them (MiMo-VL thinks without its
        # template mentioning <think>).
        return "qwen3" if "<think>" in t else "think_hermes"
    if "<think>" in t:
        return "qwen3"
    return "plain"
