"""Command deadlines on an injected clock: a command times out when the clock says so.

A driver starts a command's timer when it sends the command and stops it when the command's
completion arrives; ``expired`` names the commands whose deadline has passed on ``clock``.
Nothing fires on its own: whoever owns the timer asks (``expired``) where a real driver's
timer interrupt would run, and a test moves the clock it injected (``FakeClock``) to say that
the time has passed, so no test waits for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from vmlend.errors import ConfigError

#: Linux's NVMe I/O timeout (``nvme_core.io_timeout``), in seconds.
COMMAND_TIMEOUT = 30.0

Clock = Callable[[], float]
K = TypeVar("K", bound=Hashable)


class CommandTimer(Generic[K]):
    """The deadline of each outstanding command, by key."""

    def __init__(self, timeout: float = COMMAND_TIMEOUT, clock: Clock = time.monotonic) -> None:
        if not timeout > 0:
            raise ConfigError(f"a command timeout must be positive seconds, not {timeout!r}")
        self.timeout = timeout
        self.clock = clock
        self._deadlines: dict[K, float] = {}

    def __len__(self) -> int:
        return len(self._deadlines)

    def start(self, key: K) -> None:
        """``key`` was sent now: it times out ``timeout`` seconds from now (a command sent
        again starts over)."""
        self._deadlines[key] = self.clock() + self.timeout

    def stop(self, key: K) -> bool:
        """``key`` completed (or was given up): no deadline. False when it had none."""
        return self._deadlines.pop(key, None) is not None

    def clear(self) -> None:
        """Every command was aborted (a controller reset): no deadline left."""
        self._deadlines.clear()

    def expired(self) -> list[K]:
        """The keys whose deadline has passed on the clock, earliest first."""
        now = self.clock()
        late = [(d, k) for k, d in self._deadlines.items() if d <= now]
        return [k for _, k in sorted(late, key=lambda dk: dk[0])]
