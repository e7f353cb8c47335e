"""One request's output tracker: the structured-output gate and the reasoning budget, in token ids.

A request with a grammar (`EngineRequest.constraint`) or a reasoning budget
(`EngineRequest.reasoning_budget`) gets one `OutputTracker` (`RequestState.tracker`; None for every
other request). `Scheduler.update` feeds it every committed token exactly once, in order
(`advance`), and it answers what the next tokens must be:

- `forced_token`: the token due next instead of a draw (the budget's close, when the grammar allows
  it); `schedule` puts it on the request's chunk (`ScheduledChunk.forced_token_id`).
- `forced_run`: the tokens the answer grammar forces after the token just committed; `update`
  commits them in the same step, after it.
- `advance` returning False: the grammar rejected the token (`error` says why); the request fails.
- `is_masking`, `extra_allowed`, `allows_whitespace` and the matcher: what the runner's mask fill
  reads for this step (`structured.GrammarBatch`).

The gate: the constraint applies to the final answer only (spec, "Reasoning, sampling, and usage").
Reasoning and tool-call envelopes stay free. The engine follows them by single tokens
(`structured.Envelope`), as the spec's delimiter rule says ("Structured-output grammars ... end
reasoning only at the delimiter token"):

- REASONING: free sampling until the close token (or a tool opener, for families where a call ends
  reasoning). The row is not masked at all.
- OPEN: the answer has not started. Allowed: the answer grammar's first tokens, plus the family's
  single-token tool opener, the reasoning opener (once, before anything else), whitespace-only
  tokens right after a closed envelope (the `\\n\\n` after `</think>`; they are not answer text for
  the grammar), and EOS once a tool call completed (a turn of calls only).
- TOOL: free until the tool close token, then OPEN again.
- ANSWER: the grammar's mask alone; the matcher consumes every token.

A family without single-token delimiters has no gate: the answer grammar applies from the first
token (the serving side documents that reasoning and calls are then unavailable).

Grammar-forced tokens: after a committed answer token, when the grammar allows exactly one
continuation for at least `MIN_FORCED` tokens (llguidance's `compute_ff_tokens`), up to
`MAX_FORCED` of them are committed in the same step without sampling, never past the output limit,
and the next step computes them like a short prefill. Only for requests without logprobs (a forced
token has no sampled distribution to report); forced tokens are fed to the tracker like any other.

The reasoning budget (spec, "Reasoning, sampling, and usage"): at the cap, if reasoning is
unambiguously open, output capacity remains and any grammar allows it, the engine emits the prepared
reasoning close token and continues; the forced close counts as a generated token and has no
logprob. If reasoning closed earlier or a tool opener is undecided, nothing is injected. Since the
tracker sees committed token ids only (the engine never detokenizes), "unambiguously open" means:
the prompt left reasoning open, or the first generated token is a single-token opener; and since
then no token closed reasoning or could end it (a single-token close delimiter or a tool opener
that ends reasoning, `ReasoningBudget.end_token_ids`). After any of those the budget is done for
good. Limits (token ids only): a close delimiter or tool opener that the model writes as several
ordinary tokens is not seen here. The serving side accepts a budget only where the close delimiter
is one token, and lists single-token tool openers in ``end_token_ids``.

Not thread-safe: the engine thread and the mask-fill helper it waits for use it in turn.
"""

from __future__ import annotations

import enum

import llguidance

from helios.engine.records import EngineRequest, ReasoningBudget
from helios.engine.structured import UNPRODUCIBLE_MESSAGE, Envelope, GrammarConstraint, UnproducibleText

MAX_FORCED = 16
"""Grammar-forced tokens committed after one sampled token."""
MIN_FORCED = 8
"""Shorter forced runs are sampled token by token: committed at once they make the row's next chunk
a short prefill (its own attention call per layer, and more rows for every projection), which on the
CPU cost more than the decode steps it saves (docs/benchmarks.md, "Structured output")."""

_MAX_SEPARATORS = 4  # whitespace-only tokens the gate lets through after a closed envelope


class Mode(enum.Enum):
    """Where the output is, for the grammar gate."""

    REASONING = "reasoning"
    OPEN = "open"
    TOOL = "tool"
    ANSWER = "answer"


class BudgetState(enum.Enum):
    START = "start"  # nothing generated yet and the prompt did not open reasoning
    OPEN = "open"  # reasoning is unambiguously open: generated tokens count
    DONE = "done"  # reasoning closed, or may have ended, or never opened (or no budget): no cut


class OutputTracker:
    """One request's grammar gate and reasoning budget (module docstring); either may be absent."""

    def __init__(self, constraint: GrammarConstraint | None = None, budget: ReasoningBudget | None = None) -> None:
        # The grammar gate: a private copy of the matcher (it shares the compiled grammar).
        self.constraint = constraint
        self.matcher: llguidance.LLMatcher | None = None if constraint is None else constraint.matcher.deep_copy()
        env = Envelope() if constraint is None else constraint.envelope
        self.envelope = env
        self.mode = Mode.REASONING if env.starts_in_reasoning else (Mode.ANSWER if env.is_trivial else Mode.OPEN)
        self.reasoned = env.starts_in_reasoning
        self.after_envelope = False
        self.num_separators = 0  # whitespace tokens since the last closed envelope
        self.num_calls = 0
        self.error: str | None = None
        """Why the grammar rejected a token (None while it has not)."""
        self.unproducible = False
        """Whether it failed because the grammar requires text the vocabulary cannot give
        (`structured.UnproducibleText`, raised while llguidance tokenized forced text)."""
        # The reasoning budget.
        self.budget = budget
        self.close_token_id = None if budget is None else budget.close_token_id
        self.budget_state = (BudgetState.DONE if budget is None else
                             BudgetState.OPEN if budget.close_token_id is not None else BudgetState.START)
        self.num_reasoning_tokens = 0
        self._opens = {} if budget is None else dict(budget.opens)

    @classmethod
    def of(cls, request: EngineRequest) -> OutputTracker | None:
        """The request's tracker; None when it has neither a grammar nor a reasoning budget."""
        if request.constraint is None and not request.reasoning_budget:
            return None
        return cls(request.constraint, request.reasoning_budget or None)

    # -- the grammar gate -------------------------------------------------------------------
    @property
    def is_masking(self) -> bool:
        """Whether this step's sampling is constrained (False without a grammar, inside a free
        envelope, or once the grammar failed)."""
        return self.matcher is not None and self.error is None and self.mode in (Mode.OPEN, Mode.ANSWER)

    def extra_allowed(self) -> list[int]:
        """Tokens the gate allows besides the grammar's mask (OPEN only)."""
        if self.mode is not Mode.OPEN or self.constraint is None:
            return []
        env = self.envelope
        extra = []
        if env.tool_open is not None:
            extra.append(env.tool_open)
        if env.reasoning_open is not None and not self.reasoned and not self.after_envelope:
            extra.append(env.reasoning_open)
        if self.num_calls:
            extra.extend(self.constraint.vocab.eos_token_ids)
        return extra

    def allows_whitespace(self) -> bool:
        """Whitespace-only tokens right after a closed envelope (a few: never a run to the limit)."""
        return self.mode is Mode.OPEN and self.after_envelope and self.num_separators < _MAX_SEPARATORS

    def is_token_allowed(self, token_id: int) -> bool:
        """Whether the grammar lets `token_id` come next (True without a grammar)."""
        if self.constraint is None or self.matcher is None:
            return True
        if self.error is not None:
            return False
        if self.mode in (Mode.REASONING, Mode.TOOL) or token_id in self.extra_allowed():
            return True
        vocab = self.constraint.vocab
        if self.allows_whitespace() and token_id in vocab.whitespace_ids:
            return True
        if token_id in vocab.eos_token_ids:
            return bool(self.matcher.is_accepting())
        return bool(self.matcher.validate_tokens([token_id]) == 1)

    # -- committed tokens -------------------------------------------------------------------
    def advance(self, token_id: int) -> bool:
        """One committed generated token, in order: the gate and matcher follow it, then the budget.
        False (and `error` set) when the grammar rejects it; a rejected token is not counted."""
        if self.matcher is not None and not self._advance_grammar(token_id):
            return False
        state = self.budget_state
        if state is BudgetState.DONE:
            return True
        assert self.budget is not None
        if state is BudgetState.START:
            close = self._opens.get(token_id)
            if close is None:
                self.budget_state = BudgetState.DONE  # output starts in content: accepted without a cut
            else:
                self.budget_state, self.close_token_id = BudgetState.OPEN, close
        elif token_id == self.close_token_id or token_id in self.budget.end_token_ids:
            self.budget_state = BudgetState.DONE
        else:
            self.num_reasoning_tokens += 1
        return True

    def forced_token(self) -> int | None:
        """The token due next instead of a draw: the budget's close once the cap is reached with
        reasoning open, while the grammar allows it (None: sample). Output capacity is the caller's."""
        budget = self.budget
        if self.budget_state is not BudgetState.OPEN or budget is None:
            return None
        if self.num_reasoning_tokens < budget.max_tokens:
            return None
        token = self.close_token_id
        if token is None or not self.is_token_allowed(token):
            return None  # the constraint disallows the close: generation continues without it
        return token

    def forced_run(self, room: int) -> list[int]:
        """The tokens the answer grammar forces after the token just committed, already advanced:
        a run of at least `MIN_FORCED` and at most `MAX_FORCED` and ``room`` tokens (empty when the
        grammar has a choice sooner). A forced token the grammar rejects ends the run before it."""
        room = min(MAX_FORCED, room)
        matcher = self.matcher
        if room < MIN_FORCED or matcher is None or self.mode is not Mode.ANSWER or self.error is not None \
                or matcher.is_stopped():
            return []
        forced = list(matcher.compute_ff_tokens())[:room]
        if len(forced) < MIN_FORCED:
            return []
        for k, t in enumerate(forced):
            if not self.advance(t):
                return forced[:k]
        return forced

    def _advance_grammar(self, token_id: int) -> bool:
        assert self.constraint is not None and self.matcher is not None
        if self.error is not None:
            return False
        env = self.envelope
        mode = self.mode
        if mode is Mode.REASONING:
            if token_id == env.reasoning_close:
                self.mode, self.after_envelope, self.num_separators = Mode.OPEN, True, 0
            elif env.tool_call_ends_reasoning and token_id == env.tool_open:
                self.mode = Mode.TOOL
            return True
        if mode is Mode.TOOL:
            if token_id == env.tool_close:
                self.mode, self.after_envelope, self.num_separators = Mode.OPEN, True, 0
                self.num_calls += 1
            return True
        vocab = self.constraint.vocab
        if mode is Mode.OPEN:
            if token_id == env.tool_open:
                self.mode = Mode.TOOL
                return True
            if token_id == env.reasoning_open and not self.reasoned and not self.after_envelope:
                self.mode, self.reasoned = Mode.REASONING, True
                return True
            if self.allows_whitespace() and token_id in vocab.whitespace_ids:
                self.num_separators += 1
                return True
            if self.num_calls and token_id in vocab.eos_token_ids:
                return True  # a turn of tool calls only ends here
            self.mode = Mode.ANSWER
        # A matcher in its error state masks everything but EOS and may still "accept" it: ask.
        matcher = self.matcher
        if not matcher.consume_token(token_id) or matcher.is_error():
            error = matcher.get_error() or f"token {token_id} is not allowed by the grammar"
            # llguidance reports the tokenizer's exception inside its own panic text: name it only.
            self.unproducible = UnproducibleText.__name__ in error
            self.error = UNPRODUCIBLE_MESSAGE if self.unproducible else error
            return False
        return True
