"""Sampling parameters: the request side keeps "omitted" (None) distinct from "given"."""

from __future__ import annotations

import attrs


@attrs.frozen
class SamplingRequest:
    """Distribution parameters exactly as the client sent them; None means omitted."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] | None = None
    """(token id, bias) pairs, validated by the frontend; None or empty means no bias."""


@attrs.frozen
class SamplingParams:
    """Resolved parameters the engine applies. top_k == -1 disables top-k; temperature 0 is greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    """Added to the logits before penalties and temperature, after logprobs are taken (vLLM)."""

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1
