"""PCIe paths stage by stage: hops, root complexes and the latency the NTB adds (pure).

A path lists every element a TLP passes, both ends included: the device, the in-host switches
and expansion chassis above it, the root port, the root complex, the NTB adapters and the
cluster switches between hosts. ``hops`` is that count (the links crossed plus one), ``roots``
the root complexes passed. With the IOMMU on (always, for lending), peer-to-peer below a root
complex is forced up through it (ACS redirect), so a device reaching a peer under the same
switch still goes switch -> root port -> root complex -> root port -> switch.

The counting matches docs/design.md's Table-2 anchors on the default topology: local VM P2P is
``gpu, switch, root port, root complex, root port, switch, gpu`` = 7 hops, 1 root; a remote VM
whose two devices on two lenders exchange data through the borrower's RAM is 21 hops, 3 roots
(see docs/simulator.md). Latency: each NTB crossing adds ``NTB_ONE_WAY_NS`` one way (docs/design.md:
~350-370 ns); the other hops are not costed, the papers give no per-hop figure for them.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import msgspec

from vmlend.errors import ConfigError, FabricError
from vmlend.topology.model import AdapterSpec, DeviceSpec, PcieKind, Topology, parse_fdid
from vmlend.topology.paths import NtbPath, route

#: One way across one NTB crossing (adapter, cable or cluster switches, adapter), docs/design.md.
NTB_ONE_WAY_NS = 360


class Hop(enum.StrEnum):
    DEVICE = "device"
    SWITCH = "switch"  # in-host PCIe switch
    CHASSIS = "chassis"  # expansion chassis switch
    ROOT_PORT = "root-port"
    ROOT_COMPLEX = "root-complex"
    NTB = "ntb-adapter"
    CLUSTER_SWITCH = "cluster-switch"


_ELEMENT_HOP = {PcieKind.SWITCH: Hop.SWITCH, PcieKind.CHASSIS: Hop.CHASSIS}


class Stage(msgspec.Struct, frozen=True):
    """One element of a path: what it is, its name, and the host it sits in ("" for the
    cluster switches between hosts)."""

    kind: Hop
    name: str
    node: str

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind.value, "name": self.name, "node": self.node}


class PciePath(msgspec.Struct, frozen=True):
    """A path from ``src`` to ``dst`` (their descriptions) through ``stages``."""

    src: str
    dst: str
    stages: tuple[Stage, ...]

    @property
    def hops(self) -> int:
        return len(self.stages)

    @property
    def roots(self) -> int:
        return sum(1 for s in self.stages if s.kind is Hop.ROOT_COMPLEX)

    @property
    def ntb_crossings(self) -> int:
        return sum(1 for s in self.stages if s.kind is Hop.NTB) // 2

    @property
    def added_ns(self) -> int:
        """Estimated one-way latency the NTB crossings add over a path inside one host."""
        return self.ntb_crossings * NTB_ONE_WAY_NS

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
        return f"{self.hops} hops, {self.roots} root(s), +{self.added_ns} ns"

    def to_json(self) -> dict[str, object]:
        return {
            "src": self.src,
            "dst": self.dst,
            "hops": self.hops,
            "roots": self.roots,
            "ntb_crossings": self.ntb_crossings,
            "added_ns": self.added_ns,
            "stages": [s.to_json() for s in self.stages],
        }


def _up(topology: Topology, node: str, slot: str | None, first: Stage) -> list[Stage]:
    """From an endpoint up to its host's root complex: the endpoint, the elements it hangs
    below, the root port, the root complex. Without a slot the endpoint sits in a root port
    of its own."""
    chain = [first]
    elements = {e.name: e for e in topology.node(node).pcie}
    name = slot
    if name is None:
        chain.append(Stage(Hop.ROOT_PORT, f"root port of {first.name}", node))
    while name is not None:
        e = elements[name]  # the topology parser checked every slot and parent
        hop = Hop.ROOT_PORT if e.kind is PcieKind.ROOT_PORT else _ELEMENT_HOP[e.kind]
        chain.append(Stage(hop, e.name, node))
        name = e.parent
    chain.append(Stage(Hop.ROOT_COMPLEX, f"{node} root complex", node))
    return chain


def _device_up(topology: Topology, spec: DeviceSpec) -> list[Stage]:
    first = Stage(Hop.DEVICE, f"{spec.kind} {spec.fdid:#x}", spec.lender)
    return _up(topology, spec.lender, spec.slot, first)


def _adapter_up(topology: Topology, adapter: AdapterSpec) -> list[Stage]:
    first = Stage(Hop.NTB, adapter.ref, adapter.node)
    return _up(topology, adapter.node, adapter.slot, first)


def _across(topology: Topology, path: NtbPath) -> list[Stage]:
    """Root complex of the source host to the root complex of the destination host."""
    down = list(reversed(_adapter_up(topology, path.src)))[1:]  # without the source RC
    cluster = [Stage(Hop.CLUSTER_SWITCH, sw, "") for sw in path.switches]
    return [*down, *cluster, *_adapter_up(topology, path.dst)]


def _rc_to_rc(topology: Topology, src: str, dst: str) -> list[Stage]:
    """The stages after ``src``'s root complex up to and including ``dst``'s."""
    path = route(topology, src, dst)
    return [] if path is None else _across(topology, path)


def device_to_ram(topology: Topology, fdid: int, node: str) -> PciePath:
    """DMA of device ``fdid`` into the RAM of a VM on ``node`` (through the lender's root
    complex and IOMMU, then across the NTB to the borrower's)."""
    spec = topology.device(fdid)
    topology.node(node)
    stages = _device_up(topology, spec) + _rc_to_rc(topology, spec.lender, node)
    return PciePath(f"device {fdid:#x}", f"RAM of {node}", tuple(stages))


def cpu_to_bar(topology: Topology, node: str, fdid: int) -> PciePath:
    """A CPU of ``node`` (a VM's driver) reading or writing a BAR of device ``fdid``."""
    spec = topology.device(fdid)
    topology.node(node)
    to_lender = _rc_to_rc(topology, node, spec.lender)
    stages = [Stage(Hop.ROOT_COMPLEX, f"{node} root complex", node), *to_lender]
    stages += list(reversed(_device_up(topology, spec)))[1:]
    return PciePath(f"CPU of {node}", f"BAR of device {fdid:#x}", tuple(stages))


def device_to_device(topology: Topology, src: int, dst: int) -> PciePath:
    """Peer-to-peer: device ``src`` writes into a BAR of device ``dst`` directly (same lender:
    up through its root complex and down; else across the NTB between the two lenders)."""
    a, b = topology.device(src), topology.device(dst)
    if a.fdid == b.fdid:
        raise FabricError(f"device {src:#x} is both ends of the path; give two devices")
    stages = _device_up(topology, a) + _rc_to_rc(topology, a.lender, b.lender)
    stages += list(reversed(_device_up(topology, b)))[1:]
    return PciePath(f"device {src:#x}", f"device {dst:#x}", tuple(stages))


def device_via_ram(topology: Topology, src: int, dst: int, node: str) -> PciePath:
    """Device ``src`` to device ``dst`` through the RAM of a VM on ``node`` (a bounce buffer:
    ``src`` writes it, ``dst`` reads it)."""
    into = device_to_ram(topology, src, node).stages
    out_of = device_to_ram(topology, dst, node).stages
    stages: Sequence[Stage] = [*into, *reversed(out_of[:-1])]
    return PciePath(f"device {src:#x}", f"device {dst:#x} via RAM of {node}", tuple(stages))


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
