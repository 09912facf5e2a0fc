"""Write a ``Topology`` as a topology file (TOML) that ``parse_topology`` reads back equal.

The registry keeps a topology as the text it was parsed from; a topology vmlend changed itself
(``vmlend fabric discover``) is stored as this text. No I/O here.

SR-IOV VFs are written as their PF's ``sriov`` table, the only way a topology file declares
them; VFs the table cannot express (fdids not consecutive, PCI addresses not the ones that
follow the PF's, fields that differ between VFs) are a ``TopologyError``.
"""

from __future__ import annotations

import json

from vmlend.errors import TopologyError
from vmlend.topology.model import (
    BarSpec,
    DeviceSpec,
    LinkSpec,
    MsiSpec,
    MsixSpec,
    NodeSpec,
    Topology,
    format_fdid,
)

_PINS = {0: "none", 1: "A", 2: "B", 3: "C", 4: "D"}


def _s(text: str) -> str:
    """A TOML basic string: JSON's escapes are TOML's."""
    return json.dumps(text, ensure_ascii=False)


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _bars(bars: tuple[BarSpec, ...]) -> str:
    items = [
        f"{{ index = {b.index}, size = {b.size}, kind = {_s(b.kind.value)}"
        f", prefetch = {_bool(b.prefetch)} }}"
        for b in bars
    ]
    return "[" + ", ".join(items) + "]"


def _msi(m: MsiSpec) -> str:
    return (
        f"{{ vectors = {m.vectors}, bits64 = {_bool(m.bits64)},"
        f" maskable = {_bool(m.maskable)} }}"
    )


def _msix(m: MsixSpec) -> str:
    return (
        f"{{ vectors = {m.vectors}, table_bar = {m.table_bar}, table_offset = {m.table_offset},"
        f" pba_bar = {m.pba_bar}, pba_offset = {m.pba_offset} }}"
    )


def _vf_bdf(pf_bdf: str, i: int) -> str:
    """The address the parser gives VF ``i`` (0-based) of a PF at ``pf_bdf``."""
    bus, rest = pf_bdf.rsplit(":", 1)
    dev_no, fn = int(rest.split(".")[0], 16), i + 1
    return f"{bus}:{dev_no + fn // 8:02x}.{fn % 8}"


def _sriov(pf: DeviceSpec, vfs: list[DeviceSpec], where: str) -> list[str]:
    first = vfs[0]

    def refuse(problem: str) -> TopologyError:
        return TopologyError(where, f"the VFs of {format_fdid(pf.fdid)} {problem}")

    if [vf.fdid for vf in vfs] != list(range(first.fdid, first.fdid + len(vfs))):
        raise refuse("do not have consecutive fdids (a topology file's sriov needs them)")
    for i, vf in enumerate(vfs):
        if vf.bdf != _vf_bdf(pf.bdf, i):
            raise refuse(
                f"are not at the PCI addresses that follow the PF's ({format_fdid(vf.fdid)} is"
                f" at {vf.bdf}, sriov puts it at {_vf_bdf(pf.bdf, i)})"
            )
        same_as_pf = (vf.kind, vf.vendor_id, vf.class_code, vf.intx_pin, vf.lent, vf.slot) == (
            "vf", pf.vendor_id, pf.class_code, 0, pf.lent, pf.slot,
        )  # fmt: skip
        same_as_first = (vf.device_id, vf.bars, vf.dma_bits, vf.msi, vf.msix) == (
            first.device_id, first.bars, first.dma_bits, first.msi, first.msix,
        )  # fmt: skip
        if not (same_as_pf and same_as_first):
            raise refuse(
                "differ from their PF's vendor, class or lending, or from one another"
                " (sriov declares them alike)"
            )
    lines = [
        f"  sriov = {{ vfs = {len(vfs)}, first_fdid = {format_fdid(first.fdid)},"
        f" device = {first.device_id:#06x}, dma_bits = {first.dma_bits}"
        + (f", bars = {_bars(first.bars)}" if first.bars else "")
        + (f", msi = {_msi(first.msi)}" if first.msi else "")
        + (f", msix = {_msix(first.msix)}" if first.msix else "")
        + " }"
    ]
    return lines


def _device(d: DeviceSpec, vfs: list[DeviceSpec], where: str) -> list[str]:
    lines = [
        "",
        "  [[node.device]]",
        f"  fdid = {format_fdid(d.fdid)}",
        f"  bdf = {_s(d.bdf)}",
        f"  kind = {_s(d.kind)}",
        f"  vendor = {d.vendor_id:#06x}",
        f"  device = {d.device_id:#06x}",
        f"  class = {d.class_code:#08x}",
        f"  dma_bits = {d.dma_bits}",
        f"  intx = {_s(_PINS[d.intx_pin])}",
        f"  lent = {_bool(d.lent)}",
    ]
    if d.slot is not None:
        lines.append(f"  slot = {_s(d.slot)}")
    if d.bars:
        lines.append(f"  bars = {_bars(d.bars)}")
    if d.msi is not None:
        lines.append(f"  msi = {_msi(d.msi)}")
    if d.msix is not None:
        lines.append(f"  msix = {_msix(d.msix)}")
    if vfs:
        lines += _sriov(d, vfs, where)
    return lines


def _node(n: NodeSpec, devices: list[DeviceSpec], where: str) -> list[str]:
    lines = [
        "",
        "[[node]]",
        f"name = {_s(n.name)}",
        f"id = {n.node_id}",
        f"hostname = {_s(n.hostname)}",
        f"ram = {n.ram}",
        f"iommu = {_bool(n.iommu)}",
    ]
    for e in n.pcie:
        lines += ["", "  [[node.pcie]]", f"  name = {_s(e.name)}", f"  kind = {_s(e.kind.value)}"]
        if e.parent is not None:
            lines.append(f"  parent = {_s(e.parent)}")
        if e.chip is not None:
            lines.append(f"  chip = {_s(e.chip.value)}")
    for a in n.adapters:
        lines += [
            "",
            "  [[node.adapter]]",
            f"  index = {a.index}",
            f"  model = {_s(a.model)}",
            f"  window = {a.window_size}",
            f"  segments = {a.segments}",
            f"  lut_entries = {a.lut_entries}",
            f"  cpus = {a.cpus}",
        ]
        if a.slot is not None:
            lines.append(f"  slot = {_s(a.slot)}")
    pfs = {d.fdid for d in devices if d.physfn is None}
    vfs: dict[int, list[DeviceSpec]] = {}
    for d in devices:
        if d.physfn is None:
            continue
        if d.physfn not in pfs:
            raise TopologyError(
                where,
                f"device {format_fdid(d.fdid)} is a VF of {format_fdid(d.physfn)}, which is no"
                f" physical function of {n.name}: a topology file cannot declare it",
            )
        vfs.setdefault(d.physfn, []).append(d)
    for d in devices:
        if d.physfn is None:
            lines += _device(d, sorted(vfs.pop(d.fdid, []), key=lambda v: v.fdid), where)
    return lines


def _link(link: LinkSpec) -> list[str]:
    ends = ", ".join(_s(e) for e in link.ends)
    if link.switch is None:
        return ["", "[[link]]", f"ends = [{ends}]"]
    lines = ["", "[[switch]]", f"name = {_s(link.switch)}", f"ports = [{ends}]"]
    if link.chip is not None:
        lines.append(f"chip = {_s(link.chip.value)}")
    if link.requester_entries is not None:
        lines.append(f"requester_entries = {link.requester_entries}")
    return lines


def render_topology(topology: Topology, header: str = "") -> str:
    """``topology`` as a topology file; ``header``: comment lines put first."""
    where = topology.source
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    lines.append(f"name = {_s(topology.name)}")
    for n in topology.nodes:
        lines += _node(n, [d for d in topology.devices if d.lender == n.name], where)
    for link in topology.links:
        lines += _link(link)
    for a, b in topology.switch_links:
        lines += ["", "[[switch_link]]", f"ends = [{_s(a)}, {_s(b)}]"]
    return "\n".join(lines) + "\n"
