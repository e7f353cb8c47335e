"""The cache layout: a model's layers grouped by what they keep (`models.interface` cache specs).

Layers with equal specs form one group (vLLM v1's KV-cache groups). A paged group (full attention,
sliding window, latent attention) has its own page pool, block tables and storage; a recurrent group
has one state slot per running request. Paged groups come first (in the order of their first
layer), then recurrent ones; group 0 is the primary group, whose block table the scheduler reads.

KV dtype (``[engine] kv_dtype``, `KV_DTYPES`): "auto" keeps every row in the model's dtype; "int8"
keeps the K/V rows of full-attention and sliding-window groups as int8 codes with one bfloat16
scale per (layer, kv head, slot) row (`helios.engine.attention.quantize_rows`): a row of head_dim
``d`` takes ``d + 2`` bytes instead of ``2 d`` (bfloat16) or ``4 d`` (float32). Latent rows and
recurrent states stay in the model's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from helios.models.interface import (
    PAGED_SPECS,
    CacheSpec,
    CompressedSpec,
    FullAttentionSpec,
    RecurrentStateSpec,
    RowWindowSpec,
    SlidingWindowSpec,
)

KV_DTYPES = ("auto", "int8")
"""``[engine] kv_dtype``: how a full-attention or sliding-window group keeps its K/V rows."""
KV_SCALE_DTYPE = torch.bfloat16
"""The dtype of an int8 row's scale: bfloat16 (float32's range, 2 bytes). A float32 scale would cost
4 bytes a row: at head_dim 64 the pool would hold 2 * 64 / 68 = 1.88x a bfloat16 pool's tokens, not
the 1.94x of 2 * 64 / 66."""


def step_tokens(prefill_chunk_size: int, max_active: int, max_depth: int) -> int:
    """The most positions one step writes over all requests: the step's token budget (prefill
    chunks share it), or every running request's decode token and drafts."""
    return max(prefill_chunk_size, max_active * (1 + max_depth))


def window_pool_pages(window: int, page_size: int, max_active: int, step_tokens: int) -> int:
    """Pages of a bounded `RowWindowSpec` pool (`kv.coordinator.RowWindowPool`): each running
    request holds at most the pages of its last ``window`` positions and of its step's chunk
    (``(window - 1) // page_size + 3`` pages besides the chunk's own), the step's chunks at most
    ``step_tokens`` positions; as many pages again for the windows of finished requests (their
    prefix-cache pages)."""
    held = max_active * ((window - 1) // page_size + 3) + -(-step_tokens // page_size)
    return held + max_active * -(-window // page_size)


@attrs.frozen
class CacheGroup:
    spec: CacheSpec
    layers: tuple[int, ...]
    """The layer indices that keep this spec, in order."""

    @property
    def paged(self) -> bool:
        return isinstance(self.spec, PAGED_SPECS)

    @property
    def window(self) -> int | None:
        return self.spec.window if isinstance(self.spec, SlidingWindowSpec) else None

    def is_quantized(self, kv_dtype: str) -> bool:
        """Whether this group keeps int8 K/V rows and their scales under ``kv_dtype``."""
        _check_kv_dtype(kv_dtype)
        return kv_dtype == "int8" and isinstance(self.spec, (FullAttentionSpec, SlidingWindowSpec))

    def bytes_per_token(self, dtype: torch.dtype, kv_dtype: str = "auto") -> float:
        """Cache bytes one token takes in this group (0 for a recurrent group): with int8 K/V, one
        byte per element and a `KV_SCALE_DTYPE` scale per K row and per V row of every kv head; a
        compressed group's row over its rate (a fraction of a row per token)."""
        if isinstance(self.spec, CompressedSpec):
            return len(self.layers) * self.spec.row_dim * _element_size(dtype) / self.spec.rate
        if self.is_quantized(kv_dtype):
            spec = self.spec
            assert isinstance(spec, (FullAttentionSpec, SlidingWindowSpec))
            row = spec.head_dim + _element_size(KV_SCALE_DTYPE)
            return len(self.layers) * 2 * spec.num_kv_heads * row
        return len(self.layers) * self.spec.elements_per_token() * _element_size(dtype)

    def num_pages(self, num_pages: int, page_size: int, *, max_active: int = 0, step_tokens: int = 0) -> int:
        """This group's pool, for ``num_pages`` pages of positions: a compressed group's entry pages
        (`kv.compressed.entry_pages`); a row-window group's, with ``step_tokens`` (> 0), a number
        bounded by the running requests (`window_pool_pages`), else ``num_pages``."""
        spec = self.spec
        if isinstance(spec, CompressedSpec):
            return num_pages if spec.rate <= page_size else num_pages * page_size // spec.rate
        if isinstance(spec, RowWindowSpec) and step_tokens > 0:
            return window_pool_pages(spec.window, page_size, max_active, step_tokens)
        return num_pages

    def bytes_per_page(self, page_size: int, dtype: torch.dtype, kv_dtype: str = "auto") -> float:
        """Storage bytes per page of ``page_size`` positions: a compressed group's entry pages
        (`engine.kv.compressed`: ceil(page_size / rate) rows each, one per page of positions while
        the rate is at most the page size, else one in rate / page_size), every other paged group's
        ``page_size`` tokens."""
        spec = self.spec
        if isinstance(spec, CompressedSpec):
            rows = -(-page_size // spec.rate) if spec.rate <= page_size else page_size / spec.rate
            return len(self.layers) * spec.row_dim * _element_size(dtype) * rows
        return self.bytes_per_token(dtype, kv_dtype) * page_size

    def bytes_per_request(self, dtype: torch.dtype) -> int:
        """State bytes one request takes in a recurrent group (0 for a paged one)."""
        spec = self.spec
        if not isinstance(spec, RecurrentStateSpec):
            return 0
        return len(self.layers) * spec.elements_per_request() * _element_size(spec.dtype or dtype)


@attrs.frozen
class CacheLayout:
    groups: tuple[CacheGroup, ...]
    num_layers: int

    @classmethod
    def from_specs(cls, specs: Sequence[CacheSpec]) -> CacheLayout:
        order: dict[CacheSpec, list[int]] = {}
        for i, spec in enumerate(specs):
            order.setdefault(spec, []).append(i)
        groups = [CacheGroup(spec, tuple(layers)) for spec, layers in order.items()]
        paged = [g for g in groups if g.paged]
        if not paged:
            raise ValueError("a model needs at least one layer that keeps rows per token (a paged cache group)")
        return cls(tuple(paged + [g for g in groups if not g.paged]), len(specs))

    @property
    def paged_groups(self) -> tuple[CacheGroup, ...]:
        return tuple(g for g in self.groups if g.paged)

    @property
    def recurrent_groups(self) -> tuple[CacheGroup, ...]:
        return tuple(g for g in self.groups if not g.paged)

    @property
    def is_single_full(self) -> bool:
        """One full-attention group holding every layer (every Llama-family model)."""
        return len(self.groups) == 1 and isinstance(self.groups[0].spec, FullAttentionSpec)

    @property
    def has_partial_tables(self) -> bool:
        """Whether some paged group's tables hold placeholders inside (compressed, row-window groups)."""
        return any(isinstance(g.spec, (CompressedSpec, RowWindowSpec)) for g in self.paged_groups)

    @property
    def has_recurrent(self) -> bool:
        return any(not g.paged for g in self.groups)

    def bytes_per_token(self, dtype: torch.dtype, kv_dtype: str = "auto", *, step_tokens: int = 0) -> float:
        """Paged cache bytes per token over every group (each paged group has as many pages of
        positions; a compressed group a row per ``rate`` tokens); with ``step_tokens``, over the
        groups the running requests do not bound (`bounded`)."""
        bounded = self.bounded(step_tokens)
        return sum(g.bytes_per_token(dtype, kv_dtype) for g in self.groups if g not in bounded)

    def bytes_per_page(self, page_size: int, dtype: torch.dtype, kv_dtype: str = "auto", *,
                       step_tokens: int = 0) -> float:
        """Storage bytes per page of positions over every paged group (`CacheGroup.bytes_per_page`);
        with ``step_tokens``, over those the running requests do not bound (`bounded`)."""
        bounded = self.bounded(step_tokens)
        return sum(g.bytes_per_page(page_size, dtype, kv_dtype) for g in self.paged_groups if g not in bounded)

    def bounded_bytes(self, page_size: int, dtype: torch.dtype, kv_dtype: str = "auto", *, max_active: int,
                      step_tokens: int) -> float:
        """Storage bytes of the pools the running requests bound (their spare pages included)."""
        return sum((g.num_pages(0, page_size, max_active=max_active, step_tokens=step_tokens) + 1)
                   * g.bytes_per_page(page_size, dtype, kv_dtype) for g in self.bounded(step_tokens))

    def bytes_per_request(self, dtype: torch.dtype) -> int:
        return sum(g.bytes_per_request(dtype) for g in self.groups)

    def bounded(self, step_tokens: int) -> tuple[CacheGroup, ...]:
        """The paged groups whose pools the running requests bound (row windows, with ``step_tokens``)."""
        return tuple(g for g in self.paged_groups if isinstance(g.spec, RowWindowSpec) and step_tokens > 0)

    def pages_for(self, memory_bytes: float, page_size: int, dtype: torch.dtype, kv_dtype: str = "auto", *,
                  max_active: int = 0, states: int | None = None, step_tokens: int = 0) -> int:
        """How many pages of positions (of every paged group) a budget of ``memory_bytes`` holds,
        after the recurrent states of ``states`` requests (default ``max_active``) and, with
        ``step_tokens``, the row-window pools of ``max_active`` running requests
        (`window_pool_pages`) (`[engine] kv_memory_gib`)."""
        states = max_active if states is None else states
        budget = memory_bytes - self.bytes_per_request(dtype) * states
        budget -= self.bounded_bytes(page_size, dtype, kv_dtype, max_active=max_active, step_tokens=step_tokens)
        per_page = self.bytes_per_page(page_size, dtype, kv_dtype, step_tokens=step_tokens)
        if per_page == 0:
            raise ValueError("every paged group is bounded by the running requests: no per-page cost to size by")
        return int(max(budget, 0) // per_page)

    def describe(self, dtype: torch.dtype, kv_dtype: str = "auto") -> str:
        """What shapes every page's and state's bytes, for the layout fingerprint. A single
        full-attention group reads as it always has (`layers:kv_heads:head_dim:dtype`), so cached
        records of Llama-family models stay valid; int8 K/V add ``:kv=int8+<scale dtype>``, so their
        pages (chain hashes, host-store records) never mix with another KV dtype's."""
        _check_kv_dtype(kv_dtype)
        kv = "" if kv_dtype == "auto" else f":kv={kv_dtype}+{KV_SCALE_DTYPE}"
        if self.is_single_full:
            spec = self.groups[0].spec
            assert isinstance(spec, FullAttentionSpec)
            return f"{self.num_layers}:{spec.num_kv_heads}:{spec.head_dim}:{dtype}{kv}"
        parts = [f"{type(g.spec).__name__}{attrs.astuple(g.spec)}@{','.join(map(str, g.layers))}"
                 for g in self.groups]
        return f"{self.num_layers}:{';'.join(parts)}:{dtype}{kv}"


def _check_kv_dtype(kv_dtype: str) -> None:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
