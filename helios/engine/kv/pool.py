"""Paged KV storage: a pool of fixed-size pages and the block tables that map sequences onto them.

Ownership: PagePool owns which pages are free; each sequence's block table (a list of page ids) is
owned by the scheduler's Sequence record and only changed through `allocate_for`/`free`. The KV
tensors themselves live in KVCache, indexed by slot = page_id * page_size + offset.
"""

from __future__ import annotations

import attrs
import torch


@attrs.define
class PagePool:
    num_pages: int
    page_size: int
    _free: list[int] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        # Pop from the end: low page ids are handed out first, which keeps tests' page ids exact.
        self._free = list(range(self.num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_needed(self, block_table: list[int], num_tokens: int) -> int:
        """Extra pages a table needs to hold num_tokens tokens in total."""
        need = -(-num_tokens // self.page_size)
        return max(0, need - len(block_table))

    def can_allocate(self, block_table: list[int], num_tokens: int) -> bool:
        return self.pages_needed(block_table, num_tokens) <= len(self._free)

    def allocate_for(self, block_table: list[int], num_tokens: int) -> None:
        n = self.pages_needed(block_table, num_tokens)
        if n > len(self._free):
            raise RuntimeError("page pool exhausted; call can_allocate first")
        for _ in range(n):
            block_table.append(self._free.pop())

    def free(self, block_table: list[int]) -> None:
        self._free.extend(reversed(block_table))
        block_table.clear()

    def check_integrity(self, tables: list[list[int]]) -> None:
        used = [p for t in tables for p in t]
        assert len(used) == len(set(used)), "a page is owned twice"
        assert not set(used) & set(self._free), "a page is both owned and free"
        assert len(used) + len(self._free) == self.num_pages, "pages leaked"


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
