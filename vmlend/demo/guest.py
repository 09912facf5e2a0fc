"""The demo's guests: what QEMU, the firmware and the guest OS drivers would do on one node.

``DemoGuest`` is the simulated hypervisor's ``GuestDriver``. When the node starts a domain it
builds a ``SimVm`` (guest RAM, one pass-through session per mdev the hook created, a
peer-to-peer mapper); nothing is enabled yet, so nothing is borrowed. ``load_drivers`` is the
guest's OS probing its devices: BARs, memory decoding (the deferred borrow), Bus Master (the DMA
windows), then MSI-X/MSI with the VM's eventfds. A live hot-add runs the same probe for the new
device; a hot-remove and a stop take it all down again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import msgspec
from lxml import etree

from vmlend.demo.interrupts import VmInterrupts, WiredDevice, enable_guest_interrupts
from vmlend.errors import FabricError, VmlendError
from vmlend.irq.records import VectorRecorder
from vmlend.sim.backend import SimFabric
from vmlend.sim.dmawin import WindowLedger
from vmlend.sim.hardware import Borrow, SimHardware
from vmlend.sim.hypervisor.node import IdleGuest
from vmlend.sim.msitarget import MsiTargets
from vmlend.sim.ntbmsi import NtbMsiRoute, open_route
from vmlend.sim.p2pmap import P2PMapper, Recorder
from vmlend.sim.simvm import SimVm

log = logging.getLogger(__name__)


class GuestWorld(Protocol):
    """What a node's guests need of the simulated cluster."""

    @property
    def hw(self) -> SimHardware: ...

    @property
    def ledger(self) -> WindowLedger: ...

    @property
    def backing(self) -> int: ...

    @property
    def msi_targets(self) -> MsiTargets: ...

    def fabric(self, node: str) -> SimFabric: ...

    def p2p_recorder(self) -> Recorder: ...

    def vector_recorder(self) -> VectorRecorder: ...


class RunningGuest(msgspec.Struct):
    vm: SimVm
    p2p: P2PMapper
    irqs: VmInterrupts
    unsubscribe: Callable[[], None]  # stops following the hardware's borrow ends


def _mdev_uuid(device_xml: bytes) -> str:
    el = etree.fromstring(device_xml).find("source/address")
    return "" if el is None else el.get("uuid", "")


class DemoGuest(IdleGuest):
    """The guests of the simulated node ``node``."""

    def __init__(self, world: GuestWorld, node: str) -> None:
        self.world = world
        self.node = node
        self.running: dict[str, RunningGuest] = {}

    def guest(self, name: str) -> RunningGuest:
        try:
            return self.running[name]
        except KeyError:
            raise FabricError(f"no guest {name!r} runs on {self.node}") from None

    # --- GuestDriver --------------------------------------------------------------------------
    def on_started(self, name: str, domain_xml: bytes) -> None:
        hw = self.world.hw
        p2p = P2PMapper(
            hw, self.node, name, recorder=self.world.p2p_recorder(), promises=self.world.ledger
        )
        vm = SimVm(
            domain_xml,
            hardware=hw,
            fabric=self.world.fabric(self.node),
            ledger=self.world.ledger,
            p2p=p2p,
            backing=self.world.backing,
        )
        irqs = VmInterrupts(self.node, self._open_ntb)

        def borrow_ended(borrow: Borrow) -> None:
            # the device's interrupts stop reaching this VM in the same step as its DMA; the
            # vector records go when the device leaves the guest (no registry write here: the
            # borrow may end inside the fabric's transaction)
            if (borrow.node, borrow.vm) == (self.node, name):
                irqs.unwire(borrow.fdid)

        self.running[name] = RunningGuest(vm, p2p, irqs, hw.on_borrow_end(borrow_ended))

    def _open_ntb(self, fdid: int) -> NtbMsiRoute | None:
        world = self.world
        return open_route(world.fabric(self.node), world.hw, world.msi_targets, fdid)

    def on_device_added(self, name: str, device_xml: bytes) -> None:
        g = self.guest(name)
        fdid = self._fdid_of(device_xml)
        g.vm.add_device(fdid)
        try:
            self.probe(name, fdid)
        except VmlendError:
            self._remove(g, fdid)
            raise

    def on_device_removed(self, name: str, device_xml: bytes) -> None:
        g = self.running.get(name)
        if g is None:
            return
        fdid = self._fdid_of(device_xml)
        if fdid in g.vm.devices():
            self._remove(g, fdid)

    def on_stopped(self, name: str) -> None:
        g = self.running.pop(name, None)
        if g is None:  # a domain this process did not start (a leftover being cleaned up)
            return
        for fdid in g.vm.devices():  # the vectors end with the guest, like its DMA windows
            self.world.vector_recorder()(fdid, None)
        g.irqs.close()
        g.vm.stop()
        g.p2p.close()
        g.unsubscribe()

    # --- the guest OS ---------------------------------------------------------------------------
    def load_drivers(self, name: str) -> list[WiredDevice]:
        """Probe every device of the guest, as its drivers do at boot."""
        g = self.guest(name)
        return [self.probe(name, fdid) for fdid in g.vm.devices()]

    def probe(self, name: str, fdid: int) -> WiredDevice:
        """One driver's probe: enable the device (borrow, windows), then its interrupts."""
        g = self.guest(name)
        g.vm.enable_device(fdid)
        index, vectors = enable_guest_interrupts(g.vm, fdid)
        wired = g.irqs.wire(self.world.hw.device(fdid), index, vectors)
        self.world.vector_recorder()(
            fdid,
            [
                {"mode": index.name, "vector": i, "path": wired.path}
                for i in range(len(wired.eventfds))
            ],
        )
        return wired

    def _remove(self, g: RunningGuest, fdid: int) -> None:
        self.world.vector_recorder()(fdid, None)
        g.irqs.unwire(fdid)
        g.vm.remove_device(fdid)

    def _fdid_of(self, device_xml: bytes) -> int:
        uuid = _mdev_uuid(device_xml)
        for m in self.world.fabric(self.node).mdevs():
            if m.uuid == uuid and m.fdid is not None:
                return m.fdid
        raise FabricError(f"no mdev {uuid or '?'} on {self.node}: nothing to plug into the guest")
