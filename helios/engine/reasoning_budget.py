"""The reasoning-budget tracker: one per request with a ``thinking_token_budget``.

The spec ("Reasoning, sampling, and usage"): at the cap, if reasoning is unambiguously open, output
capacity remains and any grammar allows it, the engine emits the prepared reasoning close token and
continues; the forced close counts as a generated token and has no logprob. If reasoning closed
earlier or a tool opener is undecided, nothing is injected.

The tracker sees committed token ids only (the engine never detokenizes), so "unambiguously open"
means: the prompt left reasoning open, or the first generated token is a single-token opener; and
since then no token closed reasoning or could end it (a single-token close delimiter or a tool
opener that ends reasoning, `ReasoningBudget.end_token_ids`). After any of those the tracker is done
for good. The scheduler asks `forced_token` when it schedules a decode step and feeds every committed
token to `observe` (the forced close included, which ends the budget).

Limits (token ids only): a close delimiter or tool opener that the model writes as several ordinary
tokens is not seen here. The serving side accepts a budget only where the close delimiter is one
token, and lists single-token tool openers in ``end_token_ids``.
"""

from __future__ import annotations

import enum

from helios.engine.records import ReasoningBudget


class BudgetState(enum.Enum):
    START = "start"  # nothing generated yet and the prompt did not open reasoning
    OPEN = "open"  # reasoning is unambiguously open: generated tokens count
    DONE = "done"  # reasoning closed, or may have ended, or never opened: no cut any more


class BudgetTracker:
    """Counts a request's reasoning tokens and says when the close token is due."""

    def __init__(self, budget: ReasoningBudget) -> None:
        self.budget = budget
        self.close_token_id = budget.close_token_id
        self.state = BudgetState.OPEN if budget.close_token_id is not None else BudgetState.START
        self.num_reasoning_tokens = 0
        self._opens = dict(budget.opens)

    def forced_token(self) -> int | None:
        """The close token when the cap is reached with reasoning open, else None."""
        if self.state is BudgetState.OPEN and self.num_reasoning_tokens >= self.budget.max_tokens:
            return self.close_token_id
        return None

    def observe(self, token_id: int) -> None:
        """One committed generated token, in order."""
        if self.state is BudgetState.START:
            close = self._opens.get(token_id)
            if close is None:
                self.state = BudgetState.DONE  # output starts in content: accepted without a cut
            else:
                self.state, self.close_token_id = BudgetState.OPEN, close
        elif self.state is BudgetState.OPEN:
            if token_id == self.close_token_id or token_id in self.budget.end_token_ids:
                self.state = BudgetState.DONE
            else:
                self.num_reasoning_tokens += 1
