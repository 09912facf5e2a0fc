"""Hot migration in the simulator: a running VM moves to another node while its remote devices
stay plugged and keep working; only their mappings follow its memory (docs/migration.md).

A lent device belongs to neither host: it sits behind its lender's NTB and reaches its VM
through windows into the borrower's RAM. So moving the VM moves those windows, not the device.
Phases, each followed by the invariant checker (``check``):

1. **admit and claim** (``vmlend.ledger.handover.claim_destination``): every device kind can
   be quiesced, the whole VM is admitted on the destination, and its room there is claimed
   beside the source's. Refused: nothing changed.
2. **incoming guest**: the destination's RAM for the VM exists (the destination QEMU).
3. **pre-copy**, the devices running: each round copies the pages written since the last one.
   The vCPUs' writes are in the guest's dirty log (KVM's); the devices' DMA writes are in the
   borrower IOMMU's dirty log of the VM's domain (for a device lent by the VM's own node, its
   own domain's), so a device writing into RAM during the copy loses nothing.
4. **switch-over**, the VM paused: each device is quiesced (its kind's way: what it fetched
   completes, nothing new is fetched, its interrupts are held pending), the last dirty pages
   are copied (the stop-and-copy, at ``bandwidth``), the holds move to the destination in one
   registry transaction (a newer fencing token), then each device's borrow, DMA windows,
   interrupt route (MSI over the NTB) and peer maps are re-pointed into the destination's RAM
   through the destination's adapter, carrying that token; the source's RAM goes.
5. **source released**: the source's claims go.
6. **resume**: the devices run again on the destination (the interrupts they held are sent
   once, there), then the VM's vCPUs.

A device's *blackout* runs from its quiesce request to the first command it accepts on the
destination (or its readiness, when none waits); the VM's *downtime* from the pause to the
resume. Times are the ``clock``'s: measured work plus the modelled copy (bytes / bandwidth).
The VM's queue-level NVMe shares follow it too (``SharedNvmeDrive.move_share``): admitted and
claimed with its devices, their DMA logged in the drive's ingress domain during the copy,
handed over in the same transaction under a newer epoch, their windows re-pointed into the
destination's RAM through the drive's crossing into the destination; the other VMs sharing
the drive keep their queues and windows untouched. A share of two paths (its relay rings in
the source host's memory) cannot move hot.

A failure before the holds moved (a device that cannot quiesce, a refused mapping) resumes
the VM on the source with everything as before and raises.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import msgspec

from vmlend.errors import FabricError, QuiesceError
from vmlend.ledger import handover
from vmlend.ledger.admission import vm_share
from vmlend.ledger.nvmeshares import interrupt_windows
from vmlend.lending.quiesce import how_to_quiesce
from vmlend.nvme.guard import asid_base
from vmlend.registry import Registry
from vmlend.sim.devqueue import DeviceQueue
from vmlend.sim.dmawin import VmDmaWindows
from vmlend.sim.guest import SimGuest
from vmlend.sim.hostmem import FRAME
from vmlend.sim.iommu import IommuDomain
from vmlend.sim.ntbmsi import NtbMsiRoute
from vmlend.sim.passthrough import BarObserver
from vmlend.sim.simvm import SimVm, VmFabric
from vmlend.topology.model import Holder

log = logging.getLogger(__name__)

#: The memory copy's bandwidth when none is given: 10 Gbit/s Ethernet, bytes per second.
DEFAULT_BANDWIDTH = 1.25e9
#: Pre-copy stops when a round leaves at most this many dirty pages (QEMU's downtime limit,
#: 300 ms at the bandwidth, would allow far more; a small figure keeps the switch short).
STOP_PAGES = 256
#: ... or after this many rounds (a guest dirtying faster than the copy never converges).
MAX_ROUNDS = 8


class MigrationClock:
    """Measured time plus modelled time: ``now()`` is the wall clock advanced by every
    ``spend`` (the simulated copy of bytes that took no real time)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.modelled = 0.0

    def now(self) -> float:
        return self._clock() + self.modelled

    def spend(self, seconds: float) -> None:
        self.modelled += seconds


class Round(msgspec.Struct, frozen=True):
    """One pre-copy round (or the stop-and-copy): pages sent, and how many of those the
    devices' DMA dirtied (the rest: the vCPUs)."""

    pages: int
    dma_pages: int


class HotMigration(msgspec.Struct):
    """What a hot migration did and measured (seconds)."""

    vm: str
    source: str
    destination: str
    rounds: list[Round]
    final: Round  # the stop-and-copy's
    downtime: float
    blackout: dict[int, float]
    tokens: dict[int, int]
    bandwidth: float

    @property
    def dma_pages(self) -> int:
        """Pages the devices' DMA dirtied over the whole migration."""
        return sum(r.dma_pages for r in self.rounds) + self.final.dma_pages


Check = Callable[[str], None]


def _nocheck(_step: str) -> None:
    pass


class _Dirty:
    """The dirty logs of a running VM: its vCPUs' and its devices' (IOMMU) writes, and its
    NVMe shares' (each share's address space of a drive's domain, which other VMs' shares
    also use: only its own pages count, as guest pages)."""

    def __init__(
        self,
        guest: SimGuest,
        domains: list[IommuDomain],
        spaces: list[tuple[IommuDomain, int]] = [],  # noqa: B006 - never mutated
    ) -> None:
        self.guest, self.domains, self.spaces = guest, domains, spaces
        self._started: list[IommuDomain] = []

    def start(self) -> None:
        self.guest.start_dirty_log()
        for d in [*self.domains, *(d for d, _b in self.spaces)]:
            if not d.dirty_logging:  # a domain of two spaces is started once
                d.start_dirty_log()
                self._started.append(d)

    def take(self) -> tuple[set[int], set[int]]:
        """(every dirty page, the ones a device wrote)."""
        dma: set[int] = set()
        for d in self.domains:
            dma |= d.take_dirty()
        taken = {id(d): d.take_dirty() for d, _b in self.spaces}
        for d, base in self.spaces:
            first, end = base // FRAME, (base + asid_base(1)) // FRAME
            dma |= {p - first for p in taken[id(d)] if first <= p < end}
        return self.guest.take_dirty() | dma, dma

    def stop(self) -> None:
        self.guest.stop_dirty_log()
        for d in self._started:
            d.stop_dirty_log()


class _Run:
    def __init__(
        self,
        vm: SimVm,
        clock: MigrationClock,
        bandwidth: float,
        check: Check,
    ) -> None:
        self.vm, self.clock, self.bandwidth, self.check = vm, clock, bandwidth, check
        self.hw = vm.hw

    def copy(self, src: SimGuest, dst: SimGuest, pages: set[int] | list[int]) -> int:
        """Copy ``pages`` (4 KiB guest page numbers) and spend their time on the wire."""
        for page in sorted(pages):
            gpa = page * FRAME
            if src.is_ram(gpa):
                dst.load(gpa, src.read(gpa, FRAME))
        self.clock.spend(len(pages) * FRAME / self.bandwidth)
        return len(pages)


def hot_migrate(
    vm: SimVm,
    dst: VmFabric,
    registry: Registry,
    *,
    queues: Mapping[int, DeviceQueue] | None = None,
    msi: Mapping[int, NtbMsiRoute] | None = None,
    p2p: BarObserver | None = None,
    workload: Callable[[int], None] = lambda _round: None,
    check: Check = _nocheck,
    bandwidth: float = DEFAULT_BANDWIDTH,
    stop_pages: int = STOP_PAGES,
    max_rounds: int = MAX_ROUNDS,
    clock: MigrationClock | None = None,
) -> HotMigration:
    """Move the running ``vm`` to ``dst.local_node`` keeping its devices plugged (the module
    docstring says how). ``queues``: the devices' command engines (quiesced and resumed at
    the switch; a device without one has nothing in flight); ``msi``: their interrupt routes
    over the NTB, re-pointed; ``p2p``: the destination's peer mapper for the VM; ``workload``:
    what the guest and its devices do during pre-copy round ``n`` (from 1); ``check``: the
    invariant checker, run after every phase with its name."""
    queues, msi = dict(queues or {}), dict(msi or {})
    clk = clock or MigrationClock()
    run = _Run(vm, clk, bandwidth, check)
    hw, name, source = vm.hw, vm.name, vm.node
    dest = dst.local_node
    if dest == source:
        raise FabricError(f"VM {name} already runs on {dest}")
    shares = {f: vm.nvme_share(f) for f in vm.shares()}
    for fdid, vms in shares.items():
        if vms.revoked or not vms.open or vms.drive.ended is not None:
            raise FabricError(
                f"VM {name}'s NVMe share of {fdid:#x} was taken from it: stop the VM, or"
                " hot-remove its controller, before moving it"
            )
        if vms.relay is not None:
            raise FabricError(
                f"VM {name}'s NVMe share of {fdid:#x} has a backup path (its relay rings live"
                f" in {source}'s memory): it moves unplugged"
            )
    sessions = vm.sessions()
    kinds = {f: s.device.spec.kind for f, s in sessions.items()}
    for fdid, kind in kinds.items():
        if how_to_quiesce(kind) is None:
            raise QuiesceError(fdid, kind, "its driver does not implement the migration states")
    for fdid in sessions:
        b = hw.borrowed(fdid)
        if b is None or (b.node, b.vm) != (source, name):
            raise FabricError(
                f"device {fdid:#x} is not borrowed by {source}/{name} (its guest has not enabled"
                " it, or it was taken): hot-remove it, or move the VM cold"
            )
    # 1. admit and claim
    src_holder = vm.holder
    dst_holder = Holder(dest, name, src_holder.vm_uuid)
    claimed = handover.claim_destination(
        registry, sorted(sessions), src_holder, dst_holder, vm.guest_ram, shares=sorted(shares)
    )
    check("claimed")
    # 2. the incoming guest
    try:
        guest = hw.create_guest(dest, name, vm.layout.ranges(), backing=vm.guest.backing)
    except BaseException:
        handover.abandon(registry, claimed)
        raise
    check("incoming")
    # 3. pre-copy, the devices running
    domains = [hw.vm_domain(source, name)] + [
        hw.lender_domain(f) for f in sessions if hw.device(f).lender == source
    ]
    dirty = _Dirty(vm.guest, domains, [s.dirty_source() for s in shares.values()])
    dirty.start()
    rounds = [Round(run.copy(vm.guest, guest, vm.guest.stored_pages()), 0)]
    check("pre-copy 1")
    while len(rounds) < max_rounds:
        workload(len(rounds))
        pages, dma = dirty.take()
        rounds.append(Round(run.copy(vm.guest, guest, pages), len(dma)))
        check(f"pre-copy {len(rounds)}")
        if len(pages) <= stop_pages:
            break
    # 4. switch-over: the VM paused, nothing new submitted
    paused = clk.now()
    asked: dict[int, float] = {}
    try:
        for fdid in sorted(sessions):
            asked[fdid] = clk.now()
            q = queues.get(fdid)
            if q is not None:
                q.quiesce()
            else:
                hw.device(fdid).latch()
        for fdid in sorted(shares):
            asked[fdid] = clk.now()  # nothing in flight: the drive ran what was rung
    except QuiesceError:
        for fdid in asked:
            q = queues.get(fdid)
            if q is not None and q.stopped:
                q.resume()
            elif q is None and fdid in sessions:
                hw.device(fdid).unlatch()
        dirty.stop()
        hw.destroy_guest(dest, name)
        handover.abandon(registry, claimed)
        check("abandoned")
        raise
    pages, dma = dirty.take()
    final = Round(run.copy(vm.guest, guest, pages), len(dma))
    dirty.stop()
    mdevs = {f: s.mdev for f, s in sessions.items() if s.mdev}
    mdevs |= {f: s.mdev for f, s in shares.items() if s.mdev}
    tokens = handover.hand_over(registry, claimed, mdevs, time.time())
    windows = VmDmaWindows(hw, guest, vm.layout, vm.windows.ledger, vm_share(dst_holder))
    old_p2p, old_windows = vm.p2p, vm.windows
    for fdid, s in sorted(sessions.items()):
        mastering = s.leave()
        hw.move_borrow(fdid, dest, name, token=tokens[fdid])
        s.arrive(dst_holder, dst, windows, p2p, mastering=mastering)
        route = msi.get(fdid)
        if route is not None:
            route.repoint()
    with registry.read() as tx:  # the interrupt windows handed over with each share
        irq = {f: interrupt_windows(tx, f, dst_holder) for f in shares}
    for fdid, vms in sorted(shares.items()):
        vms.drive.move_share(vms, dest, tokens[fdid], irq[fdid])
    old_windows.close()
    close = getattr(old_p2p, "close", None)
    if close is not None:
        close()
    hw.destroy_guest(source, name)
    vm.moved(dst, guest, windows, p2p)
    check("switched")
    # 5. the source's room goes
    handover.release_source(registry, claimed)
    check("source released")
    # 6. resume: the devices first (their held interrupts go out, on the destination)
    blackout: dict[int, float] = {}
    for fdid in sorted(sessions):
        q = queues.get(fdid)
        if q is not None:
            first = q.resume()
        else:
            hw.device(fdid).unlatch()
            first = clk.now()
        blackout[fdid] = first - asked[fdid]
    for fdid in sorted(shares):
        blackout[fdid] = clk.now() - asked[fdid]  # its doorbells are rung on dest from now
    downtime = clk.now() - paused
    check("resumed")
    log.info(
        "VM %s moved hot from %s to %s: %d rounds, downtime %.1f ms",
        name,
        source,
        dest,
        len(rounds),
        downtime * 1000,
    )
    return HotMigration(
        name, source, dest, rounds, final, downtime, blackout, tokens, bandwidth
    )
