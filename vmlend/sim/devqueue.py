"""A simulated device's command engine, reduced to what a hot migration's switch-over needs.

The guest's driver submits commands (an NVMe submission queue entry, a GPU copy-engine push);
the device *fetches* (accepts) them when it is running, and *completes* them later, each with
a DMA write into guest memory through whatever mappings are current (an NVMe read's data and
its completion entry, a GPU copy's destination). Between fetch and completion a command is in
flight: its TLPs are what must not cross a switch-over.

``quiesce`` is the device kind's stop (``vmlend.lending.quiesce``): everything fetched
completes, nothing new is fetched, interrupts are held pending (``SimDevice.latch``). A kind
whose driver cannot do it refuses with ``QuiesceError``. ``resume`` lets it run again where
its mappings now point, fetches what waits, and sends the interrupts it held.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import msgspec

from vmlend.errors import QuiesceError
from vmlend.lending.quiesce import how_to_quiesce
from vmlend.sim.hardware import SimHardware
from vmlend.sim.resolver import DmaTarget


class Command(msgspec.Struct, frozen=True):
    """One command: when done, the device writes ``data`` at guest-physical ``gpa``; then
    raises ``vector`` (None: no interrupt)."""

    id: int
    gpa: int
    data: bytes
    vector: int | None = None


class Accepted(msgspec.Struct, frozen=True):
    """A command the device fetched: on which node its borrower ran, and when."""

    id: int
    node: str
    at: float


class DeviceQueue:
    """The command engine of borrowed device ``fdid`` on ``hw``."""

    def __init__(
        self, hw: SimHardware, fdid: int, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.hw = hw
        self.fdid = fdid
        self.device = hw.device(fdid)
        self.kind = self.device.spec.kind
        self.clock = clock
        self._next = 1
        self._submitted: deque[Command] = deque()  # in the guest's queue, not fetched
        self._in_flight: deque[Command] = deque()  # fetched, not completed
        self.accepted: list[Accepted] = []
        self.done: dict[int, list[DmaTarget]] = {}  # command id -> where its write landed
        self.stopped = False

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def waiting(self) -> int:
        return len(self._submitted)

    def submit(self, gpa: int, data: bytes, vector: int | None = None) -> int:
        """The guest queues a command (it sits in guest memory until the device fetches it)."""
        cmd = Command(self._next, gpa, data, vector)
        self._next += 1
        self._submitted.append(cmd)
        return cmd.id

    def fetch(self, n: int | None = None) -> list[int]:
        """The device accepts up to ``n`` waiting commands (all: None); none while stopped."""
        if self.stopped:
            return []
        out: list[int] = []
        borrow = self.hw.borrowed(self.fdid)
        node = borrow.node if borrow is not None else ""
        while self._submitted and (n is None or len(out) < n):
            cmd = self._submitted.popleft()
            self._in_flight.append(cmd)
            self.accepted.append(Accepted(cmd.id, node, self.clock()))
            out.append(cmd.id)
        return out

    def complete(self, n: int | None = None) -> list[int]:
        """Up to ``n`` fetched commands (all: None) finish: their DMA writes land where the
        mappings point now, then their interrupts are raised."""
        out: list[int] = []
        while self._in_flight and (n is None or len(out) < n):
            cmd = self._in_flight.popleft()
            self.done[cmd.id] = self.hw.dma_write(self.fdid, cmd.gpa, cmd.data)
            if cmd.vector is not None:
                self.device.raise_interrupt(cmd.vector)
            out.append(cmd.id)
        return out

    def quiesce(self) -> None:
        """Stop for a switch-over: ``QuiesceError`` (nothing changed) when this kind's driver
        cannot; else what was fetched completes, nothing more is fetched, and interrupts are
        held pending until ``resume``."""
        if how_to_quiesce(self.kind) is None:
            raise QuiesceError(
                self.fdid, self.kind, "its driver does not implement the migration states"
            )
        self.device.latch()
        self.stopped = True
        self.complete()

    def resume(self) -> float:
        """Run again: send the held interrupts, fetch what waits. Returns when the device
        accepted its first command again (now, when none waits: it is ready for one)."""
        self.stopped = False
        self.device.unlatch()
        before = len(self.accepted)
        ready = self.clock()
        return self.accepted[before].at if self.fetch() else ready
