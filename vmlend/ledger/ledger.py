"""``Ledger``: who holds what, the ``Fabric`` interface over the shared state.

Both backends keep their bookkeeping here: the simulated cluster (``vmlend.sim.backend``, the
ledger driving simulated hardware) and the kernel backend (``vmlend.kernel.backend``, the ledger
next to the SmartIO driver).

Everything lives in the registry (``vmlend.registry``): the topology, lent flags, node
availability, holds with their adapter claims, mdev parents and children. Each method is one
transaction (``Registry.transact``), so separate processes and hosts (hook, CLI, agent) see
one truth, and decisions that read before they write (reserve, unlend, create_mdev) commit only
if what they read still holds. A transaction body may run again after a conflict, so the
hardware steps of borrow, give_back and release run between transactions, never inside one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid as uuidlib
from collections.abc import Callable, Sequence
from typing import Protocol, Self, runtime_checkable

from vmlend.errors import (
    ConfigError,
    DeviceFencedError,
    DeviceHeldError,
    DeviceNotLentError,
    DeviceNotReservedError,
    FabricError,
    LenderUnavailableError,
    MdevError,
    StaleTokenError,
    StateRecordError,
    VmlendError,
)
from vmlend.ledger.admission import (
    AdapterUsage,
    PortUsage,
    StateView,
    admit,
    admit_vm,
    guest_ram_of,
    lender_problem,
    ports_in_use,
)
from vmlend.ledger.admission import usage as adapter_usage
from vmlend.ledger.linkfaults import (
    LinkChange,
    LinkFault,
    follow_crossings,
    follow_p2p,
    follow_ports,
    links_down_in,
    on_link_down,
    on_link_up,
    p2p_on_hardware,
    record_faults,
    recorded_faults,
)
from vmlend.ledger.shareops import ShareOps, existing_mdev, mdev_info, shares_on
from vmlend.registry import (
    ClaimKind,
    DeviceRecord,
    FenceRecord,
    HoldRecord,
    MdevRecord,
    NodeRecord,
    ParentRecord,
    Phase,
    Registry,
    StateTxn,
    same_holder,
)
from vmlend.registry.api import LINKS_DOWN_KEY
from vmlend.registry.records import Claim, ExpectedHold
from vmlend.topology.compiled import stored_topology
from vmlend.topology.model import (
    MANAGER_VM,
    Check,
    DeviceSpec,
    DeviceState,
    DeviceStatus,
    GuestRam,
    Holder,
    MdevInfo,
    NodeSpec,
    Reservation,
    Topology,
)
from vmlend.topology.paths import NtbPath, route, without_links
from vmlend.topology.requesters import route_ports

log = logging.getLogger(__name__)


def _port_names(path: NtbPath) -> list[str]:
    """The names of the switch ports ``path`` passes (claims of requester entries use them)."""
    return [p.name for p in route_ports(path)]


#: The mdev type the SmartIO driver offers under each parent.
MDEV_TYPE = "smartio-lend"

#: Devices of one lender lent per transaction by ``lend_many``: each reads its record, hold
#: and fence (three compares) and writes its record (one put); the lender's keys and the
#: topology's add five: 101 compares, within etcd's default of 128 operations per request.
LEND_BATCH = 32


def parent_name(fdid: int) -> str:
    """The mdev parent the SmartIO driver registers on a borrower for device ``fdid``."""
    return f"smartio-{fdid:x}"


def device_state(
    rec: DeviceRecord | None, node: NodeRecord | None, hold: HoldRecord | None
) -> DeviceState:
    """A device's state from its rows: a vanished lender wins over everything else."""
    if lender_problem(rec, node):
        return DeviceState.UNAVAILABLE
    if hold is not None:
        return DeviceState.BORROWED if hold.phase is Phase.BORROWED else DeviceState.RESERVED
    if rec is not None and rec.lent:
        return DeviceState.AVAILABLE
    return DeviceState.UNLENT


def _uuid(text: str) -> str:
    try:
        return str(uuidlib.UUID(text))
    except (ValueError, TypeError, AttributeError):
        raise ConfigError(f"bad mdev UUID {text!r}: expected e.g. {uuidlib.UUID(int=0)}") from None


class BorrowHardware(Protocol):
    """The hardware half of the deferred borrow (the simulator's ``SimHardware``)."""

    def borrow(self, fdid: int, node: str, vm: str, *, token: int = 0) -> object: ...

    def give_back(
        self,
        fdid: int,
        node: str | None = None,
        vm: str | None = None,
        *,
        token: int = 0,
        revoke: bool = True,
    ) -> bool: ...

    def revoke(self, fdid: int, node: str | None = None, vm: str | None = None) -> int: ...

    def retire(self, fdid: int, token: int) -> None: ...

    def spent(self, fdid: int) -> int: ...


@runtime_checkable
class LinkHardware(Protocol):
    """Hardware whose cables can fail (the simulator's ``SimHardware``)."""

    def link_down(self, name: str) -> bool: ...

    def link_up(self, name: str, *, keep_mappings: bool = True) -> bool: ...


class Ledger(ShareOps):
    """Holds, claims, fences and mdev records of the fabric, seen from ``local_node`` (default:
    the state's local node; with ``observer``, a shared registry without one is seen from no
    node, ``local_node == ""``, for reading).

    With ``hardware``, ``borrow``/``give_back``/``release`` also drive the hardware
    (LUT entries, IOMMU attachment) of this process: borrow checks the hold, borrows the
    hardware, then records the phase (giving the hardware back if that fails), so a hardware
    refusal leaves the state unchanged; give_back and release free the hardware before the
    state says the device is free.
    """

    _hw: BorrowHardware | None  # more than the ShareRevoker that ShareOps needs

    def __init__(
        self,
        registry: Registry,
        local_node: str | None = None,
        clock: Callable[[], float] = time.time,
        hardware: BorrowHardware | None = None,
        observer: bool = False,
    ) -> None:
        self._reg = registry
        self._clock = clock
        self._hw = hardware
        self._topo: Topology | None = None
        self._digest: str | None = None
        self._live: tuple[tuple[str, ...], Topology] | None = None
        with registry.read() as tx:
            topo = self._topology(tx)
            node = local_node or tx.topology().local_node
        if not node and observer:
            # Reading only (devices, fabric show, status, reconcile without --fix): a host
            # that has not said which node it is sees the fabric from no node ("").
            self.local_node = ""
            return
        if not node:
            raise ConfigError(
                f"say which fabric node this host is with --node, VMLEND_NODE or the file"
                f" etc/vmlend/node under the host root (the registry {registry.where} is shared"
                " by every host, so it cannot say)"
            )
        topo.node(node)  # UnknownNodeError for a node this fabric does not have
        self.local_node = node

    @property
    def registry(self) -> Registry:
        return self._reg

    def close(self) -> None:
        self._reg.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- reading ---------------------------------------------------------------------------
    def _full_topology(self, tx: StateTxn) -> Topology:
        """The topology, decoded (or parsed) again only when another process replaced it."""
        digest = tx.topology_digest()
        if self._topo is None or digest != self._digest:
            rec = tx.topology()
            self._topo = stored_topology(rec)
            self._digest = rec.digest
            self._live = None
        return self._topo

    def _topology(self, tx: StateTxn) -> Topology:
        """The topology as admission and routing see it: without the cables marked down
        (``set_link_up``), so a new reservation takes a route that works."""
        full = self._full_topology(tx)
        down = tuple(links_down_in(tx))
        if not down:
            return full
        if self._live is None or self._live[0] != down:
            self._live = (down, without_links(full, down))
        return self._live[1]

    @staticmethod
    def _lender_ok(tx: StateTxn, spec: DeviceSpec) -> None:
        problem = lender_problem(tx.device(spec.fdid), tx.node(spec.lender))
        if problem:
            raise LenderUnavailableError(spec.fdid, spec.lender, problem)

    def _status(self, tx: StateTxn, spec: DeviceSpec) -> DeviceStatus:
        hold = tx.hold(spec.fdid)
        state = device_state(tx.device(spec.fdid), tx.node(spec.lender), hold)
        return DeviceStatus(spec=spec, state=state, holder=hold.holder if hold else None)

    def topology(self) -> Topology:
        """The whole topology, every cable in it (dead ones too: ``links_down``)."""
        with self._reg.read() as tx:
            return self._full_topology(tx)

    def nodes(self) -> list[NodeSpec]:
        return list(self.topology().nodes)

    def devices(self, lender: str | None = None) -> list[DeviceStatus]:
        """Every device with its state and holder; with ``lender``, that node's alone, read
        alone: its device records and holds, its node (``UnknownNodeError`` for a node the
        topology lacks), not every record of the fabric."""
        with self._reg.read() as tx:
            topo = self._topology(tx)
            if lender is not None:
                topo.node(lender)
                specs = topo.devices_of(lender)
                fdids = [d.fdid for d in specs]
                tx.prefetch(fdids=fdids, nodes=[lender])
                recs = tx.devices(fdids)
                node = tx.node(lender)
                return [
                    DeviceStatus(spec, device_state(recs.get(spec.fdid), node, hold), holder)
                    for spec in specs
                    for hold in [tx.hold(spec.fdid)]
                    for holder in [hold.holder if hold else None]
                ]
            recs, nodes, holds = tx.devices(), tx.nodes(), tx.holds()
        out = []
        for spec in topo.devices:
            hold = holds.get(spec.fdid)
            state = device_state(recs.get(spec.fdid), nodes.get(spec.lender), hold)
            out.append(DeviceStatus(spec, state, hold.holder if hold else None))
        return out

    def device(self, fdid: int) -> DeviceStatus:
        with self._reg.read() as tx:
            return self._status(tx, self._topology(tx).device(fdid))

    def holds(self) -> dict[int, HoldRecord]:
        """Every hold with its phase and start time (sim and CLI extra)."""
        with self._reg.read() as tx:
            return tx.holds()

    def holds_of(self, holder: Holder) -> dict[int, HoldRecord]:
        """The holds of ``holder``'s VM, each with its start and fencing token."""
        with self._reg.read() as tx:
            return tx.holds_of(holder)

    def node_states(self) -> dict[str, NodeRecord]:
        with self._reg.read() as tx:
            return tx.nodes()

    def usage(self) -> dict[str, AdapterUsage]:
        """Per adapter ref, the LUT entries and window segments the holds use."""
        with self._reg.read() as tx:
            return adapter_usage(self._topology(tx), tx.claims() + tx.set_aside())

    def port_usage(self) -> list[PortUsage]:
        """The cluster switch ports whose requester tables the holds use, by name."""
        with self._reg.read() as tx:
            return ports_in_use(self._topology(tx), tx.claims() + tx.set_aside())

    # --- lender side -----------------------------------------------------------------------
    def lend(self, fdid: int) -> DeviceStatus:
        def body(tx: StateTxn) -> DeviceStatus:
            spec = self._topology(tx).device(fdid)
            self._lender_ok(tx, spec)
            tx.set_lent(fdid, True)
            return self._status(tx, spec)

        return self._reg.transact(body)

    def lend_many(
        self, fdids: Sequence[int], progress: Callable[[int], None] | None = None
    ) -> list[DeviceStatus]:
        """``lend`` for many devices, up to ``LEND_BATCH`` of one lender to a transaction (a
        cluster's 16,384 devices took 583 s one transaction each): each batch is
        all-or-nothing, and a batch refused (a lender down) leaves the batches before it lent.
        The statuses come in the order given; ``progress`` is told how many are done after
        each batch."""
        with self._reg.read() as tx:
            topo = self._topology(tx)
            specs = [topo.device(f) for f in fdids]  # an unknown fdid: nothing lent
        by_lender: dict[str, list[int]] = {}
        for spec in specs:
            by_lender.setdefault(spec.lender, []).append(spec.fdid)
        batches = [
            fdids_of[i : i + LEND_BATCH]
            for fdids_of in by_lender.values()
            for i in range(0, len(fdids_of), LEND_BATCH)
        ]
        done: dict[int, DeviceStatus] = {}
        for batch in batches:

            def body(tx: StateTxn, batch: list[int] = batch) -> list[DeviceStatus]:
                topo = self._topology(tx)
                specs = [topo.device(f) for f in batch]
                tx.prefetch(batch, nodes={s.lender for s in specs})  # one lender: one node
                for spec in specs:
                    self._lender_ok(tx, spec)
                    tx.set_lent(spec.fdid, True)
                return [self._status(tx, spec) for spec in specs]

            done.update((st.spec.fdid, st) for st in self._reg.transact(body))
            if progress is not None:
                progress(len(done))
        return [done[f] for f in fdids]

    def unlend(self, fdid: int) -> DeviceStatus:
        def body(tx: StateTxn) -> DeviceStatus:
            spec = self._topology(tx).device(fdid)
            hold = tx.hold(fdid)
            if hold is not None:
                raise DeviceHeldError(fdid, hold.holder.node, hold.holder.vm)
            tx.set_lent(fdid, False)
            return self._status(tx, spec)

        return self._reg.transact(body)

    # --- fencing: taking back what a vanished holder had ----------------------------------------
    def fenced(self) -> list[FenceRecord]:
        """Fences of devices this node lends whose hold is gone: their holder's lease ended
        while it held them, so this lender must take them back before anyone borrows them."""
        with self._reg.read() as tx:
            topo = self._topology(tx)
            mine = {d.fdid for d in topo.devices if d.lender == self.local_node}
            return [f for f in tx.fences() if f.fdid in mine and tx.hold(f.fdid) is None]

    def take_back(self, fence: FenceRecord) -> bool:
        """Reset the device on this lender (unmap its NTB and IOMMU mappings; in the sim: give
        its simulated hardware back), then drop the fence, which makes it borrowable again.
        False when a new hold appeared meanwhile (then it is not ours to touch)."""
        if self._hw is not None:
            try:  # the fence's token: a late take-back never touches a newer holder's device
                self._hw.give_back(fence.fdid, token=fence.token)
            except StaleTokenError as e:
                log.warning("%s", e)
                return False
            # the vanished holder's open mdev goes too, even when nothing was borrowed
            self._hw.revoke(fence.fdid)
            # and its token is spent: a late borrow of the ended hold, before any newer hold
            # has the device, is refused by the device itself
            self._hw.retire(fence.fdid, fence.token)
        cleared = self._reg.transact(lambda tx: tx.clear_fence(fence.fdid))
        if cleared:
            log.warning(
                "took back %#x from %s (its lease ended): mappings removed, device reset",
                fence.fdid,
                fence.holder,
                extra={"fdid": f"{fence.fdid:#x}", "vm": fence.holder.vm},
            )
        return cleared

    # --- lender-side events ----------------------------------------------------------------
    def set_node_up(self, node: str, up: bool, why: str = "") -> None:
        """Mark a node down (its devices become UNAVAILABLE) or up again. A lender going down
        ends the hardware borrows of its devices (``_end_borrow``: their mappings go, the holds
        stay RESERVED for their holders to release). The node is marked first, then each borrow
        ends outside the registry transaction (its body may re-run on etcd). A teardown that
        fails leaves that device fenced and BORROWED, and is raised after the rest is done."""

        def mark(tx: StateTxn) -> list[HoldRecord]:
            topo = self._topology(tx)
            topo.node(node)
            tx.set_node_up(node, up, "" if up else why)
            lent_here = {d.fdid for d in topo.devices if d.lender == node}
            return [h for f, h in sorted(tx.holds().items()) if f in lent_here]

        held = self._reg.transact(mark)
        failures: list[VmlendError] = []
        if not up:
            for hold in held:
                try:
                    self._end_borrow(hold)
                except VmlendError as e:  # fenced by the hardware; the others go on
                    failures.append(e)
        log.info("node %s marked %s", node, "up" if up else "down")
        if failures:
            raise failures[0]

    def links_down(self) -> list[str]:
        """The cables marked down (``set_link_up``), sorted."""
        with self._reg.read() as tx:
            return links_down_in(tx)

    def set_link_up(self, link: str, up: bool, *, keep_mappings: bool = True) -> LinkChange:
        """Mark cable ``link`` (a name of ``Topology.link_names``) down or up again, and tell
        this process's hardware: a mapping across a dead cable reads all ones and drops writes;
        one that comes back keeps its mappings, or (``keep_mappings`` False) the adapters at
        its ends lost them. New reservations route around dead cables. Every hold whose device
        crosses the cable is reported and, with hardware that can, re-routed (or re-established
        when the link comes back without its mappings): ``vmlend.ledger.linkfaults``. Returns
        what happened to each such hold (``changed`` False, nothing done, when the cable was in
        that state already). ``ConfigError`` for an unknown link."""

        def mark(tx: StateTxn) -> tuple[bool, dict[int, HoldRecord], dict[int, LinkFault]]:
            names = self._full_topology(tx).link_names()
            if link not in names:
                raise ConfigError(f"unknown link {link!r} (known: {', '.join(names) or 'none'})")
            down = set(links_down_in(tx))
            if (link not in down) == up:
                return False, {}, {}
            if up:
                down.discard(link)
            else:
                down.add(link)
            tx.set_meta(LINKS_DOWN_KEY, json.dumps(sorted(down)))
            return True, tx.holds(), recorded_faults(tx)

        changed, holds, before = self._reg.transact(mark)
        if not changed:
            return LinkChange(link, up, False)
        topo = self.topology()
        if isinstance(self._hw, LinkHardware):
            if up:
                self._hw.link_up(link, keep_mappings=keep_mappings)
            else:
                self._hw.link_down(link)
        if up:
            faults = on_link_up(topo, self._hw, holds, link, before)
        else:
            faults = on_link_down(topo, self._hw, holds, link)

        def record(tx: StateTxn) -> None:
            record_faults(tx, faults, up=up)
            follow_crossings(tx, topo, self._hw)
            follow_p2p(tx, self._topology(tx), self._hw)

        self._reg.transact(record)
        log.info("link %s marked %s", link, "up" if up else "down")
        return LinkChange(link, up, True, tuple(faults))

    def reclaim(self, fdid: int) -> Holder | None:
        """The lender takes ``fdid`` back from whoever borrows it: the hardware borrow ends
        first (``_end_borrow``: every mapping from or to the device goes), then in one
        transaction the hold and its claims go, and so do the device's mdevs, so the borrowing
        VM's guest loses the device as in a surprise removal. Returns the holder it was taken
        from (None: nobody held it). The device stays lent."""
        with self._reg.read() as tx:
            self._topology(tx).device(fdid)
            hold = tx.hold(fdid)
        if hold is None:
            return None
        self._end_borrow(hold)
        if self._hw is not None:  # every open mdev goes too (a manager's: its shares')
            self._hw.revoke(fdid)

        def drop(tx: StateTxn) -> Holder | None:
            now = tx.hold(fdid)
            if now is None or not same_holder(now.holder, hold.holder):
                return None  # released meanwhile, or someone else's now: not ours to drop
            tx.delete_hold(fdid)
            self._reclaim_p2p(tx, now.holder)
            for m in tx.mdevs():
                if m.fdid == fdid:
                    tx.delete_mdev(m.uuid)
            return now.holder

        taken = self._reg.transact(drop)
        if taken is not None:
            log.info("lender reclaimed %#x from %s", fdid, taken)
        return taken

    def set_device_available(self, fdid: int, available: bool) -> None:
        """Mark one device vanished (e.g. its mdev parent disappeared) or back."""

        def body(tx: StateTxn) -> None:
            self._topology(tx).device(fdid)
            tx.set_available(fdid, available)

        self._reg.transact(body)

    # --- borrower side ---------------------------------------------------------------------
    def admission(
        self,
        fdid: int,
        borrower: str,
        guest_ram: GuestRam | int = 0,
        *,
        holder: Holder | None = None,
        msi_over_ntb: bool = False,
    ) -> list[Check]:
        with self._reg.read() as tx:
            topo = self._topology(tx)
            view = self._view(tx, topo, fdid, borrower, holder)
            adm = admit(
                topo, view, fdid, borrower, guest_ram, holder, msi_over_ntb, self._p2p_count
            )
            return adm.checks

    def vm_admission(
        self,
        fdids: list[int],
        borrower: str,
        guest_ram: GuestRam | int,
        *,
        holder: Holder,
        leaving: Holder | None = None,
    ) -> dict[int, list[Check]]:
        with self._reg.read() as tx:
            result = admit_vm(
                self._topology(tx),
                self._whole_view(tx),
                fdids,
                borrower,
                guest_ram,
                holder,
                leaving,
            )
        return {fdid: adm.checks for fdid, adm in result.items()}

    @staticmethod
    def _whole_view(tx: StateTxn) -> StateView:
        """The whole state: what a VM's admission on another node (a migration) sums over."""
        return StateView(
            nodes=tx.nodes(),
            devices=tx.devices(),
            holds=tx.holds(),
            claims=tx.claims() + tx.set_aside(),
        )

    def _view(
        self, tx: StateTxn, topo: Topology, fdid: int, borrower: str, holder: Holder | None
    ) -> StateView:
        """What admission of ``fdid`` for ``borrower`` decides on, and nothing more, so a
        reserve reads (and, on etcd, conflicts on) a few keys however big the fabric:

        - the device, its lender node and its hold;
        - the holds of ``holder``'s VM (``holds_of``): peer-to-peer admission needs the VM's
          own other devices;
        - the claims on the two adapters of the device's path (LUT, DMA and BAR windows, the
          MSI window share) and on every adapter that peer-to-peer among the VM's devices
          would use (``_p2p_count``: their segments and LUT entries are counted there).
        """
        try:
            spec = topo.device(fdid)
        except FabricError:
            return StateView(nodes={}, devices={}, holds={}, claims=[])  # admit says why
        path: NtbPath | None
        try:
            path = route(topo, spec.lender, borrower)
        except FabricError:
            path = None  # admit reports the missing path
        node, rec, hold = tx.node(spec.lender), tx.device(fdid), tx.hold(fdid)
        holds = {} if hold is None else {fdid: hold}
        # the switch ports of the path too: their requester entries are claimed under them
        adapters = [path.src.ref, path.dst.ref, *_port_names(path)] if path else []
        if holder is not None:
            mine = tx.holds_of(holder)
            holds.update(mine)
            specs = [spec] + [
                topo.device(f) for f in sorted(mine) if topo.has_device(f) and f != fdid
            ]
            # two lenders no NTB joins: admit refuses, and reads no claims for it
            with contextlib.suppress(FabricError):
                adapters += [c.adapter for _f, c in self._p2p_count(topo, holder, specs)]
        return StateView(
            nodes={} if node is None else {spec.lender: node},
            devices={} if rec is None else {fdid: rec},
            holds=holds,
            claims=tx.claims_on(adapters) if adapters else [],
        )

    @staticmethod
    def _prefetch(tx: StateTxn, topo: Topology, fdid: int, holder: Holder) -> None:
        """Tell the registry what a reserve will read (``_view``), so etcd serves it at once."""
        try:
            spec = topo.device(fdid)
            path = route(topo, spec.lender, holder.node)
        except FabricError:
            return
        adapters = (path.src.ref, path.dst.ref, *_port_names(path)) if path else ()
        tx.prefetch([fdid], [spec.lender], adapters, held_by=[holder])

    def reserve(
        self,
        fdid: int,
        holder: Holder,
        *,
        guest_ram: GuestRam | int = 0,
        msi_over_ntb: bool = False,
    ) -> Reservation:
        if not holder.vm or not holder.node:
            raise ConfigError(f"a holder needs a node and a VM name, got {holder!r}")
        if holder.vm == MANAGER_VM:
            raise ConfigError(
                f"the VM name {MANAGER_VM!r} is reserved for the manager of shared NVMe drives;"
                " rename the VM"
            )
        ram = guest_ram_of(guest_ram)
        claimed: list[int] = []
        # This call's hold carries this stamp: a re-run that finds it found this call's own
        # commit whose reply was lost (the gateway sent the request again to another etcd
        # member), so the hold is still reported as made here and a failed prepare returns it.
        stamp = self._clock()

        def body(tx: StateTxn) -> Reservation:
            claimed.clear()
            if self._topo is not None:
                self._prefetch(tx, self._topo, fdid, holder)
            topo = self._topology(tx)
            spec = topo.device(fdid)
            hold = tx.hold(fdid)
            if hold is not None and same_holder(hold.holder, holder):
                return Reservation.of(self._status(tx, spec), created=hold.since == stamp)
            fence = tx.fence(fdid) if hold is None else None
            if fence is not None:  # the last holder's lease ended; the lender must reset it
                raise DeviceFencedError(fdid, spec.lender, str(fence.holder))
            view = self._view(tx, topo, fdid, holder.node, holder)
            adm = admit(topo, view, fdid, holder.node, ram, holder, msi_over_ntb, self._p2p_count)
            adm.raise_if_refused()
            record = HoldRecord(fdid, holder, stamp, Phase.RESERVED, ram.size)
            tx.add_hold(record, adm.claims)
            if adm.p2p is not None:
                tx.replace_claims(ClaimKind.P2P, adm.vm_devices, adm.p2p)
            claimed.append(len(adm.claims))
            return Reservation.of(self._status(tx, spec), created=True)

        reservation = self._reg.transact(body)
        if claimed:
            log.info("reserved %#x for %s (%d claims)", fdid, holder, claimed[0])
        return reservation

    def interrupt_window(self, fdid: int) -> Claim | None:
        """The interrupt window (MSI over the NTB) ``fdid``'s hold was admitted with; None:
        its interrupts use the relay."""
        from vmlend.ledger.msiadmit import is_msi_claim, msi_share

        with self._reg.read() as tx:
            hold = tx.hold(fdid)
            if hold is None:
                return None
            # the holder's own: a shared drive's hold (its manager's) claims its shares' windows
            key = msi_share(hold.holder)
            return next(
                (c for f, c in tx.claims() if f == fdid and is_msi_claim(c) and c.share == key),
                None,
            )

    def release(self, fdid: int, holder: Holder, *, expected: ExpectedHold | None = None) -> bool:
        """End ``holder``'s hold on ``fdid``; False when it had none (another holder's hold
        is never touched), or, with ``expected``, none that it admits (a newer hold). Either
        way an mdev parent nothing uses any more goes too.

        The hardware is given back first, then the hold is dropped: the state never says a
        device is free while this process still has it mapped."""

        def ours(hold: HoldRecord | None) -> bool:
            if hold is None or not same_holder(hold.holder, holder):
                return False
            return expected is None or expected.admits(hold)

        hold = None
        if self._hw is not None:  # no hardware here (the hook, the CLI): nothing to read first
            with self._reg.read() as tx:
                hold = tx.hold(fdid)
        mine = ours(hold)
        if mine and hold is not None and self._hw is not None:
            # whatever the recorded phase: this process's hardware may still have it borrowed;
            # no phase to record, the hold goes below. The VM's open mdev is cut with the hold
            # even when nothing was borrowed (the hand-over rule, docs/simulator.md).
            self._hw.give_back(fdid, hold.holder.node, hold.holder.vm, token=hold.token)
            # every open mdev of the device (a manager's hold: its shares' too)
            self._hw.revoke(fdid)
            # the hold ends here: a step made for it later (a borrow or mdev in flight in
            # another process) is refused, as after a take-back (docs/cluster.md)
            self._hw.retire(fdid, hold.token)

        def body(tx: StateTxn) -> bool:
            # one request on etcd, not six: the hold, the release's records, and the holds of
            # the VM's other devices on its node (their peer-to-peer claims are recounted)
            tx.prefetch([fdid], held_by=[holder], release_on=self.local_node)
            hold = tx.hold(fdid)
            mine = ours(hold)
            if mine and hold is not None:
                tx.delete_hold(fdid)
                self._reclaim_p2p(tx, hold.holder)
            self._drop_unused_parent(tx, fdid)
            return mine

        mine = self._reg.transact(body)
        if mine:
            log.info("released %#x from %s", fdid, holder)
        return mine

    def _p2p_count(
        self, topo: Topology, holder: Holder, specs: Sequence[DeviceSpec]
    ) -> list[tuple[int, Claim]]:
        """The peer-to-peer claims of ``holder``'s devices ``specs`` on the routes this
        node's hardware has their maps and borrows take (``p2p_on_hardware``): a reserve's
        admission and a release count them as a link event does, or after a re-route they
        drop the claim of an entry the maps still use (found by the state machine)."""
        return p2p_on_hardware(topo, holder, specs, self._hw)

    def _reclaim_p2p(self, tx: StateTxn, holder: Holder) -> None:
        """Re-count the peer-to-peer claims of ``holder``'s remaining devices: a device gone
        takes its pairs with it, whichever hold owned their claims."""
        topo = self._topology(tx)
        try:
            left = sorted(tx.holds_of(holder))
        except StateRecordError as e:  # one damaged hold: the others' release goes on
            log.warning("peer-to-peer claims of %s kept as they were: %s", holder, e)
            return
        specs = [topo.device(f) for f in left if topo.has_device(f)]
        try:
            # on the routes the hardware's maps and borrows take, as a link event counted
            # them: after a re-route those are not the cheapest live ones, and a count on
            # these dropped the LUT entry of a source whose own crossing stayed on a dead
            # cable while its peer-to-peer left by another adapter (the state machine)
            claims = self._p2p_count(topo, holder, specs)
        except VmlendError as e:  # the remaining devices were admitted; keep their claims
            log.warning("peer-to-peer claims of %s kept as they were: %s", holder, e)
            return
        if moved := _off_admitted_routes(tx, left, claims):
            # The fabric's routes changed since admission (a discover added a cheaper cable):
            # counted anew, the pairs left would claim adapters and ports admission never
            # checked for room, while their maps stay where they were made. P2P claims are an
            # upper bound, so keeping them as they are stays true; they go with the VM's holds.
            log.warning(
                "peer-to-peer claims of %s kept as they were: counted anew they would move to"
                " %s, a route they were not admitted on",
                holder,
                ", ".join(moved),
            )
            return
        tx.replace_claims(ClaimKind.P2P, left, claims)

    def forget_unused_parent(self, fdid: int) -> bool:
        """Drop this node's parent record of ``fdid`` if no hold here and no mdev use it."""
        return self._reg.transact(lambda tx: self._drop_unused_parent(tx, fdid))

    def _drop_unused_parent(self, tx: StateTxn, fdid: int) -> bool:
        """Forget this node's parent of ``fdid`` when no hold here, no child and no share of a
        VM here remain, so a failed or finished borrow leaves the state as it was before (the
        driver, too, drops the parent when it is given back)."""
        hold = tx.hold(fdid)
        if hold is not None and hold.holder.node == self.local_node:
            return False
        if any(m.fdid == fdid for m in tx.mdevs(self.local_node)):
            return False
        if shares_on(tx, fdid, self.local_node):
            # a VM here has a share of the drive whose child is not made yet (its prepare
            # reserved the share, then needs this parent): a release must not take it away
            return False
        if not tx.delete_parent(self.local_node, fdid):
            return False
        log.info("dropped mdev parent of %#x on %s", fdid, self.local_node)
        return True

    def _own_hold(self, tx: StateTxn, fdid: int, holder: Holder) -> HoldRecord:
        hold = tx.hold(fdid)
        if hold is None:
            raise DeviceNotReservedError(fdid, str(holder))
        if not same_holder(hold.holder, holder):
            raise DeviceHeldError(fdid, hold.holder.node, hold.holder.vm)
        return hold

    def _may_borrow(self, tx: StateTxn, fdid: int, holder: Holder) -> tuple[DeviceSpec, HoldRecord]:
        spec = self._topology(tx).device(fdid)
        hold = self._own_hold(tx, fdid, holder)
        self._lender_ok(tx, spec)
        return spec, hold

    def borrow(self, fdid: int, holder: Holder) -> DeviceStatus:
        """Intent, hardware, record: check the hold, borrow the hardware, record the phase;
        when recording fails, give back what this call borrowed."""
        with self._reg.read() as tx:
            _spec, hold = self._may_borrow(tx, fdid, holder)
        # Only a borrow this call starts is undone on failure, not one recorded before.
        fresh = hold.phase is Phase.RESERVED
        if self._hw is not None:
            # Every call, not only the first: another process may have recorded the borrow,
            # and this process's hardware must follow. Idempotent for the same VM.
            # The hold's fencing token goes with it: the device refuses an older hold's step.
            self._hw.borrow(fdid, hold.holder.node, hold.holder.vm, token=hold.token)

        def record(tx: StateTxn) -> DeviceStatus:
            spec, _hold = self._may_borrow(tx, fdid, holder)
            tx.set_phase(fdid, Phase.BORROWED)
            # the crossing's switch ports, should a cable have changed since the reserve
            follow_ports(tx, self._full_topology(tx), self._hw, fdid)
            return self._status(tx, spec)

        try:
            return self._reg.transact(record)
        except BaseException:
            if fresh and self._hw is not None:
                # only the hardware borrow is undone: the hold, and the VM's mdev, go on
                self._hw.give_back(
                    fdid, hold.holder.node, hold.holder.vm, token=hold.token, revoke=False
                )
            raise

    def give_back(self, fdid: int, holder: Holder) -> DeviceStatus:
        """Hardware first, then the phase: the state never says RESERVED while mapped."""
        with self._reg.read() as tx:
            hold = tx.hold(fdid)
            if hold is not None and not same_holder(hold.holder, holder):
                raise DeviceHeldError(fdid, hold.holder.node, hold.holder.vm)
        if hold is not None and self._hw is not None:
            self._hw.give_back(fdid, hold.holder.node, hold.holder.vm, token=hold.token)

        def record(tx: StateTxn) -> DeviceStatus:
            spec = self._topology(tx).device(fdid)
            hold = tx.hold(fdid)
            if hold is not None:
                if not same_holder(hold.holder, holder):
                    raise DeviceHeldError(fdid, hold.holder.node, hold.holder.vm)
                tx.set_phase(fdid, Phase.RESERVED)
            return self._status(tx, spec)

        return self._reg.transact(record)

    def _end_borrow(self, hold: HoldRecord) -> None:
        """End ``hold``'s hardware borrow: the one way the paths that take a device from its
        VM (lender reclaim, lender down) do it, as ``give_back`` and ``release`` do for the VM's
        own. Hardware first, outside any registry transaction: the hardware's borrow-end
        subscribers remove every mapping from or to the device; their failure raises (the
        device is fenced) and leaves the hold as it was. Then the phase, if the hold is still
        the same one."""
        if self._hw is not None:
            self._hw.give_back(hold.fdid, hold.holder.node, hold.holder.vm, token=hold.token)
        if hold.phase is not Phase.BORROWED:
            return  # nothing to record

        def record(tx: StateTxn) -> None:
            now = tx.hold(hold.fdid)
            same = now is not None and same_holder(now.holder, hold.holder)
            if same and now is not None and now.phase is Phase.BORROWED:
                tx.set_phase(hold.fdid, Phase.RESERVED)

        self._reg.transact(record)

    # --- mdevs on this node ------------------------------------------------------------------
    def ensure_mdev_parent(self, fdid: int) -> str:
        def body(tx: StateTxn) -> str:
            topo = self._topology(tx)
            spec = topo.device(fdid)
            self._lender_ok(tx, spec)
            rec = tx.device(fdid)
            if rec is None or not rec.lent:
                raise DeviceNotLentError(fdid, spec.lender)
            route(topo, spec.lender, self.local_node)  # the driver offers only reachable devices
            existing = tx.parent(self.local_node, fdid)
            if existing is not None:
                return existing.name
            tx.add_parent(ParentRecord(self.local_node, fdid, parent_name(fdid)))
            return parent_name(fdid)

        return self._reg.transact(body)

    def create_mdev(self, fdid: int, uuid: str, holder: Holder) -> MdevInfo:
        uuid = _uuid(uuid)
        if holder.node != self.local_node:
            raise MdevError(
                f"the mdev for {holder} belongs on {holder.node}, not on {self.local_node}:"
                " mdevs are created on the borrower"
            )

        def body(tx: StateTxn) -> MdevInfo:
            self._topology(tx).device(fdid)
            found = existing_mdev(tx, uuid, fdid, holder, self.local_node)
            if found is not None:
                return found
            parent = tx.parent(self.local_node, fdid)
            if parent is None:
                raise MdevError(
                    f"no mdev parent {parent_name(fdid)} on {self.local_node}: the SmartIO"
                    f" driver does not offer device {fdid:#x} here yet"
                )
            self._own_hold(tx, fdid, holder)
            for other in tx.mdevs(self.local_node):
                if other.fdid == fdid:
                    raise MdevError(
                        f"device {fdid:#x} already has mdev {other.uuid}"
                        f" (VM {other.vm or '?'}); remove it first"
                    )
            rec = MdevRecord(
                uuid, fdid, self.local_node, parent.name, MDEV_TYPE, holder.vm, self._clock()
            )
            tx.add_mdev(rec)
            return mdev_info(rec, created=True)

        return self._reg.transact(body)

    def remove_mdev(self, uuid: str) -> bool:
        uuid = _uuid(uuid)

        def body(tx: StateTxn) -> bool:
            rec = tx.mdev(uuid)
            if rec is None or rec.node != self.local_node:
                return False
            return tx.delete_mdev(uuid)

        return self._reg.transact(body)

    def mdevs(self) -> list[MdevInfo]:
        with self._reg.read() as tx:
            return [mdev_info(m) for m in tx.mdevs(self.local_node)]

    def mdev_records(self) -> list[MdevInfo]:
        """The records are the ledger's mdevs: what it has is what it recorded."""
        return self.mdevs()


def _off_admitted_routes(
    tx: StateTxn, owners: Sequence[int], claims: Sequence[tuple[int, Claim]]
) -> list[str]:
    """The adapters and ports where ``claims`` (the P2P claims of ``owners`` counted anew)
    claim something ``owners`` do not claim already: empty when they are a part of the claims
    in place, as when a device of the VM goes and the routes are those admission counted on.
    Reads the claims on the new claims' adapters only."""
    mine = set(owners)
    have: dict[tuple[int, Claim], int] = {}
    for f, c in tx.claims_on({c.adapter for _f, c in claims}):
        if f in mine and c.kind is ClaimKind.P2P:
            have[(f, c)] = have.get((f, c), 0) + 1
    moved = set()
    for f, c in claims:
        if have.get((f, c), 0) > 0:
            have[(f, c)] -= 1
        else:
            moved.add(c.adapter)
    return sorted(moved)
