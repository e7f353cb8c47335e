"""The paged attention backend: the cache storage of every layer and each step's attention.

The runner asks its backend for two things: the storage (allocated once, sized by the page pools
and the state slots) and, each step, the `models.interface.AttentionContext` the model's layers
call (`PagedAttention`: write the step's K/V into the cache, attend over each request's history;
or a recurrent layer's state and chunks). The KV manager decides which pages a request holds, per
cache group (`kv/coordinator.py`); the runner's persistent batch (`runner.InputBatch`) keeps every
running request's block table of each paged group as a row of one device tensor, updated with new
pages only, and hands the backend an `AttentionInputs` per step: those tensors, the step's slot
mapping per group, which tokens decode, and the recurrent chunks.

Storage (`KVCache`), per layer by its group's spec: K and V of a full-attention or sliding-window
layer as [num_kv_heads, slots, head_dim] (a sliding group has one spare page, its `NULL`
placeholder), the rows of a latent-attention layer as [slots, row_dim], and the state tensors of a
recurrent layer as [num_state_slots, *shape]. Slot = page * page_size + offset, in the layer's own
group's pages. On the CPU each large tensor is an anonymous private memory map (`zeroed`): the kernel
gives it zero pages as they are first touched, so a 2 GiB pool costs no time at start (``torch.zeros``
wrote every byte: 1-2 s, more on a busy machine) and only the pages in use are resident.

`TorchPagedBackend` runs on the CPU and, as plain torch operations, on CUDA too. It expands block
table rows into slot indices on the device (slot = page * page_size + offset), so a step costs a few
tensor operations whatever the batch, with no per-request index work on the host. On the CPU, decode
attention (one query token per row) of a full-attention layer runs Helios's own kernel
(`helios.models.cpu_kernels.paged_decode`) when it is built: it reads each row's K/V in place
through the block table, in float32, split over history chunks that run in parallel, instead of
gathering every row's whole history into a contiguous copy in every layer of every step (at 4k
tokens of context and 8 rows the gather path took 13-20 ms per layer, the kernel 2-3 ms). Prefill
chunks keep SDPA over their gathered context, or the `paged_prefill` kernel on a bfloat16 cache.

A sliding-window layer (query position p sees keys p - window + 1 .. p) uses the kernels only while
every context of the step is within its window; otherwise decode rows gather their last ``window``
positions (one index tensor for all rows) and prefill chunks their window before the chunk, with the
window in the mask. `all_decode_args` (the one-operator decode layer) is for full-attention layers.

A latent-attention layer (DeepSeek-V3's MLA, `LatentAttentionSpec`) is served by
`LatentGroupAttention` through the context's ``latent`` call: decode tokens in the absorbed form,
through `paged_decode` with the rows as the one kv head's K and V where the row size is a multiple
of 16 (else gathered), prefill chunks in the cheaper of the two forms (`helios.models.latent_attention`):
absorbed through the same kernel (each query a decode token of its position), or over their gathered
context rows.

A layer with attention sinks (gpt-oss: a call's ``sinks``) never takes the kernels, which know no
sinks: its decode rows gather their context (the gather indices are built on the first such
layer of a step that the kernel would otherwise serve) and every chunk goes through
`helios.models.attention_sinks.sink_attention` with the causal (and window) mask.

A CUDA backend with FlashAttention / FlashInfer kernels and CUDA graphs for decode batch buckets
would take the same `AttentionInputs` (block tables and sequence lengths are what those kernels
read); it is not written yet (no GPU has been available to verify one), so `[model] device = "cuda"`
uses `TorchPagedBackend` with its tensors on the GPU.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from helios.engine.kv.compressed import entries_per_page
from helios.engine.kv.layout import KV_SCALE_DTYPE, CacheGroup, CacheLayout
from helios.models import cpu_kernels
from helios.models.attention_sinks import sink_attention, sink_softmax
from helios.models.interface import (
    CompressedSpec,
    DecodeArgs,
    FullAttentionSpec,
    LatentAttentionSpec,
    LatentProjection,
    RecurrentBatch,
    RowSpans,
    RowWindowSpec,
    SlidingWindowSpec,
    SparseIndex,
)
from helios.models.latent_attention import (
    absorb_query,
    absorbed_attention,
    absorbed_is_cheaper,
    absorbed_output,
    chunk_attention,
    sparse_attention,
)


@attrs.frozen
class AttentionInputs:
    """One step's attention metadata, built by the runner's persistent batch. Tensors are on the
    device; the ints are host values the scheduler output already gave (no device read)."""

    block_table: Tensor
    """[rows, max_pages] int64, persistent: row r holds the pages of the request in batch row r in
    the primary group (group 0; entries past its pages are stale page ids, never read unmasked)."""
    slot_mapping: Tensor
    """[T] int64: the cache slot each token's K/V is written to (group 0)."""
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
    group_tables: tuple[tuple[Tensor, Tensor], ...] = ()
    """(block table, slot mapping) of paged groups 1, 2, ... (same rows, same positions)."""
    recurrent_spans: tuple[tuple[int, int, int, int], ...] = ()
    """(first token index, length, state slot, first position) of every chunk, in batch order, for a
    layout with recurrent groups (`models.interface.RecurrentBatch`)."""


class TorchPagedBackend:
    """Paged attention: decode rows through the CPU kernel where it applies (else one gather per layer
    for all decode rows); prefill chunks through the CPU prefill kernel where it applies (a bfloat16
    cache on a CPU with AVX512-BF16), else a gather and SDPA per chunk."""

    name = "torch_paged"

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, *, decode_kernel: bool | None = None,
                 prefill_kernel: bool | None = None, layout: CacheLayout | None = None,
                 num_state_slots: int = 0, kv_dtype: str = "auto", max_active: int = 0,
                 step_tokens: int = 0) -> None:
        """``num_layers`` full-attention layers of ``num_kv_heads`` x ``head_dim``, or, given
        ``layout``, its groups (the three shape arguments are then unused; `for_layout`).
        ``num_state_slots``: the state slots of every recurrent layer; ``max_active`` and
        ``step_tokens``: what sizes lazy row-window pools (`kv.layout.CacheGroup.num_pages`). ``kv_dtype``
        (`kv.layout.KV_DTYPES`): "int8" keeps full-attention and sliding-window K/V as int8 codes
        with a scale per row (`KVCache`); decode rows then use the kernel's int8 variant
        (`cpu_kernels.paged_decode_int8`) where the decode kernel applies, and prefill chunks their
        dequantized gathered context (no int8 prefill kernel).

        ``decode_kernel``: use `cpu_kernels.paged_decode` for decode rows (None: wherever it
        applies: a CPU cache in float32 or bfloat16, a head size of a multiple of 16, the kernels built).
        ``prefill_kernel``: use `cpu_kernels.paged_prefill` for prefill chunks (None: wherever it
        applies: a bfloat16 CPU cache, a head size of a multiple of 32 up to 128, the kernels built
        with AVX512-BF16)."""
        if layout is None:
            layout = CacheLayout.from_specs([FullAttentionSpec(num_kv_heads, head_dim)] * num_layers)
        self.layout = layout
        self.kv = KVCache.for_layout(layout, num_pages, page_size, dtype, device, num_state_slots, kv_dtype,
                                     max_active=max_active, step_tokens=step_tokens)
        self.kv_dtype = kv_dtype
        self.page_size = page_size
        self.device = device
        self._offsets = torch.arange(page_size, device=device)  # slot offsets within a page
        cpu = torch.device(device).type == "cpu"
        built = cpu_kernels.available() if decode_kernel is None else decode_kernel
        prefill_built = (cpu_kernels.available() and cpu_kernels.bf16_kernels_supported() if prefill_kernel is None
                         else prefill_kernel)
        # Per paged group: (decode kernel, prefill kernel) where they apply to its K/V.
        self.group_kernels: list[tuple[bool, bool]] = []
        for group in layout.paged_groups:
            spec = group.spec
            if isinstance(spec, LatentAttentionSpec):
                # Absorbed decode is multi-query attention over the rows: the decode kernel's.
                latent_applies = cpu and dtype in (torch.float32, torch.bfloat16) and spec.row_dim % 16 == 0
                self.group_kernels.append((latent_applies and built, False))
                continue
            if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
                self.group_kernels.append((False, False))
                continue
            d = spec.head_dim
            applies = cpu and dtype in (torch.float32, torch.bfloat16) and d % 16 == 0
            prefill_applies = (cpu and dtype == torch.bfloat16 and d % 32 == 0 and d <= 128
                               and not group.is_quantized(kv_dtype))
            self.group_kernels.append((applies and built, prefill_applies and prefill_built))
        self.decode_kernel, self.prefill_kernel = self.group_kernels[0]
        if self.decode_kernel:
            self.name = "cpu_paged_kernel"

    @classmethod
    def for_layout(cls, layout: CacheLayout, num_pages: int, page_size: int, dtype: torch.dtype,
                   device: torch.device, *, num_state_slots: int = 0, decode_kernel: bool | None = None,
                   prefill_kernel: bool | None = None, kv_dtype: str = "auto", max_active: int = 0,
                   step_tokens: int = 0) -> TorchPagedBackend:
        return cls(layout.num_layers, num_pages, page_size, 0, 0, dtype, device, decode_kernel=decode_kernel,
                   prefill_kernel=prefill_kernel, layout=layout, num_state_slots=num_state_slots,
                   kv_dtype=kv_dtype, max_active=max_active, step_tokens=step_tokens)

    def build(self, inputs: AttentionInputs) -> PagedAttention | GroupAttention:
        """The step's `models.interface.AttentionContext`: with one full-attention group (every
        Llama-family model) that group's `GroupAttention` itself (no per-layer dispatch)."""
        if self.layout.is_single_full:
            return GroupAttention(self.kv, self.layout.groups[0], inputs, inputs.block_table, inputs.slot_mapping,
                                  self.page_size, self._offsets, decode_kernel=self.decode_kernel,
                                  prefill_kernel=self.prefill_kernel)
        return PagedAttention(self.kv, inputs, self.page_size, self._offsets, decode_kernel=self.decode_kernel,
                              prefill_kernel=self.prefill_kernel, layout=self.layout,
                              group_kernels=self.group_kernels)

    def read_page(self, page: int, group: int = 0) -> bytes:
        return self.kv.read_page(page, self.page_size, group)

    def write_page(self, page: int, data: bytes, group: int = 0) -> bool:
        return self.kv.write_page(page, self.page_size, data, group)


_MAPPED_BYTES = 1 << 20  # CPU tensors from this size on are anonymous memory maps (`zeroed`)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu") -> Tensor:
    """A tensor of zeros. On the CPU, from 1 MiB on, it lies in its own anonymous private memory
    map: page-aligned, zero by the kernel's guarantee for a new anonymous mapping, and each page
    allocated (as a zero page) only when first touched, so making it costs no time and an unused
    part of a KV pool no memory. The tensor keeps the map alive (`torch.frombuffer` holds a reference);
    the map is unmapped when the last view of it is freed. Elsewhere, and for small tensors,
    ``torch.zeros``."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < _MAPPED_BYTES or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(buffer, dtype=dtype, count=torch.Size(shape).numel()).view(shape)


def _pack(views: Sequence[Tensor]) -> bytes:
    """The bytes of ``views``, one after another, each in its own dtype (a host-store record)."""
    return bytes(torch.cat([t.contiguous().view(torch.uint8).flatten() for t in views]).cpu().numpy().tobytes())


def _unpack(views: Sequence[Tensor], data: bytes) -> bool:
    """Fill ``views`` from `_pack`'s bytes; False (nothing written) when they do not fit."""
    if len(data) != sum(t.numel() * t.element_size() for t in views):
        return False
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    at = 0
    for t in views:
        one = t.numel() * t.element_size()
        t.copy_(raw[at:at + one].view(t.dtype).view(t.shape).to(t.device))
        at += one
    return True


class KVCache:
    """The cache storage, per layer by its spec: K and V tensors of shape
    [num_kv_heads, num_slots, head_dim] (`k`, `v`, keyed by layer index), latent rows [num_slots,
    row_dim] (`rows`), recurrent states (`states`, each [num_state_slots, *shape]).

    Head-major K/V, so gathering a batch's history is one `index_select` over slots per layer that
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
        kv_dtype: str = "auto",
    ) -> None:
        layout = CacheLayout.from_specs([FullAttentionSpec(num_kv_heads, head_dim)] * num_layers)
        self._allocate(layout, num_pages, page_size, dtype, device, 0, kv_dtype)

    @classmethod
    def for_layout(cls, layout: CacheLayout, num_pages: int, page_size: int, dtype: torch.dtype,
                   device: str | torch.device = "cpu", num_state_slots: int = 0, kv_dtype: str = "auto", *,
                   max_active: int = 0, step_tokens: int = 0) -> KVCache:
        """Storage for ``num_pages`` pages of positions in every paged group (a compressed group its
        entry pages; with ``step_tokens``, a row-window group its pool for ``max_active`` requests:
        `CacheGroup.num_pages`)."""
        kv = cls.__new__(cls)
        kv._allocate(layout, num_pages, page_size, dtype, device, num_state_slots, kv_dtype, max_active,
                     step_tokens)
        return kv

    def _allocate(self, layout: CacheLayout, num_pages: int, page_size: int, dtype: torch.dtype,
                  device: str | torch.device, num_state_slots: int, kv_dtype: str, max_active: int = 0,
                  step_tokens: int = 0) -> None:
        self.layout = layout
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        self.k: dict[int, Tensor] = {}
        self.v: dict[int, Tensor] = {}
        self.k_scale: dict[int, Tensor] = {}
        self.v_scale: dict[int, Tensor] = {}
        self.rows: dict[int, Tensor] = {}
        self.states: dict[int, tuple[Tensor, ...]] = {}
        for group in layout.groups:
            spec = group.spec
            # A sliding-window group's spare page is its placeholder (`SlidingWindowPool.null_page`);
            # a compressed group's pages hold entries (`kv.compressed`), its spare one the placeholder.
            pages = group.num_pages(num_pages, page_size, max_active=max_active, step_tokens=step_tokens)
            slots = (pages + (1 if isinstance(spec, (SlidingWindowSpec, RowWindowSpec)) else 0)) * page_size
            if isinstance(spec, CompressedSpec):
                slots = (pages + 1) * entries_per_page(page_size, spec.rate)
            quantized = group.is_quantized(kv_dtype)
            for i in group.layers:
                if isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
                    rows_dtype = torch.int8 if quantized else dtype
                    self.k[i] = zeroed((spec.num_kv_heads, slots, spec.head_dim), rows_dtype, device)
                    self.v[i] = zeroed((spec.num_kv_heads, slots, spec.head_dim), rows_dtype, device)
                    if quantized:
                        self.k_scale[i] = zeroed((spec.num_kv_heads, slots), KV_SCALE_DTYPE, device)
                        self.v_scale[i] = zeroed((spec.num_kv_heads, slots), KV_SCALE_DTYPE, device)
                elif isinstance(spec, (LatentAttentionSpec, RowWindowSpec, CompressedSpec)):
                    self.rows[i] = zeroed((slots, spec.row_dim), dtype, device)
                else:
                    self.states[i] = tuple(zeroed((num_state_slots, *shape), spec.dtype or dtype, device)
                                           for shape in spec.shapes)

    def prefault(self) -> None:
        """Write every cache tensor once (zeros), so all its memory pages are resident now rather
        than taken one by one as pages are first used (`zeroed`)."""
        tensors = [*self.k.values(), *self.v.values(), *self.k_scale.values(), *self.v_scale.values(),
                   *self.rows.values()]
        tensors += [t for state in self.states.values() for t in state]
        for t in tensors:
            t.zero_()

    def is_quantized(self, layer_idx: int) -> bool:
        """Whether the layer's K/V are int8 codes with per-row scales (`k_scale`, `v_scale`)."""
        return layer_idx in self.k_scale

    def write(self, layer_idx: int, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
        """The step's ``k``, ``v`` [T, kv_heads, d] into the layer's cache at ``slot_mapping`` [T]:
        copied in the cache's dtype, or quantized (`quantize_rows`) with their scales."""
        k_cache, v_cache = self.k[layer_idx], self.v[layer_idx]
        if layer_idx not in self.k_scale:
            k_cache.index_copy_(1, slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
            v_cache.index_copy_(1, slot_mapping, v.transpose(0, 1).to(v_cache.dtype))
            return
        for x, cache, scales in ((k, k_cache, self.k_scale[layer_idx]), (v, v_cache, self.v_scale[layer_idx])):
            codes, scale = quantize_rows(x.transpose(0, 1))
            cache.index_copy_(1, slot_mapping, codes)
            scales.index_copy_(1, slot_mapping, scale)

    def gather(self, layer_idx: int, slots: Tensor) -> tuple[Tensor, Tensor]:
        """The layer's K and V at ``slots`` ([kv_heads, len(slots), d] each): in the cache's dtype,
        or dequantized to float32 (exact: a bfloat16 scale times an int8 code)."""
        k = self.k[layer_idx].index_select(1, slots)
        v = self.v[layer_idx].index_select(1, slots)
        if layer_idx not in self.k_scale:
            return k, v
        return (dequantize_rows(k, self.k_scale[layer_idx].index_select(1, slots)),
                dequantize_rows(v, self.v_scale[layer_idx].index_select(1, slots)))

    def _page_views(self, page: int, page_size: int, group: int) -> list[Tensor]:
        """The group's tensors' views of one page, layer by layer (K then V, then with int8 K/V
        their scales; or the rows)."""
        spec = self.layout.paged_groups[group].spec
        if isinstance(spec, CompressedSpec):  # an entry page: its entries' rows (`kv.compressed`)
            page_size = entries_per_page(page_size, spec.rate)
        lo = page * page_size
        out: list[Tensor] = []
        for i in self.layout.paged_groups[group].layers:
            if i in self.k:
                out.append(self.k[i][:, lo:lo + page_size, :])
                out.append(self.v[i][:, lo:lo + page_size, :])
                if i in self.k_scale:
                    out.append(self.k_scale[i][:, lo:lo + page_size])
                    out.append(self.v_scale[i][:, lo:lo + page_size])
            else:
                out.append(self.rows[i][lo:lo + page_size])
        return out

    def read_page(self, page: int, page_size: int, group: int = 0) -> bytes:
        """One page of a paged group, layer by layer, K then V, each [kv_heads, page_size, head_dim]
        in the cache's dtype (with int8 K/V: the codes, then the K and V scales [kv_heads,
        page_size]; a latent layer: its [page_size, row_dim] rows)."""
        return _pack(self._page_views(page, page_size, group))

    def write_page(self, page: int, page_size: int, data: bytes, group: int = 0) -> bool:
        """Fill a page from `read_page`'s bytes; False (nothing written) when they do not fit."""
        return _unpack(self._page_views(page, page_size, group), data)

    # -- recurrent state rows (state checkpoints: `engine/kv/checkpoints.py`) ------------------------
    def state_bytes(self) -> int:
        """Bytes of one row of every recurrent layer's state tensors."""
        return sum(t[0].numel() * t.element_size() for state in self.states.values() for t in state)

    def copy_state(self, src: int, dst: int) -> None:
        """Copy row ``src`` of every recurrent layer's state tensors onto row ``dst``."""
        for state in self.states.values():
            for t in state:
                t[dst].copy_(t[src])

    def read_state(self, row: int) -> bytes:
        """Row ``row`` of every recurrent layer's state tensors, layer by layer, in their dtypes."""
        return _pack([t[row] for state in self.states.values() for t in state])

    def write_state(self, row: int, data: bytes) -> bool:
        """Fill a state row from `read_state`'s bytes; False (nothing written) when they do not fit."""
        return _unpack([t[row] for state in self.states.values() for t in state], data)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        kv_dtype: str = "auto") -> int:
        """Bytes per token of ``num_layers`` full-attention layers (`CacheLayout.bytes_per_token`
        for any layout)."""
        layout = CacheLayout.from_specs([FullAttentionSpec(num_kv_heads, head_dim)] * num_layers)
        return int(layout.bytes_per_token(dtype, kv_dtype))


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 codes of ``x`` [..., d] with one scale per row: ``scale`` is max|x| / 127
    rounded up to a `KV_SCALE_DTYPE` (bfloat16) value, so no code exceeds 127 in magnitude, and
    ``code = round(x / scale)`` (to nearest, ties to even) clamped to -127..127; a row of zeros gets
    scale 0 and codes 0. ``code * scale`` differs from ``x`` by at most scale / 2 per element (plus
    the float32 division's rounding, 127 * 2**-24 of the scale). Returns (int8 codes [..., d],
    scales [...])."""
    xf = x.float()
    want = xf.abs().amax(dim=-1) / 127.0
    scale = want.to(KV_SCALE_DTYPE)
    # Round up: a positive finite bfloat16's next value up is its bit pattern plus one.
    scale = torch.where(scale.float() < want, (scale.view(torch.int16) + 1).view(KV_SCALE_DTYPE), scale)
    sf = scale.float()
    codes = torch.round(xf / torch.where(sf > 0, sf, 1.0).unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_rows(codes: Tensor, scales: Tensor) -> Tensor:
    """``codes`` [..., d] (int8) times ``scales`` [...] as float32: exact (a bfloat16 scale's 8
    significant bits times a code's 7 fit in float32's 24)."""
    return codes.float() * scales.float().unsqueeze(-1)


class PagedAttention:
    """One step's attention over the paged cache of several groups
    (`models.interface.AttentionContext`): each layer goes to its group's `GroupAttention`, a
    recurrent layer gets its states and the step's spans.

    Index tensors are built once per step per paged group, on the device, and shared by every
    layer of the group."""

    def __init__(self, kv: KVCache, inputs: AttentionInputs, page_size: int, offsets: Tensor, *,
                 decode_kernel: bool = False, prefill_kernel: bool = False, layout: CacheLayout | None = None,
                 group_kernels: Sequence[tuple[bool, bool]] = ()) -> None:
        layout = kv.layout if layout is None else layout
        self.inputs = inputs
        self.kv = kv
        self._by_layer: list[GroupAttention | None] = [None] * layout.num_layers
        self._latent_by_layer: list[LatentGroupAttention | None] = [None] * layout.num_layers
        self._entries: dict[int, CompressedGroupAttention] = {}  # entry streams by cache index
        self._spans = inputs.recurrent_spans
        selections: list[list[Tensor | None]] = []  # sparse layers' per chunk (`LatentGroupAttention._sparse`)
        for g, group in enumerate(layout.paged_groups):
            if g == 0:
                table, slot_mapping = inputs.block_table, inputs.slot_mapping
                dk, pk = decode_kernel, prefill_kernel
            else:
                table, slot_mapping = inputs.group_tables[g - 1]
                dk, pk = group_kernels[g]
            if isinstance(group.spec, CompressedSpec):
                entry_step = CompressedGroupAttention(inputs, table, page_size, group.spec.rate)
                for i in group.layers:
                    self._entries[i] = entry_step
                continue
            if isinstance(group.spec, RowWindowSpec) and inputs.num_tokens:
                # A lazy pool's placeholder (its last page) is never written: a step position there
                # had no page materialized (`kv.coordinator.RowWindowPool`).
                null = kv.rows[group.layers[0]].shape[0] // page_size - 1
                if bool((slot_mapping >= null * page_size).any()):
                    raise RuntimeError("a step writes a row-window position that has no page")
            if isinstance(group.spec, (LatentAttentionSpec, RowWindowSpec)):
                latent = LatentGroupAttention(kv, inputs, table, slot_mapping, page_size, offsets, decode_kernel=dk,
                                              selections=selections)
                for i in group.layers:
                    self._latent_by_layer[i] = latent
                continue
            step = GroupAttention(kv, group, inputs, table, slot_mapping, page_size, offsets, decode_kernel=dk,
                              prefill_kernel=pk)
            for i in group.layers:
                self._by_layer[i] = step

    def recurrent(self, layer_idx: int) -> RecurrentBatch:
        return RecurrentBatch(self.kv.states[layer_idx], self._spans)

    def all_decode_args(self, layer_idx: int) -> DecodeArgs | None:
        """For a step of decode tokens only of a full-attention layer, served by the CPU kernel:
        what `write_paged_decode` needs for this layer (k_cache, v_cache, slot_mapping, block_table,
        rows, lens, page_size, and with int8 K/V the scales), so a model can run the layer as one
        operator; None otherwise."""
        step = self._by_layer[layer_idx]
        return None if step is None else step.all_decode_args(layer_idx)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float | None = None, *, sinks: torch.Tensor | None = None) -> torch.Tensor:
        step = self._by_layer[layer_idx]
        if step is None:
            raise TypeError(f"layer {layer_idx} keeps no K/V (its cache spec is not an attention spec)")
        return step(layer_idx, q, k, v, scale, sinks=sinks)

    def latent(self, layer_idx: int, q_nope: Tensor, q_rope: Tensor, rows: Tensor, projection: LatentProjection,
               scale: float, *, index: SparseIndex | None = None) -> Tensor:
        step = self._latent_by_layer[layer_idx]
        if step is None:
            raise TypeError(f"layer {layer_idx} keeps no latent rows (its cache spec is not a LatentAttentionSpec)")
        return step.latent(layer_idx, q_nope, q_rope, rows, projection, scale, index=index)

    def rows(self, layer_idx: int, rows: Tensor, *, entries: int | None = None) -> RowSpans:
        step = self._latent_by_layer[layer_idx]
        if step is None:
            raise TypeError(f"layer {layer_idx} keeps no rows (its cache spec is not a LatentAttentionSpec)")
        spans = step.rows(layer_idx, rows)
        if entries is None:
            return spans
        stream = self._entries.get(entries)
        if stream is None:
            raise TypeError(f"cache index {entries} is no entry stream (its spec is not a CompressedSpec)")
        return attrs.evolve(spans, entries=self.kv.rows[entries], entry_slots=stream.slots())


class GroupAttention:
    """One step's attention over one full-attention or sliding-window group: its index tensors,
    built once per step and shared by the group's layers."""

    def __init__(self, kv: KVCache, group: CacheGroup, inputs: AttentionInputs, table: Tensor, slot_mapping: Tensor,
                 page_size: int, offsets: Tensor, *, decode_kernel: bool, prefill_kernel: bool) -> None:
        self.kv = kv
        self.inputs = inputs  # the step's metadata (tensor parallelism's leader broadcasts it)
        window = self.window = group.window
        self.write_kernel = decode_kernel  # the CPU kernels serve this cache: row copies
        if window is not None:
            # The kernels see whole contexts: only while every one of the step is within the window.
            if inputs.decode_max_len > window:
                decode_kernel = False
            if any(ctx + n > window for _, n, _, ctx in inputs.prefills):
                prefill_kernel = False
        self.full = window is None
        self.prefill_kernel = prefill_kernel
        self.slot_mapping = slot_mapping
        self.num_decode = inputs.num_decode
        self.decode_kernel = decode_kernel
        self.page_size = page_size
        self.all_decode = inputs.num_decode == inputs.num_tokens
        if inputs.num_decode and decode_kernel:
            assert inputs.decode_rows is not None and inputs.decode_lens is not None
            assert inputs.decode_tokens is not None
            self.table = table
            self.decode_rows = inputs.decode_rows
            self.decode_lens = inputs.decode_lens
            self.decode_tokens = inputs.decode_tokens
        self._gather_from = (group, inputs, table, offsets)
        self.decode_gathered = False
        if inputs.num_decode and not decode_kernel:
            self._gather_decode()
        # (tok_start, length, slots, ctx_start, first key position)
        self.prefills: list[tuple[int, int, Tensor, int, int]] = []
        for tok_start, length, row, ctx_start in inputs.prefills:
            end = ctx_start + length
            first = 0 if window is None else max(0, ctx_start - window + 1)
            lo = first // page_size
            pages = table[row : row + 1, lo : -(-end // page_size)]
            slots = _expand(pages, page_size, offsets)[0, first - lo * page_size : end - lo * page_size]
            self.prefills.append((tok_start, length, slots, ctx_start, first))

    def _gather_decode(self) -> None:
        """The decode rows' gather indices and additive mask (the path without the decode kernel)."""
        group, inputs, table, offsets = self._gather_from
        kv, window, page_size = self.kv, self.window, self.page_size
        self.decode_gathered = True
        assert inputs.decode_rows is not None and inputs.decode_lens is not None
        lmax = inputs.decode_max_len
        num_kv = next(kv.k[i] for i in group.layers).shape[0]
        # The gathered context's dtype: the cache's, or float32 for dequantized int8 rows.
        dtype = torch.float32 if kv.is_quantized(group.layers[0]) else kv.k[group.layers[0]].dtype
        if window is not None and lmax > window:
            # Each row's last `window` positions (lens - window .. lens - 1); before 0: masked.
            pos = inputs.decode_lens[:, None] - window + torch.arange(window, device=table.device)[None, :]
            pad = pos < 0
            pos = pos.clamp(min=0)
            pages = table.index_select(0, inputs.decode_rows).gather(1, pos // page_size)
            self.decode_idx = pages * page_size + pos % page_size
            lmax = window
        else:
            pages = table.index_select(0, inputs.decode_rows)[:, : -(-lmax // page_size)]
            # [D, lmax] slots of positions 0 .. lmax - 1; a row's positions past its length are masked.
            self.decode_idx = _expand(pages, page_size, offsets)[:, :lmax]
            pad = torch.arange(lmax, device=table.device)[None, :] >= inputs.decode_lens[:, None]
        self.decode_flat = self.decode_idx.reshape(-1)
        # Additive mask over (kv head, row) batches: 0 where a row attends, -inf on padding.
        bias = torch.zeros(inputs.num_decode, lmax, dtype=dtype, device=table.device).masked_fill_(
            pad, float("-inf"))
        self.decode_bias = bias[None, :, None, :].expand(num_kv, -1, -1, -1).reshape(-1, 1, lmax)
        assert inputs.decode_tokens is not None
        self.decode_tokens = inputs.decode_tokens

    def recurrent(self, layer_idx: int) -> RecurrentBatch:
        raise TypeError(f"layer {layer_idx} is an attention layer, not a recurrent one")

    def latent(self, layer_idx: int, q_nope: Tensor, q_rope: Tensor, rows: Tensor, projection: LatentProjection,
               scale: float, *, index: SparseIndex | None = None) -> Tensor:
        raise TypeError(f"layer {layer_idx} keeps K/V, not latent rows")

    def rows(self, layer_idx: int, rows: Tensor, *, entries: int | None = None) -> RowSpans:
        raise TypeError(f"layer {layer_idx} keeps K/V, not rows")

    def all_decode_args(self, layer_idx: int) -> DecodeArgs | None:
        if not (self.num_decode and self.decode_kernel and self.all_decode and self.full):
            return None
        kv = self.kv
        return (kv.k[layer_idx], kv.v[layer_idx], self.slot_mapping, self.table, self.decode_rows, self.decode_lens,
                self.page_size, kv.k_scale.get(layer_idx), kv.v_scale.get(layer_idx))

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float | None = None, *, sinks: torch.Tensor | None = None) -> torch.Tensor:
        sdpa_scale = scale  # None: SDPA's own default, 1 / sqrt(head_dim)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        decode = self.all_decode_args(layer_idx) if sinks is None else None
        if decode is not None:
            # One operator: this step's K/V into the cache, then the paged decode over it.
            return cpu_kernels.write_paged_decode(q, k, v, *decode, scale)
        kv = self.kv
        k_cache = kv.k[layer_idx]  # [kv_heads, slots, head_dim]
        v_cache = kv.v[layer_idx]
        quantized = kv.is_quantized(layer_idx)
        if self.write_kernel:  # the CPU kernels serve this cache: row copies, or rows quantized
            if quantized:
                cpu_kernels.write_kv_int8(k, v, k_cache, kv.k_scale[layer_idx], v_cache, kv.v_scale[layer_idx],
                                          self.slot_mapping)
            else:
                cpu_kernels.write_kv(k, v, k_cache, v_cache, self.slot_mapping)
        else:
            kv.write(layer_idx, k, v, self.slot_mapping)
        out = torch.empty_like(q)
        num_kv = k_cache.shape[0]
        if self.num_decode and self.decode_kernel and sinks is None:
            qd = q if self.all_decode else q.index_select(0, self.decode_tokens)
            if quantized:
                o = cpu_kernels.paged_decode_int8(qd, k_cache, kv.k_scale[layer_idx], v_cache, kv.v_scale[layer_idx],
                                                  self.table, self.decode_rows, self.decode_lens, self.page_size,
                                                  scale)
            else:
                o = cpu_kernels.paged_decode(qd, k_cache, v_cache, self.table, self.decode_rows, self.decode_lens,
                                             self.page_size, scale)
            if self.all_decode:
                return o
            out.index_copy_(0, self.decode_tokens, o)
        elif self.num_decode:
            if not self.decode_gathered:  # a sink layer in a step the decode kernel serves
                self._gather_decode()
            b, lmax = self.decode_idx.shape
            d = q.shape[-1]
            # One gather per layer gives [kv_heads * B, L, d] batches, contiguous, in (kv head, row)
            # order. Each kv head's query group is folded into the query axis, so no GQA repeat of
            # K/V is needed (query head h uses kv head h // group). Int8 rows come dequantized in
            # float32, and the query with them.
            kd, vd = kv.gather(layer_idx, self.decode_flat)
            kd, vd = kd.view(num_kv * b, lmax, d), vd.view(num_kv * b, lmax, d)
            qd = q if self.all_decode else q.index_select(0, self.decode_tokens)
            qg = qd.view(b, num_kv, -1, d).transpose(0, 1).reshape(num_kv * b, -1, d).to(kd.dtype)
            scores = torch.baddbmm(self.decode_bias, qg, kd.transpose(1, 2), alpha=scale)
            if sinks is None:
                probs = torch.softmax(scores, dim=-1)
            else:  # query head h = kv head * group + g: its sink as a [kv_heads * B, group, 1] column
                column = sinks.view(num_kv, 1, -1, 1).expand(-1, b, -1, -1).reshape(num_kv * b, -1, 1)
                probs = sink_softmax(scores, column).to(vd.dtype)
            o = torch.bmm(probs, vd)  # [kv_heads * B, group, d]
            o = o.view(num_kv, b, -1, d).transpose(0, 1).reshape(b, -1, d).to(q.dtype)
            if self.all_decode:
                return o
            out.index_copy_(0, self.decode_tokens, o)
        window = self.window
        for tok_start, length, slots, ctx_start, first in self.prefills:
            if self.prefill_kernel and sinks is None:
                out[tok_start : tok_start + length] = cpu_kernels.paged_prefill(
                    q[tok_start : tok_start + length], k_cache, v_cache, slots, ctx_start, scale)
                continue
            kp, vp = kv.gather(layer_idx, slots)  # [nkv, Lk, d] each (int8 rows: float32)
            kp, vp = kp.unsqueeze(0), vp.unsqueeze(0)
            qp = q[tok_start : tok_start + length].transpose(0, 1).unsqueeze(0).to(kp.dtype)  # [1, nh, Lq, d]
            if sinks is not None:
                qpos = torch.arange(ctx_start, ctx_start + length, device=q.device)
                kpos = torch.arange(first, ctx_start + length, device=q.device)
                mask = kpos[None, :] <= qpos[:, None]
                if window is not None:
                    mask &= kpos[None, :] > qpos[:, None] - window
                o = sink_attention(qp, kp, vp, sinks, scale, mask)
            elif ctx_start == 0 and (window is None or length <= window):
                o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True, scale=sdpa_scale)
            else:
                qpos = torch.arange(ctx_start, ctx_start + length, device=q.device)
                kpos = torch.arange(first, ctx_start + length, device=q.device)
                mask = kpos[None, :] <= qpos[:, None]
                if window is not None:
                    mask &= kpos[None, :] > qpos[:, None] - window
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=True, scale=sdpa_scale)
            out[tok_start : tok_start + length] = o.squeeze(0).transpose(0, 1)
        return out


class LatentGroupAttention:
    """One step's multi-head latent attention over one latent group (`LatentAttentionSpec`): the
    rows [slots, row_dim] of each layer, index tensors built once per step and shared by the
    group's layers. Each layer's step rows are written at their slots first. Decode tokens attend
    in the absorbed form (`helios.models.latent_attention`): on the CPU through the
    `cpu_kernels.paged_decode` kernel, reading the rows in place through the block table as the
    one kv head's K and V ([1, slots, row_dim] views; the output's last rope_dim columns, the
    rotary keys' weighted sum, are dropped), else one gather of every decode row's context and two
    bmms. A prefill chunk attends in the cheaper form (`latent_attention.absorbed_is_cheaper`):
    absorbed (a short chunk over a long context) through the same kernel where it serves the group,
    each query a decode token of its row with context length position + 1 (the rows read in place;
    the chunk's own rows are written first); otherwise over its gathered context rows
    (`latent_attention.chunk_attention`: expanded, or absorbed with a causal mask)."""

    def __init__(self, kv: KVCache, inputs: AttentionInputs, table: Tensor, slot_mapping: Tensor, page_size: int,
                 offsets: Tensor, *, decode_kernel: bool, selections: list[list[Tensor | None]] | None = None) -> None:
        self.kv = kv
        self.selections: list[list[Tensor | None]] = [] if selections is None else selections
        self.slot_mapping = slot_mapping
        self.page_size = page_size
        self.num_decode = inputs.num_decode
        self.all_decode = inputs.num_decode == inputs.num_tokens
        self.decode_kernel = decode_kernel
        if inputs.num_decode:
            assert inputs.decode_rows is not None and inputs.decode_lens is not None
            assert inputs.decode_tokens is not None
            self.table = table
            self.decode_rows = inputs.decode_rows
            self.decode_lens = inputs.decode_lens
            self.decode_tokens = inputs.decode_tokens
            if not decode_kernel:
                lmax = inputs.decode_max_len
                pages = table.index_select(0, inputs.decode_rows)[:, : -(-lmax // page_size)]
                self.decode_idx = _expand(pages, page_size, offsets)[:, :lmax]  # [D, lmax]
                pad = torch.arange(lmax, device=table.device)[None, :] >= inputs.decode_lens[:, None]
                self.decode_bias = torch.zeros(inputs.num_decode, 1, lmax, dtype=torch.float32,
                                               device=table.device).masked_fill_(pad[:, None, :], float("-inf"))
        self.table = table
        self._offsets = offsets
        self._spans: list[tuple[slice, Tensor, int]] | None = None  # sparse layers' (`_sparse_spans`)
        # (first token index, length, context slots of positions 0 .. end, first position, batch row)
        self.prefills: list[tuple[int, int, Tensor, int, int]] = []
        for tok_start, length, row, ctx_start in inputs.prefills:
            end = ctx_start + length
            pages = table[row : row + 1, : -(-end // page_size)]
            self.prefills.append((tok_start, length, _expand(pages, page_size, offsets)[0, :end], ctx_start, row))

    def latent(self, layer_idx: int, q_nope: Tensor, q_rope: Tensor, rows: Tensor, projection: LatentProjection,
               scale: float, *, index: SparseIndex | None = None) -> Tensor:
        cache = self.kv.rows[layer_idx]  # [slots, row_dim]
        cache.index_copy_(0, self.slot_mapping, rows.to(cache.dtype))
        if index is not None:
            return self._sparse(q_nope, q_rope, cache, projection, scale, index)
        if self.all_decode:
            return self._decode(q_nope, q_rope, cache, projection, scale)
        out = q_nope.new_empty(q_nope.shape[0], projection.num_heads, projection.v_dim)
        if self.num_decode:
            qn, qr = q_nope.index_select(0, self.decode_tokens), q_rope.index_select(0, self.decode_tokens)
            out.index_copy_(0, self.decode_tokens, self._decode(qn, qr, cache, projection, scale))
        for tok_start, length, slots, ctx_start, row in self.prefills:
            chunk = slice(tok_start, tok_start + length)
            end = ctx_start + length
            if self.decode_kernel and absorbed_is_cheaper(length, end, cache.shape[1], projection):
                # Absorbed, in place: each query is a decode token of its row with context position + 1.
                device = self.table.device
                rows_of = torch.full((length,), row, dtype=torch.long, device=device)
                lens = torch.arange(ctx_start + 1, end + 1, dtype=torch.long, device=device)
                q = absorb_query(q_nope[chunk], q_rope[chunk], projection).to(cache.dtype)
                latent = cpu_kernels.paged_decode(q, cache.unsqueeze(0), cache.unsqueeze(0), self.table, rows_of, lens,
                                                  self.page_size, scale)[..., : projection.rank]
                out[chunk] = absorbed_output(latent, projection).to(out.dtype)
                continue
            out[chunk] = chunk_attention(q_nope[chunk], q_rope[chunk], cache.index_select(0, slots), projection,
                                         scale, ctx_start).to(out.dtype)
        return out

    def rows(self, layer_idx: int, rows: Tensor) -> RowSpans:
        """The step's ``rows`` written at their slots; the cache and every decode token's and
        prefill chunk's context slots (`models.interface.RowSpans`)."""
        cache = self.kv.rows[layer_idx]
        cache.index_copy_(0, self.slot_mapping, rows.to(cache.dtype))
        spans = tuple((tokens.start, tokens.stop - tokens.start, slots) for tokens, slots, _ in self._sparse_spans())
        return RowSpans(cache, spans)

    def _sparse(self, q_nope: Tensor, q_rope: Tensor, cache: Tensor, projection: LatentProjection, scale: float,
                index: SparseIndex) -> Tensor:
        """A sparse layer (DSA: the rows end with the indexer keys): every decode token and prefill
        chunk over its gathered context rows, each query attending to the keys its indexer selects
        (`latent_attention.sparse_attention`), or a shared layer (no indexer) to those the step's
        previous sparse layer selected (``selections``, shared by the step's latent groups: both
        list decode tokens, then prefill chunks, in the inputs' order)."""
        out = q_nope.new_empty(q_nope.shape[0], projection.num_heads, projection.v_dim)
        spans = self._sparse_spans()
        if len(self.selections) != len(spans):  # the step's first sparse layer
            self.selections[:] = [[] for _ in spans]
        for (tokens, slots, first), selection in zip(spans, self.selections, strict=True):
            q, weights = index.q, index.weights
            sub = SparseIndex(None if q is None else q[tokens], None if weights is None else weights[tokens],
                              index.top_k)
            out[tokens] = sparse_attention(q_nope[tokens], q_rope[tokens], cache.index_select(0, slots), projection,
                                           scale, first, sub, selection).to(out.dtype)
        return out

    def _sparse_spans(self) -> list[tuple[slice, Tensor, int]]:
        """(the step's tokens, their context slots of positions 0 .., the first's position) of every
        decode token and prefill chunk; built on the step's first sparse (or `rows`) layer and shared."""
        if self._spans is None:
            spans: list[tuple[slice, Tensor, int]] = []
            if self.num_decode:
                lens = self.decode_lens.tolist()
                lmax = max(lens)
                pages = self.table.index_select(0, self.decode_rows)[:, : -(-lmax // self.page_size)]
                slots = _expand(pages, self.page_size, self._offsets)
                for i, token in enumerate(self.decode_tokens.tolist()):
                    spans.append((slice(token, token + 1), slots[i, : lens[i]], lens[i] - 1))
            for tok_start, length, ctx_slots, ctx_start, _ in self.prefills:
                spans.append((slice(tok_start, tok_start + length), ctx_slots, ctx_start))
            self._spans = spans
        return self._spans

    def _decode(self, q_nope: Tensor, q_rope: Tensor, cache: Tensor, projection: LatentProjection,
                scale: float) -> Tensor:
        q = absorb_query(q_nope, q_rope, projection).to(cache.dtype)  # [D, heads, row_dim]
        if self.decode_kernel:
            rows = cache.unsqueeze(0)  # one kv head: K = V = the rows
            latent = cpu_kernels.paged_decode(q, rows, rows, self.table, self.decode_rows, self.decode_lens,
                                              self.page_size, scale)[..., : projection.rank]
        else:
            context = cache.index_select(0, self.decode_idx.reshape(-1)).view(*self.decode_idx.shape, -1)
            latent = absorbed_attention(q, context, self.decode_bias, scale, projection.rank)
        return absorbed_output(latent, projection).to(q_nope.dtype)


class CompressedGroupAttention:
    """One step's view of a compressed group (`CompressedSpec`, `kv.compressed`): per decode token
    and prefill chunk (in `LatentGroupAttention`'s span order), the slots of its sequence's entries
    0 .. end // rate - 1, built on first use and shared by the group's streams."""

    def __init__(self, inputs: AttentionInputs, table: Tensor, page_size: int, rate: int) -> None:
        self.table = table
        self.page_size = page_size
        self.rate = rate
        self.per_page = entries_per_page(page_size, rate)
        rows_ends: list[tuple[int, int]] = []
        if inputs.num_decode:
            assert inputs.decode_rows is not None and inputs.decode_lens is not None
            rows_ends += zip(inputs.decode_rows.tolist(), inputs.decode_lens.tolist(), strict=True)
        rows_ends += [(row, ctx_start + length) for _, length, row, ctx_start in inputs.prefills]
        self._rows_ends = rows_ends
        self._slots: tuple[Tensor, ...] | None = None

    def slots(self) -> tuple[Tensor, ...]:
        if self._slots is None:
            out: list[Tensor] = []
            ps, r, device = self.page_size, self.rate, self.table.device
            for row, end in self._rows_ends:
                w = torch.arange(end // r, device=device)
                index = ((w + 1) * r - 1) // ps
                out.append(self.table[row].index_select(0, index) * self.per_page + w - index * ps // r)
            self._slots = tuple(out)
        return self._slots


def _expand(pages: Tensor, page_size: int, offsets: Tensor) -> Tensor:
    """[R, P] page ids -> [R, P * page_size] slot ids, in position order."""
    return (pages.unsqueeze(-1) * page_size + offsets).reshape(pages.shape[0], -1)
