"""The runner half of the step: SchedulerOutput → tensors → model forward → RunnerOutput.

`ModelRunner.execute` owns everything that touches the model: it flattens the scheduled chunks of
several requests into one [T] batch for every linear layer, runs attention through the paged
backend below, scores prompt positions for requests that asked, and samples one token per request
whose chunk ends its known tokens. It returns plain values (token ids and logprob records) keyed
by request id; the scheduler commits them (`Scheduler.update`).

Attention goes through the engine's attention backend (`attention.py`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch

from helios.domain.logprobs import PromptLogprob, TokenLogprob
from helios.engine.attention import AttentionBackend
from helios.engine.kv.manager import KVCacheManager
from helios.engine.records import RunnerOutput
from helios.engine.sampler import (
    Sampler,
    SamplingRow,
    prompt_scores,
)
from helios.engine.scheduler import RequestState, ScheduledChunk, SchedulerOutput

_SCORE_ROWS = 256  # prompt positions whose logits exist at once while scoring a prompt


class ModelRunner:
    """Runs the model for one scheduled step; owns the KV tensors and the sampler."""

    def __init__(self, model: Any, backend: AttentionBackend, manager: KVCacheManager, sampler: Sampler,
                 device: torch.device) -> None:
        self.model = model
        self.backend = backend
        self.manager = manager
        self.sampler = sampler
        self.device = device

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.backend.forget(sched.freed)
        if not sched.chunks:
            return RunnerOutput()
        input_ids, positions, _ = build_inputs(sched.chunks, self.device)
        tables = [self.manager.block_table(c.seq.request_id) for c in sched.chunks]
        attn = self.backend.build(sched.chunks, tables)
        sample_rows: list[int] = []
        seqs: list[RequestState] = []
        scored: dict[str, tuple[PromptLogprob | None, ...]] = {}
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, attn)
            offset = 0
            for c in sched.chunks:
                if c.seq.request.prompt_logprobs is not None and c.start < c.seq.num_prompt_tokens:
                    scores = self._score_prompt_chunk(hidden, offset, c)
                    if scores:
                        scored[c.seq.request_id] = scores
                if c.samples and c.seq.request.max_tokens > 0:
                    sample_rows.append(offset + c.length - 1)
                    seqs.append(c.seq)
                offset += c.length
            if not seqs:
                return RunnerOutput(prompt_logprobs=scored)
            logits = self.model.compute_logits(hidden[sample_rows])
            rows = [
                SamplingRow(
                    params=s.request.sampling,
                    generator=s.generator,
                    prompt_token_ids=s.request.prompt_token_ids,  # the tuple itself, no per-step copy
                    output_token_ids=s.output_token_ids,
                    num_top_logprobs=s.request.num_top_logprobs,
                    logprob_token_ids=s.request.logprob_token_ids,
                )
                for s in seqs
            ]
            token_ids, logprobs = self.sampler.sample(logits, rows)
        sampled: dict[str, tuple[int, ...]] = {}
        records: dict[str, tuple[TokenLogprob, ...]] = {}
        for s, t, lp in zip(seqs, token_ids, logprobs, strict=True):
            sampled[s.request_id] = (t,)
            if lp is not None:
                records[s.request_id] = (lp,)
        return RunnerOutput(sampled=sampled, logprobs=records, prompt_logprobs=scored)

    def _score_prompt_chunk(self, hidden: torch.Tensor, offset: int,
                            chunk: ScheduledChunk) -> tuple[PromptLogprob | None, ...]:
        """Scores of the prompt positions this chunk's rows predict (row p predicts token p + 1).

        Logits exist for at most `_SCORE_ROWS` rows at a time, never for the whole prompt. Positions
        already scored before a preemption are not scored again."""
        seq = chunk.seq
        k = seq.request.prompt_logprobs or 0
        out: list[PromptLogprob | None] = []
        if seq.num_prompt_scored == 0 and chunk.start == 0:
            out.append(None)  # position 0 has nothing before it
            seq.num_prompt_scored = 1
        first = max(chunk.start + 1, seq.num_prompt_scored)
        last = min(chunk.start + chunk.length, seq.num_prompt_tokens - 1)  # inclusive target positions
        vocab_size = self.sampler.vocab_size
        for lo in range(first, last + 1, _SCORE_ROWS):
            hi = min(lo + _SCORE_ROWS, last + 1)
            rows = hidden[offset + lo - 1 - chunk.start : offset + hi - 1 - chunk.start]
            logits = self.model.compute_logits(rows)[:, :vocab_size]
            for score in prompt_scores(logits, seq.token_ids[lo:hi], k):
                out.append(PromptLogprob(score.token_id, score.logprob, score.rank, score.top))
        if last >= first:
            seq.num_prompt_scored = last + 1
        return tuple(out)


def build_inputs(chunks: Seq[ScheduledChunk], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Flattened input ids, positions, and the flattened index of each row that samples."""
    ids: list[int] = []
    positions: list[int] = []
    sample_rows: list[int] = []
    for c in chunks:
        ids.extend(c.seq.token_ids[c.start : c.start + c.length])
        positions.extend(range(c.start, c.start + c.length))
        if c.samples:
            sample_rows.append(len(ids) - 1)
    return (
        torch.tensor(ids, dtype=torch.long, device=device),
        torch.tensor(positions, dtype=torch.long, device=device),
        sample_rows,
    )
