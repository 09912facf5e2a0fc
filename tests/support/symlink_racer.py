"""An attacker for file-race tests: a forked process running as an unprivileged uid that watches
a directory it owns and renames a symbolic link to a victim file over every temporary file that
appears there (what a local user does to a root process that chowns or chmods by name)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

NOBODY = 65534


def _race(directory: str, prefix: str, victim: str) -> None:
    link = os.path.join(directory, ".racer-link")
    while True:
        for name in os.listdir(directory):
            if not name.startswith(prefix):
                continue
            with contextlib.suppress(FileExistsError):
                os.symlink(victim, link)
            with contextlib.suppress(OSError):
                os.rename(link, os.path.join(directory, name))


@contextlib.contextmanager
def symlink_racer(directory: str, prefix: str, victim: str, uid: int = NOBODY) -> Iterator[int]:
    """Run the attacker as ``uid`` (the caller is root) while the block runs; yields its PID and
    kills it by that PID afterwards."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the attacker: drop every privilege first, then race until killed
        try:
            os.close(ready_r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.write(ready_w, b"1")
            os.close(ready_w)
            _race(directory, prefix, victim)
        finally:
            os._exit(0)
    os.close(ready_w)
    try:
        assert os.read(ready_r, 1) == b"1", "the attacker could not drop privileges"
    finally:
        os.close(ready_r)
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
