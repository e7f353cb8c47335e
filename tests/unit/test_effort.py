"""Chat reasoning_effort mapping per recipe (spec: Reasoning, sampling, and usage)."""

from __future__ import annotations

import pytest

from helios.errors import BadRequest
from helios.frontends.effort import chat_effort_kwargs


def kw(value, recipe, given=True, template=None):  # type: ignore[no-untyped-def]
    return chat_effort_kwargs(value, template or {}, recipe, given)


def test_deepseek41_numeric_scores_and_named_levels() -> None:
    assert kw(80, "deepseek41") == {"reasoning_effort": 80}
    assert kw(None, "deepseek41", template={"reasoning_effort": 80}, given=False) == {"reasoning_effort": 80}
    assert kw("low", "deepseek41") == {"reasoning_effort": 50}
    assert kw("high", "deepseek41") == {"reasoning_effort": 75}
    assert kw("xhigh", "deepseek41") == {"reasoning_effort": 75}
    assert kw("max", "deepseek41") == {"reasoning_effort": 100}
    assert kw(None, "deepseek41") == {"reasoning_effort": 75}  # explicit null: the encoder's high default
    assert kw(None, "deepseek41", given=False) == {}  # omitted: prepared defaults
    for bad in (0, 101, 80.0, True, "80", [80]):
        with pytest.raises(BadRequest):
            kw(bad, "deepseek41")
    with pytest.raises(BadRequest):
        kw(80, "deepseek41", template={"reasoning_effort": 60})


def test_named_levels_resolve_against_the_template_vocabulary() -> None:
    assert kw("medium", "qwen38") == {"reasoning_effort": "medium"}
    assert kw("high", "qwen38") == {"reasoning_effort": "xhigh"}  # nearest accepted level, ties go up
    assert kw("none", "qwen38") == {"enable_thinking": False}
    with pytest.raises(BadRequest):
        kw(80, "deepseek4")  # DeepSeek V4 rejects numeric effort
    with pytest.raises(BadRequest):
        kw("turbo", "qwen38")
    assert kw("high", "plain") == {}  # no effort control: accepted, nothing to pass
