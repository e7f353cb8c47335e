"""The host store behind the page pool: evicted prefix-cache pages, kept in DRAM and on disk.

A record is one full KV page (every layer's keys and values, as the attention backend lays them
out), keyed by its chain hash under one model fingerprint (the weights, dtype, page size and KV
layout: a record of another model or layout is never found). Records leave the page pool when the
prefix cache evicts a page (`put`) and return into new pages on a lookup hit (`get`).

Tiers (the spec's metric labels): ``dram``, a bounded in-memory LRU (`[cache] host_memory_gib`),
and ``nvme``, a bounded directory (`[cache] disk_dir`, `disk_gib`) that survives a restart. A
record pushed out of DRAM is written to disk by a background thread (never the engine thread); the
gauge `parked` counts DRAM copies awaiting that write. The oldest disk records go when the disk
budget is exceeded.

A disk record is `MAGIC | fingerprint (16 B) | chain hash (16 B) | payload length (8 B) |
blake2b-128 of the payload (16 B) | payload`. A record that is truncated, fails its checksum, or
names another fingerprint or hash is deleted and counted as dropped (`io_error`); the caller
recomputes the prefix. A record is never served unless it verifies.

Thread safety: one lock guards the maps; disk IO runs outside it.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import queue
import threading
from pathlib import Path

import attrs

log = logging.getLogger("helios.cache")

MAGIC = b"HKVPAGE1"
_HEADER = len(MAGIC) + 16 + 16 + 8 + 16
TIERS = ("dram", "nvme")
DROP_REASONS = ("end_of_chain", "oversize", "io_error")


@attrs.define
class HostStoreStats:
    """Counters since start, and the instantaneous record gauges."""

    memory_records: int = 0
    disk_records: int = 0
    parked: int = 0
    hits: int = 0
    misses: int = 0
    bytes_out: int = 0  # copied from the page pool into the store
    bytes_in: int = 0  # copied from the store into pages
    held: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(TIERS, 0))
    dropped: dict[tuple[str, str], int] = attrs.field(
        factory=lambda: {(t, r): 0 for t in TIERS for r in DROP_REASONS})
    skipped: int = 0  # puts of a record already held (duplicates)


class HostStore:
    def __init__(self, fingerprint: bytes, *, memory_bytes: int, disk_dir: Path | None = None,
                 disk_bytes: int = 0) -> None:
        if len(fingerprint) != 16:
            raise ValueError("the model fingerprint is 16 bytes")
        self.fingerprint = fingerprint
        self.memory_bytes = max(0, memory_bytes)
        self.disk_bytes = max(0, disk_bytes) if disk_dir is not None else 0
        self.dir = (disk_dir / fingerprint.hex()) if disk_dir is not None and self.disk_bytes else None
        self.stats = HostStoreStats()
        self._lock = threading.Lock()
        self._memory: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self._memory_used = 0
        self._disk: collections.OrderedDict[int, int] = collections.OrderedDict()  # hash -> file size, LRU
        self._disk_used = 0
        self._parked: dict[int, bytes] = {}
        # Disk writes, a flush marker (set once everything before it is written), or None (stop).
        self._queue: queue.SimpleQueue[tuple[int, bytes] | threading.Event | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._scan()
            self._writer = threading.Thread(target=self._write_loop, name="helios-host-store", daemon=True)
            self._writer.start()

    # -- the engine's side ---------------------------------------------------------------------
    def contains(self, block_hash: int) -> bool:
        with self._lock:
            return block_hash in self._memory or block_hash in self._parked or block_hash in self._disk

    def put(self, block_hash: int, payload: bytes) -> None:
        """Keep an evicted page. Records larger than a whole tier are dropped (`oversize`)."""
        size = len(payload)
        with self._lock:
            if block_hash in self._memory or block_hash in self._parked or block_hash in self._disk:
                self.stats.skipped += 1
                if block_hash in self._memory:
                    self._memory.move_to_end(block_hash)
                return
            self.stats.bytes_out += size
            if size > self.memory_bytes:
                self.stats.dropped["dram", "oversize"] += 1
                spill = [(block_hash, payload)]
            else:
                self._memory[block_hash] = payload
                self._memory_used += size
                self.stats.held["dram"] += 1
                spill = []
                while self._memory_used > self.memory_bytes:
                    old, data = self._memory.popitem(last=False)
                    self._memory_used -= len(data)
                    spill.append((old, data))
            for old, data in spill:
                if self.dir is None:
                    self.stats.dropped["dram", "end_of_chain"] += 1
                elif len(data) + _HEADER > self.disk_bytes:
                    self.stats.dropped["nvme", "oversize"] += 1
                else:
                    self._parked[old] = data
                    self._queue.put((old, data))
            self._gauges()

    def get(self, block_hash: int) -> bytes | None:
        """A held record's payload (DRAM, then parked, then disk, verified), or None."""
        with self._lock:
            data = self._memory.get(block_hash)
            if data is not None:
                self._memory.move_to_end(block_hash)
            elif block_hash in self._parked:
                data = self._parked[block_hash]
            elif block_hash not in self._disk:
                self.stats.misses += 1
                return None
        if data is None:
            data = self._read(block_hash)
            if data is None:
                with self._lock:
                    self.stats.misses += 1
                return None
        with self._lock:
            self.stats.hits += 1
            self.stats.bytes_in += len(data)
        return data

    def close(self, *, persist: bool = True) -> None:
        """Finish the pending disk writes and stop the writer. With `persist`, the DRAM tier's
        records are written to disk first (within its budget), so a restart finds them."""
        if self._writer is None:
            return
        if persist:
            with self._lock:
                records = [(h, d) for h, d in self._memory.items()
                           if h not in self._disk and h not in self._parked and len(d) + _HEADER <= self.disk_bytes]
                for h, d in records:
                    self._parked[h] = d
                    self._queue.put((h, d))
                self._gauges()
        self._queue.put(None)
        self._writer.join(timeout=60)
        self._writer = None

    def flush(self) -> None:
        """Wait until every parked record is on disk (tests, shutdown)."""
        if self._writer is None:
            return
        done = threading.Event()
        self._queue.put(done)
        done.wait(timeout=30)

    # -- disk ------------------------------------------------------------------------------------
    def _path(self, block_hash: int) -> Path:
        assert self.dir is not None
        return self.dir / f"{block_hash:032x}.kv"

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            block_hash, data = item
            try:
                self._write(block_hash, data)
            except OSError as exc:
                log.warning("host store: cannot write a record: %s", exc)
                with self._lock:
                    self._parked.pop(block_hash, None)
                    self.stats.dropped["nvme", "io_error"] += 1
                    self._gauges()

    def _write(self, block_hash: int, data: bytes) -> None:
        path = self._path(block_hash)
        digest = hashlib.blake2b(data, digest_size=16).digest()
        record = b"".join((MAGIC, self.fingerprint, block_hash.to_bytes(16, "big"), len(data).to_bytes(8, "big"),
                           digest, data))
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(record)
        os.replace(tmp, path)
        evict: list[int] = []
        with self._lock:
            self._parked.pop(block_hash, None)
            self._disk[block_hash] = len(record)
            self._disk_used += len(record)
            self.stats.held["nvme"] += 1
            while self._disk_used > self.disk_bytes and len(self._disk) > 1:
                old, size = self._disk.popitem(last=False)
                self._disk_used -= size
                self.stats.dropped["nvme", "end_of_chain"] += 1
                evict.append(old)
            self._gauges()
        for old in evict:
            self._path(old).unlink(missing_ok=True)

    def _read(self, block_hash: int) -> bytes | None:
        path = self._path(block_hash)
        try:
            record = path.read_bytes()
        except OSError:
            record = b""
        data = self._verify(record, block_hash)
        with self._lock:
            if data is None:
                size = self._disk.pop(block_hash, None)
                if size is not None:
                    self._disk_used -= size
                self.stats.dropped["nvme", "io_error"] += 1
                self._gauges()
            else:
                self._disk.move_to_end(block_hash)
        if data is None:
            log.warning("host store: dropped a corrupt or missing record %032x", block_hash)
            path.unlink(missing_ok=True)
        return data

    def _verify(self, record: bytes, block_hash: int) -> bytes | None:
        if len(record) < _HEADER or not record.startswith(MAGIC):
            return None
        at = len(MAGIC)
        if record[at:at + 16] != self.fingerprint or record[at + 16:at + 32] != block_hash.to_bytes(16, "big"):
            return None
        size = int.from_bytes(record[at + 32:at + 40], "big")
        digest = record[at + 40:at + 56]
        data = record[_HEADER:]
        if len(data) != size or hashlib.blake2b(data, digest_size=16).digest() != digest:
            return None
        return data

    def _scan(self) -> None:
        """Index the records a previous run left (oldest first by modification time); they are
        verified when read."""
        assert self.dir is not None
        entries = []
        for path in self.dir.glob("*.kv"):
            try:
                block_hash = int(path.stem, 16)
                st = path.stat()
            except (ValueError, OSError):
                continue
            entries.append((st.st_mtime, block_hash, st.st_size))
        for path in self.dir.glob("*.tmp"):
            path.unlink(missing_ok=True)
        for _, block_hash, size in sorted(entries):
            self._disk[block_hash] = size
            self._disk_used += size
        self._gauges()

    def _gauges(self) -> None:
        self.stats.memory_records = len(self._memory)
        self.stats.disk_records = len(self._disk)
        self.stats.parked = len(self._parked)
