"""Reasoning budgets (spec: `thinking_token_budget`): which requests the engine can cut, and how.

A budget caps generated reasoning tokens: at the cap, with reasoning unambiguously open, the engine
forces the family's close delimiter as one token (`helios.engine.reasoning_budget`). The engine
sees token ids only, so a family can be cut only where its close delimiter is a single token of the
vocabulary. Per request, after the chat template has rendered the prompt:

- the prompt ends with a reasoning opener (Qwen3.5's `<think>\\n`): the output starts in reasoning;
  the opener's close must be one token, else the format is unsupported;
- otherwise the output starts undecided: reasoning opens only if the model's first token is a
  single-token opener (Qwen3 writes `<think>` itself), closed by that opener's single-token close;
  when no opener/close pair is single tokens, or the first token is anything else, the output
  starts in content and the budget is accepted without a cut;
- a family without reasoning syntax (or with none the engine can close: harmony's channels) is
  unsupported.

Unsupported formats answer HTTP 400 naming the field when the budget is one the request gave
explicitly (`thinking_token_budget`); an advisory budget (Messages `thinking.budget_tokens`, the
server default) is then dropped. `check_default` is the start-up check of `[server]
thinking_token_budget`.

While reasoning is open, tokens that close it or may end it stop the budget for good: every
single-token close delimiter, and in families where a tool call ends reasoning (Qwen3), the
single-token tool openers. A delimiter or tool opener the model spells in several ordinary tokens
is not seen by the engine (a limit of token-id tracking).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from helios.engine.records import ReasoningBudget
from helios.errors import BadRequest
from helios.parsers import get_family

MAX_BUDGET = 2**31 - 1


@attrs.frozen
class _Pair:
    open: str
    close: str
    open_id: int | None
    close_id: int | None


@attrs.frozen
class _FamilyIds:
    pairs: tuple[_Pair, ...]
    end_token_ids: frozenset[int]


class ReasoningBudgets:
    """The loaded model's reasoning delimiters as token ids, per parser family (cached)."""

    def __init__(self, token_id: Callable[[str], int | None]) -> None:
        self._token_id = token_id
        self._families: dict[str, _FamilyIds | None] = {}

    def for_request(self, family: str, prompt: str, budget: int, param: str | None) -> ReasoningBudget | None:
        """The engine's budget for a request whose rendered prompt is `prompt` (None: no cut).

        `param` names the request field for the 400 of an unsupported format; None: the budget is
        advisory and an unsupported format simply gets no cut."""
        ids = self._ids(family)
        if ids is None:
            _unsupported(param, "this model has no reasoning syntax that a token budget can close")
            return None
        tail = prompt.rstrip()
        opened = next((p for p in ids.pairs if tail.endswith(p.open)), None)
        if opened is not None:
            if opened.close_id is None:
                _unsupported(param, f"this model's reasoning close delimiter {opened.close!r} is not a single token")
                return None
            return ReasoningBudget(budget, close_token_id=opened.close_id, end_token_ids=ids.end_token_ids)
        opens = tuple((p.open_id, p.close_id) for p in ids.pairs if p.open_id is not None and p.close_id is not None)
        if not opens:
            return None  # the output starts in content: accepted without a cut
        return ReasoningBudget(budget, opens=opens, end_token_ids=ids.end_token_ids)

    def check_default(self, family: str, prompt: str) -> None:
        """Start-up check of a `[server] thinking_token_budget` default against the prompt a plain
        conversation renders to: raises ValueError when the model cannot honour it (no reasoning
        syntax, no single-token close, or a default output start that is neither in reasoning nor
        a single-token opener)."""
        try:
            budget = self.for_request(family, prompt, 1, "thinking_token_budget")
        except BadRequest as exc:
            raise ValueError(f"[server] thinking_token_budget: {exc.message}") from None
        if budget is None:
            raise ValueError("[server] thinking_token_budget: this model's output does not start in reasoning "
                             "and its reasoning opener and close are not single tokens")

    def _ids(self, family: str) -> _FamilyIds | None:
        if family not in self._families:
            self._families[family] = self._lookup(family)
        return self._families[family]

    def _lookup(self, family: str) -> _FamilyIds | None:
        spec = get_family(family)
        syntax = spec.reasoning
        if syntax is None or not syntax.open or not syntax.close:
            return None
        pairs = tuple(
            _Pair(o, c, self._token_id(o), self._token_id(c))
            for i, o in enumerate(syntax.open)
            for c in (syntax.close[min(i, len(syntax.close) - 1)],)
        )
        ends = {self._token_id(c) for c in syntax.close}
        if spec.tool_call_ends_reasoning and spec.tools is not None:
            ends.update(self._token_id(o) for o in spec.tools({}).openers)
        return _FamilyIds(pairs, frozenset(i for i in ends if i is not None))


def _unsupported(param: str | None, why: str) -> None:
    """An explicit budget (`param` names its field) on a format that cannot honour it is a 400; an
    advisory one is dropped."""
    if param is not None:
        raise BadRequest(f"{param} is not supported: {why}", param=param)
