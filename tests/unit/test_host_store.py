"""The prefix cache's host store: DRAM LRU, disk records that survive a restart, and records that
are never served unless they verify (corrupt, truncated, foreign or missing → dropped, io_error)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helios.engine.kv.host_store import HostStore

FP = bytes(range(16))


def page(i: int, size: int = 1000) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(size))


def test_dram_only_keeps_the_most_recent_within_its_budget() -> None:
    store = HostStore(FP, memory_bytes=3000)
    for i in range(5):
        store.put(i, page(i))
    assert store.stats.memory_records == 3
    assert [store.get(i) for i in range(2)] == [None, None]  # the two oldest were dropped
    assert store.get(4) == page(4) and store.get(2) == page(2)
    assert store.stats.dropped["dram", "end_of_chain"] == 2
    assert store.stats.hits == 2 and store.stats.misses == 2
    assert store.stats.bytes_out == 5000 and store.stats.bytes_in == 2000
    store.put(4, page(4))  # a duplicate is skipped, not stored twice
    assert store.stats.skipped == 1 and store.stats.bytes_out == 5000


def test_a_get_refreshes_recency() -> None:
    store = HostStore(FP, memory_bytes=2000)
    store.put(1, page(1))
    store.put(2, page(2))
    assert store.get(1) == page(1)
    store.put(3, page(3))  # evicts 2, the least recently used
    assert store.contains(1) and not store.contains(2) and store.contains(3)


def test_oversize_records_are_dropped() -> None:
    store = HostStore(FP, memory_bytes=500)
    store.put(1, page(1))
    assert not store.contains(1) and store.stats.dropped["dram", "oversize"] == 1


def test_dram_overflow_goes_to_disk_and_survives_a_restart(tmp_path: Path) -> None:
    store = HostStore(FP, memory_bytes=2000, disk_dir=tmp_path, disk_bytes=1 << 20)
    for i in range(6):
        store.put(i, page(i))
    store.flush()
    assert store.stats.memory_records == 2 and store.stats.disk_records == 4 and store.stats.parked == 0
    assert store.stats.held == {"dram": 6, "nvme": 4}
    assert store.get(0) == page(0)  # from disk, verified
    store.close(persist=False)  # the DRAM tier is lost
    again = HostStore(FP, memory_bytes=2000, disk_dir=tmp_path, disk_bytes=1 << 20)
    assert again.stats.disk_records == 4 and again.stats.memory_records == 0
    assert [again.get(i) for i in range(4)] == [page(i) for i in range(4)]
    assert again.get(5) is None  # it was in the first run's DRAM only
    other = HostStore(bytes(16), memory_bytes=2000, disk_dir=tmp_path, disk_bytes=1 << 20)
    assert other.stats.disk_records == 0 and other.get(0) is None  # another model's records are not seen
    again.close()
    other.close()


def test_the_disk_budget_drops_the_oldest_records(tmp_path: Path) -> None:
    store = HostStore(FP, memory_bytes=1000, disk_dir=tmp_path, disk_bytes=3 * 1100)
    for i in range(8):
        store.put(i, page(i))
    store.flush()
    assert store.stats.disk_records == 3
    assert store.stats.dropped["nvme", "end_of_chain"] == 4  # 7 spilled, 3 fit
    assert [store.contains(i) for i in range(8)] == [False] * 4 + [True] * 4
    assert len(list((tmp_path / FP.hex()).glob("*.kv"))) == 3
    store.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "foreign_hash", "garbage"])
def test_a_damaged_record_is_dropped_never_served(tmp_path: Path, damage: str) -> None:
    store = HostStore(FP, memory_bytes=1000, disk_dir=tmp_path, disk_bytes=1 << 20)
    store.put(1, page(1))
    store.put(2, page(2))  # pushes 1 to disk
    store.flush()
    store.close()
    path = tmp_path / FP.hex() / f"{1:032x}.kv"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-10] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "delete":
        path.unlink()
    elif damage == "foreign_hash":
        os.replace(path, path.with_name(f"{3:032x}.kv"))  # a record of 1 under 3's name
    else:
        path.write_bytes(b"not a record")
    again = HostStore(FP, memory_bytes=1000, disk_dir=tmp_path, disk_bytes=1 << 20)
    key = 3 if damage == "foreign_hash" else 1
    assert again.get(key) is None
    assert again.stats.dropped["nvme", "io_error"] == (0 if damage == "delete" else 1)
    assert not again.contains(key)
    assert again.get(key) is None  # and it stays gone
    again.close()


def test_close_persists_the_dram_tier(tmp_path: Path) -> None:
    store = HostStore(FP, memory_bytes=10_000, disk_dir=tmp_path, disk_bytes=1 << 20)
    store.put(1, page(1))
    store.put(2, page(2))
    assert store.stats.disk_records == 0
    store.close()
    again = HostStore(FP, memory_bytes=10_000, disk_dir=tmp_path, disk_bytes=1 << 20)
    assert again.stats.disk_records == 2 and again.get(1) == page(1) and again.get(2) == page(2)
    again.close(persist=False)
