"""systemd's service notification protocol (sd_notify(3)) without libsystemd: one datagram of
``KEY=value`` lines to the unix socket ``$NOTIFY_SOCKET`` names (``@name``: the abstract
namespace). Outside systemd (no ``NOTIFY_SOCKET``) every call does nothing.

The agent says ``READY=1`` once it serves: its lease is held (on a cluster registry), its
start-up reconcile is done and the hook socket accepts calls; ``WATCHDOG=1`` from its loop
while ``$WATCHDOG_USEC`` asks for it; ``STATUS=`` lines for ``systemctl status``; and
``STOPPING=1`` on its way out.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

SOCKET_ENV = "NOTIFY_SOCKET"
WATCHDOG_ENV = "WATCHDOG_USEC"
WATCHDOG_PID_ENV = "WATCHDOG_PID"


class Notifier:
    """Sends notifications for this process to the socket ``env`` names (the process's own
    environment by default). Failures are logged once and never raised: a service must not
    die because its supervisor went away."""

    def __init__(
        self, env: Mapping[str, str] | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        environ = os.environ if env is None else env
        self._clock = clock
        self._last_watchdog: float | None = None
        where = environ.get(SOCKET_ENV, "")
        self.address: str | bytes | None = None
        if where.startswith("@"):
            self.address = b"\0" + where[1:].encode()
        elif where.startswith("/"):
            self.address = where
        self.watchdog_seconds = _watchdog(environ)
        self._warned = False

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: str) -> bool:
        """One notification (``send(READY="1", STATUS="serving")``); False when not sent."""
        if self.address is None:
            return False
        payload = "".join(f"{key}={value}\n" for key, value in fields.items()).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.sendto(payload, self.address)
        except OSError as e:
            if not self._warned:
                log.warning("cannot notify the service manager at %r: %s", self.address, e)
                self._warned = True
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send(READY="1", STATUS=status, MAINPID=str(os.getpid()))

    def status(self, status: str) -> bool:
        return self.send(STATUS=status)

    def watchdog(self) -> bool:
        """A keep-alive when the manager asked for them, at most four per watchdog period
        (the loop may turn far more often); False when none was due or asked for."""
        if self.watchdog_seconds is None:
            return False
        now = self._clock()
        if (
            self._last_watchdog is not None
            and now - self._last_watchdog < self.watchdog_seconds / 4
        ):
            return False
        self._last_watchdog = now
        return self.send(WATCHDOG="1")

    def stopping(self, status: str) -> bool:
        return self.send(STOPPING="1", STATUS=status)


def _watchdog(env: Mapping[str, str]) -> float | None:
    """Seconds between keep-alives the manager expects, when it expects them of this very
    process (``WATCHDOG_PID`` unset or ours)."""
    usec = env.get(WATCHDOG_ENV, "")
    pid = env.get(WATCHDOG_PID_ENV, "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 1_000_000
