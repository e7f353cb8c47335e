"""Model-family recipes: sampling defaults and ranges, output parser family, reasoning delimiters and
effort vocabulary, plus sampling resolution and recipe detection. No torch, no trio.

    recipe = get_recipe(detect_recipe(model_id, arch, chat_template))
    params = resolve_sampling(recipe, SamplingRequest(temperature=0.0))   # -> clamped
    card["flare"]["sampling_defaults"] = recipe.sampling_defaults_json()
    card["flare"]["sampling_ranges"] = recipe.sampling_ranges_json()
"""

from helios.recipes.base import (
    DISTRIBUTION_PARAMETERS,
    NEUTRAL_EFFORT_LEVELS,
    EffortError,
    EffortVocabulary,
    Range,
    Recipe,
    SamplingParameterError,
    effort_score,
    numeric_effort,
    resolve_effort,
    resolve_sampling,
)
from helios.recipes.catalog import PLAIN_RANGES, RECIPES, plain_recipe
from helios.recipes.detect import (
    UnknownRecipeError,
    detect_parser_family,
    detect_recipe,
    get_recipe,
    recipe_names,
)

__all__ = [
    "DISTRIBUTION_PARAMETERS",
    "NEUTRAL_EFFORT_LEVELS",
    "PLAIN_RANGES",
    "RECIPES",
    "EffortError",
    "EffortVocabulary",
    "Range",
    "Recipe",
    "SamplingParameterError",
    "UnknownRecipeError",
    "detect_parser_family",
    "detect_recipe",
    "effort_score",
    "get_recipe",
    "numeric_effort",
    "plain_recipe",
    "recipe_names",
    "resolve_effort",
    "resolve_sampling",
]
