"""Interrupts of one simulated VM, end to end in this process.

The guest's driver enables MSI-X (or MSI) in the device's config space and MSI-X table, as a
guest does; the VMM gives one eventfd per vector (``VFIO_DEVICE_SET_IRQS``). A device lent by
another node is relayed: ``LenderRelay`` on its lender follows the guest's writes and sends
each interrupt over a SOCK_SEQPACKET channel to the VM node's ``BorrowerRelay``, which signals
the VM's eventfd. A device installed in the VM's own node needs no relay: the lender's kernel
(``SimIrqHost``, vfio-pci) signals the VM's eventfds itself, as with local pass-through.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import time
from collections.abc import Callable

import msgspec

from vmlend.errors import RelayError
from vmlend.irq import vectors as r
from vmlend.irq.borrower import BorrowerRelay
from vmlend.irq.eventfd import EventFd
from vmlend.irq.lender import LenderRelay
from vmlend.irq.relay import Reactor
from vmlend.irq.vectors import IrqIndex
from vmlend.irq.vfio import TRIGGER_EVENTFDS, SimIrqHost
from vmlend.sim.device import SimDevice
from vmlend.sim.ntbmsi import MESSAGE_INDEXES, NtbMsiRoute
from vmlend.sim.simvm import SimVm

log = logging.getLogger(__name__)

#: The x86 MSI address a guest programs (the local APIC window) and the first data value.
MSI_ADDRESS = 0xFEE0_0000
MSI_DATA = 0x4020


def enable_guest_interrupts(vm: SimVm, fdid: int) -> tuple[IrqIndex, int]:
    """What the guest driver does after enabling the device: every MSI-X vector programmed
    and unmasked then MSI-X on; else one MSI vector; else INTx stays. Returns (mode, vectors)."""
    session = vm.session(fdid)
    spec = session.device.spec
    config = session.device.config
    if spec.msix is not None:
        msix = spec.msix
        cap = config.find_capability(r.CAP_ID_MSIX)
        assert cap is not None, "the device spec has MSI-X, so its config space does"
        table_bar = session.guest_bar(msix.table_bar)
        if table_bar is None:
            raise RelayError(f"device {fdid:#x}: the guest has not placed BAR {msix.table_bar}")
        for v in range(msix.vectors):
            entry = table_bar + msix.table_offset + v * r.MSIX_ENTRY_SIZE
            vm.mmio_write(entry + r.MSIX_ENTRY_ADDR_LO, 4, MSI_ADDRESS)
            vm.mmio_write(entry + r.MSIX_ENTRY_ADDR_HI, 4, 0)
            vm.mmio_write(entry + r.MSIX_ENTRY_DATA, 4, MSI_DATA + v)
            vm.mmio_write(entry + r.MSIX_ENTRY_CTRL, 4, 0)  # unmasked
        flags = vm.config_read(fdid, cap + r.MSIX_FLAGS, 2) & ~r.MSIX_FLAGS_MASKALL
        vm.config_write(fdid, cap + r.MSIX_FLAGS, 2, flags | r.MSIX_FLAGS_ENABLE)
        return IrqIndex.MSIX, msix.vectors
    if spec.msi is not None:
        cap = config.find_capability(r.CAP_ID_MSI)
        assert cap is not None, "the device spec has MSI, so its config space does"
        flags = vm.config_read(fdid, cap + r.MSI_FLAGS, 2)
        wide = bool(flags & r.MSI_FLAGS_64BIT)
        vm.config_write(fdid, cap + r.MSI_ADDR_LO, 4, MSI_ADDRESS)
        if wide:
            vm.config_write(fdid, cap + r.MSI_ADDR_HI, 4, 0)
        vm.config_write(fdid, cap + (r.MSI_DATA_64 if wide else r.MSI_DATA_32), 2, MSI_DATA)
        single = flags & ~r.MSI_FLAGS_QSIZE  # one vector: QSIZE 0
        vm.config_write(fdid, cap + r.MSI_FLAGS, 2, single | r.MSI_FLAGS_ENABLE)
        return IrqIndex.MSI, 1
    return IrqIndex.INTX, 1


class WiredDevice(msgspec.Struct):
    """One device's vectors as the VM sees them."""

    fdid: int
    index: IrqIndex
    eventfds: list[EventFd]
    path: str  # how interrupts travel: "relay alpha->gamma" or "vfio (local)"
    teardown: Callable[[], None]

    def json(self) -> dict[str, object]:
        return {
            "fdid": f"{self.fdid:#x}",
            "mode": self.index.name,
            "vectors": len(self.eventfds),
            "path": self.path,
        }


#: The NTB route of a borrowed device, or None when its MSI/MSI-X use the relay.
OpenNtbRoute = Callable[[int], NtbMsiRoute | None]


class VmInterrupts:
    """The eventfds of one VM on ``node`` and what feeds them. ``close`` stops every thread.

    ``open_ntb`` (``vmlend.sim.ntbmsi.open_route`` bound to the cluster) maps a remote device's
    MSI/MSI-X over the NTB when its hold was admitted with an interrupt window; everything else
    (INTx, no window) goes through the relay."""

    def __init__(self, node: str, open_ntb: OpenNtbRoute | None = None) -> None:
        self.node = node
        self._open_ntb = open_ntb
        self._reactor = Reactor()
        self._reactor.start(f"irq-vm-{node}")
        self.borrower = BorrowerRelay(self._reactor)
        self.devices: dict[int, WiredDevice] = {}

    def wire(self, device: SimDevice, index: IrqIndex, vectors: int) -> WiredDevice:
        """Give ``device``'s ``vectors`` vectors of mode ``index`` one VM eventfd each."""
        if device.fdid in self.devices:
            return self.devices[device.fdid]
        efds = [EventFd() for _ in range(vectors)]
        try:
            if device.lender == self.node:
                wired = self._wire_local(device, index, efds)
            else:
                wired = self._wire_ntb(device, index, efds) or self._wire_relay(device, index, efds)
        except BaseException:
            for e in efds:
                e.close()
            raise
        self.devices[device.fdid] = wired
        return wired

    def _wire_local(self, device: SimDevice, index: IrqIndex, efds: list[EventFd]) -> WiredDevice:
        host = SimIrqHost(device)
        try:
            host.set_irqs(index, TRIGGER_EVENTFDS, 0, [e.fileno() for e in efds])
        except BaseException:
            host.close()
            raise
        return WiredDevice(device.fdid, index, efds, "vfio (local)", host.close)

    def _wire_ntb(
        self, device: SimDevice, index: IrqIndex, efds: list[EventFd]
    ) -> WiredDevice | None:
        if self._open_ntb is None or index not in MESSAGE_INDEXES:
            return None
        route = self._open_ntb(device.fdid)
        if route is None:
            return None
        try:
            route.set_triggers(index, [e.fileno() for e in efds])
        except BaseException:
            route.close()
            raise
        path = f"ntb {device.lender}->{self.node} (no lender software)"
        return WiredDevice(device.fdid, index, efds, path, route.close)

    def _wire_relay(self, device: SimDevice, index: IrqIndex, efds: list[EventFd]) -> WiredDevice:
        # One lender relay (its own thread, as the lender's process) per device, so removing
        # one device never disturbs another's channel.
        reactor = Reactor()
        reactor.start(f"irq-lender-{device.lender}")
        lender = LenderRelay(reactor)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fdid = device.fdid
        try:
            self.borrower.attach([fdid], theirs)
            lender.add_sim_device(device, lender.open_channel(mine))
            self.borrower.set_irqs(
                fdid, index, TRIGGER_EVENTFDS, 0, [os.dup(e.fileno()) for e in efds]
            )
        except BaseException:
            reactor.stop()
            if fdid in self.borrower.devices():
                self.borrower.release(fdid)
            lender.close()
            reactor.close()
            raise

        def teardown() -> None:
            # The lender stops first: the borrower hanging up then wakes nobody.
            reactor.stop()
            self.borrower.release(fdid)
            lender.close()
            reactor.close()

        return WiredDevice(fdid, index, efds, f"relay {device.lender}->{self.node}", teardown)

    def unwire(self, fdid: int) -> None:
        wired = self.devices.pop(fdid, None)
        if wired is None:
            return
        wired.teardown()
        for e in wired.eventfds:
            e.close()

    def fire(self, device: SimDevice, count: int, timeout: float = 5.0) -> list[int]:
        """Raise ``count`` interrupts on the lender, spread over the device's vectors, and
        return what the VM read from each eventfd (waits until all arrived or ``timeout``)."""
        wired = self.devices[device.fdid]
        n = len(wired.eventfds)
        for i in range(count):
            device.raise_interrupt(i % n)
        got = [0] * n
        deadline = time.monotonic() + timeout
        while sum(got) < count and time.monotonic() < deadline:
            ready, _, _ = select.select(wired.eventfds, [], [], 0.05)
            for efd in ready:
                got[wired.eventfds.index(efd)] += efd.drain()
        return got

    def close(self) -> None:
        for fdid in list(self.devices):
            self.unwire(fdid)
        self._reactor.stop()
        self.borrower.close()
        self._reactor.close()
