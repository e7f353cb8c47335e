"""Per-group page pools behind one KV manager API (vLLM v1's hybrid KV-cache coordinator).

A model's layers are grouped by cache spec (`kv.layout`). A model with one full-attention group
(every Llama-family model) uses a plain `KVCacheManager`; any other layout uses a
`KVCacheCoordinator`, which keeps the manager's API (what the scheduler calls: `KVManager`) and
fans every call out to its groups:

- Paged groups. Each has its own pool of ``num_pages`` pages and its own block tables, one entry
  per page of positions in every group (tables stay position-aligned, so one page count and one
  chain hash per position serve every group). Memory is split by bytes per token: every group has
  as many pages, each sized by its own layers' rows (a compressed group fewer, a lazy row-window
  group a number the running requests bound: `CacheGroup.num_pages`). Group 0 is the primary one: its table is what
  `block_table` returns and what the scheduler counts. Allocation is all or nothing over groups;
  `num_free` is the smallest group's, `pages_needed` the largest.
- A sliding-window group (`SlidingWindowPool`). Query position p sees key positions
  p - window + 1 .. p, and no later query is before the request's computed tokens, so once
  ``num_computed`` tokens are computed every page whose last position is below
  ``num_computed - window + 1`` is dead: `release_before` (called from `allocate_slots` and
  `cache_full_pages`, that is whenever the computed tokens move on) takes it out of the table and
  leaves the placeholder `NULL` (page id ``num_pages``, a spare page of the group's storage that is
  never written and only read masked) so positions stay aligned. A dead page that was registered
  becomes evictable (still a prefix-cache page), any other goes back to the free pool.
- A row-window group (`RowWindowPool`, `models.interface.RowWindowSpec`: a layer's own rows, read
  only for the last ``window`` positions) releases pages as a sliding-window group does; lazy (the
  engine passes ``step_tokens``), it also takes no page before a step writes there: its tables get
  `NULL` entries from `allocate_slots` and pages from `materialize` (the scheduler's call for each
  chunk it schedules), so a request holds its window's and its chunk's pages only, and the pool is
  sized for ``max_active`` requests (`layout.window_pool_pages`). It does not count in `num_free`.
- A compressed group (`kv/compressed.py`'s `CompressedPool`, `models.interface.CompressedSpec`):
  one entry row per ``rate`` positions. Its table holds a real page only at the indices whose
  positions complete an entry (the placeholder `NULL` elsewhere), each page the entries of its
  positions, and its pool has `compressed.entry_pages` pages (a rate-th of the positions' when the
  rate is a multiple of the page size). `num_free` counts it in position pages (a lower bound).
- A recurrent group (`StateSlots`): one state slot per running request, taken with its first pages
  (`allocate_cached` / `allocate_slots`) and released by `free` (finish, abort, preemption).

Prefix cache. One hash chain (the same fingerprint in every group) names a page of positions in
every group; each group registers its own page under that hash. `lookup` returns the longest hit
every group can serve: a full or latent group serves any prefix of its registered run; a sliding
group serves a hit of h pages when the pages holding positions h * page_size - window + 1 ..
h * page_size - 1 (the first computed query's window) are registered in it (vLLM's rule; the pages
before them are `NULL` in its table). A compressed group serves any prefix whose entry pages are
registered (its placeholders need nothing). A hit is a list with one tuple per page: (page of group 0,
page of group 1, ...). A layout with a recurrent group hits only where a state snapshot exists
(`kv/checkpoints.py`): the longest prefix every group serves whose last page's chain hash has a
snapshot (``has_snapshot``: the coordinator's `SnapshotPool`, or the host store). Speculative
decoding is off for it (rejected drafts would need a state rollback; `EngineCore` turns it off).

Host store: records are per group. Group g's record of a page with chain hash h is keyed
`group_key(h, g)` (h itself for group 0, so a one-group model's records are unchanged); a host
restore needs every paged group's record of the page (`HostStore` side: `EngineCore`).

`check_integrity` runs every group's check and verifies the alignment of their tables, the state
slots (one per request holding pages, none twice, none lost) and the snapshot rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs

from helios.engine.kv.checkpoints import SnapshotPool
from helios.engine.kv.compressed import CompressedPool
from helios.engine.kv.layout import CacheLayout
from helios.engine.kv.manager import ImageKey, KVCacheManager
from helios.models.interface import CompressedSpec, RowWindowSpec


class KVManager(Protocol):
    """What the scheduler and the runner use of a KV manager (`KVCacheManager` or
    `KVCacheCoordinator`). ``hits`` are what `lookup` returned."""

    num_pages: int
    page_size: int
    enable_caching: bool

    @property
    def num_free(self) -> int: ...
    @property
    def num_cached(self) -> int: ...
    def block_table(self, request_id: str) -> list[int]: ...
    def pages_needed(self, request_id: str, num_tokens: int) -> int: ...
    def can_allocate(self, request_id: str, num_tokens: int) -> bool: ...
    def can_admit(self, num_tokens: int, hits: Sequence[Any]) -> bool: ...
    def lookup(self, token_ids: Sequence[int], hashes: list[int] | None = None,
               images: Sequence[ImageKey] = ()) -> tuple[list[Any], list[int]]: ...
    def allocate_cached(self, request_id: str, pages: Sequence[Any], hashes: list[int],
                        retain_pages: int = 0) -> None: ...
    def register(self, request_id: str, page: int, block_hash: int, token_ids: Sequence[int] = ()) -> None: ...
    def cache_full_pages(self, request_id: str, token_ids: Sequence[int], num_computed: int,
                         retain_pages: int = 0, images: Sequence[ImageKey] = ()) -> None: ...
    def allocate_slots(self, request_id: str, num_computed: int, num_new_tokens: int,
                       num_lookahead: int = 0) -> list[int] | None: ...
    def trim(self, request_id: str, num_tokens: int) -> int: ...
    def materialize(self, request_id: str, start: int, end: int) -> bool: ...
    def free(self, request_id: str) -> None: ...
    def check_integrity(self) -> None: ...


def group_key(block_hash: int, group: int) -> int:
    """The host-store key of group ``group``'s record of the page with chain hash ``block_hash``."""
    if group == 0:
        return block_hash
    digest = hashlib.blake2b(block_hash.to_bytes(16, "big") + b"group" + group.to_bytes(4, "big"), digest_size=16)
    return int.from_bytes(digest.digest(), "big")


@attrs.define
class SlidingWindowPool(KVCacheManager):
    """One sliding-window group's pages: a `KVCacheManager` whose tables lose their dead leading
    pages to the `NULL` placeholder (see the module docstring)."""

    window: int = 1
    # request -> how many of its table's first entries are NULL (they are never revisited)
    _num_released: dict[str, int] = attrs.field(init=False, factory=dict)

    @property
    def null_page(self) -> int:
        """The placeholder page id: the storage's spare page (``num_pages``)."""
        return self.num_pages

    def first_needed(self, num_computed: int) -> int:
        """The first table index a request with ``num_computed`` computed tokens still reads."""
        return max(0, num_computed - self.window + 1) // self.page_size

    def release_before(self, request_id: str, num_computed: int) -> int:
        """Take the request's pages that no query at or after ``num_computed`` sees out of its table
        (placeholders stay). Returns the pages released."""
        table = self._tables.get(request_id)
        if not table:
            return 0
        start = self._num_released.get(request_id, 0)
        end = min(self.first_needed(num_computed), len(table))
        if end <= start:
            return 0
        null = self.null_page
        released = 0
        for i in range(start, end):
            page = table[i]
            if page == null:
                continue
            table[i] = null
            self._drop(page)
            released += 1
        self._num_released[request_id] = end
        return released

    def can_admit(self, num_tokens: int, hits: Sequence[int]) -> bool:
        need = max(0, -(-num_tokens // self.page_size) - len(hits))
        null = self.null_page
        claimed = sum(1 for p in hits if p != null and self.ref_counts[p] == 0)
        return need <= self.num_free - claimed

    def allocate_cached(self, request_id: str, pages: Sequence[int], hashes: list[int],
                        retain_pages: int = 0) -> None:
        null = self.null_page
        real = [p for p in pages if p != null]
        leading = len(pages) - len(real)
        assert all(p == null for p in pages[:leading]), "placeholders lead a sliding-window hit"
        super().allocate_cached(request_id, real, hashes, max(0, retain_pages - leading))
        self._tables[request_id][:0] = [null] * leading
        self._num_registered[request_id] = len(pages)
        self._num_released[request_id] = leading

    def _registers(self, page: int) -> bool:
        return page != self.null_page  # a released position holds no page to register

    def free(self, request_id: str) -> None:
        self._num_released.pop(request_id, None)
        super().free(request_id)

    def hit_length(self, hashes: Sequence[int], limit: int) -> int:
        """The longest hit of at most ``limit`` pages this group can serve: h pages such that the
        pages of the first computed query's window (`first_needed(h * page_size)` .. h - 1) are
        registered here."""
        h = limit
        while h > 0:
            first = self.first_needed(h * self.page_size)
            missing = next((i for i in range(h - 1, first - 1, -1) if hashes[i] not in self._cached), None)
            if missing is None:
                return h
            h = missing  # any hit that ends past a missing page needs it
        return 0

    def hit_pages(self, hashes: Sequence[int], length: int) -> list[int]:
        first = self.first_needed(length * self.page_size)
        return [self.null_page] * first + [self._cached[h] for h in hashes[first:length]]

    def num_held(self) -> int:
        """Pages some table holds."""
        return sum(1 for c in self.ref_counts if c)

    def check_integrity(self) -> None:
        null = self.null_page
        for rid, table in self._tables.items():
            leading = self._num_released.get(rid, 0)
            assert all(p == null for p in table[:leading]), "a released entry holds a page"
            assert null not in table[leading:], "a placeholder after the released entries"
        self._check_tables([[p for p in t if p != null] for t in self._tables.values()])


@attrs.define
class RowWindowPool(SlidingWindowPool):
    """A row-window group's pages (`models.interface.RowWindowSpec`): a `SlidingWindowPool` that,
    ``lazy``, also takes no page for a position before a step writes it. `allocate_slots` extends
    the table with placeholders (`NULL`) and `materialize` gives the positions a scheduled chunk
    writes their pages, so a request holds only its window's pages and its chunk's: its table is
    ``NULL`` (released), then real pages, then ``NULL`` (not yet written). The pool is sized for
    ``max_active`` such requests (`layout.window_pool_pages`), so `materialize` does not fail within
    that bound; `take_changed` tells the runner where a table changed other than at its end."""

    lazy: bool = False
    _changed: dict[str, int] = attrs.field(init=False, factory=dict)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return True if self.lazy else super().can_allocate(request_id, num_tokens)

    def can_admit(self, num_tokens: int, hits: Sequence[int]) -> bool:
        return True if self.lazy else super().can_admit(num_tokens, hits)

    def allocate_slots(self, request_id: str, num_computed: int, num_new_tokens: int,
                       num_lookahead: int = 0) -> list[int] | None:
        if not self.lazy:
            return super().allocate_slots(request_id, num_computed, num_new_tokens, num_lookahead)
        table = self._tables.setdefault(request_id, [])
        n = self.pages_needed(request_id, num_computed + num_new_tokens + num_lookahead)
        new = [self.null_page] * n
        table.extend(new)
        return new

    def materialize(self, request_id: str, start: int, end: int) -> bool:
        """Pages for positions ``start .. end - 1`` where the table holds placeholders after its
        released entries (a lazy pool); False (nothing taken) when the pool has too few."""
        table = self._tables.get(request_id)
        if not self.lazy or not table or end <= start:
            return True
        self.release_before(request_id, start)  # positions before start are computed
        lo = max(start // self.page_size, self._num_released.get(request_id, 0))
        hi = min(-(-end // self.page_size), len(table))
        todo = [i for i in range(lo, hi) if table[i] == self.null_page]
        if len(todo) > self.num_free:
            return False
        for i in todo:
            page = self._take()
            assert self.ref_counts[page] == 0
            self.ref_counts[page] = 1
            table[i] = page
        if todo:
            self._changed[request_id] = min(self._changed.get(request_id, todo[0]), todo[0])
        return True

    def take_changed(self, request_id: str) -> int | None:
        """The first table index `materialize` filled since the last call (None: none)."""
        return self._changed.pop(request_id, None)

    def free(self, request_id: str) -> None:
        self._changed.pop(request_id, None)
        super().free(request_id)

    def num_held(self) -> int:
        return sum(1 for c in self.ref_counts if c)

    def check_integrity(self) -> None:
        null = self.null_page
        for rid, table in self._tables.items():
            leading = self._num_released.get(rid, 0)
            assert all(p == null for p in table[:leading]), "a released entry holds a page"
            real = [i for i in range(leading, len(table)) if table[i] != null]
            assert real == list(range(leading, leading + len(real))), "a placeholder between a table's pages"
        self._check_tables([[p for p in t if p != null] for t in self._tables.values()])


@attrs.define
class StateSlots:
    """A recurrent group's state slots: one per running request."""

    num_slots: int
    _free: list[int] = attrs.field(init=False)
    _slot_of: dict[str, int] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        self._free = list(range(self.num_slots - 1, -1, -1))  # pop() hands out the lowest

    @property
    def num_free(self) -> int:
        return len(self._free)

    def slot(self, request_id: str) -> int:
        return self._slot_of[request_id]

    def has(self, request_id: str) -> bool:
        return request_id in self._slot_of

    def take(self, request_id: str) -> None:
        if request_id not in self._slot_of:
            self._slot_of[request_id] = self._free.pop()

    def release(self, request_id: str) -> None:
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def check_integrity(self, holders: set[str]) -> None:
        assert set(self._slot_of) == holders, "state slots and block tables disagree on who runs"
        slots = list(self._slot_of.values())
        assert len(set(slots)) == len(slots), "a state slot is held twice"
        assert not set(slots) & set(self._free), "a state slot is both held and free"
        assert len(slots) + len(self._free) == self.num_slots, "state slots leaked"


class KVCacheCoordinator:
    """The KV manager of a layout with several groups (see the module docstring)."""

    def __init__(self, layout: CacheLayout, num_pages: int, page_size: int, *, enable_caching: bool = False,
                 fingerprint: bytes = b"", num_state_slots: int = 0, num_snapshots: int = 0,
                 on_evict: Callable[[int, int, int], None] | None = None, max_active: int = 0,
                 step_tokens: int = 0) -> None:
        """``on_evict(group, block hash, page)``: called before a group's cached page is reused.
        ``num_state_slots``: state slots of each recurrent group (at least the running requests);
        ``num_snapshots``: snapshot rows of a recurrent layout's prefix cache. ``step_tokens`` (> 0:
        the most positions a step writes, `layout.step_tokens`) with ``max_active`` (the most
        running requests): row-window pools are lazy and sized for them (`RowWindowPool`)."""
        self.layout = layout
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_caching = enable_caching
        self.groups: list[KVCacheManager] = []
        self.sliding: list[SlidingWindowPool] = []
        for g, group in enumerate(layout.paged_groups):
            evict = None if on_evict is None else _group_evict(on_evict, g)
            window = group.window
            pool: KVCacheManager
            size = group.num_pages(num_pages, page_size, max_active=max_active, step_tokens=step_tokens)
            if isinstance(group.spec, CompressedSpec):
                pool = CompressedPool(size, page_size, enable_caching=self.enable_caching, fingerprint=fingerprint,
                                      on_evict=evict, rate=group.spec.rate)
            elif isinstance(group.spec, RowWindowSpec):
                pool = RowWindowPool(size, page_size, enable_caching=self.enable_caching, fingerprint=fingerprint,
                                     on_evict=evict, window=group.spec.window, lazy=step_tokens > 0)
                self.sliding.append(pool)
            elif window is None:
                pool = KVCacheManager(num_pages, page_size, enable_caching=self.enable_caching,
                                      fingerprint=fingerprint, on_evict=evict)
            else:
                pool = SlidingWindowPool(num_pages, page_size, enable_caching=self.enable_caching,
                                         fingerprint=fingerprint, on_evict=evict, window=window)
                self.sliding.append(pool)
            self.groups.append(pool)
        self.primary = self.groups[0]
        self.states: StateSlots | None = StateSlots(num_state_slots) if layout.has_recurrent else None
        self.snapshots: SnapshotPool | None = (
            SnapshotPool(num_snapshots) if layout.has_recurrent and enable_caching else None)
        self.has_snapshot: Callable[[int], bool] = self.snapshots.has if self.snapshots is not None else _never
        """Whether a state snapshot of the boundary of a chain hash can be restored (`EngineCore`
        widens it to the host store)."""
        self.host_has_page: Callable[[int], bool] = _never
        """Whether the host store holds every paged group's record of a page (`EngineCore`)."""
        self.last_new: list[tuple[int, ...]] = []
        """Every group's pages of the last `allocate_slots` (group 0's first): a host-store restore
        fills them all."""

    # -- reading ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """The smallest group's free pages of positions (a lazy row-window pool, sized for the
        running requests, does not count)."""
        return min(g.num_free for g in self.groups if not (isinstance(g, RowWindowPool) and g.lazy))

    @property
    def num_cached(self) -> int:
        return self.primary.num_cached

    def block_table(self, request_id: str) -> list[int]:
        return self.primary.block_table(request_id)

    def tables(self, request_id: str) -> list[list[int]]:
        """The request's table in every paged group (position-aligned)."""
        return [g.block_table(request_id) for g in self.groups]

    def state_slot(self, request_id: str) -> int:
        assert self.states is not None
        return self.states.slot(request_id)

    def pages_needed(self, request_id: str, num_tokens: int) -> int:
        return max(g.pages_needed(request_id, num_tokens) for g in self.groups)

    def _slot_ok(self, request_id: str | None) -> bool:
        states = self.states
        return states is None or (request_id is not None and states.has(request_id)) or states.num_free > 0

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self._slot_ok(request_id) and all(g.can_allocate(request_id, num_tokens) for g in self.groups)

    def can_admit(self, num_tokens: int, hits: Sequence[tuple[int, ...]]) -> bool:
        return self._slot_ok(None) and all(
            g.can_admit(num_tokens, [h[i] for h in hits]) for i, g in enumerate(self.groups))

    # -- the prefix cache --------------------------------------------------------------------------
    def chain(self, token_ids: Sequence[int], num_pages: int, parent: int | None = None,
              start_page: int = 0, images: Sequence[ImageKey] = ()) -> list[int]:
        return self.primary.chain(token_ids, num_pages, parent, start_page, images)

    def lookup(self, token_ids: Sequence[int], hashes: list[int] | None = None,
               images: Sequence[ImageKey] = ()) -> tuple[list[tuple[int, ...]], list[int]]:
        """The longest prefix every group can serve (see the module docstring), one tuple of
        pages per hit page."""
        hashes = [] if hashes is None else hashes
        if not self.enable_caching:
            return [], hashes
        limit = (len(token_ids) - 1) // self.page_size
        self.primary.extend_chain(token_ids, hashes, limit, images)
        h = limit
        for g in self.groups:
            if isinstance(g, CompressedPool):
                h = g.hit_length(hashes, h)
            elif not isinstance(g, SlidingWindowPool):
                cached = g._cached
                n = 0
                while n < h and hashes[n] in cached:
                    n += 1
                h = n
        changed = True
        while changed and h:
            changed = False
            for s in self.sliding:
                n = s.hit_length(hashes, h)
                if n < h:
                    h, changed = n, True
        if self.snapshots is not None:
            h = self._checkpointed(hashes, h, limit)
        if not h:
            return [], hashes
        columns = [g.hit_pages(hashes, h) if isinstance(g, (SlidingWindowPool, CompressedPool))
                   else [g._cached[x] for x in hashes[:h]] for g in self.groups]
        return list(zip(*columns, strict=True)), hashes

    def _checkpointed(self, hashes: Sequence[int], h: int, limit: int) -> int:
        """The pages of an ``h``-page hit (one every group serves) a recurrent layout may use: all
        of them when the host store continues them up to a snapshot (the scheduler restores that
        far), else the longest prefix that ends at a snapshot and that every sliding group serves
        (0: none)."""
        end = h
        while end < limit and self.host_has_page(hashes[end]):
            end += 1
        for k in range(end, 0, -1):
            if not self.has_snapshot(hashes[k - 1]):
                continue
            if k >= h:
                return h
            if all(s.hit_length(hashes, k) == k for s in self.sliding):
                return k
        return 0

    def allocate_cached(self, request_id: str, pages: Sequence[tuple[int, ...]], hashes: list[int],
                        retain_pages: int = 0) -> None:
        for i, g in enumerate(self.groups):
            g.allocate_cached(request_id, [p[i] for p in pages], hashes, retain_pages)
        if self.states is not None:
            self.states.take(request_id)

    def register(self, request_id: str, page: int, block_hash: int, token_ids: Sequence[int] = ()) -> None:
        """Register the request's last page in every group (restored from the host store)."""
        assert self.primary.block_table(request_id)[-1] == page
        for g in self.groups:
            g.register(request_id, g.block_table(request_id)[-1], block_hash, token_ids)

    def cache_full_pages(self, request_id: str, token_ids: Sequence[int], num_computed: int,
                         retain_pages: int = 0, images: Sequence[ImageKey] = ()) -> None:
        for g in self.groups:
            g.cache_full_pages(request_id, token_ids, num_computed, retain_pages, images)
        for s in self.sliding:
            s.release_before(request_id, num_computed)

    # -- changing ownership ------------------------------------------------------------------------
    def allocate_slots(self, request_id: str, num_computed: int, num_new_tokens: int,
                       num_lookahead: int = 0) -> list[int] | None:
        for s in self.sliding:
            s.release_before(request_id, num_computed)
        total = num_computed + num_new_tokens + num_lookahead
        if not self.can_allocate(request_id, total):
            return None
        new = [g.allocate_slots(request_id, num_computed, num_new_tokens, num_lookahead) for g in self.groups]
        if self.states is not None:
            self.states.take(request_id)
        columns = [n or [] for n in new]
        self.last_new = list(zip(*columns, strict=True))
        return columns[0]

    def materialize(self, request_id: str, start: int, end: int) -> bool:
        """Pages for the positions ``start .. end - 1`` a scheduled chunk writes, in the lazy
        row-window pools (`RowWindowPool.materialize`); False when one has too few."""
        return all(s.materialize(request_id, start, end) for s in self.sliding if isinstance(s, RowWindowPool))

    def take_changed(self, request_id: str) -> int | None:
        """The first table index some group changed other than at the table's end since the last
        call (`RowWindowPool.take_changed`), for the runner's block tables; None: none."""
        changed = [c for s in self.sliding if isinstance(s, RowWindowPool)
                   if (c := s.take_changed(request_id)) is not None]
        return min(changed, default=None)

    def trim(self, request_id: str, num_tokens: int) -> int:
        return max(g.trim(request_id, num_tokens) for g in self.groups)

    def free(self, request_id: str) -> None:
        for g in self.groups:
            g.free(request_id)
        if self.states is not None:
            self.states.release(request_id)

    # -- checks ------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        for g in self.groups:
            g.check_integrity()
        holders = set(self.primary._tables)
        for g in self.groups[1:]:
            assert set(g._tables) == holders, "groups disagree on which requests hold pages"
            for rid in holders:
                assert len(g.block_table(rid)) == len(self.primary.block_table(rid)), "tables are not aligned"
        if self.states is not None:
            self.states.check_integrity(holders)
        if self.snapshots is not None:
            self.snapshots.check_integrity(holders)


def _group_evict(on_evict: Callable[[int, int, int], None], group: int) -> Callable[[int, int], None]:
    return lambda block_hash, page: on_evict(group, block_hash, page)


def _never(block_hash: int) -> bool:
    return False
