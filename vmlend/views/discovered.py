"""What ``vmlend fabric discover`` found on this host, as lines and as JSON."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vmlend.topology.discovered import FoundAdapter, FoundHost
from vmlend.topology.merge import Change
from vmlend.topology.model import format_fdid


def _size(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def _approx(n: int) -> str:
    """A host's RAM: in whole GiB when it is, else to one decimal."""
    return _size(n) if n % (1 << 30) == 0 else f"{n / (1 << 30):.1f}GiB"


def _cable(a: FoundAdapter) -> str:
    if not a.link_up:
        return "no link"
    if a.peer is not None:
        return f"cable to node id {a.peer[0]} adapter {a.peer[1]}"
    if a.switch_port is not None:
        return f"cable to port {a.switch_port} of a cluster switch"
    return "link up, peer not named"


def found_lines(host: FoundHost, node: str) -> list[str]:
    """One line for the host, one per adapter and per device of the host."""
    n, a = len(host.devices), len(host.adapters)
    ram = f", RAM {_approx(host.ram)}" if host.ram else ""
    out = [
        f"found: node id {host.node_id} ({node}), hostname {host.hostname}{ram};"
        f" {a} adapter{'s' if a != 1 else ''}, {n} device{'s' if n != 1 else ''} installed here,"
        f" {host.remote_devices} of other nodes (each host describes its own)"
    ]
    for ad in host.adapters:
        out.append(
            f"  adapter {ad.index}: {ad.model}, window {_size(ad.window_size)} in"
            f" {ad.segments} segments, {ad.lut_entries} LUT entries; {_cable(ad)}"
        )
    for d in host.devices:
        vf = f", VF of {format_fdid(d.physfn)}" if d.physfn is not None else ""
        out.append(
            f"  device {format_fdid(d.fdid)}: {d.kind} {d.bdf} {d.vendor_id:04x}:{d.device_id:04x}"
            f" on adapter {d.adapter}{vf}{'' if d.lent else ', unlent'}"
        )
    return out


def discover_json(host: FoundHost) -> dict[str, Any]:
    return {
        "node_id": host.node_id,
        "hostname": host.hostname,
        "ram": host.ram,
        "adapters": [
            {
                "index": a.index,
                "model": a.model,
                "window_size": a.window_size,
                "segments": a.segments,
                "lut_entries": a.lut_entries,
                "link": "up" if a.link_up else "down",
                "peer": None if a.peer is None else {"node_id": a.peer[0], "adapter": a.peer[1]},
                "switch_port": a.switch_port,
            }
            for a in host.adapters
        ],
        "devices": [
            {
                "fdid": format_fdid(d.fdid),
                "adapter": d.adapter,
                "bdf": d.bdf,
                "kind": d.kind,
                "vendor": f"{d.vendor_id:#06x}",
                "device": f"{d.device_id:#06x}",
                "class": f"{d.class_code:#08x}",
                "dma_bits": d.dma_bits,
                "physfn": None if d.physfn is None else format_fdid(d.physfn),
                "lent": d.lent,
            }
            for d in host.devices
        ],
        "remote_devices": host.remote_devices,
        "damaged": list(host.damaged),
    }


def changes_json(changes: Iterable[Change]) -> list[dict[str, str]]:
    return [
        {"what": c.what, "subject": c.subject, "action": c.action, "detail": c.detail}
        for c in changes
    ]
