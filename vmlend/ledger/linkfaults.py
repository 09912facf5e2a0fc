"""What a link fault does to the devices borrowed across it (issue 23 part 3).

When a cable goes down, every hold whose device crosses it is reported (a runtime record of
kind ``link-fault`` on the hold, shown by ``vmlend status`` and written to the action log by
the CLI), and, with hardware that can (the simulator's ``SimHardware.reroute``), the device's
crossing is re-established over another route from its lender's adapter, carrying the hold's
fencing token like any other step on the device. The guest does not reset the device: its
DMA windows name the borrower's addresses, which every route reaches alike.

When the cable comes back, its adapters either kept their state or were reset; in the second
case their driver programs again what they had (``reprogram``), and every device whose
crossing lost state there is re-established. A device whose route works again is reported
recovered.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import msgspec

from vmlend.errors import NoPathError, VmlendError
from vmlend.registry import HoldRecord, Phase, StateTxn, same_holder
from vmlend.registry.api import LINKS_DOWN_KEY
from vmlend.registry.records import Claim, ClaimKind
from vmlend.topology.model import DeviceSpec, Holder, Topology
from vmlend.topology.paths import NtbPath, route
from vmlend.topology.requesters import is_port, ports_between, requester_share, route_ports

log = logging.getLogger(__name__)

#: Runtime record kind of a link fault on a hold's path (key: the link's name).
LINK_FAULT = "link-fault"


def links_down_in(tx: StateTxn) -> list[str]:
    """The cables the state marks down (``Topology.link_names`` spelling), sorted."""
    raw = tx.meta(LINKS_DOWN_KEY)
    if not raw:
        return []
    try:
        found = json.loads(raw)
    except ValueError:
        return []
    return sorted(str(n) for n in found) if isinstance(found, list) else []


class _Borrowed(Protocol):
    @property
    def path(self) -> NtbPath | None: ...


class _ShareCrossing(Protocol):
    """A shared drive's crossing into a node (``SimHardware.share_crossings``)."""

    @property
    def node(self) -> str: ...

    @property
    def backup_of(self) -> str: ...

    @property
    def path(self) -> NtbPath: ...


@runtime_checkable
class RerouteHardware(Protocol):
    """Hardware that can move a borrowed device's crossing to another route."""

    def borrowed(self, fdid: int) -> _Borrowed | None: ...

    def reroute(self, fdid: int, *, token: int = 0) -> _Borrowed | None: ...

    def reprogram(self, name: str) -> int: ...

    def dead_links(self, path: NtbPath) -> list[str]: ...

    def crossing(self, fdid: int, node: str) -> NtbPath | None: ...


class LinkFault(msgspec.Struct, frozen=True):
    """What a link event did to one hold's device."""

    fdid: int
    holder: Holder
    link: str
    #: "down" (no other route: it reads all ones until the link is back), "rerouted" (its
    #: crossing now takes ``path``), "recovered" (its route works again), "failed" (a step
    #: was refused: ``detail`` says why)
    state: str
    path: str = ""  # the route it takes now ("" when none works)
    was: str = ""  # the route it took when the link went down
    detail: str = ""
    #: When its crossing moved to another borrower adapter: (old, new) adapter refs, for the
    #: hold's claims to follow it.
    moved: tuple[str, str] | None = None

    def line(self) -> str:
        """One line for the action log and the CLI."""
        where = f" over {self.path}" if self.path else ""
        was = f" (was {self.was})" if self.was else ""
        why = f": {self.detail}" if self.detail else ""
        head = f"device {self.fdid:#x} of {self.holder}: link {self.link} {self.state}"
        return f"{head}{where}{was}{why}"

    def record(self) -> dict[str, object]:
        return {"link": self.link, "state": self.state, "path": self.path, "was": self.was,
                "detail": self.detail}  # fmt: skip


class LinkChange(msgspec.Struct, frozen=True):
    """What ``set_link_up`` did: whether the cable changed state, and to which holds."""

    link: str
    up: bool
    changed: bool
    faults: tuple[LinkFault, ...] = ()


def _crosses(topology: Topology, hw: object, hold: HoldRecord, link: str) -> NtbPath | None:
    """The route of ``hold``'s device when it passes ``link`` (the hardware's borrow when
    there is hardware, else the cheapest route, as admission claimed it)."""
    path: NtbPath | None
    if isinstance(hw, RerouteHardware):
        b = hw.borrowed(hold.fdid)
        path = b.path if b is not None else None
    else:
        spec = topology.device(hold.fdid)
        try:
            path = route(topology, spec.lender, hold.holder.node)
        except NoPathError:
            path = None
    return path if path is not None and link in path.links else None


def on_link_down(
    topology: Topology, hw: object, holds: Mapping[int, HoldRecord], link: str
) -> list[LinkFault]:
    """Report every hold whose device crosses ``link`` and re-route the borrowed ones."""
    out: list[LinkFault] = []
    for fdid, hold in sorted(holds.items()):
        path = _crosses(topology, hw, hold, link)
        if path is None:
            continue
        fault = LinkFault(fdid, hold.holder, link, "down", "", path.describe())
        if isinstance(hw, RerouteHardware) and hold.phase is Phase.BORROWED:
            try:
                moved = hw.reroute(fdid, token=hold.token)
            except NoPathError:
                fault = LinkFault(fdid, hold.holder, link, "down", "", path.describe(),
                                  "no other route from its lender's adapter")  # fmt: skip
            except VmlendError as e:  # a stale token, a full LUT on the other adapter
                fault = LinkFault(fdid, hold.holder, link, "failed", "", path.describe(), str(e))
            else:
                now = moved.path if moved is not None else None
                if now is not None:
                    fault = LinkFault(fdid, hold.holder, link, "rerouted", now.describe(),
                                      path.describe(), moved=_moved(path, now))  # fmt: skip
        log.warning("%s", fault.line())
        out.append(fault)
    return out


def on_link_up(
    topology: Topology,
    hw: object,
    holds: Mapping[int, HoldRecord],
    link: str,
    faults: Mapping[int, LinkFault],
) -> list[LinkFault]:
    """``link`` is back: program again what its adapters lost, re-establish the crossings
    that lost state, and report the devices whose route works again."""
    out: list[LinkFault] = []
    if isinstance(hw, RerouteHardware):
        hw.reprogram(link)
    for fdid, hold in sorted(holds.items()):
        fault = faults.get(fdid)
        crosses = _crosses(topology, hw, hold, link)
        if fault is None and crosses is None:
            continue
        path = crosses.describe() if crosses is not None else (fault.path if fault else "")
        state = "recovered"
        detail = ""
        shift: tuple[str, str] | None = None
        if isinstance(hw, RerouteHardware) and hold.phase is Phase.BORROWED:
            b = hw.borrowed(fdid)
            before = b.path if b is not None else None
            try:
                moved = hw.reroute(fdid, token=hold.token)
            except NoPathError:
                state, detail = "down", "no route works yet"
            except VmlendError as e:
                state, detail = "failed", str(e)
            else:
                if moved is not None and moved.path is not None:
                    path = moved.path.describe()
                    if before is not None:
                        shift = _moved(before, moved.path)
        was = fault.was if fault is not None else ""
        if state == "recovered" and isinstance(hw, RerouteHardware) and _still_dead(hw, fdid):
            state, detail = "down", "its route crosses another dead link"
        lf = LinkFault(fdid, hold.holder, link, state, path, was, detail, shift)
        log.warning("%s", lf.line())
        out.append(lf)
    return out


def _still_dead(hw: RerouteHardware, fdid: int) -> bool:
    b = hw.borrowed(fdid)
    return b is not None and b.path is not None and bool(hw.dead_links(b.path))


def _moved(old: NtbPath, new: NtbPath) -> tuple[str, str] | None:
    return (old.dst.ref, new.dst.ref) if old.dst.ref != new.dst.ref else None


def _move_claims(tx: StateTxn, fdid: int, old: str, new: str) -> None:
    """The hold's claims on borrower adapter ``old`` now hold on ``new``: its crossing moved.
    A shared drive's manager claims what its share records say (recomputed at every share
    reserve and release), so those records move too."""
    from vmlend.ledger.nvmeshares import SHARE_RECORD  # it imports this module

    for r in tx.runtime(fdid, SHARE_RECORD):
        claims = r.data.get("claims")
        if isinstance(claims, list) and any(c.get("adapter") == old for c in claims):
            kept = [dict(c, adapter=new) if c.get("adapter") == old else c for c in claims]
            tx.put_runtime(fdid, SHARE_RECORD, r.key, {**r.data, "claims": kept})
    mine = [c for f, c in tx.claims() if f == fdid]
    for kind in sorted({c.kind for c in mine if c.adapter == old}):
        moved = [
            (fdid, msgspec.structs.replace(c, adapter=new) if c.adapter == old else c)
            for c in mine
            if c.kind is kind
        ]
        tx.replace_claims(kind, [fdid], moved)


def follow_crossings(tx: StateTxn, topology: Topology, hw: object) -> None:
    """Claims follow the hardware: a hold's claim on an adapter of another node than its
    device's lender moves to the adapter the device's crossing into that node uses now (an
    exclusive device re-routed, a shared drive's crossing moved by its manager)."""
    if not isinstance(hw, RerouteHardware):
        return
    shared = _follow_shares(tx, topology, hw)
    for fdid in sorted({f for f, _c in tx.claims()} - shared):
        follow_ports(tx, topology, hw, fdid)
    for fdid, claim in sorted(tx.claims(), key=lambda fc: (fc[0], fc[1].adapter)):
        if fdid in shared or is_port(claim.adapter):
            continue
        try:
            spec = topology.device(fdid)
            node = claim.adapter.rsplit(":", 1)[0]
            if node == spec.lender:
                continue
            now = hw.crossing(fdid, node)
        except VmlendError:  # gone from the topology, or no route: nothing to follow
            continue
        if now is not None and now.dst.node == node and now.dst.ref != claim.adapter:
            _move_claims(tx, fdid, claim.adapter, now.dst.ref)


def p2p_on_hardware(
    live: Topology, holder: Holder, specs: Sequence[DeviceSpec], hw: object
) -> list[tuple[int, Claim]]:
    """The peer-to-peer claims of ``holder``'s devices ``specs``, counted on the routes the
    hardware's maps take (where it lists a pair's crossing; else, for a pair not mapped yet,
    the cheapest on ``live``) and from the adapter each device's own crossing really leaves
    its lender by: after a link event these are not the cheapest live routes (a crossing
    with no other route stays on its dead cable, so peer-to-peer re-routed off that cable
    leaves by another adapter and holds an entry of its own there). ``NoPathError`` when two
    lenders have no route between them. Without hardware (``hw`` None), the topology's."""
    from vmlend.ledger.admission import p2p_claims  # it imports this module

    vm = (holder.node, holder.vm)

    def crosses_from(fdid: int) -> str | None:
        b = hw.borrowed(fdid) if isinstance(hw, RerouteHardware) else None
        if b is None or b.path is None or (getattr(b, "node", ""), getattr(b, "vm", "")) != vm:
            return None  # not this VM's borrow (yet): its route on ``live``
        return b.path.src.ref

    # this VM's mapper's crossings only (a hot move has one on each node for a while)
    mapped = {
        (x.source, x.target): x.path
        for x in getattr(hw, "p2p_crossings", list)()
        if (x.node, x.vm) == vm
    }

    # the mapper gives a new pair the route the VM's maps between the same two lenders hold,
    # or held before they all went (``P2PMapper._route``), which after a re-plan that found
    # no room is not the cheapest
    held = {
        (r.path.src.node, r.path.dst.node): r.path
        for r in getattr(hw, "p2p_routes", list)()
        if (r.node, r.vm) == vm
    }
    held.update({(p.src.node, p.dst.node): p for p in mapped.values() if p is not None})

    def route_of(source: DeviceSpec, target: DeviceSpec) -> NtbPath | None:
        if source.lender == target.lender:
            return None
        found = mapped.get((source.fdid, target.fdid))
        if found is None:
            found = held.get((source.lender, target.lender))
        return found if found is not None else route(live, source.lender, target.lender)

    return p2p_claims(live, holder, specs, crosses_from, route_of)


def follow_p2p(tx: StateTxn, live: Topology, hw: object) -> None:
    """Peer-to-peer claims follow a link event. The mapper of a VM's peer-to-peer re-plans
    its crossings between two lenders onto the routes that work now (the simulator's
    ``P2PMapper``; a real host's driver does the same), which take segments, LUT entries and
    switch port entries elsewhere, or leaves them where they were when the new route has no
    room. So each VM's peer-to-peer claims are counted again on the routes its maps use now
    (``p2p_on_hardware``) and replace the old ones: exact, so link events going back and
    forth do not pile claims up. A release counts them the same way (``Ledger.release``)."""
    vms: dict[tuple[str, str], list[HoldRecord]] = {}
    for hold in tx.holds().values():
        h = hold.holder
        vms.setdefault((h.node, h.vm_uuid or h.vm), []).append(hold)
    claims = tx.claims()
    for holds in vms.values():
        fdids = sorted(h.fdid for h in holds if live.has_device(h.fdid))
        if len(fdids) < 2:
            continue  # peer-to-peer needs two devices
        try:
            specs = [live.device(f) for f in fdids]
            needed = p2p_on_hardware(live, holds[0].holder, specs, hw)
        except VmlendError:  # no route left between two lenders: the maps stay cut
            continue
        had = [(f, c) for f, c in claims if f in fdids and c.kind is ClaimKind.P2P]
        if set(needed) != set(had):
            tx.replace_claims(ClaimKind.P2P, fdids, needed)


def follow_ports(tx: StateTxn, topology: Topology, hw: object, fdid: int) -> None:
    """The hold of ``fdid`` claims requester entries on the switch ports its crossing passes
    now: a re-route (or a borrow made after a cable changed since the reserve) moved it to
    other ports between its lender and its VM's node. Claims on ports of routes to another
    node (a hot migration's other end) stay. Nothing written when they agree."""
    if not isinstance(hw, RerouteHardware):
        return
    hold = tx.hold(fdid)
    if hold is None or not topology.has_device(fdid):
        return
    b = hw.borrowed(fdid)
    if b is None or b.path is None:
        return
    spec = topology.device(fdid)
    node = hold.holder.node
    if node != b.path.dst.node:
        return  # the hardware serves another holder: nothing to follow
    want = {p.name for p in route_ports(b.path)}
    between = ports_between(topology, spec.lender, node)
    share = requester_share(spec)
    # its crossing's claims only: the hold's peer-to-peer claims on ports (another device's
    # requester, as the target) are not the crossing's
    on = tx.claims_on(sorted(between | want))
    # on the port toward its lender, the etcd registry shows the device's requester entry
    # as its lender's lent entry (a claim of no hold: ``EtcdTxn._lent_claims``)
    mine = {
        c.adapter
        for f, c in on
        if c.kind is ClaimKind.LUT and (f == fdid or (f == 0 and c.share == share))
    }
    stale, missing = (mine & between) - want, want - mine
    if not stale and not missing:
        return
    lut = [c for f, c in tx.claims() if f == fdid and c.kind is ClaimKind.LUT]
    kept = [c for c in lut if c.adapter not in stale]
    kept += [Claim(p, ClaimKind.LUT, share, entries=1) for p in sorted(missing)]
    tx.replace_claims(ClaimKind.LUT, [fdid], [(fdid, c) for c in kept])


def _follow_shares(tx: StateTxn, topology: Topology, hw: RerouteHardware) -> set[int]:
    """A shared drive's share records claim, on each borrower node, the adapter the drive's
    crossing into it uses now, and a two-path share also the other adapter its backup path
    enters by (``SimHardware.entry_adapters``), and the requester entries on the switch ports
    those crossings pass now (``SimHardware.share_crossings``); the manager's claims are then
    recounted from the records. Returns the drives handled."""
    from vmlend.ledger.nvmeshares import SHARE_RECORD, store_claims  # it imports this module

    entry_adapters = getattr(hw, "entry_adapters", None)
    share_crossings = getattr(hw, "share_crossings", None)
    done: set[int] = set()
    for r in tx.runtime(None, SHARE_RECORD):
        claims = r.data.get("claims")
        if not isinstance(claims, list):
            continue
        done.add(r.fdid)
        try:
            lender = topology.device(r.fdid).lender
        except VmlendError:
            continue
        paths = int(r.data.get("share", {}).get("paths", 1))
        kept = [dict(c) for c in claims]
        adapters = {str(c["adapter"]) for c in kept if not is_port(str(c["adapter"]))}
        for node in sorted({a.rsplit(":", 1)[0] for a in adapters} - {lender}):
            try:
                now = hw.crossing(r.fdid, node)
            except VmlendError:
                continue
            if now is None or now.dst.node != node:
                continue
            want = [now.dst.ref]
            if paths > 1:
                used = entry_adapters(r.fdid, node) if entry_adapters is not None else []
                want.append(next((a for a in used if a != now.dst.ref), now.dst.ref))
            mine = [
                c
                for c in kept
                if c["kind"] == ClaimKind.LUT.value and str(c["adapter"]).rsplit(":", 1)[0] == node
            ]
            for c, adapter in zip(mine, want, strict=False):
                c["adapter"] = adapter
            for c in kept:  # its CPU's windows (CMB, doorbell page) leave by the crossing's
                if c["kind"] == ClaimKind.BAR.value and str(c["adapter"]).startswith(f"{node}:"):
                    c["adapter"] = now.dst.ref
        holder = r.data.get("holder")
        if share_crossings is not None and isinstance(holder, dict):
            crossings = share_crossings(r.fdid)
            node = str(holder.get("node", ""))
            kept = _follow_share_ports(kept, topology, r.fdid, node, r.key, paths, crossings)
        if kept != claims:
            tx.put_runtime(r.fdid, SHARE_RECORD, r.key, {**r.data, "claims": kept})
    for fdid in sorted(done):
        store_claims(tx, fdid)
    return done


def _follow_share_ports(
    claims: list[dict[str, object]],
    topology: Topology,
    fdid: int,
    node: str,
    name: str,
    paths: int,
    crossings: list[_ShareCrossing],
) -> list[dict[str, object]]:
    """Share ``name``'s record claims (builtins) with its switch port claims on the routes
    between the drive's lender and ``node`` those of the crossings it uses now: the node's
    shares' crossing and, for two paths, its own backup. Unchanged while they are not made
    (the share is not mapped yet: the claims stay as admitted)."""
    primary = next((c for c in crossings if c.node == node and not c.backup_of), None)
    backup = next((c for c in crossings if c.node == node and c.backup_of == name), None)
    if primary is None or (paths > 1 and backup is None):
        return claims
    spec = topology.device(fdid)
    want = {p.name for c in (primary, backup) if c is not None for p in route_ports(c.path)}
    between = ports_between(topology, spec.lender, node)
    out = [c for c in claims if str(c["adapter"]) not in between - want]
    have = {str(c["adapter"]) for c in out}
    share = requester_share(spec)
    for port in sorted(want - have):
        out.append(msgspec.to_builtins(Claim(port, ClaimKind.LUT, share, entries=1)))
    return out


def record_faults(tx: StateTxn, faults: list[LinkFault], *, up: bool) -> None:
    """Keep each fault on its hold (``vmlend status``; a recovered one is cleared)."""
    holds = tx.holds()
    for f in faults:
        hold = holds.get(f.fdid)
        if hold is None or not same_holder(hold.holder, f.holder):
            continue
        if up and f.state == "recovered":  # its route works: every fault of it is over
            tx.clear_runtime(f.fdid, LINK_FAULT)
        else:
            tx.put_runtime(f.fdid, LINK_FAULT, f.link, f.record())


def recorded_faults(tx: StateTxn) -> dict[int, LinkFault]:
    """The fault recorded on each hold (of any link; the first by link name), by fdid."""
    holds = tx.holds()
    out: dict[int, LinkFault] = {}
    for r in sorted(tx.runtime(kind=LINK_FAULT), key=lambda r: (r.fdid, r.key)):
        hold = holds.get(r.fdid)
        if hold is None or r.fdid in out:
            continue
        d = r.data
        out[r.fdid] = LinkFault(r.fdid, hold.holder, r.key, str(d.get("state", "")),
                                str(d.get("path", "")), str(d.get("was", "")),
                                str(d.get("detail", "")))  # fmt: skip
    return out
