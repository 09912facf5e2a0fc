"""Read what the demo shows from the shared state and the simulated hardware, as JSON-able
dicts: device states, adapter accounting, DMA windows, peer-to-peer maps, DMA hops, and what is
left held at the end. Reading only; the steps decide what to check."""

from __future__ import annotations

from typing import Any

from vmlend.memory.dmarecords import DMA_WINDOW
from vmlend.p2p import P2PMap
from vmlend.registry import Registry
from vmlend.sim.backend import SimFabric
from vmlend.sim.hardware import SimHardware
from vmlend.sim.resolver import DmaTarget, Hop
from vmlend.topology.model import format_fdid

Json = dict[str, Any]


def device_states(fabric: SimFabric, registry: Registry, fdids: list[int]) -> list[Json]:
    with registry.read() as tx:  # every node's mdevs (SimFabric.mdevs lists its own node's)
        mdevs = {m.fdid: m for m in tx.mdevs()}
    out = []
    for fdid in fdids:
        st = fabric.device(fdid)
        m = mdevs.get(fdid)
        out.append(
            {
                "fdid": format_fdid(fdid),
                "lender": st.spec.lender,
                "kind": st.spec.kind,
                "state": st.state.value,
                "holder": str(st.holder) if st.holder else None,
                "mdev": m.uuid if m else None,
                "mdev_node": m.node if m else None,
                "parent": m.parent if m else None,
            }
        )
    return out


def adapter_use(fabric: SimFabric, hw: SimHardware) -> list[Json]:
    """Per adapter: what the holds claim (registry) and what the hardware has set up."""
    use = fabric.usage()
    out = []
    for adapter in hw.adapters():
        u = use[adapter.ref]
        out.append(
            {
                "adapter": adapter.ref,
                "lut_claimed": u.lut_used,
                "lut_usable": u.adapter.lut_usable,
                "segments_claimed": u.segments_used,
                "segments": u.adapter.segments,
                "segment_size": u.adapter.segment_size,
                "lut_entries": adapter.lut_used,
                "segments_mapped": len(adapter.mapped_segments()),
            }
        )
    return out


def runtime(registry: Registry, kind: str) -> list[Json]:
    with registry.read() as tx:
        records = tx.runtime(kind=kind)
    return [{"fdid": format_fdid(r.fdid), "key": r.key} | r.data for r in records]


def windows(registry: Registry) -> list[Json]:
    """The DMA windows in place, one per device and window, by device then address."""
    return sorted(runtime(registry, DMA_WINDOW), key=lambda w: (int(w["fdid"], 16), w["gpa_start"]))


def p2p_maps(maps: list[P2PMap]) -> list[Json]:
    return [
        {
            "source": format_fdid(m.source),
            "target": format_fdid(m.target),
            "bar": m.bar,
            "iova": m.iova,
            "size": m.size,
            "case": m.case,
            "source_node": m.source_node,
            "target_node": m.target_node,
            "hops": m.hops,
            "roots": m.roots,
            "ntb_crossings": m.ntb_crossings,
            "route": list(m.route),
        }
        for m in maps
    ]


def hop_json(h: Hop) -> Json:
    return {"stage": h.stage, "node": h.node, "address": h.address, "detail": h.detail}


def target_json(t: DmaTarget) -> Json:
    return {
        "node": t.node,
        "kind": t.kind,
        "address": t.address,
        "owner": format_fdid(t.owner) if isinstance(t.owner, int) else t.owner,
        "bar": t.bar,
        "offset": t.offset,
        "crossed_ntb": t.crossed_ntb,
        "hops": [hop_json(h) for h in t.hops],
    }


def leftovers(fabric: SimFabric, registry: Registry, hw: SimHardware, vm: str) -> Json:
    """What is still in use anywhere, for the end of the story (all should be zero)."""
    with registry.read() as tx:
        holds = [h for h in tx.holds().values() if h.holder.vm == vm]
        mdevs = [m for m in tx.mdevs() if m.vm == vm]
        claims = tx.claims()
        records = tx.runtime()
    return {
        "holds": len(holds),
        "mdevs": len(mdevs),
        "lut_claimed": sum(u.lut_used for u in fabric.usage().values()),
        "segments_claimed": sum(u.segments_used for u in fabric.usage().values()),
        "claims": len(claims),
        "runtime_records": len(records),
        "lut_entries": sum(a.lut_used for a in hw.adapters()),
        "segments_mapped": sum(len(a.mapped_segments()) for a in hw.adapters()),
        "borrows": len(hw.borrows()),
        "guests": len(hw.guests()),
        "lender_iommu_bytes": sum(hw.lender_domain(d.fdid).mapped_bytes for d in hw.devices()),
    }
