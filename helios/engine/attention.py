"""Attention backends: each owns a KV layout and builds every step's attention metadata.

The runner asks its backend for two things: the KV storage (allocated once, sized by the page
pool) and, each step, a callable the model's layers use (`models.llama.AttentionBackend`: write the
step's K/V into the cache, attend over each request's history). The KV cache manager decides which
pages a request holds; the runner's persistent batch (`runner.InputBatch`) keeps every running
request's block table as a row of one device tensor, updated with new pages only, and hands the
backend an `AttentionInputs` per step: that tensor, the step's slot mapping, and which tokens decode.

`TorchPagedBackend` runs on the CPU and, as plain torch operations, on CUDA too. It expands block
table rows into slot indices on the device (slot = page * page_size + offset), so a step costs a few
tensor operations whatever the batch, with no per-request index work on the host. On the CPU, decode
attention (one query token per row) runs Helios's own kernel (`helios.models.cpu_kernels.paged_decode`)
when it is built: it reads each row's K/V in place through the block table, in float32, split over
history chunks that run in parallel, instead of gathering every row's whole history into a contiguous
copy in every layer of every step (at 4k tokens of context and 8 rows the gather path took 13-20 ms
per layer, the kernel 2-3 ms). Prefill chunks keep SDPA over their gathered context.

A CUDA backend with FlashAttention / FlashInfer kernels and CUDA graphs for decode batch buckets
would take the same `AttentionInputs` (block tables and sequence lengths are what those kernels
read); it is not written yet (no GPU has been available to verify one), so `[model] device = "cuda"`
uses `TorchPagedBackend` with its tensors on the GPU.
"""

from __future__ import annotations

from typing import Protocol

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from helios.models import cpu_kernels
from helios.models.interface import DecodeArgs, RecurrentBatch


@attrs.frozen
class AttentionInputs:
    """One step's attention metadata, built by the runner's persistent batch. Tensors are on the
    device; the ints are host values the scheduler output already gave (no device read)."""

    block_table: Tensor
    """[rows, max_pages] int64, persistent: row r holds the pages of the request in batch row r
    (entries past its pages are stale page ids, never read unmasked)."""
    slot_mapping: Tensor
    """[T] int64: the cache slot each token's K/V is written to."""
    num_tokens: int
    decode_tokens: Tensor | None
    """[D] flattened index of each decode token (a one-token chunk after position 0)."""
    decode_rows: Tensor | None
    """[D] batch row of each decode token."""
    decode_lens: Tensor | None
    """[D] context length of each decode token (its position + 1)."""
    decode_max_len: int
    num_decode: int
    prefills: tuple[tuple[int, int, int, int], ...]
    """(first token index, length, batch row, first position) of every other chunk."""


class AttentionBackend(Protocol):
    """The engine-side interface of an attention implementation."""

    name: str
    kv: KVCache

    def build(self, inputs: AttentionInputs) -> PagedAttention:
        """The step's attention callable."""
        ...

    def read_page(self, page: int) -> bytes:
        """One page's K/V for every layer, as bytes (the prefix cache's host-store copy-out)."""
        ...

    def write_page(self, page: int, data: bytes) -> bool:
        """Fill a page from `read_page`'s bytes; False (nothing written) when they do not fit."""
        ...


class TorchPagedBackend:
    """Paged attention: decode rows through the CPU kernel where it applies (else one gather per layer
    for all decode rows); prefill chunks through the CPU prefill kernel where it applies (a bfloat16
    cache on a CPU with AVX512-BF16), else a gather and SDPA per chunk."""

    name = "torch_paged"

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, *, decode_kernel: bool | None = None,
                 prefill_kernel: bool | None = None) -> None:
        """``decode_kernel``: use `cpu_kernels.paged_decode` for decode rows (None: wherever it
        applies: a CPU cache in float32 or bfloat16, a head size of a multiple of 16, the kernels built).
        ``prefill_kernel``: use `cpu_kernels.paged_prefill` for prefill chunks (None: wherever it
        applies: a bfloat16 CPU cache, a head size of a multiple of 32 up to 128, the kernels built
        with AVX512-BF16)."""
        self.kv = KVCache(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device)
        self.page_size = page_size
        self.device = device
        self._offsets = torch.arange(page_size, device=device)  # slot offsets within a page
        applies = (torch.device(device).type == "cpu" and dtype in (torch.float32, torch.bfloat16)
                   and head_dim % 16 == 0)
        self.decode_kernel = applies and (cpu_kernels.available() if decode_kernel is None else decode_kernel)
        prefill_applies = (torch.device(device).type == "cpu" and dtype == torch.bfloat16
                           and head_dim % 32 == 0 and head_dim <= 128)
        self.prefill_kernel = prefill_applies and (
            cpu_kernels.available() and cpu_kernels.bf16_kernels_supported() if prefill_kernel is None
            else prefill_kernel)
        if self.decode_kernel:
            self.name = "cpu_paged_kernel"

    def build(self, inputs: AttentionInputs) -> PagedAttention:
        return PagedAttention(self.kv, inputs, self.page_size, self._offsets, decode_kernel=self.decode_kernel,
                              prefill_kernel=self.prefill_kernel)

    def read_page(self, page: int) -> bytes:
        return self.kv.read_page(page, self.page_size)

    def write_page(self, page: int, data: bytes) -> bool:
        return self.kv.write_page(page, self.page_size, data)


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

    def read_page(self, page: int, page_size: int) -> bytes:
        """Layer by layer, K then V, each [kv_heads, page_size, head_dim] in the cache's dtype."""
        lo = page * page_size
        parts = [t[:, lo:lo + page_size, :].contiguous().view(torch.uint8).flatten()
                 for layer in zip(self.k, self.v, strict=True) for t in layer]
        return bytes(torch.cat(parts).cpu().numpy().tobytes())

    def write_page(self, page: int, page_size: int, data: bytes) -> bool:
        k0 = self.k[0]
        one = k0.shape[0] * page_size * k0.shape[2] * k0.element_size()
        if len(data) != one * 2 * len(self.k):
            return False
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        lo = page * page_size
        at = 0
        for layer in zip(self.k, self.v, strict=True):
            for t in layer:
                src = raw[at:at + one].view(t.dtype).view(t.shape[0], page_size, t.shape[2])
                t[:, lo:lo + page_size, :].copy_(src.to(t.device))
                at += one
        return True

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class PagedAttention:
    """One step's attention over the paged KV cache (the model's per-step `AttentionBackend`).

    Index tensors are built once per step, on the device, and shared by every layer."""

    def __init__(self, kv: KVCache, inputs: AttentionInputs, page_size: int, offsets: Tensor, *,
                 decode_kernel: bool = False, prefill_kernel: bool = False) -> None:
        self.kv = kv
        self.prefill_kernel = prefill_kernel
        self.slot_mapping = inputs.slot_mapping
        table = inputs.block_table
        self.num_decode = inputs.num_decode
        self.decode_kernel = decode_kernel
        self.page_size = page_size
        if inputs.num_decode and decode_kernel:
            assert inputs.decode_rows is not None and inputs.decode_lens is not None
            assert inputs.decode_tokens is not None
            self.table = table
            self.decode_rows = inputs.decode_rows
            self.decode_lens = inputs.decode_lens
            self.all_decode = inputs.num_decode == inputs.num_tokens
            self.decode_tokens = inputs.decode_tokens
        elif inputs.num_decode:
            assert inputs.decode_rows is not None and inputs.decode_lens is not None
            lmax = inputs.decode_max_len
            pages = table.index_select(0, inputs.decode_rows)[:, : -(-lmax // page_size)]
            # [D, lmax] slots of positions 0 .. lmax - 1; a row's positions past its length are masked.
            self.decode_idx = _expand(pages, page_size, offsets)[:, :lmax]
            self.decode_flat = self.decode_idx.reshape(-1)
            # Additive mask over (kv head, row) batches: 0 where a row attends, -inf on padding.
            pad = torch.arange(lmax, device=table.device)[None, :] >= inputs.decode_lens[:, None]
            dtype = kv.k[0].dtype
            bias = torch.zeros(inputs.num_decode, lmax, dtype=dtype, device=table.device).masked_fill_(
                pad, float("-inf"))
            self.decode_bias = bias[None, :, None, :].expand(kv.k[0].shape[0], -1, -1, -1).reshape(-1, 1, lmax)
            self.all_decode = inputs.num_decode == inputs.num_tokens
            assert inputs.decode_tokens is not None
            self.decode_tokens = inputs.decode_tokens
        self.prefills: list[tuple[int, int, Tensor, int]] = []  # (tok_start, length, slots, ctx_start)
        for tok_start, length, row, ctx_start in inputs.prefills:
            end = ctx_start + length
            pages = table[row : row + 1, : -(-end // page_size)]
            self.prefills.append((tok_start, length, _expand(pages, page_size, offsets)[0, :end], ctx_start))

    def recurrent(self, layer_idx: int) -> RecurrentBatch:
        raise NotImplementedError("recurrent-state layers are not served by this backend yet")

    def all_decode_args(self, layer_idx: int) -> DecodeArgs | None:
        """For a step of decode tokens only, served by the CPU kernel: what `write_paged_decode` needs
        for this layer (k_cache, v_cache, slot_mapping, block_table, rows, lens, page_size), so a model
        can run the layer as one operator; None otherwise."""
        if not (self.num_decode and self.decode_kernel and self.all_decode):
            return None
        return (self.kv.k[layer_idx], self.kv.v[layer_idx], self.slot_mapping, self.table, self.decode_rows,
                self.decode_lens, self.page_size)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float | None = None) -> torch.Tensor:
        sdpa_scale = scale  # None: SDPA's own default, 1 / sqrt(head_dim)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        decode = self.all_decode_args(layer_idx)
        if decode is not None:
            # One operator: this step's K/V into the cache, then the paged decode over it.
            return cpu_kernels.write_paged_decode(q, k, v, *decode, scale)
        k_cache = self.kv.k[layer_idx]  # [kv_heads, slots, head_dim]
        v_cache = self.kv.v[layer_idx]
        if self.decode_kernel:  # the CPU kernels serve this cache: row copies
            cpu_kernels.write_kv(k, v, k_cache, v_cache, self.slot_mapping)
        else:
            k_cache.index_copy_(1, self.slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
            v_cache.index_copy_(1, self.slot_mapping, v.transpose(0, 1).to(v_cache.dtype))
        out = torch.empty_like(q)
        num_kv = k_cache.shape[0]
        if self.num_decode and self.decode_kernel:
            qd = q if self.all_decode else q.index_select(0, self.decode_tokens)
            o = cpu_kernels.paged_decode(qd, k_cache, v_cache, self.table, self.decode_rows, self.decode_lens,
                                         self.page_size, scale)
            if self.all_decode:
                return o
            out.index_copy_(0, self.decode_tokens, o)
        elif self.num_decode:
            b, lmax = self.decode_idx.shape
            d = q.shape[-1]
            # One gather per layer gives [kv_heads * B, L, d] batches, contiguous, in (kv head, row)
            # order. Each kv head's query group is folded into the query axis, so no GQA repeat of
            # K/V is needed (query head h uses kv head h // group).
            kd = k_cache.index_select(1, self.decode_flat).view(num_kv * b, lmax, d)
            vd = v_cache.index_select(1, self.decode_flat).view(num_kv * b, lmax, d)
            qd = q if self.all_decode else q.index_select(0, self.decode_tokens)
            qg = qd.view(b, num_kv, -1, d).transpose(0, 1).reshape(num_kv * b, -1, d)
            scores = torch.baddbmm(self.decode_bias, qg, kd.transpose(1, 2), alpha=scale)
            o = torch.bmm(torch.softmax(scores, dim=-1), vd)  # [kv_heads * B, group, d]
            o = o.view(num_kv, b, -1, d).transpose(0, 1).reshape(b, -1, d)
            if self.all_decode:
                return o
            out.index_copy_(0, self.decode_tokens, o)
        for tok_start, length, slots, ctx_start in self.prefills:
            if self.prefill_kernel:
                out[tok_start : tok_start + length] = cpu_kernels.paged_prefill(
                    q[tok_start : tok_start + length], k_cache, v_cache, slots, ctx_start, scale)
                continue
            qp = q[tok_start : tok_start + length].transpose(0, 1).unsqueeze(0)  # [1, nh, Lq, d]
            kp = k_cache.index_select(1, slots).unsqueeze(0)  # [1, nkv, Lk, d]
            vp = v_cache.index_select(1, slots).unsqueeze(0)
            if ctx_start == 0:
                o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True, scale=sdpa_scale)
            else:
                qpos = torch.arange(ctx_start, ctx_start + length, device=q.device)
                kpos = torch.arange(ctx_start + length, device=q.device)
                mask = kpos[None, :] <= qpos[:, None]
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=True, scale=sdpa_scale)
            out[tok_start : tok_start + length] = o.squeeze(0).transpose(0, 1)
        return out


def _expand(pages: Tensor, page_size: int, offsets: Tensor) -> Tensor:
    """[R, P] page ids -> [R, P * page_size] slot ids, in position order."""
    return (pages.unsqueeze(-1) * page_size + offsets).reshape(pages.shape[0], -1)
