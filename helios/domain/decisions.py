"""Decision questions and their scores: what the label scorer (`helios.serving.decisions`) produces
and the System One and Decisions frontends turn into answers, with the confidence formulas both
use. Plain values, no torch, no trio."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any, Literal

import attrs


@attrs.frozen
class DecisionQuestion:
    """One question as the scorer sees it; option texts are already rendered to strings."""

    kind: Literal["binary", "options", "levels"]
    instructions: str
    options: tuple[str, ...] = ()


@attrs.frozen
class QuestionScore:
    """Raw full-vocabulary probabilities of each label (binary: yes, no) and what the child cost."""

    probabilities: tuple[float, ...]
    labels: tuple[str, ...]
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int

    @property
    def normalized(self) -> tuple[float, ...]:
        total = sum(self.probabilities)
        if total <= 0.0 or not math.isfinite(total):
            return tuple(1.0 / len(self.probabilities) for _ in self.probabilities)
        return tuple(p / total for p in self.probabilities)

    @property
    def mass(self) -> float:
        return sum(self.probabilities)


def render_value(value: Any) -> str:
    """Structured instructions, criteria and descriptions stay JSON; strings stay as they are."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def render_state(state: Any) -> str:
    if isinstance(state, str):
        return state
    return json.dumps(state, ensure_ascii=False, indent=2)


def first_argmax(values: Sequence[float]) -> int:
    """The index of the largest value, the first one on a tie."""
    best = 0
    for i, v in enumerate(values):
        if v > values[best]:
            best = i
    return best


# -- confidence (System One's Jev formulas) ---------------------------------------------------------


def choice_confidence(p: Sequence[float]) -> float:
    """How far the top probability sits above uniform: 0 for uniform, 1 for certainty and for one option."""
    k = len(p)
    if k <= 1:
        return 1.0
    uniform = 1.0 / k
    return min(max((max(p) - uniform) / (1.0 - uniform), 0.0), 1.0)


def score_confidence(p: Sequence[float]) -> float:
    """One minus the mean absolute distance from the most likely level (first on a tie), relative to the
    same distance of a uniform distribution around the middle level; never below 0; 1 for one level."""
    k = len(p)
    if k <= 1:
        return 1.0
    m = first_argmax(p)
    dist = sum(x * abs(i - m) for i, x in enumerate(p))
    centre = (k - 1) / 2
    uniform = sum(abs(i - centre) for i in range(k)) / k
    return max(1.0 - dist / uniform, 0.0)


def expected_level(p: Sequence[float]) -> float:
    return sum(i * x for i, x in enumerate(p))
