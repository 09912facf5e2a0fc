"""Properties of PCIe path counting over generated host trees (issue 23): turning an IOMMU off
never makes a path longer, and a path has one count wherever it is shown (``vmlend path``,
P2P maps and their runtime records, the demo's facts)."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.hypothesis_tiers import examples
from tests.support.topology_strategies import slots, trees
from vmlend.demo.facts import p2p_maps
from vmlend.p2p import GuestBar, peer_device, plan_p2p
from vmlend.topology.model import (
    AdapterSpec,
    BarKind,
    BarSpec,
    DeviceSpec,
    LinkSpec,
    MiB,
    NodeSpec,
    PcieElement,
    PcieKind,
    Topology,
)
from vmlend.topology.pcie import (
    Hop,
    PciePath,
    cpu_to_bar,
    device_to_device,
    device_to_ram,
    device_via_ram,
    explain,
)

#: Devices 0x1 and 0x2 in host a, 0x3 in host b; a and b joined through cluster switch "sw".
PLACES = ((0x1, "a"), (0x2, "a"), (0x3, "b"))


@st.composite
def topologies(draw: st.DrawFn) -> Topology:
    tree = {"a": draw(trees()), "b": draw(trees())}
    nodes = tuple(
        NodeSpec(
            name,
            i + 1,
            name,
            adapters=(AdapterSpec(name, 0, slot=draw(slots(tree[name]))),),
            pcie=tree[name],
            iommu=draw(st.booleans()),
        )
        for i, name in enumerate(("a", "b"))
    )
    devices = tuple(
        DeviceSpec(
            fdid,
            lender,
            f"0000:0{fdid}:00.0",
            "gpu",
            0x10DE,
            0x1DB4,
            0x030200,
            bars=(BarSpec(0, 16 * MiB, BarKind.MEM32),),
            slot=draw(slots(tree[lender])),
        )
        for fdid, lender in PLACES
    )
    return Topology("gen", nodes, (LinkSpec(("a:0", "b:0"), "sw"),), devices)


def with_iommu(topology: Topology, on: bool) -> Topology:
    nodes = tuple(msgspec.structs.replace(n, iommu=on) for n in topology.nodes)
    return msgspec.structs.replace(topology, nodes=nodes)


def every_path(t: Topology) -> list[PciePath]:
    return [
        device_to_device(t, 0x1, 0x2),
        device_to_device(t, 0x2, 0x1),
        device_to_device(t, 0x1, 0x3),
        device_to_device(t, 0x3, 0x2),
        device_to_ram(t, 0x1, "a"),
        device_to_ram(t, 0x1, "b"),
        device_to_ram(t, 0x3, "a"),
        cpu_to_bar(t, "b", 0x2),
        device_via_ram(t, 0x1, 0x3, "a"),
        device_via_ram(t, 0x2, 0x3, "b"),
    ]


@settings(max_examples=examples(150), deadline=None, derandomize=True, database=None)
@given(topologies())
def test_an_iommu_off_never_makes_a_path_longer(topology):
    on, off = with_iommu(topology, True), with_iommu(topology, False)
    for p_on, p, p_off in zip(every_path(on), every_path(topology), every_path(off), strict=True):
        assert p_off.hops <= p.hops <= p_on.hops, (p_off.stages, p.stages, p_on.stages)
        assert p_off.roots <= p.roots <= p_on.roots
        assert p.ntb_crossings == p_on.ntb_crossings  # the IOMMU never changes the crossing
        # the ends are never hops; the rest are, each root complex among them
        ends = [s for s in p.stages if s.kind is Hop.DEVICE]
        assert p.hops == len(p.stages) - len(ends) and p.roots <= p.hops
    # the papers' bare-metal cases: through the root complex with the IOMMU on; off, under
    # a common switch or chassis, turning there without a root
    local_on = device_to_device(on, 0x1, 0x2)
    assert local_on.roots == 1 and local_on.hops >= 1
    local_off = device_to_device(off, 0x1, 0x2)
    above = {e.name: e for e in topology.node("a").pcie}
    common = _common_switch(above, topology.device(0x1).slot, topology.device(0x2).slot)
    assert local_off.roots == (0 if common else 1)
    if common:
        assert local_off.hops < local_on.hops


def _common_switch(elements: dict[str, PcieElement], a: str | None, b: str | None) -> bool:
    def chain(slot: str | None) -> set[str]:
        out: set[str] = set()
        while slot is not None:
            e = elements[slot]
            if e.kind is not PcieKind.ROOT_PORT:
                out.add(e.name)
            slot = e.parent
        return out

    return bool(chain(a) & chain(b))


@settings(max_examples=examples(100), deadline=None, derandomize=True, database=None)
@given(topologies())
def test_a_path_has_one_count_wherever_it_is_shown(topology):
    devices = [
        peer_device(topology.device(fdid), {0: 0x8000_0000 + fdid * 16 * MiB}) for fdid, _ in PLACES
    ]
    bars = [GuestBar(fdid, 0, 0xC000_0000 + fdid * 16 * MiB, 16 * MiB) for fdid, _ in PLACES]
    plan = plan_p2p(topology, "b", devices, bars)
    assert len(plan.maps) == 6 and not plan.skipped
    facts = p2p_maps(list(plan.maps))
    for m, fact in zip(plan.maps, facts, strict=True):
        shown = explain(topology, hex(m.source), hex(m.target)).to_json()
        want = (shown["hops"], shown["roots"])
        assert (m.hops, m.roots) == want
        assert (m.record()["hops"], m.record()["roots"]) == want
        assert (fact["hops"], fact["roots"]) == want
        assert m.ntb_crossings == shown["ntb_crossings"]
