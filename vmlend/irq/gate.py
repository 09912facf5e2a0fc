"""Masking without loss: a masked vector holds its interrupts as pending, unmasking releases them.

Pure bookkeeping; the caller signals what ``admit`` and ``set_masked`` return. Counts are kept
(not a single pending bit) so the number delivered always equals the number raised — the VM may
still see them coalesced into one eventfd read.
"""

from __future__ import annotations


class VectorGate:
    def __init__(self, count: int, masked: frozenset[int] = frozenset()) -> None:
        self._count = count
        self._masked = {v for v in masked if v < count}
        self._pending: dict[int, int] = {}

    def admit(self, vector: int, n: int) -> int:
        """How many of ``n`` interrupts on ``vector`` to deliver now (0 if masked: now pending)."""
        if vector in self._masked:
            self._pending[vector] = self._pending.get(vector, 0) + n
            return 0
        return n

    def set_masked(self, masked: frozenset[int]) -> dict[int, int]:
        """Apply a new mask set; returns {vector: count} released by unmasking."""
        self._masked = {v for v in masked if v < self._count}
        released = {v: n for v, n in self._pending.items() if v not in self._masked}
        for v in released:
            del self._pending[v]
        return released

    def is_pending(self, vector: int) -> bool:
        return vector in self._pending

    def pending(self) -> dict[int, int]:
        return dict(self._pending)

    def take_all(self) -> dict[int, int]:
        """Everything still held (on teardown): the guest enabled these, so they are owed."""
        held, self._pending = self._pending, {}
        return held
