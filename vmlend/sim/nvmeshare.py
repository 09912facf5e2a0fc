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
  software on the I/O path), from another node through a window segment of its adapter
  (``place_cpu_windows``, beside its window onto its CMB extent: what admission claims); in
  trap mode each write is trapped and forwarded to the share's own real queue ids only (one
  software step each). Either way the write reaches the drive as MMIO from the VM's node
  (``vmlend.sim.mmio``): through the node's adapter of the drive's crossing and the
  lender's, so a dead cable drops it.

A share of two paths (``--paths 2``) also gets a backup path through another adapter of the
VM's node, in an address space of its own, and a backup queue pair per queue pair, its rings
in memory of the VM's host (``vmlend.sim.nvme.relay``). A guest that uses shadow doorbells
(Doorbell Buffer Config, which its virtual controller advertises when the drive gives the
share a doorbell page) runs in page mode, as a one-path share does: its own rings are the
primary pair's, its doorbell page is mapped onto the share's real page through the primary
path (0 software steps per doorbell). Otherwise, and after a failover, its queues are relayed
(one software step per doorbell). A link event on the primary path (or a command timeout, a
deadline on the drive's injected clock) switches to the backup with nothing lost; the link's
return switches back. The relay rings each pair's real doorbells through that pair's path.
The simulator counts the guest's I/O doorbell writes and the software steps taken for them,
before and after the share's first failover (``VmNvmeShare.steps``).

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

Each crossing of the drive into a node (the one the node's shares use, and each two-path
share's backup) holds the drive's requester entry on every cluster switch port of its route,
as a borrow's crossing does (``SwitchPorts``): made with the crossing's LUT entries, all or
nothing (a full port refuses it), moved with it on a re-route, removed with it; what the
crossings pass (``crossings``) is visible to the invariant checker.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

import msgspec

from vmlend.errors import (
    ConfigError,
    DmaFault,
    FabricError,
    NoPathError,
    ResourceExhaustedError,
    StaleTokenError,
    SwitchPortFullError,
)
from vmlend.ledger.admission import vm_share
from vmlend.ledger.nvmeadmit import BACKUP_SUFFIX, is_share_msi_claim
from vmlend.ledger.nvmeshares import record_usage
from vmlend.memory.windows import window_groups
from vmlend.nvme import spec
from vmlend.nvme.cmb import GUEST_CMB_BASE, cmbsz
from vmlend.nvme.guard import asid_base
from vmlend.nvme.shares import Share
from vmlend.registry import Claim, Registry
from vmlend.sim.guest import Frame
from vmlend.sim.hardware import (
    Borrow,
    CmbWindowMap,
    ShareCrossing,
    ShareWindowMap,
    ShareWire,
    SimHardware,
    fabric_requester_key,
    share_user,
)
from vmlend.sim.hostmem import FRAME, HostMemory, OwnedFrames
from vmlend.sim.invariants import ShareGrant
from vmlend.sim.iommu import IommuDomain, Requester
from vmlend.sim.msitarget import MSI_IOVA, PAGE, MsiTarget, MsiTargets
from vmlend.sim.nvme.cmb import CmbMemory, CmbWindow
from vmlend.sim.nvme.controller import ControllerConfig
from vmlend.sim.nvme.driver import NvmeDriver
from vmlend.sim.nvme.manager import NvmeManager
from vmlend.sim.nvme.relay import QueueRelay
from vmlend.sim.nvme.relayrings import BACKUP, PRIMARY, RING_IOVA, ring_bytes
from vmlend.sim.nvme.timer import COMMAND_TIMEOUT, Clock, CommandTimer
from vmlend.sim.nvme.virtual import VirtualNvmeController
from vmlend.sim.nvmedrive import DeviceBar0, HostDmaMemory, attach_nvme
from vmlend.sim.pci import regs
from vmlend.sim.resolver import Hop
from vmlend.topology.model import MANAGER_VM, GuestRange, Holder
from vmlend.topology.paths import NtbPath
from vmlend.topology.requesters import requester_device, route_ports

log = logging.getLogger(__name__)

_MANAGER_IOVA = 0x4000_0000  # the manager's admin memory, in the untagged address space
_MANAGER_BYTES = 256 * 1024


class _Ingress(msgspec.Struct):
    """The drive's crossing into one borrower node, shared by the VMs of that node: the
    lender adapter its DMA leaves by and the node's adapter it enters by."""

    src: str
    far: str
    domain: IommuDomain
    users: int = 0
    #: The route it takes now (its switch ports hold the drive's requester entries).
    path: NtbPath | None = None


class _RingMemory(OwnedFrames):
    """Memory of the VM's host that its virtual controller keeps for a two-path share's
    relay rings (``vmlend.sim.nvme.relay``): frames of the VM (its hypervisor's), read and
    written by offset."""

    def __init__(self, memory: HostMemory, size: int, owner: str) -> None:
        super().__init__(memory, size, owner, "the relay rings")


class DoorbellSteps(msgspec.Struct):
    """The guest's I/O doorbell writes and the software steps taken for them (traps)."""

    doorbells: int = 0
    traps: int = 0

    def per_doorbell(self) -> float:
        return self.traps / self.doorbells if self.doorbells else 0.0


class _Windows(msgspec.Struct):
    undo: list[Callable[[], object]] = msgspec.field(default_factory=list)

    def close(self) -> None:
        while self.undo:
            self.undo.pop()()


NTB = "ntb"
RELAY = "relay"


def msi_paths(claims: Sequence[Claim]) -> frozenset[int]:
    """The paths of a share whose interrupt window was admitted (its claims' MSI windows:
    ``nvmeadmit.share_msi_claims``): their interrupts cross the NTB, the others' are relayed."""
    return frozenset(
        BACKUP if c.share.endswith(BACKUP_SUFFIX) else PRIMARY
        for c in claims
        if is_share_msi_claim(c)
    )


class MsiStats(msgspec.Struct):
    """A share's completion interrupts: posted over the NTB and delivered at its VM's target,
    posted and lost (the write faulted: a dead link, a mapping gone), or relayed in software."""

    delivered: int = 0
    lost: int = 0
    relayed: int = 0


class VmNvmeShare:
    """One VM's share: its virtual controller's BAR0 (``bar0``), its interrupts."""

    def __init__(
        self,
        drive: SharedNvmeDrive,
        node: str,
        vm: str,
        share: Share,
        msi: Collection[int] = (),
    ) -> None:
        self.drive = drive
        self.node = node
        self.vm = vm
        self.share = share
        self.windows = _Windows()
        self.interrupts: dict[int, int] = {}
        self._listeners: list[Callable[[int], object]] = []
        #: The paths whose interrupt window admission granted (``msi_paths``): while mapped,
        #: their completion interrupts are posted writes over the NTB to the VM's target.
        self.msi_paths = frozenset(msi)
        self.msi_mapped: set[int] = set()  # paths whose interrupt route is mapped now
        self.msi_target: MsiTarget | None = None
        self.msi_first = 0  # the first data value of its vectors in the target
        self.msi = MsiStats()
        self.msi_faults: list[DmaFault] = []
        self.last_hops: tuple[Hop, ...] = ()
        self._triggers: dict[int, int] = {}  # guest vector -> our dup of the VM's eventfd
        self.traps = 0  # software steps taken for the guest's I/O doorbell writes
        #: Doorbells and traps before the first failover of a two-path share, and after it.
        self.steps = {"before_fault": DoorbellSteps(), "after_fault": DoorbellSteps()}
        self.open = True
        #: The share was cut (its drive's borrow or its own share ended): a removed device.
        self.revoked = False
        self.mdev: str | None = None  # the mdev the VM opened it through (``SimVm``)
        #: The epoch (fencing token) of the last hot move the share made (``move_share``).
        self.epoch = 0
        guest = drive.hw.guest(node, vm)
        #: A two-path share's relay onto its primary and backup queue pairs (else None).
        self.relay: QueueRelay | None = None
        self.backup: NtbPath | None = None  # its backup path while mapped
        self.failed: set[str] = set()  # the cables of the primary path it failed over from
        self.rings: _RingMemory | None = None
        if share.paths > 1:
            self.rings = _RingMemory(drive.hw.node(node).memory, ring_bytes(share.queue_pairs), vm)
            self.relay = QueueRelay(
                share,
                guest,
                self.rings,
                drive.manager,
                self._ring_real,
                self._interrupt,
                CommandTimer(drive.command_timeout, drive.clock),
                page=share.page is not None,
                dstrd=drive.controller.config.dstrd,
            )
        #: Its extent of the drive's controller memory buffer as its CPU reaches it (BAR 2 of
        #: its virtual controller), None when its queues are in RAM only.
        self.cmb: CmbWindow | None = None
        self.cmb_mapped = False  # the drive's address space of the share maps the extent
        #: Its CPU's windows onto the drive by kind ("cmb": its extent, "doorbell": its own
        #: doorbell page): (its node's adapter, the segments each takes there).
        self.cpu_windows: dict[str, tuple[str, tuple[int, ...]]] = {}
        extent = share.cmb_extent
        if extent is not None and drive.cmb is not None:
            self.cmb = CmbWindow(
                drive.cmb.memory,
                drive.device.lender,
                node,
                drive.cmb.extent_frames(*extent),
                self.doorbell_route,
                drive.hw.dead_links,
                lambda: self.open and not self.revoked,
                share.name,
                self._cmb_carried,
            )
            for frame in self.cmb.frames:  # nothing of the extent's last owner is left
                drive.cmb.memory.write(frame, bytes(FRAME))
        self.virtual = VirtualNvmeController(
            share,
            drive.controller.config,
            drive.namespace.block_size,
            guest,
            self.relay if self.relay is not None else drive.manager,
            self._interrupt,
            self.relay if self.relay is not None and self.relay.shadow is not None else None,
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

    def interrupt_path(self, path: int = PRIMARY) -> str:
        """``"ntb"`` while path ``path``'s completion interrupts cross the NTB as MSI, else
        ``"relay"`` (not admitted, not mapped yet, or a VM on the drive's lender)."""
        return NTB if path in self.msi_mapped else RELAY

    def set_triggers(self, fds: Mapping[int, int]) -> None:
        """The VMM's eventfds for guest vectors (1..queue pairs; -1 de-assigns one), as its
        ``VFIO_DEVICE_SET_IRQS`` on the share's mdev: the VM's target signals them. A
        two-path share's completions go to its relay first, which signals the guest."""
        for vector, fd in fds.items():
            if not 1 <= vector <= self.share.queue_pairs:
                raise FabricError(
                    f"NVMe share {self.name}: vector {vector} is not one of its 1.."
                    f"{self.share.queue_pairs}"
                )
            old = self._triggers.pop(vector, None)
            if old is not None:
                os.close(old)
            if fd >= 0:
                self._triggers[vector] = os.dup(fd)
            if self.msi_target is not None and self.relay is None:
                self.msi_target.assign(self.msi_first + vector - 1, self._triggers.get(vector, -1))

    def _data(self, path: int, vector: int) -> int:
        return self.msi_first + path * self.share.queue_pairs + vector - 1

    def from_drive(self, path: int, vector: int) -> None:
        """The drive raised the completion interrupt of guest vector ``vector`` on path
        ``path``'s queue pair: a posted write over the NTB when that path's route is mapped,
        else the relay (mechanism 7, the manager's software here)."""
        if path in self.msi_mapped:
            self._post(path, vector)
            return
        self.msi.relayed += 1
        self._deliver(path, vector)

    def _deliver(self, path: int, vector: int) -> None:
        """What reaches the VM's host: a two-path share's relay takes both pairs'
        completions; a one-path share's guest vector fires."""
        if self.relay is not None:
            self.relay.on_interrupt(path, vector)
        else:
            self._interrupt(vector)

    def _post(self, path: int, vector: int) -> None:
        """The drive's posted write of the vector's message in the path's address space,
        resolved hop by hop like its DMA: lender IOMMU, NTB segment, requester LUTs, the
        drive's ingress domain on the VM's node, the target page. A fault (a dead link, a
        mapping gone) loses it: nothing reaches the VM."""
        drive = self.drive
        asid = self.share.asid if path == PRIMARY else self.share.backup_asid
        data = self._data(path, vector)
        try:
            hit = drive.hw.resolve_dma(drive.fdid, asid_base(asid) + MSI_IOVA, write=True)
        except DmaFault as fault:
            self.msi.lost += 1
            self.msi_faults.append(fault)
            log.debug("MSI of share %s vector %d faulted: %s", self.name, vector, fault)
            return
        self.last_hops = hit.hops
        target = drive.msi_targets.at(hit.node, hit.address) if hit.kind == "irq" else None
        if target is None or not target.write(hit.address - target.base, data):
            self.msi.lost += 1  # it decodes as something else: no interrupt
            return
        self.msi.delivered += 1

    def mastering(self) -> bool:
        """Bus Master is on: the share's DMA windows are mapped."""
        return bool(self.config.command & regs.COMMAND_MASTER)

    def dirty_source(self) -> tuple[IommuDomain, int]:
        """Where the drive's DMA into this VM's RAM is translated on the VM's node (the
        drive's ingress domain there, or the lender's domain for a VM on the lender), and the
        first IOVA of the share's address space in it: a hot migration logs the pages it
        dirties there."""
        base = asid_base(self.share.asid)
        if self.drive.crossing(self.node) is None:
            return self.drive.hw.lender_domain(self.drive.fdid), base
        return self.drive._domain(self.node), base

    def set_master(self, on: bool = True) -> None:
        """What the guest's ``pci_set_master``/``pci_clear_master`` does to its controller's
        config space: Bus Master (with memory decoding) on or off."""
        cmd = self.config.read(regs.COMMAND, 2) | regs.COMMAND_MEMORY
        mask = regs.COMMAND_MASTER
        self.config.write(regs.COMMAND, 2, cmd | mask if on else cmd & ~mask)

    def status(self) -> dict[str, object]:
        out = {
            **self.share.as_dict(),
            "node": self.node,
            "vm": self.vm,
            "cmb_mapped": self.cmb_mapped,
            "real_queues": self.drive.manager.real_queues(self.name),
            "rejections": self.drive.manager.rejections(self.name),
        }
        if self.relay is not None:
            out["relay"] = self.relay.status()
        out["interrupts"] = {
            "paths": {
                "primary" if p == PRIMARY else "backup": self.interrupt_path(p)
                for p in range(self.share.paths)
            },
            **msgspec.structs.asdict(self.msi),
        }
        out["steps"] = {k: msgspec.structs.asdict(v) for k, v in self.steps.items()}
        return out

    def count_doorbell(self, trapped: bool) -> None:
        """One I/O doorbell write of the guest's (``trapped``: a software step took it)."""
        relay = self.relay
        fault = relay is not None and bool(relay.stats.switches)
        steps = self.steps["after_fault" if fault else "before_fault"]
        steps.doorbells += 1
        if trapped:
            steps.traps += 1
            self.traps += 1

    def timeout(self) -> bool:
        """Check the virtual controller's command timer (a two-path share), on the drive's
        clock: when a command on its primary pair is past its deadline, the backup pair takes
        over. True if it did."""
        return self.relay is not None and self.relay.timeout()

    def _ring_real(self, qid: int, completion: bool, value: int) -> None:
        """The relay rings real doorbell ``qid``: MMIO from the VM's node through the path of
        the pair ``qid`` belongs to (a backup queue id: the backup path; else the drive's
        crossing into the node)."""
        share = self.share
        backup = qid > share.qid_base + share.queue_pairs
        path = self.doorbell_route(backup)
        offset = spec.doorbell_offset(qid, completion, self.drive.controller.config.dstrd)
        self.drive.hw.mmio_write(self.node, self.drive.fdid, 0, offset, 4, value, path=path)

    def mmio(self, offset: int, size: int, value: int) -> None:
        """A write of the guest's (or of its trap) into the drive's BAR0, from the VM's node,
        over the drive's crossing into the node (never a guess from LUT entries: a two-path
        share's backup puts one on another adapter of the node)."""
        path = self.doorbell_route()
        self.drive.hw.mmio_write(self.node, self.drive.fdid, 0, offset, size, value, path=path)

    def doorbell_route(self, backup: bool = False) -> NtbPath | None:
        """The route of the VM's MMIO to the drive: the backup path for the backup pair's
        doorbells; else the drive's crossing into the node, or before any share of the node
        is mapped (no crossing yet), the cheapest live route, else the cheapest (its dead
        cable drops the write). The share's doorbells are the node's to ring from its
        opening on, so the route is named, not left to ``hw.crossing``, which refuses a node
        holding nothing. None on the lender."""
        if backup:
            return self.backup
        path = self.drive.crossing(self.node)
        if path is not None:
            return path
        hw, lender = self.drive.hw, self.drive.device.lender
        try:
            return hw.route(lender, self.node)
        except NoPathError:
            return next(iter(hw.routes(lender, self.node)), None)

    # --- the CPU's windows onto the drive (segments of its node's adapter) --------------------
    @property
    def cmb_window(self) -> tuple[str, tuple[int, ...]] | None:
        """Its window onto its CMB extent: (its node's adapter, the segments it takes)."""
        return self.cpu_windows.get("cmb")

    @property
    def doorbell_window(self) -> tuple[str, tuple[int, ...]] | None:
        """Its window onto its own doorbell page (page mode), as ``cmb_window``."""
        return self.cpu_windows.get("doorbell")

    def _window_remotes(self, kind: str, segment: int) -> list[int]:
        """Where each segment of window ``kind`` translates on the lender: for the CMB, the
        frame its first byte of the extent is in; for the doorbell page, the page in the
        drive's BAR0."""
        if kind == "cmb":
            assert self.cmb is not None
            count = -(-self.cmb.size // segment)
            return [self.cmb.frames[i * segment // FRAME] for i in range(count)]
        assert self.bar0.page is not None
        return [self.drive.device.bar_phys[0] + self.bar0.page]

    def _window_kinds(self) -> list[str]:
        kinds = ["cmb"] if self.cmb is not None else []
        return kinds + (["doorbell"] if self.bar0.page is not None else [])

    def place_cpu_windows(self) -> None:
        """Map its CPU's windows (onto its CMB extent, onto its doorbell page) in its node's
        adapter of the route its CPU takes now (``doorbell_route``), or program them again
        where a reset lost them; the old ones go once the new ones are mapped. All or
        nothing: ``ResourceExhaustedError`` naming the adapter when it has no free segments.
        Nothing for a VM on the lender."""
        if not self._window_kinds() or not self.open or self.revoked:
            return
        path = self.doorbell_route()
        if path is None:  # on the lender: no NTB between its CPU and the drive
            self.drop_cpu_windows()
            return
        self.commit_cpu_windows(self.map_cpu_windows(path))

    def map_cpu_windows(self, path: NtbPath) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The first half of ``place_cpu_windows`` for ``path``'s adapter on its node: the new
        windows mapped beside the old ones (lost segments of windows already there programmed
        again), to be kept by ``commit_cpu_windows`` or undone by ``unmap_cpu_windows``. All
        or nothing: ``ResourceExhaustedError`` naming the adapter, nothing left mapped."""
        kinds = self._window_kinds()
        if not kinds or not self.open or self.revoked:
            return {}
        lender = self.drive.device.lender
        adapter = self.drive.hw.adapter(path.dst.ref)
        seg = adapter.segment_size
        made: dict[str, tuple[str, tuple[int, ...]]] = {}
        try:
            for kind in kinds:
                remotes = self._window_remotes(kind, seg)
                have = self.cpu_windows.get(kind)
                if have is not None and have[0] == adapter.ref:
                    for index, remote in zip(have[1], remotes, strict=True):
                        if adapter.segment(index) is None:  # lost by a reset: again
                            adapter.map_segment(index, lender, remote)
                    continue
                first = adapter.free_segments(len(remotes))
                done: list[int] = []
                made[kind] = (adapter.ref, ())
                for i, remote in enumerate(remotes):
                    adapter.map_segment(first + i, lender, remote)
                    done.append(first + i)
                    made[kind] = (adapter.ref, tuple(done))
        except Exception:
            self.unmap_cpu_windows(made)
            raise
        return made

    def commit_cpu_windows(self, made: dict[str, tuple[str, tuple[int, ...]]]) -> None:
        """Keep the windows ``map_cpu_windows`` made; the ones they replace go."""
        for kind, window in made.items():
            self._drop_window(kind)
            self.cpu_windows[kind] = window

    def unmap_cpu_windows(self, made: dict[str, tuple[str, tuple[int, ...]]]) -> None:
        """Undo ``map_cpu_windows``: its new segments go, the windows the share had stay."""
        for ref, indices in made.values():
            for index in indices:
                self.drive.hw.adapter(ref).unmap_segment(index)

    def _drop_window(self, kind: str) -> None:
        window = self.cpu_windows.pop(kind, None)
        if window is not None:
            adapter = self.drive.hw.adapter(window[0])
            for index in window[1]:
                adapter.unmap_segment(index)

    def drop_cpu_windows(self) -> None:
        """Its CPU's windows go (the share ends)."""
        for kind in list(self.cpu_windows):
            self._drop_window(kind)

    def _carried(self, kind: str, offset: int, path: NtbPath) -> int:
        """The address in ``path``'s adapter window that carries ``offset`` of window
        ``kind``: ``no-target`` when no window of that adapter maps it, ``ntb-segment`` when
        its segment is not translated (a reset lost it) or translates elsewhere."""
        window = self.cpu_windows.get(kind)
        what = "CMB extent" if kind == "cmb" else "doorbell page"
        if window is None or window[0] != path.dst.ref:
            raise DmaFault(
                "no-target", offset, f"no segment of {path.dst.ref} maps the {what} of {self.name}"
            )
        adapter = self.drive.hw.adapter(path.dst.ref)
        seg = adapter.segment_size
        i = offset // seg
        index = window[1][i]
        address = adapter.segment_base(index) + offset % seg
        mapped = adapter.segment(index)
        want = (self.drive.device.lender, self._window_remotes(kind, seg)[i])
        if mapped is None or (mapped.remote_node, mapped.remote_addr) != want:
            raise DmaFault(
                "ntb-segment",
                address,
                f"segment {index} of {adapter.ref} does not carry the {what} of {self.name}",
            )
        return address

    def _cmb_carried(self, offset: int, path: NtbPath) -> int:
        return self._carried("cmb", offset, path)

    def page_write(self, offset: int, size: int, value: int) -> None:
        """A guest write into its doorbell page mapped onto the share's real one (page mode):
        through its doorbell window, then across the adapters as MMIO; a window that does not
        carry it is a master abort, counted as the MMIO resolver counts them."""
        assert self.bar0.page is not None
        path = self.doorbell_route()
        if path is not None:
            try:
                self._carried("doorbell", offset, path)
            except DmaFault:
                self.drive.hw.mmio.stats.aborted[path.dst.ref] += 1
                return
        self.mmio(self.bar0.page + offset, size, value)

    def _free_rings(self) -> None:
        if self.rings is not None:
            self.rings.close()
            self.rings = None

    def close(self) -> None:
        """The VM stops: its queues go, then its windows and pins. Idempotent."""
        if self.mdev is not None:
            self.drive.hw.close_mdev(self.mdev, self.node)
        if self.open:
            self.open = False
            self.drive._end_share(self)
        self._close_triggers()

    def _close_triggers(self) -> None:
        for fd in self._triggers.values():
            os.close(fd)
        self._triggers.clear()

    def revoke(self) -> None:
        """The share was taken from the VM (the hardware cuts its open mdev): its queues,
        routes and windows go now; the guest sees a removed controller. Idempotent."""
        if self.revoked:
            return
        self.revoked = True
        if self.open:
            self.open = False
            self.drive._end_share(self)
        self._close_triggers()
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
        self.dstrd = share.drive.controller.config.dstrd
        self.page = share.share.doorbell_page_offset(self.dstrd)

    @property
    def mapped(self) -> bool:
        """The guest's doorbell page is mapped onto the share's real one (page mode): the
        share has a page of its own and, with two paths, its queues are not relayed (at a
        failover the mapping goes before the relay reads the guest's shadow doorbells, so
        every later write is trapped)."""
        relay = self.s.relay
        return self.page is not None and (relay is None or relay.page_mode)

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
        slot = spec.doorbell_of(offset, self.dstrd)
        relay = self.s.relay
        mapped = self.mapped
        if relay is not None and not mapped:
            # two paths, relayed: every doorbell is trapped (one software step) and relayed
            # onto the active queue pair, whichever path that is
            if slot is None or size != 4:
                return
            qid, completion = slot
            if qid == 0:
                self.s.virtual.admin_doorbell(completion, value)
                return
            self.s.count_doorbell(trapped=True)
            if completion:
                relay.cq_doorbell(qid, value)
            else:
                relay.sq_doorbell(qid, value)
            return
        if mapped:
            assert self.page is not None
            # page mode (one path, or two on the primary's own rings): the guest page is
            # mapped onto the share's real doorbell page through the primary path, so the
            # write lands in the drive with no software in between (guest qid g = real
            # qid_base + g by construction); admin doorbells come back as stray doorbells.
            # (The count is the simulator's: a real mapping has none.)
            if slot is not None and slot[0] != 0:
                self.s.count_doorbell(trapped=False)
            self.s.page_write(offset - spec.DOORBELL_BASE, size, value)
            return
        if slot is None or size != 4:
            return
        qid, completion = slot
        if qid == 0:
            self.s.virtual.admin_doorbell(completion, value)
            return
        self.s.count_doorbell(trapped=True)  # trap mode: one software step per I/O doorbell
        if qid <= self.s.share.queue_pairs:
            real = spec.doorbell_offset(self.s.share.real_qid(qid), completion, self.dstrd)
            self.s.mmio(real, 4, value)


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
        link_events: bool = True,
        clock: Clock = time.monotonic,
        command_timeout: float = COMMAND_TIMEOUT,
        cmb_bytes: int = 0,
        msi_targets: MsiTargets | None = None,
    ) -> None:
        """``msi_targets``: the VMs' interrupt targets of this hardware, which its borrowed
        devices' MSI routes use too (one per hardware; None: the drive's own).
        ``cmb_bytes``: lender memory the manager keeps as the drive's controller memory
        buffer, an extent of it for each one-path share's submission queues (0: none).
        ``link_events=False``: the drive's manager and the VMs' virtual controllers do not
        hear link events (their hosts missed them): crossings are not moved, and a two-path
        share fails over only on a command timeout (``VmNvmeShare.timeout``): a command past
        ``command_timeout`` seconds on ``clock`` (which tests inject)."""
        if not (command_timeout > 0 and math.isfinite(command_timeout)):
            # checked before anything is taken: a two-path share's timer would refuse it later
            raise ConfigError(
                f"a command timeout must be a positive, finite number of seconds, not "
                f"{command_timeout!r} (Linux's default is {COMMAND_TIMEOUT:g})"
            )
        if cmb_bytes:
            cmbsz(cmb_bytes)  # a size CMBSZ can describe, or ConfigError, before anything
        self.hw = hardware
        self.fdid = fdid
        self.clock = clock
        self.command_timeout = command_timeout
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
        self._lut_users: dict[str, int] = {}  # lender adapter -> crossings through it
        #: (node, node's adapter) -> (the drive's requester there, crossings using it): the
        #: node's crossing and two-path shares' backup paths may enter by the same adapter
        self._far: dict[tuple[str, str], tuple[Requester, int]] = {}
        self._domains: dict[str, IommuDomain] = {}  # node -> the drive's ingress domain there
        self._backups: dict[str, ShareCrossing] = {}  # share -> its backup crossing, if mapped
        self.shares: dict[str, VmNvmeShare] = {}
        self.msi_targets = msi_targets if msi_targets is not None else MsiTargets(hardware)
        #: (node, target slot) -> the share paths whose interrupt route maps it in the node's
        #: ingress domain (both paths of a two-path share enter the same domain)
        self._msi_ingress: dict[tuple[str, int], int] = {}
        self.memory: HostDmaMemory | None = None
        self.cmb: CmbMemory | None = None
        self._remove_irq: Callable[[], None] = lambda: None
        #: Why the manager's borrow ended under it (every share ended with it), else None.
        self.ended: str | None = None
        self._remove_end = hardware.on_borrow_end(self._borrow_ended)
        self._remove_wiring = hardware.add_share_wiring(self)
        self._remove_link = (
            hardware.on_link_change(self._link_changed) if link_events else (lambda: None)
        )
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
            if cmb_bytes:
                self.cmb = CmbMemory(
                    hardware.node(self.device.lender).memory, cmb_bytes, MANAGER_VM
                )
            driver = NvmeDriver(DeviceBar0(self.device), self.memory, self.memory.alloc)
            self.manager = NvmeManager(self.controller, driver, f"nvme {fdid:#x}", cmb_bytes)
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
        self,
        node: str,
        vm: str,
        queue_pairs: int = 1,
        blocks: int = 0,
        share: Share | None = None,
        paths: int = 1,
        interrupts: Sequence[Claim] = (),
    ) -> VmNvmeShare:
        """Give VM ``vm`` on ``node`` (a running guest) a share of ``queue_pairs`` and
        ``blocks`` on ``paths`` paths, or the ``share`` the registry reserved for it; all or
        nothing. ``interrupts``: the interrupt windows its admission granted
        (``ShareOps.share_interrupt_windows``): those paths' completion interrupts cross the
        NTB as MSI once its windows are mapped; without, they are relayed."""
        self.hw.guest(node, vm)  # a running guest, or FabricError
        borrow = self.hw.borrowed(self.fdid)
        if self.ended is not None or borrow is None or borrow.vm != MANAGER_VM:
            raise FabricError(
                f"NVMe drive {self.fdid:#x} is not served by its manager any more"
                f" ({self.ended or 'its borrow ended'}); share it again ('vmlend nvme share')"
                " before VMs use it"
            )
        name = share.name if share is not None else f"vm:{node}/{vm}"
        if (share.paths if share is not None else paths) > 1 and node == self.device.lender:
            raise FabricError(
                f"a VM on {node}, the lender of {self.fdid:#x}, crosses no NTB: one path only"
            )
        share = self.manager.add_share(name, queue_pairs, blocks, decided=share, paths=paths)
        vms = None
        try:
            vms = VmNvmeShare(self, node, vm, share, msi_paths(interrupts))
            self.connect(vms)
            vms.place_cpu_windows()  # its CPU's windows onto its CMB extent, doorbell page
        except Exception:
            if vms is not None:
                vms.drop_cpu_windows()
            self.manager.remove_share(name)
            raise
        self.shares[name] = vms
        return vms

    def connect(self, vms: VmNvmeShare) -> None:
        """The manager routes ``vms``'s admin doorbells to its virtual controller and its
        completion interrupts to it (``VmNvmeShare.from_drive``: over the NTB or relayed)."""

        def one_path(vector: int) -> None:
            vms.from_drive(PRIMARY, vector)

        self.manager.connect(
            vms.name,
            vms.virtual.admin_doorbell,
            one_path,
            None if vms.relay is None else vms.from_drive,
        )

    def _map_share(self, vms: VmNvmeShare) -> None:
        """Bus Master of ``vms``'s controller went on: pin and map its RAM; all or nothing."""
        try:
            self._map(vms, self.hw.guest(vms.node, vms.vm).ranges)
            # the crossing into its node exists now: its CPU windows leave by that adapter
            vms.place_cpu_windows()
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
        if vms.cmb is not None:
            self._map_cmb(vms, base)
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
        self._map_path(vms, ranges, frames, ingress.domain, path.src.ref, base, None)
        if vms.msi_paths:
            self._msi_vectors(vms)
        if PRIMARY in vms.msi_paths:
            self._map_msi(vms, PRIMARY, ingress.domain, path.src.ref, base, None)
        if vms.relay is None:
            return
        # two paths: the primary's relay rings, then the backup path through the node's other
        # adapter (its segments name that adapter), in the backup's own address space
        self._map_rings(vms, PRIMARY, ingress.domain, path.src.ref, base, None)
        primary = self.hw.path_between(ingress.src, ingress.far)
        # a live route only: one over a dead cable would carry nothing until the link is back
        backup = next(
            (
                p
                for p in self.hw.routes(self.device.lender, vms.node)
                if p.dst.ref != ingress.far and not self.hw.dead_links(p)
            ),
            None,
        )
        if primary is None or backup is None:
            raise FabricError(
                f"NVMe share {vms.name} of {self.fdid:#x}: {vms.node} has no second adapter"
                f" reached from {self.device.lender} for its backup path"
            )
        user = self._user(vms.node, vms.name)
        self._cross(vms.node, backup, user)
        vms.backup = backup
        self._backups[vms.name] = ShareCrossing(self.fdid, vms.node, vms.name, backup)

        def uncross_backup() -> None:
            # forgotten with its crossing: the relay must not ring or switch onto freed ports
            vms.backup = None
            self._backups.pop(vms.name, None)
            self._uncross(vms.node, backup, user)

        undo.append(uncross_backup)
        bbase = asid_base(vms.share.backup_asid)
        via = backup.dst.ref
        self._map_path(vms, ranges, frames, ingress.domain, backup.src.ref, bbase, via)
        self._map_rings(vms, BACKUP, ingress.domain, backup.src.ref, bbase, via)
        if BACKUP in vms.msi_paths:
            self._map_msi(vms, BACKUP, ingress.domain, backup.src.ref, bbase, via)

    def _msi_vectors(self, vms: VmNvmeShare) -> None:
        """Data values for the share's vectors (each path's) in its VM's target, each
        handled by the share (a one-path share's also signal the VMM's eventfds)."""
        target = self.msi_targets.target(vms.node, vms.vm)
        qp = vms.share.queue_pairs
        count = qp * vms.share.paths
        first = target.allocate(count)
        vms.msi_target, vms.msi_first = target, first
        for path in range(vms.share.paths):
            for vector in range(1, qp + 1):

                def handle(path: int = path, vector: int = vector) -> None:
                    vms._deliver(path, vector)

                target.listen(first + path * qp + vector - 1, handle)
        if vms.relay is None:
            for vector, fd in vms._triggers.items():
                target.assign(first + vector - 1, fd)

        def free() -> None:
            vms.msi_target = None
            target.free(first, count)

        vms.windows.undo.append(free)

    def _map_msi(
        self,
        vms: VmNvmeShare,
        path: int,
        domain: IommuDomain,
        src_ref: str,
        base: int,
        via: str | None,
    ) -> None:
        """Path ``path``'s interrupt route, as a borrowed device's (``vmlend.sim.ntbmsi``):
        the lender IOMMU maps ``MSI_IOVA`` of the path's address space onto the VM's slot in
        the interrupt segment of ``src_ref`` towards the VM's node (shared with the node's
        borrowed devices and other shares), and the drive's ingress domain there maps that
        slot onto the VM's target page. Not mapped (the share's interrupts are then relayed,
        and the check says so) when the segment cannot be had."""
        assert vms.msi_target is not None
        target, node = vms.msi_target, vms.node
        lender_domain = self.hw.lender_domain(self.fdid)
        user = (self.fdid, vms.name, path)
        offset = target.slot * PAGE
        undo: list[Callable[[], object]] = []
        try:
            if offset >= self.hw.adapter(src_ref).segment_size:
                raise FabricError(f"{src_ref}: no room for interrupt slot {target.slot}")
            window = self.msi_targets.acquire_segment(src_ref, node, user, via=via)
            undo.append(lambda: self.msi_targets.release_segment(src_ref, node, user, via=via))
            key = (node, target.slot)
            if not self._msi_ingress.get(key):
                domain.map(MSI_IOVA + offset, target.base, PAGE)
            self._msi_ingress[key] = self._msi_ingress.get(key, 0) + 1

            def unmap_ingress() -> None:
                self._msi_ingress[key] -= 1
                if not self._msi_ingress[key]:
                    del self._msi_ingress[key]
                    domain.unmap(MSI_IOVA + offset, PAGE)

            undo.append(unmap_ingress)
            # the device's side last: it never reaches a segment that leads nowhere
            lender_domain.map(base + MSI_IOVA, window + offset, PAGE)
            undo.append(lambda: lender_domain.unmap(base + MSI_IOVA, PAGE))
        except FabricError as e:
            while undo:
                undo.pop()()
            log.warning(
                "NVMe share %s of %#x: interrupts of its path %d relayed: %s",
                vms.name,
                self.fdid,
                path,
                e,
            )
            return
        vms.msi_mapped.add(path)
        undo.append(lambda: vms.msi_mapped.discard(path))
        vms.windows.undo.extend(undo)

    def _map_cmb(self, vms: VmNvmeShare, base: int) -> None:
        """The share's address space maps ``GUEST_CMB_BASE`` onto its CMB extent, and no
        other part of the CMB: its queues there are fetched in the lender, no NTB crossed."""
        assert vms.cmb is not None
        lender_domain = self.hw.lender_domain(self.fdid)
        undo = vms.windows.undo
        for i, phys in enumerate(vms.cmb.frames):
            iova = base + GUEST_CMB_BASE + i * FRAME
            lender_domain.map(iova, phys, FRAME)

            def unmap_cmb(iova: int = iova) -> None:
                lender_domain.unmap(iova, FRAME)

            undo.append(unmap_cmb)

        def unmapped() -> None:
            vms.cmb_mapped = False

        vms.cmb_mapped = True
        undo.append(unmapped)

    def _map_path(
        self,
        vms: VmNvmeShare,
        ranges: list[GuestRange],
        frames: list[Frame],
        domain: IommuDomain,
        src_ref: str,
        base: int,
        via: str | None,
    ) -> None:
        """The guest's RAM in address space ``base`` on one path: the node's ingress domain
        onto its frames, NTB segments of ``src_ref`` (towards adapter ``via`` when given) and
        the lender IOMMU onto those segments."""
        undo = vms.windows.undo
        lender_domain = self.hw.lender_domain(self.fdid)
        for f in frames:
            domain.map(base + f.gpa, f.phys, f.size)

            def unmap_ingress(f: Frame = f) -> None:
                domain.unmap(base + f.gpa, f.size)

            undo.append(unmap_ingress)
        src = self.hw.adapter(src_ref)
        seg = src.segment_size
        # the planner's windows (low, high), each rounded out to whole segments: exactly the
        # segments admission claimed for the share (``vmlend.ledger.nvmeadmit``)
        for _name, group in window_groups(ranges, seg):
            start = group[0].start // seg * seg
            count = -(-(group[-1].end - start) // seg)
            first = src.free_segments(count)
            for i in range(count):
                src.map_segment(first + i, vms.node, base + start + i * seg, via=via)

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

    def _map_rings(
        self,
        vms: VmNvmeShare,
        path: int,
        domain: IommuDomain,
        src_ref: str,
        base: int,
        via: str | None,
    ) -> None:
        """Path ``path``'s half of the relay rings at ``RING_IOVA`` of address space ``base``:
        one segment (``nvmeadmit.RING_SEGMENTS``)."""
        assert vms.rings is not None
        undo = vms.windows.undo
        lender_domain = self.hw.lender_domain(self.fdid)
        half = len(vms.rings.frames) // 2
        offset = path * half * FRAME
        for i, phys in enumerate(vms.rings.frames[path * half : (path + 1) * half]):
            iova = base + RING_IOVA + offset + i * FRAME
            domain.map(iova, phys, FRAME)

            def unmap_ring(iova: int = iova) -> None:
                domain.unmap(iova, FRAME)

            undo.append(unmap_ring)
        src = self.hw.adapter(src_ref)
        index = src.free_segments(1)
        src.map_segment(index, vms.node, base + RING_IOVA, via=via)
        undo.append(lambda: src.unmap_segment(index))
        size = half * FRAME
        lender_domain.map(base + RING_IOVA + offset, src.segment_base(index) + offset, size)
        undo.append(lambda: lender_domain.unmap(base + RING_IOVA + offset, size))

    def move_share(
        self,
        vms: VmNvmeShare,
        node: str,
        token: int,
        interrupts: Sequence[Claim] | None = None,
    ) -> None:
        """A hot migration's switch-over (the VM paused, its guest's RAM existing on ``node``
        too): ``vms`` follows its VM to ``node``. Its real queues, vectors, blocks and address
        space stay, so commands the guest queued are fetched on ``node``; its DMA windows are
        re-pointed (the source's unmapped and unpinned, the destination's pinned and mapped
        through the drive's crossing into ``node``), its doorbells rung from ``node``, its
        emulated admin queue served from the destination's RAM, its name follows the node.
        The controller runs a command when its doorbell is rung, so at the pause nothing of
        the share is in flight: that is its quiesce. ``token``: the share's new epoch (the
        registry's hand-over); ``StaleTokenError`` for one not newer than the last move's.
        All or nothing: a refused mapping puts the share back on its node. ``interrupts``: the
        interrupt windows admitted for it on ``node`` (None: as it had); its interrupt route
        is mapped again with its windows, towards its VM's target on ``node``."""
        old_node, old_name = vms.node, vms.name
        old_msi = vms.msi_paths
        if vms.relay is not None:
            raise FabricError(
                f"NVMe share {old_name} of {self.fdid:#x} relays onto two paths from memory of"
                f" {old_node}: it moves unplugged"
            )
        if not vms.open or vms.revoked:
            raise FabricError(f"NVMe share {old_name} of {self.fdid:#x} is closed")
        if token <= vms.epoch:
            raise StaleTokenError(self.fdid, token, vms.epoch, "an NVMe share's hot move")
        guest = self.hw.guest(node, vms.vm)
        before = vms.virtual.memory
        mastering = vms.mastering()
        vms.windows.close()  # the source's windows, pins and crossing use go
        try:
            vms.node = node
            vms.virtual.memory = guest
            if interrupts is not None:
                vms.msi_paths = msi_paths(interrupts)
            if mastering:
                self._map_share(vms)
            else:
                vms.place_cpu_windows()  # from ``node``'s adapter now
        except Exception:
            vms.node, vms.virtual.memory, vms.msi_paths = old_node, before, old_msi
            if mastering:
                self._map_share(vms)
            raise
        new_name = vm_share(Holder(node, vms.vm))
        moved = self.manager.rename_share(old_name, new_name)
        vms.share = vms.virtual.share = moved
        self.shares[new_name] = self.shares.pop(old_name)
        vms.epoch = token
        if vms.cmb is not None:  # the guest's CPU now reaches its extent from ``node``
            vms.cmb.node = node
        if vms.mdev is not None and self.hw.close_mdev(vms.mdev, old_node):
            self.hw.open_mdev(vms.mdev, self.fdid, node, vms.vm, vms.revoke, share=True)
        log.info("NVMe share %s of %#x moved to %s (epoch %d)", old_name, self.fdid, node, token)

    # --- crossings into nodes --------------------------------------------------------------
    def _domain(self, node: str) -> IommuDomain:
        domain = self._domains.get(node)
        if domain is None:
            domain = self._domains[node] = IommuDomain(f"{node}:nvme{self.fdid:#x}")
        return domain

    def _key(self) -> int:
        return fabric_requester_key(
            self.hw.node(self.device.lender).spec.node_id, self.device.requester_id
        )

    def _far_add(self, node: str, ref: str) -> Requester:
        """The drive's LUT entry on ``node``'s adapter ``ref`` and its context in the node's
        ingress domain (counted: shared by every crossing through that adapter)."""
        have = self._far.get((node, ref))
        if have is not None:
            self._far[(node, ref)] = (have[0], have[1] + 1)
            return have[0]
        dst, key = self.hw.adapter(ref), self._key()
        # the far side sees the id its own entry for the drive assigns, and nothing else
        entry = dst.lut_add(key)
        requester = Requester(dst.assigned_requester_id(entry, key))
        try:
            self.hw.node(node).iommu.attach(requester, self._domain(node))
        except Exception:
            dst.lut_remove(key)
            raise
        self._far[(node, ref)] = (requester, 1)
        return requester

    def _far_drop(self, node: str, ref: str) -> None:
        requester, users = self._far[(node, ref)]
        if users > 1:
            self._far[(node, ref)] = (requester, users - 1)
            return
        del self._far[(node, ref)]
        self.hw.node(node).iommu.detach(requester)
        self.hw.adapter(ref).lut_remove(self._key())

    def _user(self, node: str, backup_of: str = "") -> tuple[int, str]:
        return share_user(self.fdid, node, backup_of)

    def _cross(self, node: str, path: NtbPath, user: tuple[int, str]) -> None:
        """The drive's DMA may cross ``path`` into ``node``: its requester entry on every
        switch port of the route (``user``'s), LUT entries at both ends (one per adapter
        serves every crossing through it), all or nothing."""
        requester = requester_device(self.device.spec)
        ports = route_ports(path)
        self.hw.switch_ports.add(ports, requester, user)  # all or nothing
        rid = self.device.requester_id
        try:
            self.hw.adapter(path.src.ref).lut_add(rid)
        except Exception:
            self.hw.switch_ports.remove(ports, requester, user)
            raise
        self._lut_users[path.src.ref] = self._lut_users.get(path.src.ref, 0) + 1
        try:
            self._far_add(node, path.dst.ref)
        except Exception:
            self._lut_release(path.src.ref, rid)
            self.hw.switch_ports.remove(ports, requester, user)
            raise

    def _uncross(self, node: str, path: NtbPath, user: tuple[int, str]) -> None:
        self._far_drop(node, path.dst.ref)
        self._lut_release(path.src.ref, self.device.requester_id)
        self.hw.switch_ports.remove(route_ports(path), requester_device(self.device.spec), user)

    def crossing(self, node: str) -> NtbPath | None:
        """The route the drive's crossing into ``node`` takes now (the one the node's shares
        ring their primary doorbells over); None while no share of the node is mapped."""
        ingress = self._ingress.get(node)
        return ingress.path if ingress is not None else None

    def _enter(self, node: str, path: NtbPath) -> _Ingress:
        ingress = self._ingress.get(node)
        if ingress is None:
            self._cross(node, path, self._user(node))
            ingress = self._ingress[node] = _Ingress(
                path.src.ref, path.dst.ref, self._domain(node), path=path
            )
        ingress.users += 1
        return ingress

    def _link_changed(self, link: str, up: bool) -> None:
        """A link event. Down: a two-path share whose primary path (the crossing into its
        node) is dead switches to its backup queue pair; then every crossing of the drive into
        a node whose route now passes a dead cable moves to another route from the same lender
        adapter, if one is up. The segments and the node's ingress domain stay (they name the
        node's addresses), so one-path shares' queues and commands go on as they are: nothing
        is resubmitted, nothing lost. Up: a two-path share on its backup whose primary path
        works again switches back to its primary pair, deleting and creating it again when
        the link came back without its mappings (which are programmed again first); and every
        crossing goes back to the cheapest live route from its lender adapter."""
        if self.ended is not None:
            return
        if up:
            self._link_back(link)
            return
        for vms in list(self.shares.values()):
            if vms.relay is None or vms.backup is None or not vms.open:
                continue
            path = self.hw.crossing(self.fdid, vms.node)
            if path is not None and self.hw.dead_links(path):
                if self.hw.dead_links(vms.backup):
                    continue  # no path left: nothing to switch to
                vms.failed = set(path.links)
                vms.relay.fail_over(f"link {link} down")
        for node in sorted(self._ingress):
            path = self.hw.crossing(self.fdid, node)
            if path is not None and self.hw.dead_links(path):
                self._reroute(node, path)

    def _link_back(self, link: str) -> None:
        # the event as the adapters' driver raised it: back with or without its mappings
        lost = bool(self.hw.link_log) and self.hw.link_log[-1] == (link, "up-lost")
        for node, ingress in sorted(self._ingress.items()):
            # every crossing goes back to its cheapest live route: the one admission claims
            # for the node's next share, and a two-path share's primary and backup use
            # different adapters again
            old = self.hw.path_between(ingress.src, ingress.far)
            if old is not None:
                self._reroute(node, old)
        for vms in list(self.shares.values()):
            if vms.relay is None or not vms.open:
                continue
            path = self.hw.crossing(self.fdid, vms.node)
            primary_dead = path is None or bool(self.hw.dead_links(path))
            if vms.relay.active == PRIMARY:
                # both paths were dead when the primary failed: the backup is back first
                if primary_dead and vms.backup is not None and not self.hw.dead_links(vms.backup):
                    vms.failed = set(path.links) if path is not None else set()
                    vms.relay.fail_over(f"link {link} up: its backup path works")
                continue
            if primary_dead:
                continue
            recreate = lost and link in vms.failed
            if recreate:  # its driver programs again what the adapters lost
                self.hw.reprogram(link)
            why = f"link {link} up" + (" without its mappings" if recreate else "")
            vms.relay.switch_back(why)
            vms.failed = set()

    def _reroute(self, node: str, old: NtbPath) -> bool:
        live = [
            p
            for p in self.hw.routes(self.device.lender, node)
            if p.src.ref == old.src.ref and not self.hw.dead_links(p)
        ]
        if not live or live[0].dst.ref == old.dst.ref:
            if self.hw.dead_links(old):
                log.warning(
                    "NVMe drive %#x: no other route to %s than %s", self.fdid, node, old.describe()
                )
            return False
        new = live[0]
        ingress = self._ingress[node]
        requester, user = requester_device(self.device.spec), self._user(node)
        # the ports it holds entries on: the route it was made or last moved over
        old_ports = route_ports(ingress.path if ingress.path is not None else old)
        added = [p for p in route_ports(new) if p not in old_ports]
        try:
            self.hw.switch_ports.add(added, requester, user)  # all or nothing
        except SwitchPortFullError as e:  # the route it has is the one it keeps
            log.warning("NVMe drive %#x: crossing to %s not moved: %s", self.fdid, node, e)
            return False
        # The CPUs' windows follow the crossing, in the same all or nothing: mapped on the new
        # adapter before anything moves, so a full adapter keeps the route it has (as a full
        # switch port does) instead of moving the crossing without its windows.
        windows: list[tuple[VmNvmeShare, dict[str, tuple[str, tuple[int, ...]]]]] = []
        try:
            for vms in self.shares.values():
                if vms.node == node:
                    windows.append((vms, vms.map_cpu_windows(new)))
        except ResourceExhaustedError as e:
            for vms, made in windows:
                vms.unmap_cpu_windows(made)
            self.hw.switch_ports.remove(added, requester, user)
            log.warning("NVMe drive %#x: crossing to %s not moved: %s", self.fdid, node, e)
            return False
        try:
            self._far_add(node, new.dst.ref)
        except Exception:
            for vms, made in windows:
                vms.unmap_cpu_windows(made)
            self.hw.switch_ports.remove(added, requester, user)
            raise
        self._far_drop(node, ingress.far)
        new_ports = route_ports(new)
        self.hw.switch_ports.remove([p for p in old_ports if p not in new_ports], requester, user)
        ingress.far, ingress.path = new.dst.ref, new
        for vms, made in windows:
            vms.commit_cpu_windows(made)
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
            del self._ingress[node]
            path = ingress.path
            assert path is not None  # every ingress is made over a route
            self._uncross(node, path, self._user(node))

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
            vms.drop_cpu_windows()
            vms._free_rings()
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
        self._free_cmb()
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
            if v.open and v.bar0.mapped:
                out.append(ShareWire(self.fdid, v.node, v.vm, "doorbell-page", f"{v.bar0.page:#x}"))
        return out

    def crossings(self) -> list[ShareCrossing]:
        """The drive's crossings into nodes now: each node's shares', each two-path share's
        backup (their switch ports hold the drive's requester entries)."""
        out = [
            ShareCrossing(self.fdid, node, "", i.path)
            for node, i in sorted(self._ingress.items())
            if i.path is not None
        ]
        return out + [c for _name, c in sorted(self._backups.items())]

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
        out = []
        for v in self.shares.values():
            msi = PRIMARY in v.msi_paths
            out.append(
                ShareGrant(
                    self.fdid, v.node, v.vm, v.share.asid, cmb=v.share.cmb_extent, msi=msi
                )
            )
            if v.share.paths > 1:
                out.append(
                    ShareGrant(
                        self.fdid,
                        v.node,
                        v.vm,
                        v.share.backup_asid,
                        backup=True,
                        msi=BACKUP in v.msi_paths,
                    )
                )
        return out

    # --- life -----------------------------------------------------------------------------------
    def status(self) -> dict[str, object]:
        return {
            "fdid": f"{self.fdid:#x}",
            "mode": "shared",
            "doorbells": self.mode,
            "queue_pairs": self.controller.config.queue_pairs,
            "free_queue_pairs": self.manager.book.free_queue_pairs(),
            "cmb_bytes": self.cmb.size if self.cmb is not None else 0,
            "blocks": self.namespace.blocks,
            "shares": [s.status() for s in self.shares.values()],
        }

    def _free_cmb(self) -> None:
        if self.cmb is not None:
            self.cmb.close()
            self.cmb = None

    def cmb_windows(self) -> list[CmbWindowMap]:
        """What each open share's VM reaches of the CMB through its window."""
        return [
            CmbWindowMap(self.fdid, v.node, v.vm, v.share.asid, tuple(v.cmb.frames))
            for v in self.shares.values()
            if v.cmb is not None and v.open and not v.revoked
        ]

    def cpu_windows(self) -> list[ShareWindowMap]:
        """The segments each share's CPU windows onto the drive take now."""
        return [
            ShareWindowMap(self.fdid, v.node, v.vm, v.share.asid, kind, ref, indices)
            for v in self.shares.values()
            for kind, (ref, indices) in sorted(v.cpu_windows.items())
        ]

    def cmb_frames(self) -> list[int]:
        """The frames of its controller memory buffer in lender memory ([] when none)."""
        return list(self.cmb.frames) if self.cmb is not None else []

    def _teardown(self) -> None:
        self._remove_end()
        self._remove_link()
        self._remove_irq()
        if self.memory is not None:
            self.memory.close()
            self.memory = None
        self._free_cmb()
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
