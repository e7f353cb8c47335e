"""Continuous batching with chunked prefill over the paged KV cache: the scheduler half of the step.

The step (nano-vllm's shape, with vLLM v1's named boundary records):

    scheduler.schedule() -> SchedulerOutput          which tokens of which requests run now
    runner.execute(SchedulerOutput) -> RunnerOutput   forward, prompt scores, sampling
    scheduler.update(SchedulerOutput, RunnerOutput) -> [RequestOutput]
                                                      commit tokens, stop checks, frees

The runner reads request state but changes none: every change to a `RequestState` is made here.
`schedule` writes on each chunk what the runner needs to know (its tokens, the token forced in place
of its draw, the prompt positions it scores, its drafts); `update` commits what came back. A request
with a grammar or a reasoning budget has one `output_tracker.OutputTracker`, fed every committed
token once in `update`: it says which token is forced next (the budget's close), which
grammar-forced tokens follow a sampled one (committed in the same step, after it), and whether the
grammar rejected a token (the request then fails with `records.GRAMMAR_FAILURE`).

Every step, all running requests that finished their prefill decode one token, and the remaining
token budget (`prefill_chunk_size`) goes to prefill chunks, oldest first. Requests join at any step
once pages for their whole prompt are free and a slot is open, and leave the batch the step they
finish. Page ownership belongs to the KV cache manager (`kv/manager.py`). A layout with recurrent
layers reuses prefixes through state checkpoints (`kv/checkpoints.py`): admission restores one
(pages and state snapshot), prefill chunks end at the checkpoints planned for the request, and
`update` captures them and keeps a decoding request's endpoint copy.

Speculation with recurrent state (`StateRollback`): a recurrent layer's state cannot drop a
rejected draft's update, so before a verification round runs, the request's state is saved (a copy
into its backup row). When every draft is accepted the state already is the state after them. When
one is rejected, the saved state is put back and the request's computed position goes back to the
round's start: the next step recomputes the round's first token, the accepted drafts and the token
sampled in place of the rejected one as one chunk (no drafts on it), so the state holds exactly the
committed tokens. With state checkpoints, a round's drafts never pass the next page boundary, so
every boundary is reached exactly and its endpoint copy taken (after the round is settled).

Preemption (recompute: the victim's pages are freed and it is prefilled again later from its prompt
plus the tokens it already produced). When a decoding request needs a page and none is free, the
newest running request not yet scheduled in this step is preempted; when every other request is
already scheduled, the requesting one preempts itself (as vLLM does). A request that cannot grow
even alone finishes with the length cause (the spec's "cannot grow past page capacity").
"""

from __future__ import annotations

import collections
import enum
import time
from collections.abc import Callable, Iterable

import attrs
import torch

from helios.domain.events import FailureKind
from helios.domain.logprobs import PromptLogprob, TokenLogprob
from helios.engine.kv.checkpoints import Checkpoints
from helios.engine.kv.coordinator import KVManager
from helios.engine.kv.manager import ImageKey
from helios.engine.output_tracker import MAX_FORCED, OutputTracker
from helios.engine.records import (
    GRAMMAR_FAILURE,
    EngineFailure,
    EngineFinish,
    EngineRequest,
    RequestOutput,
    RunnerOutput,
)
from helios.engine.speculative import (
    DraftState,
    FirstOf,
    HistoryProposer,
    NgramProposer,
    Proposer,
    SharedHistory,
    SpeculativeConfig,
    SpeculativeStats,
    planned_depth,
)

_MAX_PENDING = 1 + MAX_FORCED  # a sampled token and the grammar-forced ones committed after it


class SeqStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@attrs.define(eq=False)
class RequestState:
    """What the step needs to know about one request, owned by the scheduler.

    Its pages are not here: the KV cache manager keys block tables by request id. The last two
    fields are the plug-in points of later features: the output tracker of a request with a grammar
    or a reasoning budget (`output_tracker.OutputTracker`: the runner reads its token mask; `update`
    feeds it every committed token, commits the grammar-forced tokens it names and fails the
    request when the grammar rejects a token; at the budget's cap `schedule` puts the close token on
    the chunk as its forced token) and speculative decoding's `speculative.DraftState` (its proposer
    and depth: drafts ride on the decode chunk, their pages are lookahead slots in `allocate_slots`,
    and the runner samples several positions per step).
    """

    request: EngineRequest
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None
    arrival: int
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose K/V are in the cache
    num_preemptions: int = 0
    num_prompt_scored: int = 0  # prompt positions whose scores went out (prompt_logprobs requests)
    num_cached_tokens: int = 0  # prompt tokens reused at its first admission (usage's cached_tokens)
    block_hashes: list[int] = attrs.field(factory=list)
    """Prefix-cache chain hashes of its pages, computed once (extended as its tokens grow)."""
    image_keys: tuple[ImageKey, ...] = ()
    """Its images' spans and identities, in every chain hash of a page a span overlaps."""
    tracker: OutputTracker | None = None
    """Its grammar gate and reasoning budget (None: it has neither)."""
    drafts: DraftState | None = None
    """Set when the request speculates (speculation on; no grammar, no reasoning budget)."""
    capture_at: list[tuple[int, str, bool]] = attrs.field(factory=list)
    """State checkpoints planned at admission (`kv/checkpoints.py`): (page boundary, role, charged)
    in position order; a prefill chunk ends at the next one, whose state is captured after it (a
    capture that needs no split is charged then, one that splits a chunk when it was selected)."""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < len(self.token_ids) - 1


@attrs.frozen
class ScheduledChunk:
    """A slice of one sequence's tokens to run this step; `samples` when its last token yields a new one."""

    seq: RequestState
    start: int  # first token index (== position) in seq.token_ids
    length: int
    samples: bool
    forced_token_id: int | None = None
    """The runner returns this token instead of the row's draw (no logprob entry): a reasoning
    budget's close token. Only on a chunk that samples."""
    draft_token_ids: tuple[int, ...] = ()
    """Speculative drafts verified after the chunk's tokens: they are the chunk's last
    ``len(draft_token_ids)`` positions (counted in ``length``), not in ``seq.token_ids``."""
    decode_round: bool = False
    """A decode (or verification) round of a request past its prefill: what the speculative
    counters count (prefill chunks, resumed ones included, are not rounds)."""
    score_from: int = 0
    """Prompt positions already scored when it was scheduled (``RequestState.num_prompt_scored``;
    prompt_logprobs requests): a recomputed prefill after a preemption scores none of them again."""

    @property
    def num_drafts(self) -> int:
        return len(self.draft_token_ids)

    @property
    def scores_prompt(self) -> bool:
        """Whether its rows predict prompt positions whose scores were asked for."""
        return self.seq.request.prompt_logprobs is not None and self.start < self.seq.num_prompt_tokens

    def prompt_targets(self) -> tuple[bool, int, int]:
        """For a chunk that `scores_prompt`: whether it emits position 0's null score, and the first
        and last (inclusive) prompt positions it scores (row p predicts position p + 1; none when
        first > last)."""
        null_first = self.score_from == 0 and self.start == 0  # position 0 has nothing before it
        first = max(self.start + 1, 1 if null_first else self.score_from)
        last = min(self.start + self.length, self.seq.num_prompt_tokens - 1)
        return null_first, first, last


@attrs.frozen
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    finished_early: tuple[tuple[RequestState, EngineFinish], ...] = ()
    freed: tuple[str, ...] = ()
    """Requests whose pages were released since the previous step (finished, aborted, preempted):
    the runner drops its per-request state for them before building this step."""
    trimmed: tuple[tuple[str, int], ...] = ()
    """(request, pages kept) of the speculative rollbacks since the previous step: the tables'
    entries from there on may have changed since the runner last copied them."""

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)


@attrs.frozen
class StateRollback:
    """A recurrent layout's state copies for speculation (by request id): `save` copies a request's
    state into its backup row before a verification round, `restore` copies it back."""

    save: Callable[[str], None]
    restore: Callable[[str], None]


class Scheduler:
    def __init__(
        self,
        kv: KVManager,
        *,
        max_active: int,
        prefill_chunk_size: int,
        max_model_len: int,
        restore: Callable[[int, int], bool] | None = None,
        host_has: Callable[[int], bool] | None = None,
        speculative: SpeculativeConfig | None = None,
        checkpoints: Checkpoints | None = None,
        draft_proposer: Callable[[str], Proposer] | None = None,
        rollback: StateRollback | None = None,
    ) -> None:
        self.kv = kv
        # A recurrent layout's state save and restore around verification rounds (None: the layout
        # has no recurrent group, or speculation is off).
        self.rollback = rollback
        self.state_rollbacks = 0  # verification rounds whose state was put back (a draft rejected)
        # A recurrent layout's state checkpoints (None: the layout has no recurrent group, or no
        # prefix cache): captured here, restored at admission.
        self.checkpoints = checkpoints
        # The host store behind the prefix cache: `host_has(hash)` says whether it holds a page,
        # `restore(hash, page)` fills a page from it (False: the record was missing or corrupt).
        self.restore = restore
        self.host_has = host_has
        self.max_active = max_active
        self.prefill_chunk_size = prefill_chunk_size
        self.max_model_len = max_model_len
        self.waiting: collections.deque[RequestState] = collections.deque()
        self.running: list[RequestState] = []
        self.by_id: dict[str, RequestState] = {}
        self._arrivals = 0
        self.num_preemptions = 0
        # Totals for the metrics: prompt tokens prefilled and tokens committed.
        self.prefill_tokens = 0
        self.generated_tokens = 0
        self.reused_tokens = 0  # prompt tokens covered by page-pool prefix hits at admission
        self.host_hits = 0  # admissions that restored pages from the host store
        self.host_reused_tokens = 0  # tokens those restored pages covered
        # Per host-store lookup: tokens still to prefill, and the restore's time in ns.
        self.host_lookups: list[tuple[int, int]] = []
        self._freed: list[str] = []
        self._trimmed: dict[str, int] = {}
        self.reasoning_budget_cuts = 0  # forced reasoning closes committed (flare_reasoning_budget_cuts_total)
        self.speculative = speculative or SpeculativeConfig()
        self.spec_stats = SpeculativeStats()
        spec_cfg = self.speculative
        self.history: SharedHistory | None = (
            SharedHistory(spec_cfg.min_ngram, spec_cfg.max_ngram, spec_cfg.history_tokens)
            if spec_cfg.enabled and spec_cfg.history else None)
        """The shared decoded history the speculating requests draft from (None: off)."""
        self.draft_proposer = draft_proposer if spec_cfg.enabled else None
        """Makes a request's draft-model proposer, asked after the lookups (None: no draft model)."""

    # -- membership -------------------------------------------------------------------------
    def add(self, request: EngineRequest, generator: torch.Generator | None) -> RequestState:
        seq = RequestState(
            request=request,
            token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            generator=generator,
            arrival=self._arrivals,
            tracker=OutputTracker.of(request),
            image_keys=tuple((im.offset, im.offset + im.length, im.identity.encode()) for im in request.images),
        )
        spec = self.speculative
        if spec.enabled and seq.tracker is None and request.max_tokens > 1:
            chain: list[Proposer] = [NgramProposer(spec.min_ngram, spec.max_ngram)]
            if self.history is not None:
                chain.append(HistoryProposer(self.history, request.request_id))
            if self.draft_proposer is not None:
                chain.append(self.draft_proposer(request.request_id))
            seq.drafts = DraftState(chain[0] if len(chain) == 1 else FirstOf(*chain), spec.max_depth)
        self._arrivals += 1
        self.waiting.append(seq)
        self.by_id[request.request_id] = seq
        return seq

    def finish(self, seq: RequestState) -> None:
        """Remove a sequence from the batch and free its pages (idempotent)."""
        if seq.status == SeqStatus.FINISHED:
            return
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        seq.status = SeqStatus.FINISHED
        self._release(seq)
        self.by_id.pop(seq.request_id, None)

    def abort(self, request_ids: Iterable[str]) -> list[RequestState]:
        out = []
        for rid in request_ids:
            seq = self.by_id.get(rid)
            if seq is not None:
                self.finish(seq)
                out.append(seq)
        return out

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- the step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        chunks: list[ScheduledChunk] = []
        finished_early: list[tuple[RequestState, EngineFinish]] = []
        scheduled: set[str] = set()
        budget = self.prefill_chunk_size
        kv = self.kv

        # 1. Decode: every running request past its prefill grows by one token (speculating ones
        # verify their drafts in the same chunk).
        num_decode = sum(1 for s in self.running if _decodes(s))
        if self.draft_proposer is not None:  # a learned drafter: announce the rounds (`_prefetch_drafts`)
            self._prefetch_drafts(budget, num_decode)
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.status != SeqStatus.RUNNING or not _decodes(seq):
                continue
            total = len(seq.token_ids)
            while not kv.can_allocate(seq.request_id, total):
                victim = self._newest_unscheduled(exclude=seq, scheduled=scheduled)
                if victim is None:
                    break
                self._preempt(victim)
            if not kv.can_allocate(seq.request_id, total):
                if any(s is not seq for s in self.running):
                    # Everyone else already runs this step: this request waits its turn again.
                    self._preempt(seq)
                else:
                    # Alone and still no room: the spec's "cannot grow past page capacity" → length.
                    finished_early.append((seq, EngineFinish.LENGTH))
                    self.finish(seq)
                continue
            num_new = total - seq.num_computed  # 1, or more after grammar-forced tokens
            drafts = self._drafts(seq, num_new, budget, num_decode, len(scheduled))
            kv.allocate_slots(seq.request_id, seq.num_computed, num_new, len(drafts))
            self._materialize(seq, total - num_new, total + len(drafts))
            if drafts and self.rollback is not None:
                self.rollback.save(seq.request_id)
            chunks.append(ScheduledChunk(seq, total - num_new, num_new + len(drafts), True, self._forced_token(seq),
                                         drafts, decode_round=True, score_from=seq.num_prompt_scored))
            scheduled.add(seq.request_id)
            budget -= num_new + len(drafts)
        budget = max(budget, 0)

        # 2. Continue partial prefills of running requests, oldest first.
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if budget <= 0:
                break
            if seq.status != SeqStatus.RUNNING or not seq.is_prefilling or seq.request_id in scheduled:
                continue
            chunk = self._prefill_chunk(seq, budget)
            chunks.append(chunk)
            scheduled.add(seq.request_id)
            budget -= chunk.length

        # 3. Admit waiting requests while slots, pages and budget allow.
        while self.waiting and budget > 0 and len(self.running) < self.max_active:
            seq = self.waiting[0]
            # The longest cached prefix (none for prompt scoring, which needs every position's
            # logits; its pages are still published for others).
            scoring = seq.request.prompt_logprobs is not None
            hits, _ = ([], []) if scoring else kv.lookup(seq.token_ids, seq.block_hashes, seq.image_keys)
            # Pages for the whole known context plus one generated token, so a prefill is never
            # stranded half-way for lack of pages.
            if not kv.can_admit(len(seq.token_ids) + 1, hits):
                if not self.running and kv.num_free == kv.num_pages:
                    # It can never fit: fail it rather than wait forever.
                    self.waiting.popleft()
                    finished_early.append((seq, EngineFinish.LENGTH))
                    seq.status = SeqStatus.FINISHED
                    self.by_id.pop(seq.request_id, None)
                    continue
                break
            self.waiting.popleft()
            kv.allocate_cached(seq.request_id, hits, seq.block_hashes,
                               seq.request.retain_tokens // kv.page_size)
            t0 = time.perf_counter_ns()
            restored = 0 if scoring else self._restore_from_host(seq, len(hits))
            if self.checkpoints is not None and not self._restore_state(seq, len(hits) + restored):
                # Its checkpoint could not be restored: it starts over from position 0, now if the
                # pool has room for its whole prompt, else at a later step (the failed records are
                # dropped by then, so the lookup does not find them again).
                kv.free(seq.request_id)
                if not kv.can_admit(len(seq.token_ids) + 1, []):
                    self.waiting.appendleft(seq)
                    break
                kv.allocate_cached(seq.request_id, [], seq.block_hashes, seq.request.retain_tokens // kv.page_size)
                hits, restored = [], 0
            if self.host_has is not None and not scoring:
                num_missing = len(seq.token_ids) - (len(hits) + restored) * kv.page_size
                self.host_lookups.append((num_missing, time.perf_counter_ns() - t0))
            seq.num_computed = (len(hits) + restored) * kv.page_size
            self._select_captures(seq)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed
                self.reused_tokens += len(hits) * kv.page_size
                if restored:
                    self.host_hits += 1
                    self.host_reused_tokens += restored * kv.page_size
            kv.allocate_slots(seq.request_id, seq.num_computed, len(seq.token_ids) - seq.num_computed)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            chunk = self._prefill_chunk(seq, budget)
            chunks.append(chunk)
            scheduled.add(seq.request_id)
            budget -= chunk.length

        freed, self._freed = tuple(self._freed), []
        trimmed, self._trimmed = tuple(self._trimmed.items()), {}
        return SchedulerOutput(tuple(chunks), tuple(finished_early), freed, trimmed)

    def update(self, out: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        """Commit what the runner produced: computed positions, prompt-scoring progress, tokens
        (through the output trackers: grammar-forced tokens after a sampled one, a grammar's
        rejection), stops, frees and outputs."""
        outputs = [RequestOutput(s.request_id, (), finish=cause, num_prompt_tokens=s.num_prompt_tokens,
                                 num_cached_tokens=s.num_cached_tokens)
                   for s, cause in out.finished_early]
        for c in out.chunks:
            if c.seq.request_id in result.not_run:
                continue  # its chunk never ran (an image could not be prepared): it fails below
            # Drafts are computed only once verified: their positions are settled below.
            c.seq.num_computed = c.start + c.length - c.num_drafts
            if c.start < c.seq.num_prompt_tokens:
                self.prefill_tokens += min(c.start + c.length, c.seq.num_prompt_tokens) - c.start
                if c.scores_prompt:
                    null_first, first, last = c.prompt_targets()
                    if last >= first:
                        c.seq.num_prompt_scored = last + 1
                    elif null_first:
                        c.seq.num_prompt_scored = 1
            # Pages these tokens filled become findable (their K/V were written this step).
            self.kv.cache_full_pages(c.seq.request_id, c.seq.token_ids, c.seq.num_computed,
                                     c.seq.request.retain_tokens // self.kv.page_size, c.seq.image_keys)
            if self.checkpoints is not None and not (c.num_drafts and self.rollback is not None):
                self._capture(c, self.checkpoints)  # (a verification round's: once it is settled)
        widest = 0
        for c in out.chunks:
            seq = c.seq
            rid = seq.request_id
            scores = result.prompt_logprobs.get(rid)
            tokens = result.sampled.get(rid)
            error = result.failed.get(rid)
            if tokens and error is None and seq.tracker is not None:
                tokens, error = self._track(seq, seq.tracker, tokens)
            if error is not None:  # a grammar rejected its token, or an image failed: it ends here
                self.finish(seq)
                outputs.append(RequestOutput(rid, (), finish=EngineFinish.ERROR, error=error.message,
                                             failure=error.kind,
                                             num_prompt_tokens=seq.num_prompt_tokens,
                                             num_cached_tokens=seq.num_cached_tokens))
            elif tokens and c.num_drafts:
                widest = max(widest, c.num_drafts + 1)
                outputs.append(self._commit_verified(c, tokens, result.logprobs.get(rid), scores))
            elif tokens:
                forced = (0,) if c.forced_token_id is not None else ()
                output = self._commit(seq, tokens, result.logprobs.get(rid), scores, forced)
                outputs.append(output)
                if c.decode_round and output.new_token_ids:
                    self.spec_stats.round(0, 0)
            elif c.samples and seq.request.max_tokens == 0:
                # A scoring-only request: its prefill is done and nothing is sampled.
                self.finish(seq)
                outputs.append(RequestOutput(rid, (), prompt_logprobs=scores, finish=EngineFinish.LENGTH,
                                             num_prompt_tokens=seq.num_prompt_tokens,
                                             num_cached_tokens=seq.num_cached_tokens))
            elif scores:
                outputs.append(RequestOutput(rid, (), prompt_logprobs=scores, num_prompt_tokens=seq.num_prompt_tokens,
                                             num_cached_tokens=seq.num_cached_tokens))
        if widest:
            self.spec_stats.step(widest)
        return outputs

    def _track(self, seq: RequestState, tracker: OutputTracker,
               tokens: tuple[int, ...]) -> tuple[tuple[int, ...], EngineFailure | None]:
        """Feed a sampled (or budget-forced) token to the request's tracker: the tokens to commit (it,
        then the grammar-forced run after it: none for logprob requests, never past the output
        limit), or the grammar's rejection. Requests with a tracker never speculate: ``tokens`` is
        the one token of the step."""
        (token_id,) = tokens
        if not tracker.advance(token_id):
            kind = FailureKind.UNPRODUCIBLE if tracker.unproducible else FailureKind.GRAMMAR
            return (), EngineFailure(kind, f"{GRAMMAR_FAILURE}: {tracker.error}")
        req = seq.request
        if tracker.matcher is None or req.num_top_logprobs is not None or req.logprob_token_ids:
            return tokens, None
        forced = tracker.forced_run(req.max_tokens - seq.num_output_tokens - 1)
        return ((token_id, *forced) if forced else tokens), None

    def _commit_verified(self, c: ScheduledChunk, tokens: tuple[int, ...], logprobs: tuple[TokenLogprob, ...] | None,
                         prompt_logprobs: tuple[PromptLogprob | None, ...] | None) -> RequestOutput:
        """Commit a verification round: ``tokens`` are the accepted drafts and then the token sampled
        at the first rejected (or the bonus) position. The accepted drafts' K/V are now computed and
        their full pages registered; the pages of rejected positions are rolled back."""
        seq = c.seq
        accepted = len(tokens) - 1
        if tokens[:accepted] != c.draft_token_ids[:accepted]:
            raise RuntimeError("a verification round committed tokens that differ from its accepted drafts")
        seq.num_computed = c.start + c.length - c.num_drafts + accepted
        # Positions up to the accepted drafts hold accepted tokens (a stop among them ends the
        # request, whose pages are freed right after): never a rejected draft.
        self.kv.cache_full_pages(seq.request_id, [*seq.token_ids, *tokens[:accepted]], seq.num_computed,
                                 seq.request.retain_tokens // self.kv.page_size, seq.image_keys)
        output = self._commit(seq, tokens, logprobs, prompt_logprobs)
        if seq.status != SeqStatus.FINISHED and self.kv.trim(seq.request_id, len(seq.token_ids)):
            kept = len(self.kv.block_table(seq.request_id))
            self._trimmed[seq.request_id] = min(kept, self._trimmed.get(seq.request_id, kept))
        if self.rollback is not None and seq.status != SeqStatus.FINISHED:
            if accepted < c.num_drafts:
                # A rejected draft's update is in the state: back to the round's start, recomputed.
                self.rollback.restore(seq.request_id)
                seq.num_computed = c.start
                self.state_rollbacks += 1
            elif self.checkpoints is not None:
                self._capture(c, self.checkpoints)
        if output.new_token_ids:
            self.spec_stats.round(c.num_drafts, min(accepted, len(output.new_token_ids)),
                                  seq.drafts.last_kind if seq.drafts is not None else None)
        if seq.drafts is not None:
            seq.drafts.observe(self.speculative, c.num_drafts, accepted)
        return output

    def _commit(self, seq: RequestState, tokens: tuple[int, ...], logprobs: tuple[TokenLogprob, ...] | None,
                prompt_logprobs: tuple[PromptLogprob | None, ...] | None,
                forced: tuple[int, ...] = ()) -> RequestOutput:
        """Append the runner's tokens in order; the first that ends the request is the last kept.

        A token stop ends the request at the token that completes it: a `stop_token_ids` entry, or
        the last token of a `stop_token_sequences` entry that the generated tokens now end with
        (generated tokens only: a sequence never matches across the prompt boundary). Neither a token
        stop nor EOS ends it within its first `min_tokens` tokens. `forced`:
        indices of the budget-forced tokens (no entry in `logprobs`). Output trackers were fed the
        tokens already (`_track`)."""
        req = seq.request
        finish: EngineFinish | None = None
        kept = 0
        for token_id in tokens:
            seq.token_ids.append(token_id)
            if kept in forced:
                self.reasoning_budget_cuts += 1
            kept += 1
            stops = seq.num_output_tokens > req.min_tokens  # none before min_tokens (the draws mask them too)
            if stops and (token_id in req.stop_token_ids or any(
                stop[-1] == token_id and len(stop) <= seq.num_output_tokens
                and tuple(seq.token_ids[-len(stop):]) == stop
                for stop in req.stop_token_sequences
            )):
                finish = EngineFinish.STOP_TOKEN
            elif stops and not req.ignore_eos and token_id in req.eos_token_ids:
                finish = EngineFinish.EOS
            elif seq.num_output_tokens >= req.max_tokens or len(seq.token_ids) >= self.max_model_len:
                finish = EngineFinish.LENGTH
            if finish is not None:
                break
        self.generated_tokens += kept
        if self.history is not None and seq.drafts is not None:
            self.history.extend(seq.request_id, seq.token_ids, seq.num_prompt_tokens)
        if finish is not None:
            self.finish(seq)
        kept_forced = tuple(i for i in forced if i < kept)
        return RequestOutput(
            seq.request_id,
            tuple(tokens[:kept]),
            logprobs=None if logprobs is None else tuple(logprobs[:kept - len(kept_forced)]),
            prompt_logprobs=prompt_logprobs,
            forced=kept_forced,
            finish=finish,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
        )

    # -- helpers ----------------------------------------------------------------------------
    def _drafts(self, seq: RequestState, num_new: int, budget: int, num_decode: int,
                num_scheduled: int) -> tuple[int, ...]:
        """A speculating request's drafts for this decode round (empty: plain decode). They stay
        within its output and context limits (the bonus token included) and the step's token
        budget, and take lookahead pages only while every decoding request not scheduled yet
        could still grow by a page."""
        state = seq.drafts
        if state is None or num_new != 1:
            return ()
        if state.pause_round():
            self.spec_stats.paused_rounds += 1
            return ()
        depth = self._draft_depth(seq, state, num_new, budget, num_decode)
        if depth <= 0:
            return ()
        drafts = state.proposer.propose(seq.token_ids, depth)
        state.last_kind = state.proposer.last_kind if drafts else None
        if drafts:
            kv = self.kv
            total = len(seq.token_ids)
            need = kv.pages_needed(seq.request_id, total + len(drafts))
            if need > kv.num_free - max(num_decode - num_scheduled - 1, 0):
                return ()
        return drafts

    def _draft_depth(self, seq: RequestState, state: DraftState, num_new: int, budget: int, num_decode: int) -> int:
        """The drafts a decode round may ask for: the planned depth, within the request's output and
        context limits (the bonus token included) and the step's token ``budget``."""
        depth = min(planned_depth(self.speculative, state, num_decode),
                    seq.request.max_tokens - seq.num_output_tokens - 1,
                    self.max_model_len - len(seq.token_ids) - 1,
                    budget - num_new)
        if self.rollback is not None and self.checkpoints is not None:
            # The round (accepted or recomputed) ends at or before the next page boundary.
            ps = self.kv.page_size
            depth = min(depth, ps - 1 - seq.num_computed % ps)
        return depth

    def _prefetch_drafts(self, budget: int, num_decode: int) -> None:
        """Tell each decoding request's proposer what its round will ask for, so a learned drafter
        drafts for all of them together: the decode loop's depths, the step's budget taken in the
        same order as if every round got the drafts it asks for (a round that then finds more
        budget asks for more, and its drafter computes them when asked)."""
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.status != SeqStatus.RUNNING or not _decodes(seq):
                continue
            num_new = len(seq.token_ids) - seq.num_computed
            state = seq.drafts
            depth = 0
            if state is not None and num_new == 1 and state.paused == 0:
                depth = max(self._draft_depth(seq, state, num_new, budget, num_decode), 0)
                if depth:
                    state.proposer.prefetch(seq.token_ids, depth)
            budget -= num_new + depth

    def _prefill_chunk(self, seq: RequestState, budget: int) -> ScheduledChunk:
        total = len(seq.token_ids)
        start = seq.num_computed
        if self.kv.allocate_slots(seq.request_id, start, total - start) is None:
            raise RuntimeError("pages for a running prefill were not reserved at admission")
        length = min(total - start, budget)
        if seq.capture_at:
            length = min(length, seq.capture_at[0][0] - start)  # end at the next checkpoint
        samples = start + length == total
        self._materialize(seq, start, start + length)
        # A recomputed (preempted) request may be due its close token on its last prefill chunk.
        return ScheduledChunk(seq, start, length, samples, self._forced_token(seq) if samples else None,
                              score_from=seq.num_prompt_scored)

    def _materialize(self, seq: RequestState, start: int, end: int) -> None:
        """The pages of the positions a chunk writes in the lazy pools (`KVManager.materialize`),
        which are sized for every running request's window and the step's chunks."""
        if not self.kv.materialize(seq.request_id, start, end):
            raise RuntimeError(f"the row-window pool has no page for positions {start}..{end - 1} of "
                               f"{seq.request_id}: a step wrote more positions than it was sized for")

    def _forced_token(self, seq: RequestState) -> int | None:
        """The token the runner must return next instead of its draw (None: sample): the tracker's
        (the reasoning close at the budget, when the grammar allows it), while output capacity
        remains."""
        tracker = seq.tracker
        if tracker is None:
            return None
        if seq.num_output_tokens >= seq.request.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return None  # no output capacity left (the request is ending with the length cause)
        return tracker.forced_token()

    def _restore_from_host(self, seq: RequestState, num_hits: int) -> int:
        """Continue a page-pool hit with pages the host store holds: each is given a new page of the
        request and filled from its record, until a record is absent or fails to verify (that
        page then stays the request's, to be computed). Returns the pages restored."""
        if self.restore is None or self.host_has is None:
            return 0
        kv = self.kv
        hashes = seq.block_hashes
        end = num_hits
        while end < min(len(hashes), (len(seq.token_ids) - 1) // kv.page_size) and self.host_has(hashes[end]):
            end += 1
        if self.checkpoints is not None:  # a recurrent layout continues only to a checkpoint
            end = next((k for k in range(end, num_hits, -1) if self.checkpoints.available(hashes[k - 1])), num_hits)
        restored = 0
        for j in range(num_hits, end):
            new = kv.allocate_slots(seq.request_id, j * kv.page_size, kv.page_size)
            if not new or not self.restore(hashes[j], new[0]):
                break
            kv.register(seq.request_id, new[0], hashes[j], seq.token_ids)
            restored += 1
        return restored

    def _restore_state(self, seq: RequestState, num_pages: int) -> bool:
        """A recurrent layout's admission: copy the snapshot at the end of the request's
        ``num_pages`` reused pages into its state slot. False when that fails: a host record that
        does not verify, or a host page restore that stopped short of the checkpoint."""
        assert self.checkpoints is not None
        return num_pages == 0 or self.checkpoints.restore(seq.block_hashes[num_pages - 1], seq.request_id)

    def _select_captures(self, seq: RequestState) -> None:
        """Plan the request's anchor and message checkpoints past what it reuses. One that splits a
        prefill chunk is selected now (charged against the work budget, or counted as a skip:
        `Checkpoints.select`); one at the end of its known tokens after the step that reaches it."""
        seq.capture_at = []
        checkpoints = self.checkpoints
        if checkpoints is None:
            return
        ps = self.kv.page_size
        anchor = seq.num_prompt_tokens // ps * ps
        candidates = [(anchor, "anchor")] if anchor > seq.num_computed else []
        for message in sorted({m // ps * ps for m in seq.request.marker_tokens}):
            if message > seq.num_computed and message != anchor:
                candidates.append((message, "message"))
        for position, role in sorted(candidates):
            if position == len(seq.token_ids):  # the prefill ends there anyway: decided after it
                seq.capture_at.append((position, role, False))
                continue
            known = seq.block_hashes[position // ps - 1] if len(seq.block_hashes) >= position // ps else None
            if checkpoints.select(splits=True, block_hash=known):  # (False, uncounted, if captured already)
                seq.capture_at.append((position, role, True))

    def _capture(self, c: ScheduledChunk, checkpoints: Checkpoints) -> None:
        """After a chunk ran: capture the checkpoint its prefill ended at, and keep a decoding
        request's state at each page it completes (its endpoint copy)."""
        seq = c.seq
        done = seq.num_computed
        ps = self.kv.page_size
        while seq.capture_at and seq.capture_at[0][0] <= done:
            position, role, charged = seq.capture_at.pop(0)
            block_hash = seq.block_hashes[position // ps - 1] if position == done else None
            if block_hash is not None and (charged or checkpoints.select(splits=False, block_hash=block_hash)):
                checkpoints.capture(role, seq.request_id, block_hash)
        if c.decode_round and done % ps == 0 and done > seq.num_prompt_tokens:
            checkpoints.endpoint_copy(seq.request_id, seq.block_hashes[done // ps - 1])

    @property
    def anchor_reservations(self) -> int:
        """Selected anchor checkpoints of running requests not captured yet."""
        return sum(1 for s in self.running for _, role, _ in s.capture_at if role == "anchor")

    def _release(self, seq: RequestState) -> None:
        """Free a request's pages and state (its endpoint copy becomes a checkpoint first)."""
        if self.checkpoints is not None:
            self.checkpoints.release(seq.request_id)
        seq.capture_at = []
        self.kv.free(seq.request_id)
        self._freed.append(seq.request_id)
        if seq.drafts is not None:
            seq.drafts.proposer.release()

    def _newest_unscheduled(self, exclude: RequestState, scheduled: set[str]) -> RequestState | None:
        cands = [s for s in self.running if s is not exclude and s.request_id not in scheduled]
        return max(cands, key=lambda s: s.arrival) if cands else None

    def _preempt(self, seq: RequestState) -> None:
        """Recompute-style preemption: drop its KV and put it first in line again."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def check_integrity(self) -> None:
        kv = self.kv
        kv.check_integrity()
        for s in self.running:
            assert s.status == SeqStatus.RUNNING
            assert len(kv.block_table(s.request_id)) * kv.page_size >= s.num_computed
            positions = [p for p, _, _ in s.capture_at]
            assert positions == sorted(set(positions)), "planned checkpoints out of order"
            assert all(p > s.num_computed for p in positions), "a planned checkpoint was passed"
        for s in self.waiting:
            assert not kv.block_table(s.request_id), "a waiting request holds pages"
            assert not s.capture_at, "a waiting request plans checkpoints"


def _decodes(seq: RequestState) -> bool:
    """Whether a running request decodes this step: its prefill is done and the tokens it has not
    computed are generated ones (one sampled token, or a few more the grammar forced; a recomputed
    request with a longer generated tail finishes it as a prefill)."""
    pending = len(seq.token_ids) - seq.num_computed
    return pending == 1 or (seq.num_computed >= seq.num_prompt_tokens and 1 < pending <= _MAX_PENDING)
