"""A compressed group's page pool (`models.interface.CompressedSpec`): one entry row per ``rate``
positions, entry w complete once position (w + 1) * rate - 1 is.

Geometry. Tables stay position-aligned with the coordinator's other groups (one entry per page of
``page_size`` positions, one chain hash per page of positions), but a page of this pool holds
entries, not positions: table index i holds a real page exactly when positions i * page_size ..
(i + 1) * page_size - 1 complete at least one entry (`holds_entry`), and that page's
`entries_per_page` slots (ceil(page_size / rate)) hold the entries those positions complete, in
order. Every other index holds the placeholder ``NULL`` (page id ``num_pages``, never written nor
read). So with rate 128 and pages of 16 positions one index in 8 holds a page of one entry, and
with rate 4 every index holds a page of four entries: the pool keeps ``row_dim / rate`` elements
per position, not ``row_dim``.

Pool size (`entry_pages`): the entry pages ``num_pages`` position pages need, for one table as long
as the pool: all of them for rate <= page_size, else ``num_pages * page_size // rate``. Tables that
share a prefix (prefix-cache hits) and then diverge hold more entry pages per position page than
one table does, so this pool may run out before the position pools; allocation is all or nothing
over the coordinator's groups, so the request then waits or is preempted as in any full pool.

Capacity in position pages (`num_free`): ``free entry pages * rate // page_size`` (rate >
page_size), a sound lower bound of the position pages any table can still grow by (k position
pages complete at most ceil(k * page_size / rate) entries). `can_allocate` and `can_admit` count
entry pages exactly.

Prefix cache: an entry page is registered under its index's chain hash once that position page is
full and computed (its entries are then written: every entry it holds completes inside it). A hit
of h position pages needs the real pages of indices < h registered; placeholders need nothing. The
raw rows a hit ending inside a window needs belong to another group (a sliding-window pool), whose
own rule shortens the hit (`SlidingWindowPool.hit_length`).

`check_integrity`: the base checks over real pages, and that every table holds a real page exactly
at its entry-holding indices.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from helios.engine.kv.manager import KVCacheManager


def entries_per_page(page_size: int, rate: int) -> int:
    """The most entries one page of ``page_size`` positions completes: ceil(page_size / rate)."""
    return -(-page_size // rate)


def entry_pages(num_pages: int, page_size: int, rate: int) -> int:
    """The entry pages ``num_pages`` position pages of one table need (the pool's size)."""
    return num_pages if rate <= page_size else num_pages * page_size // rate


@attrs.define
class CompressedPool(KVCacheManager):
    """One compressed group's pages (see the module docstring). ``num_pages`` counts entry pages."""

    rate: int = 1

    @property
    def null_page(self) -> int:
        """The placeholder page id: the storage's spare page (``num_pages``)."""
        return self.num_pages

    @property
    def slots_per_page(self) -> int:
        return entries_per_page(self.page_size, self.rate)

    def holds_entry(self, index: int) -> bool:
        """Whether positions of page ``index`` complete an entry."""
        ps, r = self.page_size, self.rate
        return (index + 1) * ps // r > index * ps // r

    def holding(self, start: int, end: int) -> int:
        """How many of the indices ``start .. end - 1`` hold an entry page."""
        if end <= start:
            return 0
        if self.rate <= self.page_size:
            return end - start
        return end * self.page_size // self.rate - start * self.page_size // self.rate

    def entry_slot(self, table: Sequence[int], entry: int) -> int:
        """The storage slot of entry ``entry`` of a request whose table is ``table``."""
        ps, r = self.page_size, self.rate
        index = ((entry + 1) * r - 1) // ps
        return table[index] * self.slots_per_page + entry - index * ps // r

    def entry_slots(self, request_id: str, count: int) -> list[int]:
        """The slots of the request's entries 0 .. count - 1."""
        table = self.block_table(request_id)
        return [self.entry_slot(table, w) for w in range(count)]

    # -- capacity --------------------------------------------------------------------------------
    def _available(self) -> int:
        return len(self._free) + len(self._evictable) + len(self._evictable_retained)

    @property
    def num_free(self) -> int:
        """Position pages every table can still grow by (a lower bound; see the module docstring)."""
        free = self._available()
        return free if self.rate <= self.page_size else free * self.rate // self.page_size

    def pages_needed(self, request_id: str, num_tokens: int) -> int:
        """Entry pages the request needs to hold ``num_tokens`` positions in total."""
        return self.holding(len(self.block_table(request_id)), -(-num_tokens // self.page_size))

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.pages_needed(request_id, num_tokens) <= self._available()

    def can_admit(self, num_tokens: int, hits: Sequence[int]) -> bool:
        need = self.holding(len(hits), -(-num_tokens // self.page_size))
        null = self.null_page
        claimed = sum(1 for p in hits if p != null and self.ref_counts[p] == 0)
        return need <= self._available() - claimed

    # -- ownership ---------------------------------------------------------------------------------
    def allocate_slots(self, request_id: str, num_computed: int, num_new_tokens: int,
                       num_lookahead: int = 0) -> list[int] | None:
        """The table's new entries (real pages and placeholders, position-aligned), or None (and
        nothing allocated) when the pool cannot supply them."""
        table = self._tables.setdefault(request_id, [])
        target = -(-(num_computed + num_new_tokens + num_lookahead) // self.page_size)
        if self.holding(len(table), target) > self._available():
            return None
        new: list[int] = []
        for i in range(len(table), target):
            if self.holds_entry(i):
                page = self._take()
                assert self.ref_counts[page] == 0
                self.ref_counts[page] = 1
                new.append(page)
            else:
                new.append(self.null_page)
        table.extend(new)
        return new

    def allocate_cached(self, request_id: str, pages: Sequence[int], hashes: list[int],
                        retain_pages: int = 0) -> None:
        null = self.null_page
        for i, page in enumerate(pages):
            assert (page != null) == self.holds_entry(i), "a hit's placeholders must sit where no entry is"
        real = [p for p in pages if p != null]
        super().allocate_cached(request_id, real, hashes, self.holding(0, min(retain_pages, len(pages))))
        self._tables[request_id][:] = list(pages)
        self._num_registered[request_id] = len(pages)

    def register(self, request_id: str, page: int, block_hash: int, token_ids: Sequence[int] = ()) -> None:
        if page == self.null_page:
            self._num_registered[request_id] = self._num_registered.get(request_id, 0) + 1
            return
        super().register(request_id, page, block_hash, token_ids)

    def _registers(self, page: int) -> bool:
        return page != self.null_page

    # -- the prefix cache --------------------------------------------------------------------------
    def hit_length(self, hashes: Sequence[int], limit: int) -> int:
        """The longest run of at most ``limit`` position pages whose entry pages are registered."""
        n = 0
        while n < limit and (not self.holds_entry(n) or hashes[n] in self._cached):
            n += 1
        return n

    def hit_pages(self, hashes: Sequence[int], length: int) -> list[int]:
        return [self._cached[h] if self.holds_entry(i) else self.null_page for i, h in enumerate(hashes[:length])]

    # -- checks ------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        null = self.null_page
        for table in self._tables.values():
            for i, page in enumerate(table):
                assert (page != null) == self.holds_entry(i), f"index {i} holds {page}: not where its entries are"
        self._check_tables([[p for p in t if p != null] for t in self._tables.values()])
