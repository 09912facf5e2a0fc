"""Admission control: may a borrower take a device, and which adapter resources does it use?

Pure logic over a ``Topology`` and a snapshot of the shared state (``StateView``); no I/O. Every
backend that keeps its claims in the registry uses it, inside the registry's write transaction,
so the decision and the claims it makes are atomic across processes.

A VM's device must be lent from a host whose IOMMU is on (``NodeSpec.iommu``): the lender's
IOMMU maps the guest's physical layout for the device, so admission refuses any other lender.

What a remote reservation uses (docs/design.md, limits):
- one requester LUT entry on each adapter of the crossing (the device's requester id on the
  lender's, its identity on the borrower's): 30 usable entries allow 30 devices lent and 30
  borrowed per node. An entry is per requester bus:device, not per function
  (``vmlend.topology.requesters``): the functions of one device share it;
- one requester entry on each cluster switch port the crossing passes (the port it enters
  each switch by and the one it leaves by), per requester bus:device too, out of the
  switch's ``requester_entries`` per port;
- room in the lender's NTB window for the VM's DMA windows (its guest RAM, whole segments),
  counted once per (lender adapter, VM) however many devices the VM borrows from that lender
  (a VM here is node + domain name: ``vm_share`` says why);
- room in the borrower's NTB window for the device's memory BARs, each BAR in whole segments
  (``bar_segments``: what the simulated hardware borrow maps as its BAR windows);
- peer-to-peer among the VM's devices (``p2p_claims``): for every memory BAR of every device
  that another device of the VM reaches across an NTB, the segments of the source lender's
  adapter that BAR can occupy, a LUT entry for a source installed in the borrower itself
  (a borrowed source already has one), and a LUT entry on the target lender's adapter that
  names the source there when the target is not in the borrower, and the source's requester
  entry on every cluster switch port of that crossing (a P2P claim under the port's name and
  the source's requester key: the same entry as a borrow's of the source's device there).
The DMA window segments are the planner's own count (``vmlend.memory.windows.window_segments``)
over the guest's RAM ranges, so what is claimed is what bus-master enable maps; the device's
DMA address width is checked against the top of that RAM. A device lent and used on the same
node crosses no NTB for its own DMA and uses none of the adapter resources, but its
peer-to-peer with remote devices may.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

import msgspec

from vmlend.errors import (
    ConfigError,
    DeviceHeldError,
    DeviceNotLentError,
    DmaLimitError,
    FabricError,
    LenderIommuOffError,
    LenderUnavailableError,
    ResourceExhaustedError,
    SwitchPortFullError,
    UnknownDeviceError,
    VmlendError,
    WindowExhaustedError,
)
from vmlend.registry.records import (
    Claim,
    ClaimKind,
    DeviceRecord,
    HoldRecord,
    NodeRecord,
    Phase,
    same_holder,
)
from vmlend.topology.model import (
    AdapterSpec,
    BarKind,
    Check,
    DeviceSpec,
    GuestRam,
    Holder,
    Topology,
)
from vmlend.topology.paths import NtbPath, route
from vmlend.topology.pcie import device_to_ram
from vmlend.topology.requesters import (
    is_port,
    port_switch,
    requester_device,
    requester_share,
    route_ports,
)
from vmlend.units import format_size_human


def _segments(size: int, segment: int) -> int:
    return -(-size // segment)


def bar_segments(spec: DeviceSpec, segment: int) -> int:
    """Segments the device's memory BARs take in a window: each BAR maps on its own."""
    return sum(_segments(b.size, segment) for b in spec.bars if b.kind is not BarKind.IO)


def guest_ram_of(value: GuestRam | int) -> GuestRam:
    """``value`` as RAM ranges. A bare byte count stands for a q35 guest of that size (the
    machine ``vmlend xml new`` writes), so callers that know only a size are counted by the
    same layout rules and planner as everyone else; callers that have the domain XML pass its
    real layout (``vmlend.memory.domain_memory.domain_guest_ram``)."""
    if isinstance(value, GuestRam):
        return value
    if value < 0:
        raise ConfigError(f"guest RAM must not be negative, got {value}")
    if value == 0:
        return GuestRam()
    # The layout rules and the planner load here, not with the module: listing devices
    # (`vmlend devices`, status) imports this module for its state rules only.
    from vmlend.memory.layout import MemoryConfig, compute_layout

    return GuestRam(tuple(compute_layout(MemoryConfig("q35", value)).ranges()))


def vm_share(holder: Holder) -> str:
    """The key under which a VM's DMA windows are counted once per lender adapter: its node
    and domain name.

    Not the UUID: ``same_holder`` treats a holder without a UUID and one with it as the same
    VM when node and name agree, so a UUID key would count that VM's windows twice. The name
    is what identifies the QEMU process whose RAM the windows map: libvirt allows one domain
    per name on a host and renames only stopped domains. Two holders with one name but
    different UUIDs (a stale hold of a redefined VM) therefore never map windows at the same
    time, and sharing their count is exact; a VM renamed while stopped that finds a stale hold
    under its old name is counted twice, which errs on the safe side."""
    return f"vm:{holder.node}/{holder.vm}"


def device_share(fdid: int) -> str:
    return f"dev:{fdid:#x}"


def lender_problem(rec: DeviceRecord | None, node: NodeRecord | None) -> str | None:
    """Why the device's lender cannot serve it now (for ``LenderUnavailableError``), or None."""
    if node is not None and not node.up:
        return f"is down ({node.why})" if node.why else "is down"
    if rec is not None and not rec.available:
        return "no longer offers it"
    return None


class StateView(msgspec.Struct, frozen=True):
    """The parts of the shared state that admission reads (one consistent snapshot)."""

    nodes: Mapping[str, NodeRecord]
    devices: Mapping[int, DeviceRecord]
    holds: Mapping[int, HoldRecord]
    claims: Sequence[tuple[int, Claim]]


class ClaimsOn:
    """``claims`` grouped by the adapter or port each is on, in one pass: admission asks about
    the few adapters and ports of one path several times, and going over every claim for
    each question made a reserve's cost grow with how full those adapters are."""

    __slots__ = ("_on",)

    def __init__(self, claims: Iterable[tuple[int, Claim]]) -> None:
        on: dict[str, list[tuple[int, Claim]]] = {}
        for item in claims:
            on.setdefault(item[1].adapter, []).append(item)
        self._on = {ref: tuple(items) for ref, items in on.items()}  # asked, never changed

    def __call__(self, *refs: str) -> Sequence[tuple[int, Claim]]:
        """The claims on ``refs``, in the order the claims came."""
        if len(refs) == 1:
            return self._on.get(refs[0], ())
        return [item for ref in dict.fromkeys(refs) for item in self._on.get(ref, ())]


class AdapterUsage(msgspec.Struct, frozen=True):
    """How much of an adapter's LUT and NTB window the current claims use."""

    adapter: AdapterSpec
    lut_used: int = 0
    segments_used: int = 0

    @property
    def lut_free(self) -> int:
        return self.adapter.lut_usable - self.lut_used

    @property
    def segments_free(self) -> int:
        return self.adapter.segments - self.segments_used

    @property
    def window_used(self) -> int:
        return self.segments_used * self.adapter.segment_size

    @property
    def window_free(self) -> int:
        return self.adapter.window_size - self.window_used


def usage(
    topology: Topology,
    claims: Sequence[tuple[int, Claim]],
    refs: Collection[str] | None = None,
) -> dict[str, AdapterUsage]:
    """Per adapter ref, what the claims use. A shared claim counts once, at its largest.
    Every adapter of the topology, or only those of ``refs`` (those it has): admission asks
    about the few adapters of one path, and a fabric may have thousands."""
    shared: dict[tuple[str, ClaimKind, str], tuple[int, int]] = {}
    for _fdid, c in claims:
        key = (c.adapter, c.kind, c.share)
        had = shared.get(key)
        # most claims share with none: compared only where one already counts
        shared[key] = (
            (c.entries, c.segments)
            if had is None
            else (max(had[0], c.entries), max(had[1], c.segments))
        )
    lut: dict[str, int] = {}
    segs: dict[str, int] = {}
    for (ref, _kind, _share), (entries, segments) in shared.items():
        lut[ref] = lut.get(ref, 0) + entries
        segs[ref] = segs.get(ref, 0) + segments
    if refs is None:
        adapters = topology.adapters()
    else:
        adapters = [a for ref in refs if (a := topology.adapter(ref)) is not None]
    return {a.ref: AdapterUsage(a, lut.get(a.ref, 0), segs.get(a.ref, 0)) for a in adapters}


#: The claim kinds that take a switch port's requester entries: a crossing's (LUT), and
#: peer-to-peer's between two lenders (P2P).
PORT_KINDS = (ClaimKind.LUT, ClaimKind.P2P)


def port_usage(claims: Sequence[tuple[int, Claim]], ports: Collection[str]) -> dict[str, int]:
    """Per switch port of ``ports``, the requester entries the claims use: one per requester
    however many holds claim it, for a crossing or peer-to-peer (``usage`` counts a shared
    claim once the same way)."""
    held: dict[str, set[str]] = {p: set() for p in ports}
    for _fdid, c in claims:
        if c.kind in PORT_KINDS and c.adapter in held:
            held[c.adapter].add(c.share)
    return {p: len(s) for p, s in held.items()}


class PortUsage(msgspec.Struct, frozen=True):
    """How many of a cluster switch port's requester entries the current claims use."""

    switch: str
    port: str
    used: int
    capacity: int

    @property
    def free(self) -> int:
        return self.capacity - self.used


def ports_in_use(topology: Topology, claims: Sequence[tuple[int, Claim]]) -> list[PortUsage]:
    """Every switch port some claim holds an entry on, by name (a port nobody crosses is not
    listed: a large fabric has thousands), each with its switch's ``requester_entries``."""
    held: dict[str, set[str]] = {}
    for _fdid, c in claims:
        if c.kind in PORT_KINDS and is_port(c.adapter):
            held.setdefault(c.adapter, set()).add(c.share)
    return [
        PortUsage(sw, name, len(s), topology.switch_requester_entries(sw))
        for name, s in sorted(held.items())
        for sw in [port_switch(name)]
    ]


def _claimed(claims: Sequence[tuple[int, Claim]], where: str, share: str) -> bool:
    """Some hold claims the requester entry ``share`` on ``where`` (an adapter, or a port,
    where peer-to-peer's claim of it counts too)."""
    kinds = PORT_KINDS if is_port(where) else (ClaimKind.LUT,)
    return any(c.kind in kinds and c.adapter == where and c.share == share for _f, c in claims)


class Admission(msgspec.Struct):
    """The outcome of admission: every check, and the claims a reservation would make."""

    checks: list[Check] = msgspec.field(default_factory=list)
    claims: list[Claim] = msgspec.field(default_factory=list)
    #: The VM's peer-to-peer claims once this device is added, each with the fdid whose hold
    #: owns it, and the VM's devices they replace the P2P claims of (None: not computed).
    p2p: list[tuple[int, Claim]] | None = None
    vm_devices: tuple[int, ...] = ()
    _errors: list[VmlendError | None] = msgspec.field(default_factory=list)

    def add(self, name: str, detail: str, error: VmlendError | None = None, **data: object) -> None:
        self.checks.append(
            Check(name=name, ok=error is None, detail=str(error) if error else detail, data=data)
        )
        self._errors.append(error)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def first_error(self) -> VmlendError | None:
        return next((e for e in self._errors if e is not None), None)

    def raise_if_refused(self) -> None:
        if (e := self.first_error()) is not None:
            raise e


def admit(
    topology: Topology,
    view: StateView,
    fdid: int,
    borrower: str,
    guest_ram: GuestRam | int = 0,
    holder: Holder | None = None,
    msi_over_ntb: bool = False,
    p2p_count: P2PCount | None = None,
) -> Admission:
    """Check whether ``borrower`` (for ``holder``'s VM with RAM ``guest_ram``) may take
    ``fdid``. Checks that cannot be evaluated after an earlier failure (no device, no path)
    are left out. ``msi_over_ntb`` also asks for an interrupt window (``msiadmit``), which is
    never a reason to refuse. ``p2p_count``: how the VM's peer-to-peer claims are counted
    (default ``p2p_claims``; a ledger with hardware counts them on the routes its maps take,
    ``linkfaults.p2p_on_hardware``)."""
    adm = Admission()
    ram = guest_ram_of(guest_ram)
    try:
        spec = topology.device(fdid)
    except UnknownDeviceError as e:
        adm.add("exists", "", e)
        return adm
    adm.add("exists", f"{spec.kind} {spec.bdf} on {spec.lender}", lender=spec.lender)

    rec = view.devices.get(fdid)
    problem = lender_problem(rec, view.nodes.get(spec.lender))
    if problem:
        adm.add("lender", "", LenderUnavailableError(fdid, spec.lender, problem))
    else:
        adm.add("lender", f"{spec.lender} is up")
    # Every holder is a VM, whose device's DMA lands at guest-physical addresses only through
    # the lender's IOMMU (IOVA = GPA): a lender with it off can lend to no VM.
    if topology.node(spec.lender).iommu:
        adm.add("iommu", f"{spec.lender} has its IOMMU on")
    else:
        adm.add("iommu", "", LenderIommuOffError(fdid, spec.lender))
    if rec is None or not rec.lent:
        adm.add("lent", "", DeviceNotLentError(fdid, spec.lender))
    else:
        adm.add("lent", f"lent by {spec.lender}")

    hold = view.holds.get(fdid)
    mine = hold is not None and holder is not None and same_holder(hold.holder, holder)
    if hold is None:
        adm.add("not-held", "nobody holds it")
    elif mine:
        adm.add("not-held", f"already held by this VM ({hold.holder})", holder=str(hold.holder))
    else:
        h = hold.holder
        adm.add("not-held", "", DeviceHeldError(fdid, h.node, h.vm), holder=str(h))

    # The device's DMA reaches the guest's RAM at its guest-physical addresses (lender IOMMU:
    # IOVA = GPA), so all of it must lie below the device's DMA limit.
    if ram.top > spec.dma_limit:
        adm.add("dma-limit", "", DmaLimitError(f"{fdid:#x}", spec.dma_bits, ram.top))
    elif ram.ranges:
        adm.add(
            "dma-limit",
            f"guest RAM ends at {ram.top:#x}, within {spec.dma_bits}-bit DMA reach",
            top=ram.top,
        )
    else:
        adm.add("dma-limit", "no guest RAM given: DMA reach not checked")

    try:
        path = route(topology, spec.lender, borrower)
    except FabricError as e:  # unknown borrower node or no cable
        adm.add("path", "", e)
        return adm
    if path is None:
        adm.add("path", f"{borrower} is the lender itself: no NTB crossing")
    else:
        hops, roots = _dma_counts(topology, fdid, borrower)  # as `vmlend path` counts them
        adm.add("path", path.describe(), path=path.describe(), hops=hops, roots=roots)
    if mine:
        for name in ("lut", "ports", "window-dma", "window-bars", "segments", "p2p"):
            adm.add(name, "already claimed by this VM's reservation")
        return adm
    if path is None:
        for name in ("lut", "ports", "window-dma", "window-bars", "segments"):
            adm.add(name, "not needed: the device is local")
    else:
        on = ClaimsOn(view.claims)
        _resource_checks(adm, topology, on, spec, path, ram, holder)
        if msi_over_ntb:
            _msi_check(adm, topology, on, spec, path, holder)
    _p2p_checks(adm, topology, view, spec, holder, p2p_count or p2p_claims)
    return adm


def _dma_memo(_topology: Topology) -> dict[tuple[int, str], tuple[int, int]]:
    return {}


def _dma_counts(topology: Topology, fdid: int, node: str) -> tuple[int, int]:
    """The hops and root complexes of device ``fdid``'s DMA into ``node``'s RAM
    (``device_to_ram``), computed once per topology: a pure function of it, and a changed
    topology (a new generation, cables down) is another instance with nothing derived. A
    reserve asks it every time; it walks the PCIe tree on both hosts."""
    memo = topology.derived(_dma_memo)
    counts = memo.get((fdid, node))
    if counts is None:
        dma = device_to_ram(topology, fdid, node)
        counts = memo[(fdid, node)] = (dma.hops, dma.roots)
    return counts


def admit_vm(
    topology: Topology,
    view: StateView,
    fdids: Sequence[int],
    borrower: str,
    guest_ram: GuestRam | int,
    holder: Holder,
    leaving: Holder | None = None,
) -> dict[int, Admission]:
    """Admit all of a VM's devices together from ``borrower``'s view: each device against the
    claims the ones before it would make, as if ``leaving`` (the same VM on the node it leaves,
    about to give its devices back) held nothing. What a migration must know before it stops
    the VM: several devices through one adapter are summed, not checked each on its own."""
    ram = guest_ram_of(guest_ram)
    holds = {
        f: h for f, h in view.holds.items() if leaving is None or not same_holder(h.holder, leaving)
    }
    # the holds' claims, and what the registry sets aside with no hold (fdid 0)
    claims = [(f, c) for f, c in view.claims if f in holds or f == 0]
    out: dict[int, Admission] = {}
    for fdid in fdids:
        adm = admit(
            topology,
            StateView(view.nodes, view.devices, holds, claims),
            fdid,
            borrower,
            ram,
            holder,
        )
        out[fdid] = adm
        if not adm.ok or fdid in holds:
            continue
        holds = {**holds, fdid: HoldRecord(fdid, holder, 0.0, Phase.RESERVED, ram.size)}
        claims = [*claims, *((fdid, c) for c in adm.claims)]
        if adm.p2p is not None:
            owners = set(adm.vm_devices)
            claims = [
                (f, c) for f, c in claims if not (c.kind is ClaimKind.P2P and f in owners)
            ] + adm.p2p
    return out


def _bar_chunks(size: int, segment: int) -> int:
    """Segments a naturally aligned BAR of ``size`` bytes can touch: each segment translates
    one segment-aligned chunk of guest-physical space."""
    chunks = -(-size // segment)
    aligned = size & (size - 1) == 0 and (segment % size == 0 or size % segment == 0)
    return chunks if aligned else chunks + 1


#: ``count(topology, holder, devices)``: a VM's peer-to-peer claims (``p2p_claims``'s shape).
P2PCount = Callable[[Topology, Holder, Sequence[DeviceSpec]], list[tuple[int, Claim]]]


def p2p_share(holder: Holder, target: int, bar: int) -> str:
    return f"p2p:{holder.node}/{holder.vm}>{target:#x}/bar{bar}"


def p2p_claims(
    topology: Topology,
    holder: Holder,
    devices: Sequence[DeviceSpec],
    crosses_from: Callable[[int], str | None] | None = None,
    route_of: Callable[[DeviceSpec, DeviceSpec], NtbPath | None] | None = None,
) -> list[tuple[int, Claim]]:
    """The adapter resources peer-to-peer among ``devices`` (one VM's, on ``holder.node``)
    can use, each owned by the target device's fdid (its hold).

    Mirrors ``vmlend.p2p.plan_p2p`` and the simulated mapper: a source reaches a BAR across
    an NTB through segments of its lender's adapter, one per segment-sized chunk of the BAR's
    guest-physical range, shared by every source through that adapter (hence one claim per
    adapter and BAR, which ``usage`` counts once); a source installed in the borrower has no
    LUT entry from a borrow and needs one there; a target on a lender other than the borrower
    needs the source named in that lender adapter's LUT (once per source and adapter). Where
    the guest puts the BARs is not known before it runs, so the count is the most the BAR can
    touch. ``NoPathError`` when two
    lenders of the VM have no NTB between them. ``crosses_from(fdid)``: the adapter the
    device's own crossing leaves its lender by, where the hardware says (None: not known,
    its route on ``topology``); a peer-to-peer route leaving by another adapter needs the
    source named in that adapter's LUT too (a re-route after a link event can do that).
    ``route_of(source, target)``: the route peer-to-peer from ``source`` to ``target`` takes
    (default: the cheapest on ``topology``; after a link event, the one the hardware's maps
    use)."""
    from vmlend.memory.layout import PAGE

    out: list[tuple[int, Claim]] = []
    for target in sorted(devices, key=lambda d: d.fdid):
        for source in sorted(devices, key=lambda d: d.fdid):
            if source.fdid == target.fdid:
                continue
            if route_of is not None:
                path = route_of(source, target)
            else:
                path = route(topology, source.lender, target.lender)
            if path is None:
                continue  # same lender: the lender IOMMU alone, no NTB resource
            adapter = path.src
            seg = adapter.segment_size
            reached = False
            for bar in target.bars:
                if bar.kind is BarKind.IO or bar.size < PAGE:
                    continue
                n = _bar_chunks(bar.size, seg)
                share = p2p_share(holder, target.fdid, bar.index)
                claim = Claim(adapter.ref, ClaimKind.P2P, share, segments=n, bytes=n * seg)
                out.append((target.fdid, claim))
                reached = True
            if reached:  # the source's requester crosses the switch ports on the way
                req = requester_share(source)
                for port in route_ports(path):
                    out.append((target.fdid, Claim(port.name, ClaimKind.P2P, req, entries=1)))
            if source.lender == holder.node or _leaves_by(
                topology, source, holder.node, crosses_from
            ) not in (None, adapter.ref):
                rid = Claim(adapter.ref, ClaimKind.P2P, f"p2p-rid:{source.fdid:#x}", entries=1)
                out.append((target.fdid, rid))
            if target.lender != holder.node:
                # the far lender's adapter names the source in its own LUT (attach_ingress);
                # towards the borrower itself the source's borrow made that entry already
                far = Claim(path.dst.ref, ClaimKind.P2P, f"p2p-in:{source.fdid:#x}", entries=1)
                out.append((target.fdid, far))
    # once each: two sources through one adapter claim a BAR's segments there alike, and a
    # copy is one key more in every transaction that re-makes the hold (a hand-over)
    return list(dict.fromkeys(out))


def _leaves_by(
    topology: Topology,
    source: DeviceSpec,
    node: str,
    crosses_from: Callable[[int], str | None] | None,
) -> str | None:
    """The adapter ``source``'s own crossing to ``node`` leaves its lender by (None: none)."""
    known = crosses_from(source.fdid) if crosses_from is not None else None
    if known is not None:
        return known
    own = route(topology, source.lender, node)
    return own.src.ref if own is not None else None


def _p2p_checks(
    adm: Admission,
    topology: Topology,
    view: StateView,
    spec: DeviceSpec,
    holder: Holder | None,
    count: P2PCount,
) -> None:
    if holder is None:
        adm.add("p2p", "no VM given: peer-to-peer not counted")
        return
    mine = sorted(
        f for f, h in view.holds.items() if f != spec.fdid and same_holder(h.holder, holder)
    )
    specs = [spec]
    for f in mine:
        try:
            specs.append(topology.device(f))
        except UnknownDeviceError:
            continue  # a hold on a device the topology no longer has: nothing to reach
    try:
        p2p = count(topology, holder, specs)
    except FabricError as e:  # two lenders of the VM that no NTB joins
        adm.add("p2p", "", e)
        return
    adm.p2p, adm.vm_devices = p2p, (*mine, spec.fdid)
    if not p2p:
        adm.add("p2p", "peer-to-peer among the VM's devices crosses no NTB")
        return
    owners = set(adm.vm_devices)
    base = [(f, c) for f, c in view.claims if not (c.kind is ClaimKind.P2P and f in owners)]
    base += [(spec.fdid, c) for c in adm.claims]
    port_error = _p2p_port_error(topology, base, p2p)
    refs = sorted({c.adapter for _f, c in p2p if not is_port(c.adapter)})
    before, after = usage(topology, base, refs), usage(topology, [*base, *p2p], refs)
    parts: list[str] = []
    error: VmlendError | None = None
    for ref in refs:
        b, a = before[ref], after[ref]
        segs, luts = a.segments_used - b.segments_used, a.lut_used - b.lut_used
        parts.append(f"{ref} needs {segs} of {b.segments_free} free segments")
        if luts:
            parts[-1] += f" and {luts} of {b.lut_free} free LUT entries"
        if error is None and a.segments_free < 0:
            error = ResourceExhaustedError(
                "NTB window segments for peer-to-peer", ref, segs, b.segments_free, "segments"
            )
        if error is None and a.lut_free < 0:
            error = ResourceExhaustedError(
                "requester LUT for peer-to-peer", ref, luts, b.lut_free, "entries"
            )
    if ports := sorted({c.adapter for _f, c in p2p if is_port(c.adapter)}):
        parts.append(f"the requesters' entries on {len(ports)} switch port(s)")
    adm.add("p2p", "peer-to-peer: " + "; ".join(parts), error or port_error)


def _p2p_port_error(
    topology: Topology, base: Sequence[tuple[int, Claim]], p2p: Sequence[tuple[int, Claim]]
) -> SwitchPortFullError | None:
    """The first switch port peer-to-peer needs a requester entry on that is full."""
    ports = sorted({c.adapter for _f, c in p2p if is_port(c.adapter)})
    before, after = port_usage(base, ports), port_usage([*base, *p2p], ports)
    for name in ports:
        size = topology.switch_requester_entries(port_switch(name))
        if after[name] > size and after[name] > before[name]:
            have = {c.share for _f, c in base if c.adapter == name and c.kind in PORT_KINDS}
            new = sorted(c.share for _f, c in p2p if c.adapter == name and c.share not in have)
            requester = new[0].removeprefix("req:") if new else "?"
            return SwitchPortFullError(port_switch(name), name, requester, size)
    return None


def _msi_check(
    adm: Admission,
    topology: Topology,
    on: ClaimsOn,
    spec: DeviceSpec,
    path: NtbPath,
    holder: Holder | None,
) -> None:
    from vmlend.ledger.msiadmit import msi_claim

    # Free segments after this reservation's own claims (shared claims count once).
    there = on(path.src.ref)
    mine = [*there, *((spec.fdid, c) for c in adm.claims)]
    left = usage(topology, mine, [path.src.ref])[path.src.ref]
    claim, why = msi_claim(spec, path.src, left.segments_free, holder, there)
    adm.add("msi-ntb", why, path="ntb" if claim else "relay")
    if claim is not None:
        adm.claims.append(claim)


def _resource_checks(
    adm: Admission,
    topology: Topology,
    on: ClaimsOn,
    spec: DeviceSpec,
    path: NtbPath,
    ram: GuestRam,
    holder: Holder | None,
) -> None:
    lender_a, borrower_a = path.src, path.dst
    use = usage(topology, on(lender_a.ref, borrower_a.ref), [lender_a.ref, borrower_a.ref])
    lu, bu = use[lender_a.ref], use[borrower_a.ref]
    fd = f"{spec.fdid:#x}"

    # Requester LUT: one entry on each adapter of the crossing, for the device's requester id
    # on the lender's side and its identity on the borrower's side; per requester bus:device,
    # so a function whose device already has the entry there needs none more.
    lut_error: VmlendError | None = None
    share = requester_share(spec)
    shared: list[str] = []
    for a, u in ((lender_a, lu), (borrower_a, bu)):
        if _claimed(on(a.ref), a.ref, share):
            shared.append(a.ref)
        elif u.lut_free < 1 and lut_error is None:
            lut_error = ResourceExhaustedError("requester LUT", a.ref, 1, u.lut_free, "entries")
        adm.claims.append(Claim(a.ref, ClaimKind.LUT, share, entries=1))
    also = f"; its device's entry there already on {', '.join(shared)}" if shared else ""
    adm.add(
        "lut",
        f"1 entry for {fd} (requester {requester_device(spec)}) on each of {lender_a.ref}"
        f" ({lu.lut_free} of {lender_a.lut_usable} usable free) and {borrower_a.ref}"
        f" ({bu.lut_free} of {borrower_a.lut_usable} free){also}",
        lut_error,
        lender_free=lu.lut_free,
        borrower_free=bu.lut_free,
    )
    _port_checks(adm, topology, on, spec, path)

    # DMA windows: the VM's RAM in the lender's window, once per (lender adapter, VM).
    seg_l = lender_a.segment_size
    who = str(holder) if holder else "the VM"
    prior = 0
    if holder is not None:
        share = vm_share(holder)
        prior = max(
            (
                c.segments
                for _f, c in on(lender_a.ref)
                if c.kind is ClaimKind.DMA and c.share == share
            ),
            default=0,
        )
    from vmlend.memory.windows import window_segments

    # the planner's own count: low and high windows each rounded out to whole segments
    dma_segs = window_segments(ram.ranges, seg_l) if ram.ranges else 0
    extra_dma_segs = max(0, dma_segs - prior)
    dma_need = extra_dma_segs * seg_l
    purpose = f"DMA windows for {format_size_human(ram.size)} of RAM of {who} ({dma_segs} segments)"
    if not ram.ranges:
        adm.add("window-dma", "no guest RAM given: no DMA window claimed")
    elif dma_need > lu.window_free:
        adm.add(
            "window-dma",
            "",
            WindowExhaustedError(lender_a.ref, dma_need, lu.window_free, purpose),
            need=dma_need,
            have=lu.window_free,
        )
    elif prior:
        adm.add(
            "window-dma",
            f"NTB window {lender_a.ref}: {who} already has {format_size_human(prior * seg_l)}"
            f" of DMA windows there; {format_size_human(dma_need)} more needed",
            need=dma_need,
            have=lu.window_free,
        )
    else:
        adm.add(
            "window-dma",
            f"NTB window {lender_a.ref}: {purpose}, {format_size_human(lu.window_free)} free",
            need=dma_need,
            have=lu.window_free,
        )
    if holder is not None and dma_segs:
        adm.claims.append(
            Claim(
                lender_a.ref,
                ClaimKind.DMA,
                vm_share(holder),
                segments=dma_segs,
                bytes=dma_segs * seg_l,
            )
        )

    # BARs: the device's memory BARs in the borrower's window.
    seg_b = borrower_a.segment_size
    bar_need = spec.bar_bytes
    bar_segs = bar_segments(spec, seg_b)
    if bar_need > bu.window_free:
        adm.add(
            "window-bars",
            "",
            WindowExhaustedError(borrower_a.ref, bar_need, bu.window_free, f"BARs of {fd}"),
            need=bar_need,
            have=bu.window_free,
        )
    else:
        adm.add(
            "window-bars",
            f"NTB window {borrower_a.ref}: {format_size_human(bar_need)} of BARs of {fd},"
            f" {format_size_human(bu.window_free)} free",
            need=bar_need,
            have=bu.window_free,
        )
    if bar_segs:
        adm.claims.append(
            Claim(
                borrower_a.ref,
                ClaimKind.BAR,
                device_share(spec.fdid),
                segments=bar_segs,
                bytes=bar_segs * seg_b,
            )
        )

    # Segments: the window is mapped in whole segments, so small mappings round up.
    parts = []
    error: VmlendError | None = None
    for a, u, need in ((lender_a, lu, extra_dma_segs), (borrower_a, bu, bar_segs)):
        parts.append(
            f"{a.ref} needs {need} of {u.segments_free} free segments"
            f" ({format_size_human(a.segment_size)} each)"
        )
        if need > u.segments_free and error is None:
            error = ResourceExhaustedError(
                "NTB window segments", a.ref, need, u.segments_free, "segments"
            )
    adm.add(
        "segments",
        "; ".join(parts),
        error,
        lender_segments=extra_dma_segs,
        borrower_segments=bar_segs,
    )


def _port_checks(
    adm: Admission, topology: Topology, on: ClaimsOn, spec: DeviceSpec, path: NtbPath
) -> None:
    """A requester entry on every cluster switch port the crossing passes: the port's table
    must have room for the device's requester unless another function of it is there."""
    ports = route_ports(path)
    if not ports:
        adm.add("ports", "a back-to-back cable: no switch port to pass")
        return
    share = requester_share(spec)
    names = [p.name for p in ports]
    used = port_usage(on(*names), names)
    parts: list[str] = []
    error: VmlendError | None = None
    for p in ports:
        size = topology.switch_requester_entries(p.switch)
        free = size - used[p.name]
        if _claimed(on(p.name), p.name, share):
            parts.append(f"{p.name} has it")
        else:
            parts.append(f"{p.name} {free} of {size} free")
            if free < 1 and error is None:
                error = SwitchPortFullError(p.switch, p.name, requester_device(spec), size)
        adm.claims.append(Claim(p.name, ClaimKind.LUT, share, entries=1))
    adm.add(
        "ports",
        f"1 requester entry on each switch port on the way: {', '.join(parts)}",
        error,
        ports=[p.name for p in ports],
    )
