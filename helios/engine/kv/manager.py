"""The KV cache manager: which pages each request holds, with reference counts, and the prefix cache.

One page pool: a model whose layers all keep full attention uses one `KVCacheManager`; other
layouts use one per paged cache group behind `kv/coordinator.py`'s `KVCacheCoordinator`.

Ownership rules (vLLM v1's KV-manager split):

- The manager alone changes page ownership. A request's block table (its page ids in position
  order) is keyed by request id and only changes through `allocate_cached`, `allocate_slots`,
  `trim` (speculative rollback of lookahead pages at its end) and `free`; the scheduler and the
  runner read it.
- A page's reference count is the number of block tables holding it. Every page is in exactly one
  of three states: held (count > 0), free (count 0, no content worth keeping), or evictable
  (count 0, a cached full page kept for reuse, least recently used first).
- Prefix cache (`enable_caching`). A full page whose tokens' K/V are computed is identified by a
  hash chain: blake2b-128 of (the parent page's hash, the model fingerprint, the page's token ids,
  and the identity and span of every image whose placeholder span overlaps the page: `ImageKey`).
  The same tokens with another image (or the same image under other processing settings) never
  hit; a page no image overlaps hashes exactly as in a text-only prompt.
  `cache_full_pages` registers a request's newly full pages; the first page registered under a
  hash is the one found (a later page with the same content stays unregistered). `lookup` finds the
  longest chain of registered pages for a prompt, never its whole prompt (at least one token is
  computed, for the logits); `allocate_cached` starts an empty table with them (an evictable page
  becomes held again).
- Shared pages are never written: a table only gains pages at its end, hits are full pages, and
  the runner writes K/V only at positions past a request's computed tokens, which lie in pages after
  every cached one.
- Eviction: `allocate_slots` takes free pages first, then the least recently used evictable page;
  an evicted page's hash is unregistered, and `on_evict(hash, page)` (the host store's copy-out)
  runs before the page is reused. `free` makes a request's registered pages evictable, its last
  pages first in line, so a chain's shared head outlives its tail. Retained pages (those before a
  client's prefix-checkpoint marker, `cache_full_pages(retain_pages=...)`) are evicted only when no
  other evictable page is left.

`check_integrity` verifies all of this: counts equal the number of tables holding each page, every
page is in exactly one state, and every registered hash names a page holding that hash.
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from collections.abc import Callable, Sequence

import attrs

from helios.engine.kv.events import BlockRemoved, BlockStored, KVEvent

ROOT_HASH = b"\x00" * 16

ImageKey = tuple[int, int, bytes]
"""(first position, end position, identity) of one image's placeholder span in a prompt: part of
the chain hash of every page the span overlaps (`engine.records.ImageInput`)."""


def chain_hashes(token_ids: Sequence[int], num_pages: int, *, page_size: int, fingerprint: bytes,
                 parent: int | None = None, start_page: int = 0, images: Sequence[ImageKey] = ()) -> list[int]:
    """The prefix cache's chain hashes of full pages `start_page .. start_page + num_pages` of
    `token_ids`, chained from `parent` (the hash of page `start_page - 1`; None at the root): each is
    blake2b-128 of the parent hash, `fingerprint` (the model and KV layout), the page's token ids
    and, for a page that an image's span in `images` overlaps, that image's span and identity. The
    one implementation: the manager registers and looks pages up with it, and the data-parallel
    router (`engine/dp.py`) scores ranks with it."""
    out: list[int] = []
    prev = ROOT_HASH if parent is None else parent.to_bytes(16, "big")
    ps = page_size
    for i in range(start_page, start_page + num_pages):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(fingerprint)
        h.update(array("q", token_ids[i * ps:(i + 1) * ps]).tobytes())
        for start, end, identity in images:
            if start < (i + 1) * ps and end > i * ps:
                h.update(b"image" + array("q", (start, end, len(identity))).tobytes() + identity)
        prev = h.digest()
        out.append(int.from_bytes(prev, "big"))
    return out


@attrs.define
class KVCacheManager:
    num_pages: int
    page_size: int
    enable_caching: bool = False
    fingerprint: bytes = b""
    """Extra key of every chain hash: the model and KV layout (image identities are per page: `ImageKey`)."""
    on_evict: Callable[[int, int], None] | None = None
    """Called with (block hash, page) before a cached page is reused (the host store copies it out)."""
    events: list[KVEvent] | None = None
    """While a list: every registration (`BlockStored`, one per run of pages registered together)
    and every unregistration (`BlockRemoved`) is appended to it (`kv/events.py`); the engine takes
    them after each step. None: nobody listens and nothing is collected."""
    medium: str = "CPU"
    """The pool's device kind, as the events name it."""
    ref_counts: list[int] = attrs.field(init=False)
    block_hash: list[int | None] = attrs.field(init=False)
    _free: collections.deque[int] = attrs.field(init=False)
    _evictable: collections.OrderedDict[int, None] = attrs.field(init=False, factory=collections.OrderedDict)
    _evictable_retained: collections.OrderedDict[int, None] = attrs.field(init=False,
                                                                         factory=collections.OrderedDict)
    _retained: set[int] = attrs.field(init=False, factory=set)  # cached pages a marker asked to keep
    _cached: dict[int, int] = attrs.field(init=False, factory=dict)  # block hash -> page
    _tables: dict[str, list[int]] = attrs.field(init=False, factory=dict)
    # request -> the chain hashes of its pages (computed once, the scheduler's list when it passes
    # one), and how many of its first pages are registered or known to be
    _hashes: dict[str, list[int]] = attrs.field(init=False, factory=dict)
    _num_registered: dict[str, int] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        self.ref_counts = [0] * self.num_pages
        self.block_hash = [None] * self.num_pages
        self._free = collections.deque(range(self.num_pages))

    # -- reading ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages an allocation may take: free ones and evictable cached ones."""
        return len(self._free) + len(self._evictable) + len(self._evictable_retained)

    @property
    def num_cached(self) -> int:
        """Registered full pages (held or evictable): the cache's content."""
        return len(self._cached)

    def block_table(self, request_id: str) -> list[int]:
        """The request's pages in position order (empty when it holds none). Do not mutate."""
        return self._tables.get(request_id, _EMPTY)

    def pages_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra pages the request needs to hold `num_tokens` tokens in total."""
        need = -(-num_tokens // self.page_size)
        return max(0, need - len(self.block_table(request_id)))

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.pages_needed(request_id, num_tokens) <= self.num_free

    def can_admit(self, num_tokens: int, hits: Sequence[int]) -> bool:
        """Whether a new request holding the cached pages `hits` can then grow to `num_tokens`:
        evictable hits leave the pool when claimed, so they count against it."""
        need = max(0, -(-num_tokens // self.page_size) - len(hits))
        claimed = sum(1 for p in hits if self.ref_counts[p] == 0)
        return need <= self.num_free - claimed

    # -- the prefix cache --------------------------------------------------------------------------
    def chain(self, token_ids: Sequence[int], num_pages: int, parent: int | None = None,
              start_page: int = 0, images: Sequence[ImageKey] = ()) -> list[int]:
        """Hashes of full pages `start_page .. start_page + num_pages` of `token_ids`, chained from
        `parent` (the hash of page `start_page - 1`; None at the root). A page that an image's span
        in `images` overlaps hashes that image's span and identity after its tokens."""
        return chain_hashes(token_ids, num_pages, page_size=self.page_size, fingerprint=self.fingerprint,
                            parent=parent, start_page=start_page, images=images)

    def extend_chain(self, token_ids: Sequence[int], hashes: list[int], num_pages: int,
                     images: Sequence[ImageKey] = ()) -> None:
        """Extend `hashes` (the chain of `token_ids`' pages so far) in place to `num_pages` pages;
        what is already there is never hashed again."""
        if num_pages > len(hashes):
            hashes.extend(self.chain(token_ids, num_pages - len(hashes), hashes[-1] if hashes else None,
                                     len(hashes), images))

    def lookup(self, token_ids: Sequence[int], hashes: list[int] | None = None,
               images: Sequence[ImageKey] = ()) -> tuple[list[int], list[int]]:
        """The longest chain of registered pages that starts `token_ids`, leaving at least its last
        token to compute: (the pages, the prompt's chain hashes). `hashes`, when given, is the chain
        computed so far (a waiting request's): it is extended in place, not recomputed. `images`:
        the prompt's image spans and identities (the same on every call for one request)."""
        hashes = [] if hashes is None else hashes
        if not self.enable_caching:
            return [], hashes
        limit = (len(token_ids) - 1) // self.page_size
        self.extend_chain(token_ids, hashes, limit, images)
        pages: list[int] = []
        for h in hashes[:limit]:
            page = self._cached.get(h)
            if page is None:
                break
            pages.append(page)
        return pages, hashes

    def allocate_cached(self, request_id: str, pages: Sequence[int], hashes: list[int],
                        retain_pages: int = 0) -> None:
        """Start `request_id`'s (empty) table with cached pages (the first `len(pages)` of its chain
        `hashes`, which the manager keeps using); an evictable page becomes held again. Its first
        `retain_pages` pages are kept with priority (a client's prefix-checkpoint marker)."""
        table = self._tables.setdefault(request_id, [])
        if table:
            raise ValueError("cached pages must start an empty block table")
        for page in pages:
            if self.block_hash[page] is None:
                raise ValueError(f"page {page} is not a cached page")
            if self.ref_counts[page] == 0:
                self._evictable.pop(page, None)
                self._evictable_retained.pop(page, None)
            self.ref_counts[page] += 1
        self._retained.update(pages[:retain_pages])
        table.extend(pages)
        self._hashes[request_id] = hashes
        self._num_registered[request_id] = len(pages)

    def register(self, request_id: str, page: int, block_hash: int, token_ids: Sequence[int] = ()) -> None:
        """Register the request's next page (restored from the host store) under its chain hash
        (``token_ids``: the request's tokens, for the `BlockStored` event while events are on)."""
        index = self._num_registered.get(request_id, 0)
        if self.block_hash[page] is None and block_hash not in self._cached:
            self.block_hash[page] = block_hash
            self._cached[block_hash] = page
            if self.events is not None:
                hashes = self._hashes.get(request_id, [])
                parent = hashes[index - 1] if 0 < index <= len(hashes) else None
                ps = self.page_size
                self.events.append(BlockStored((block_hash,), parent, tuple(token_ids[index * ps:(index + 1) * ps]),
                                               ps, self.medium))
        self._num_registered[request_id] = index + 1

    def cache_full_pages(self, request_id: str, token_ids: Sequence[int], num_computed: int,
                         retain_pages: int = 0, images: Sequence[ImageKey] = ()) -> None:
        """Register the request's pages that `num_computed` tokens fill and that are not registered
        yet (the tokens' K/V must be written: call after the step that computed them). Pages among
        its first `retain_pages` are kept with priority. `images` as in `lookup`."""
        if not self.enable_caching:
            return
        table = self._tables.get(request_id)
        if not table:
            return
        done = self._num_registered.get(request_id, 0)
        full = min(num_computed // self.page_size, len(table))
        if full <= done:
            return
        hashes = self._hashes.setdefault(request_id, [])
        self.extend_chain(token_ids, hashes, full, images)
        stored: list[int] = []  # page indices registered now (events only)
        for i in range(done, full):
            h, page = hashes[i], table[i]
            if self._registers(page) and self.block_hash[page] is None and h not in self._cached:
                self.block_hash[page] = h
                self._cached[h] = page
                if i < retain_pages:
                    self._retained.add(page)
                if self.events is not None:
                    stored.append(i)
        self._num_registered[request_id] = full
        if stored:
            self._emit_stored(token_ids, hashes, stored)

    def _emit_stored(self, token_ids: Sequence[int], hashes: Sequence[int], indices: Sequence[int]) -> None:
        """One `BlockStored` per run of consecutive page indices registered together."""
        assert self.events is not None
        ps = self.page_size
        run_start = prev = indices[0]
        for i in [*indices[1:], -1]:
            if i == prev + 1:
                prev = i
                continue
            self.events.append(BlockStored(
                tuple(hashes[run_start:prev + 1]), hashes[run_start - 1] if run_start > 0 else None,
                tuple(token_ids[run_start * ps:(prev + 1) * ps]), ps, self.medium))
            run_start = prev = i

    def _registers(self, page: int) -> bool:
        """Whether a table entry is a page (`cache_full_pages` may register it; `trim` and `free` give
        it back), not a subclass's placeholder (a sliding-window pool's released position, a
        compressed pool's position without an entry)."""
        return True

    # -- changing ownership ------------------------------------------------------------------------
    def allocate_slots(self, request_id: str, num_computed: int, num_new_tokens: int,
                       num_lookahead: int = 0) -> list[int] | None:
        """Pages for `num_computed + num_new_tokens + num_lookahead` tokens in total.

        Returns the newly allocated page ids, or None (and allocates nothing) when the pool cannot
        supply them. `num_lookahead` reserves room for tokens proposed but not yet verified
        (speculative decoding)."""
        total = num_computed + num_new_tokens + num_lookahead
        n = self.pages_needed(request_id, total)
        if n > self.num_free:
            return None
        new = [self._take() for _ in range(n)]
        for page in new:
            assert self.ref_counts[page] == 0
            self.ref_counts[page] = 1
        self._tables.setdefault(request_id, []).extend(new)
        return new

    def materialize(self, request_id: str, start: int, end: int) -> bool:
        """Pages for the positions a scheduled chunk writes: this pool's were all taken by
        `allocate_slots` (a lazy row-window pool takes them here: `coordinator.RowWindowPool`)."""
        return True

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Roll back the request's table to the pages `num_tokens` tokens need: the pages past them
        (speculative lookahead whose drafts were rejected) go back to the free pool. Such pages are
        never registered (only computed full pages are) nor shared. Returns the pages released."""
        table = self._tables.get(request_id)
        if not table:
            return 0
        keep = max(-(-num_tokens // self.page_size), self._num_registered.get(request_id, 0))
        released = 0
        while len(table) > keep:
            page = table.pop()
            if not self._registers(page):  # a placeholder holds no page
                continue
            self.ref_counts[page] -= 1
            assert self.ref_counts[page] == 0 and self.block_hash[page] is None, "trimmed a shared or cached page"
            self._free.appendleft(page)
            released += 1
        return released

    def free(self, request_id: str) -> None:
        """Drop every reference the request holds (idempotent)."""
        table = self._tables.pop(request_id, None)
        self._hashes.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        if not table:
            return
        # Reverse order: a request's first pages go back last, so the next allocation reuses its
        # newest pages first (page ids in tests stay exact) and a cached chain's tail is evicted
        # before its head.
        for page in reversed(table):
            if self._registers(page):  # a placeholder holds no page
                self._drop(page)

    def _drop(self, page: int) -> None:
        """One reference to ``page`` dropped; at none it becomes evictable (registered) or free."""
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0:
            if page in self._retained:
                self._evictable_retained[page] = None
            elif self.block_hash[page] is not None:
                self._evictable[page] = None
            else:
                self._free.appendleft(page)

    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        page, _ = (self._evictable or self._evictable_retained).popitem(last=False)
        block_hash = self.block_hash[page]
        if block_hash is not None and self.on_evict is not None:
            self.on_evict(block_hash, page)
        self._uncache(page)
        return page

    def _uncache(self, page: int) -> None:
        self._retained.discard(page)
        block_hash = self.block_hash[page]
        if block_hash is not None and self._cached.get(block_hash) == page:
            del self._cached[block_hash]
            if self.events is not None:
                self.events.append(BlockRemoved((block_hash,), self.medium))
        self.block_hash[page] = None

    # -- checks ------------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        self._check_tables(list(self._tables.values()))

    def _check_tables(self, tables: Sequence[Sequence[int]]) -> None:
        held = collections.Counter(p for table in tables for p in table)
        for page in range(self.num_pages):
            assert self.ref_counts[page] == held[page], f"page {page}: count {self.ref_counts[page]} != {held[page]}"
        free = list(self._free)
        assert len(free) == len(set(free)), "a page is free twice"
        assert all(self.ref_counts[p] == 0 and self.block_hash[p] is None for p in free), "a free page is held or cached"
        evictable = [*self._evictable, *self._evictable_retained]
        assert all(self.ref_counts[p] == 0 and self.block_hash[p] is not None for p in evictable), \
            "an evictable page is held or uncached"
        assert all(p in self._retained for p in self._evictable_retained), "a retained-list page is not retained"
        assert all(self.block_hash[p] is not None for p in self._retained), "a retained page is not cached"
        assert len(set(evictable)) == len(evictable), "a page is evictable twice"
        assert not set(free) & set(evictable), "a page is both free and evictable"
        assert len(free) + len(evictable) + len(held) == self.num_pages, "pages leaked"
        for table in tables:
            assert len(table) == len(set(table)), "a table holds a page twice"
        for block_hash, page in self._cached.items():
            assert self.block_hash[page] == block_hash, f"hash of page {page} does not match its registration"
        registered = sum(1 for h in self.block_hash if h is not None)
        assert registered == len(self._cached), "a page carries a hash it is not registered under"


_EMPTY: list[int] = []
