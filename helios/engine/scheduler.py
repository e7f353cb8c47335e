"""Continuous batching with chunked prefill over the paged KV pool.

Every step, all running sequences that finished their prefill decode one token, and the remaining
token budget (`prefill_chunk_size`) goes to prefill chunks, oldest first. Requests join at any step
once pages for their whole prompt are free and a slot is open, and leave the batch the step they
finish. When pages run out during decode, the newest running sequence is preempted (its pages are
freed and it is recomputed later from its prompt plus the tokens it already produced); a sequence
that cannot grow even alone finishes with the length cause.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Iterable

import attrs
import torch

from helios.engine.kv.pool import PagePool
from helios.engine.records import EngineFinish, EngineRequest


class SeqStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@attrs.define(eq=False)
class Sequence:
    request: EngineRequest
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None
    arrival: int
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = attrs.field(factory=list)
    num_preemptions: int = 0
    num_prompt_scored: int = 0  # prompt positions whose scores went out (prompt_logprobs requests)

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

    seq: Sequence
    start: int  # first token index (== position) in seq.token_ids
    length: int
    samples: bool


@attrs.frozen
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    finished_early: tuple[tuple[Sequence, EngineFinish], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        pool: PagePool,
        *,
        max_active: int,
        prefill_chunk_size: int,
        max_model_len: int,
    ) -> None:
        self.pool = pool
        self.max_active = max_active
        self.prefill_chunk_size = prefill_chunk_size
        self.max_model_len = max_model_len
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.by_id: dict[str, Sequence] = {}
        self._arrivals = 0
        self.num_preemptions = 0

    # -- membership -------------------------------------------------------------------------
    def add(self, request: EngineRequest, generator: torch.Generator | None) -> Sequence:
        seq = Sequence(
            request=request,
            token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            generator=generator,
            arrival=self._arrivals,
        )
        self._arrivals += 1
        self.waiting.append(seq)
        self.by_id[request.request_id] = seq
        return seq

    def finish(self, seq: Sequence) -> None:
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
        self.pool.free(seq.block_table)
        self.by_id.pop(seq.request_id, None)

    def abort(self, request_ids: Iterable[str]) -> list[Sequence]:
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
        finished_early: list[tuple[Sequence, EngineFinish]] = []
        budget = self.prefill_chunk_size

        # 1. Decode: every running sequence past its prefill grows by one token.
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.status != SeqStatus.RUNNING or seq.is_prefilling:
                continue
            total = len(seq.token_ids)
            while not self.pool.can_allocate(seq.block_table, total):
                victim = self._newest_running(exclude=seq)
                if victim is None:
                    break
                self._preempt(victim)
            if not self.pool.can_allocate(seq.block_table, total):
                # Alone and still no room: the spec's "cannot grow past page capacity" → length.
                finished_early.append((seq, EngineFinish.LENGTH))
                self.finish(seq)
                continue
            self.pool.allocate_for(seq.block_table, total)
            chunks.append(ScheduledChunk(seq, total - 1, 1, True))
            budget -= 1
        budget = max(budget, 0)

        # 2. Continue partial prefills of running sequences, oldest first.
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if budget <= 0:
                break
            if seq.status != SeqStatus.RUNNING or not seq.is_prefilling:
                continue
            chunk = self._prefill_chunk(seq, budget)
            chunks.append(chunk)
            budget -= chunk.length

        # 3. Admit waiting sequences while slots, pages and budget allow.
        while self.waiting and budget > 0 and len(self.running) < self.max_active:
            seq = self.waiting[0]
            # Pages for the whole known context plus one generated token, so a prefill is never
            # stranded half-way for lack of pages.
            if not self.pool.can_allocate(seq.block_table, len(seq.token_ids) + 1):
                if not self.running and self.pool.num_free == self.pool.num_pages:
                    # It can never fit: fail it rather than wait forever.
                    self.waiting.popleft()
                    finished_early.append((seq, EngineFinish.LENGTH))
                    seq.status = SeqStatus.FINISHED
                    self.by_id.pop(seq.request_id, None)
                    continue
                break
            self.waiting.popleft()
            self.pool.allocate_for(seq.block_table, len(seq.token_ids))
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            chunk = self._prefill_chunk(seq, budget)
            chunks.append(chunk)
            budget -= chunk.length

        return SchedulerOutput(tuple(chunks), tuple(finished_early))

    def after_forward(self, out: SchedulerOutput) -> None:
        for c in out.chunks:
            c.seq.num_computed = c.start + c.length

    # -- helpers ----------------------------------------------------------------------------
    def _prefill_chunk(self, seq: Sequence, budget: int) -> ScheduledChunk:
        total = len(seq.token_ids)
        self.pool.allocate_for(seq.block_table, total)
        start = seq.num_computed
        length = min(total - start, budget)
        return ScheduledChunk(seq, start, length, samples=start + length == total)

    def _newest_running(self, exclude: Sequence) -> Sequence | None:
        cands = [s for s in self.running if s is not exclude]
        return max(cands, key=lambda s: s.arrival) if cands else None

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: drop its KV and put it first in line again."""
        self.running.remove(seq)
        self.pool.free(seq.block_table)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def check_integrity(self) -> None:
        self.pool.check_integrity([s.block_table for s in self.running] + [s.block_table for s in self.waiting])
        for s in self.running:
            assert s.status == SeqStatus.RUNNING
            assert len(s.block_table) * self.pool.page_size >= s.num_computed
