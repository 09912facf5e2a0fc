"""Hypothesis strategies for generated topologies: hosts' PCIe trees (root ports, in-host
switches, expansion chassis) and fabrics of several lenders built from them, where the costs of
a device's path into a VM's RAM (latency, hops, root complexes) vary from device to device
and disagree with one another as they do on real clusters: a device of the VM's own host deep in
chained chassis has many hops, one root complex and no NTB crossing; a remote one on a root port
fewer hops, two root complexes and one crossing. The switches' chips (``None``: the default)
are drawn too, so a way through more but faster chips can cost less latency."""

from __future__ import annotations

from hypothesis import strategies as st

from vmlend.topology.chips import Chip
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


@st.composite
def trees(draw: st.DrawFn, deep: bool = False) -> tuple[PcieElement, ...]:
    """A host's PCIe tree: root ports, switches and chassis, each below one declared before
    (``deep``: first a chain of up to three switches and chassis below the first root port,
    each below the one before)."""
    out = [PcieElement("e0", PcieKind.ROOT_PORT)]
    if deep:
        for _ in range(draw(st.integers(0, 3))):
            kind = draw(st.sampled_from([PcieKind.SWITCH, PcieKind.CHASSIS]))
            out.append(PcieElement(f"e{len(out)}", kind, out[-1].name, draw(chips())))
    for _ in range(draw(st.integers(0, 6 if not deep else 3))):
        kind = draw(st.sampled_from(list(PcieKind)))
        parent = chip = None
        if kind is not PcieKind.ROOT_PORT:
            parent = draw(st.sampled_from([e.name for e in out]))
            chip = draw(chips())
        out.append(PcieElement(f"e{len(out)}", kind, parent, chip))
    return tuple(out)


def chips() -> st.SearchStrategy[Chip | None]:
    """A switching element's chip as a topology gives it: any known one, or none said."""
    return st.sampled_from([None, *Chip])


def slots(tree: tuple[PcieElement, ...]) -> st.SearchStrategy[str | None]:
    """Where an endpoint of a host with ``tree`` may sit: below one of its elements, or on a
    root port of its own (None)."""
    return st.sampled_from([None, *(e.name for e in tree)])


def plain_device(fdid: int, lender: str, kind: str, slot: str | None) -> DeviceSpec:
    """A device of ``kind`` with one 16 MiB BAR (what the path counts need of it)."""
    return DeviceSpec(
        fdid,
        lender,
        f"0000:{fdid:02x}:00.0",
        kind,
        0x10DE,
        0x1DB4,
        0x030200,
        bars=(BarSpec(0, 16 * MiB, BarKind.MEM32),),
        slot=slot,
    )


@st.composite
def lender_fabrics(draw: st.DrawFn, kinds: tuple[str, ...] = ("gpu", "nic")) -> Topology:
    """Nodes ``n0``, ``n1``, ... (two to four), each with its own PCIe tree, IOMMU on or off
    and one NTB adapter somewhere in it, all on cluster switch ``sw`` (of any chip); two to
    eight devices of ``kinds`` (fdid 0x1, 0x2, ...) spread over them, each somewhere in its
    lender's tree (``trees(deep=True)``: chained switches and chassis are common)."""
    names = [f"n{i}" for i in range(draw(st.integers(2, 4)))]
    tree = {name: draw(trees(deep=True)) for name in names}
    nodes = tuple(
        NodeSpec(
            name,
            i + 1,
            name,
            adapters=(AdapterSpec(name, 0, slot=draw(slots(tree[name]))),),
            pcie=tree[name],
            iommu=draw(st.booleans()),
        )
        for i, name in enumerate(names)
    )
    devices = []
    for fdid in range(1, draw(st.integers(2, 8)) + 1):
        lender = draw(st.sampled_from(names))
        kind = draw(st.sampled_from(kinds))
        devices.append(plain_device(fdid, lender, kind, draw(slots(tree[lender]))))
    link = LinkSpec(tuple(f"{name}:0" for name in names), "sw", draw(chips()))
    return Topology("generated", nodes, (link,), tuple(devices))
