"""One simulated NVMe drive shared by VMs on any nodes at the queue level (mechanism 11).

``SharedNvmeDrive`` puts the controller model on the device, takes the device for the
manager on its lender (so no VM can borrow it exclusively meanwhile), gives the manager its
admin queues in lender memory, and for each VM (``open_share``):

- DMA windows in the share's address space: the lender IOMMU maps ``asid_base + GPA`` of each
  guest RAM range onto NTB segments that point at the same IOVAs on the VM's node, where a
  per-node domain (attached to the drive's crossing into that node) maps them onto the guest's
  pinned frames. A VM on the lender itself is mapped in the lender domain directly.
- a virtual controller (its mdev is of type ``smartio-nvme_share``): emulated registers and
  admin queue, and a config space whose Bus Master bit maps the share's DMA windows (as for a
  borrowed device: set, the windows are mapped; cleared, they go).
- the guest's doorbell page: in page mode mapped onto the share's own real doorbell page (no
  software on the I/O path); in trap mode each write is trapped and forwarded to the share's
  own real queue ids only (one software step each).

A VM's stop (``VmNvmeShare.close``) deletes its real queues, unmaps its windows and unpins its
RAM; other shares keep running.

When the manager's borrow of the drive ends by any path (the lender reclaims it, goes down,
takes a fenced drive back), every share ends in that same step (a borrow-end subscriber): the
guard forgets its queues, the interrupt and doorbell routes go, its windows, NTB segments, LUT
entries and ingress contexts are removed, and the manager's own memory is unmapped; the
hardware then resets the drive, so the next owner finds a reset controller. The shares'
virtual controllers read all ones and drop writes from then on, as after a surprise removal.
A share revoked alone (its registry share released behind its VM's back) ends the same way.
What a drive keeps wired for its shares (``wiring``) is visible to the invariant checker.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import msgspec

from vmlend.errors import FabricError
from vmlend.ledger.nvmeshares import record_usage
from vmlend.memory.windows import window_groups
from vmlend.nvme import spec
from vmlend.nvme.guard import asid_base
from vmlend.nvme.shares import Share
from vmlend.registry import Registry
from vmlend.sim.guest import Frame
from vmlend.sim.hardware import Borrow, ShareWire, SimHardware, fabric_requester_key
from vmlend.sim.invariants import ShareGrant
from vmlend.sim.iommu import IommuDomain, Requester
from vmlend.sim.nvme.controller import ControllerConfig
from vmlend.sim.nvme.driver import NvmeDriver
from vmlend.sim.nvme.manager import NvmeManager
from vmlend.sim.nvme.virtual import VirtualNvmeController
from vmlend.sim.nvmedrive import DeviceBar0, HostDmaMemory, attach_nvme
from vmlend.sim.pci import regs
from vmlend.topology.model import MANAGER_VM, GuestRange
from vmlend.topology.paths import NtbPath

log = logging.getLogger(__name__)

_MANAGER_IOVA = 0x4000_0000  # the manager's admin memory, in the untagged address space
_MANAGER_BYTES = 256 * 1024


class _Ingress(msgspec.Struct):
    """The drive's crossing into one borrower node, shared by the VMs of that node."""

    requester: Requester
    domain: IommuDomain
    users: int = 0
    undo: list[Callable[[], object]] = msgspec.field(default_factory=list)


class _Windows(msgspec.Struct):
    undo: list[Callable[[], object]] = msgspec.field(default_factory=list)

    def close(self) -> None:
        while self.undo:
            self.undo.pop()()


class VmNvmeShare:
    """One VM's share: its virtual controller's BAR0 (``bar0``), its interrupts."""

    def __init__(self, drive: SharedNvmeDrive, node: str, vm: str, share: Share) -> None:
        self.drive = drive
        self.node = node
        self.vm = vm
        self.share = share
        self.windows = _Windows()
        self.interrupts: dict[int, int] = {}
        self._listeners: list[Callable[[int], object]] = []
        self.traps = 0  # software steps taken for the guest's I/O doorbell writes
        self.open = True
        #: The share was cut (its drive's borrow or its own share ended): a removed device.
        self.revoked = False
        self.mdev: str | None = None  # the mdev the VM opened it through (``SimVm``)
        self.virtual = VirtualNvmeController(
            share,
            drive.controller.config,
            drive.namespace.block_size,
            drive.hw.guest(node, vm),
            drive.manager,
            self._interrupt,
        )
        self.bar0 = _GuestBar0(self)
        self.config = _ShareConfig(self)

    @property
    def name(self) -> str:
        return self.share.name

    def _interrupt(self, vector: int) -> None:
        self.interrupts[vector] = self.interrupts.get(vector, 0) + 1
        for fn in list(self._listeners):
            fn(vector)

    def on_interrupt(self, fn: Callable[[int], object]) -> None:
        self._listeners.append(fn)

    def set_master(self, on: bool = True) -> None:
        """What the guest's ``pci_set_master``/``pci_clear_master`` does to its controller's
        config space: Bus Master (with memory decoding) on or off."""
        cmd = self.config.read(regs.COMMAND, 2) | regs.COMMAND_MEMORY
        mask = regs.COMMAND_MASTER
        self.config.write(regs.COMMAND, 2, cmd | mask if on else cmd & ~mask)

    def status(self) -> dict[str, object]:
        return {
            **self.share.as_dict(),
            "node": self.node,
            "vm": self.vm,
            "real_queues": self.drive.manager.real_queues(self.name),
            "rejections": self.drive.manager.rejections(self.name),
        }

    def close(self) -> None:
        """The VM stops: its queues go, then its windows and pins. Idempotent."""
        if self.mdev is not None:
            self.drive.hw.close_mdev(self.mdev)
        if self.open:
            self.open = False
            self.drive._end_share(self)

    def revoke(self) -> None:
        """The share was taken from the VM (the hardware cuts its open mdev): its queues,
        routes and windows go now; the guest sees a removed controller. Idempotent."""
        if self.revoked:
            return
        self.revoked = True
        if self.open:
            self.open = False
            self.drive._end_share(self)
        log.warning(
            "NVMe share %s of %#x was taken from %s/%s",
            self.name,
            self.drive.fdid,
            self.node,
            self.vm,
        )


class _ShareConfig:
    """The Command register of the virtual controller's config space (the rest reads 0):
    Bus Master maps the share's DMA windows, as bus-master enable does for a borrowed device,
    so a guest that never enables its controller pins and maps nothing."""

    def __init__(self, share: VmNvmeShare) -> None:
        self.s = share
        self.command = 0

    def read(self, offset: int, size: int) -> int:
        if self.s.revoked:
            return (1 << 8 * size) - 1  # a removed device
        if offset == regs.COMMAND:
            return self.command & ((1 << (8 * size)) - 1)
        return 0

    def write(self, offset: int, size: int, value: int) -> None:
        if self.s.revoked or offset != regs.COMMAND or size not in (2, 4):
            return
        if not self.s.open:
            raise FabricError(f"VM {self.s.vm}'s NVMe share is closed")
        value &= regs.COMMAND_MEMORY | regs.COMMAND_MASTER
        was, now = self.command & regs.COMMAND_MASTER, value & regs.COMMAND_MASTER
        if now and not was:
            self.s.drive._map_share(self.s)  # a refusal leaves Bus Master clear
        elif was and not now:
            self.s.windows.close()
        self.command = value


class _GuestBar0:
    """The guest's view of its virtual controller's BAR0 (the mdev region)."""

    def __init__(self, share: VmNvmeShare) -> None:
        self.s = share
        self.real = share.drive.device.bars
        self.dstrd = share.drive.controller.config.dstrd
        self.page = share.share.doorbell_page_offset(self.dstrd)

    def read(self, offset: int, size: int) -> int:
        if self.s.revoked:
            return (1 << 8 * size) - 1  # a removed device
        if offset < spec.DOORBELL_BASE:
            return self.s.virtual.read(offset, size)
        return 0

    def write(self, offset: int, size: int, value: int) -> None:
        if self.s.revoked:
            return  # dropped, as a write to a removed device
        if not self.s.open:
            raise FabricError(f"VM {self.s.vm}'s NVMe share is closed")
        if offset < spec.DOORBELL_BASE:
            self.s.virtual.write(offset, size, value)
            return
        if offset >= spec.DOORBELL_BASE + spec.PAGE:
            return  # nothing else in the BAR decodes
        if self.page is not None:
            # page mode: the guest page is mapped onto the share's real doorbell page, so the
            # write lands in the drive with no software in between (guest qid g = real
            # qid_base + g by construction); admin doorbells come back as stray doorbells
            self.real.write(0, self.page + offset - spec.DOORBELL_BASE, size, value)
            return
        slot = spec.doorbell_of(offset, self.dstrd)
        if slot is None or size != 4:
            return
        qid, completion = slot
        if qid == 0:
            self.s.virtual.admin_doorbell(completion, value)
            return
        self.s.traps += 1  # trap mode: one software step per I/O doorbell write
        if qid <= self.s.share.queue_pairs:
            real = spec.doorbell_offset(self.s.share.real_qid(qid), completion, self.dstrd)
            self.real.write(0, real, 4, value)


class SharedNvmeDrive:
    """Device ``fdid`` as an NVMe drive shared by VMs, its manager on the lender."""

    def __init__(
        self,
        hardware: SimHardware,
        fdid: int,
        directory: Path,
        *,
        blocks: int = 1 << 21,
        config: ControllerConfig | None = None,
    ) -> None:
        self.hw = hardware
        self.fdid = fdid
        held = hardware.borrowed(fdid)
        if held is not None:
            raise FabricError(
                f"device {fdid:#x} is borrowed exclusively by {held.node}/{held.vm}; "
                "release it before sharing the drive"
            )
        self.nvme = attach_nvme(hardware, fdid, directory, blocks=blocks, config=config)
        self.device = self.nvme.device
        self.controller = self.nvme.controller
        self.namespace = self.nvme.namespace
        self._ingress: dict[str, _Ingress] = {}
        self._lut_users: dict[str, int] = {}  # lender adapter -> nodes crossed to through it
        self.shares: dict[str, VmNvmeShare] = {}
        self.memory: HostDmaMemory | None = None
        self._remove_irq: Callable[[], None] = lambda: None
        #: Why the manager's borrow ended under it (every share ended with it), else None.
        self.ended: str | None = None
        self._remove_end = hardware.on_borrow_end(self._borrow_ended)
        self._remove_wiring = hardware.add_share_wiring(self)
        self._remove_link = hardware.on_link_change(self._link_changed)
        #: Each move of a crossing: (node, old route, new route).
        self.reroutes: list[tuple[str, str, str]] = []
        try:
            hardware.borrow(fdid, self.device.lender, MANAGER_VM)
            cmd = self.device.config.read(regs.COMMAND, 2)
            self.device.config.write(
                regs.COMMAND, 2, cmd | regs.COMMAND_MEMORY | regs.COMMAND_MASTER
            )
            self.memory = HostDmaMemory(
                hardware.node(self.device.lender).memory,
                hardware.lender_domain(fdid),
                _MANAGER_IOVA,
                _MANAGER_BYTES,
                MANAGER_VM,
            )
            driver = NvmeDriver(DeviceBar0(self.device), self.memory, self.memory.alloc)
            self.manager = NvmeManager(self.controller, driver, f"nvme {fdid:#x}")
            self._remove_irq = self.device.on_interrupt(
                self.manager.route_interrupt, owner=(self.device.lender, MANAGER_VM)
            )
            self.manager.start()
        except Exception:
            self._teardown()
            raise

    @property
    def mode(self) -> str:
        return self.manager.book.geometry.mode

    # --- shares -------------------------------------------------------------------------------
    def open_share(
        self, node: str, vm: str, queue_pairs: int = 1, blocks: int = 0, share: Share | None = None
    ) -> VmNvmeShare:
        """Give VM ``vm`` on ``node`` (a running guest) a share of ``queue_pairs`` and
        ``blocks``, or the ``share`` the registry reserved for it; all or nothing."""
        self.hw.guest(node, vm)  # a running guest, or FabricError
        borrow = self.hw.borrowed(self.fdid)
        if self.ended is not None or borrow is None or borrow.vm != MANAGER_VM:
            raise FabricError(
                f"NVMe drive {self.fdid:#x} is not served by its manager any more"
                f" ({self.ended or 'its borrow ended'}); share it again ('vmlend nvme share')"
                " before VMs use it"
            )
        name = share.name if share is not None else f"vm:{node}/{vm}"
        share = self.manager.add_share(name, queue_pairs, blocks, decided=share)
        vms = VmNvmeShare(self, node, vm, share)
        try:
            self.manager.connect(name, vms.virtual.admin_doorbell, vms._interrupt)
        except Exception:
            self.manager.remove_share(name)
            raise
        self.shares[name] = vms
        return vms

    def _map_share(self, vms: VmNvmeShare) -> None:
        """Bus Master of ``vms``'s controller went on: pin and map its RAM; all or nothing."""
        try:
            self._map(vms, self.hw.guest(vms.node, vms.vm).ranges)
        except Exception:
            vms.windows.close()
            raise

    def _map(self, vms: VmNvmeShare, ranges: list[GuestRange]) -> None:
        guest = self.hw.guest(vms.node, vms.vm)
        base = asid_base(vms.share.asid)
        lender_domain = self.hw.lender_domain(self.fdid)
        undo = vms.windows.undo
        frames = []
        for r in ranges:
            frames += guest.pin(r.start, r.size)

            def unpin(r: GuestRange = r) -> None:
                guest.unpin(r.start, r.size)

            undo.append(unpin)
        path = self.hw.route(self.device.lender, vms.node)
        if path is None:  # a VM on the lender: no NTB, the lender domain maps its frames
            for f in frames:
                lender_domain.map(base + f.gpa, f.phys, f.size)

                def unmap_here(f: Frame = f) -> None:
                    lender_domain.unmap(base + f.gpa, f.size)

                undo.append(unmap_here)
            return
        ingress = self._enter(vms.node, path)
        undo.append(lambda: self._leave(vms.node))
        for f in frames:
            ingress.domain.map(base + f.gpa, f.phys, f.size)

            def unmap_ingress(f: Frame = f) -> None:
                ingress.domain.unmap(base + f.gpa, f.size)

            undo.append(unmap_ingress)
        src = self.hw.adapter(path.src.ref)
        seg = src.segment_size
        # the planner's windows (low, high), each rounded out to whole segments: exactly the
        # segments admission claimed for the share (``vmlend.ledger.nvmeadmit``)
        for _name, group in window_groups(ranges, seg):
            start = group[0].start // seg * seg
            count = -(-(group[-1].end - start) // seg)
            first = src.free_segments(count)
            for i in range(count):
                src.map_segment(first + i, vms.node, base + start + i * seg)

                def unmap_segment(index: int = first + i) -> None:
                    src.unmap_segment(index)

                undo.append(unmap_segment)
            window = src.segment_base(first)
            for r in group:
                at = window + r.start - start
                lender_domain.map(base + r.start, at, r.size)

                def unmap_window(r: GuestRange = r) -> None:
                    lender_domain.unmap(base + r.start, r.size)

                undo.append(unmap_window)

    def _enter(self, node: str, path: NtbPath) -> _Ingress:
        ingress = self._ingress.get(node)
        if ingress is None:
            src, dst = self.hw.adapter(path.src.ref), self.hw.adapter(path.dst.ref)
            rid = self.device.requester_id
            key = fabric_requester_key(self.hw.node(self.device.lender).spec.node_id, rid)
            undo: list[Callable[[], object]] = []
            try:
                src.lut_add(rid)
                # one entry per adapter serves every node the drive's DMA crosses to
                self._lut_users[src.ref] = self._lut_users.get(src.ref, 0) + 1
                undo.append(lambda: self._lut_release(src.ref, rid))
                # the far side sees the id its own entry for the drive assigns, and nothing else
                entry = dst.lut_add(key)
                undo.append(lambda: dst.lut_remove(key))
                requester = Requester(dst.assigned_requester_id(entry))
                domain = IommuDomain(f"{node}:nvme{self.fdid:#x}")
                self.hw.node(node).iommu.attach(requester, domain)
                undo.append(lambda: self.hw.node(node).iommu.detach(requester))
            except Exception:
                while undo:
                    undo.pop()()
                raise
            ingress = self._ingress[node] = _Ingress(requester, domain, 0, undo)
        ingress.users += 1
        return ingress

    def _link_changed(self, link: str, up: bool) -> None:
        """A link event: every crossing of the drive into a node whose route now passes a
        dead cable moves to another route from the same lender adapter, if one is up. The
        segments and the node's ingress domain stay (they name the node's addresses), so the
        VMs' queues and commands go on as they are: nothing is resubmitted, nothing lost."""
        if self.ended is not None:
            return
        for node in sorted(self._ingress):
            path = self.hw.crossing(self.fdid, node)
            if path is not None and self.hw.dead_links(path):
                self._reroute(node, path)

    def _reroute(self, node: str, old: NtbPath) -> bool:
        live = [
            p
            for p in self.hw.routes(self.device.lender, node)
            if p.src.ref == old.src.ref and not self.hw.dead_links(p)
        ]
        if not live or live[0].dst.ref == old.dst.ref:
            log.warning(
                "NVMe drive %#x: no other route to %s than %s", self.fdid, node, old.describe()
            )
            return False
        new = live[0]
        ingress = self._ingress[node]
        key = fabric_requester_key(
            self.hw.node(self.device.lender).spec.node_id, self.device.requester_id
        )
        dst = self.hw.adapter(new.dst.ref)
        iommu = self.hw.node(node).iommu
        entry = dst.lut_add(key)
        requester = Requester(dst.assigned_requester_id(entry))
        try:
            iommu.attach(requester, ingress.domain)
        except Exception:
            dst.lut_remove(key)
            raise
        iommu.detach(ingress.requester)
        self.hw.adapter(old.dst.ref).lut_remove(key)
        ingress.requester = requester
        # _enter's undo: release the lender entry, remove the far entry, detach the context
        ingress.undo = [
            ingress.undo[0],
            lambda: dst.lut_remove(key),
            lambda: iommu.detach(requester),
        ]
        self.reroutes.append((node, old.describe(), new.describe()))
        log.warning(
            "NVMe drive %#x: crossing to %s moved from %s to %s",
            self.fdid,
            node,
            old.describe(),
            new.describe(),
        )
        return True

    def _lut_release(self, ref: str, rid: int) -> None:
        self._lut_users[ref] -= 1
        if not self._lut_users[ref]:
            del self._lut_users[ref]
            self.hw.adapter(ref).lut_remove(rid)

    def _leave(self, node: str) -> None:
        ingress = self._ingress[node]
        ingress.users -= 1
        if ingress.users == 0:
            while ingress.undo:
                ingress.undo.pop()()
            del self._ingress[node]

    def _end_share(self, vms: VmNvmeShare) -> None:
        """End ``vms`` (its VM stops, or it is cut). While the drive goes on its real queues
        are deleted (the others keep theirs); once the drive's borrow ended the controller is
        not asked (the reset deletes every queue). Either way the guard and the routes forget
        it and its windows and pins go: nothing of it is left whatever fails."""
        try:
            if self.ended is None:
                self.manager.remove_share(vms.name)
        except Exception as e:  # never stop half-way: forget it all the same
            log.warning("NVMe share %s: its queues could not be deleted: %s", vms.name, e)
        finally:
            self.manager.forget_share(vms.name)
            vms.windows.close()
            self.shares.pop(vms.name, None)

    def _borrow_ended(self, borrow: Borrow) -> None:
        """The manager's borrow of the drive ends (reclaim, lender down, take-back): every
        share and the manager's own paths go in this same step, before the hardware resets
        the drive and forgets the borrow."""
        if borrow.fdid != self.fdid or borrow.vm != MANAGER_VM or self.ended is not None:
            return
        self.ended = f"the manager's borrow of {self.fdid:#x} ended"
        failures: list[Exception] = []
        for vms in list(self.shares.values()):
            try:
                vms.revoke()
            except Exception as e:  # cut the rest all the same; the hardware fences on raise
                failures.append(e)
        self._remove_irq()
        self._remove_irq = lambda: None
        self.manager.detach()
        if self.memory is not None:
            self.memory.close()
            self.memory = None
        log.warning("NVMe drive %#x: %s; every share ended", self.fdid, self.ended)
        if failures:
            raise failures[0]

    def wiring(self) -> list[ShareWire]:
        """What the drive keeps wired for shares now: real queues, interrupt and admin
        doorbell routes (the manager's), and doorbell pages (open shares in page mode)."""
        owners = {n: (v.node, v.vm) for n, v in self.shares.items()}
        out = [
            ShareWire(self.fdid, *owners.get(name, ("?", name)), kind, detail)
            for name, kind, detail in self.manager.wiring()
        ]
        for v in self.shares.values():
            if v.open and v.bar0.page is not None:
                out.append(ShareWire(self.fdid, v.node, v.vm, "doorbell-page", f"{v.bar0.page:#x}"))
        return out

    def record(self, registry: Registry) -> None:
        """Put what the data path sees of each share (real queues, guard rejections) into
        the registry, for ``vmlend nvme status`` in any process."""
        for vms in self.shares.values():
            record_usage(
                registry,
                self.fdid,
                vms.name,
                self.manager.real_queues(vms.name),
                self.manager.rejections(vms.name),
            )

    def grants(self) -> list[ShareGrant]:
        """The shares open now, as justifications for the fabric's invariant checker."""
        return [ShareGrant(self.fdid, v.node, v.vm, v.share.asid) for v in self.shares.values()]

    # --- life -----------------------------------------------------------------------------------
    def status(self) -> dict[str, object]:
        return {
            "fdid": f"{self.fdid:#x}",
            "mode": "shared",
            "doorbells": self.mode,
            "queue_pairs": self.controller.config.queue_pairs,
            "free_queue_pairs": self.manager.book.free_queue_pairs(),
            "blocks": self.namespace.blocks,
            "shares": [s.status() for s in self.shares.values()],
        }

    def _teardown(self) -> None:
        self._remove_end()
        self._remove_link()
        self._remove_irq()
        if self.memory is not None:
            self.memory.close()
            self.memory = None
        borrow = self.hw.borrowed(self.fdid)
        if borrow is not None and borrow.vm == MANAGER_VM:  # never another owner's borrow
            self.hw.give_back(self.fdid, borrow.node, MANAGER_VM)
        self._remove_wiring()
        self.nvme.close()

    def close(self) -> None:
        """Every share closes, the manager stops and the device is given back (reset)."""
        for vms in list(self.shares.values()):
            vms.close()
        if self.ended is None:
            self.manager.close()
        self._teardown()
