"""The hook's action log: one line per action, in a file users can find (`vmlend hook log`).

libvirt shows only a failing hook's stderr, so what the hook did on success is recorded here.
Lines are appended with O_APPEND, so concurrent hooks (two VMs starting) do not interleave.
The hook runs as root: the log is opened with O_NOFOLLOW, so a link planted at its name is
refused (``vmlend hook log`` and ``vmlend doctor`` say so) rather than appended through.

The file is capped: past ``max_bytes`` it becomes ``hook.log.1`` (the one before goes) and a
new one starts, and ``tail`` reads across both. Each line also goes to the system log
(``vmlend.journal``) with the VM, the operation and the device as fields, when there is one.
"""

from __future__ import annotations

import os
import time
from collections import deque
from pathlib import Path

from vmlend.errors import UnsafePathError
from vmlend.journal import Sink, current_fields, field_value
from vmlend.messages import single_line
from vmlend.safefile import open_nofollow

LOG_NAME = "hook.log"
#: Past this the log is rotated (one old file kept): a busy host's hooks cannot fill /var.
MAX_BYTES = 4 << 20


def log_path_for_state(state_path: Path) -> Path:
    """The log lives beside the state database."""
    return state_path.parent / LOG_NAME


def one_line(text: str) -> str:
    """``text`` with every control character escaped: a domain name or a message holding a
    newline must not be able to forge a line of the log."""
    return single_line(text)


class ActionLog:
    def __init__(self, path: Path, system: Sink | None = None, max_bytes: int = MAX_BYTES) -> None:
        self.path = path
        self.system = system
        self.max_bytes = max_bytes

    @property
    def previous(self) -> Path:
        return self.path.with_name(self.path.name + ".1")

    def record(self, domain: str, operation: str, message: str) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        line = (
            f"{stamp}Z pid={os.getpid()} vm={field_value(domain)} {one_line(operation)}:"
            f" {one_line(message)}\n"
        )
        if self.system is not None:
            failed = "FAILED" in message or operation in ("internal-error", "error")
            self.system.send(
                f"{field_value(domain)} {operation}: {message}",
                40 if failed else 20,  # logging.ERROR / logging.INFO, without importing it
                {**current_fields(), "vm": domain, "operation": operation},
            )
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = self._open()
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except (OSError, UnsafePathError):
            # The log must never be the reason a VM fails to start or stop.
            pass

    def _open(self) -> int:
        """The log for appending, rotated first when it is full. Concurrent hooks may both
        find it full: only the one whose file is still the log renames it."""
        fd = open_nofollow(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        st = os.fstat(fd)
        if st.st_size < self.max_bytes:
            return fd
        try:
            if os.stat(self.path, follow_symlinks=False).st_ino == st.st_ino:
                os.replace(self.path, self.previous)
        finally:
            os.close(fd)
        return open_nofollow(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)

    def tail(self, lines: int = 20) -> list[str]:
        """The last ``lines`` lines, across a rotation; ``UnsafePathError`` when a link stands
        at the log's name."""
        out: deque[str] = deque(maxlen=lines)
        for path in (self.previous, self.path):
            try:
                fd = open_nofollow(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            with os.fdopen(fd, errors="replace") as f:
                out.extend(line.rstrip("\n") for line in f)
        return list(out)


class NullLog(ActionLog):
    def __init__(self) -> None:
        super().__init__(Path(os.devnull))

    def record(self, domain: str, operation: str, message: str) -> None:
        pass
