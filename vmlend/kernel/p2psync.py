"""The kernel backend acting on a child's ``SMARTIO_BARS`` / ``SMARTIO_P2P`` uevent
(docs/smartio-contract.md section 8): read the files, decide with ``vmlend.kernel.p2pevents``,
write each source's ``p2p`` and keep ``p2p_state`` as the registry's ``p2p-map`` records (on
the source device, as the simulator's mapper keeps them, so they go with its hold).

A refusal never stops the watcher: ``handle`` logs it and returns it as a ``P2POutcome``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from vmlend.errors import P2PError, VmlendError
from vmlend.kernel.driver import MDEV_TYPE
from vmlend.kernel.p2pevents import (
    Child,
    ChildEvent,
    child_event,
    map_record,
    over_claims,
    plan_writes,
    state_records,
)
from vmlend.kernel.p2pfiles import (
    P2PDifference,
    P2PReport,
    compare_maps,
    over_segments,
    segments_by_adapter,
)
from vmlend.kernel.p2pio import P2PFiles, Written
from vmlend.kernel.udev import Uevent
from vmlend.p2p import RECORD_KIND, GuestBar
from vmlend.registry.records import ClaimKind, same_holder
from vmlend.topology.model import GuestRange, Holder

if TYPE_CHECKING:
    from vmlend.kernel.backend import SmartioFabric
    from vmlend.registry import StateTxn

log = logging.getLogger(__name__)


class P2POutcome(msgspec.Struct, frozen=True):
    """What one event led to: the sources written, those waiting (``ENOTCONN``/``EAGAIN``),
    and the error that refused the step ("" when none)."""

    uuid: str
    vm: str = ""
    written: tuple[int, ...] = ()
    waiting: tuple[int, ...] = ()
    error: str = ""


class P2PSync:
    """Peer-to-peer of the VMs on ``fabric``'s node, driven by their children's uevents."""

    def __init__(self, fabric: SmartioFabric, files: P2PFiles | None = None) -> None:
        self.fabric = fabric
        self.files = files or P2PFiles(fabric.env, fabric.bus.writer)
        self.outcomes: list[P2POutcome] = []

    def handle(self, ev: Uevent) -> P2POutcome | None:
        """Act on ``ev`` if it is a child's section 8 event; errors are logged, not raised."""
        what = child_event(ev)
        if what is None:
            return None
        try:
            out = self._act(what)
        except VmlendError as e:
            log.warning("peer-to-peer of mdev %s: %s", what.uuid, e)
            out = P2POutcome(what.uuid, error=str(e))
        if out is not None:
            self.outcomes.append(out)
        return out

    def _act(self, what: ChildEvent) -> P2POutcome | None:
        found = self.vm_of(what.uuid)
        if found is None:
            return None  # not a child vmlend made for a VM here
        holder, children = found
        out = P2POutcome(what.uuid, holder.vm)
        if what.bars:
            out = self.sync_vm(holder, children, what.uuid)
        if what.p2p:  # with SMARTIO_BARS too (a reset): the driver's own removals, kept
            for c in children:
                if c.uuid == what.uuid:
                    self._record_state(c)
        return out

    # --- who ----------------------------------------------------------------------------------
    def vm_of(self, uuid: str) -> tuple[Holder, list[Child]] | None:
        """The holder whose VM child ``uuid`` serves and every borrowed child of that VM on
        this node (each with its hold's token); None for a child vmlend did not record."""
        node = self.fabric.local_node
        me = next(
            (
                m
                for m in self.fabric.mdev_records()
                if m.uuid == uuid and m.node == node and m.type_id == MDEV_TYPE
            ),
            None,
        )
        if me is None:
            return None
        with self.fabric.registry.read() as tx:
            hold = tx.hold(me.fdid or 0)
        if hold is None or hold.holder.node != node or hold.holder.vm != me.vm:
            return None
        return hold.holder, self.children_of(hold.holder)

    def children_of(self, holder: Holder) -> list[Child]:
        """Every child this node recorded for ``holder``'s VM whose device it holds."""
        node = self.fabric.local_node
        with self.fabric.registry.read() as tx:
            holds = tx.holds()
        children = []
        for m in self.fabric.mdev_records():
            h = holds.get(m.fdid or 0)
            if (
                m.node == node
                and m.type_id == MDEV_TYPE
                and m.vm == holder.vm
                and h is not None
                and same_holder(h.holder, holder)
            ):
                children.append(Child(m.uuid, m.fdid or 0, h.token))
        return sorted(children, key=lambda c: c.fdid)

    # --- SMARTIO_BARS ---------------------------------------------------------------------------
    def sync_vm(self, holder: Holder, children: Sequence[Child], uuid: str = "") -> P2POutcome:
        """Plan over the guest's BARs now and write every source's ``p2p``; refuse (write
        nothing) when the plan needs more than admission claimed."""
        present: list[Child] = []
        bars: list[GuestBar] = []
        for c in children:
            decoded = self.files.guest_bars(c.uuid, c.fdid)
            if decoded is None:
                continue  # no peer-to-peer files: this driver predates them
            present.append(c)
            bars.extend(decoded)
        ram = self._ram(present)
        topology = self.fabric.topology()
        plan, writes = plan_writes(topology, self.fabric.local_node, present, bars, ram)
        with self.fabric.registry.read() as tx:
            claims = [c for _f, c in tx.claims()]
        over = over_claims(topology, holder, plan.maps, claims)
        if over:
            raise P2PError(
                f"peer-to-peer of VM {holder.vm!r} needs more than admission claimed, so"
                f" nothing was written: {over[0]}"
                + (f" (and {len(over) - 1} more)" if len(over) > 1 else "")
                + "; 'vmlend reconcile' re-counts the VM's claims, or the guest must place"
                " its BARs as admission assumed"
            )
        for s in plan.skipped:
            log.info("peer-to-peer of %s: %s", holder.vm, s.reason)
        written: list[int] = []
        waiting: list[int] = []
        for w in writes:
            result = self.files.write(w.child.fdid, w.child.uuid, w.child.token, w.lines, ram)
            if result.outcome is Written.WRITTEN:
                written.append(w.child.fdid)
                planned = {m.key: m for m in plan.from_source(w.child.fdid)}
                self._record_state(w.child, planned)
            elif result.outcome is Written.WAIT:
                waiting.append(w.child.fdid)
        return P2POutcome(uuid, holder.vm, tuple(written), tuple(waiting))

    def _ram(self, children: Sequence[Child]) -> list[GuestRange]:
        """The guest's RAM, as the children's written DMA windows say (equal for every child
        of one VM): the planner keeps BARs off it."""
        for c in children:
            report = self.fabric.dma_report(c.uuid)
            if report is not None and report.written is not None:
                return [r for w in report.written.windows for r in w.ranges]
        return []

    # --- reconcile: what the driver has against what vmlend plans -----------------------------
    def compare(self, holder: Holder) -> list[P2PDifference]:
        """Each child's ``p2p_state`` against ``plan_p2p`` over the guest's BARs now, its
        token against the hold's, and the distinct segments per adapter against the VM's P2P
        claims; one line each. Children without the files are ``vmlend doctor``'s."""
        children = self.children_of(holder)
        reports = {c.uuid: self.files.report(c.uuid, c.fdid) for c in children}
        out: list[P2PDifference] = []
        present: list[Child] = []
        for c in children:
            report = reports[c.uuid]
            if report is None:
                continue
            if report.damaged:
                damaged = f"its peer-to-peer files are damaged: {report.damaged}"
                out.append(P2PDifference(c.fdid, c.uuid, damaged))
                continue
            present.append(c)
        if out or not present:
            # a plan without a damaged child's BARs would call its peers' maps to it drift
            return out
        bars = [b for c in present for b in (reports[c.uuid] or P2PReport()).bars]
        topology = self.fabric.topology()
        try:
            ram = self._ram(present)
            plan, _ = plan_writes(topology, self.fabric.local_node, present, bars, ram)
        except VmlendError as e:
            first = present[0]
            why = f"the guest's BARs cannot be mapped peer-to-peer: {e}"
            return [*out, P2PDifference(first.fdid, first.uuid, why)]
        used: dict[str, set[int]] = {}
        for c in present:
            report = reports[c.uuid] or P2PReport()
            rewrite = "; 'vmlend reconcile --fix' writes the maps again"
            for line in compare_maps(plan.from_source(c.fdid), report.state):
                out.append(P2PDifference(c.fdid, c.uuid, line + rewrite, rewrite=True))
            if report.written is not None and report.written.token != c.token:
                out.append(
                    P2PDifference(
                        c.fdid,
                        c.uuid,
                        f"the peer-to-peer maps were written under fencing token"
                        f" {report.written.token}, the hold's is {c.token}{rewrite}",
                        rewrite=True,
                    )
                )
            lender = topology.device(c.fdid).lender
            for index, segs in segments_by_adapter(report.state).items():
                used.setdefault(f"{lender}:{index}", set()).update(segs)
        over = over_segments(used, self._claimed(holder, [c.fdid for c in children]))
        first = present[0]
        out += [P2PDifference(first.fdid, first.uuid, line) for line in over]
        return out

    def _claimed(self, holder: Holder, fdids: Sequence[int]) -> dict[str, int]:
        """Segments the VM's P2P claims hold per adapter (a shared claim counted once)."""
        largest: dict[tuple[str, str], int] = {}
        with self.fabric.registry.read() as tx:
            for fdid, c in tx.claims():
                if fdid in fdids and c.kind is ClaimKind.P2P and c.segments:
                    key = (c.adapter, c.share)
                    largest[key] = max(largest.get(key, 0), c.segments)
        out: dict[str, int] = {}
        for (adapter, _share), n in largest.items():
            out[adapter] = out.get(adapter, 0) + n
        return out

    def sync(self, holder: Holder) -> P2POutcome:
        """Plan and write ``holder``'s VM's maps now (``vmlend reconcile --fix``)."""
        return self.sync_vm(holder, self.children_of(holder))

    # --- p2p_state -> records -------------------------------------------------------------------
    def _record_state(self, child: Child, planned: dict[str, Any] | None = None) -> None:
        state = self.files.state(child.uuid)
        if state is None:
            return
        def body(tx: StateTxn) -> bool:
            # The hold the child was found under, still: the event often comes while a
            # borrow ends, and a record put now under another hold (a new borrower's, with
            # its own token) would claim maps of a VM that no longer has the device.
            hold = tx.hold(child.fdid)
            if hold is None or hold.token != child.token:
                return False
            old = {r.key: r.data for r in tx.runtime(child.fdid, RECORD_KIND)}
            # after a write the plan's maps are the records; after the driver's own change
            # the ones already kept
            kept = old if planned is None else {k: map_record(m, None) for k, m in planned.items()}
            new = state_records(child.fdid, state, kept)
            for key in old.keys() - new.keys():
                tx.clear_runtime(child.fdid, RECORD_KIND, key)
            for key, data in new.items():
                if old.get(key) != data:
                    tx.put_runtime(child.fdid, RECORD_KIND, key, data)
            return True

        if not self.fabric.registry.transact(body):
            log.info("p2p_state of mdev %s not kept: its hold ended meanwhile", child.uuid)
