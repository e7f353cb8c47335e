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
(vLLM's ``ngram`` / llama.cpp's lookup decoding), then `HistoryProposer`, lookup in the shared
decoded history (`SharedHistory`: the recent outputs of every speculating request, so one request's
output drafts another's: parallel choices of one prompt, a batch of similar edits, an agent
re-sending what another session produced), then, with ``[speculative] draft_model``, the draft
model (`drafter.LearnedProposer`: a second, smaller model with the target's vocabulary decodes
greedily from the request's tokens, in its own KV pages), or, for a checkpoint with
multi-token-prediction layers and no draft model, its MTP layer (`mtp.MTPDrafter`'s `drafter.LearnedProposer`: the layer reads
the target's own hidden states). `FirstOf` asks them in that order: the cheap exact lookups first,
the learned drafter when neither has a guess. A greedy draft model, or MTP layer, is a
deterministic proposer (its drafts are a function of the request's tokens), so the argument above
holds for it unchanged.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

import attrs

SPECULATIVE_MODES = ("off", "ngram", "adaptive")

DRAFT_MODEL_KIND = "draft"
"""The proposer kind of the draft model's drafts (`drafter.Drafter`)."""
MTP_KIND = "mtp"
"""The proposer kind of a checkpoint's multi-token-prediction layer's drafts (`mtp.MTPDrafter`)."""
LEARNED_KINDS = (DRAFT_MODEL_KIND, MTP_KIND)
"""The learned drafters' kinds (at most one per engine): their rounds are the ``model_*`` counters."""

BATCH_DRAFT_TOKENS = 8
"""Adaptive mode's back-off: a request's depth is at most ``BATCH_DRAFT_TOKENS // decode rows - 1``,
so the drafts of a large batch (compute-bound rather than weight-bandwidth-bound) shrink to none:
up to 7 drafts alone, 3 each for two streams, 1 for four, none from five. On the CPU a step's cost
grows with its rows well before that (default model, int4, 1,000-token contexts: one stream with 4
drafts cost 1.45x a decode step, eight streams with 3 drafts each 4.2x)."""


MISS_LIMIT = 3
"""Adaptive mode: draft rounds in a row that accept nothing before the request pauses drafting."""
PAUSE_ROUNDS = 16
"""Adaptive mode: the first pause's length in decode rounds (`DraftState.observe`)."""
MAX_PAUSE_ROUNDS = 256
"""Adaptive mode: the longest pause."""


@attrs.frozen
class SpeculativeConfig:
    mode: str = attrs.field(default="off", validator=attrs.validators.in_(SPECULATIVE_MODES))
    """off: no drafts; ngram: up to ``max_depth`` prompt-lookup drafts per round; adaptive: n-gram
    drafts whose depth follows each request's recent acceptance and backs off in large batches."""
    max_depth: int = 4
    min_ngram: int = 2
    max_ngram: int = 4
    history: bool = True
    """Also draft from the shared decoded history of other requests (`SharedHistory`)."""
    history_tokens: int = 65536
    """The shared history's size: output tokens of the most recent requests kept and indexed."""

    @property
    def enabled(self) -> bool:
        return self.mode != "off"


class Proposer(Protocol):
    """Drafts for one request. Stateful per request; called once per decode round with its tokens so
    far (prompt and committed output; the list only grows)."""

    kind: str
    last_kind: str | None
    """The kind of the proposer whose drafts the last `propose` returned (a plain proposer: its own)."""

    def propose(self, token_ids: Sequence[int], depth: int) -> tuple[int, ...]:
        """Up to ``depth`` tokens likely to follow ``token_ids`` (empty: no guess)."""
        ...

    def prefetch(self, token_ids: Sequence[int], depth: int) -> None:
        """Told before a step's decode rounds are planned: this step's `propose`, if any, comes with
        ``token_ids`` and at most ``depth``. A learned drafter then drafts for every request told
        in one forward per depth (`mtp.MTPDrafter`); the lookups ignore it."""
        ...

    def release(self) -> None:
        """Drop what the proposer holds for the request; called when the request finishes, is
        aborted or is preempted. A later `propose` (after a preemption) starts over."""
        ...


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the request's last
    n tokens (the longest n in ``min_n .. max_n`` that occurred before), in its prompt or output.

    An index from each n-gram to the end of its latest occurrence is extended with the tokens added
    since the last call, so a call costs the new tokens, not the whole context."""

    kind = "ngram"
    last_kind: str | None = "ngram"

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

    def prefetch(self, token_ids: Sequence[int], depth: int) -> None:
        """Nothing to do ahead: a lookup costs the new tokens."""

    def release(self) -> None:
        """Drop the index (rebuilt from the tokens by the next `propose`)."""
        self._index = {n: {} for n in self.sizes}
        self._indexed = 1


class SharedHistory:
    """The decoded outputs of recent requests, indexed by n-gram, shared by every request's proposer.

    Engine-thread state. `extend` indexes a request's newly committed output tokens (each token
    once); `lookup` finds the latest occurrence, in another request's output, of the longest suffix
    of n (``max_n`` down to ``min_n``) tokens of the asking request and returns what followed it
    there. At most ``capacity`` tokens are kept: the least recently extended outputs are dropped
    with their index entries."""

    def __init__(self, min_n: int = 2, max_n: int = 4, capacity: int = 65536) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.sizes = tuple(range(max_n, min_n - 1, -1))
        self.capacity = capacity
        self._outputs: OrderedDict[str, list[int]] = OrderedDict()
        self._index: dict[int, dict[tuple[int, ...], tuple[str, int]]] = {n: {} for n in self.sizes}
        self._size = 0

    @property
    def num_tokens(self) -> int:
        return self._size

    def extend(self, request_id: str, token_ids: Sequence[int], offset: int = 0) -> None:
        """Index the request's output, ``token_ids[offset:]`` (it only grows), past what was indexed."""
        kept = self._outputs.get(request_id)
        if kept is None:
            kept = self._outputs[request_id] = []
        else:
            self._outputs.move_to_end(request_id)
        start = len(kept)
        if offset + start >= len(token_ids):
            return
        kept.extend(token_ids[offset + start :])
        self._size += len(kept) - start
        # An n-gram ending at e (exclusive) has a continuation once e < len(kept); index the n-grams
        # whose continuation's first token just arrived.
        for n, index in self._index.items():
            for e in range(max(start, n), len(kept)):
                index[tuple(kept[e - n : e])] = (request_id, e)
        while self._size > self.capacity and len(self._outputs) > 1:
            self._drop_oldest()

    def lookup(self, token_ids: Sequence[int], depth: int, exclude: str | None = None) -> tuple[int, ...]:
        """Up to ``depth`` tokens that followed the latest occurrence of the longest suffix of
        ``token_ids`` in another request's output (``exclude``: the asking request)."""
        if depth <= 0:
            return ()
        end = len(token_ids)
        for n in self.sizes:
            if n > end:
                continue
            found = self._index[n].get(tuple(token_ids[end - n : end]))
            if found is None or found[0] == exclude:
                continue
            output = self._outputs[found[0]]
            return tuple(output[found[1] : found[1] + depth])
        return ()

    def _drop_oldest(self) -> None:
        request_id, output = self._outputs.popitem(last=False)
        self._size -= len(output)
        for n, index in self._index.items():
            for e in range(n, len(output)):
                key = tuple(output[e - n : e])
                if index.get(key, (None, 0))[0] == request_id:
                    del index[key]


class HistoryProposer:
    """Drafts from the shared decoded history (`SharedHistory`), never from the asking request itself."""

    kind = "history"
    last_kind: str | None = "history"

    def __init__(self, history: SharedHistory, request_id: str) -> None:
        self.history = history
        self.request_id = request_id

    def propose(self, token_ids: Sequence[int], depth: int) -> tuple[int, ...]:
        return self.history.lookup(token_ids, depth, exclude=self.request_id)

    def prefetch(self, token_ids: Sequence[int], depth: int) -> None:
        """Nothing to do ahead."""

    def release(self) -> None:
        """Nothing is held per request: the shared history keeps a finished request's output on
        purpose (it drafts later requests) and bounds itself in tokens."""


class FirstOf:
    """Proposers asked in order; the first that has drafts gives them (`kind` names it)."""

    def __init__(self, *proposers: Proposer) -> None:
        self.proposers = proposers
        self.kind = "+".join(p.kind for p in proposers)
        self.last_kind: str | None = None
        """The proposer whose drafts the last call returned (None: no drafts)."""

    def propose(self, token_ids: Sequence[int], depth: int) -> tuple[int, ...]:
        for proposer in self.proposers:
            drafts = proposer.propose(token_ids, depth)
            if drafts:
                self.last_kind = proposer.kind
                return drafts
        self.last_kind = None
        return ()

    def prefetch(self, token_ids: Sequence[int], depth: int) -> None:
        """Told on to the proposers `propose` would reach: up to the first of them that has drafts
        now (the lookups answer at once; the same call then gives the same drafts)."""
        for proposer in self.proposers:
            proposer.prefetch(token_ids, depth)
            if proposer is not self.proposers[-1] and proposer.propose(token_ids, depth):
                return

    def release(self) -> None:
        for proposer in self.proposers:
            proposer.release()


@attrs.define
class DraftState:
    """One speculating request's proposer and planned depth (adaptive mode moves it)."""

    proposer: Proposer
    depth: int
    last_kind: str | None = None
    """The proposer kind of the drafts planned last (``history``: the shared history's)."""
    misses: int = 0
    """Adaptive mode: consecutive draft rounds that accepted nothing."""
    paused: int = 0
    """Adaptive mode: decode rounds left in which the request drafts nothing."""
    pause_rounds: int = PAUSE_ROUNDS
    """The next pause's length (doubles after each pause, back to ``PAUSE_ROUNDS`` on an acceptance)."""

    def observe(self, cfg: SpeculativeConfig, proposed: int, accepted: int) -> None:
        """Adaptive depth after a verified round: doubled after a round that accepted every draft;
        after a rejection, one more than the drafts accepted but at least half the drafts offered
        (one miss in a long copy does not collapse the depth). At most ``max_depth``, at least 1.

        A request whose drafts stop being accepted turns itself off: after ``MISS_LIMIT`` draft
        rounds in a row that accepted nothing it drafts nothing for ``pause_rounds`` decode rounds,
        then tries again; each pause that follows another without an acceptance between them is
        twice as long (at most ``MAX_PAUSE_ROUNDS``), so text the proposers cannot predict costs
        at most one verification round in ``MISS_LIMIT + pause`` beyond plain decoding."""
        if cfg.mode != "adaptive" or proposed == 0:
            return
        depth = 2 * proposed if accepted == proposed else max(accepted + 1, proposed // 2)
        self.depth = max(min(cfg.max_depth, depth), 1)
        if accepted:
            self.misses = 0
            self.pause_rounds = PAUSE_ROUNDS
            return
        self.misses += 1
        if self.misses >= MISS_LIMIT:
            self.misses = 0
            self.paused = self.pause_rounds
            self.pause_rounds = min(2 * self.pause_rounds, MAX_PAUSE_ROUNDS)

    def pause_round(self) -> bool:
        """Whether this decode round drafts nothing (a pause's round, counted down)."""
        if self.paused <= 0:
            return False
        self.paused -= 1
        return True


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
    history_draft_rounds: int = 0
    """Request rounds whose drafts came from the shared decoded history (part of draft_rounds)."""
    history_accepted_drafts: int = 0
    """Accepted drafts of those rounds (part of accepted_drafts)."""
    paused_rounds: int = 0
    """Decode rounds in which a speculating request drafted nothing because it was paused
    (adaptive mode, after drafts stopped being accepted)."""
    model_draft_rounds: int = 0
    """Request rounds whose drafts came from the learned drafter (``draft_model``, or the checkpoint's
    MTP layer; part of draft_rounds)."""
    model_accepted_drafts: int = 0
    """Accepted drafts of those rounds (part of accepted_drafts)."""

    def round(self, drafts: int, accepted: int, kind: str | None = None) -> None:
        if drafts and kind == HistoryProposer.kind:
            self.history_draft_rounds += 1
            self.history_accepted_drafts += accepted
        elif drafts and kind in LEARNED_KINDS:
            self.model_draft_rounds += 1
            self.model_accepted_drafts += accepted
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
                                dict(self.rounds_by_depth), dict(self.accepted_by_depth),
                                self.history_draft_rounds, self.history_accepted_drafts, self.paused_rounds,
                                self.model_draft_rounds, self.model_accepted_drafts)
