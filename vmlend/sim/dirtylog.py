"""A dirty-page log, as KVM keeps one for the vCPUs' writes and an IOMMU with dirty tracking
for a device's: off until started, then every page written since the last take."""

from __future__ import annotations

from collections.abc import Iterable


class DirtyLog:
    def __init__(self) -> None:
        self._pages: set[int] | None = None  # None: not logging

    @property
    def active(self) -> bool:
        return self._pages is not None

    def start(self) -> None:
        """Log from now on (idempotent: a running log keeps what it has)."""
        if self._pages is None:
            self._pages = set()

    def mark(self, pages: Iterable[int]) -> None:
        """``pages`` were written (nothing while the log is off)."""
        if self._pages is not None:
            self._pages.update(pages)

    def take(self) -> set[int]:
        """The pages written since the last take; the log goes on."""
        if self._pages is None:
            return set()
        taken, self._pages = self._pages, set()
        return taken

    def stop(self) -> set[int]:
        """Stop logging; what was written since the last take."""
        taken = self.take()
        self._pages = None
        return taken
