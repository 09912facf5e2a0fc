"""What systemd would do with vmlend's units, where systemd is not PID 1 (these machines): check
a unit with systemd-analyze, read its ExecStart, and be the service manager's end of sd_notify
(a datagram socket the test binds) while the test runs that ExecStart itself."""

from __future__ import annotations

import shlex
import shutil
import socket
import subprocess
import time
from pathlib import Path

#: A bound on waiting for a daemon that hangs, not a timing assertion.
WAIT = 60.0


def verify_units(*units: Path) -> None:
    """systemd-analyze accepts ``units`` and says nothing about them (it exits 0 on mere
    warnings, such as an unknown Type=, so its output must be empty too)."""
    tool = shutil.which("systemd-analyze")
    assert tool, "systemd-analyze is missing (Debian: systemd)"
    run = subprocess.run(
        [tool, "verify", "--man=no", *map(str, units)], capture_output=True, text=True
    )
    assert (run.returncode, run.stdout + run.stderr) == (0, "")


def exec_start(unit: Path) -> list[str]:
    """The command a unit's ExecStart= runs."""
    for line in unit.read_text().splitlines():
        if line.startswith("ExecStart="):
            return shlex.split(line.removeprefix("ExecStart="))
    raise AssertionError(f"no ExecStart in {unit}")


class NotifySocket:
    """The service manager's end of sd_notify: a datagram socket the test binds (also usable
    as journald's, whose entries are ``KEY=value`` lines too)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.5)
        self.seen: list[dict[str, str]] = []

    def wait_for(self, key: str, proc: subprocess.Popen, log: Path) -> dict[str, str]:
        """The first message carrying ``key`` from ``proc``, which must keep running."""
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            try:
                data = self.sock.recv(65536).decode()
            except TimeoutError:
                continue
            message = dict(line.split("=", 1) for line in data.splitlines() if "=" in line)
            self.seen.append(message)
            if key in message:
                return message
        raise AssertionError(f"no {key} from the service\n{log.read_text()}")

    def close(self) -> None:
        self.sock.close()
