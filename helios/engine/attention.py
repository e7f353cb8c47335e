"""Attention backends: each owns a KV layout and builds every step's attention metadata.

The runner asks its backend for two things: the KV storage (allocated once, sized by the page
pool) and, each step, a callable the model's layers use (`models.llama.AttentionBackend`: write the
step's K/V into the cache, attend over each request's history). The KV cache manager decides which
pages a request holds; the backend turns block tables into slot indices.

`TorchPagedBackend` runs on the CPU and, as plain torch operations, on CUDA too. It keeps each
running request's slot index (slot = page * page_size + offset for every position so far) from
step to step and extends it by the new positions only, so a decode step costs O(batch) index work
instead of rebuilding every request's full history. Requests whose pages were released (finished,
aborted or preempted: `SchedulerOutput.freed`) are forgotten before the step is built.

A CUDA backend with FlashAttention / FlashInfer kernels and CUDA graphs for decode batch buckets
would implement the same two methods; it is not written yet (no GPU has been available to verify
one), so `[model] device = "cuda"` uses `TorchPagedBackend` with its tensors on the GPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import Protocol

import torch
import torch.nn.functional as F

from helios.engine.scheduler import ScheduledChunk


class AttentionBackend(Protocol):
    """The engine-side interface of an attention implementation."""

    name: str
    kv: KVCache

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop per-request state of requests whose pages were released."""

    def build(self, chunks: Seq[ScheduledChunk], tables: Seq[list[int]]) -> PagedAttention:
        """The step's attention callable for these chunks (block tables in chunk order)."""
        ...


class TorchPagedBackend:
    """Paged attention in plain torch: one gather per layer for all decode rows, SDPA per prefill."""

    name = "torch_paged"

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.kv = KVCache(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device)
        self.page_size = page_size
        self.device = device
        self._slots: dict[str, tuple[torch.Tensor, int]] = {}  # request id -> (slot buffer, positions filled)

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._slots.pop(rid, None)

    def build(self, chunks: Seq[ScheduledChunk], tables: Seq[list[int]]) -> PagedAttention:
        histories = [self.history(c.seq.request_id, table, c.start + c.length)
                     for c, table in zip(chunks, tables, strict=True)]
        return PagedAttention(self.kv, chunks, histories, self.device)

    def history(self, request_id: str, table: list[int], end: int) -> torch.Tensor:
        """The slots of positions 0 .. end-1, extended from what earlier steps computed."""
        buf, filled = self._slots.get(request_id, (None, 0))
        if buf is None or buf.numel() < end:
            grown = torch.empty(max(64, 1 << (end - 1).bit_length()), dtype=torch.long)
            if buf is not None:
                grown[:filled] = buf[:filled]
            buf = grown
        if filled < end:
            ps = self.page_size
            if end - filled == 1:
                buf[filled] = table[filled // ps] * ps + filled % ps
            else:
                pos = torch.arange(filled, end)
                buf[filled:end] = torch.tensor(table, dtype=torch.long)[pos // ps] * ps + pos % ps
            filled = end
        self._slots[request_id] = (buf, filled)
        return buf[:end]


class KVCache:
    """Per-layer K and V tensors of shape [num_kv_heads, num_slots, head_dim].

    Head-major, so gathering a batch's history is one `index_select` over slots per layer that
    yields [kv_heads, B * L, head_dim] blocks attention can use without another copy."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        slots = num_pages * page_size
        self.k = [torch.zeros(num_kv_heads, slots, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(num_kv_heads, slots, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class PagedAttention:
    """One step's attention over the paged KV cache (the model's per-step `AttentionBackend`).

    Index tensors are built once per step and shared by every layer."""

    def __init__(self, kv: KVCache, chunks: Seq[ScheduledChunk], slots: Seq[torch.Tensor],
                 device: torch.device) -> None:
        """`slots[i]`: the KV slots of positions 0 .. end of chunk i (the backend keeps them)."""
        self.kv = kv
        slot_rows: list[torch.Tensor] = []
        self.decode_rows: list[int] = []  # flattened token index of each decode row
        self.prefills: list[tuple[int, int, torch.Tensor, int]] = []  # (tok_start, length, slots, ctx_start)
        decode_slots: list[torch.Tensor] = []
        offset = 0
        for c, history in zip(chunks, slots, strict=True):
            slot_rows.append(history[c.start :])
            if c.length == 1 and c.start > 0:
                self.decode_rows.append(offset)
                decode_slots.append(history)
            else:
                self.prefills.append((offset, c.length, history.to(device), c.start))
            offset += c.length
        self.num_tokens = offset
        self.slot_mapping = torch.cat(slot_rows).to(device) if slot_rows else torch.empty(0, dtype=torch.long)
        if decode_slots:
            lens = torch.tensor([s.numel() for s in decode_slots])
            idx = torch.nn.utils.rnn.pad_sequence(decode_slots, batch_first=True)  # zeros pad; masked below
            lmax = idx.shape[1]
            self.decode_idx = idx.to(device)
            self.decode_flat = self.decode_idx.reshape(-1)
            # Additive mask over (kv head, row) batches: 0 where a row attends, -inf on padding.
            pad = torch.arange(lmax)[None, :] >= lens[:, None]
            bias = torch.zeros(len(decode_slots), lmax).masked_fill_(pad, float("-inf"))
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
