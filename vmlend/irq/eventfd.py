"""A thin owner of one Linux eventfd.

Every eventfd in the relay is nonblocking: a reader that finds nothing gets 0, a writer never
waits. Counts coalesce (N writes may be read as one value N), which the relay relies on: a
count is the number of interrupts, however they were batched.
"""

from __future__ import annotations

import os
import stat
from types import TracebackType

# Largest value an eventfd counter holds (2**64 - 2); a write that would pass it blocks or,
# nonblocking, fails with EAGAIN.
EVENTFD_MAX = 0xFFFF_FFFF_FFFF_FFFE


class EventFd:
    """One eventfd descriptor, owned: ``close`` closes it exactly once."""

    __slots__ = ("_fd",)

    def __init__(self, fd: int | None = None) -> None:
        # Adopting an fd received from elsewhere (SCM_RIGHTS) keeps its flags; make it
        # nonblocking so a full counter can never stall the relay.
        if fd is None:
            fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:
            # An eventfd is an anonymous inode (no file type bits); this rejects files, pipes
            # and sockets handed over by mistake (other anonymous inodes look the same).
            if stat.S_IFMT(os.fstat(fd).st_mode) != 0:
                raise ValueError(f"descriptor {fd} is not an eventfd")
            os.set_blocking(fd, False)
        self._fd = fd

    def fileno(self) -> int:
        if self._fd < 0:
            raise ValueError("eventfd is closed")
        return self._fd

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def signal(self, count: int = 1) -> bool:
        """Add ``count``; False if the counter is saturated (the reader has fallen 2**64 behind)."""
        try:
            os.eventfd_write(self._fd, count)
        except BlockingIOError:
            return False
        return True

    def drain(self) -> int:
        """Read and reset the counter; 0 when nothing was signalled."""
        try:
            return os.eventfd_read(self._fd)
        except BlockingIOError:
            return 0

    def close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __enter__(self) -> EventFd:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EventFd({self._fd})"
