"""The DMA windows of one simulated VM: pin, probe, plan and map its RAM for its borrowed devices.

The glue between the pure memory code (``vmlend.memory``: layout, probe, plan) and the simulated
hardware. When a device's Bus Master bit goes on, :meth:`VmDmaWindows.enable` probes the guest's
RAM with the pin oracle (a mismatch with the computed layout is refused), pins it, plans the low
and high windows against the lender adapter's free segments and the device's DMA limit, and
programs the three stages (docs/design.md mechanism 6):

- borrower IOMMU, the VM's domain: IOVA = GPA -> host frames. Shared by every remote device of
  the VM (the domain is per VM), mapped by the first and unmapped by the last.
- NTB segments of the lender's adapter -> borrower IOVA. Shared by the VM's devices from that
  lender adapter (admission claims them once per VM), mapped by the first, unmapped by the last.
- the device's own lender IOMMU domain: IOVA = GPA -> NTB window address. One per device.

A device lent by the VM's own node crosses no NTB: its domain maps IOVA = GPA -> host frames,
as local VFIO does. Every refusal (layout mismatch, DMA limit, window room, free segments) is
raised before anything is mapped, and a failure part way undoes what was done, pins included.

The windows follow the hardware's borrow ends: a device of this VM given back by any path loses
its windows before the borrow goes (the records are removed at the next ``settle``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import msgspec

from vmlend.errors import DmaLimitError, FabricError
from vmlend.memory.dmarecords import DMA_WINDOW
from vmlend.memory.layout import Layout
from vmlend.memory.probe import probe_layout
from vmlend.memory.windows import DmaPlan, FrameRun, apply_plan, plan_dma_windows, unapply_plan
from vmlend.p2p import RECORD_KIND as P2P_RECORD_KIND
from vmlend.registry import Registry, StateTxn
from vmlend.sim.guest import SimGuest
from vmlend.sim.hardware import Borrow, SimHardware
from vmlend.sim.iommu import IommuDomain
from vmlend.sim.ntb import NtbAdapter
from vmlend.sim.promises import promised_segments
from vmlend.topology.model import GiB, GuestRange, KiB, MiB

log = logging.getLogger(__name__)


_PAGE_NAMES = {4 * KiB: "4K", 2 * MiB: "2M", GiB: "1G"}


class WindowLedger(Protocol):
    """Where the windows of a device are recorded (the registry's runtime records), and what
    other VMs were promised at admission on an adapter but have not mapped yet."""

    def record_windows(self, fdid: int, windows: Mapping[str, dict[str, Any]]) -> None: ...

    def forget_windows(self, fdid: int) -> None: ...

    def promised_segments(self, adapter: str, share: str) -> int: ...


class RegistryWindowLedger:
    """Records windows as runtime records of the device's hold (removed with the hold)."""

    def __init__(self, registry: Registry) -> None:
        self._reg = registry

    def promised_segments(self, adapter: str, share: str) -> int:
        """Segments of ``adapter`` admission promised to other VMs (DMA windows and
        peer-to-peer) that they have not mapped yet: the hardware shows them free, but they
        are spoken for (``promises.promised_segments``)."""
        with self._reg.read() as tx:
            return promised_segments(
                adapter,
                share,
                tx.claims(),
                tx.holds(),
                tx.runtime(kind=DMA_WINDOW),
                tx.runtime(kind=P2P_RECORD_KIND),
            )

    def record_windows(self, fdid: int, windows: Mapping[str, dict[str, Any]]) -> None:
        def body(tx: StateTxn) -> None:
            tx.clear_runtime(fdid, DMA_WINDOW)
            for key, data in windows.items():
                tx.put_runtime(fdid, DMA_WINDOW, key, data)

        self._reg.transact(body)

    def forget_windows(self, fdid: int) -> None:
        self._reg.transact(lambda tx: tx.clear_runtime(fdid, DMA_WINDOW))


class _NoStage:
    """A stage somebody else already mapped (shared windows): map and unmap do nothing."""

    def map(self, iova: int, phys: int, size: int) -> None:
        pass

    def unmap(self, iova: int, size: int) -> None:
        pass


_SKIP = _NoStage()


class _NtbStage:
    """The plan's NTB stage on a real adapter: ``iova`` is the lender-side window address,
    ``phys`` the borrower IOVA; each segment is translated on its own."""

    def __init__(self, adapter: NtbAdapter, remote_node: str) -> None:
        self.adapter = adapter
        self.remote = remote_node

    def map(self, iova: int, phys: int, size: int) -> None:
        seg = self.adapter.segment_size
        done: list[int] = []
        try:
            for off in range(0, size, seg):
                index = self.adapter.segment_of(iova + off)
                self.adapter.map_segment(index, self.remote, phys + off)
                done.append(index)
        except Exception:
            for index in done:
                self.adapter.unmap_segment(index)
            raise

    def unmap(self, iova: int, size: int) -> None:
        for off in range(0, size, self.adapter.segment_size):
            self.adapter.unmap_segment(self.adapter.segment_of(iova + off))


def _entries(counts: Mapping[int, int]) -> dict[str, int]:
    return {_PAGE_NAMES.get(size, str(size)): n for size, n in sorted(counts.items()) if n}


def coalesce_frames(frames: Iterable[FrameRun]) -> list[FrameRun]:
    """Merge pieces contiguous in both guest-physical and host address into runs."""
    runs: list[FrameRun] = []
    for f in sorted(frames, key=lambda f: f.gpa):
        last = runs[-1] if runs else None
        if last and last.gpa + last.size == f.gpa and last.host + last.size == f.host:
            runs[-1] = FrameRun(last.gpa, last.host, last.size + f.size)
        else:
            runs.append(f)
    return runs


class _Pinned(msgspec.Struct):
    ranges: list[GuestRange]
    runs: list[FrameRun]
    probes: int


class _AdapterWindows(msgspec.Struct):
    """The windows of the VM on one lender adapter, and the devices using them."""

    plan: DmaPlan
    users: set[int] = msgspec.field(default_factory=set)


class DeviceWindows(msgspec.Struct, frozen=True):
    """What one device's DMA uses: the adapter plan (None for a device local to the VM's node)
    and the runtime records written for it."""

    fdid: int
    adapter: str | None
    records: dict[str, dict[str, Any]]


class VmDmaWindows:
    """DMA windows of one running guest for the devices it borrowed on ``hardware``."""

    def __init__(
        self,
        hardware: SimHardware,
        guest: SimGuest,
        layout: Layout,
        ledger: WindowLedger | None = None,
        share: str = "",
    ) -> None:
        self.hw = hardware
        self.guest = guest
        self.layout = layout
        self.ledger = ledger
        self.share = share  # the VM's claim share (admission.vm_share) in the ledger
        self._pinned: _Pinned | None = None
        self._adapters: dict[str, _AdapterWindows] = {}
        self._devices: dict[int, DeviceWindows] = {}
        self._borrower_users: set[int] = set()  # remote devices using the VM domain's maps
        self._unforgotten: set[int] = set()  # unmapped, records still to be removed
        self._unsubscribe = hardware.on_borrow_end(self._borrow_ended)

    @property
    def node(self) -> str:
        return self.guest.node

    @property
    def vm(self) -> str:
        return self.guest.vm

    def active(self, fdid: int) -> bool:
        return fdid in self._devices

    def windows(self, fdid: int) -> DeviceWindows | None:
        return self._devices.get(fdid)

    def devices(self) -> list[int]:
        return sorted(self._devices)

    @property
    def pinned(self) -> bool:
        return self._pinned is not None

    # --- enable ---------------------------------------------------------------------------------
    def enable(self, fdid: int) -> DeviceWindows:
        """Map the guest's RAM for ``fdid`` (idempotent). Raises, changing nothing, when the
        device is not borrowed by this VM, the probe disagrees with the layout, or the plan is
        refused (DMA limit, NTB window room, free segments: each says what is short)."""
        self.settle()
        if fdid in self._devices:
            return self._devices[fdid]
        dev = self.hw.device(fdid)
        borrow = self.hw.borrowed(fdid)
        if borrow is None or (borrow.node, borrow.vm) != (self.node, self.vm):
            raise FabricError(
                f"device {fdid:#x} is not borrowed by {self.node}/{self.vm}; the guest must "
                "enable the device (memory decoding or reset) before bus mastering"
            )
        first_pin = self._pinned is None
        pinned = self._pin()
        try:
            top = pinned.ranges[-1].end
            if top > dev.dma_limit:
                raise DmaLimitError(f"{fdid:#x}", dev.spec.dma_bits, top)
            if borrow.path is None:
                result = self._enable_local(fdid, pinned)
            else:
                result = self._enable_remote(fdid, borrow.path.src.ref, pinned)
        except Exception:
            if first_pin:
                self._unpin()
            raise
        self._devices[fdid] = result
        log.info("DMA windows of %s/%s mapped for device %#x", self.node, self.vm, fdid)
        return result

    def _pin(self) -> _Pinned:
        if self._pinned is not None:
            return self._pinned
        probed = probe_layout(self.guest.can_pin, self.layout)
        ranges = list(probed.ranges)
        frames: list[FrameRun] = []
        done: list[GuestRange] = []
        try:
            for r in ranges:
                frames += [FrameRun(f.gpa, f.phys, f.size) for f in self.guest.pin(r.start, r.size)]
                done.append(r)
        except Exception:
            for r in done:
                self.guest.unpin(r.start, r.size)
            raise
        self._pinned = _Pinned(ranges, coalesce_frames(frames), probed.probes)
        log.debug("pinned %s/%s after %d probes", self.node, self.vm, probed.probes)
        return self._pinned

    def _unpin(self) -> None:
        if self._pinned is None:
            return
        for r in self._pinned.ranges:
            self.guest.unpin(r.start, r.size)
        self._pinned = None

    def _enable_remote(self, fdid: int, ref: str, pinned: _Pinned) -> DeviceWindows:
        adapter = self.hw.adapter(ref)
        shared = self._adapters.get(ref)
        if shared is None:
            free = [i for i in range(adapter.segments) if adapter.segment(i) is None]
            if self.ledger is not None and self.share:
                # keep what admission promised to VMs that have not mapped yet
                promised = self.ledger.promised_segments(ref, self.share)
                free = free[: max(0, len(free) - promised)]
            plan = plan_dma_windows(
                pinned.ranges,
                pinned.runs,
                adapter.spec,
                free,
                dma_bits=self.hw.device(fdid).spec.dma_bits,
                device=f"{fdid:#x}",
                ntb_base=adapter.window_base,
            )
        else:
            plan = shared.plan
        borrower: IommuDomain | _NoStage = (
            _SKIP if self._borrower_users else self.hw.vm_domain(self.node, self.vm)
        )
        ntb: _NtbStage | _NoStage = _SKIP if shared else _NtbStage(adapter, self.node)
        lender = self.hw.lender_domain(fdid)
        apply_plan(plan, borrower, ntb, lender)
        records = _plan_records(plan, lender)
        try:
            if self.ledger is not None:
                self.ledger.record_windows(fdid, records)
        except Exception:
            unapply_plan(plan, borrower, ntb, lender)
            raise
        self._borrower_users.add(fdid)
        self._adapters.setdefault(ref, _AdapterWindows(plan)).users.add(fdid)
        return DeviceWindows(fdid, ref, records)

    def _enable_local(self, fdid: int, pinned: _Pinned) -> DeviceWindows:
        # The VM runs on the lender: no NTB, the device's domain maps GPA -> host frames.
        domain = self.hw.lender_domain(fdid)
        done: list[FrameRun] = []
        try:
            for run in pinned.runs:
                domain.map(run.gpa, run.host, run.size)
                done.append(run)
            records = _local_records(pinned, domain)
            if self.ledger is not None:
                self.ledger.record_windows(fdid, records)
        except Exception:
            for run in done:
                domain.unmap(run.gpa, run.size)
            raise
        return DeviceWindows(fdid, None, records)

    # --- disable --------------------------------------------------------------------------------
    def disable(self, fdid: int, *, forget: bool = True) -> bool:
        """Unmap ``fdid``'s windows; the last device out also unmaps the shared stages and
        unpins the guest. False when nothing was mapped.

        ``forget=False`` leaves the runtime records to :meth:`settle`: for a caller inside
        someone else's registry transaction (a reset during the fabric's give-back), where
        writing the registry would wait on that very transaction."""
        if forget:
            self.settle()
        win = self._devices.pop(fdid, None)
        if win is None:
            return False
        lender = self.hw.lender_domain(fdid)
        if win.adapter is None:
            assert self._pinned is not None
            for run in self._pinned.runs:
                lender.unmap(run.gpa, run.size)
        else:
            shared = self._adapters[win.adapter]
            shared.users.discard(fdid)
            self._borrower_users.discard(fdid)
            borrower = _SKIP if self._borrower_users else self.hw.vm_domain(self.node, self.vm)
            ntb = _SKIP if shared.users else _NtbStage(self.hw.adapter(win.adapter), self.node)
            unapply_plan(shared.plan, borrower, ntb, lender)
            if not shared.users:
                del self._adapters[win.adapter]
        if self.ledger is not None:
            if forget:
                self.ledger.forget_windows(fdid)
            else:
                self._unforgotten.add(fdid)
        if not self._devices:
            self._unpin()
        log.info("DMA windows of %s/%s unmapped for device %#x", self.node, self.vm, fdid)
        return True

    def settle(self) -> None:
        """Remove the records of windows unmapped with ``forget=False`` (not re-mapped since)."""
        while self._unforgotten:
            fdid = min(self._unforgotten)
            if self.ledger is not None and fdid not in self._devices:
                self.ledger.forget_windows(fdid)
            self._unforgotten.discard(fdid)

    def close(self) -> None:
        """Unmap everything (VM stop) and stop following borrow ends."""
        for fdid in list(self._devices):
            self.disable(fdid)
        self.settle()
        self._unsubscribe()

    def _borrow_ended(self, borrow: Borrow) -> None:
        if (borrow.node, borrow.vm) == (self.node, self.vm):
            # maybe inside the fabric's registry transaction: the records wait for settle
            self.disable(borrow.fdid, forget=False)


def _plan_records(plan: DmaPlan, lender: IommuDomain) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for w in plan.windows:
        lender_entries: dict[int, int] = {}
        for m in w.lender_maps:
            lender_entries[m.page_size] = lender_entries.get(m.page_size, 0) + m.entries
        out[w.name] = {
            "gpa_start": w.ranges[0].start,
            "gpa_end": w.ranges[-1].end,
            "ranges": [[r.start, r.end] for r in w.ranges],
            "adapter": plan.adapter,
            "ntb_window": w.ntb_maps[0].iova if w.ntb_maps else None,
            "borrower_iova": [w.span.start, w.span.end],
            "segments": list(w.segments),
            "segment_size": plan.segment_size,
            "iommu_entries": _entries(w.entries()),
            "lender_entries": _entries(lender_entries),
            "lender_domain": lender.name,
        }
    return out


def _local_records(pinned: _Pinned, domain: IommuDomain) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    low = [r for r in pinned.ranges if r.start < 4 * GiB]
    high = [r for r in pinned.ranges if r.start >= 4 * GiB]
    for name, group in (("low", low), ("high", high)):
        if not group:
            continue
        counts: dict[int, int] = {}
        for r in group:
            for m in domain.mappings():
                if r.start <= m.iova < r.end:
                    counts[m.page_size] = counts.get(m.page_size, 0) + m.pages
        out[name] = {
            "gpa_start": group[0].start,
            "gpa_end": group[-1].end,
            "ranges": [[r.start, r.end] for r in group],
            "adapter": None,
            "ntb_window": None,
            "segments": [],
            "iommu_entries": _entries(counts),
            "lender_domain": domain.name,
        }
    return out
