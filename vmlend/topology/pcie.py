"""PCIe paths stage by stage: hops, root complexes and the latency of each element (pure).

A path lists the elements a TLP passes from one end to the other: the end device (not a hop),
then each switching element, then the other end. A **hop** is a switching element, counted the
way the papers count them: an in-host PCIe switch, a root complex, an NTB adapter, a cluster
switch, and each of the three elements of a transparent link to an expansion chassis (the
host-side link adapter, the chassis' link adapter, the chassis switch). Neither end device is a
hop, and root ports are part of their root complex. ``roots`` counts the root complexes passed.

Where peer-to-peer turns depends on the host's IOMMU (``NodeSpec.iommu``, on by default). On,
ACS redirects it up through the root complex, so two devices under one switch go switch ->
root complex -> switch: 3 hops, 1 root. Off, it turns at the nearest switch both hang below:
1 hop, 0 roots (and a device reaches its host's NTB adapter without visiting the root). A TLP
into RAM or from a CPU always passes the root complex.

On the default topology (GPUs and the NTB adapter in an expansion chassis behind a transparent
link, as the papers built it) this gives the papers' Table-2 anchors: local VM P2P 7 hops,
1 root; a remote VM whose devices on two lenders exchange data through the borrower's RAM
21 hops, 3 roots (docs/simulator.md).

Latency, one way, as the SmartIO paper gives it per element (``vmlend.topology.chips``): each
switch, chassis element and cluster switch its chip's figure, each NTB crossing
``NTB_CROSSING_NS`` (both adapters and the cable; the stage of the adapter a TLP enters by
carries it), a root complex nothing (the papers give no figure for it). A path's latency is the
sum: the papers' estimate, not a measurement.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import msgspec

from vmlend.errors import ConfigError, FabricError
from vmlend.topology.chips import LINK_ADAPTER_CHIP, NTB_CROSSING_NS, Chip
from vmlend.topology.model import DeviceSpec, PcieElement, PcieKind, Topology, parse_fdid
from vmlend.topology.paths import NtbPath, route, routes


class Hop(enum.StrEnum):
    DEVICE = "device"  # an end of the path, not a hop
    SWITCH = "switch"  # in-host PCIe switch
    HOST_LINK = "host-link-adapter"  # the host's end of the transparent link to a chassis
    CHASSIS_LINK = "chassis-link-adapter"  # the chassis' end of that link
    CHASSIS = "chassis-switch"  # the expansion chassis' switch
    ROOT_COMPLEX = "root-complex"  # with its root ports
    NTB = "ntb-adapter"
    CLUSTER_SWITCH = "cluster-switch"


class Stage(msgspec.Struct, frozen=True):
    """One element of a path: what it is, its name, the host it sits in ("" for the cluster
    switches between hosts), its chip (None: an end, a root complex, an NTB adapter) and what
    it adds one way (an NTB adapter: the whole crossing, or 0 for its far end)."""

    kind: Hop
    name: str
    node: str
    chip: Chip | None = None
    ns: int = 0

    def to_json(self) -> dict[str, object]:
        return {
            "kind": self.kind.value,
            "name": self.name,
            "node": self.node,
            "chip": self.chip.value if self.chip else None,
            "ns": self.ns,
        }


def _chip_stage(kind: Hop, name: str, node: str, chip: Chip) -> Stage:
    return Stage(kind, name, node, chip, chip.ns)


class PciePath(msgspec.Struct, frozen=True):
    """A path from ``src`` to ``dst`` (their descriptions) through ``stages``."""

    src: str
    dst: str
    stages: tuple[Stage, ...]
    #: The NTB cables it passes by name (``LinkSpec.names``); () inside one host.
    links: tuple[str, ...] = ()

    @property
    def hops(self) -> int:
        """Switching elements passed: every stage but the end devices."""
        return sum(1 for s in self.stages if s.kind is not Hop.DEVICE)

    @property
    def roots(self) -> int:
        return sum(1 for s in self.stages if s.kind is Hop.ROOT_COMPLEX)

    @property
    def ntb_crossings(self) -> int:
        return sum(1 for s in self.stages if s.kind is Hop.NTB) // 2

    @property
    def added_ns(self) -> int:
        """The NTB crossings' share of ``latency_ns``."""
        return self.ntb_crossings * NTB_CROSSING_NS

    @property
    def latency_ns(self) -> int:
        """Its one-way latency: the sum of its elements' (the papers' figures)."""
        return sum(s.ns for s in self.stages)

    def legs(self) -> list[tuple[str, list[Stage]]]:
        """The stages grouped by where they are: one group per host, "fabric" in between."""
        out: list[tuple[str, list[Stage]]] = []
        for s in self.stages:
            where = s.node or "fabric"
            if out and out[-1][0] == where:
                out[-1][1].append(s)
            else:
                out.append((where, [s]))
        return out

    def summary(self) -> str:
        return f"{self.hops} hops, {self.roots} root(s), {self.latency_ns} ns"

    def to_json(self) -> dict[str, object]:
        return {
            "src": self.src,
            "dst": self.dst,
            "hops": self.hops,
            "roots": self.roots,
            "ntb_crossings": self.ntb_crossings,
            "latency_ns": self.latency_ns,
            "added_ns": self.added_ns,
            "links": list(self.links),
            "stages": [s.to_json() for s in self.stages],
        }


def _ancestors(topology: Topology, node: str, slot: str | None) -> list[PcieElement]:
    """The elements above an endpoint in ``slot``, nearest first, up to its root port (none
    for an endpoint without a slot: it sits in a root port of its own)."""
    elements = {e.name: e for e in topology.node(node).pcie}
    out: list[PcieElement] = []
    name = slot
    while name is not None:
        e = elements[name]  # the topology parser checked every slot and parent
        out.append(e)
        name = e.parent
    return out


def _element_up(e: PcieElement, node: str) -> list[Stage]:
    """The hops of one element as a TLP climbs through it; the turning point first."""
    if e.kind is PcieKind.SWITCH:
        return [_chip_stage(Hop.SWITCH, e.name, node, e.switch_chip)]
    if e.kind is PcieKind.CHASSIS:  # the chassis switch, then the transparent link up
        return [
            _chip_stage(Hop.CHASSIS, f"{e.name} switch", node, e.switch_chip),
            _chip_stage(Hop.CHASSIS_LINK, f"{e.name} link adapter", node, LINK_ADAPTER_CHIP),
            _chip_stage(Hop.HOST_LINK, f"host link adapter to {e.name}", node, LINK_ADAPTER_CHIP),
        ]
    return []  # a root port is part of the root complex


def _climb(elements: Sequence[PcieElement], node: str) -> list[Stage]:
    return [s for e in elements for s in _element_up(e, node)]


def _root_complex(node: str, *sides: Sequence[PcieElement]) -> Stage:
    ports = sorted({e.name for side in sides for e in side if e.kind is PcieKind.ROOT_PORT})
    via = f" via {', '.join(ports)}" if ports else ""
    return Stage(Hop.ROOT_COMPLEX, f"{node} root complex{via}", node)


def _up(topology: Topology, node: str, slot: str | None) -> list[Stage]:
    """From an endpoint in ``slot`` up to and including its host's root complex (towards its
    RAM or CPU: always through the root complex)."""
    above = _ancestors(topology, node, slot)
    return [*_climb(above, node), _root_complex(node, above)]


def _within(topology: Topology, node: str, a: str | None, b: str | None) -> list[Stage]:
    """The hops between two endpoints of one host (in slots ``a`` and ``b``): with its IOMMU
    off, turning at the nearest switch above both; else (or with none in common) through its
    root complex."""
    up_a = _ancestors(topology, node, a)
    up_b = _ancestors(topology, node, b)
    if not topology.node(node).iommu:
        names_b = [e.name for e in up_b]
        for i, e in enumerate(up_a):
            if e.kind is not PcieKind.ROOT_PORT and e.name in names_b:
                j = names_b.index(e.name)
                turn = _element_up(e, node)[0]
                down = _climb(up_b[:j], node)[::-1]
                return [*_climb(up_a[:i], node), turn, *down]
    return [*_climb(up_a, node), _root_complex(node, up_a, up_b), *_climb(up_b, node)[::-1]]


def _across(path: NtbPath) -> list[Stage]:
    """From the source adapter to the destination adapter, both included: the first carries
    the crossing's latency, each cluster switch its chip's."""
    cluster = [
        _chip_stage(Hop.CLUSTER_SWITCH, sw, "", chip)
        for sw, chip in zip(path.switches, path.chips, strict=True)
    ]
    return [
        Stage(Hop.NTB, path.src.ref, path.src.node, ns=NTB_CROSSING_NS),
        *cluster,
        Stage(Hop.NTB, path.dst.ref, path.dst.node),
    ]


def _backwards(stages: Sequence[Stage]) -> tuple[Stage, ...]:
    """``stages`` walked the other way: each crossing's latency moves to the adapter a TLP now
    enters the NTB by (the first of each pair of NTB adapters)."""
    out: list[Stage] = []
    entering = True
    for s in reversed(stages):
        if s.kind is Hop.NTB:
            s = msgspec.structs.replace(s, ns=NTB_CROSSING_NS if entering else 0)
            entering = not entering
        out.append(s)
    return tuple(out)


def _ntb(topology: Topology, src: str, dst: str, ntb: NtbPath | None = None) -> NtbPath:
    """``ntb`` when given (one of the ``routes``), else the shortest route."""
    if ntb is not None:
        return ntb
    path = route(topology, src, dst)
    assert path is not None  # callers handle the same node
    return path


def _device_stage(spec: DeviceSpec) -> Stage:
    return Stage(Hop.DEVICE, f"{spec.kind} {spec.fdid:#x}", spec.lender)


def peer_path(
    topology: Topology,
    src: Stage,
    src_slot: str | None,
    dst: Stage,
    dst_slot: str | None,
    ntb: NtbPath | None = None,
) -> PciePath:
    """Peer-to-peer from the endpoint ``src`` (in ``src_slot`` of host ``src.node``) to
    ``dst``: inside one host, or through the NTB between the two hosts; each host's IOMMU
    decides where the TLP turns in it. ``NoPathError`` when no NTB joins the hosts."""
    links: tuple[str, ...] = ()
    if src.node == dst.node:
        middle = _within(topology, src.node, src_slot, dst_slot)
    else:
        ntb = _ntb(topology, src.node, dst.node, ntb)
        links = ntb.links
        middle = [
            *_within(topology, src.node, src_slot, ntb.src.slot),
            *_across(ntb),
            *_within(topology, dst.node, ntb.dst.slot, dst_slot),
        ]
    return PciePath(src.name, dst.name, (src, *middle, dst), links)


def device_to_ram(topology: Topology, fdid: int, node: str, ntb: NtbPath | None = None) -> PciePath:
    """DMA of device ``fdid`` into the RAM of a VM on ``node`` (to the lender's NTB adapter,
    across the NTB, up to the borrower's root complex), over ``ntb`` when given (one of the
    ``routes`` from the lender to ``node``), else the shortest route."""
    spec = topology.device(fdid)
    topology.node(node)
    stages = [_device_stage(spec)]
    links: tuple[str, ...] = ()
    if spec.lender == node:
        stages += _up(topology, node, spec.slot)
    else:
        ntb = _ntb(topology, spec.lender, node, ntb)
        links = ntb.links
        stages += _within(topology, spec.lender, spec.slot, ntb.src.slot)
        stages += _across(ntb)
        stages += _up(topology, node, ntb.dst.slot)
    return PciePath(f"device {fdid:#x}", f"RAM of {node}", tuple(stages), links)


def cpu_to_bar(topology: Topology, node: str, fdid: int, ntb: NtbPath | None = None) -> PciePath:
    """A CPU of ``node`` (a VM's driver) reading or writing a BAR of device ``fdid``: the way
    the device's DMA into that node's RAM takes, backwards (``ntb``: from the lender)."""
    back = device_to_ram(topology, fdid, node, ntb)
    stages = _backwards(back.stages)
    return PciePath(f"CPU of {node}", f"BAR of device {fdid:#x}", stages, back.links)


def device_to_device(
    topology: Topology, src: int, dst: int, ntb: NtbPath | None = None
) -> PciePath:
    """Peer-to-peer: device ``src`` writes into a BAR of device ``dst`` directly (same lender:
    inside it; else across the NTB between the two lenders, over ``ntb`` when given)."""
    a, b = topology.device(src), topology.device(dst)
    if a.fdid == b.fdid:
        raise FabricError(f"device {src:#x} is both ends of the path; give two devices")
    found = peer_path(topology, _device_stage(a), a.slot, _device_stage(b), b.slot, ntb)
    return PciePath(f"device {src:#x}", f"device {dst:#x}", found.stages, found.links)


def device_via_ram(topology: Topology, src: int, dst: int, node: str) -> PciePath:
    """Device ``src`` to device ``dst`` through the RAM of a VM on ``node`` (a bounce buffer:
    ``src`` writes it, ``dst`` reads it)."""
    into = device_to_ram(topology, src, node).stages
    out_of = device_to_ram(topology, dst, node).stages
    stages = (*into, *_backwards(out_of)[1:])
    return PciePath(f"device {src:#x}", f"device {dst:#x} via RAM of {node}", stages)


def explain(topology: Topology, src: str, dst: str, via: str | None = None) -> PciePath:
    """The path ``vmlend path SRC DST`` explains. Each end is a device (fdid) or a node name
    (that node's CPU and RAM, i.e. its root complex): device -> node is DMA into a VM's RAM
    there, node -> device a CPU reaching the device's BAR, device -> device peer-to-peer
    (through ``via``'s RAM when given). ``ConfigError`` for anything else."""
    nodes = {n.name for n in topology.nodes}
    a_node, b_node = src in nodes, dst in nodes
    if via is not None:
        topology.node(via)
        if a_node or b_node:
            raise ConfigError("--via names a node whose RAM two devices meet in; give two devices")
        return device_via_ram(topology, parse_fdid(src), parse_fdid(dst), via)
    if a_node and b_node:
        raise ConfigError(
            f"{src} and {dst} are both nodes; give a device (fdid) on at least one side"
        )
    if b_node:
        return device_to_ram(topology, parse_fdid(src), dst)
    if a_node:
        return cpu_to_bar(topology, src, parse_fdid(dst))
    return device_to_device(topology, parse_fdid(src), parse_fdid(dst))


def explain_all(topology: Topology, src: str, dst: str) -> list[PciePath]:
    """Every path ``vmlend path --all SRC DST`` lists: ``explain``'s path once per NTB route
    between the two hosts (different adapters, different cables), in the order ``routes`` ranks
    them (the crossing's latency, then hops: the first is the one used, though the elements
    inside the hosts may make a later one cheaper end to end); the one path when both ends are
    in one host. ``ConfigError`` as ``explain``."""
    nodes = {n.name for n in topology.nodes}
    a_node, b_node = src in nodes, dst in nodes
    if a_node and b_node:
        raise ConfigError(
            f"{src} and {dst} are both nodes; give a device (fdid) on at least one side"
        )
    if b_node:
        fdid, node = parse_fdid(src), dst
        lender = topology.device(fdid).lender
        alts = routes(topology, lender, node)
        if not alts:
            return [device_to_ram(topology, fdid, node)]
        return [device_to_ram(topology, fdid, node, p) for p in alts]
    if a_node:
        fdid, node = parse_fdid(dst), src
        alts = routes(topology, topology.device(fdid).lender, node)
        if not alts:
            return [cpu_to_bar(topology, node, fdid)]
        return [cpu_to_bar(topology, node, fdid, p) for p in alts]
    a, b = topology.device(parse_fdid(src)), topology.device(parse_fdid(dst))
    alts = routes(topology, a.lender, b.lender)
    if not alts:
        return [device_to_device(topology, a.fdid, b.fdid)]
    return [device_to_device(topology, a.fdid, b.fdid, p) for p in alts]
