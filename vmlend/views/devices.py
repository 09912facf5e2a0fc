"""A fabric device as a table row and as JSON (``vmlend devices``, ``vmlend lend``, the demo)."""

from __future__ import annotations

from typing import Any

from vmlend.topology.model import BarKind, DeviceSpec, DeviceStatus, format_fdid
from vmlend.units import format_size_exact

HEADERS = ("FDID", "LENDER", "BDF", "KIND", "BARS", "DMA", "STATE", "HOLDER")


def bars_summary(spec: DeviceSpec) -> str:
    """BAR sizes in index order, e.g. ``16M,32G,32M``; I/O BARs as ``io:256``."""
    parts = [
        f"io:{format_size_exact(b.size)}" if b.kind is BarKind.IO else format_size_exact(b.size)
        for b in spec.bars
    ]
    return ",".join(parts) or "-"


def device_row(st: DeviceStatus) -> list[str]:
    s = st.spec
    return [
        format_fdid(s.fdid),
        s.lender,
        s.bdf,
        s.kind if s.physfn is None else f"vf of {format_fdid(s.physfn)}",
        bars_summary(s),
        f"{s.dma_bits}-bit",
        st.state.value,
        str(st.holder) if st.holder else "-",
    ]


def device_json(st: DeviceStatus) -> dict[str, Any]:
    s = st.spec
    return {
        "fdid": format_fdid(s.fdid),
        "lender": s.lender,
        "bdf": s.bdf,
        "kind": s.kind,
        "vendor": f"{s.vendor_id:#06x}",
        "device": f"{s.device_id:#06x}",
        "class": f"{s.class_code:#08x}",
        "physfn": format_fdid(s.physfn) if s.physfn is not None else None,
        "bars": [
            {"index": b.index, "size": b.size, "kind": b.kind.value, "prefetch": b.prefetch}
            for b in s.bars
        ],
        "dma_bits": s.dma_bits,
        "state": st.state.value,
        "holder": (
            {"node": st.holder.node, "vm": st.holder.vm, "vm_uuid": st.holder.vm_uuid}
            if st.holder
            else None
        ),
    }
