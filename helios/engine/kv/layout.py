"""The cache layout: a model's layers grouped by what they keep (`models.interface` cache specs).

Layers with equal specs form one group (vLLM v1's KV-cache groups). A paged group (full attention,
sliding window, latent attention) has its own page pool, block tables and storage; a recurrent group
has one state slot per running request. Paged groups come first (in the order of their first
layer), then recurrent ones; group 0 is the primary group, whose block table the scheduler reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from helios.models.interface import (
    PAGED_SPECS,
    CacheSpec,
    FullAttentionSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
)


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

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Cache bytes one token takes in this group (0 for a recurrent group)."""
        return len(self.layers) * self.spec.elements_per_token() * _element_size(dtype)

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
    def has_recurrent(self) -> bool:
        return any(not g.paged for g in self.groups)

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Paged cache bytes per token over every group (each paged group has as many pages)."""
        return sum(g.bytes_per_token(dtype) for g in self.groups)

    def bytes_per_request(self, dtype: torch.dtype) -> int:
        return sum(g.bytes_per_request(dtype) for g in self.groups)

    def describe(self, dtype: torch.dtype) -> str:
        """What shapes every page's and state's bytes, for the layout fingerprint. A single
        full-attention group reads as it always has (`layers:kv_heads:head_dim:dtype`), so cached
        records of Llama-family models stay valid."""
        if self.is_single_full:
            spec = self.groups[0].spec
            assert isinstance(spec, FullAttentionSpec)
            return f"{self.num_layers}:{spec.num_kv_heads}:{spec.head_dim}:{dtype}"
        parts = [f"{type(g.spec).__name__}{attrs.astuple(g.spec)}@{','.join(map(str, g.layers))}"
                 for g in self.groups]
        return f"{self.num_layers}:{';'.join(parts)}:{dtype}"


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
