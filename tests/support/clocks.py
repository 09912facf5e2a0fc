"""A monotonic clock the test moves (``advance``), safe to read from the threads under test."""

from __future__ import annotations

import threading


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds
