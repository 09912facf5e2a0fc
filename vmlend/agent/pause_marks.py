"""Which VMs the agent paused itself, kept on the host so that the next agent resumes them.

The agent pauses a VM with remote devices while its lease is in doubt, and resumes it after a
renewal, or after a recovery under a new lease. An agent killed in between (kill -9, the OOM
killer, a crash) left the VM paused, and a hypervisor cannot tell that pause from an
operator's ``virsh suspend``. So the agent marks the VM here before it pauses it, and clears
the mark once it resumed it. At start-up the next agent recovers each marked VM that is still
paused: it re-reserves the devices or unplugs them, then resumes the VM. A VM an operator
paused has no mark, and stays paused.

One file per VM under ``<root>/run/vmlend/paused/``: a reboot ends the VMs, and the marks go
with ``/run``. The file's name is a digest of the VM's name (any name is safe as a file name);
the file holds the name. A mark outlives a VM that an operator resumed or destroyed; the next
start-up drops the marks of VMs that are not paused. (Not the census: its listing may predate a
pause whose mark is already written, and dropping that mark would lose the pause.)
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path

from vmlend.errors import UnsafePathError
from vmlend.safefile import read_regular, write_atomically

log = logging.getLogger(__name__)

#: A VM name is at most a few hundred bytes; a larger file is not a mark.
_MAX_MARK_BYTES = 4096


class PauseMarks:
    """The marks in ``directory`` (made on the first mark)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def _path(self, name: str) -> Path:
        return self.dir / hashlib.sha256(name.encode()).hexdigest()[:32]

    def mark(self, name: str) -> None:
        """Record that the agent is about to pause ``name``. A failure is logged, not raised:
        the pause matters more than its mark."""
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_atomically(self._path(name), name.encode(), mode=0o600)
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
        with contextlib.suppress(FileNotFoundError):
            try:
                os.unlink(self._path(name))
            except OSError as e:
                log.warning("cannot clear the pause mark of %s in %s: %s", name, self.dir, e)

    def names(self) -> list[str]:
        """The marked VMs (unreadable marks are skipped)."""
        return sorted(self._read())

    def _read(self) -> dict[str, Path]:
        out: dict[str, Path] = {}
        try:
            paths = sorted(p for p in self.dir.iterdir() if not p.name.startswith("."))
        except FileNotFoundError:
            return out
        except OSError as e:
            log.warning("cannot read the pause marks in %s: %s", self.dir, e)
            return out
        for path in paths:
            try:
                name = read_regular(path, _MAX_MARK_BYTES).decode()
            except (OSError, UnsafePathError, UnicodeDecodeError):
                continue  # a temporary file, or not ours
            if path.name == self._path(name).name:
                out[name] = path
        return out
