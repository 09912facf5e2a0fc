"""MSI/MSI-X mapped over the NTB: the device signals the VM itself (docs/design.md, mechanism 12).

The guest's MSI/MSI-X address and data stay virtual (the VMM routes the guest's vectors, as
with the relay). vmlend owns the physical message each vector sends: address ``MSI_IOVA`` in
the device's lender IOMMU domain, mapped onto an NTB segment that translates to the VM's
interrupt target page on the borrower (``vmlend.sim.msitarget``), and a data value
that selects the VM's eventfd there. An interrupt is then one posted write, resolved hop by hop
like any DMA: lender IOMMU, NTB segment, requester LUT, borrower IOMMU, target. No software
on the lender touches it. When a mapping is gone (the device was given back, reset, reclaimed
by its lender) the write faults where it stops and nothing reaches the VM.

Masking is the device's own: a masked vector sets its pending bit (MSI-X PBA, MSI pending
register) and keeps a count; unmasking sends what was held. INTx cannot cross the NTB and
stays on the relay. ``interrupt_path`` says which path a held device uses.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vmlend.errors import DmaFault, FabricError
from vmlend.irq.gate import VectorGate
from vmlend.irq.records import VectorRecorder
from vmlend.irq.vectors import ConfigIrqWatcher, IrqIndex, IrqSetup, IrqSetupSource
from vmlend.sim.msitarget import MSI_IOVA, PAGE, MsiTarget, MsiTargets

if TYPE_CHECKING:
    from vmlend.sim.backend import SimFabric
    from vmlend.sim.hardware import Borrow, SimHardware
    from vmlend.sim.resolver import Hop

log = logging.getLogger(__name__)

MESSAGE_INDEXES = (IrqIndex.MSI, IrqIndex.MSIX)
NTB = "ntb"
RELAY = "relay"


def interrupt_path(fabric: SimFabric, fdid: int, index: IrqIndex) -> str:
    """``"ntb"`` when ``fdid``'s hold was admitted with an interrupt window and ``index`` is
    MSI or MSI-X; ``"relay"`` otherwise (INTx, a local device, no window room, or the VM
    asked for the relay)."""
    if index not in MESSAGE_INDEXES:
        return RELAY
    return NTB if fabric.interrupt_window(fdid) is not None else RELAY


def open_route(
    fabric: SimFabric,
    hw: SimHardware,
    targets: MsiTargets,
    fdid: int,
    *,
    recorder: VectorRecorder | None = None,
) -> NtbMsiRoute | None:
    """The NTB route for a borrowed device whose hold was admitted with an interrupt window;
    None when its MSI/MSI-X use the relay (not asked for, or no room: the fallback)."""
    if fabric.interrupt_window(fdid) is None:
        return None
    return NtbMsiRoute(hw, targets, fdid, recorder=recorder)


class NtbMsiRoute:
    """One borrowed device's MSI/MSI-X, posted by the device through the NTB to its VM."""

    def __init__(
        self,
        hw: SimHardware,
        targets: MsiTargets,
        fdid: int,
        *,
        watcher: IrqSetupSource | None = None,
        recorder: VectorRecorder | None = None,
    ) -> None:
        borrow = hw.borrowed(fdid)
        if borrow is None:
            raise FabricError(f"device {fdid:#x} is not borrowed: borrow it before routing MSI")
        if borrow.path is None:
            raise FabricError(
                f"device {fdid:#x} is local to {borrow.node}: no NTB to map MSI over; use the relay"
            )
        self.hw = hw
        self.targets = targets
        self.fdid = fdid
        self.node, self.vm = borrow.node, borrow.vm
        self.adapter = borrow.path.src.ref
        self.device = hw.device(fdid)
        self.target: MsiTarget = targets.for_vm(borrow.node, borrow.vm)
        self._lock = threading.RLock()
        self._recorder = recorder
        window = targets.acquire_segment(self.adapter, self.node, fdid)
        try:
            # The device side last: the device can never reach a segment that leads nowhere.
            hw.lender_domain(fdid).map(MSI_IOVA, window, PAGE)
        except Exception:
            targets.release_segment(self.adapter, self.node, fdid)
            raise
        self._mapped = True
        self._closed = False
        # The route is a mapping like a DMA window: it goes in the same step as the borrow.
        self._remove_borrow_end = hw.on_borrow_end(self._borrow_ended)
        self.faults: list[DmaFault] = []
        self.last_hops: tuple[Hop, ...] = ()
        self._setup = IrqSetup()
        self._gate = VectorGate(0)
        self._first = 0  # first data value of the current vectors in the target
        self._triggers: dict[int, int] = {}  # vector -> our dup of the VM's eventfd
        self._watcher = watcher or ConfigIrqWatcher.for_device(self.device)
        self._owns_watcher = watcher is None
        self._unsubscribe = self._watcher.subscribe(self._apply)
        self._remove_sink = self.device.on_interrupt(self._on_interrupt, owner=(self.node, self.vm))
        self._apply(self._watcher.current())

    # --- the VMM's side (VFIO_DEVICE_SET_IRQS with DATA_EVENTFD|ACTION_TRIGGER) --------------
    def set_triggers(self, index: IrqIndex, fds: Sequence[int], start: int = 0) -> None:
        """The VM's eventfds for vectors ``start..`` of ``index`` (-1 de-assigns one)."""
        if index not in MESSAGE_INDEXES:
            raise FabricError(f"{index.name} cannot cross the NTB: it stays on the relay")
        with self._lock:
            for i, fd in enumerate(fds):
                vector = start + i
                old = self._triggers.pop(vector, None)
                if old is not None:
                    os.close(old)
                if fd >= 0:
                    self._triggers[vector] = os.dup(fd)
                if self._setup.index == index and vector < self._setup.count:
                    self.target.assign(self._first + vector, self._triggers.get(vector, -1))

    # --- the device's side --------------------------------------------------------------------
    def message(self, vector: int) -> tuple[int, int]:
        """The physical (address, data) ``vector`` sends: vmlend's, not the guest's."""
        with self._lock:
            if self._setup.index not in MESSAGE_INDEXES or not 0 <= vector < self._setup.count:
                raise FabricError(f"device {self.fdid:#x}: vector {vector} is not enabled")
            return MSI_IOVA, self._first + vector

    def _apply(self, setup: IrqSetup) -> None:
        with self._lock:
            if setup.shape == self._setup.shape:
                released = self._gate.set_masked(setup.masked)
                self._setup = setup
                for vector, n in released.items():
                    self._watcher.set_pending(vector, False)
                    self._post(vector, n)
                self._record()
                return
            # Raised while the old vectors were enabled: still owed to the VM.
            for vector, n in self._gate.take_all().items():
                self._post(vector, n)
            if self._setup.index in MESSAGE_INDEXES and self._setup.count:
                self.target.free(self._first, self._setup.count)
            self._setup = setup
            self._gate = VectorGate(0)
            if setup.index in MESSAGE_INDEXES and setup.count:
                self._first = self.target.allocate(setup.count)
                self._gate = VectorGate(setup.count, setup.masked)
                for vector in range(setup.count):
                    fd = self._triggers.get(vector)
                    if fd is not None:
                        self.target.assign(self._first + vector, fd)
            self._record()

    def _on_interrupt(self, vector: int) -> None:
        with self._lock:
            setup = self._setup
            if setup.index not in MESSAGE_INDEXES or vector >= setup.count:
                return  # INTx, or nothing enabled: not this path's
            if self._gate.admit(vector, 1) == 0:
                self._watcher.set_pending(vector, True)
                return
            self._post(vector, 1)

    def _post(self, vector: int, n: int) -> None:
        """The device's posted write of ``vector``'s message, ``n`` times."""
        if self._setup.index not in MESSAGE_INDEXES:
            return
        address, data = MSI_IOVA, self._first + vector
        for _ in range(n):
            try:
                hit = self.hw.resolve_dma(self.fdid, address, write=True)
            except DmaFault as fault:
                # Like any DMA whose mapping is gone: the write stops at the faulting hop.
                self.faults.append(fault)
                log.debug("MSI of %#x vector %d faulted: %s", self.fdid, vector, fault)
                return
            self.last_hops = hit.hops
            if hit.kind == "irq" and (target := self.targets.at(hit.node, hit.address)):
                target.write(hit.address - target.base, data)
            else:  # the message address now decodes as memory: it lands there, as on hardware
                self.hw.dma_write(self.fdid, address, data.to_bytes(4, "little"))

    def _record(self) -> None:
        if self._recorder is None:
            return
        setup = self._setup
        vectors: list[dict[str, object]] = []
        if setup.index in MESSAGE_INDEXES:
            for v in range(setup.count):
                vectors.append(
                    {
                        "mode": setup.index.name,
                        "vector": v,
                        "path": NTB,
                        "address": f"{MSI_IOVA:#x}",
                        "data": self._first + v,
                        "via": self.adapter,
                        "masked": v in setup.masked,
                    }
                )
        self._recorder(self.fdid, vectors)

    def repoint(self) -> None:
        """A hot migration moved the device's borrow to its VM on another node: the route
        follows it. The device's map to the old node's interrupt target goes with its segment,
        a segment towards the VM's target on the new node is mapped instead, the enabled
        vectors are allocated there with the same eventfds, and the sink names the new owner.
        Interrupts the gate holds pending stay pending. The device must be stopped meanwhile
        (``SimDevice.latch``): none is posted half way."""
        borrow = self.hw.borrowed(self.fdid)
        if borrow is None or borrow.path is None:
            raise FabricError(
                f"device {self.fdid:#x} is not borrowed across the NTB: no route to re-point"
            )
        with self._lock:
            self._unmap()
            counted = self._setup.index in MESSAGE_INDEXES and self._setup.count
            if counted:
                self.target.free(self._first, self._setup.count)
            self.node, self.vm = borrow.node, borrow.vm
            self.adapter = borrow.path.src.ref
            self.target = self.targets.for_vm(self.node, self.vm)
            window = self.targets.acquire_segment(self.adapter, self.node, self.fdid)
            try:
                self.hw.lender_domain(self.fdid).map(MSI_IOVA, window, PAGE)
            except Exception:
                self.targets.release_segment(self.adapter, self.node, self.fdid)
                raise
            self._mapped = True
            if counted:
                self._first = self.target.allocate(self._setup.count)
                for vector in range(self._setup.count):
                    fd = self._triggers.get(vector)
                    if fd is not None:
                        self.target.assign(self._first + vector, fd)
            self._remove_sink()
            self._remove_sink = self.device.on_interrupt(
                self._on_interrupt, owner=(self.node, self.vm)
            )
            self._record()

    def _borrow_ended(self, borrow: Borrow) -> None:
        if borrow.fdid == self.fdid:
            self._unmap()
            # the route is dead with the borrow: the device's next owner's interrupts must not
            # reach this VM's eventfds, nor this route post into the next owner's target
            self._remove_sink()

    def _unmap(self) -> None:
        """The device's side first, then the segment. Idempotent."""
        with self._lock:
            if not self._mapped:
                return
            self.hw.lender_domain(self.fdid).unmap(MSI_IOVA, PAGE)
            self.targets.release_segment(self.adapter, self.node, self.fdid)
            self._mapped = False

    def close(self) -> None:
        """Unmap the device's side first, then free the target's vectors and the segment.
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._remove_sink()
            self._unsubscribe()
            self._remove_borrow_end()
            if self._owns_watcher:
                self._watcher.close()
            self._unmap()
            if self._setup.index in MESSAGE_INDEXES and self._setup.count:
                self.target.free(self._first, self._setup.count)
            for fd in self._triggers.values():
                os.close(fd)
            self._triggers.clear()
            self._setup = IrqSetup()
            if self._recorder is not None:
                self._recorder(self.fdid, None)
