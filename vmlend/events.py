"""The protocol's events as JSON lines, for the replay through its model (issue 35, point 10).

The nemesis test (``tests/scenarios/test_nemesis.py``) names a directory in ``$VMLEND_EVENTS``;
every process of its simulated cluster then appends what it did to ``events.jsonl`` there: the
agent its lease (granted, adopted, renewed, lost, followed) and its VMs' pauses and resumes,
the sim backend a reserve and a release with the hold's fencing token (each call bracketed by
``-begun`` and ``-done``: a process killed in it leaves the bracket open), the lender register
every serve, end and take-back at the device (written under the device's lock, so their order
per device is the device's), the test its kills and restarts of agents. The checker
(``tests/support/replay.py``) replays them through the protocol's model.

Unset (production), ``from_env`` gives None and nothing is written. One ``os.write`` of a whole
line on a file opened with ``O_APPEND``: lines of concurrent processes never interleave.
Each line: ``t`` (wall time, seconds since the epoch), ``pid``, ``seq`` (per process, from 0),
``actor`` (a node, or "" when the event names its own), ``kind``, and the event's fields.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path

import msgspec

#: The directory of the event log; unset: no events.
EVENTS_ENV = "VMLEND_EVENTS"
#: The file under it every process appends to.
EVENTS_FILE = "events.jsonl"

Field = str | int | float | bool | list[int] | None


def wall(mono: float) -> float:
    """A ``time.monotonic`` reading as wall time (what the events are ordered by)."""
    return time.time() - (time.monotonic() - mono)


class EventLog:
    """Appends events of ``actor`` to ``directory``/events.jsonl."""

    def __init__(self, directory: Path, actor: str = "") -> None:
        self.path = directory / EVENTS_FILE
        self.actor = actor
        self._lock = threading.Lock()
        self._seq = itertools.count()

    @classmethod
    def from_env(cls, actor: str = "") -> EventLog | None:
        """The log ``$VMLEND_EVENTS`` names; None when it names none."""
        where = os.environ.get(EVENTS_ENV)
        return cls(Path(where), actor) if where else None

    def note(self, kind: str, **fields: Field) -> None:
        """One event, stamped now. Never raises: the log must not change what it records."""
        with self._lock:  # seq and t in one order within the process
            record = {"t": time.time(), "pid": os.getpid(), "seq": next(self._seq),
                      "actor": self.actor, "kind": kind, **fields}
            line = msgspec.json.encode(record) + b"\n"
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line)
                finally:
                    os.close(fd)
            except OSError:
                pass
