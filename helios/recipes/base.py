"""Recipe: a model family's sampling defaults and ranges, output syntax and effort vocabulary.

Resolution rule (spec, "Reasoning, sampling, and usage"): omitted request fields take the recipe
default; numeric values for temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty
and frequency_penalty are clamped to the recipe's inclusive range; a parameter without a range is
fixed at its default whatever the request says; malformed types (booleans, strings, non-finite
numbers, a non-integer top_k) raise SamplingParameterError, which the frontends answer with HTTP 400;
seed is request-controlled. top_k 0 means disabled and is stored as -1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from helios.domain.sampling import SamplingParams, SamplingRequest

DISTRIBUTION_PARAMETERS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
"""The parameters that have ranges (seed is request-controlled and has none)."""

NEUTRAL_EFFORT_LEVELS = ("minimal", "low", "medium", "high", "xhigh", "max")
"""The neutral reasoning-effort scale the frontends map Responses/Anthropic effort names into."""

_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


class SamplingParameterError(ValueError):
    """A sampling field has a malformed type or value; the frontend answers HTTP 400."""

    def __init__(self, parameter: str, message: str) -> None:
        super().__init__(f"{parameter}: {message}")
        self.parameter = parameter


class EffortError(ValueError):
    """A reasoning-effort value the recipe does not accept; the frontend answers HTTP 400."""


@attrs.frozen
class Range:
    """Inclusive numeric bounds, as the card publishes them (`flare.sampling_ranges`)."""

    min: float
    max: float

    def contains(self, value: float) -> bool:
        return self.min <= value <= self.max

    def clamp(self, value: float) -> float:
        return min(max(value, self.min), self.max)

    def to_json(self) -> dict[str, float]:
        return {"min": self.min, "max": self.max}


@attrs.frozen
class EffortVocabulary:
    """Reasoning-effort settings the prepared template accepts."""

    levels: tuple[str, ...] = ()  # named levels, lowest first; empty: no effort control
    default: str | None = None
    numeric: tuple[int, int] | None = None  # inclusive integer scores accepted natively (DeepSeek V4.1)
    scores: Mapping[str, int] = attrs.field(factory=dict)  # named level -> native numeric score


@attrs.frozen
class Recipe:
    name: str
    basis: str  # the model card the defaults and ranges come from
    defaults: SamplingParams
    ranges: Mapping[str, Range] = attrs.field(factory=dict)  # absent parameter: fixed at default
    output_parser: str = "plain"  # helios.parsers family composed from the two below
    reasoning_parser: str | None = None  # reasoning syntax name ("think", "gemma4_channel", ...)
    tool_parser: str | None = None  # tool syntax name ("qwen3_coder", "dsml", ...)
    reasoning_delimiters: tuple[str, str] | None = None  # (open, close) as text
    effort: EffortVocabulary = EffortVocabulary()
    out_of_range: Literal["clamp", "reject"] = "clamp"

    def __attrs_post_init__(self) -> None:
        _validate(self)

    def without_ranges(self) -> Recipe:
        """The recipe as exported without range metadata: every parameter fixed at its default."""
        return attrs.evolve(self, ranges={})

    def sampling_defaults_json(self) -> dict[str, Any]:
        """`flare.sampling_defaults` on the model card."""
        d = self.defaults
        return {
            "seed": d.seed,
            "temperature": float(d.temperature),
            "top_p": float(d.top_p),
            "top_k": int(d.top_k),
            "min_p": float(d.min_p),
            "repetition_penalty": float(d.repetition_penalty),
            "presence_penalty": float(d.presence_penalty),
            "frequency_penalty": float(d.frequency_penalty),
        }

    def sampling_ranges_json(self) -> dict[str, dict[str, float] | None]:
        """`flare.sampling_ranges`: {min, max} per distribution parameter, null when fixed."""
        return {
            name: (self.ranges[name].to_json() if name in self.ranges else None)
            for name in DISTRIBUTION_PARAMETERS
        }


def resolve_sampling(recipe: Recipe, request: SamplingRequest) -> SamplingParams:
    """Request values + recipe defaults and ranges -> the parameters the engine applies."""
    values: dict[str, Any] = {}
    for name in DISTRIBUTION_PARAMETERS:
        given = getattr(request, name)
        default = getattr(recipe.defaults, name)
        if given is None:
            values[name] = default
            continue
        value = _checked_int(name, given) if name == "top_k" else _checked_float(name, given)
        bounds = recipe.ranges.get(name)
        if bounds is None:
            values[name] = default
        elif name == "top_k":
            values[name] = _resolve_top_k(int(value), bounds, recipe.out_of_range)
        elif recipe.out_of_range == "reject":
            if not bounds.contains(value):
                raise SamplingParameterError(name, f"{value!r} is outside the sampler's valid range")
            values[name] = float(value)
        else:
            values[name] = float(bounds.clamp(value))
    seed = request.seed
    if seed is None:
        values["seed"] = recipe.defaults.seed
    else:
        values["seed"] = _checked_seed(seed)
    values["logit_bias"] = request.logit_bias or ()
    return SamplingParams(**values)


def resolve_effort(recipe: Recipe, level: str) -> str | None:
    """Maps a neutral effort level to the nearest level the template accepts (ties go up).

    Returns None for recipes without effort control. Raises EffortError for unknown names.
    """
    vocabulary = recipe.effort.levels
    if not vocabulary:
        return None
    if level in vocabulary:
        return level
    if level not in NEUTRAL_EFFORT_LEVELS:
        raise EffortError(f"unknown reasoning effort {level!r}")
    wanted = NEUTRAL_EFFORT_LEVELS.index(level)
    ranked = [
        (abs(NEUTRAL_EFFORT_LEVELS.index(v) - wanted), -NEUTRAL_EFFORT_LEVELS.index(v), v) for v in vocabulary
    ]
    return min(ranked)[2]


def numeric_effort(recipe: Recipe, value: object) -> int:
    """Validates a native numeric effort score (DeepSeek V4.1: a JSON integer 1-100). Floats such
    as 80.0, booleans and numeric strings are rejected with EffortError."""
    bounds = recipe.effort.numeric
    if bounds is None:
        raise EffortError(f"{recipe.name} does not accept a numeric reasoning effort")
    if isinstance(value, bool) or not isinstance(value, int):
        raise EffortError("reasoning_effort must be an integer or a named level")
    if not bounds[0] <= value <= bounds[1]:
        raise EffortError(f"reasoning_effort must be between {bounds[0]} and {bounds[1]}")
    return value


def effort_score(recipe: Recipe, level: str) -> int:
    """The native numeric score of a named level (DeepSeek V4.1: low=50, high=75, xhigh=75, max=100)."""
    try:
        return recipe.effort.scores[level]
    except KeyError:
        raise EffortError(f"{recipe.name} has no numeric score for effort {level!r}") from None


# --- private helpers -------------------------------------------------------------------------------


def _checked_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SamplingParameterError(name, "must be a number")
    if not math.isfinite(value):
        raise SamplingParameterError(name, "must be a finite number")
    return float(value)


def _checked_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParameterError(name, "must be an integer")
    return value


def _checked_seed(value: object) -> int:
    seed = _checked_int("seed", value)
    if not _SEED_MIN <= seed <= _SEED_MAX:
        raise SamplingParameterError("seed", "must fit in 64 bits")
    return seed


def _resolve_top_k(value: int, bounds: Range, mode: str) -> int:
    if value == 0:
        value = -1  # 0 and -1 both mean disabled
    if value < -1:
        if mode == "reject":
            raise SamplingParameterError("top_k", "must be -1 (disabled) or a positive integer")
        value = -1
    if value == -1:
        # Disabled = unbounded k; a range that requires a finite k takes its largest value.
        if bounds.min >= 1 and bounds.max is not None:
            return int(bounds.max)
        return -1
    if mode == "reject":
        if bounds.max is not None and value > bounds.max:
            raise SamplingParameterError("top_k", "is outside the sampler's valid range")
        return value
    if bounds.max is not None and value > bounds.max:
        return int(bounds.max)
    return max(value, math.ceil(bounds.min)) if bounds.min >= 1 else value


def _valid_value(name: str, value: float) -> bool:
    if name == "temperature":
        return value >= 0
    if name == "top_p":
        return 0 < value <= 1
    if name == "top_k":
        return value == -1 or value >= 1
    if name == "min_p":
        return 0 <= value <= 1
    if name == "repetition_penalty":
        return value > 0
    return -2 <= value <= 2  # presence and frequency penalties


def _validate(recipe: Recipe) -> None:
    for name in DISTRIBUTION_PARAMETERS:
        if not _valid_value(name, getattr(recipe.defaults, name)):
            raise ValueError(f"recipe {recipe.name}: default {name} is not a valid sampler value")
    for name, bounds in recipe.ranges.items():
        if name not in DISTRIBUTION_PARAMETERS:
            raise ValueError(f"recipe {recipe.name}: {name} cannot have a range")
        default = getattr(recipe.defaults, name)
        if not (name == "top_k" and default == -1) and not bounds.contains(default):
            raise ValueError(f"recipe {recipe.name}: the {name} range does not contain its default")
        if bounds.max < bounds.min:
            raise ValueError(f"recipe {recipe.name}: empty {name} range")
        # Every value within must be a valid sampler value (clamping lands on the bounds). top_k's
        # lower bound may be -1 (off); the values between -1 and 1 (0, also off) are valid too.
        ends = [bounds.min, bounds.max] if name != "top_k" or bounds.min != -1 else [bounds.max]
        if not all(_valid_value(name, end) for end in ends):
            raise ValueError(f"recipe {recipe.name}: the {name} range holds invalid sampler values")
        if recipe.out_of_range == "clamp":
            if name == "temperature" and bounds.min <= 0:
                raise ValueError(f"recipe {recipe.name}: temperature bounds must be positive")
    if recipe.effort.default is not None and recipe.effort.default not in recipe.effort.levels:
        raise ValueError(f"recipe {recipe.name}: default effort is not in its vocabulary")
