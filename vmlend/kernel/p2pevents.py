"""What a child's ``SMARTIO_BARS`` / ``SMARTIO_P2P`` uevent asks of vmlend (docs/smartio-contract.md
section 8, "The guest event"), decided without I/O.

- ``SMARTIO_BARS``: the guest decoded, moved or dropped a BAR. vmlend reads ``guest_bars`` of
  every borrowed child of the VM on this host, plans with ``vmlend.p2p.plan_p2p`` (the
  simulator's planner), checks the plan against the VM's P2P claims and writes each source's
  ``p2p`` (``plan_writes``, ``over_claims``);
- ``SMARTIO_P2P``: the driver removed maps itself (a peer's borrow ended, a reset): vmlend
  reads ``p2p_state`` and updates its ``p2p-map`` records (``state_records``).

``vmlend.kernel.p2psync`` does the reading and writing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from vmlend.kernel.p2pfiles import MapState, P2PLine, lines_for
from vmlend.kernel.udev import Uevent
from vmlend.ledger.admission import p2p_share
from vmlend.p2p import GuestBar, P2PMap, P2PPlan, PeerDevice, peer_device, plan_p2p
from vmlend.registry.records import Claim, ClaimKind
from vmlend.topology.model import GuestRange, Holder, Topology

BARS = "SMARTIO_BARS"
P2P = "SMARTIO_P2P"


class ChildEvent(msgspec.Struct, frozen=True):
    """A child's section 8 event: re-plan (``bars``) and/or re-read its maps (``p2p``)."""

    uuid: str
    bars: bool
    p2p: bool


def child_event(ev: Uevent) -> ChildEvent | None:
    """The peer-to-peer part of an mdev child's uevent; None when it has none."""
    if ev.subsystem != "mdev" or ev.action != "change":
        return None
    bars, p2p = BARS in ev.properties, P2P in ev.properties
    if not (bars or p2p):
        return None
    return ChildEvent(ev.sys_name, bars, p2p)


class Child(msgspec.Struct, frozen=True):
    """A borrowed child of the VM on this host: its device and the hold's token."""

    uuid: str
    fdid: int
    token: int


class P2PWrite(msgspec.Struct, frozen=True):
    """One source's ``p2p`` write."""

    child: Child
    lines: tuple[P2PLine, ...]


def peer_devices(topology: Topology, children: Sequence[Child]) -> list[PeerDevice]:
    """The VM's devices for the planner. The lender's BAR addresses are the driver's, not
    known here: the maps' ``target_phys`` is 0 (records say None)."""
    out = []
    for c in children:
        spec = topology.device(c.fdid)
        out.append(peer_device(spec, {b.index: 0 for b in spec.bars}))
    return out


def plan_writes(
    topology: Topology,
    borrower: str,
    children: Sequence[Child],
    bars: Sequence[GuestBar],
    ram: Sequence[GuestRange] = (),
) -> tuple[P2PPlan, list[P2PWrite]]:
    """The plan over the guest's decoded ``bars`` and every child's ``p2p`` write (a child
    with no map gets the token line alone: its maps go). ``plan_p2p``'s errors propagate."""
    plan = plan_p2p(topology, borrower, peer_devices(topology, children), bars, ram)
    writes = [P2PWrite(c, lines_for(plan.from_source(c.fdid))) for c in children]
    return plan, writes


def chunks(gpa: int, size: int, segment: int) -> int:
    """Segments a map of [gpa, gpa + size) takes: one per segment-sized chunk it touches."""
    return (gpa + size - 1) // segment - gpa // segment + 1


def over_claims(
    topology: Topology, holder: Holder, maps: Sequence[P2PMap], claims: Sequence[Claim]
) -> list[str]:
    """Each map across an NTB that needs more segments of its source lender's adapter than
    admission claimed for its target BAR (``p2p_claims``), one line each; empty: it fits."""
    claimed: dict[tuple[str, str], int] = {}
    for c in claims:
        if c.kind is ClaimKind.P2P:
            key = (c.adapter, c.share)
            claimed[key] = max(claimed.get(key, 0), c.segments)
    out = []
    for m in maps:
        if m.path is None:
            continue
        adapter = topology.adapter(m.path.src.ref)
        if adapter is None:
            continue
        need = chunks(m.iova, m.size, adapter.segment_size)
        have = claimed.get((adapter.ref, p2p_share(holder, m.target, m.bar)), 0)
        if need > have:
            out.append(
                f"device {m.source:#x} reaching BAR {m.bar} of {m.target:#x} at"
                f" {m.iova:#x}+{m.size:#x} needs {need} segment(s) of {adapter.ref},"
                f" admission claimed {have}"
            )
    return out


def map_record(m: P2PMap, state: MapState | None) -> dict[str, Any]:
    """A ``p2p-map`` record: ``P2PMap.record`` with the driver's segments."""
    data = m.record()
    data["target_phys"] = None  # the driver's to know on a real host
    data["segments"] = list(state.segments) if state and state.segments is not None else None
    return data


def state_records(
    source: int, state: Sequence[MapState], kept: Mapping[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """The ``p2p-map`` records of ``source`` after the driver reports ``state``: those ``kept``
    (the planned maps' records, or the ones already recorded) for maps still in place, with
    the driver's segments; a map vmlend has no record of gets the driver's words alone."""
    out: dict[str, dict[str, Any]] = {}
    for s in state:
        key = s.line.key
        base = kept.get(key)
        if base is not None and (base.get("iova"), base.get("size")) == (s.line.gpa, s.line.size):
            data = dict(base)
        else:
            data = {
                "source": source,
                "target": s.line.target,
                "bar": s.line.bar,
                "iova": s.line.gpa,
                "size": s.line.size,
                "case": s.case,
                "adapter": None,
            }
        data["segments"] = list(s.segments) if s.segments is not None else None
        out[key] = data
    return out
