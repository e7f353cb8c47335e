"""HTTP admission slots (spec: "Transport and admission").

Each generated choice of a request holds one slot from acceptance until its response is fully
delivered (finished responses awaiting delivery still count). A request with ``n`` children takes
``n`` slots all or nothing. ``n`` larger than the whole pool can never be admitted: that is an
oversized group (400), distinct from temporary exhaustion (429).

The counter is plain and synchronous: every caller runs on the trio thread.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class AdmissionStatistics:
    in_use: int
    total: int
    rejected_total: int  # 429s since start
    oversized_total: int  # 400s since start

    @property
    def free(self) -> int:
        return self.total - self.in_use


class AdmissionSlots:
    """A fixed pool of admission slots with all-or-nothing multi-slot acquisition."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError("admission needs at least one slot")
        self._total = total
        self._in_use = 0
        self._num_rejected = 0
        self._num_oversized = 0

    @property
    def total(self) -> int:
        return self._total

    @property
    def in_use(self) -> int:
        return self._in_use

    def is_oversized(self, n: int) -> bool:
        return n > self._total

    def try_acquire(self, n: int = 1) -> bool:
        """Take ``n`` slots if all are free; never a partial grant. False for oversized groups too."""
        if n < 1:
            raise ValueError("a request takes at least one slot")
        if self._in_use + n > self._total:
            if self.is_oversized(n):
                self._num_oversized += 1
            else:
                self._num_rejected += 1
            return False
        self._in_use += n
        return True

    def release(self, n: int = 1) -> None:
        if n < 1 or n > self._in_use:
            raise ValueError(f"releasing {n} slots with {self._in_use} in use")
        self._in_use -= n

    def statistics(self) -> AdmissionStatistics:
        return AdmissionStatistics(self._in_use, self._total, self._num_rejected, self._num_oversized)
