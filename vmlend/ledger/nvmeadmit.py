"""Admission of a VM's NVMe share against the fabric's adapters (pure): what the share's
DMA path uses, claimed at reserve like a borrowed device's (``vmlend.ledger.admission``).

A share's DMA crosses from the drive's lender to the VM's node (docs/nvme-sharing.md):
- one requester LUT entry for the drive on the lender's adapter, shared by every share
  through it, and one on the borrower's adapter, shared by the shares of that node (both
  under the drive's ``requester_share`` key, so ``usage`` counts each once, as it counts the
  entry once with a borrow of another function of the drive's device through the adapter);
- one requester entry for the drive on every cluster switch port the crossing passes, under
  the same key (the share's DMA carries the drive's requester id through the switches as a
  borrow's does: one entry per port serves every share, and a borrow of another function of
  the drive's device, through it);
- the share's DMA windows in the lender's NTB window: the planner's own segment count for the
  VM's RAM layout (``window_segments``), under a key of its own (``share_window_key``): the
  share's windows live in its address space, apart from any windows of the VM's borrowed
  devices, so they take segments of their own.
A VM on the lender crosses no NTB and claims nothing.

A share with a backup path (``paths=2``) claims a second set: the cheapest route from the
lender to another adapter of the VM's host (``backup_route``), its LUT entries on both ends
and on the switch ports it passes (the same ``requester_share`` key: one entry per adapter or
port serves every share through it) and its
own DMA windows in its lender adapter's window (key ``share_window_key(...) + "#backup"``).
Its queue pairs live in memory the VM's virtual controller keeps on the VM's host (the relay
rings, docs/nvme-sharing.md), reached through one more segment on each path
(``RING_SEGMENTS``). Both sets are checked and claimed together, or nothing is.

A share's completion interrupts cross the NTB as MSI, as a borrowed device's do (docs/design.md
mechanism 12, ``vmlend.ledger.msiadmit``): ``share_msi_claims`` asks for the same interrupt
window, one segment of the lender adapter's window per (adapter, VM) under ``msi:<node>/<vm>``,
so it counts once with the VM's borrowed devices through that adapter. Like theirs it never
refuses: with no segment left the share's interrupts are relayed. A two-path share's backup path
asks for one more (key ``msi:<node>/<vm>#backup`` on the backup's lender adapter): its
interrupts cross that path, so they arrive after a failover.
"""

from __future__ import annotations

from collections.abc import Sequence

from vmlend.errors import (
    NoBackupPathError,
    ResourceExhaustedError,
    SwitchPortFullError,
    WindowExhaustedError,
)
from vmlend.ledger.admission import port_usage, usage
from vmlend.ledger.msiadmit import MSI_SHARE_PREFIX, msi_claim, msi_share
from vmlend.memory.windows import window_segments
from vmlend.registry.records import Claim, ClaimKind
from vmlend.topology.model import DeviceSpec, GuestRam, Holder, Topology
from vmlend.topology.paths import NtbPath, route, routes
from vmlend.topology.requesters import (
    is_port,
    port_switch,
    requester_device,
    requester_share,
    route_ports,
)
from vmlend.units import format_size_human


def share_window_key(fdid: int, holder: Holder) -> str:
    """The claim key of ``holder``'s share windows of drive ``fdid``."""
    return f"nvme:{fdid:#x}:{holder.node}/{holder.vm}"


BACKUP_SUFFIX = "#backup"
#: Segments each path of a two-path share takes besides its DMA windows: one for the rings of
#: its queue pairs, which the VM's virtual controller keeps in memory of the VM's host.
RING_SEGMENTS = 1


def backup_route(topology: Topology, lender: str, node: str, primary: NtbPath) -> NtbPath | None:
    """The route a share's backup path takes from ``lender`` into ``node``: the cheapest whose
    far adapter is not ``primary``'s (None when the node has no other adapter reached)."""
    return next((p for p in routes(topology, lender, node) if p.dst.ref != primary.dst.ref), None)


def _path_claims(
    spec: DeviceSpec, path: NtbPath, key: str, ram: GuestRam, extra: int = 0
) -> list[Claim]:
    lender_a, borrower_a = path.src, path.dst
    claims = [
        Claim(lender_a.ref, ClaimKind.LUT, requester_share(spec), entries=1),
        Claim(borrower_a.ref, ClaimKind.LUT, requester_share(spec), entries=1),
    ]
    claims += [
        Claim(p.name, ClaimKind.LUT, requester_share(spec), entries=1) for p in route_ports(path)
    ]
    segs = window_segments(ram.ranges, lender_a.segment_size) if ram.ranges else 0
    segs += extra if segs else 0
    if segs:
        claims.append(
            Claim(
                lender_a.ref, ClaimKind.DMA, key, segments=segs, bytes=segs * lender_a.segment_size
            )
        )
    return claims


def share_claims(
    topology: Topology, fdid: int, holder: Holder, ram: GuestRam, paths: int = 1
) -> list[Claim]:
    """The adapter resources ``holder``'s share of ``fdid`` uses with RAM ``ram`` on
    ``paths`` paths; ``NoBackupPathError`` when a second path is asked for and there is none."""
    spec = topology.device(fdid)
    path = route(topology, spec.lender, holder.node)
    if path is None:
        if paths > 1:
            raise NoBackupPathError(
                fdid, holder.node, f"{holder.node} is the drive's lender (no NTB to back up)"
            )
        return []
    key = share_window_key(fdid, holder)
    claims = _path_claims(spec, path, key, ram, RING_SEGMENTS if paths > 1 else 0)
    if paths > 1:
        backup = backup_route(topology, spec.lender, holder.node, path)
        if backup is None:
            others = [a.ref for a in topology.node(holder.node).adapters if a.ref != path.dst.ref]
            missing = (
                f"no adapter of {holder.node} but {path.dst.ref} is reached from {spec.lender}"
                f" (other adapters: {', '.join(others)})"
                if others
                else f"{holder.node} has one NTB adapter ({path.dst.ref}); a backup needs a second"
            )
            raise NoBackupPathError(fdid, holder.node, missing)
        more = _path_claims(spec, backup, key + BACKUP_SUFFIX, ram, RING_SEGMENTS)
        claims += [c for c in more if c not in claims]  # one LUT entry per adapter
    return claims


def check_share_claims(
    topology: Topology,
    existing: Sequence[tuple[int, Claim]],
    fdid: int,
    holder: Holder,
    claims: Sequence[Claim],
) -> None:
    """Raise the first shortfall of ``claims`` on top of ``existing`` (a
    ``ResourceExhaustedError`` naming the adapter and how much is short; a
    ``SwitchPortFullError`` naming the switch and the port)."""
    ports = sorted({c.adapter for c in claims if is_port(c.adapter)})
    have = port_usage(existing, ports)
    after_ports = port_usage([*existing, *((fdid, c) for c in claims)], ports)
    for name in ports:
        size = topology.switch_requester_entries(port_switch(name))
        if after_ports[name] > size and after_ports[name] > have[name]:
            requester = requester_device(topology.device(fdid))
            raise SwitchPortFullError(port_switch(name), name, requester, size)
    refs = sorted({c.adapter for c in claims if not is_port(c.adapter)})
    before = usage(topology, existing, refs)
    after = usage(topology, [*existing, *((fdid, c) for c in claims)], refs)
    for ref in refs:
        b, a = before[ref], after[ref]
        if a.lut_free < 0:
            need = a.lut_used - b.lut_used
            raise ResourceExhaustedError("requester LUT", ref, need, b.lut_free, "entries")
        if a.segments_free < 0:
            segs = a.segments_used - b.segments_used
            purpose = (
                f"DMA windows of {holder}'s share of {fdid:#x}, {segs} segments of "
                f"{format_size_human(a.adapter.segment_size)}"
            )
            raise WindowExhaustedError(ref, segs * a.adapter.segment_size, b.window_free, purpose)


def is_share_msi_claim(claim: Claim) -> bool:
    """A share's interrupt window (either path's)."""
    return claim.kind is ClaimKind.DMA and claim.share.startswith(MSI_SHARE_PREFIX)


def share_msi_claims(
    topology: Topology,
    existing: Sequence[tuple[int, Claim]],
    fdid: int,
    holder: Holder,
    claims: Sequence[Claim],
    paths: int = 1,
) -> list[Claim]:
    """The interrupt windows ``holder``'s share of ``fdid`` gets on top of ``existing`` and its
    own ``claims`` (``share_claims``): the primary path's (shared with the VM's borrowed
    devices through that adapter) and, with ``paths=2``, the backup's. A path with no segment
    left gets none (its interrupts are relayed); a VM on the lender crosses no NTB: none."""
    spec = topology.device(fdid)
    path = route(topology, spec.lender, holder.node)
    if path is None:
        return []
    mine = [*existing, *((fdid, c) for c in claims)]
    out: list[Claim] = []
    left = usage(topology, mine, [path.src.ref])[path.src.ref].segments_free
    primary, _why = msi_claim(spec, path.src, left, holder, existing)
    if primary is not None:
        out.append(primary)
    if paths > 1:
        backup = backup_route(topology, spec.lender, holder.node, path)
        if backup is not None:
            a = backup.src
            key = msi_share(holder) + BACKUP_SUFFIX
            room = usage(topology, [*mine, *((fdid, c) for c in out)], [a.ref])[a.ref]
            shared = any((c.adapter, c.share) == (a.ref, key) for _f, c in existing)
            if shared or room.segments_free >= 1:
                out.append(Claim(a.ref, ClaimKind.DMA, key, segments=1, bytes=a.segment_size))
    return out


#: The claim key suffixes of a share's CPU windows (``cpu_window_claims``): onto its CMB
#: extent, and onto its own doorbell page (page mode).
CMB_SUFFIX = "#cmb"
DOORBELL_SUFFIX = "#doorbell"


def cpu_window_claims(
    topology: Topology,
    fdid: int,
    holder: Holder,
    cmb_extent: tuple[int, int] | None,
    page: bool,
) -> list[Claim]:
    """The segments of the VM's adapter its CPU's windows onto the drive take: onto its CMB
    extent (mechanism 15: the guest writes its submission queue entries across the NTB into
    it) and onto its own doorbell page when it has one (page mode), each leaving by its node's
    adapter of the drive's crossing, in whole segments as a BAR window takes them
    (``admission.bar_segments``), under keys of the share's own. [] for a VM on the lender
    (its CPU reaches the drive without the NTB)."""
    path = route(topology, topology.device(fdid).lender, holder.node)
    if path is None:
        return []
    a, key = path.dst, share_window_key(fdid, holder)
    sizes = []
    if cmb_extent is not None:
        sizes.append((CMB_SUFFIX, cmb_extent[1]))
    if page:
        sizes.append((DOORBELL_SUFFIX, 4096))
    out = []
    for suffix, size in sizes:
        segs = -(-size // a.segment_size)
        out.append(
            Claim(a.ref, ClaimKind.BAR, key + suffix, segments=segs, bytes=segs * a.segment_size)
        )
    return out


def check_cpu_windows(
    topology: Topology,
    existing: Sequence[tuple[int, Claim]],
    fdid: int,
    holder: Holder,
    claims: Sequence[Claim],
) -> None:
    """``ResourceExhaustedError`` naming the adapter when the CPU windows ``claims`` do not
    fit beside ``existing``."""
    for ref in sorted({c.adapter for c in claims}):
        need = sum(c.segments for c in claims if c.adapter == ref)
        free = usage(topology, existing, [ref])[ref].segments_free
        if need > free:
            what = " and ".join(
                "CMB" if c.share.endswith(CMB_SUFFIX) else "doorbell page"
                for c in claims
                if c.adapter == ref
            )
            raise ResourceExhaustedError(
                f"NTB window segments for the {what} window of {holder}'s share of {fdid:#x}",
                ref,
                need,
                free,
                "segments",
            )
