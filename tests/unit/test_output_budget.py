"""`Service.output_budget`: the output limit a request gets from its own, the server's default, the
context its prompt leaves, `[server] max_tokens_overflow` and `[server] max_output_tokens`."""

from __future__ import annotations

from types import SimpleNamespace

import attrs
import pytest

from helios.domain.model import ModelInfo
from helios.errors import ContextLengthExceeded
from helios.serving.pipeline import Service

INFO = ModelInfo(
    model_id="m", aliases=(), created=0, max_model_len=1000, vocab_size=100, default_max_tokens=300,
    max_concurrency=1, prefill_chunk_size=64, max_top_logprobs=20, prompt_logprobs=True,
    sampling_defaults={}, sampling_ranges={}, recipe="plain", has_bos=False,
)


def budget(prompt: int, max_tokens: int | None, **info: object) -> int:
    return Service.output_budget(SimpleNamespace(info=attrs.evolve(INFO, **info)), prompt, max_tokens)  # type: ignore[arg-type]


def test_default_and_explicit_limits() -> None:
    assert budget(100, None) == 300  # the server's default
    assert budget(900, None) == 100  # within the context left
    assert budget(100, 50) == 50
    assert budget(100, 900) == 900  # exactly what is left


def test_overflow_is_clamped_or_rejected() -> None:
    assert budget(100, 32000) == 900
    with pytest.raises(ContextLengthExceeded) as exc:
        budget(100, 32000, clamp_max_tokens=False)
    assert exc.value.max_tokens == 32000 and exc.value.prompt_tokens == 100
    with pytest.raises(ContextLengthExceeded):  # a prompt with no room is refused either way
        budget(1000, 5)


def test_the_server_cap_bounds_every_limit() -> None:
    assert budget(100, None, max_output_tokens=128) == 128
    assert budget(100, 32000, max_output_tokens=128) == 128
    assert budget(100, 64, max_output_tokens=128) == 64
    assert budget(950, 32000, max_output_tokens=128) == 50  # the context left is still the bound
    # Under "reject", a limit the cap brings inside the context is not an error.
    assert budget(100, 32000, max_output_tokens=128, clamp_max_tokens=False) == 128
