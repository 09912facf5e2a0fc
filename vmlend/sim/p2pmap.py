"""Peer-to-peer maps of one VM applied to the simulated hardware.

``P2PMapper`` keeps the guest-physical BARs the guest programmed for the VM's devices, re-plans
with ``vmlend.p2p.plan_p2p`` on every change and applies only the difference, all or nothing:

- same lender: the source's lender IOMMU domain maps IOVA = GPA straight to the target's BAR;
- across an NTB: the target node's IOMMU maps the GPA to the BAR (the VM's own domain when the
  target is on the borrower, else a domain of this VM on the target's lender); one segment of
  the source lender's adapter per segment-sized chunk of that GPA range points at it (shared by
  every source and every BAR in the chunk); the source's requester id is let through the
  adapter's LUT (a borrowed device already is), the target's adapter gets an entry naming it
  (the id it enters with) and its crossing is attached to the target domain; the source's
  lender domain maps the GPA onto the segments last, so the device never reaches a half-built
  path. Removal runs the other way. The crossing, from the source's lender to the target's
  node, holds the source's requester entry on every cluster switch port of its route (one
  crossing per source and target, shared by the target's BARs; ``SwitchPorts``, all or
  nothing: a full port refuses the map, nothing changed).

Segments, LUT entries, target mappings and attachments are shared between maps and counted, so
they go when the last map using them goes. Only what this mapper set up is undone: a borrow's
own LUT entry or IOMMU attachment is left alone.

The mapper subscribes to the hardware's borrow ends: when one of its devices is given back by
any path (the VM's removal, a release after a crash, the fabric's give-back), every map from or
to it goes before the borrow does. Errors propagate (the hardware then fences the device). The
records of those maps are removed at the mapper's next call (``settle``): the borrow may end
inside the fabric's registry transaction, which a write from here would wait on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from vmlend.errors import (
    DeviceHeldError,
    FabricError,
    NoPathError,
    P2PError,
    ResourceExhaustedError,
    VmlendError,
)
from vmlend.ledger.admission import vm_share
from vmlend.p2p import RECORD_KIND, GuestBar, P2PMap, P2PPlan, Skipped, peer_device, plan_p2p
from vmlend.sim.iommu import IommuDomain
from vmlend.topology.model import BarKind, Holder
from vmlend.topology.paths import NtbPath, route
from vmlend.topology.requesters import requester_device, route_ports

if TYPE_CHECKING:
    from vmlend.registry import Registry, StateTxn
    from vmlend.sim.hardware import Borrow, SimHardware
    from vmlend.sim.ntb import NtbAdapter

log = logging.getLogger(__name__)


class Promises(Protocol):
    """What admission promised other VMs on an adapter and they have not mapped yet
    (``dmawin.RegistryWindowLedger``): the mapper leaves that many free segments alone."""

    def promised_segments(self, adapter: str, share: str) -> int: ...


#: ``recorder(source fdid, key, data)`` persists a map; ``data`` None removes it.
Recorder = Callable[[int, str, "dict[str, Any] | None"], None]
Undo = Callable[[], object]  # what an undo returns is ignored


def registry_recorder(registry: Registry) -> Recorder:
    """A recorder keeping maps as the registry's runtime records of kind ``p2p-map`` (on the
    source device, so they go with its hold)."""

    def record(fdid: int, key: str, data: dict[str, Any] | None) -> None:
        def body(tx: StateTxn) -> None:
            if data is None:
                tx.clear_runtime(fdid, RECORD_KIND, key)
            else:
                tx.put_runtime(fdid, RECORD_KIND, key, data)

        registry.transact(body)

    return record


class _Shared:
    """Reference-counted resources: made by the first user, destroyed after the last."""

    def __init__(self) -> None:
        self._items: dict[Hashable, list[Any]] = {}  # key -> [count, value, destroy]

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def acquire(self, key: Hashable, make: Callable[[], tuple[Any, Undo]]) -> tuple[Any, Undo]:
        """(value, release). ``make`` returns (value, destroy) and runs only for the first."""
        item = self._items.get(key)
        if item is None:
            value, destroy = make()
            item = self._items[key] = [0, value, destroy]
        item[0] += 1
        return item[1], lambda: self._release(key)

    def _release(self, key: Hashable) -> None:
        item = self._items[key]
        item[0] -= 1
        if item[0] == 0:
            del self._items[key]
            item[2]()


class P2PPairRoute(msgspec.Struct, frozen=True):
    """The route VM ``vm`` on ``node``'s peer-to-peer from lender ``src`` to lender ``dst``
    takes: its maps', or where its next maps go when it has none now."""

    node: str
    vm: str
    src: str
    dst: str
    path: NtbPath


class P2PCrossing(msgspec.Struct, frozen=True):
    """Peer-to-peer of VM ``vm`` on ``node`` from device ``source`` to device ``target``
    crossing ``path`` (the source's lender to the target's node)."""

    source: int
    target: int
    node: str
    vm: str
    path: NtbPath

    @property
    def user(self) -> tuple[int, str]:
        """Who it is in the switch ports' tables (``SwitchPorts``): the target's hold claims
        its entries (``admission.p2p_claims``)."""
        return (self.target, f"p2p {self.node}/{self.vm} from {self.source:#x}")


class _Applied(msgspec.Struct):
    map: P2PMap
    undo: list[Undo] = msgspec.field(default_factory=list)  # in the order things were set up


class P2PMapper:
    """Peer-to-peer maps among the devices VM ``vm`` on ``node`` borrowed from ``hardware``."""

    def __init__(
        self,
        hardware: SimHardware,
        node: str,
        vm: str,
        recorder: Recorder | None = None,
        promises: Promises | None = None,
    ) -> None:
        hardware.node(node)
        self.hw = hardware
        self.node = node
        self.vm = vm
        self._recorder = recorder
        self._promises = promises
        self._share_key = vm_share(Holder(node, vm))
        self._members: set[int] = set()  # devices that programmed a BAR, until removed
        self._bars: dict[tuple[int, int], GuestBar] = {}  # (fdid, index) -> where the guest put it
        self._applied: dict[tuple[int, str], _Applied] = {}
        self._skipped: tuple[Skipped, ...] = ()
        self._shared = _Shared()
        self._domains: dict[str, IommuDomain] = {}  # this VM's domains on other lenders
        self._defer_records = False  # inside a borrow end: keep record changes for settle
        self._unrecorded: list[tuple[int, str, dict[str, Any] | None]] = []  # still to record
        self._unsubscribe = hardware.on_borrow_end(self._borrow_ended)
        self._unfollow = hardware.on_link_change(self._link_changed)
        self._rerouting = False  # inside a link event's re-plan: routes may change
        #: Each (source, target) crossing holding switch port entries now.
        self._crossings: dict[tuple[int, int], P2PCrossing] = {}
        self._unregister = hardware.add_p2p_crossings(self.crossings)
        #: The route each lender pair's maps take, kept when they are all gone (a guest that
        #: unassigns and re-programs BARs): only a link event moves it, so maps made again go
        #: where the registry counted them (``linkfaults.p2p_on_hardware`` reads it).
        self._pair_routes: dict[tuple[str, str], NtbPath] = {}
        self._unregister_routes = hardware.add_p2p_routes(self.pair_routes)

    # --- the interface the pass-through session calls -------------------------------------------
    def program_bar(self, fdid: int, bar_index: int, gpa: int, size: int) -> None:
        """The guest programmed (or moved) BAR ``bar_index`` of ``fdid`` to ``gpa``: re-plan
        and update every affected map. ``gpa`` 0 means unassigned (its maps go); an I/O BAR is
        ignored (DMA cannot target it). On any error nothing changes. Unassigning a BAR of a
        device no longer borrowed is not an error: its maps went with its borrow."""
        if gpa == 0 and not self._is_mine(fdid):
            self._drop(fdid)  # e.g. the reset of a give-back, inside the fabric's transaction
            return
        self.settle()
        self._check_borrowed(fdid)
        dev = self.hw.device(fdid)
        kind = next((b.kind for b in dev.spec.bars if b.index == bar_index), None)
        if kind is None:
            peer_device(dev.spec, dev.bar_phys).bar(bar_index)  # raises with the BARs it has
        members = self._members | {fdid}
        bars = dict(self._bars)
        if kind is BarKind.IO or gpa == 0:
            bars.pop((fdid, bar_index), None)
        else:
            bars[(fdid, bar_index)] = GuestBar(fdid, bar_index, gpa, size)
        self._update(members, bars)
        log.debug("%s/%s: device %#x BAR %d at %#x", self.node, self.vm, fdid, bar_index, gpa)

    def remove_device(self, fdid: int) -> None:
        """``fdid`` left the VM: drop every map targeting it or issued by it. Idempotent."""
        self.settle()
        members = self._members - {fdid}
        bars = {k: v for k, v in self._bars.items() if k[0] != fdid}
        self._update(members, bars)

    def close(self) -> None:
        """The VM is gone: drop every map and stop following borrow ends. Idempotent."""
        for fdid in sorted(self._members):
            self.remove_device(fdid)
        self._unsubscribe()
        self._unfollow()
        self._unregister()
        self._unregister_routes()
        self.settle()

    def crossings(self) -> list[P2PCrossing]:
        """The crossings between the VM's devices' lenders, each with the route its maps take
        (those over a cluster switch hold its ports' requester entries)."""
        return [c for _k, c in sorted(self._crossings.items())]

    def pair_routes(self) -> list[P2PPairRoute]:
        """The route of each lender pair between the VM's devices (``_pair_routes``)."""
        return [
            P2PPairRoute(self.node, self.vm, src, dst, path)
            for (src, dst), path in sorted(self._pair_routes.items())
        ]

    def settle(self) -> None:
        """Write the record changes of maps changed when a borrow ended."""
        while self._unrecorded and self._recorder is not None:
            self._recorder(*self._unrecorded.pop(0))

    def _borrow_ended(self, borrow: Borrow) -> None:
        fdid = borrow.fdid
        if (borrow.node, borrow.vm) != (self.node, self.vm):
            return
        self._drop(fdid)

    def _link_changed(self, link: str, up: bool) -> None:
        """A cable went down or came back: re-plan on the routes that work now, so a crossing
        between two lenders leaves a dead cable (as the device's own crossing does,
        ``SimHardware.reroute``) and takes the cheapest route again once it is back. The maps
        whose route changed are made again on the new one (segments, LUT entries, switch port
        entries), all or nothing: when no live route is left or the new route has no room
        (a full requester table), the maps stay where they are, cut at the dead cable, and
        the next link event or BAR change tries again."""
        if not self._applied:
            self._pair_routes = {}  # nothing mapped: the next maps take the routes that work
            return
        self._rerouting = True
        try:
            self._update(self._members, self._bars)
        except VmlendError as e:
            log.warning(
                "%s/%s: peer-to-peer not re-routed after link %s went %s: %s",
                self.node, self.vm, link, "up" if up else "down", e,
            )  # fmt: skip
        finally:
            self._rerouting = False

    def _drop(self, fdid: int) -> None:
        """Drop ``fdid``'s maps without writing the registry now (see ``settle``)."""
        if fdid not in self._members and not any(k[0] == fdid for k in self._bars):
            return
        self._defer_records = True
        try:
            members = self._members - {fdid}
            bars = {k: v for k, v in self._bars.items() if k[0] != fdid}
            self._update(members, bars)
        finally:
            self._defer_records = False

    def _is_mine(self, fdid: int) -> bool:
        b = self.hw.borrowed(fdid)
        return b is not None and (b.node, b.vm) == (self.node, self.vm)

    def maps(self) -> list[P2PMap]:
        """The maps in place, by source, target and BAR."""
        return sorted((a.map for a in self._applied.values()), key=_order)

    def skipped(self) -> list[Skipped]:
        """Pairs left unmapped by the last plan, with the reason (e.g. beyond a DMA width)."""
        return list(self._skipped)

    # --- planning ------------------------------------------------------------------------------
    def _check_borrowed(self, fdid: int) -> None:
        b = self.hw.borrowed(fdid)
        if b is None:
            raise P2PError(
                f"device {fdid:#x} is not borrowed by {self.node}/{self.vm}; borrow it before "
                "mapping its BARs for peer-to-peer"
            )
        if (b.node, b.vm) != (self.node, self.vm):
            raise DeviceHeldError(fdid, b.node, b.vm)

    def _plan(self, members: set[int], bars: dict[tuple[int, int], GuestBar]) -> P2PPlan:
        # a device given back without remove_device is no longer the VM's: leave it out
        live = []
        for f in sorted(members):
            b = self.hw.borrowed(f)
            if b is not None and (b.node, b.vm) == (self.node, self.vm):
                dev = self.hw.device(f)
                live.append(peer_device(dev.spec, dev.bar_phys))
        fdids = {d.fdid for d in live}
        # no guest (yet): no RAM for a BAR to collide with
        ram = [
            r for g in self.hw.guests() if (g.node, g.vm) == (self.node, self.vm) for r in g.ranges
        ]
        guest_bars = [g for k, g in sorted(bars.items()) if k[0] in fdids]
        # the hardware's routes: over live cables only, so a re-plan after a link event moves
        # a crossing whose cable died onto another route (``_link_changed``)
        return plan_p2p(self.hw.topology, self.node, live, guest_bars, ram, self._route)

    def _route(self, src: str, dst: str) -> NtbPath | None:
        """The route maps between lenders ``src`` and ``dst`` take. Only a link event moves
        maps between routes (``_link_changed``), and only onto a route that works: any other
        re-plan, and a link event that leaves no live route, keeps the route the pair's maps
        have, so removing one device never re-makes another's maps (which fails on a cut
        route, inside a give-back)."""
        held = next(
            (
                a.map.path
                for a in self._applied.values()
                if a.map.path is not None and (a.map.source_node, a.map.target_node) == (src, dst)
            ),
            self._pair_routes.get((src, dst)),
        )
        if held is not None and not self._rerouting:
            return held
        try:
            return self.hw.route(src, dst)
        except NoPathError:
            if held is not None:
                return held  # cut, and nowhere else to go: the maps stay as they are
            # a new pair with every route cut: the cheapest, cut at its dead cable, as
            # before link events were followed (the route coming back brings the maps back)
            return route(self.hw.topology, src, dst)

    def _update(self, members: set[int], bars: dict[tuple[int, int], GuestBar]) -> None:
        plan = self._plan(members, bars)
        wanted = {(m.source, m.key): m for m in plan.maps}
        drop = {k for k, a in self._applied.items() if wanted.get(k) != a.map}
        add = [m for k, m in wanted.items() if k not in self._applied or k in drop]
        journal: list[Undo] = []
        try:
            for key in sorted(drop):
                old = self._applied[key].map
                self._unapply(key)

                def reapply(old: P2PMap = old) -> None:
                    self._apply(old)

                journal.append(reapply)
            for m in add:
                self._apply(m)

                def unapply(k: tuple[int, str] = (m.source, m.key)) -> None:
                    self._unapply(k)

                journal.append(unapply)
        except Exception:
            for undo in reversed(journal):
                undo()
            raise
        self._members, self._bars, self._skipped = members, bars, plan.skipped
        self._keep_pair_routes()
        if drop or add:
            log.info(
                "%s/%s: peer-to-peer %d removed, %d added, %d in place",
                self.node,
                self.vm,
                len(drop),
                len(add),
                len(self._applied),
            )

    def _keep_pair_routes(self) -> None:
        """After an update: each lender pair's route is its maps' now; a pair without maps
        keeps the one it had while both lenders still have a device of the VM, except in a
        link event's re-plan, which moves it (the next maps take the route that works then)."""
        routes: dict[tuple[str, str], NtbPath] = {}
        for a in self._applied.values():
            if a.map.path is not None:
                routes[(a.map.source_node, a.map.target_node)] = a.map.path
        lenders = {self.hw.device(f).lender for f in self._members}
        if not self._rerouting:
            for pair, path in self._pair_routes.items():
                if pair not in routes and pair[0] in lenders and pair[1] in lenders:
                    routes[pair] = path
        self._pair_routes = routes

    # --- applying one map ------------------------------------------------------------------------
    def _apply(self, m: P2PMap) -> None:
        applied = _Applied(m)
        try:
            if m.path is None:
                self._map_lender(applied, m.iova, m.target_phys, m.size)
            else:
                self._apply_crossing(applied, m)
            if self._recorder is not None:
                self._record(m.source, m.key, m.record())
                applied.undo.append(lambda: self._record(m.source, m.key, None))
        except Exception:
            _run(applied.undo)
            raise
        self._applied[(m.source, m.key)] = applied

    def _unapply(self, key: tuple[int, str]) -> None:
        applied = self._applied.pop(key)
        _run(applied.undo)

    def _record(self, source: int, key: str, data: dict[str, Any] | None) -> None:
        assert self._recorder is not None
        if self._defer_records:
            self._unrecorded.append((source, key, data))
        else:
            self._recorder(source, key, data)

    def _map_lender(self, applied: _Applied, iova: int, phys: int, size: int) -> None:
        domain = self.hw.lender_domain(applied.map.source)
        domain.map(iova, phys, size)
        applied.undo.append(lambda: domain.unmap(iova, size))

    def _share(self, applied: _Applied, key: Hashable, make: Callable[[], tuple[Any, Undo]]) -> Any:
        value, release = self._shared.acquire(key, make)
        applied.undo.append(release)
        return value

    def _target_domain(self, node: str) -> IommuDomain:
        if node == self.node:
            return self.hw.vm_domain(node, self.vm)  # the borrow attached the crossings to it
        if node not in self._domains:
            self._domains[node] = IommuDomain(
                f"{node}:p2p:{self.node}/{self.vm}", owner=(self.node, self.vm)
            )
        return self._domains[node]

    def _apply_crossing(self, applied: _Applied, m: P2PMap) -> None:
        assert m.path is not None
        target = self._target_domain(m.target_node)

        def map_target() -> tuple[None, Undo]:
            target.map(m.iova, m.target_phys, m.size)
            return None, lambda: target.unmap(m.iova, m.size)

        self._share(applied, ("target", target.name, m.iova, m.size, m.target_phys), map_target)
        self._hold_ports(applied, P2PCrossing(m.source, m.target, self.node, self.vm, m.path))

        adapter = self.hw.adapter(m.path.src.ref)
        rid = self.hw.device(m.source).requester_id
        lut_key = ("lut", adapter.ref, rid)
        if lut_key in self._shared or adapter.lut_lookup(rid) is None:
            # a device local to the borrower was never let across by a borrow

            def let_through() -> tuple[None, Undo]:
                adapter.lut_add(rid)
                return None, lambda: adapter.lut_remove(rid)

            self._share(applied, lut_key, let_through)

        ingress_key = ("ingress", m.source, m.target_node)
        if ingress_key in self._shared or not self._enters(m.source, m.target_node):

            def attach() -> tuple[None, Undo]:
                # on the map's own route: an undo re-making a map cut at a dead cable puts
                # its entry back where it was, not on the live route
                self.hw.attach_ingress(m.source, m.target_node, target, m.path)
                return None, lambda: self.hw.detach_ingress(m.source, m.target_node)

            self._share(applied, ingress_key, attach)

        seg = adapter.segment_size
        chunk = m.iova - m.iova % seg
        pieces: list[tuple[int, int, int]] = []
        while chunk < m.iova + m.size:

            def map_segment(base: int = chunk) -> tuple[int, Undo]:
                index = _last_free_segment(adapter, self._promised(adapter.ref))
                adapter.map_segment(index, m.target_node, base)
                return index, lambda: adapter.unmap_segment(index)

            index = self._share(
                applied, ("segment", adapter.ref, m.target_node, chunk), map_segment
            )
            lo, hi = max(m.iova, chunk), min(m.iova + m.size, chunk + seg)
            pieces.append((lo, adapter.segment_base(index) + lo - chunk, hi - lo))
            chunk += seg
        for iova, window, size in pieces:  # the device side last
            self._map_lender(applied, iova, window, size)

    def _hold_ports(self, applied: _Applied, crossing: P2PCrossing) -> None:
        """The source's requester entry on each switch port of the crossing (shared by the
        target's BARs): a full port raises ``SwitchPortFullError``, nothing changed. The
        crossing is listed either way (``crossings``), with the route its maps take."""
        ports = route_ports(crossing.path)
        requester = requester_device(self.hw.device(crossing.source).spec)
        pair = (crossing.source, crossing.target)

        def hold() -> tuple[None, Undo]:
            if ports:
                self.hw.switch_ports.add(ports, requester, crossing.user)
            self._crossings[pair] = crossing

            def release() -> None:
                self._crossings.pop(pair, None)
                if ports:
                    self.hw.switch_ports.remove(ports, requester, crossing.user)

            return None, release

        self._share(applied, ("ports", *pair), hold)

    def _promised(self, ref: str) -> int:
        """Segments of ``ref`` promised to other VMs and not mapped yet (kept free for them)."""
        if self._promises is None:
            return 0
        return self._promises.promised_segments(ref, self._share_key)

    def _enters(self, fdid: int, node: str) -> bool:
        """Whether ``fdid``'s DMA entering ``node`` is translated already (by its borrow)."""
        try:
            requester = self.hw.ingress(fdid, node)
        except FabricError:
            return False  # the far adapter has no LUT entry for it yet
        return self.hw.node(node).iommu.domain_for(requester) is not None


def _last_free_segment(adapter: NtbAdapter, promised: int = 0) -> int:
    """The highest unmapped segment: P2P takes single segments from the top of the window so
    the runs DMA windows want stay whole at the bottom. ``promised`` free segments are other
    VMs' (admitted, not mapped yet): one must be left over beyond them."""
    free = [i for i in range(adapter.segments) if adapter.segment(i) is None]
    if len(free) <= promised:
        raise ResourceExhaustedError(
            "NTB window segments for peer-to-peer",
            adapter.ref,
            1,
            max(0, len(free) - promised),
            "segments",
        )
    return free[-1]


def _order(m: P2PMap) -> tuple[int, int, int]:
    return (m.source, m.target, m.bar)


def _run(undo: list[Undo]) -> None:
    """Run undo steps newest first."""
    for step in reversed(undo):
        step()
    undo.clear()
