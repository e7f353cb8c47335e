"""State checkpoints: the prefix cache of a layout with recurrent layers.

A recurrent layer keeps one fixed-size state per request, not rows per token, so a prefix is
reused only with a snapshot of that state at the prefix's end. A checkpoint at a page boundary p
is the attention groups' pages of positions 0 .. p - 1 (registered under their chain hashes as in
any layout) plus a copy of every recurrent layer's state tensors after position p - 1, keyed by
the chain hash of the page ending at p. A hit is the longest chain every paged group serves whose
last page has a snapshot; restoring it shares the pages and copies the snapshot into the new
request's state slot, which then continues from position p (`KVCacheCoordinator.lookup`,
`Scheduler` admission).

Ownership (`SnapshotPool`, held by the coordinator): a bounded pool of snapshot rows (rows of the
recurrent layers' state tensors after the running requests' slots). Every row is in exactly one
state: free; pending (a running request's latest endpoint copy, not findable yet); or registered
under a chain hash (findable, least recently used first). Taking a row uses a free one, else
evicts the least recently used registered one (``on_evict``: the host store's copy-out); pending
rows are never evicted, so a pool whose rows are all pending has no room (`storage`).

Capture points (`Checkpoints`, the policy, held by the scheduler):

- ``anchor``: the last page boundary at or before the end of the prompt. The prefill is split so a
  chunk ends exactly there and the state is copied after that step.
- ``message``: the client's prefix-checkpoint markers (`EngineRequest.marker_tokens`, the ends of
  its first four ``cache_control`` blocks), each floored to a page boundary; a message boundary
  equal to the anchor is the anchor.
- ``endpoint``: in decode, the state after the token that completes a page is the state at that
  boundary; the latest such copy of a running request (its pending row) is registered when the
  request leaves the batch (finish, abort, preemption), so a follow-up turn that extends its
  prompt and output finds it.

Work budget: each capture is charged its predicted extra work: the copy (the state's bytes times
the measured copy time per byte: a timed copy at start, then an average of every copy), plus, for
a capture that splits a prefill chunk, one more step (the average time of a decode-only step: the
fixed cost of a forward; unknown until the engine has run one, so such a capture is skipped with
``unknown_cost`` until then). The allowance is ``work_fraction`` of the engine's measured step
time so far, less what was charged: over the engine's life the charged extra work never exceeds
that fraction of its step time. A capture it cannot afford is skipped (``work_budget``), one the
pool has no row for is skipped (``storage``). Anchor and message captures are decided (and
charged) when the request is admitted if they split a chunk, else after the step that reaches
them; endpoint copies at each page boundary. The charged nanoseconds are predictions, not
timings (`extra_work_ns`). The copy times are host wall-clock times around the copy call: exact
on the CPU; on CUDA they time the launch only (the copy is asynchronous), so the copy part of a
prediction is low there.

Limitations: as for any layout, each page of a hit comes either from every paged group's pool or
from the host store's records of every group (a page one group keeps in its pool and another
only in the host store ends the hit).

Host store: a snapshot's record is the recurrent layers' state bytes, keyed
`group_key(hash, first recurrent group)` in the same DRAM/disk tiers as the pages (so it survives
a restart); a host restore needs the pages' records and the snapshot's.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import attrs

CAPTURE_ROLES = ("anchor", "message", "endpoint")
SKIP_REASONS = ("unknown_cost", "work_budget", "storage")


@attrs.define
class SnapshotPool:
    """Which snapshot row holds what (see the module docstring)."""

    num_rows: int
    on_evict: Callable[[int, int], None] | None = None
    """``on_evict(hash, row)``: called before a registered row is reused."""
    _free: list[int] = attrs.field(init=False)
    _by_hash: collections.OrderedDict[int, int] = attrs.field(init=False, factory=collections.OrderedDict)
    """hash -> row, least recently used first."""
    _hash_of: list[int | None] = attrs.field(init=False)
    _pending: dict[str, tuple[int, int | None]] = attrs.field(init=False, factory=dict)
    """request -> (its pending row, the chain hash of the boundary it holds; None: not filled yet)."""

    def __attrs_post_init__(self) -> None:
        self._free = list(range(self.num_rows - 1, -1, -1))  # pop() hands out the lowest
        self._hash_of = [None] * self.num_rows

    # -- reading -----------------------------------------------------------------------------------
    @property
    def num_registered(self) -> int:
        return len(self._by_hash)

    def has(self, block_hash: int) -> bool:
        return block_hash in self._by_hash

    def find(self, block_hash: int) -> int | None:
        """The row registered under ``block_hash`` (now the most recently used), or None."""
        row = self._by_hash.get(block_hash)
        if row is not None:
            self._by_hash.move_to_end(block_hash)
        return row

    def registered(self) -> list[tuple[int, int]]:
        """(hash, row) of every registered snapshot."""
        return list(self._by_hash.items())

    def can_take(self) -> bool:
        return bool(self._free or self._by_hash)

    def pending(self, request_id: str) -> tuple[int, int | None] | None:
        return self._pending.get(request_id)

    # -- changing ownership --------------------------------------------------------------------------
    def take(self) -> int | None:
        """A row to fill: a free one, else the least recently used registered one (evicted). None:
        every row is pending."""
        if self._free:
            return self._free.pop()
        if not self._by_hash:
            return None
        block_hash, row = self._by_hash.popitem(last=False)
        if self.on_evict is not None:
            self.on_evict(block_hash, row)
        self._hash_of[row] = None
        return row

    def give_back(self, row: int) -> None:
        """A taken row that was not filled after all."""
        assert self._hash_of[row] is None and row not in self._free
        self._free.append(row)

    def register(self, row: int, block_hash: int) -> bool:
        """Make a taken, filled row findable under ``block_hash``. A hash that already has a row
        keeps it (the same state): this row goes back to the free list. Returns whether it was
        registered."""
        assert self._hash_of[row] is None and row not in self._free
        if block_hash in self._by_hash:
            self._by_hash.move_to_end(block_hash)
            self._free.append(row)
            return False
        self._hash_of[row] = block_hash
        self._by_hash[block_hash] = row
        return True

    def hold_pending(self, request_id: str) -> int | None:
        """The request's pending row, taking one if it has none (None: no row)."""
        held = self._pending.get(request_id)
        if held is not None:
            return held[0]
        row = self.take()
        if row is not None:
            self._pending[request_id] = (row, None)
        return row

    def fill_pending(self, request_id: str, block_hash: int) -> None:
        """The request's pending row now holds the state at the boundary of ``block_hash``."""
        row, _ = self._pending[request_id]
        self._pending[request_id] = (row, block_hash)

    def release(self, request_id: str) -> bool:
        """The request leaves the batch: its filled pending row is registered (an unfilled one is
        freed). Returns whether a snapshot was registered (idempotent)."""
        held = self._pending.pop(request_id, None)
        if held is None:
            return False
        row, block_hash = held
        if block_hash is None:
            self._free.append(row)
            return False
        return self.register(row, block_hash)

    # -- checks ------------------------------------------------------------------------------------
    def check_integrity(self, holders: set[str]) -> None:
        free = list(self._free)
        pending = [row for row, _ in self._pending.values()]
        registered = list(self._by_hash.values())
        rows = free + pending + registered
        assert len(rows) == len(set(rows)), "a snapshot row is in two states"
        assert len(rows) == self.num_rows, "snapshot rows leaked"
        assert set(self._pending) <= holders, "a pending snapshot belongs to a request that holds no pages"
        for block_hash, row in self._by_hash.items():
            assert self._hash_of[row] == block_hash, f"snapshot row {row} does not carry its hash"
        assert sum(1 for h in self._hash_of if h is not None) == len(self._by_hash), \
            "a snapshot row carries a hash it is not registered under"


@attrs.define
class CheckpointCounters:
    """Counters since start (`records.CheckpointStats` is what crosses the engine boundary)."""

    captures: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(CAPTURE_ROLES, 0))
    skips: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(SKIP_REASONS, 0))
    extra_work_ns: int = 0
    """Charged predicted extra work (copies and split steps), ns."""
    restores: int = 0
    """Admissions that continued from a checkpoint."""
    host_restores: int = 0
    """Of those, restores whose snapshot came from the host store."""


class Checkpoints:
    """The capture policy, the work budget and the state copies (see the module docstring).

    Device work goes through callbacks on the state rows of the recurrent layers (rows
    ``0 .. base - 1`` are the running requests' slots, snapshot row r is ``base + r``): ``copy(src,
    dst)``, ``read(row) -> bytes`` and ``write(row, bytes) -> bool``. The host store through
    ``host_put(key, bytes)``, ``host_get(key)`` and ``host_has(key)`` (None: no host store)."""

    def __init__(self, pool: SnapshotPool, *, base: int, state_bytes: int, work_fraction: float,
                 copy: Callable[[int, int], None], read: Callable[[int], bytes],
                 write: Callable[[int, bytes], bool], key: Callable[[int], int], slot_of: Callable[[str], int],
                 host_put: Callable[[int, bytes], None] | None = None,
                 host_get: Callable[[int], bytes | None] | None = None,
                 host_has: Callable[[int], bool] | None = None) -> None:
        self.pool = pool
        self.base = base
        self.state_bytes = state_bytes
        self.work_fraction = work_fraction
        self._copy, self._read, self._write, self.key, self._slot_of = copy, read, write, key, slot_of
        self._host_put, self._host_get, self._host_has = host_put, host_get, host_has
        self.counters = CheckpointCounters()
        self.allowance_ns = 0.0
        """Step time times ``work_fraction``, less every charge (`observe_step`, `_charge`)."""
        self.step_ns_total = 0
        self.ns_per_byte: float | None = None
        self.decode_step_ns: float | None = None
        pool.on_evict = self._evict
        if pool.num_rows and state_bytes:
            self._timed_copy(base, base)  # a first measurement of the copy time (row 0 onto itself)

    # -- what the engine tells it ---------------------------------------------------------------------
    def observe_step(self, step_ns: int, decode_only: bool) -> None:
        """A step ran in ``step_ns``: the allowance grows by its share; decode-only steps give the
        split estimate (an average)."""
        self.step_ns_total += step_ns
        self.allowance_ns += self.work_fraction * step_ns
        if decode_only:
            prev = self.decode_step_ns
            self.decode_step_ns = step_ns if prev is None else 0.9 * prev + 0.1 * step_ns

    # -- lookup and restore ---------------------------------------------------------------------------
    def available(self, block_hash: int) -> bool:
        """Whether a snapshot of the boundary of ``block_hash`` is in the pool or the host store."""
        return self.pool.has(block_hash) or (self._host_has is not None and self._host_has(self.key(block_hash)))

    def restore(self, block_hash: int, request_id: str) -> bool:
        """Fill the request's state slot with the snapshot of ``block_hash`` (pool, else host
        store). False: none, or its host record failed to verify."""
        slot = self._slot_of(request_id)
        row = self.pool.find(block_hash)
        if row is not None:
            self._timed_copy(self.base + row, slot)
            self.counters.restores += 1
            return True
        if self._host_get is None:
            return False
        data = self._host_get(self.key(block_hash))
        if data is None or not self._write(slot, data):
            return False
        self.counters.restores += 1
        self.counters.host_restores += 1
        return True

    # -- capture ----------------------------------------------------------------------------------------
    def select(self, splits: bool, block_hash: int | None = None) -> bool:
        """Decide an anchor or message capture and charge it: False (counted as a skip) when no row
        can hold it, its cost is unknown, or the allowance cannot pay it; also False, uncounted,
        when ``block_hash``'s boundary has a snapshot already (nothing to capture)."""
        if block_hash is not None and self.pool.has(block_hash):
            return False
        if not self.pool.can_take():
            self.counters.skips["storage"] += 1
            return False
        cost = self._predicted(splits)
        if cost is None:
            self.counters.skips["unknown_cost"] += 1
            return False
        return self._charge(cost)

    def capture(self, role: str, request_id: str, block_hash: int) -> bool:
        """Copy the request's state (at the boundary of ``block_hash``) into a snapshot row and
        register it (a capture selected earlier). False: no row now (counted: ``storage``)."""
        if self.pool.has(block_hash):
            self.pool.find(block_hash)
            return False  # another request captured the same boundary: the same state
        row = self.pool.take()
        if row is None:
            self.counters.skips["storage"] += 1
            return False
        self._timed_copy(self._slot_of(request_id), self.base + row)
        self.pool.register(row, block_hash)
        self.counters.captures[role] += 1
        return True

    def endpoint_copy(self, request_id: str, block_hash: int) -> bool:
        """A running request's decode completed the page of ``block_hash``: copy its state into its
        pending row (taken on the first boundary), charged as a copy."""
        if self.pool.has(block_hash):
            return False  # that boundary is checkpointed already
        if self.pool.pending(request_id) is None and not self.pool.can_take():
            self.counters.skips["storage"] += 1
            return False
        cost = self._predicted(False)
        if cost is None:
            self.counters.skips["unknown_cost"] += 1
            return False
        if not self._charge(cost):
            return False
        row = self.pool.hold_pending(request_id)
        assert row is not None
        self._timed_copy(self._slot_of(request_id), self.base + row)
        self.pool.fill_pending(request_id, block_hash)
        return True

    def release(self, request_id: str) -> None:
        """The request left the batch: its endpoint copy becomes a checkpoint."""
        if self.pool.release(request_id):
            self.counters.captures["endpoint"] += 1

    def copy_out(self) -> None:
        """Put every registered snapshot into the host store (shutdown with a disk tier)."""
        if self._host_put is None or self._host_has is None:
            return
        for block_hash, row in self.pool.registered():
            if not self._host_has(self.key(block_hash)):
                self._host_put(self.key(block_hash), self._read(self.base + row))

    # -- internals ------------------------------------------------------------------------------------
    def _predicted(self, splits: bool) -> float | None:
        if self.ns_per_byte is None:
            return None
        cost = self.ns_per_byte * self.state_bytes
        if splits:
            if self.decode_step_ns is None:
                return None
            cost += self.decode_step_ns
        return cost

    def _charge(self, cost: float) -> bool:
        if cost > self.allowance_ns:
            self.counters.skips["work_budget"] += 1
            return False
        self.allowance_ns -= cost
        self.counters.extra_work_ns += round(cost)
        return True

    def _timed_copy(self, src: int, dst: int) -> None:
        t0 = time.perf_counter_ns()
        self._copy(src, dst)
        ns = max(time.perf_counter_ns() - t0, 1)
        if self.state_bytes:
            per = ns / self.state_bytes
            self.ns_per_byte = per if self.ns_per_byte is None else 0.9 * self.ns_per_byte + 0.1 * per

    def _evict(self, block_hash: int, row: int) -> None:
        if self._host_put is not None:
            self._host_put(self.key(block_hash), self._read(self.base + row))
