"""The DMA resolver: follow a device's memory request hop by hop to the page it lands in.

Stages, each with the name a ``DmaFault.hop`` carries when it refuses:

``dma-limit``       the IOVA is beyond the device's DMA address width (e.g. 40 bits)
``bus-master``      the device's Bus Master bit is off, so it cannot issue requests at all
``fenced``          the device's last borrow teardown failed: the lender contains it until a
                    give-back succeeds (its BARs do not answer either: ``no-target``)
``lender-iommu``    the lender's IOMMU, in the device's own domain, has no (writable) mapping
``ntb-segment``     the address hit the lender's NTB window in a segment with no translation
``link-down``       a cable of the route the segment is mapped over is down: the adapter
                    answers a read with all ones and drops a write (``dma_read`` and
                    ``dma_write`` do so; ``resolve_dma`` names the fault)
``lut``             the device's requester id is not in the crossing adapter's requester LUT,
                    or the far adapter has no entry for it (it assigns the id the far side sees)
``borrower-iommu``  the far node's IOMMU has no domain for the crossing, or no mapping in it
``no-target``       nothing decodes the physical address: a hole, a BAR whose device has
                    memory decoding off, or an NTB window again (hosts do not forward NTB
                    traffic)

A request that resolves ends at RAM (a host page, owned by the guest it backs), at a BAR
(peer-to-peer, owned by that device) or at an interrupt target (``irq``: a VM's MSI page,
see ``msitarget``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import msgspec

from vmlend.errors import DmaFault
from vmlend.sim.iommu import IommuDomain, Requester
from vmlend.sim.pci import regs

if TYPE_CHECKING:
    from vmlend.sim.hardware import SimHardware, SimNode
    from vmlend.topology.paths import NtbPath

_PAGE = 4096


class Hop(msgspec.Struct, frozen=True):
    """One stage a request passed: ``address`` is where it pointed after the stage, in the
    address space of ``node`` (so the NTB stages already name the far node)."""

    stage: str  # "device", "lender-iommu", "ntb-segment", "lut", "borrower-iommu", "ram", "bar"
    node: str
    address: int
    detail: str = ""

    def __str__(self) -> str:
        extra = f" ({self.detail})" if self.detail else ""
        return f"{self.stage}@{self.node} -> {self.address:#x}{extra}"


class DmaTarget(msgspec.Struct, frozen=True):
    """Where a DMA lands."""

    node: str
    kind: str  # "ram", "bar" or "irq"
    address: int  # physical address on ``node``
    owner: str | int | None  # RAM: the VM whose page it is (None: not a guest's); BAR: fdid;
    # irq: the interrupt target
    hops: tuple[Hop, ...]
    bar: int | None = None  # for kind "bar": BAR index and offset in it
    offset: int | None = None
    room: int = 0  # bytes from ``address`` to the end of the RAM range or BAR

    @property
    def crossed_ntb(self) -> bool:
        return any(h.stage == "lut" for h in self.hops)

    def describe(self) -> str:
        return " | ".join(str(h) for h in self.hops)


class DmaResolver:
    """Resolves DMAs over a ``SimHardware``."""

    def __init__(self, hardware: SimHardware) -> None:
        self.hw = hardware

    def resolve_dma(self, fdid: int, iova: int, *, write: bool = False) -> DmaTarget:
        """The target of a ``write`` (or read) by device ``fdid`` to ``iova``; ``DmaFault``
        naming the stage that refused."""
        dev = self.hw.device(fdid)
        if iova < 0 or iova >= dev.dma_limit:
            raise DmaFault(
                "dma-limit",
                iova,
                f"device {fdid:#x} addresses only {dev.spec.dma_bits} bits "
                f"(below {dev.dma_limit:#x}); map the window lower",
            )
        if not dev.config.bus_master:
            raise DmaFault(
                "bus-master", iova, f"device {fdid:#x} has Bus Master disabled (command bit 2)"
            )
        why = self.hw.fenced(fdid)
        if why is not None:
            raise DmaFault("fenced", iova, f"device {fdid:#x} is fenced: {why}")
        node = self.hw.node(dev.lender)
        hops = [Hop("device", node.name, iova, f"fdid {fdid:#x} rid {dev.spec.bdf}")]
        phys = self._translate(
            node, Requester(dev.requester_id), iova, write, "lender-iommu", f"device {fdid:#x}"
        )
        hops.append(Hop("lender-iommu", node.name, phys, self._domain(node, dev.requester_id)))
        crossed = False
        while True:
            region = node.address_map.find(phys)
            if region is None:
                raise DmaFault("no-target", phys, f"nothing on {node.name} decodes {phys:#x}")
            if region.kind == "ram":
                owner = node.memory.owner_of(phys)
                hops.append(Hop("ram", node.name, phys, owner or "host memory"))
                return DmaTarget(
                    node.name, "ram", phys, owner or None, tuple(hops), room=region.end - phys
                )
            if region.kind == "irq":  # MSI over the NTB: the posted write ends at the target
                hops.append(Hop("irq", node.name, phys, region.owner))
                return DmaTarget(
                    node.name, "irq", phys, region.owner, tuple(hops), room=region.end - phys
                )
            if region.kind == "bar":
                assert region.fdid is not None and region.bar is not None
                if self.hw.fenced(region.fdid) is not None:
                    raise DmaFault(
                        "no-target", phys, f"{phys:#x} is a BAR of fenced device {region.fdid:#x}"
                    )
                if not self.hw.device(region.fdid).config.command & regs.COMMAND_MEMORY:
                    raise DmaFault(
                        "no-target",
                        phys,
                        f"{phys:#x} on {node.name} is BAR {region.bar} of device "
                        f"{region.fdid:#x}, whose memory decoding is off (command bit 1)",
                    )
                hops.append(Hop("bar", node.name, phys, region.owner))
                return DmaTarget(
                    node.name,
                    "bar",
                    phys,
                    region.fdid,
                    tuple(hops),
                    bar=region.bar,
                    offset=phys - region.start,
                    room=region.end - phys,
                )
            # An NTB window: cross once; a host does not forward what arrived from the NTB.
            if crossed:
                raise DmaFault(
                    "no-target",
                    phys,
                    f"{phys:#x} on {node.name} is in NTB window {region.owner}; "
                    "hosts do not forward NTB traffic",
                )
            crossed = True
            assert region.adapter is not None
            adapter = self.hw.adapter(region.adapter)
            remote_name, remote_addr = adapter.translate(phys)
            hops.append(Hop("ntb-segment", remote_name, remote_addr, adapter.ref))
            seg = adapter.segment(adapter.segment_of(phys))
            assert seg is not None  # translate found it
            path = self._crossing(fdid, adapter.ref, remote_name, seg.via)
            dead = self.hw.dead_links(path)
            if dead:
                raise DmaFault(
                    "link-down",
                    phys,
                    f"link {', '.join(dead)} of {path.describe()} is down: reads return all"
                    " ones, writes are dropped",
                )
            entry = adapter.lut_lookup(dev.requester_id)
            if entry is None:
                raise DmaFault(
                    "lut",
                    phys,
                    f"requester {dev.spec.bdf} (device {fdid:#x}) is not in the requester LUT "
                    f"of {adapter.ref}; borrow the device first",
                )
            far = self.hw.adapter(path.dst.ref)
            key = self.hw.requester_key(fdid)
            far_entry = far.lut_lookup(key)
            if far_entry is None:
                raise DmaFault(
                    "lut",
                    phys,
                    f"device {fdid:#x} has no entry in the requester LUT of {far.ref}: "
                    f"{remote_name} drops its requests",
                )
            ingress = Requester(far.assigned_requester_id(far_entry, key))
            hops.append(
                Hop("lut", remote_name, remote_addr, f"{far.ref} entry {far_entry} -> {ingress}")
            )
            node = self.hw.node(remote_name)
            what = f"device {fdid:#x} entering through {far.ref} (LUT entry {far_entry})"
            phys = self._translate(node, ingress, remote_addr, write, "borrower-iommu", what)
            domain = node.iommu.domain_for(ingress)
            hops.append(Hop("borrower-iommu", node.name, phys, domain.name if domain else ""))

    def _crossing(self, fdid: int, src_ref: str, remote: str, via: str | None) -> NtbPath:
        """The route a TLP of ``fdid`` takes out of adapter ``src_ref`` to ``remote``: towards
        adapter ``via`` when the segment names it, else towards the first far adapter (cheapest
        route first) that has a LUT entry for the device (the one its crossing was set up on),
        else the cheapest."""
        src = self.hw.adapter(src_ref)
        if via is not None:
            found = self.hw.path_between(src_ref, via)
            if found is None:
                raise DmaFault("no-target", 0, f"no cable joins {src_ref} and {via}")
            return found
        candidates = [p for p in self.hw.routes(src.node, remote) if p.src.ref == src_ref]
        if not candidates:
            raise DmaFault("no-target", 0, f"no cable joins {src_ref} and {remote}")
        key = self.hw.requester_key(fdid)
        for p in candidates:
            if self.hw.adapter(p.dst.ref).lut_lookup(key) is not None:
                return p
        return candidates[0]

    @staticmethod
    def _domain(node: SimNode, rid: int) -> str:
        d = node.iommu.domain_for(Requester(rid))
        return d.name if d else ""

    @staticmethod
    def _translate(
        node: SimNode, requester: Requester, addr: int, write: bool, hop: str, what: str
    ) -> int:
        domain: IommuDomain | None = node.iommu.domain_for(requester)
        if domain is None:
            raise DmaFault(
                hop, addr, f"no IOMMU domain on {node.name} for {what} (requester {requester})"
            )
        try:
            return domain.translate(addr, write=write)
        except DmaFault as fault:
            raise DmaFault(hop, addr, f"{fault.why} ({what})") from None

    # --- moving bytes ------------------------------------------------------------------------
    def _pieces(
        self, fdid: int, iova: int, length: int, write: bool
    ) -> Iterator[tuple[int, int, DmaTarget | None]]:
        """Each piece of the request with its target; None for a piece across a dead link."""
        at, end = iova, iova + length
        while at < end:
            target: DmaTarget | None
            try:
                target = self.resolve_dma(fdid, at, write=write)
            except DmaFault as fault:
                if fault.hop != "link-down":
                    raise
                target = None
            n = min(end - at, _PAGE - at % _PAGE, target.room if target else end - at)
            yield at - iova, n, target
            at += n

    def dma_read(self, fdid: int, iova: int, length: int) -> bytes:
        """Bytes a device read of ``length`` at ``iova`` returns (resolved page by page); all
        ones where it crosses a dead link."""
        out = bytearray()
        for _, n, t in self._pieces(fdid, iova, length, write=False):
            if t is None:
                out += b"\xff" * n
            elif t.kind == "ram":
                out += self.hw.node(t.node).memory.read(t.address, n)
            else:
                assert isinstance(t.owner, int) and t.bar is not None and t.offset is not None
                out += self.hw.device(t.owner).bars.read_bytes(t.bar, t.offset, n)
        return bytes(out)

    def dma_write(self, fdid: int, iova: int, data: bytes) -> list[DmaTarget]:
        """Write ``data`` at ``iova`` as device ``fdid``; returns the target of every piece
        written. Every piece is resolved before anything is written, so a fault writes nothing;
        a piece across a dead link is dropped, as the adapter drops it."""
        pieces = [(pos, n, t) for pos, n, t in self._pieces(fdid, iova, len(data), write=True) if t]
        for pos, n, t in pieces:
            chunk = data[pos : pos + n]
            if t.kind == "ram":
                self.hw.node(t.node).memory.write(t.address, chunk)
            else:
                assert isinstance(t.owner, int) and t.bar is not None and t.offset is not None
                self._write_bar(t.owner, t.bar, t.offset, chunk)
        return [t for _, _, t in pieces]

    def _write_bar(self, fdid: int, bar: int, offset: int, chunk: bytes) -> None:
        """A peer's write into a BAR. Where it hits the MSI-X table it is a table write like a
        CPU's: its listeners (the interrupt relay) hear of each dword touched."""
        dev = self.hw.device(fdid)
        dev.bars.write_bytes(bar, offset, chunk)
        msix = dev.spec.msix
        if msix is None or msix.table_bar != bar:
            return
        lo = max(offset, msix.table_offset)
        hi = min(offset + len(chunk), msix.table_offset + msix.vectors * 16)
        for dword in range(lo - lo % 4, hi, 4):
            # the stored (already masked) value written again: same memory, listeners told
            dev.bars.write(bar, dword, 4, dev.bars.read(bar, dword, 4))
