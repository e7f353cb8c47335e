"""The runner half of the step: SchedulerOutput → tensors → model forward → RunnerOutput.

`ModelRunner.execute` owns everything that touches the model: it flattens the scheduled chunks of
several requests into one [T] batch for every linear layer, runs attention through the paged
backend, scores prompt positions for requests that asked, and samples one token per request whose
chunk ends its known tokens. It returns plain values (token ids and logprob records) keyed by
request id, and changes no request state: it reads the requests' tokens and their output trackers'
token masks, and takes everything else from the scheduled chunks; the scheduler commits what it
returns (`Scheduler.update`, which also advances grammars and commits grammar-forced tokens). A
chunk with a forced token (`ScheduledChunk.forced_token_id`, a reasoning budget's close) gets that
token instead of its draw and no logprob record; every other row keeps its draw (the replacement is
made on the host list of sampled ids, so it adds no device read). A chunk that scores its prompt
scores the positions `ScheduledChunk.prompt_targets` names. A chunk with speculative drafts
(`ScheduledChunk.draft_token_ids`) samples each of its last k + 1 positions in the same `sample`
call and returns the run of draws that match the drafts plus the first that does not (`_verify`;
`engine/speculative.py`).

Image prompts (`records.ImageInput`): the rows of a chunk's image placeholder tokens take the image's
features (`images.FeatureWindows`: loaded and encoded when a chunk first needs them, kept in one
bounded window per request until the image's last placeholder is consumed) through the model's
``embeds`` argument; prompt scores at placeholder positions are null. A request whose image cannot
be prepared fails alone: its chunk is left out of the step (`RunnerOutput.not_run`).

The step's tensors come from a persistent input batch (`InputBatch`): each running request holds a
row from its first step until `SchedulerOutput.freed` names it, and the row's block table and
sampling parameters live in preallocated device tensors written only when they change (new pages,
a new request). Per step the host writes the token ids, positions and indices into one staging
buffer that crosses to the device in one copy; the slot mapping is computed there from the block
table. The step reads the device once, in the sampler: the sampled ids (`sampling/sampler.py`, "Host reads").
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as Seq
from typing import Any, overload

import attrs
import torch
from torch import Tensor

from helios.domain.events import FailureKind
from helios.domain.logprobs import PromptLogprob, TokenLogprob
from helios.engine.attention import AttentionInputs, TorchPagedBackend
from helios.engine.images import FeatureWindows, ImageEncoder, ImageError, StepEmbeds
from helios.engine.kv.coordinator import KVCacheCoordinator, KVManager
from helios.engine.records import EngineFailure, RunnerOutput
from helios.engine.sampling import (
    RowParams,
    Sampler,
    SamplingRow,
    consume_uniforms,
    draws_uniform,
    prompt_scores,
    row_log_min_p,
    row_temperature,
)
from helios.engine.scheduler import RequestState, ScheduledChunk, SchedulerOutput
from helios.engine.structured import GrammarBatch
from helios.models.interface import CausalLM, DraftFeatureLM

_SCORE_ROWS = 256  # prompt positions whose logits exist at once while scoring a prompt


class ModelRunner:
    """Runs the model for one scheduled step; owns the persistent input batch and the sampler.

    `execute` changes no `RequestState`: what it returns is committed by `Scheduler.update`."""

    def __init__(self, model: CausalLM, backend: TorchPagedBackend, manager: KVManager, sampler: Sampler,
                 device: torch.device, *, max_rows: int = 64, max_model_len: int = 8192,
                 vision: ImageEncoder | None = None) -> None:
        self.model = model
        self.images = FeatureWindows(vision)
        self.backend = backend
        self.manager = manager
        self.sampler = sampler
        self.device = device
        self.grammar = GrammarBatch(sampler.vocab_size)
        layout = backend.layout
        self.batch = InputBatch(max_rows, -(-(max_model_len + 1) // manager.page_size), manager.page_size, device,
                                num_groups=len(layout.paged_groups), recurrent=layout.has_recurrent)
        # With the CPU paged-decode kernel, verification rows attend as decode tokens: it reads their
        # context in place, where the prefill path gathers it per row and layer (at 1,000 tokens of
        # context, one stream, 4 drafts: 67 ms a step against 131 ms, a plain decode step 46 ms).
        self.batch.verify_as_decode = backend.decode_kernel
        self.compute_logits: Callable[[Tensor], Tensor] = model.compute_logits
        """The logits of the rows a step samples from (the model's; a drafter's may rank a vocabulary
        prefix: `drafter.Drafter`)."""
        self.hidden_sink: Callable[[RequestState, int, Tensor], None] | None = None
        """Given (an MTP drafter's `mtp.MTPDrafter.capture`): called after each forward with every
        chunk of a speculating request, its first position and its rows of the final hidden states,
        or of the features a `DraftFeatureLM` gives its MTP layers (the model's last layer then runs
        for all rows of the step)."""

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.batch.release(sched.freed)
        self.images.release(sched.freed)
        self.batch.rollback(sched.trimmed)
        if not sched.chunks:
            return RunnerOutput()
        scored: dict[str, tuple[PromptLogprob | None, ...]] = {}
        chunks: Seq[ScheduledChunk] = sched.chunks
        embeds: StepEmbeds | None = None
        image_failed: dict[str, EngineFailure] = {}
        with torch.inference_mode():
            if any(_touches_images(c) for c in chunks):
                chunks, embeds, image_failed = self._image_embeds(chunks)
                if not chunks:
                    return RunnerOutput(failed=image_failed, not_run=frozenset(image_failed))
            step = self.batch.prepare(chunks, self.manager)
            # Constrained rows' token masks fill on a helper thread while the forward runs.
            masks = self.grammar.start([s.tracker for s in step.seqs]) if self._any_tracker(step.seqs) else None
            attn = self.backend.build(step.attention)
            # Without prompt scoring only the sampled rows' hidden states are read: the model's last
            # layer computes its MLP for those alone (a prefill chunk that ends no prompt: for none).
            sink = self.hidden_sink
            captured = [c for c in chunks if c.seq.drafts is not None] if sink is not None else []
            keep = step.sample_tokens if not step.scoring and not captured else None
            step_embeds = embeds.tensors(self.device) if embeds is not None and embeds.rows else None
            features: torch.Tensor | None = None
            if captured and isinstance(self.model, DraftFeatureLM):  # its MTP layers read features of their own
                hidden, features = self.model.forward_with_features(step.input_ids, step.positions, attn,
                                                                    embeds=step_embeds)
            elif step_embeds is not None:
                hidden = self.model(step.input_ids, step.positions, attn, embeds=step_embeds, keep=keep)
            else:
                hidden = self.model(step.input_ids, step.positions, attn, keep=keep)
            if captured:
                assert sink is not None
                rows_out = hidden if features is None else features
                offset = 0
                for c in chunks:  # the flattened batch is the chunks in order
                    if c.seq.drafts is not None:
                        sink(c.seq, c.start, rows_out[offset : offset + c.length])
                    offset += c.length
            for offset, c in step.scoring:
                scores = self._score_prompt_chunk(hidden, offset, c)
                if scores:
                    scored[c.seq.request_id] = scores
            if not step.seqs:
                return RunnerOutput(prompt_logprobs=scored, failed=image_failed, not_run=frozenset(image_failed))
            rows = hidden if keep is not None or step.sample_tokens is None else hidden.index_select(
                0, step.sample_tokens)
            logits = self.compute_logits(rows)
            token_mask, masked_rows = masks.result(self.sampler.vocab_size, logits.device) if masks else (None, None)
            if masked_rows is not None and step.first_rows is not None:
                masked_rows = [step.first_rows[i] for i in masked_rows]  # request index -> logits row
            rewind = self._generator_states(step)
            token_ids, logprobs = self.sampler.sample(logits, step.rows, token_mask=token_mask,
                                                      masked_rows=masked_rows, row_params=step.row_params)
        if step.first_rows is not None:
            token_ids, logprobs, verified = self._verify(step, token_ids, logprobs, rewind)
        else:
            verified = {}
        for i, forced_id in step.forced:
            # A forced token (a reasoning budget's close) replaces this row's draw; it has no logprob.
            token_ids[i] = forced_id
            logprobs[i] = None
        sampled: dict[str, tuple[int, ...]] = {}
        records: dict[str, tuple[TokenLogprob, ...]] = {}
        for s, t, lp, row in zip(step.seqs, token_ids, logprobs, step.sampler_rows, strict=True):
            run = verified.get(s.request_id)
            if run is not None:  # a verification round: its accepted drafts and its sampled token
                sampled[s.request_id] = run[0]
                if row.wants_logprobs:
                    records[s.request_id] = run[1]
                continue
            sampled[s.request_id] = (t,)
            if lp is not None:
                records[s.request_id] = (lp,)
            elif row.wants_logprobs:
                records[s.request_id] = ()  # a forced token: omitted from the logprobs
        return RunnerOutput(sampled=sampled, logprobs=records, prompt_logprobs=scored, failed=image_failed,
                            not_run=frozenset(image_failed))

    def _image_embeds(self, chunks: Seq[ScheduledChunk]) -> tuple[list[ScheduledChunk], StepEmbeds, dict[str, EngineFailure]]:
        """The step's image rows (indices into the flattened chunks that run) and their features;
        chunks of requests whose image could not be prepared are left out, with why."""
        kept: list[ScheduledChunk] = []
        embeds = StepEmbeds([], [])
        failed: dict[str, EngineFailure] = {}
        offset = 0
        for c in chunks:
            seq = c.seq
            if _touches_images(c):
                mine = StepEmbeds([], [])
                end = min(c.start + c.length - c.num_drafts, seq.num_prompt_tokens)
                try:
                    self.images.chunk_embeds(seq.request_id, seq.token_ids, seq.request.images, c.start, end,
                                             offset, mine)
                except ImageError as exc:
                    failed[seq.request_id] = EngineFailure(FailureKind.IMAGE, str(exc))
                    continue
                embeds.rows.extend(mine.rows)
                embeds.features.extend(mine.features)
            kept.append(c)
            offset += c.length
        return kept, embeds, failed

    @staticmethod
    def _generator_states(step: StepBatch) -> dict[int, Tensor]:
        """The generator state of each seeded, drawing verification request before its draws (by
        its index in ``step.seqs``): `_verify` rewinds it to the draws of its committed tokens."""
        if step.first_rows is None:
            return {}
        out: dict[int, Tensor] = {}
        for i, drafts in enumerate(step.drafts):
            row = step.rows[step.first_rows[i]]
            if drafts and row.generator is not None and draws_uniform(row.params):
                out[i] = row.generator.get_state()
        return out

    @staticmethod
    def _verify(step: StepBatch, token_ids: list[int], logprobs: list[TokenLogprob | None],
                rewind: dict[int, Tensor]) -> tuple[list[int], list[TokenLogprob | None],
                                                    dict[str, tuple[tuple[int, ...], tuple[TokenLogprob, ...]]]]:
        """Per request, from the draws of all its rows: its first row's token and logprob (aligned
        with ``step.seqs``) and, for verification rounds, the committed run and its logprob records.

        Position i of a round was sampled from the target model's logits after the drafts before it
        (the sampler row's output tokens include them). The run keeps positions while their draw
        equals the draft and ends with the first draw that differs, or the bonus draw after the last
        draft: each committed token is exactly the token decoding would have drawn. A seeded row's
        generator is rewound to one draw per committed token."""
        assert step.first_rows is not None
        first_ids: list[int] = []
        first_lps: list[TokenLogprob | None] = []
        verified: dict[str, tuple[tuple[int, ...], tuple[TokenLogprob, ...]]] = {}
        for i, (seq, at, drafts) in enumerate(zip(step.seqs, step.first_rows, step.drafts, strict=True)):
            first_ids.append(token_ids[at])
            first_lps.append(logprobs[at])
            if not drafts:
                continue
            n = 0
            while n < len(drafts) and token_ids[at + n] == drafts[n]:
                n += 1
            run = tuple(token_ids[at : at + n + 1])
            lps = tuple(lp for lp in logprobs[at : at + n + 1] if lp is not None)
            verified[seq.request_id] = (run, lps)
            state = rewind.get(i)
            if state is not None:
                generator = step.rows[at].generator
                assert generator is not None
                generator.set_state(state)
                consume_uniforms(generator, n + 1)
        return first_ids, first_lps, verified

    @staticmethod
    def _any_tracker(seqs: Seq[RequestState]) -> bool:
        return any(s.tracker is not None for s in seqs)

    def _score_prompt_chunk(self, hidden: torch.Tensor, offset: int,
                            chunk: ScheduledChunk) -> tuple[PromptLogprob | None, ...]:
        """Scores of the prompt positions this chunk's rows predict (row p predicts token p + 1).

        Logits exist for at most `_SCORE_ROWS` rows at a time, never for the whole prompt. Positions
        already scored before a preemption are not scored again (`ScheduledChunk.prompt_targets`)."""
        seq = chunk.seq
        k = seq.request.prompt_logprobs or 0
        out: list[PromptLogprob | None] = []
        null_first, first, last = chunk.prompt_targets()  # inclusive target positions
        if null_first:
            out.append(None)  # position 0 has nothing before it
        vocab_size = self.sampler.vocab_size
        images = seq.request.images
        for lo in range(first, last + 1, _SCORE_ROWS):
            hi = min(lo + _SCORE_ROWS, last + 1)
            rows = hidden[offset + lo - 1 - chunk.start : offset + hi - 1 - chunk.start]
            logits = self.model.compute_logits(rows)[:, :vocab_size]
            for p, score in enumerate(prompt_scores(logits, seq.token_ids[lo:hi], k), lo):
                if images and self.images.is_placeholder(seq.token_ids, images, p):
                    out.append(None)  # an image position has no prompt score (spec: prompt_logprobs)
                else:
                    out.append(PromptLogprob(score.token_id, score.logprob, score.rank, score.top))
        return tuple(out)


@attrs.frozen
class StepBatch:
    """One step's inputs, cut from the persistent batch."""

    input_ids: Tensor
    positions: Tensor
    attention: AttentionInputs
    seqs: list[RequestState]
    """The requests that sample this step, in chunk order."""
    rows: list[SamplingRow]
    """The sampler's rows, aligned with the logits: one per request, or one per verified position
    of a verification round (its k drafts and the bonus position)."""
    row_params: RowParams | None
    sample_tokens: Tensor | None
    """Flattened index of each sampled position's token; None when every token samples."""
    scoring: list[tuple[int, ScheduledChunk]]
    """(first token index, chunk) of the chunks whose prompt positions are scored."""
    forced: list[tuple[int, int]] = attrs.field(factory=list)
    """(index into ``seqs``, token id) of the rows whose next token is forced instead of sampled."""
    first_rows: list[int] | None = None
    """With verification rounds in the step: each request's first row in ``rows`` (None: row i is
    request i's)."""
    drafts: list[tuple[int, ...]] = attrs.field(factory=list)
    """With ``first_rows``: each request's drafts (empty for plain rows)."""

    @property
    def sampler_rows(self) -> list[SamplingRow]:
        """Each request's own sampling row (its first), aligned with ``seqs``."""
        return self.rows if self.first_rows is None else [self.rows[i] for i in self.first_rows]


class InputBatch:
    """The runner's persistent batch: one row per running request, kept from step to step.

    A request gets a row the first step it runs and keeps it until `release` (the scheduler's
    `freed`: finished, aborted or preempted). Per row, in preallocated device tensors: the block
    table of every paged cache group (`block_tables`; `block_table` is group 0's; only pages added
    since the last step are written: the KV manager's tables are position-aligned across groups and
    only grow until freed, except a speculative rollback, which `rollback` rewinds, and a
    sliding-window group's placeholders for pages out of every window, entries no query reads
    again, and a lazy row-window group's placeholders that became pages, rewritten from the index
    `KVCacheCoordinator.take_changed` names), the temperature and log(min-p) of the sampler's vectorised path; and on the host its
    `SamplingRow`, built once, whose output ids are a live view of the request's tokens. With
    recurrent groups, each chunk's state slot goes into the step's `recurrent_spans`.

    Per step, the host lists (token ids, positions, the row of each token, new block-table entries,
    sampling and decode indices) are written into one staging buffer, pinned on CUDA, which crosses
    to the device in one copy; the slot mapping is computed on the device from the block table. On
    CUDA the staging buffer is rewritten only after the previous step's copy has finished (an event
    wait; the previous step's read of its sampled ids normally finished it already).
    """

    def __init__(self, max_rows: int, max_pages: int, page_size: int, device: torch.device, *,
                 num_groups: int = 1, recurrent: bool = False) -> None:
        self.device = device
        self.page_size = page_size
        self._pinned = device.type == "cuda"
        self._recurrent = recurrent
        with torch.inference_mode(False):
            self.block_tables = [torch.zeros(max_rows, max_pages, dtype=torch.long, device=device)
                                 for _ in range(num_groups)]
            self.temperature = torch.ones(max_rows, dtype=torch.float32, device=device)
            self.log_min_p = torch.full((max_rows,), float("-inf"), dtype=torch.float32, device=device)
        self._row_of: dict[str, int] = {}
        self._free_rows = list(range(max_rows - 1, -1, -1))  # pop() hands out the lowest row
        self._num_pages = [0] * max_rows  # block-table entries written per row
        self._rows: list[SamplingRow | None] = [None] * max_rows
        self._staging = self._host_buffer(4096)
        self._staging_np = self._staging.numpy()
        self._staged = self._staging if device.type == "cpu" else self._device_buffer(4096)
        self._copy_done: Any = None  # torch.cuda.Event of the last staging copy
        self.verify_as_decode = False
        """Verification rows attend as decode tokens (True: one per position, context length
        position + 1) or as one prefill chunk over their context (SDPA, causal from its start)."""
        self.short_chunks_as_decode = 0
        """With `verify_as_decode`: a chunk of at most this many positions after some context attends
        as decode tokens too, so a step of such chunks takes the model's decode path (a drafter's
        catch-up on the drafts the target accepted: `drafter.Drafter`); 0: none. The engine's own
        batch keeps 0 (a prompt's chunk attends as prefill, the same sums at any chunking)."""

    @property
    def block_table(self) -> Tensor:
        """Group 0's block tables, [rows, max_pages]."""
        return self.block_tables[0]

    @property
    def num_rows(self) -> int:
        return len(self._row_of)

    def row_of(self, request_id: str) -> int | None:
        return self._row_of.get(request_id)

    def release(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            row = self._row_of.pop(rid, None)
            if row is not None:
                self._free_rows.append(row)
                self._rows[row] = None
                self._num_pages[row] = 0

    def rollback(self, trimmed: Iterable[tuple[str, int]]) -> None:
        """Speculative rollbacks: a row's block-table entries from ``pages kept`` on are rewritten
        at its next step (the pages there may have been released and others taken since)."""
        for rid, kept in trimmed:
            row = self._row_of.get(rid)
            if row is not None:
                self._num_pages[row] = min(self._num_pages[row], kept)

    def prepare(self, chunks: Seq[ScheduledChunk], manager: KVManager) -> StepBatch:
        ids: list[int] = []
        positions: list[int] = []
        token_rows: list[int] = []
        new_rows: list[int] = []
        new_cols: list[int] = []
        new_pages: list[int] = []
        sample_tokens: list[int] = []
        sample_rows: list[int] = []
        decode_tokens: list[int] = []
        decode_rows: list[int] = []
        decode_lens: list[int] = []
        prefills: list[tuple[int, int, int, int]] = []
        scoring: list[tuple[int, ScheduledChunk]] = []
        seqs: list[RequestState] = []
        rows: list[SamplingRow] = []
        forced: list[tuple[int, int]] = []
        first_rows: list[int] = []
        step_drafts: list[tuple[int, ...]] = []
        # Several cache groups: the other paged groups' new entries, and the recurrent chunks.
        coord = manager if isinstance(manager, KVCacheCoordinator) else None
        extra: list[list[int]] | None = None
        spans: list[tuple[int, int, int, int]] | None = None
        if coord is not None:
            extra = [[] for _ in self.block_tables[1:]]
            spans = [] if self._recurrent else None
        offset = 0
        for c in chunks:
            seq = c.seq
            row = self._row_of.get(seq.request_id)
            if row is None:
                row = self._admit(seq)
            table = manager.block_table(seq.request_id)
            known = self._num_pages[row]
            if coord is not None:  # a lazy pool filled placeholders: rewrite the row from there
                changed = coord.take_changed(seq.request_id)
                if changed is not None and changed < known:
                    known = self._num_pages[row] = changed
            if len(table) > known:
                if len(table) > self.block_table.shape[1]:
                    self._grow_pages(len(table))
                new_rows.extend(itertools.repeat(row, len(table) - known))
                new_cols.extend(range(known, len(table)))
                new_pages.extend(table[known:])
                if extra:
                    assert coord is not None
                    for pages, other in zip(extra, coord.tables(seq.request_id)[1:], strict=True):
                        pages.extend(other[known:])
                self._num_pages[row] = len(table)
            start, length = c.start, c.length
            if spans is not None:
                assert coord is not None
                spans.append((offset, length, coord.state_slot(seq.request_id), start))
            if length == 1:
                ids.append(seq.token_ids[start])
                positions.append(start)
                token_rows.append(row)
                if start > 0:
                    decode_tokens.append(offset)
                    decode_rows.append(row)
                    decode_lens.append(start + 1)
                else:
                    prefills.append((offset, 1, row, 0))
            else:
                drafts = c.draft_token_ids
                ids.extend(seq.token_ids[start : start + length - len(drafts)])
                ids.extend(drafts)
                positions.extend(range(start, start + length))
                token_rows.extend(itertools.repeat(row, length))
                if self.verify_as_decode and (drafts or (0 < start and length <= self.short_chunks_as_decode)):
                    # Each verified position attends like a decode token of its row: the step's K/V
                    # are written before attention, so position p sees exactly positions 0..p.
                    decode_tokens.extend(range(offset, offset + length))
                    decode_rows.extend(itertools.repeat(row, length))
                    decode_lens.extend(range(start + 1, start + length + 1))
                else:
                    prefills.append((offset, length, row, start))
            if seq.request.prompt_logprobs is not None and start < seq.num_prompt_tokens:
                scoring.append((offset, c))
            offset += length
            if c.samples and seq.request.max_tokens > 0:
                sampling_row = self._rows[row]
                assert sampling_row is not None
                if c.forced_token_id is not None:
                    forced.append((len(seqs), c.forced_token_id))
                first_rows.append(len(rows))
                step_drafts.append(c.draft_token_ids)
                seqs.append(seq)
                nd = c.num_drafts
                # A verification round samples each of its k + 1 last positions; position j's row
                # sees the drafts before it among its output tokens (penalties read them).
                for j in range(nd + 1):
                    sample_tokens.append(offset - 1 - nd + j)
                    sample_rows.append(row)
                    rows.append(_draft_row(sampling_row, c.draft_token_ids[:j]) if j else sampling_row)
        num_tokens = offset

        parts = [ids, positions, token_rows, new_rows, new_cols, new_pages, sample_tokens, sample_rows,
                 decode_tokens, decode_rows, decode_lens]
        if extra:
            parts += extra
        staged = self._stage(parts)
        ids_t, positions_t, token_rows_t, new_rows_t, new_cols_t, new_pages_t, sample_tokens_t, sample_rows_t, \
            decode_tokens_t, decode_rows_t, decode_lens_t = staged[:11]
        if new_rows:
            self.block_table.index_put_((new_rows_t, new_cols_t), new_pages_t)
        ps = self.page_size
        slot_mapping = self.block_table[token_rows_t, positions_t // ps] * ps + positions_t % ps
        group_tables: tuple[tuple[Tensor, Tensor], ...] = ()
        if extra:
            if new_rows:
                for table_t, pages_t in zip(self.block_tables[1:], staged[11:], strict=True):
                    table_t.index_put_((new_rows_t, new_cols_t), pages_t)
            blk, off = positions_t // ps, positions_t % ps
            group_tables = tuple((t, t[token_rows_t, blk] * ps + off) for t in self.block_tables[1:])
        attention = AttentionInputs(
            block_table=self.block_table,
            slot_mapping=slot_mapping,
            num_tokens=num_tokens,
            decode_tokens=decode_tokens_t if decode_tokens else None,
            decode_rows=decode_rows_t if decode_tokens else None,
            decode_lens=decode_lens_t if decode_tokens else None,
            decode_max_len=max(decode_lens, default=0),
            num_decode=len(decode_tokens),
            prefills=tuple(prefills),
            group_tables=group_tables,
            recurrent_spans=tuple(spans) if spans else (),
        )
        row_params = None
        if rows:
            row_params = RowParams(self.temperature.index_select(0, sample_rows_t),
                                   self.log_min_p.index_select(0, sample_rows_t))
        return StepBatch(
            input_ids=ids_t,
            positions=positions_t,
            attention=attention,
            seqs=seqs,
            rows=rows,
            row_params=row_params,
            sample_tokens=None if len(sample_tokens) == num_tokens else sample_tokens_t,
            scoring=scoring,
            forced=forced,
            first_rows=first_rows if len(rows) > len(seqs) else None,
            drafts=step_drafts,
        )

    # -- helpers ----------------------------------------------------------------------------
    def _admit(self, seq: RequestState) -> int:
        if not self._free_rows:
            self._grow_rows()
        row = self._free_rows.pop()
        self._row_of[seq.request_id] = row
        self._num_pages[row] = 0
        request = seq.request
        params = request.sampling
        self.temperature[row] = row_temperature(params)
        self.log_min_p[row] = row_log_min_p(params)
        self._rows[row] = SamplingRow(
            params=params,
            generator=seq.generator,
            prompt_token_ids=request.prompt_token_ids,  # the tuple itself, no copy
            output_token_ids=_OutputIds(seq.token_ids, seq.num_prompt_tokens),
            num_top_logprobs=request.num_top_logprobs,
            logprob_token_ids=request.logprob_token_ids,
            min_tokens=request.min_tokens,
            stop_ids=tuple(sorted(request.eos_token_ids | request.stop_token_ids)) if request.min_tokens else (),
        )
        return row

    def _stage(self, parts: Seq[list[int]]) -> list[Tensor]:
        """Writes ``parts`` into the staging buffer, moves it to the device in one copy, and returns
        one device view per part."""
        total = sum(len(p) for p in parts)
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the previous copy still reads the staging buffer
        if total > self._staging.numel():
            size = 1 << (total - 1).bit_length()
            self._staging = self._host_buffer(size)
            self._staging_np = self._staging.numpy()
            self._staged = self._staging if self.device.type == "cpu" else self._device_buffer(size)
        host = self._staging_np
        flat: list[int] = []
        for p in parts:
            flat += p
        host[:total] = flat
        staged = self._staged
        if staged is not self._staging:
            staged[:total].copy_(self._staging[:total], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._copy_done = event
        views: list[Tensor] = []
        at = 0
        for p in parts:
            views.append(staged[at : at + len(p)])
            at += len(p)
        return views

    def _host_buffer(self, size: int) -> Tensor:
        with torch.inference_mode(False):
            return torch.empty(size, dtype=torch.long, pin_memory=self._pinned)

    def _device_buffer(self, size: int) -> Tensor:
        with torch.inference_mode(False):
            return torch.empty(size, dtype=torch.long, device=self.device)

    def _grow_rows(self) -> None:
        old = len(self._rows)
        new = 2 * old
        with torch.inference_mode(False):
            self.block_tables = [_grown(t, (new, t.shape[1]), 0) for t in self.block_tables]
            self.temperature = _grown(self.temperature, (new,), 1.0)
            self.log_min_p = _grown(self.log_min_p, (new,), float("-inf"))
        self._free_rows.extend(range(new - 1, old - 1, -1))
        self._num_pages.extend([0] * (new - old))
        self._rows.extend([None] * (new - old))

    def _grow_pages(self, needed: int) -> None:
        with torch.inference_mode(False):
            width = max(needed, 2 * self.block_table.shape[1])
            self.block_tables = [_grown(t, (t.shape[0], width), 0) for t in self.block_tables]


def _touches_images(c: ScheduledChunk) -> bool:
    """Whether the chunk covers prompt positions up to the end of the request's last image span."""
    images = c.seq.request.images
    return bool(images) and c.start < images[-1].offset + images[-1].length


def _draft_row(row: SamplingRow, drafts: tuple[int, ...]) -> SamplingRow:
    """``row`` for a verified position after ``drafts``: output tokens extended by them when its
    penalties or its min_tokens read them (the same row otherwise)."""
    if not row.has_penalties and not row.masks_stops:
        return row
    return attrs.evolve(row, output_token_ids=[*row.output_token_ids, *drafts])


def _grown(t: Tensor, shape: tuple[int, ...], fill: float) -> Tensor:
    """A larger copy of ``t`` (``fill`` beyond the old extent)."""
    out = torch.full(shape, fill, dtype=t.dtype, device=t.device)
    out[tuple(slice(0, n) for n in t.shape)] = t
    return out


class _OutputIds(Seq[int]):
    """A request's generated ids as a live view of its token list: no copy per step."""

    __slots__ = ("_ids", "_start")

    def __init__(self, ids: list[int], start: int) -> None:
        self._ids = ids
        self._start = start

    def __len__(self) -> int:
        return len(self._ids) - self._start

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._ids, self._start, None)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self._ids[self._start :][index]
