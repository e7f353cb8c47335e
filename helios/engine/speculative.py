"""Exact speculative decoding: draft proposers, the per-request draft depth, and the counters.

A request that speculates gets drafts from its proposer when the scheduler plans its decode round:
up to ``depth`` tokens that probably follow its committed tokens. The round's chunk then covers
the request's last committed token plus the drafts (``ScheduledChunk.draft_token_ids``), k + 1
positions verified by one forward beside the step's other decode and prefill rows; the runner
samples each position as decoding would (`runner.ModelRunner._verify`), so outputs do not depend
on the drafts at all:

- position i is sampled with the request's own sampler row, its output tokens extended by the
  drafts before it, from the target model's logits at that position; the run is accepted while
  the sampled token equals the draft, and the first mismatch (or, when every draft matched, the
  bonus position) commits its sampled token and ends the run. For a greedy row this is the longest
  matching prefix plus the model's own next token. For a sampled row with a deterministic proposer
  it is exactly rejection sampling with a point-mass proposal: the draft x is accepted with
  probability p(x), and on rejection the token is drawn from p with x removed and renormalised
  (a draw from p conditioned on not being x). A seeded row consumes one uniform per committed
  token, as without speculation, so its tokens are the same with and without speculation.
- logprobs are the target model's at each committed position (the sampler's records of those rows).
- the pages of rejected positions are rolled back (`KVCacheManager.trim`); the prefix cache only
  registers pages of accepted tokens.

Requests with a grammar matcher or a reasoning-budget tracker never speculate (both must see
committed tokens one at a time); stops and max_tokens truncate an accepted run (`Scheduler._commit`).

Proposers (`Proposer`): `NgramProposer`, prompt lookup over the request's own prompt and output
(vLLM's ``ngram`` / llama.cpp's lookup decoding). The interface takes the request's tokens and a
depth, so a shared decoded-history proposer or a learned drafter fits behind it; neither exists yet
(``flare_history_drafts_enabled`` is 0, ``learned_drafter`` false).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import attrs

SPECULATIVE_MODES = ("off", "ngram", "adaptive")

BATCH_DRAFT_TOKENS = 8
"""Adaptive mode's back-off: a request's depth is at most ``BATCH_DRAFT_TOKENS // decode rows - 1``,
so the drafts of a large batch (compute-bound rather than weight-bandwidth-bound) shrink to none:
up to 7 drafts alone, 3 each for two streams, 1 for four, none from five. On the CPU a step's cost
grows with its rows well before that (default model, int4, 1,000-token contexts: one stream with 4
drafts cost 1.45x a decode step, eight streams with 3 drafts each 4.2x)."""


@attrs.frozen
class SpeculativeConfig:
    mode: str = attrs.field(default="off", validator=attrs.validators.in_(SPECULATIVE_MODES))
    """off: no drafts; ngram: up to ``max_depth`` prompt-lookup drafts per round; adaptive: n-gram
    drafts whose depth follows each request's recent acceptance and backs off in large batches."""
    max_depth: int = 4
    min_ngram: int = 2
    max_ngram: int = 4

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


class Proposer(Protocol):
    """Drafts for one request. Stateful per request; called once per decode round with its tokens so
    far (prompt and committed output; the list only grows)."""

    kind: str

    def propose(self, token_ids: Sequence[int], depth: int) -> tuple[int, ...]:
        """Up to ``depth`` tokens likely to follow ``token_ids`` (empty: no guess)."""
        ...


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the request's last
    n tokens (the longest n in ``min_n .. max_n`` that occurred before), in its prompt or output.

    An index from each n-gram to the end of its latest occurrence is extended with the tokens added
    since the last call, so a call costs the new tokens, not the whole context."""

    kind = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.sizes = tuple(range(max_n, min_n - 1, -1))
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self._indexed = 1  # n-grams ending before this index are in the index

    def propose(self, token_ids: Sequence[int], depth: int) -> tuple[int, ...]:
        end = len(token_ids)
        if depth <= 0 or end < 2:
            return ()
        # Index n-grams ending at 1 .. end - 1 (each has a continuation); the one ending at `end`
        # is the suffix being looked up, and is indexed on the next call.
        lo = self._indexed
        if lo < end:
            for n, index in self._index.items():
                for e in range(max(lo, n), end):
                    index[tuple(token_ids[e - n : e])] = e
            self._indexed = end
        for n in self.sizes:
            if n >= end:
                continue
            at = self._index[n].get(tuple(token_ids[end - n : end]))
            if at is not None:
                return tuple(token_ids[at : min(at + depth, end)])
        return ()


@attrs.define
class DraftState:
    """One speculating request's proposer and planned depth (adaptive mode moves it)."""

    proposer: Proposer
    depth: int

    def observe(self, cfg: SpeculativeConfig, proposed: int, accepted: int) -> None:
        """Adaptive depth after a verified round: doubled after a round that accepted every draft;
        after a rejection, one more than the drafts accepted but at least half the drafts offered
        (one miss in a long copy does not collapse the depth). At most ``max_depth``, at least 1."""
        if cfg.mode != "adaptive" or proposed == 0:
            return
        depth = 2 * proposed if accepted == proposed else max(accepted + 1, proposed // 2)
        self.depth = max(min(cfg.max_depth, depth), 1)


def planned_depth(cfg: SpeculativeConfig, state: DraftState, num_decode: int) -> int:
    """Drafts to ask for this round: the request's depth, and in adaptive mode at most
    ``BATCH_DRAFT_TOKENS // num_decode - 1`` (zero in a large batch)."""
    depth = min(state.depth, cfg.max_depth)
    if cfg.mode == "adaptive":
        depth = min(depth, BATCH_DRAFT_TOKENS // max(num_decode, 1) - 1)
    return max(depth, 0)


@attrs.define
class SpeculativeStats:
    """The engine's speculation counters (spec: "Health and metrics"). A request round is one decode
    or verification chunk of a request past its prefill that committed at least one token."""

    verify_steps: int = 0
    """Steps whose forward verified at least one draft (flare_speculative_rounds_total, summed)."""
    verification_drafts: int = 0
    """Drafts planned for progressing request rounds, rejected ones included."""
    verification_rounds: int = 0
    """Progressing decode or verification request rounds, zero-draft rounds included."""
    accepted_drafts: int = 0
    """Drafts accepted and committed (the bonus token excluded)."""
    draft_rounds: int = 0
    """Request rounds that offered at least one draft."""
    steps_by_width: dict[int, int] = attrs.field(factory=dict)
    """verify_steps by the widest verification row of the step (drafts + 1)."""
    rounds_by_depth: dict[int, int] = attrs.field(factory=dict)
    """verification_rounds by the round's planned depth (drafts offered)."""
    accepted_by_depth: dict[int, int] = attrs.field(factory=dict)
    """accepted_drafts by the round's planned depth."""

    def round(self, drafts: int, accepted: int) -> None:
        self.verification_rounds += 1
        self.verification_drafts += drafts
        self.accepted_drafts += accepted
        self.rounds_by_depth[drafts] = self.rounds_by_depth.get(drafts, 0) + 1
        if drafts:
            self.draft_rounds += 1
            self.accepted_by_depth[drafts] = self.accepted_by_depth.get(drafts, 0) + accepted

    def step(self, widest: int) -> None:
        self.verify_steps += 1
        self.steps_by_width[widest] = self.steps_by_width.get(widest, 0) + 1

    def snapshot(self) -> SpeculativeStats:
        return SpeculativeStats(self.verify_steps, self.verification_drafts, self.verification_rounds,
                                self.accepted_drafts, self.draft_rounds, dict(self.steps_by_width),
                                dict(self.rounds_by_depth), dict(self.accepted_by_depth))
