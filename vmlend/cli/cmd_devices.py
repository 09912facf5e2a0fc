"""``vmlend devices``: every device of the fabric with its state and holder."""

from __future__ import annotations

from typing import Any

import click

from vmlend.cli.common import emit_json, emit_table, json_option
from vmlend.cli.context import CliContext
from vmlend.errors import ConfigError
from vmlend.ledger.admission import format_size_short
from vmlend.topology.model import BarKind, DeviceSpec, DeviceState, DeviceStatus, format_fdid

HEADERS = ("FDID", "LENDER", "BDF", "KIND", "BARS", "DMA", "STATE", "HOLDER")


def bars_summary(spec: DeviceSpec) -> str:
    """BAR sizes in index order, e.g. ``16M,32G,32M``; I/O BARs as ``io:256``."""
    parts = [
        f"io:{format_size_short(b.size)}" if b.kind is BarKind.IO else format_size_short(b.size)
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


@click.command("devices")
@click.option("--lender", help="Only devices lent by this node.")
@click.option("--kind", help="Only devices of this kind (gpu, nvme, nic, vf, ...).")
@click.option("--available", is_flag=True, help="Only devices nobody holds that can be taken.")
@json_option
@click.pass_obj
def devices(
    obj: CliContext, lender: str | None, kind: str | None, available: bool, json_output: bool
) -> None:
    """List the devices of the fabric: lender, PCI address, BARs, state and holder."""
    fabric = obj.fabric()
    if lender is not None:
        fabric.topology().node(lender)  # an unknown node is an error, not an empty list
    every = fabric.devices()
    kinds = sorted({st.spec.kind for st in every})
    if kind is not None and kind not in kinds:
        # Like an unknown --lender: a typo should not look like an empty fabric.
        known = ", ".join(kinds) or "none"
        raise ConfigError(f"no device of kind {kind!r} in the fabric; its kinds: {known}")
    rows = [
        st
        for st in every
        if (lender is None or st.spec.lender == lender)
        and (kind is None or st.spec.kind == kind)
        and (not available or st.state is DeviceState.AVAILABLE)
    ]
    if json_output:
        emit_json([device_json(st) for st in rows])
    else:
        emit_table(HEADERS, [device_row(st) for st in rows])
    # The kernel backend lists a device it cannot read as unavailable; say why, one line each.
    for problem in getattr(fabric, "unreadable", ()):
        click.echo(f"vmlend: warning: device left unavailable: {problem}", err=True)


COMMANDS = [devices]
