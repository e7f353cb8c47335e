"""Batch → tensors → model forward, with a paged attention backend over the KV pool.

The scheduler hands over chunks of several sequences; their tokens are flattened into one
[T] batch for every linear layer. Attention runs per group: all single-token decode rows together
(gathering each row's history from its pages, padded and masked), and each prefill chunk on its own
(causal within the chunk, full over its cached history).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch
import torch.nn.functional as F

from helios.engine.kv.pool import KVCache
from helios.engine.scheduler import ScheduledChunk


class PagedAttention:
    """AttentionBackend for one step. Index tensors are built once and shared by every layer."""

    def __init__(self, kv: KVCache, chunks: Seq[ScheduledChunk], page_size: int, device: torch.device) -> None:
        self.kv = kv
        slot_rows: list[torch.Tensor] = []
        self.decode_rows: list[int] = []  # flattened token index of each decode row
        self.prefills: list[tuple[int, int, torch.Tensor, int]] = []  # (tok_start, length, slots, ctx_start)
        decode_slots: list[torch.Tensor] = []
        offset = 0
        for c in chunks:
            table = torch.tensor(c.seq.block_table, dtype=torch.long)
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
