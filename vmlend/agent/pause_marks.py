"""Which VMs the agent paused itself, kept on the host so that the next agent resumes them.

The agent pauses a VM with remote devices while its lease is in doubt, and resumes it after a
renewal, or after a recovery under a new lease. An agent killed in between (kill -9, the OOM
killer, a crash) left the VM paused, and a hypervisor cannot tell that pause from an
operator's ``virsh suspend``. So the agent marks the VM here before it pauses it, and clears
the mark once it resumed it. At start-up the next agent recovers each marked VM that is still
paused: it re-reserves the devices or unplugs them, then resumes the VM. A VM an operator
paused has no mark, and stays paused. Marking, pausing, resuming and clearing one VM are
ordered by the guard (``RemoteVmGuard``), which holds a lock per VM around each pair.

One file per VM under ``<root>/run/vmlend/paused/``: a reboot ends the VMs, and the marks go
with ``/run``. The file's name is a digest of the VM's name (any name is safe as a file name);
the file holds the name. A mark outlives a VM that an operator resumed or destroyed; the next
start-up drops the marks of VMs that are not paused.

The agent runs as root and a mark makes it resume a VM, so the directory must be its own: a
real directory (not a link), owned by the agent's user, writable by nobody else. Otherwise no
mark is written or read, and the log says why. Entries are opened without following links.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
from pathlib import Path

from vmlend.errors import UnsafePathError
from vmlend.safefile import kind_of, own_directory, write_atomically

log = logging.getLogger(__name__)

#: A VM name is at most a few hundred bytes; a larger file is not a mark.
_MAX_MARK_BYTES = 4096


class PauseMarks:
    """The marks in ``directory`` (made on the first mark)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    @staticmethod
    def _file(name: str) -> str:
        return hashlib.sha256(name.encode()).hexdigest()[:32]

    def _opened(self, create: bool) -> contextlib.AbstractContextManager[int | None]:
        """The directory, if it is safe to use (``safefile.own_directory``)."""
        return own_directory(self.dir, create=create)

    def mark(self, name: str) -> None:
        """Record that the agent is about to pause ``name``. A failure is logged, not raised:
        the pause matters more than its mark."""
        try:
            with self._opened(create=True):
                write_atomically(self.dir / self._file(name), name.encode(), mode=0o600)
        except (OSError, UnsafePathError) as e:
            log.warning(
                "cannot mark %s as paused by the agent in %s (%s): if this agent dies before it"
                " resumes it, resume it by hand",
                name,
                self.dir,
                e,
            )

    def clear(self, name: str) -> None:
        """The agent resumed ``name`` (or it is gone): no mark any more."""
        try:
            with self._opened(create=False) as fd:
                if fd is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._file(name), dir_fd=fd)
        except (OSError, UnsafePathError) as e:
            log.warning("cannot clear the pause mark of %s in %s: %s", name, self.dir, e)

    def names(self) -> list[str]:
        """The marked VMs (entries that are not marks are skipped; none when the marks
        cannot be read, which is logged)."""
        return self.read() or []

    def read(self) -> list[str] | None:
        """The marked VMs; None when the marks cannot be read (logged): then nobody can
        tell which paused VM is whose."""
        out = []
        try:
            with self._opened(create=False) as fd:
                if fd is None:
                    return []
                for entry in sorted(os.listdir(fd)):
                    name = _read_mark(fd, entry)
                    if name is not None and self._file(name) == entry:
                        out.append(name)
        except (OSError, UnsafePathError) as e:
            log.warning("cannot read the pause marks in %s: %s", self.dir, e)
            return None
        return sorted(out)


def _read_mark(dfd: int, entry: str) -> str | None:
    """The VM name in the regular file ``entry`` of the directory ``dfd``; None for anything
    else (a link, a FIFO, a temporary file, a file too large or not UTF-8)."""
    if entry.startswith("."):
        return None
    try:
        fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_MARK_BYTES:
            log.debug("not a pause mark: %s (%s)", entry, kind_of(st.st_mode))
            return None
        return os.read(fd, _MAX_MARK_BYTES + 1).decode()
    except (OSError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)
