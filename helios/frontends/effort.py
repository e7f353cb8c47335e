"""Chat Completions `reasoning_effort`: named levels for every recipe with an effort vocabulary, and
DeepSeek V4.1's native integer score 1..100 (top level or in chat_template_kwargs).

The result is a set of chat-template kwargs, so the effort reaches the model exactly as the
prepared template understands it (spec: Reasoning, sampling, and usage)."""

from __future__ import annotations

from typing import Any

from helios.errors import BadRequest
from helios.recipes import EffortError, effort_score, get_recipe, numeric_effort, resolve_effort


def chat_effort_kwargs(top_level: Any, template_kwargs: dict[str, Any], recipe_name: str,
                       top_level_given: bool) -> dict[str, Any]:
    """Template kwargs for a chat request's effort; the request's own chat_template_kwargs win."""
    recipe = get_recipe(recipe_name)
    if top_level_given and template_kwargs.get("reasoning_effort", top_level) != top_level:
        raise BadRequest("reasoning_effort differs between the top level and chat_template_kwargs",
                         param="reasoning_effort")
    if not top_level_given and "reasoning_effort" not in template_kwargs:
        return {}
    value = top_level if top_level_given else template_kwargs["reasoning_effort"]
    try:
        if recipe.effort.numeric is not None:  # DeepSeek V4.1: integer scores, named levels map to scores
            if not isinstance(value, str | None):
                return {"reasoning_effort": numeric_effort(recipe, value)}
            level = (recipe.effort.default or "high") if value is None else resolve_effort(recipe, value)
            if level is None:
                raise EffortError(f"unknown reasoning effort {value!r}")
            return {"reasoning_effort": effort_score(recipe, level)}
        if value is None:
            return {}
        if not isinstance(value, str):
            raise EffortError(f"reasoning_effort must be a named level for {recipe.name}; numeric efforts are "
                              "not accepted")
        if value == "none":
            return {"enable_thinking": False}
        level = resolve_effort(recipe, value)
        return {"reasoning_effort": level} if level is not None else {}
    except EffortError as exc:
        raise BadRequest(str(exc), param="reasoning_effort") from None
