"""The runner half of the step: SchedulerOutput → tensors → model forward → RunnerOutput.

`ModelRunner.execute` owns everything that touches the model: it flattens the scheduled chunks of
several requests into one [T] batch for every linear layer, runs attention through the paged
backend below, scores prompt positions for requests that asked, and samples one token per request
whose chunk ends its known tokens. It returns plain values (token ids and logprob records) keyed
by request id; the scheduler commits them (`Scheduler.update`).

Attention runs per group: all single-token decode rows together (gathering each row's history
from its pages, padded and masked), and each prefill chunk on its own (causal within the chunk,
full over its cached history).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch
import torch.nn.functional as F

from helios.engine.kv.manager import KVCacheManager
from helios.engine.kv.pool import KVCache
from helios.engine.records import PromptLogprobRecord, RunnerOutput, TokenLogprobRecord
from helios.engine.sampler import Sampler, SamplingRow, prompt_scores
from helios.engine.scheduler import RequestState, ScheduledChunk, SchedulerOutput

_SCORE_ROWS = 256  # prompt positions whose logits exist at once while scoring a prompt


class ModelRunner:
    """Runs the model for one scheduled step; owns the KV tensors and the sampler."""

    def __init__(self, model: Any, kv: KVCache, manager: KVCacheManager, sampler: Sampler,
                 device: torch.device) -> None:
        self.model = model
        self.kv = kv
        self.manager = manager
        self.sampler = sampler
        self.device = device

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        if not sched.chunks:
            return RunnerOutput()
        input_ids, positions, _ = build_inputs(sched.chunks, self.device)
        tables = [self.manager.block_table(c.seq.request_id) for c in sched.chunks]
        attn = PagedAttention(self.kv, sched.chunks, tables, self.manager.page_size, self.device)
        sample_rows: list[int] = []
        seqs: list[RequestState] = []
        scored: dict[str, tuple[PromptLogprobRecord | None, ...]] = {}
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
        records: dict[str, tuple[TokenLogprobRecord, ...]] = {}
        for s, t, lp in zip(seqs, token_ids, logprobs, strict=True):
            sampled[s.request_id] = (t,)
            if lp is not None:
                records[s.request_id] = (TokenLogprobRecord(lp.token_id, lp.logprob, lp.rank, tuple(lp.top)),)
        return RunnerOutput(sampled=sampled, logprobs=records, prompt_logprobs=scored)

    def _score_prompt_chunk(self, hidden: torch.Tensor, offset: int,
                            chunk: ScheduledChunk) -> tuple[PromptLogprobRecord | None, ...]:
        """Scores of the prompt positions this chunk's rows predict (row p predicts token p + 1).

        Logits exist for at most `_SCORE_ROWS` rows at a time, never for the whole prompt. Positions
        already scored before a preemption are not scored again."""
        seq = chunk.seq
        k = seq.request.prompt_logprobs or 0
        out: list[PromptLogprobRecord | None] = []
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
                out.append(PromptLogprobRecord(score.token_id, score.logprob, score.rank, score.top))
        if last >= first:
            seq.num_prompt_scored = last + 1
        return tuple(out)


class PagedAttention:
    """AttentionBackend for one step. Index tensors are built once and shared by every layer."""

    def __init__(self, kv: KVCache, chunks: Seq[ScheduledChunk], tables: Seq[list[int]], page_size: int,
                 device: torch.device) -> None:
        self.kv = kv
        slot_rows: list[torch.Tensor] = []
        self.decode_rows: list[int] = []  # flattened token index of each decode row
        self.prefills: list[tuple[int, int, torch.Tensor, int]] = []  # (tok_start, length, slots, ctx_start)
        decode_slots: list[torch.Tensor] = []
        offset = 0
        for c, block_table in zip(chunks, tables, strict=True):
            table = torch.tensor(block_table, dtype=torch.long)
            end = c.start + c.length
            pos = torch.arange(end, dtype=torch.long)
            slots = table[pos // page_size] * page_size + pos % page_size  # slots of tokens 0..end-1
            slot_rows.append(slots[c.start :])
            if c.length == 1 and c.start > 0:
                self.decode_rows.append(offset)
                decode_slots.append(slots)
            else:
                self.prefills.append((offset, c.length, slots.to(device), c.start))
            offset += c.length
        self.num_tokens = offset
        self.slot_mapping = torch.cat(slot_rows).to(device) if slot_rows else torch.empty(0, dtype=torch.long)
        if decode_slots:
            lens = [s.numel() for s in decode_slots]
            lmax = max(lens)
            idx = torch.zeros(len(decode_slots), lmax, dtype=torch.long)
            mask = torch.zeros(len(decode_slots), lmax, dtype=torch.bool)
            for i, s in enumerate(decode_slots):
                idx[i, : s.numel()] = s
                mask[i, : s.numel()] = True
            self.decode_idx = idx.to(device)
            self.decode_flat = self.decode_idx.reshape(-1)
            # Additive mask over (kv head, row) batches: 0 where a row attends, -inf on padding.
            bias = torch.zeros(len(decode_slots), lmax).masked_fill_(~mask, float("-inf"))
            self.decode_bias = bias[None, :, None, :].expand(kv.k[0].shape[0], -1, -1, -1).reshape(
                -1, 1, lmax).to(device=device, dtype=kv.k[0].dtype)
            self.all_decode = len(self.decode_rows) == offset
            self.decode_rows_t = torch.tensor(self.decode_rows, dtype=torch.long, device=device)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache = self.kv.k[layer_idx]  # [kv_heads, slots, head_dim]
        v_cache = self.kv.v[layer_idx]
        k_cache.index_copy_(1, self.slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
        v_cache.index_copy_(1, self.slot_mapping, v.transpose(0, 1).to(v_cache.dtype))
        out = torch.empty_like(q)
        num_kv = k_cache.shape[0]
        if self.decode_rows:
            b, lmax = self.decode_idx.shape
            d = q.shape[-1]
            # One gather per layer gives [kv_heads * B, L, d] batches, contiguous, in (kv head, row)
            # order. Each kv head's query group is folded into the query axis, so no GQA repeat of
            # K/V is needed (query head h uses kv head h // group).
            kd = k_cache.index_select(1, self.decode_flat).view(num_kv * b, lmax, d)
            vd = v_cache.index_select(1, self.decode_flat).view(num_kv * b, lmax, d)
            qd = q if self.all_decode else q.index_select(0, self.decode_rows_t)
            qg = qd.view(b, num_kv, -1, d).transpose(0, 1).reshape(num_kv * b, -1, d)
            scores = torch.baddbmm(self.decode_bias, qg, kd.transpose(1, 2), alpha=d**-0.5)
            o = torch.bmm(torch.softmax(scores, dim=-1), vd)  # [kv_heads * B, group, d]
            o = o.view(num_kv, b, -1, d).transpose(0, 1).reshape(b, -1, d)
            if self.all_decode:
                return o
            out.index_copy_(0, self.decode_rows_t, o)
        for tok_start, length, slots, ctx_start in self.prefills:
            qp = q[tok_start : tok_start + length].transpose(0, 1).unsqueeze(0)  # [1, nh, Lq, d]
            kp = k_cache.index_select(1, slots).unsqueeze(0)  # [1, nkv, Lk, d]
            vp = v_cache.index_select(1, slots).unsqueeze(0)
            if ctx_start == 0:
                o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
            else:
                qpos = torch.arange(ctx_start, ctx_start + length, device=q.device)
                kpos = torch.arange(ctx_start + length, device=q.device)
                mask = kpos[None, :] <= qpos[:, None]
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=True)
            out[tok_start : tok_start + length] = o.squeeze(0).transpose(0, 1)
        return out


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
