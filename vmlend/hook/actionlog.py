"""The hook's action log: one line per action, in a file users can find (`vmlend hook log`).

libvirt shows only a failing hook's stderr, so what the hook did on success is recorded here.
Lines are appended with O_APPEND, so concurrent hooks (two VMs starting) do not interleave.
The hook runs as root: the log is opened with O_NOFOLLOW, so a link planted at its name is
refused (``vmlend hook log`` and ``vmlend doctor`` say so) rather than appended through.
"""

from __future__ import annotations

import os
import time
from collections import deque
from pathlib import Path

from vmlend.errors import UnsafePathError
from vmlend.messages import single_line
from vmlend.safefile import open_nofollow

LOG_NAME = "hook.log"


def log_path_for_state(state_path: Path) -> Path:
    """The log lives beside the state database."""
    return state_path.parent / LOG_NAME


def one_line(text: str) -> str:
    """``text`` with every control character escaped: a domain name or a message holding a
    newline must not be able to forge a line of the log."""
    return single_line(text)


class ActionLog:
    def __init__(self, path: Path) -> None:
        self.path = path

    def record(self, domain: str, operation: str, message: str) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        line = (
            f"{stamp}Z pid={os.getpid()} vm={one_line(domain)} {one_line(operation)}:"
            f" {one_line(message)}\n"
        )
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = open_nofollow(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except (OSError, UnsafePathError):
            # The log must never be the reason a VM fails to start or stop.
            pass

    def tail(self, lines: int = 20) -> list[str]:
        """The last ``lines`` lines; ``UnsafePathError`` when a link stands at the log's name."""
        try:
            fd = open_nofollow(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return []
        with os.fdopen(fd, errors="replace") as f:
            return [line.rstrip("\n") for line in deque(f, maxlen=lines)]


class NullLog(ActionLog):
    def __init__(self) -> None:
        super().__init__(Path(os.devnull))

    def record(self, domain: str, operation: str, message: str) -> None:
        pass
