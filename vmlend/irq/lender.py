"""The lender side: eventfds for the device's enabled vectors, gated by the guest's masks.

For each device it follows the guest's interrupt set-up (an ``IrqSetupSource``): when the set
of vectors changes it de-assigns and closes the old eventfds and hands new ones to the host
(``VFIO_DEVICE_SET_IRQS``); when only masks change it releases what was pending. Each
interrupt read from an eventfd goes through the device's ``VectorGate`` to the transport.
"""

from __future__ import annotations

import logging
import select
import socket
from collections.abc import Callable, Sequence
from typing import Protocol

from vmlend.errors import RelayError
from vmlend.irq.eventfd import EventFd
from vmlend.irq.gate import VectorGate
from vmlend.irq.relay import Reactor
from vmlend.irq.transport import Channel, Kind, Record
from vmlend.irq.vectors import (
    DISABLED,
    ConfigIrqWatcher,
    IrqIndex,
    IrqSetup,
    IrqSetupSource,
    SimDeviceLike,
)
from vmlend.irq.vfio import (
    DISABLE,
    TRIGGER_EVENTFDS,
    UNMASK_EVENTFD,
    InterruptSource,
    IrqHost,
    SimIrqHost,
)

log = logging.getLogger(__name__)


class Closeable(Protocol):
    def close(self) -> None: ...


class SimLike(SimDeviceLike, InterruptSource, Protocol):
    @property
    def fdid(self) -> int: ...


class LenderDevice:
    """One lent device's vectors. Everything runs under the reactor's lock."""

    def __init__(
        self,
        fdid: int,
        source: IrqSetupSource,
        host: IrqHost,
        channel: Channel,
        reactor: Reactor,
    ) -> None:
        self.fdid = fdid
        self._source = source
        self._host = host
        self._channel = channel
        self._reactor = reactor
        self._setup = DISABLED
        self._triggers: dict[int, EventFd] = {}
        self._unmask: EventFd | None = None
        self._gate = VectorGate(0)
        self.raised = 0
        with reactor.lock:
            # Subscribe first: a guest write landing in between is then not missed.
            self._unsubscribe = source.subscribe(self._on_setup)
            try:
                self._apply(source.current())
            except RelayError:
                self._unsubscribe()
                raise

    @property
    def setup(self) -> IrqSetup:
        return self._setup

    def trigger_fds(self) -> dict[int, int]:
        """vector -> the lender eventfd the host signals (what a benchmark writes to)."""
        return {v: e.fileno() for v, e in self._triggers.items()}

    def pending(self) -> dict[int, int]:
        return self._gate.pending()

    def _on_setup(self, setup: IrqSetup) -> None:
        # Called from the guest's config write: a failure here must not fail that write
        # (hardware does not refuse a config write); the vectors simply stay down.
        with self._reactor.lock:
            try:
                self._apply(setup)
            except RelayError as e:
                log.error("device %#x: cannot set up interrupts: %s", self.fdid, e)

    def _apply(self, new: IrqSetup) -> None:
        old = self._setup
        if new.shape != old.shape:
            self._teardown()
            self._setup = new
            self._build()
            return
        self._setup = new
        for vector, n in self._gate.set_masked(new.masked).items():
            self._source.set_pending(vector, False)
            self._send(vector, n)

    def _build(self) -> None:
        setup = self._setup
        if setup.index is None:
            return
        self._gate = VectorGate(setup.count, setup.masked)
        self._triggers = {v: EventFd() for v in range(setup.count)}
        try:
            self._host.set_irqs(
                setup.index, TRIGGER_EVENTFDS, 0, [e.fileno() for e in self._triggers.values()]
            )
            if setup.index == IrqIndex.INTX:
                self._unmask = EventFd()
                self._host.set_irqs(IrqIndex.INTX, UNMASK_EVENTFD, 0, [self._unmask.fileno()])
        except RelayError:
            self._close_fds()
            self._setup = DISABLED
            raise
        for vector, efd in self._triggers.items():
            self._reactor.register(efd.fileno(), select.EPOLLIN, self._make_reader(vector))
        log.info("device %#x: %s x%d set up", self.fdid, IrqIndex(setup.index).name, setup.count)

    def _make_reader(self, vector: int) -> Callable[[int], None]:
        efd = self._triggers[vector]

        def read(_events: int) -> None:
            n = efd.drain()
            if n:
                self._admit(vector, n)

        return read

    def _admit(self, vector: int, n: int) -> None:
        self.raised += n
        deliver = self._gate.admit(vector, n)
        if deliver:
            self._send(vector, deliver)
        else:
            self._source.set_pending(vector, True)

    def _send(self, vector: int, n: int) -> None:
        index = self._setup.index
        assert index is not None
        self._channel.post(Kind.IRQ, index, vector, self.fdid, n)

    def unmask_intx(self) -> None:
        """The VM handled the INTx interrupt: re-arm the line (the host re-signals if asserted)."""
        if self._unmask is not None:
            self._unmask.signal()

    def _teardown(self) -> None:
        setup = self._setup
        if setup.index is None:
            return
        self._host.set_irqs(setup.index, DISABLE, 0, [])
        # Interrupts raised before the guest disabled the vectors are owed to it.
        for vector, efd in self._triggers.items():
            n = efd.drain()
            if n:
                self._admit(vector, n)
        for vector, n in self._gate.take_all().items():
            self._source.set_pending(vector, False)
            self._send(vector, n)
        self._close_fds()
        log.info("device %#x: %s torn down", self.fdid, IrqIndex(setup.index).name)
        self._setup = DISABLED

    def _close_fds(self) -> None:
        for efd in self._triggers.values():
            self._reactor.unregister(efd.fileno())
            efd.close()
        self._triggers = {}
        if self._unmask is not None:
            self._unmask.close()
            self._unmask = None
        self._gate = VectorGate(0)

    def close(self) -> None:
        self._unsubscribe()
        with self._reactor.lock:
            self._teardown()


class LenderRelay:
    """All devices a lender relays, one reactor, one channel per borrower."""

    def __init__(self, reactor: Reactor) -> None:
        self._reactor = reactor
        self._devices: dict[int, LenderDevice] = {}
        self._channels: dict[Channel, set[int]] = {}
        self._owned: dict[int, list[Closeable]] = {}

    def open_channel(self, sock: socket.socket) -> Channel:
        """Take one end of a transport to a borrower (a connected SOCK_SEQPACKET socket)."""
        channel = Channel(sock, self._reactor, self._on_records, self._on_channel_closed)
        self._channels[channel] = set()
        return channel

    def add_device(
        self,
        fdid: int,
        source: IrqSetupSource,
        host: IrqHost,
        channel: Channel,
        owns: Sequence[Closeable] = (),
    ) -> LenderDevice:
        """Relay ``fdid``'s interrupts to ``channel``; ``owns`` are closed with the device."""
        with self._reactor.lock:
            if fdid in self._devices:
                raise RelayError(f"device {fdid:#x} is already relayed by this lender")
            device = LenderDevice(fdid, source, host, channel, self._reactor)
            self._devices[fdid] = device
            self._owned[fdid] = list(owns)
            self._channels.setdefault(channel, set()).add(fdid)
            return device

    def add_sim_device(self, device: SimLike, channel: Channel) -> LenderDevice:
        """Relay a simulated device: its config space drives the vectors, ``SimIrqHost`` plays
        the lender's kernel. Both are closed when the device is removed."""
        host = SimIrqHost(device)
        watcher = ConfigIrqWatcher.for_device(device)
        try:
            return self.add_device(device.fdid, watcher, host, channel, owns=(watcher, host))
        except RelayError:
            watcher.close()
            host.close()
            raise

    def remove_device(self, fdid: int) -> None:
        with self._reactor.lock:
            device = self._devices.pop(fdid, None)
            if device is None:
                return
            device.close()
            for owned in self._owned.pop(fdid, []):
                owned.close()
            for fdids in self._channels.values():
                fdids.discard(fdid)

    def device(self, fdid: int) -> LenderDevice:
        return self._devices[fdid]

    def _on_records(self, records: list[Record]) -> None:
        for kind, _index, _vector, fdid, _count in records:
            if kind == Kind.UNMASK and (device := self._devices.get(fdid)) is not None:
                device.unmask_intx()

    def _on_channel_closed(self, channel: Channel) -> None:
        # The borrower is gone; the devices keep running (the lender never waits for it) and
        # what they raise is counted as dropped until the device is removed or re-borrowed.
        log.warning(
            "borrower of devices %s hung up", sorted(f"{f:#x}" for f in self._channels[channel])
        )

    def close(self) -> None:
        with self._reactor.lock:
            for fdid in list(self._devices):
                self.remove_device(fdid)
            for channel in self._channels:
                channel.close()
            self._channels.clear()
