"""``SimFabric``: the simulated SmartIO cluster's fabric, the ledger with simulated hardware.

The bookkeeping is the production ledger's (``vmlend.ledger.ledger``); what makes it the
simulator is the ``hardware`` it is given (``vmlend.sim.hardware.SimHardware``: LUT entries,
IOMMU domains, NTB segments), which the ledger's borrow, give-back and take-back drive. Without
hardware (the hook on the ``sim`` backend) it is the ledger alone: the simulated hardware of
a node lives in that node's hypervisor process.

With a lender register (``vmlend.sim.register``, ``$VMLEND_SIM_LENDERS``: a directory every
process of the simulated cluster shares) the steps on a device for a hold also tell the
device's lender, with the hold's fencing token, as the kernel backend tells the SmartIO driver
(``vmlend.kernel.backend``): an mdev creation writes (token, borrower) first and is refused
for a token older than the device's; the holder's mdev removal or release clears the borrower;
a take-back clears it with the fence's token and is refused for an older one. Without one,
nothing here differs from the ledger.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterator

from vmlend.errors import (
    DeviceNotReservedError,
    RegistryUnreachableError,
    StaleTokenError,
    VmlendError,
)
from vmlend.events import EventLog
from vmlend.faults import fault_point
from vmlend.ledger.ledger import MDEV_TYPE, BorrowHardware, Ledger, parent_name
from vmlend.registry import FenceRecord, Registry, same_holder
from vmlend.registry.records import ExpectedHold, HoldRecord
from vmlend.sim.register import LenderRegister, borrower_of
from vmlend.topology.model import GuestRam, Holder, MdevInfo, Reservation

__all__ = ["MDEV_TYPE", "SimFabric", "parent_name"]

log = logging.getLogger(__name__)


class SimFabric(Ledger):
    """The fabric of the simulated cluster (see the module's docstring)."""

    def __init__(
        self,
        registry: Registry,
        local_node: str | None = None,
        clock: Callable[[], float] = time.time,
        hardware: BorrowHardware | None = None,
        observer: bool = False,
        *,
        lenders: LenderRegister | None = None,
    ) -> None:
        super().__init__(registry, local_node, clock, hardware, observer)
        #: The simulated lenders' register (None: none, the ledger alone).
        self.lenders = lenders
        #: The protocol's event log (``vmlend.events``; None: none): reserves, releases.
        self.events = EventLog.from_env(local_node or "")

    @contextlib.contextmanager
    def _call(self, kind: str, **fields: int | str) -> Iterator[float]:
        """A reserve's or a release's call between ``<kind>-begun`` and ``<kind>-done`` (when
        it returns or raises), both naming the ``call``: a process killed in it noted no done,
        and its commit may have landed unrecorded (the replay's ``_cut_short``). Yields when
        the call began."""
        began = time.time()
        if self.events is None:
            yield began
            return
        call = uuid.uuid4().hex[:16]  # two threads' calls may begin at one clock reading
        self.events.note(f"{kind}-begun", began=began, call=call, **fields)
        try:
            yield began
        finally:
            self.events.note(f"{kind}-done", began=began, call=call)

    def _hold(self, fdid: int) -> HoldRecord | None:
        with self.registry.read() as tx:
            return tx.hold(fdid)

    def reserve(
        self,
        fdid: int,
        holder: Holder,
        *,
        guest_ram: GuestRam | int = 0,
        msi_over_ntb: bool = False,
    ) -> Reservation:
        with self._call("reserve", fdid=fdid, node=holder.node, vm=holder.vm) as began:

            def commit() -> Reservation:
                try:
                    return super(SimFabric, self).reserve(
                        fdid, holder, guest_ram=guest_ram, msi_over_ntb=msi_over_ntb
                    )
                except RegistryUnreachableError:
                    # its commit may have landed all the same (etcd without quorum answers 503
                    # after applying it): a hold of unknown token may exist
                    self._note_unknown(fdid, holder, began)
                    raise

            made = commit()
            fault_point("reserve:after-commit")  # killed here, nothing notes the hold
            if not made.created and self._hold_is_spent(fdid, holder):
                # A release of this hold spent its token at the device and then failed in the
                # registry (etcd away): the device refuses every step of it, so the VM's own
                # hold is dead. End it and take a new one (a new token), as after that release.
                log.info("the hold of %#x for %s was spent by a release that did not land;"
                         " taking a new one", fdid, holder)
                self.release(fdid, holder)
                made = commit()
            if self.events is not None:
                self._note_made(fdid, holder, made, began)
            return made

    def _note_made(self, fdid: int, holder: Holder, made: Reservation, began: float) -> None:
        """The event of a reserve that returned. Not created: the VM had the hold, or this
        call made it and lost the reply (a re-run then finds it); the replay tells them apart
        by the token, read back. The registry gone away since the commit: the hold exists and
        its token is unknown (``reserve-unknown``), and the reserve still returns what it
        made, as it does with no event log (the log never changes an outcome)."""
        assert self.events is not None
        try:
            token = self._token_read_back(fdid, holder)
        except RegistryUnreachableError:
            self._note_unknown(fdid, holder, began)
            return
        self.events.note("reserve", fdid=fdid, node=holder.node, vm=holder.vm, token=token,
                         created=made.created, began=began)

    def _note_unknown(self, fdid: int, holder: Holder, began: float) -> None:
        """``reserve-unknown``: a reserve that began at ``began`` may have made a hold whose
        token nobody read (the replay's ``on_reserve_unknown``)."""
        if self.events is not None:
            self.events.note("reserve-unknown", fdid=fdid, node=holder.node, vm=holder.vm,
                             began=began)

    def _token_read_back(self, fdid: int, holder: Holder) -> int:
        """The token of ``holder``'s hold of ``fdid``, read back after its commit (etcd's,
        known only then), or 0 when nothing of it is left. A reserve committed under a lease
        that expired just after (its agent dead) has lost its hold by now, but the fence it
        wrote in the same transaction has no lease and carries the same token until the
        lender takes the device back: the replay needs that token to follow the take-back."""
        with self.registry.read() as tx:
            hold = tx.hold(fdid)
            if hold is not None:
                return hold.token if same_holder(hold.holder, holder) else 0
            fence = tx.fence(fdid)
        return fence.token if fence is not None and same_holder(fence.holder, holder) else 0

    def _hold_is_spent(self, fdid: int, holder: Holder) -> bool:
        """Whether ``holder``'s hold of ``fdid`` has a token the device spent."""
        hold = self._hold(fdid)
        if hold is None or not hold.token or not same_holder(hold.holder, holder):
            return False
        spent = self._hw.spent(fdid) if self._hw is not None else 0
        if self.lenders is not None:
            spent = max(spent, self.lenders.read(fdid).retired)
        return hold.token <= spent

    def create_mdev(self, fdid: int, uuid: str, holder: Holder) -> MdevInfo:
        info = super().create_mdev(fdid, uuid, holder)  # checks the hold, records the child
        if self.lenders is None:
            return info
        try:
            # the hold's fencing token first, as the kernel backend writes the driver's
            hold = self._hold(fdid)
            if hold is None or not same_holder(hold.holder, holder):
                raise DeviceNotReservedError(fdid, str(holder))  # ended since the record
            self.lenders.serve(fdid, hold.token, borrower_of(holder.node, holder.vm))
        except (DeviceNotReservedError, StaleTokenError):
            if info.created:  # undo only the record this call made, never another process's
                super().remove_mdev(info.uuid)
            raise
        return info

    def repoint(self, fdid: int, holder: Holder, token: int) -> None:
        """A hot migration's switch-over moved ``fdid``'s hold to ``holder`` with ``token``:
        the lender serves that borrow now (``Repoints``). The simulated hardware's mappings
        live in the process that runs it, which re-points them itself
        (``vmlend.sim.hotmig``); here, the lender register is all there is."""
        if self.lenders is not None:
            self.lenders.serve(fdid, token, borrower_of(holder.node, holder.vm))

    def remove_mdev(self, uuid: str) -> bool:
        if self.lenders is not None:
            with self.registry.read() as tx:
                rec = tx.mdev(uuid)
                hold = tx.hold(rec.fdid) if rec is not None else None
            if rec is not None and rec.node == self.local_node and rec.vm:
                # the device first: nothing reaches it through the child once it is gone
                ours = hold is not None and (hold.holder.node, hold.holder.vm) == (
                    rec.node,
                    rec.vm,
                )
                token = hold.token if ours and hold is not None else None
                self.lenders.end(rec.fdid, borrower_of(rec.node, rec.vm), token)
        return super().remove_mdev(uuid)

    def release(self, fdid: int, holder: Holder, *, expected: ExpectedHold | None = None) -> bool:
        hold = self._hold(fdid) if self.lenders is not None or self.events is not None else None
        mine = hold if hold is not None and same_holder(hold.holder, holder) else None
        # what this release ends: not a hold its expected hold does not admit
        ends = mine if mine is not None and (expected is None or expected.admits(mine)) else None
        if self.lenders is not None and ends is not None:
            # the device before the registry: it never serves a borrow the state ended and
            # spends its token: an mdev creation that read the hold before this release
            # (another process's) is refused when it serves it after
            self.lenders.end(fdid, borrower_of(holder.node, holder.vm), ends.token, spend=True)
        token = ends.token if ends is not None else 0
        with self._call("release", fdid=fdid, node=holder.node, vm=holder.vm,
                        token=token) as began:
            try:
                released = super().release(fdid, holder, expected=expected)
            except RegistryUnreachableError:
                if self.events is not None and mine is not None:
                    # its commit may have landed; its journal lands it later, and that
                    # landing's commit was no sooner than this call began
                    self.events.note("release-unknown", fdid=fdid, node=holder.node,
                                     vm=holder.vm, token=mine.token, began=began)
                raise
            if released:  # killed here, nothing notes the end
                fault_point("release:after-commit")
            if self.events is not None:
                self._note_end(fdid, holder, mine, released, expected, began)
            return released

    def _note_end(
        self,
        fdid: int,
        holder: Holder,
        mine: HoldRecord | None,
        released: bool,
        expected: ExpectedHold | None,
        began: float,
    ) -> None:
        """The events of a release that returned (``mine``: the holder's hold it found)."""
        assert self.events is not None
        landing = expected is not None
        if mine is not None:
            if released and expected is not None and not expected.token:
                # A pending release that knew no token: its VM's prepare met the registry
                # away, and its reserve may have committed and lost its reply, noting
                # nothing. Its hold is noted as made here (as a lost reply; one the history
                # has seen already is the VM's own, no change), so its end has a beginning.
                self.events.note("reserve", fdid=fdid, node=holder.node, vm=holder.vm,
                                 token=mine.token, created=False)
            self._note_release(fdid, holder, mine.token, released, landing, began)
        elif expected is not None and expected.token:
            # A pending release landing after its first run committed and lost its reply (the
            # registry went away mid-call): that run could note nothing, and here the hold is
            # gone already, the device free or held by another VM since (seed 20 on
            # 2026-11-30: alpha's reserve came 0.1 s before the landing). Its token is the
            # journal's, so the history still shows the end.
            self._note_release(fdid, holder, expected.token, released, landing, began)

    def _note_release(
        self,
        fdid: int,
        holder: Holder,
        token: int,
        released: bool,
        landing: bool = False,
        began: float = 0.0,
    ) -> None:
        """The event of ``holder``'s release of ``fdid`` (hold ``token``): it ended it; or it
        found it gone, and its fence with it (this call's earlier run committed and lost its
        reply), or not (the lease took the hold; nothing to note)."""
        assert self.events is not None
        if not released:
            try:
                with self.registry.read() as tx:
                    now, fence = tx.hold(fdid), tx.fence(fdid)
            except VmlendError:
                return
            if (now is not None and now.token == token) or (
                fence is not None and fence.token == token
            ):
                return
        self.events.note("release", fdid=fdid, node=holder.node, vm=holder.vm, token=token,
                         lost_reply=not released, landing=landing, began=began)

    def take_back(self, fence: FenceRecord) -> bool:
        if self.lenders is not None:
            try:  # the fence's token: a late take-back never touches a newer holder's borrow
                self.lenders.take_back(fence.fdid, fence.token)
            except StaleTokenError as e:
                log.warning("%s", e)
                return False
        return super().take_back(fence)

    def reclaim(self, fdid: int) -> Holder | None:
        if self.lenders is not None:
            hold = self._hold(fdid)
            if hold is not None:
                self.lenders.take_back(fdid, hold.token)
        return super().reclaim(fdid)
