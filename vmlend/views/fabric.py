"""The fabric (nodes, adapters with their use, links) as text and as JSON (``vmlend fabric
show``, the demo)."""

from __future__ import annotations

from typing import Any

from vmlend.fabric.base import Fabric
from vmlend.ledger.admission import AdapterUsage
from vmlend.ledger.ledger import Ledger
from vmlend.units import format_size_exact, format_size_human
from vmlend.views.table import render_table


def node_states(f: Fabric) -> dict[str, tuple[bool, str]]:
    """Up/down per node where the fabric keeps it: the ledger (the simulated fabric) does."""
    if isinstance(f, Ledger):
        return {name: (rec.up, rec.why) for name, rec in f.node_states().items()}
    return {}


def _adapter_json(u: AdapterUsage) -> dict[str, Any]:
    a = u.adapter
    return {
        "ref": a.ref,
        "model": a.model,
        "lut_entries": a.lut_entries,
        "lut_usable": a.lut_usable,
        "lut_used": u.lut_used,
        "window_size": a.window_size,
        "window_used": u.window_used,
        "segments": a.segments,
        "segment_size": a.segment_size,
        "segments_used": u.segments_used,
    }


def fabric_json(f: Fabric) -> dict[str, Any]:
    topo = f.topology()
    use = f.usage()
    states = node_states(f)
    down = _links_down(f)
    return {
        "name": topo.name,
        "source": topo.source,
        "local_node": f.local_node,
        "nodes": [
            {
                "name": n.name,
                "id": n.node_id,
                "hostname": n.hostname,
                "ram": n.ram,
                "up": states.get(n.name, (True, ""))[0],
                "down_reason": states.get(n.name, (True, ""))[1],
                "devices": [f"{d.fdid:#x}" for d in topo.devices if d.lender == n.name],
                "adapters": [_adapter_json(use[a.ref]) for a in n.adapters],
            }
            for n in topo.nodes
        ],
        "links": [{"ends": list(link.ends), "switch": link.switch} for link in topo.links],
        "switch_links": [list(pair) for pair in topo.switch_links],
        "cables": [{"name": n, "up": n not in down} for n in topo.link_names()],
    }


def _links_down(f: Fabric) -> set[str]:
    """The cables the simulated fabric marks down (none for another backend)."""
    read = getattr(f, "links_down", None)
    return set(read()) if callable(read) else set()


def render_fabric(f: Fabric) -> str:
    """The fabric as text: nodes, adapters with their use, links."""
    topo = f.topology()
    use = f.usage()
    states = node_states(f)
    node_rows = []
    for n in topo.nodes:
        up, why = states.get(n.name, (True, ""))
        lent = sum(1 for d in topo.devices if d.lender == n.name)
        here = " (this host)" if n.name == f.local_node else ""
        node_rows.append(
            [
                n.name + here,
                n.node_id,
                n.hostname,
                format_size_human(n.ram),
                lent,
                "up" if up else f"DOWN{': ' + why if why else ''}",
            ]
        )
    adapter_rows = []
    for a in topo.adapters():
        u = use[a.ref]
        adapter_rows.append(
            [
                a.ref,
                a.model,
                f"{u.lut_used}/{a.lut_usable}",
                f"{format_size_exact(u.window_used) if u.window_used else 0}"
                f"/{format_size_exact(a.window_size)}",
                f"{u.segments_used}/{a.segments} x {format_size_exact(a.segment_size)}",
            ]
        )
    links = [
        f"switch {link.switch}: {', '.join(link.ends)}"
        if link.switch
        else f"cable: {' <-> '.join(link.ends)}"
        for link in topo.links
    ]
    links += [f"switch link: {a} <-> {b}" for a, b in topo.switch_links]
    down = _links_down(f)
    links.append(
        "cables down: " + ", ".join(n for n in topo.link_names() if n in down)
        if down
        else f"cables: {', '.join(topo.link_names())} (all up)"
    )
    return "\n\n".join(
        [
            f"fabric {topo.name!r} from {topo.source}",
            render_table(("NODE", "ID", "HOSTNAME", "RAM", "DEVICES", "STATE"), node_rows),
            render_table(
                ("ADAPTER", "MODEL", "LUT USED/USABLE", "WINDOW USED/SIZE", "SEGMENTS"),
                adapter_rows,
            ),
            "\n".join(["LINKS", *(f"  {line}" for line in links)] if links else ["LINKS  none"]),
        ]
    )
