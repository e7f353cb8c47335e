"""The KV cache manager: which pages each request holds, with reference counts.

Ownership rules (vLLM v1's KV-manager split):

- The manager alone changes page ownership. A request's block table (its page ids in position
  order) is keyed by request id and only changes through `allocate_slots` and `free`; the
  scheduler and the runner read it.
- A page's reference count is the number of block tables holding it. Pages are free exactly when
  their count is zero; `free` drops the request's references and returns pages that reach zero to
  the free list (most recently freed last, so low ids are handed out first on a fresh pool).
- A page may be held by several tables by design, through `share` (a prefix shared with another
  request: the future prefix cache). Only the last page of a table is ever written, and `share`
  takes only full pages, so a shared page is never written again.
- Each page carries a `block_hash` slot for the prefix cache's hash chain (hash of the parent's
  hash and the page's token ids); it is cleared when the page returns to the free list. Nothing
  fills it yet.

`check_integrity` verifies all of this: counts equal the number of tables holding each page,
free pages have count zero and are listed once, and no page is lost.
"""

from __future__ import annotations

import collections

import attrs


@attrs.define
class KVCacheManager:
    num_pages: int
    page_size: int
    ref_counts: list[int] = attrs.field(init=False)
    block_hash: list[int | None] = attrs.field(init=False)
    _free: collections.deque[int] = attrs.field(init=False)
    _tables: dict[str, list[int]] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        self.ref_counts = [0] * self.num_pages
        self.block_hash = [None] * self.num_pages
        self._free = collections.deque(range(self.num_pages))

    # -- reading ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def block_table(self, request_id: str) -> list[int]:
        """The request's pages in position order (empty when it holds none). Do not mutate."""
        return self._tables.get(request_id, _EMPTY)

    def pages_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra pages the request needs to hold `num_tokens` tokens in total."""
        need = -(-num_tokens // self.page_size)
        return max(0, need - len(self.block_table(request_id)))

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.pages_needed(request_id, num_tokens) <= len(self._free)

    # -- changing ownership ------------------------------------------------------------------------
    def allocate_slots(self, request_id: str, num_computed: int, num_new_tokens: int,
                       num_lookahead: int = 0) -> list[int] | None:
        """Pages for `num_computed + num_new_tokens + num_lookahead` tokens in total.

        Returns the newly allocated page ids, or None (and allocates nothing) when the pool cannot
        supply them. `num_lookahead` reserves room for tokens proposed but not yet verified
        (speculative decoding)."""
        total = num_computed + num_new_tokens + num_lookahead
        n = self.pages_needed(request_id, total)
        if n > len(self._free):
            return None
        new = [self._free.popleft() for _ in range(n)]
        for page in new:
            assert self.ref_counts[page] == 0
            self.ref_counts[page] = 1
        self._tables.setdefault(request_id, []).extend(new)
        return new

    def share(self, request_id: str, pages: list[int]) -> None:
        """Start `request_id`'s (empty) table with pages another table holds (a shared prefix)."""
        table = self._tables.setdefault(request_id, [])
        if table:
            raise ValueError("a shared prefix must start an empty block table")
        for page in pages:
            if self.ref_counts[page] <= 0:
                raise ValueError(f"page {page} is free; only held pages can be shared")
            self.ref_counts[page] += 1
        table.extend(pages)

    def free(self, request_id: str) -> None:
        """Drop every reference the request holds (idempotent)."""
        table = self._tables.pop(request_id, None)
        if not table:
            return
        # Reverse order: a request's first pages go back last, so the next allocation reuses
        # its newest pages first (and page ids in tests stay exact).
        for page in reversed(table):
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                self.block_hash[page] = None
                self._free.appendleft(page)

    # -- checks ------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        held = collections.Counter(p for table in self._tables.values() for p in table)
        for page in range(self.num_pages):
            assert self.ref_counts[page] == held[page], f"page {page}: count {self.ref_counts[page]} != {held[page]}"
        free = list(self._free)
        assert len(free) == len(set(free)), "a page is free twice"
        assert all(self.ref_counts[p] == 0 for p in free), "a page is both held and free"
        assert len(free) + len(held) == self.num_pages, "pages leaked"
        for table in self._tables.values():
            assert len(table) == len(set(table)), "a table holds a page twice"


_EMPTY: list[int] = []
