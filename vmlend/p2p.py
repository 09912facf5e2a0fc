"""Peer-to-peer between the devices of one VM: where a device's DMA to another device's
guest-physical BAR address must go. Pure planning over a ``Topology``: no hardware, no I/O.

The guest driver of device A is handed device B's BAR as the guest sees it (a guest-physical
address, GPA), exactly as with local VFIO pass-through. So each source A gets, in its own lender
IOMMU domain, IOVA = B's guest-physical BAR address for every memory BAR of every other device B
of the VM. Where that IOVA leads depends on where B sits:

``same-lender``     A and B in one host: A's lender IOMMU maps straight to B's BAR (host
                    physical). The request turns at that host's root complex (a VM's
                    lender has its IOMMU on: ACS redirects peer-to-peer up through it).
``borrower-local``  B is installed in the borrower itself: A's IOVA leads into A's lender NTB
                    window, whose segment points at the borrower, whose per-VM IOMMU maps the
                    GPA to B's BAR.
``other-lender``    B is lent by a third host: the same, through the NTB between the two
                    lenders (``vmlend.topology.paths.route``), which need not be the borrower's;
                    the far lender translates the GPA in a domain of its own for this VM.

Each map carries the PCIe path the request takes (``vmlend.topology.pcie.peer_path``): its
hops and roots are the ones ``vmlend path`` shows for the same pair.

Only memory BARs are mapped; the guest's BARs are checked first (naturally aligned, the right
size, 32-bit BARs below 4 GiB, no overlap with the VM's RAM or with each other). A pair the
source cannot reach (the BAR lies beyond its DMA width, or is smaller than an IOMMU page) is
skipped with the reason rather than refused: the other pairs still work.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import msgspec

from vmlend.errors import BarConflictError, P2PError
from vmlend.topology.chips import NTB_CROSSING_NS
from vmlend.topology.model import BarKind, DeviceSpec, GiB, GuestRange, Topology
from vmlend.topology.paths import NtbPath, route
from vmlend.topology.pcie import Hop, PciePath, Stage, peer_path

SAME_LENDER = "same-lender"
BORROWER_LOCAL = "borrower-local"
OTHER_LENDER = "other-lender"

#: Smallest IOMMU page: a BAR below this cannot be mapped on its own.
PAGE = 4096
#: Kind of runtime record a P2P map is persisted as (registry ``put_runtime``).
RECORD_KIND = "p2p-map"


class PeerBar(msgspec.Struct, frozen=True):
    """One BAR of a passed-through device; ``host`` is its physical base on the lender (what
    the lender's address decoders answer to)."""

    index: int
    size: int
    kind: BarKind
    host: int


class PeerDevice(msgspec.Struct, frozen=True):
    """A device passed through to the VM: where it is lent from and what it has."""

    fdid: int
    lender: str
    bars: tuple[PeerBar, ...]
    dma_bits: int = 64
    slot: str | None = None  # where it hangs in its lender's PCIe tree (``DeviceSpec.slot``)

    def bar(self, index: int) -> PeerBar:
        for b in self.bars:
            if b.index == index:
                return b
        have = ", ".join(str(b.index) for b in self.bars) or "none"
        raise P2PError(f"device {self.fdid:#x} has no BAR {index} (its BARs: {have})")


def peer_device(spec: DeviceSpec, host_bars: Mapping[int, int]) -> PeerDevice:
    """A ``PeerDevice`` from a topology spec and the lender's BAR bases (index -> address)."""
    bars = tuple(PeerBar(b.index, b.size, b.kind, host_bars[b.index]) for b in spec.bars)
    return PeerDevice(spec.fdid, spec.lender, bars, spec.dma_bits, spec.slot)


class GuestBar(msgspec.Struct, frozen=True):
    """Where the guest programmed BAR ``index`` of device ``fdid``: [gpa, gpa + size)."""

    fdid: int
    index: int
    gpa: int
    size: int

    @property
    def end(self) -> int:
        return self.gpa + self.size

    def describe(self) -> str:
        return f"BAR {self.index} of device {self.fdid:#x} at {self.gpa:#x}+{self.size:#x}"


class P2PMap(msgspec.Struct, frozen=True):
    """Device ``source`` reaches BAR ``bar`` of device ``target`` at IOVA ``iova`` (the BAR's
    guest-physical address) in its own lender IOMMU domain."""

    source: int
    target: int
    bar: int
    iova: int
    size: int
    case: str  # SAME_LENDER, BORROWER_LOCAL or OTHER_LENDER
    source_node: str  # the source's lender
    target_node: str  # the target's lender (the borrower for BORROWER_LOCAL)
    target_phys: int  # the BAR on target_node (host physical)
    path: NtbPath | None  # the NTB crossing, None for SAME_LENDER
    pcie: PciePath  # what the request passes, in order (vmlend.topology.pcie)

    @property
    def key(self) -> str:
        """Tells the maps of one source apart (one per target BAR)."""
        return f"{self.target:#x}/bar{self.bar}"

    @property
    def route(self) -> tuple[str, ...]:
        """The names of what the request passes, both ends included."""
        return tuple(s.name for s in self.pcie.stages)

    @property
    def hops(self) -> int:
        """Switching elements the request passes, counted as ``vmlend path`` counts them."""
        return self.pcie.hops

    @property
    def roots(self) -> int:
        """Root complexes (each with its IOMMU) the request passes."""
        return self.pcie.roots

    @property
    def ntb_crossings(self) -> int:
        return 0 if self.path is None else 1

    @property
    def added_ns(self) -> int:
        """Estimated one-way latency the NTB adds over a same-host peer (papers' numbers)."""
        return NTB_CROSSING_NS * self.ntb_crossings

    def describe(self) -> str:
        return " -> ".join(self.route)

    def record(self) -> dict[str, Any]:
        """JSON-able form for the registry's runtime records (kind ``RECORD_KIND``)."""
        return {
            "source": self.source,
            "target": self.target,
            "bar": self.bar,
            "iova": self.iova,
            "size": self.size,
            "case": self.case,
            "source_node": self.source_node,
            "target_node": self.target_node,
            "target_phys": self.target_phys,
            "ntb": self.path.describe() if self.path else None,
            "adapter": self.path.src.ref if self.path else None,  # whose segments it uses
            "route": list(self.route),
            "hops": self.hops,
            "roots": self.roots,
            "ntb_crossings": self.ntb_crossings,
        }


class Skipped(msgspec.Struct, frozen=True):
    """A (source, target BAR) pair that gets no mapping, and why."""

    source: int
    target: int
    bar: int
    reason: str


class P2PPlan(msgspec.Struct, frozen=True):
    borrower: str
    maps: tuple[P2PMap, ...]
    skipped: tuple[Skipped, ...] = ()

    def from_source(self, fdid: int) -> list[P2PMap]:
        return [m for m in self.maps if m.source == fdid]


# --- checking what the guest programmed ------------------------------------------------------


def check_guest_bars(
    devices: Mapping[int, PeerDevice], bars: Sequence[GuestBar], ram: Iterable[GuestRange] = ()
) -> None:
    """Refuse guest BARs that cannot be mapped: unknown device or BAR, an I/O BAR, a wrong
    size, a misaligned base, a 32-bit BAR above 4 GiB (``P2PError``), or an overlap with the
    VM's RAM or another BAR (``BarConflictError``)."""
    seen: set[tuple[int, int]] = set()
    for g in bars:
        dev = devices.get(g.fdid)
        if dev is None:
            raise P2PError(f"device {g.fdid:#x} is not passed through to this VM")
        spec = dev.bar(g.index)
        if spec.kind is BarKind.IO:
            raise P2PError(
                f"BAR {g.index} of device {g.fdid:#x} is an I/O BAR: DMA cannot reach it"
            )
        if g.size != spec.size:
            raise P2PError(
                f"BAR {g.index} of device {g.fdid:#x} is {spec.size:#x} bytes, not {g.size:#x}"
            )
        if g.gpa < 0 or g.gpa % g.size:
            raise P2PError(
                f"{g.describe()} is not aligned to its size (PCI BARs are naturally aligned)"
            )
        if spec.kind is BarKind.MEM32 and g.end > 4 * GiB:
            raise P2PError(f"{g.describe()} is a 32-bit BAR and must end below 4 GiB")
        if (g.fdid, g.index) in seen:
            raise P2PError(f"BAR {g.index} of device {g.fdid:#x} is given twice")
        seen.add((g.fdid, g.index))
    _check_ram(bars, ram)
    reach: GuestBar | None = None  # of the BARs so far, the one ending last
    for b in sorted(bars, key=lambda b: (b.gpa, b.fdid, b.index)):
        if reach is not None and b.gpa < reach.end:
            raise BarConflictError(b.fdid, b.index, b.gpa, b.size, reach.describe())
        if reach is None or b.end > reach.end:
            reach = b


def _check_ram(bars: Sequence[GuestBar], ram: Iterable[GuestRange]) -> None:
    ranges = sorted(ram, key=lambda r: r.start)
    starts = [r.start for r in ranges]
    for g in bars:
        # RAM ranges are disjoint: if any overlaps the BAR, the last one starting before the
        # BAR's end does
        i = bisect.bisect_left(starts, g.end) - 1
        if i >= 0 and g.gpa < ranges[i].end:
            r = ranges[i]
            raise BarConflictError(
                g.fdid, g.index, g.gpa, g.size, f"guest RAM {r.start:#x}-{r.end:#x}"
            )


# --- planning --------------------------------------------------------------------------------


def _peer_path(topology: Topology, src: PeerDevice, dst: PeerDevice) -> PciePath:
    """The PCIe path from ``src`` to ``dst`` (``NoPathError`` when no NTB joins the lenders)."""
    a = Stage(Hop.DEVICE, f"device {src.fdid:#x}", src.lender)
    b = Stage(Hop.DEVICE, f"device {dst.fdid:#x}", dst.lender)
    return peer_path(topology, a, src.slot, b, dst.slot)


def _to_bar(path: PciePath, g: GuestBar) -> PciePath:
    """``path`` ending at BAR ``g.index`` of its target."""
    end = path.stages[-1]
    name = f"{end.name} BAR{g.index}"
    return PciePath(path.src, name, (*path.stages[:-1], Stage(end.kind, name, end.node)))


def plan_p2p(
    topology: Topology,
    borrower: str,
    devices: Sequence[PeerDevice],
    bars: Sequence[GuestBar],
    ram: Iterable[GuestRange] = (),
    route_of: Callable[[str, str], NtbPath | None] | None = None,
) -> P2PPlan:
    """Every mapping the VM on ``borrower`` needs so each of ``devices`` reaches every memory
    BAR of every other one at the BAR's guest-physical address (``bars``, as the guest
    programmed them). Checks ``bars`` first (see ``check_guest_bars``); ``NoPathError`` names
    two lenders no NTB joins; nothing is mapped here. ``route_of(lender, lender)``: the route
    between two lenders (default: the topology's cheapest; the simulated hardware passes its
    own, which leaves out dead cables, so a re-plan after a link event re-routes)."""
    topology.node(borrower)
    by_fdid = {d.fdid: d for d in devices}
    if len(by_fdid) != len(devices):
        raise P2PError("a device is listed twice for the VM")
    check_guest_bars(by_fdid, bars, ram)
    paths: dict[tuple[str, str], NtbPath | None] = {}
    peer_paths: dict[tuple[int, int], PciePath] = {}
    maps: list[P2PMap] = []
    skipped: list[Skipped] = []
    for src in sorted(devices, key=lambda d: d.fdid):
        for g in sorted(bars, key=lambda b: (b.fdid, b.index)):
            if g.fdid == src.fdid:
                continue
            dst = by_fdid[g.fdid]
            reason = _unreachable(src, g)
            if reason:
                skipped.append(Skipped(src.fdid, g.fdid, g.index, reason))
                continue
            pair = (src.lender, dst.lender)
            if pair not in paths:
                # NoPathError(src lender, dst lender)
                paths[pair] = route_of(*pair) if route_of else route(topology, *pair)
            path = paths[pair]
            if path is None:
                case = SAME_LENDER
            elif dst.lender == borrower:
                case = BORROWER_LOCAL
            else:
                case = OTHER_LENDER
            if (src.fdid, dst.fdid) not in peer_paths:
                peer_paths[src.fdid, dst.fdid] = _peer_path(topology, src, dst)
            maps.append(
                P2PMap(
                    source=src.fdid,
                    target=g.fdid,
                    bar=g.index,
                    iova=g.gpa,
                    size=g.size,
                    case=case,
                    source_node=src.lender,
                    target_node=dst.lender,
                    target_phys=dst.bar(g.index).host,
                    path=path,
                    pcie=_to_bar(peer_paths[src.fdid, dst.fdid], g),
                )
            )
    return P2PPlan(borrower, tuple(maps), tuple(skipped))


def _unreachable(src: PeerDevice, g: GuestBar) -> str:
    if g.size < PAGE:
        return f"{g.describe()} is smaller than a {PAGE}-byte IOMMU page"
    if g.end > 1 << src.dma_bits:
        return (
            f"device {src.fdid:#x} addresses only {src.dma_bits} bits and {g.describe()} lies "
            "beyond; the guest must place the BAR lower for peer-to-peer"
        )
    return ""
