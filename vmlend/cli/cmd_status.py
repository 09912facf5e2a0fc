"""``vmlend status [VM]``: per VM its remote devices and what the data path set up for them,
with each device's PCIe path into the VM's RAM (``vmlend path`` explains it stage by stage);
each VM's queue-level NVMe shares (queue pairs, LBA window, real queue ids, doorbell mode,
guard rejections); per NTB adapter the LUT entries and window room in use. The collection is in
``vmlend.ops.status``; this module renders it.
"""

from __future__ import annotations

from typing import Any

import click

from vmlend.cli.common import emit_json, json_option, render_table
from vmlend.cli.connect import connect_option, fabric_for, open_hv
from vmlend.cli.context import CliContext
from vmlend.ledger.admission import format_size_short
from vmlend.lending.shares import BLOCK
from vmlend.ops.reconcile import find_drift, look
from vmlend.ops.status import RUNTIME_KINDS, VmView, collect, read_runtime, usage_rows
from vmlend.registry.records import RuntimeRecord
from vmlend.topology.model import format_fdid
from vmlend.topology.pcie import PciePath


def _runtime_cell(records: list[RuntimeRecord]) -> str:
    if not records:
        return "-"
    if len(records) > 3:
        return f"{len(records)}"
    parts = []
    for r in records:
        start, end = r.data.get("start"), r.data.get("end")
        if isinstance(start, int) and isinstance(end, int):
            parts.append(f"{r.key}:{start:#x}-{end:#x}")
        else:
            parts.append(r.key)
    return ",".join(parts)


def path_cell(path: PciePath | None) -> str:
    """Hops, root complexes and the NTB's added latency, e.g. ``11h/2rc/+360ns``."""
    if path is None:
        return "-"
    return f"{path.hops}h/{path.roots}rc/+{path.added_ns}ns"


def render_status(
    vms: list[VmView], usage: list[dict[str, Any]], empty: str = "no VMs with remote devices"
) -> str:
    headers = (
        "VM",
        "NODE",
        "VM STATE",
        "FDID",
        "STATE",
        "MDEV",
        "INTERRUPTS",
        "DMA",
        "VECTORS",
        "P2P",
        "PATH",
    )
    rows = []
    for v in vms:
        if not v.devices:
            rows.append([v.name, v.node, v.state, "-", "-", "-", "-", "-", "-", "-", "-"])
        for d in v.devices:
            mdev = d.mdev or "-"
            if d.mdev and not d.mdev_present:
                mdev += " (absent)"
            rows.append(
                [
                    v.name,
                    v.node,
                    v.state,
                    format_fdid(d.fdid),
                    d.state,
                    mdev,
                    d.interrupts,
                    *(_runtime_cell(d.runtime.get(k, [])) for k in RUNTIME_KINDS),
                    path_cell(d.path),
                ]
            )
    parts = [render_table(headers, rows) if rows else empty]
    s_rows = [
        [
            v.name,
            v.node,
            format_fdid(e.fdid),
            str(e.share.queue_pairs),
            f"{e.share.lba_offset}+{e.share.blocks} ({format_size_short(e.share.blocks * BLOCK)})",
            ",".join(map(str, e.real_queues)) or "-",
            e.share.mode,
            str(e.rejections),
        ]
        for v in vms
        for e in v.shares
    ]
    if s_rows:
        s_headers = (
            "VM",
            "NODE",
            "NVME",
            "QUEUE PAIRS",
            "LBA WINDOW",
            "REAL QIDS",
            "DOORBELLS",
            "REJECTED",
        )
        parts.append(render_table(s_headers, s_rows))
    a_rows = [
        [
            u["adapter"],
            f"{u['lut_used']}/{u['lut_usable']}",
            f"{format_size_short(u['window_used']) if u['window_used'] else 0}"
            f"/{format_size_short(u['window_size'])}",
            f"{u['segments_used']}/{u['segments']}",
        ]
        for u in usage
    ]
    parts.append(render_table(("ADAPTER", "LUT USED", "WINDOW USED", "SEGMENTS"), a_rows))
    return "\n\n".join(parts)


@click.command("status")
@click.argument("vm", required=False)
@connect_option
@json_option
@click.pass_obj
def status_cmd(obj: CliContext, vm: str | None, uri: str | None, json_output: bool) -> None:
    """Per VM its remote devices (state, holder, mdev, DMA windows, vectors, P2P maps) and
    NVMe shares (queue pairs, LBA window, real queues, guard rejections); per NTB adapter the
    LUT entries and window in use."""
    hv = open_hv(obj, uri)
    try:
        fabric = fabric_for(obj, hv)
        vms = collect(hv, fabric, read_runtime(obj.location), vm)
        usage = usage_rows(fabric.usage())
        drift = find_drift(look(hv, fabric))
    finally:
        hv.close()
    if json_output:
        emit_json(
            {
                "node": fabric.local_node,
                "vms": [v.to_json() for v in vms],
                "adapters": usage,
                "drift": [d.to_json() for d in drift],
            }
        )
    else:
        empty = "no VMs with remote devices"
        if vm is not None:
            empty = f"VM {vm!r} has no remote devices; 'vmlend attach' adds one"
        click.echo(render_status(vms, usage, empty))
        if drift:
            kinds = ", ".join(sorted({d.kind.value for d in drift}))
            click.echo(
                f"\nDRIFT: {len(drift)} disagreement(s) between VMs, state and mdevs ({kinds});"
                " 'vmlend reconcile' explains them, 'vmlend reconcile --fix' repairs them"
            )


COMMANDS = [status_cmd]
