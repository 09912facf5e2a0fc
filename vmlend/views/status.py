"""Per VM its remote devices and NVMe shares, per NTB adapter and per switch port in use
its use, as text (``vmlend status``, the demo)."""

from __future__ import annotations

import time
from typing import Any

from vmlend.kernel.dmafiles import DmaReport, window_lines
from vmlend.ledger.linkfaults import LINK_FAULT
from vmlend.lending.shares import BLOCK
from vmlend.memory.dmarecords import DMA_WINDOW
from vmlend.ops.live_state import LiveRecord
from vmlend.ops.status import RUNTIME_KINDS, DeviceView, VmView
from vmlend.registry.records import RuntimeRecord
from vmlend.topology.model import format_fdid
from vmlend.topology.pcie import PciePath
from vmlend.units import format_size_exact
from vmlend.views.table import render_table


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


#: The runtime kinds after the DMA column, which ``_dma_cell`` fills.
OTHER_KINDS = [k for k in RUNTIME_KINDS if k != DMA_WINDOW]


def _dma_cell(d: DeviceView) -> str:
    """The device's mapped windows, or the driver's refusal when none is mapped."""
    cell = _runtime_cell(d.runtime.get(DMA_WINDOW, []))
    refusal = d.dma_refusal
    if cell == "-" and refusal is not None:
        return f"refused {refusal.data.get('error', '?')}"
    return cell


def _driver_dma_cells(report: DmaReport) -> list[str]:
    """The windows the driver has for a child (``token N: low 0x0-0x80000000; high ...``)
    and its state's one line."""
    if report.damaged:
        return [f"damaged: {report.damaged}", "-"]
    written = report.written
    if written is None:
        cell = "none written"
    else:
        cell = f"token {written.token}: " + ("; ".join(window_lines(written.windows)) or "none")
    return [cell, "-" if report.state is None else report.state.summary()]


def path_cell(path: PciePath | None) -> str:
    """Hops, root complexes and the path's one-way latency, e.g. ``11h/2rc/934ns``."""
    if path is None:
        return "-"
    return f"{path.hops}h/{path.roots}rc/{path.latency_ns}ns"


#: Switch ports shown in the text, fullest first: a 1,024-node fabric has thousands in use,
#: and the fullest are the ones that refuse next (``--json`` lists them all).
PORT_ROWS = 8


def render_ports(ports: list[dict[str, Any]], limit: int = PORT_ROWS) -> str:
    """The fullest ``limit`` switch ports in use (requester entries used / table size), and
    how many more are in use; "" when none is (a fabric of back-to-back cables)."""
    if not ports:
        return ""
    fullest = sorted(ports, key=lambda p: (p["capacity"] - p["used"], -p["used"], p["port"]))
    rows = [[p["port"], f"{p['used']}/{p['capacity']}"] for p in fullest[:limit]]
    text = render_table(("SWITCH PORT", "REQUESTERS USED"), rows)
    more = len(ports) - len(rows)
    if more > 0:
        text += f"\n({more} more switch port(s) in use, less full; --json lists every one)"
    return text


def render_status(
    vms: list[VmView],
    usage: list[dict[str, Any]],
    empty: str = "no VMs with remote devices",
    ports: list[dict[str, Any]] | None = None,
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
                    _dma_cell(d),
                    *(_runtime_cell(d.runtime.get(k, [])) for k in OTHER_KINDS),
                    path_cell(d.path),
                ]
            )
    parts = [render_table(headers, rows) if rows else empty]
    f_rows = [
        [v.name, v.node, format_fdid(d.fdid), str(r.data.get("link", r.key)),
         str(r.data.get("state", "")), str(r.data.get("path", "")) or "-",
         str(r.data.get("detail", "")) or "-"]
        for v in vms
        for d in v.devices
        for r in d.runtime.get(LINK_FAULT, [])
    ]  # fmt: skip
    if f_rows:
        f_headers = ("VM", "NODE", "FDID", "LINK FAULT", "STATE", "ROUTE NOW", "DETAIL")
        parts.append(render_table(f_headers, f_rows))
    w_rows = [
        [v.name, format_fdid(d.fdid), d.mdev or "-", *_driver_dma_cells(d.driver_dma)]
        for v in vms
        for d in v.devices
        if d.driver_dma is not None
    ]
    if w_rows:
        w_headers = ("VM", "FDID", "MDEV", "DRIVER'S DMA WINDOWS", "DMA STATE")
        parts.append(render_table(w_headers, w_rows))
    s_rows = [
        [
            v.name,
            v.node,
            format_fdid(e.fdid),
            str(e.share.queue_pairs),
            f"{e.share.lba_offset}+{e.share.blocks} ({format_size_exact(e.share.blocks * BLOCK)})",
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
            f"{format_size_exact(u['window_used']) if u['window_used'] else 0}"
            f"/{format_size_exact(u['window_size'])}",
            f"{u['segments_used']}/{u['segments']}",
        ]
        for u in usage
    ]
    parts.append(render_table(("ADAPTER", "LUT USED", "WINDOW USED", "SEGMENTS"), a_rows))
    if port_text := render_ports(ports or []):
        parts.append(port_text)
    migrations = [_migration_line(v.name, m) for v in vms for m in v.live_migrations]
    if migrations:
        parts.append("\n".join(["live migrations:", *migrations]))
    return "\n\n".join(parts)


def _ms(seconds: float | None) -> str:
    return "not measured" if seconds is None else f"{seconds * 1000:.1f} ms"


def _migration_line(vm: str, m: LiveRecord) -> str:
    """``vm1  gamma -> beta  2026-11-25 16:14:28  downtime 2.9 ms, 0x10 blackout 41.0 ms``."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.finished))
    how = {f: f" ({m.device_mode(f)})" if m.mode == "mixed" else "" for f in m.blackout}
    each = [f"{format_fdid(f)}{how[f]} blackout {_ms(s)}" for f, s in sorted(m.blackout.items())]
    resumed = " (resumed)" if m.resumed else ""
    hot = f" {m.mode}" if m.mode in ("hot", "mixed") else ""
    return f"  {vm}  {m.source} -> {m.destination}{hot}  {when}{resumed}  " + ", ".join(
        [f"downtime {_ms(m.downtime)}", *each]
    )
