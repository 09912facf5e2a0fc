"""A simulated running VM on a borrower node, built from its domain XML.

``SimVm`` is what QEMU, the guest firmware and the guest's drivers would be: the guest's RAM
(``SimHardware.create_guest`` with the layout computed from the XML), one
``PassthroughSession`` per vmlend device whose mdev exists on the node, a firmware-like BAR
assignment, and driver-like helpers (enable, disable, hot-add, hot-remove, DMA, config access).
The reservation and the mdevs are the hook's business (prepare/release); the VM only borrows
the hardware when the guest enables a device and gives it back when the device leaves.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Protocol

import msgspec

from vmlend.domain import read_domain
from vmlend.errors import ConfigError, FabricError, ResourceExhaustedError
from vmlend.ledger.admission import vm_share
from vmlend.ledger.shareops import ShareOps
from vmlend.lending.shares import ShareFabric
from vmlend.memory.domain_memory import domain_layout
from vmlend.memory.layout import CpuVendor, Family, Layout
from vmlend.sim.dmawin import VmDmaWindows, WindowLedger
from vmlend.sim.guest import SimGuest
from vmlend.sim.hardware import SimHardware
from vmlend.sim.hostmem import HUGE_2M
from vmlend.sim.nvmeshare import SharedNvmeDrive, VmNvmeShare
from vmlend.sim.passthrough import BarObserver, BorrowFabric, PassthroughSession
from vmlend.sim.pci import regs
from vmlend.sim.resolver import DmaTarget
from vmlend.topology.model import BarKind, BarSpec, GiB, GuestRam, Holder, MdevInfo

log = logging.getLogger(__name__)

#: Top of the guest's 32-bit PCI hole: the IOAPIC/LAPIC/firmware area starts here.
PCI_HOLE32_END = 0xFEC0_0000
#: q35's PCIe MMCONFIG window (QEMU's default), which 32-bit BARs must avoid.
Q35_MMCONFIG = (0xB000_0000, 0xC000_0000)
#: I/O port range firmware hands to devices.
IO_PORTS = (0xC000, 0x10000)


class VmFabric(BorrowFabric, Protocol):
    """What the VM needs of the fabric: the deferred borrow and this node's mdevs."""

    local_node: str

    def mdevs(self) -> list[MdevInfo]: ...


class GuestBar(msgspec.Struct, frozen=True):
    """Where the guest's firmware put one BAR (I/O BARs: a port number)."""

    fdid: int
    index: int
    kind: BarKind
    size: int
    address: int


def _align_up(value: int, align: int) -> int:
    return -(-value // align) * align


class GuestBarAllocator:
    """Firmware-like BAR placement: 32-bit BARs in the PCI hole above low RAM (avoiding q35's
    MMCONFIG), 64-bit BARs above the highest RAM or hot-plug address (from the next 1 GiB),
    I/O BARs from port 0xc000; each naturally aligned. Pure bookkeeping."""

    def __init__(self, layout: Layout) -> None:
        self._hole = [(layout.below_4g, PCI_HOLE32_END)]
        if layout.machine.family is Family.Q35:
            lo, hi = Q35_MMCONFIG
            self._hole = [(a, min(b, lo)) for a, b in self._hole if a < lo] + [
                (max(a, hi), b) for a, b in self._hole if b > hi
            ]
        self._hole = [(a, b) for a, b in self._hole if b > a]
        top = max(r.end for r in layout.ranges())
        if layout.device_memory is not None:
            top = max(top, layout.device_memory.end)
        self._next64 = _align_up(max(top, 4 * GiB), GiB)
        self._used32: list[tuple[int, int]] = []
        self._next_io = IO_PORTS[0]

    def place(self, bar: BarSpec) -> int:
        if bar.kind is BarKind.IO:
            base = _align_up(self._next_io, bar.size)
            if base + bar.size > IO_PORTS[1]:
                raise ResourceExhaustedError(
                    "guest I/O ports", "the guest", bar.size, IO_PORTS[1] - base, "ports"
                )
            self._next_io = base + bar.size
            return base
        if bar.kind is BarKind.MEM64:
            base = _align_up(self._next64, bar.size)
            self._next64 = base + bar.size
            return base
        for lo, hi in self._hole:
            base = _align_up(lo, bar.size)
            while base + bar.size <= hi:
                clash = [u for u in self._used32 if base < u[1] and u[0] < base + bar.size]
                if not clash:
                    self._used32.append((base, base + bar.size))
                    return base
                base = _align_up(max(u[1] for u in clash), bar.size)
        room = sum(b - a for a, b in self._hole) - sum(b - a for a, b in self._used32)
        raise ResourceExhaustedError("guest 32-bit PCI hole", "the guest", bar.size, room, "bytes")


class SimVm:
    """VM ``xml`` running on ``fabric.local_node`` of ``hardware``.

    ``fabric`` must drive the same ``hardware`` (``SimFabric(..., hardware=hardware)``) so that
    the deferred borrow takes the device in this simulation. ``ledger`` keeps the DMA windows
    in the registry (``RegistryWindowLedger``); ``p2p`` is told about guest BAR addresses.
    """

    def __init__(
        self,
        xml: str | bytes,
        *,
        hardware: SimHardware,
        fabric: VmFabric,
        ledger: WindowLedger | None = None,
        p2p: BarObserver | None = None,
        backing: int = HUGE_2M,
        host_vendor: CpuVendor | None = None,
        nvme: Mapping[int, SharedNvmeDrive] | None = None,
    ) -> None:
        info = read_domain(xml)
        self.name = info.name
        self.hw = hardware
        self.fabric = fabric
        self.p2p = p2p
        self.node = fabric.local_node
        self.holder = Holder(self.node, info.name, str(info.uuid or ""))
        self.layout = domain_layout(xml, host_vendor)
        self.guest_ram: GuestRam = info.guest_ram  # what admission counts (a migration's)
        self._mdevs = {d.fdid: str(d.mdev) for d in info.devices if d.share is None}
        # queue-level NVMe shares: the drive's manager (``nvme``) serves them, not a borrow
        shared = {d.fdid: str(d.mdev) for d in info.devices if d.share is not None}
        self._nvme = dict(nvme or {})
        self._shares: dict[int, VmNvmeShare] = {}
        self.guest = hardware.create_guest(
            self.node, info.name, self.layout.ranges(), backing=backing
        )
        self.windows = VmDmaWindows(
            hardware, self.guest, self.layout, ledger, vm_share(self.holder)
        )
        self._bars = GuestBarAllocator(self.layout)
        self._sessions: dict[int, PassthroughSession] = {}
        self._placed: dict[int, list[GuestBar]] = {}
        self.running = True
        present = {m.uuid for m in self._my_mdevs()}
        try:
            self._attach([f for f, u in sorted(self._mdevs.items()) if u in present])
            for fdid, u in sorted(shared.items()):
                if u in present:
                    self._open_share(fdid, u)
        except BaseException:
            self.stop()
            raise
        missing = sorted(f for f, u in {**self._mdevs, **shared}.items() if u not in present)
        if missing:
            log.warning(
                "VM %s starts without devices %s: their mdevs do not exist on %s",
                self.name,
                ", ".join(f"{f:#x}" for f in missing),
                self.node,
            )

    # --- devices -------------------------------------------------------------------------------
    def _my_mdevs(self) -> list[MdevInfo]:
        """This node's mdevs made for this VM: QEMU opens only those. An mdev the XML names
        but the registry made for another VM (forged or stale metadata) stays closed."""
        return [m for m in self.fabric.mdevs() if m.node in ("", self.node) and m.vm == self.name]

    def _attach(self, fdids: Iterable[int]) -> None:
        wanted = list(fdids)
        # firmware places the largest BARs first so natural alignment packs them
        bars = sorted(
            ((f, b) for f in wanted for b in self.hw.device(f).spec.bars),
            key=lambda fb: (-fb[1].size, fb[0], fb[1].index),
        )
        placed: dict[int, list[GuestBar]] = {f: [] for f in wanted}
        for fdid, bar in bars:
            placed[fdid].append(
                GuestBar(fdid, bar.index, bar.kind, bar.size, self._bars.place(bar))
            )
        for fdid in wanted:
            self._sessions[fdid] = PassthroughSession(
                self.hw.device(fdid),
                self.holder,
                self.fabric,
                self.windows,
                self.p2p,
                mdev=self._mdevs[fdid],
            )
            self._placed[fdid] = sorted(placed[fdid], key=lambda b: b.index)

    def devices(self) -> list[int]:
        return sorted(self._sessions)

    def _open_share(self, fdid: int, mdev: str) -> None:
        drive = self._nvme.get(fdid)
        share = (
            self.fabric.share_of(fdid, self.holder)
            if isinstance(self.fabric, ShareFabric)
            else None
        )
        if drive is None or share is None:
            raise FabricError(
                f"VM {self.name} has an NVMe share mdev for {fdid:#x} but "
                + ("no manager serves that drive here" if drive is None else "no share of it")
            )
        # the interrupt windows its admission granted: those paths' interrupts cross the NTB
        windows = (
            self.fabric.share_interrupt_windows(fdid, self.holder)
            if isinstance(self.fabric, ShareOps)
            else []
        )
        opened = drive.open_share(self.node, self.name, share=share, interrupts=windows)
        try:
            self.hw.open_mdev(mdev, fdid, self.node, self.name, opened.revoke, share=True)
        except BaseException:
            opened.close()
            raise
        opened.mdev = mdev
        self._shares[fdid] = opened

    def nvme_share(self, fdid: int) -> VmNvmeShare:
        """The VM's share of NVMe drive ``fdid``: its virtual controller's BAR0 (``bar0``)."""
        self._require_running()
        try:
            return self._shares[fdid]
        except KeyError:
            raise FabricError(f"VM {self.name} has no share of device {fdid:#x}") from None

    def shares(self) -> list[int]:
        return sorted(self._shares)

    def share_unplugged(self, fdid: int) -> VmNvmeShare:
        """Its share controller of ``fdid`` left the guest (``vmlend.sim.shareunplug``)."""
        return self._shares.pop(fdid)

    def share_plugged(self, fdid: int, share: VmNvmeShare) -> None:
        """A share controller of ``fdid`` was plugged into the guest (``sim.shareunplug``)."""
        self._shares[fdid] = share

    def session(self, fdid: int) -> PassthroughSession:
        self._require_running()
        try:
            return self._sessions[fdid]
        except KeyError:
            raise FabricError(f"device {fdid:#x} is not attached to VM {self.name}") from None

    def bars(self, fdid: int) -> list[GuestBar]:
        """The guest addresses firmware chose for ``fdid``'s BARs."""
        self.session(fdid)
        return list(self._placed[fdid])

    def add_device(self, fdid: int) -> PassthroughSession:
        """Hot-add: the mdev must exist already (the CLI creates it before attaching)."""
        self._require_running()
        if fdid in self._sessions:
            return self._sessions[fdid]
        mdevs = [m for m in self._my_mdevs() if m.fdid == fdid]
        if not mdevs:
            raise FabricError(
                f"device {fdid:#x} has no mdev for VM {self.name} on {self.node}; reserve it"
                " and create its mdev before hot-adding it"
            )
        self._mdevs[fdid] = mdevs[0].uuid
        self._attach([fdid])
        return self._sessions[fdid]

    def remove_device(self, fdid: int) -> None:
        """Hot-remove: unmap, unpin (if last), tell the P2P observer, give the hardware back.
        The reservation and mdev stay until the caller releases them."""
        session = self.session(fdid)
        session.close()
        del self._sessions[fdid]
        del self._placed[fdid]

    def sessions(self) -> dict[int, PassthroughSession]:
        """The VM's pass-through sessions by fdid (a hot migration moves each)."""
        self._require_running()
        return dict(self._sessions)

    def moved(
        self,
        fabric: VmFabric,
        guest: SimGuest,
        windows: VmDmaWindows,
        p2p: BarObserver | None,
    ) -> None:
        """A hot migration finished: the VM runs on ``fabric.local_node`` with ``guest`` (its
        RAM copied there) and ``windows``; its sessions moved already (``arrive``)."""
        self.fabric, self.node, self.guest, self.windows, self.p2p = (
            fabric,
            fabric.local_node,
            guest,
            windows,
            p2p,
        )
        self.holder = Holder(self.node, self.name, self.holder.vm_uuid)

    # --- guest driver helpers -------------------------------------------------------------------
    def config_read(self, fdid: int, offset: int, size: int) -> int:
        return self.session(fdid).config_read(offset, size)

    def config_write(self, fdid: int, offset: int, size: int, value: int) -> None:
        self.session(fdid).config_write(offset, size, value)

    def program_bars(self, fdid: int) -> None:
        """What firmware does: size every BAR, then write its guest address."""
        s = self.session(fdid)
        for bar in self._placed[fdid]:
            off = regs.BASE_ADDRESS_0 + 4 * bar.index
            halves = [off, off + 4] if bar.kind is BarKind.MEM64 else [off]
            for at in halves:
                old = s.config_read(at, 4)
                s.config_write(at, 4, 0xFFFFFFFF)
                s.config_read(at, 4)  # the size mask, as firmware reads it
                s.config_write(at, 4, old)
            s.config_write(off, 4, bar.address & 0xFFFFFFFF)
            if bar.kind is BarKind.MEM64:
                s.config_write(off + 4, 4, bar.address >> 32)

    def enable_device(self, fdid: int) -> None:
        """Program the BARs, enable decoding (the deferred borrow), then Bus Master (the DMA
        windows). A refusal is raised here; the guest itself would only see Bus Master stay 0."""
        s = self.session(fdid)
        cmd = s.config_read(regs.COMMAND, 2)
        s.config_write(regs.COMMAND, 2, cmd & ~(regs.COMMAND_IO | regs.COMMAND_MEMORY))
        self.program_bars(fdid)
        has_io = any(b.kind is BarKind.IO for b in self._placed[fdid])
        cmd = regs.COMMAND_MEMORY | (regs.COMMAND_IO if has_io else 0)
        s.config_write(regs.COMMAND, 2, cmd)
        if s.refusal is not None:
            raise s.refusal
        s.config_write(regs.COMMAND, 2, cmd | regs.COMMAND_MASTER)
        if s.refusal is not None:
            raise s.refusal

    def disable_device(self, fdid: int) -> None:
        """What Linux's pci_disable_device does: clear Bus Master (the windows go)."""
        s = self.session(fdid)
        s.config_write(regs.COMMAND, 2, s.config_read(regs.COMMAND, 2) & ~regs.COMMAND_MASTER)

    def _mmio_target(self, gpa: int, size: int) -> tuple[PassthroughSession, int, int]:
        self._require_running()
        for s in self._sessions.values():
            for index, base in s.decoded_bars().items():
                if base <= gpa and gpa + size <= base + s.shadow.bars[index].size:
                    return s, index, gpa - base
        raise FabricError(
            f"nothing in VM {self.name} decodes guest-physical {gpa:#x}+{size}: no enabled "
            "device has a memory BAR there"
        )

    def mmio_read(self, gpa: int, size: int) -> int:
        """The guest CPU reads a device register at guest-physical ``gpa`` (the BAR as the
        guest programmed it): through this node's adapter and the lender's, over the route
        of the device's crossing (``SimHardware.mmio_read``); all ones across a dead cable,
        and from a device taken from the VM."""
        s, index, offset = self._mmio_target(gpa, size)
        if s.cut_off:
            return (1 << 8 * size) - 1  # a removed device
        return self.hw.mmio_read(self.node, s.fdid, index, offset, size)

    def mmio_write(self, gpa: int, size: int, value: int) -> None:
        """The guest CPU writes a device register (an MSI-X table entry, a doorbell), by the
        same way as ``mmio_read``: a dead cable drops it, as a device taken from the VM does."""
        s, index, offset = self._mmio_target(gpa, size)
        if not s.cut_off:
            self.hw.mmio_write(self.node, s.fdid, index, offset, size, value)

    def _live(self, fdid: int) -> PassthroughSession:
        """``fdid``'s session while the device is still this VM's: the guest's driver can make
        it do DMA only then (a device taken from the VM is a removed device)."""
        s = self.session(fdid)
        if s.cut_off:
            raise s.cut_off_error()
        return s

    def dma_write(self, fdid: int, gpa: int, data: bytes) -> list[DmaTarget]:
        """The device writes ``data`` at guest-physical ``gpa`` (through the resolver)."""
        self._live(fdid)
        return self.hw.dma_write(fdid, gpa, data)

    def dma_read(self, fdid: int, gpa: int, length: int) -> bytes:
        self._live(fdid)
        return self.hw.dma_read(fdid, gpa, length)

    # --- life -----------------------------------------------------------------------------------
    def _require_running(self) -> None:
        if not self.running:
            raise ConfigError(f"VM {self.name} is stopped")

    def stop(self) -> None:
        """The VM stops: every device leaves (windows unmapped, guest unpinned, hardware given
        back), then the guest's RAM is freed. Idempotent."""
        if not self.running:
            return
        errors: list[Exception] = []
        for fdid in sorted(self._shares):  # its real queues go, then its windows and pins
            try:
                self._shares[fdid].close()
            except Exception as e:  # keep stopping the rest; the first error is raised
                log.warning("VM %s: NVMe share of %#x did not stop cleanly: %s", self.name, fdid, e)
                errors.append(e)
        self._shares.clear()
        for fdid in sorted(self._sessions):
            try:
                self._sessions[fdid].close()
            except Exception as e:  # keep stopping the rest; the first error is raised
                log.warning("VM %s: device %#x did not stop cleanly: %s", self.name, fdid, e)
                errors.append(e)
        self._sessions.clear()
        self._placed.clear()
        self.windows.close()
        self.hw.destroy_guest(self.node, self.name)
        self.running = False
        if errors:
            raise errors[0]
