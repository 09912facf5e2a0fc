"""Run a command as the child of a process that reaps every orphan below it at once.

libvirtd double-forks QEMU, so a QEMU reparents to the nearest "child subreaper" or to PID 1.
`virDomainDestroy` returns only when the killed QEMU is gone, zombie included; an init that
reaps lazily (this machine's PID 1 takes up to ~2 s) makes each destroy that slow. As the
subreaper of the private libvirtd, this process reaps QEMU at once, as a real init would.

Usage: reaper.py COMMAND [ARG...]. SIGTERM/SIGINT/SIGHUP are forwarded to COMMAND; the exit
status is COMMAND's (128 + signal if it was killed).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> int:
    if not argv:
        sys.stderr.write("usage: reaper.py COMMAND [ARG...]\n")
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.stderr.write(f"reaper: prctl failed: {os.strerror(ctypes.get_errno())}\n")
        return 1
    child = os.fork()
    if child == 0:
        try:
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)  # dies with the reaper
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    while True:
        try:
            pid, status = os.wait()  # any child: the command or an orphan handed to us
        except ChildProcessError:
            return 1
        if pid == child:
            if os.WIFSIGNALED(status):
                return 128 + os.WTERMSIG(status)
            return os.WEXITSTATUS(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
