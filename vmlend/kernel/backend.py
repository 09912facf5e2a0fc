"""``SmartioFabric``: the ``Fabric`` interface over the real kernel.

Two sources of truth, each for what it knows:

- the shared registry (``vmlend.registry``) decides *who holds what*: reservations, adapter
  claims, admission, mdev records. That bookkeeping is the same as the simulated cluster's, so
  it is delegated to a ``Ledger`` over the same registry rather than written twice;
- the SmartIO driver and the mdev ABI (docs/smartio-contract.md, ``vmlend.kernel.mdev``) say
  what the hardware can do right now: whether a device is lent and reachable, whether its
  parent exists, which children exist. Their word wins over the registry's for availability.

Every step that changes the kernel records enough to undo itself when a later step fails.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from vmlend.errors import (
    DeviceHeldError,
    DeviceNotLentError,
    DeviceNotReservedError,
    FabricError,
    HostError,
    LenderUnavailableError,
    MdevError,
    MdevParentNotFoundError,
    MdevTypeNotFoundError,
    NvmeShareError,
    SharingUnsupportedError,
    StaleTokenError,
    SysfsAttributeError,
    UnknownDeviceError,
    UnsafePathError,
    VmlendError,
)
from vmlend.hostenv import HostEnv
from vmlend.kernel import sharefiles
from vmlend.kernel.dmafiles import (
    DmaReport,
    Window,
    format_windows,
    state_records,
    windows_for,
)
from vmlend.kernel.driver import (
    MDEV_TYPE,
    Availability,
    SmartioDevice,
    SmartioDriver,
    device_name,
    fdid_of,
)
from vmlend.kernel.made_mdevs import MadeMdev, MadeMdevs, notes_dir
from vmlend.kernel.mdev import MdevBus, SysfsWriter, normalize_uuid
from vmlend.kernel.nvmeshare import (
    clear_share,
    share_report,
    share_state,
    share_support,
    write_share,
)
from vmlend.kernel.p2pfiles import P2PDifference, P2PReport
from vmlend.kernel.p2pio import P2PFiles
from vmlend.kernel.p2psync import P2POutcome, P2PSync
from vmlend.kernel.sharefiles import ShareReport, ShareState, ShareValues
from vmlend.kernel.udev import DmaChange, Outcome, ParentWatcher, Reaction, WantedMdev
from vmlend.ledger.admission import AdapterUsage, PortUsage, vm_share
from vmlend.ledger.ledger import Ledger
from vmlend.ledger.shareops import SHARE_MDEV_TYPE, SHARE_RECORD
from vmlend.memory.dmarecords import DMA_REFUSAL, DMA_WINDOW, REFUSAL_KEY
from vmlend.registry import (
    ClaimKind,
    FenceRecord,
    Registry,
    RegistryLocation,
    StateTxn,
    open_registry,
    same_holder,
)
from vmlend.registry.records import Claim, ExpectedHold, HoldRecord, RuntimeRecord
from vmlend.topology.model import (
    Check,
    DeviceState,
    DeviceStatus,
    GuestRam,
    Holder,
    MdevInfo,
    NodeSpec,
    Reservation,
    Topology,
)

if TYPE_CHECKING:  # the NVMe geometry is imported on a share's first use only
    from vmlend.nvme.shares import Share

log = logging.getLogger(__name__)


def overlay(status: DeviceStatus, dev: SmartioDevice | None, local_node_id: int) -> DeviceStatus:
    """The registry's status corrected by what the driver reports now (pure).

    The driver can only take availability away (unreachable, withdrawn): a device is offered
    when both the registry and the lender's driver say so."""
    state = status.state
    if dev is None or dev.availability is Availability.UNREACHABLE:
        state = DeviceState.UNAVAILABLE
    elif dev.availability is Availability.UNLENT and state is DeviceState.AVAILABLE:
        state = DeviceState.UNLENT  # the lender withdrew it
    if (
        state is DeviceState.RESERVED
        and dev is not None
        and dev.borrower_node_id == local_node_id
        and status.holder is not None
    ):
        state = DeviceState.BORROWED  # the guest enabled it: the driver took the borrow
    if state is status.state:
        return status
    return DeviceStatus(spec=status.spec, state=state, holder=status.holder)


class SmartioFabric:
    """The kernel backend. ``env`` locates sysfs; ``writer`` is the sysfs writer (tests pass a
    fake kernel)."""

    def __init__(
        self,
        registry: Registry,
        env: HostEnv,
        local_node: str | None = None,
        writer: SysfsWriter | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._state = Ledger(registry, local_node=local_node, clock=clock)
        self.local_node = self._state.local_node
        self.env = env
        self.driver = SmartioDriver(env, writer)
        self.bus = MdevBus(env, writer)
        #: The children this host made, noted outside the registry (they outlive a lease).
        self.made = MadeMdevs(notes_dir(env))
        #: The damaged devices the last ``devices()`` left out (not part of ``Fabric``).
        self.unreadable: list[SysfsAttributeError] = []

    def close(self) -> None:
        self._state.close()

    @property
    def registry(self) -> Registry:
        return self._state.registry

    # --- taking back what a vanished holder had (``TakesBack``) -----------------------------
    def fenced(self) -> list[FenceRecord]:
        return self._state.fenced()

    def take_back(self, fence: FenceRecord) -> bool:
        """The driver unmaps and resets the device (with the fence's token, so a late
        take-back never touches a newer holder's borrow), then the fence goes. False when the
        driver refused a stale token or a new hold appeared meanwhile."""
        try:
            self.driver.take_back(fence.fdid, fence.token)
        except StaleTokenError as e:
            log.warning("%s", e)
            return False
        return self._state.take_back(fence)

    def __enter__(self) -> SmartioFabric:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- reading -------------------------------------------------------------------------------
    def topology(self) -> Topology:
        return self._state.topology()

    def nodes(self) -> list[NodeSpec]:
        return self._state.nodes()

    def usage(self) -> dict[str, AdapterUsage]:
        return self._state.usage()

    def port_usage(self) -> list[PortUsage]:
        return self._state.port_usage()

    def _local_node_id(self) -> int:
        return self.topology().node(self.local_node).node_id

    def devices(self, lender: str | None = None) -> list[DeviceStatus]:
        """Every device of the registry as the driver sees it now. A device whose attributes
        are damaged shows as unavailable (nobody can borrow what cannot be read); the errors
        stay in ``unreadable`` for the caller to report."""
        self.driver.require()
        found, self.unreadable = self.driver.scan()
        seen = {d.fdid: d for d in found}
        me = self._local_node_id()
        return [overlay(s, seen.get(s.fdid), me) for s in self._state.devices(lender)]

    def device(self, fdid: int) -> DeviceStatus:
        status = self._state.device(fdid)
        return overlay(status, self._driver_device(fdid), self._local_node_id())

    def _driver_device(self, fdid: int) -> SmartioDevice | None:
        self.driver.require()
        try:
            return self.driver.device(fdid)
        except UnknownDeviceError:
            return None

    def _require_available(self, fdid: int) -> None:
        """The driver's word on whether ``fdid`` can be borrowed now."""
        dev = self._driver_device(fdid)
        lender = self._state.topology().device(fdid).lender
        if dev is None:
            raise LenderUnavailableError(fdid, lender, "is not known to this host's SmartIO driver")
        if dev.availability is Availability.UNREACHABLE:
            raise LenderUnavailableError(fdid, lender)
        if dev.availability is Availability.UNLENT:
            raise DeviceNotLentError(fdid, lender)

    # --- lender side: only the host the device is installed in can lend it -----------------
    def _require_local(self, fdid: int, verb: str) -> None:
        lender = self._state.topology().device(fdid).lender
        if lender != self.local_node:
            raise FabricError(
                f"device {fdid:#x} is installed in {lender}, not in {self.local_node}:"
                f" run 'vmlend {verb} {fdid:#x}' on {lender}"
            )

    def lend(self, fdid: int) -> DeviceStatus:
        self._require_local(fdid, "lend")
        self.driver.lend(fdid)
        self._state.lend(fdid)
        return self.device(fdid)

    def lend_many(
        self, fdids: Sequence[int], progress: Callable[[int], None] | None = None
    ) -> list[DeviceStatus]:
        for fdid in fdids:  # every one this host's before any is offered
            self._require_local(fdid, "lend")
        for fdid in fdids:
            self.driver.lend(fdid)
        return self._state.lend_many(fdids, progress)

    def unlend(self, fdid: int) -> DeviceStatus:
        self._require_local(fdid, "unlend")
        self._state.unlend(fdid)  # refuses while anyone holds it
        try:
            self.driver.unlend(fdid)
        except FabricError:
            self._state.lend(fdid)  # undo: the driver still lends it
            raise
        return self.device(fdid)

    # --- borrower side -------------------------------------------------------------------------
    def admission(
        self,
        fdid: int,
        borrower: str,
        guest_ram: GuestRam | int = 0,
        *,
        holder: Holder | None = None,
        msi_over_ntb: bool = False,
    ) -> list[Check]:
        # As reserve: an interrupt window only where the driver can map MSI over the NTB.
        msi_over_ntb = msi_over_ntb and self.driver.msi_capable(fdid)
        checks = self._state.admission(
            fdid, borrower, guest_ram, holder=holder, msi_over_ntb=msi_over_ntb
        )
        try:
            self._require_available(fdid)
            checks.insert(0, Check("driver", True, "the SmartIO driver offers the device"))
        except FabricError as e:
            checks.insert(0, Check("driver", False, str(e)))
        return checks

    def vm_admission(
        self,
        fdids: list[int],
        borrower: str,
        guest_ram: GuestRam | int,
        *,
        holder: Holder,
        leaving: Holder | None = None,
    ) -> dict[int, list[Check]]:
        # the driver's word is about this node; the destination's view is the registry's
        return self._state.vm_admission(fdids, borrower, guest_ram, holder=holder, leaving=leaving)

    def reserve(
        self,
        fdid: int,
        holder: Holder,
        *,
        guest_ram: GuestRam | int = 0,
        msi_over_ntb: bool = False,
    ) -> Reservation:
        self._require_available(fdid)
        # An interrupt window only where the driver can map MSI over the NTB: else the claim
        # would take a segment, and status would say ntb, for interrupts the relay carries.
        msi_over_ntb = msi_over_ntb and self.driver.msi_capable(fdid)
        made = self._state.reserve(fdid, holder, guest_ram=guest_ram, msi_over_ntb=msi_over_ntb)
        if not made.created and self._hold_is_spent(fdid, holder):
            # A release of this hold spent its token at the driver and then failed in the
            # registry: the driver refuses every step of it. End it and take a new one.
            log.info(
                "the hold of %#x for %s was spent by a release that did not land; taking a"
                " new one", fdid, holder,
            )  # fmt: skip
            self.release(fdid, holder)
            made = self._state.reserve(
                fdid, holder, guest_ram=guest_ram, msi_over_ntb=msi_over_ntb
            )
        return Reservation.of(self.device(fdid), created=made.created)

    def _hold_is_spent(self, fdid: int, holder: Holder) -> bool:
        with self._state.registry.read() as tx:
            hold = tx.hold(fdid)
        if hold is None or not hold.token or not same_holder(hold.holder, holder):
            return False
        return hold.token <= self.driver.spent(fdid)

    def interrupt_window(self, fdid: int) -> Claim | None:
        return self._state.interrupt_window(fdid)

    def holds_of(self, holder: Holder) -> dict[int, HoldRecord]:
        return self._state.holds_of(holder)

    def release(self, fdid: int, holder: Holder, *, expected: ExpectedHold | None = None) -> bool:
        with self._state.registry.read() as tx:
            hold = tx.hold(fdid)
        if (
            hold is not None
            and hold.token
            and same_holder(hold.holder, holder)
            and (expected is None or expected.admits(hold))
        ):
            # the device before the registry: the hold's token is spent, so a step made for
            # it that another process has in flight (an mdev creation) is refused after this
            with contextlib.suppress(UnknownDeviceError):  # left the fabric: serves nobody
                self.driver.spend(fdid, hold.token)
        released = self._state.release(fdid, holder, expected=expected)
        # Also on a re-run that found no hold: an earlier run may have left the parent.
        self._drop_parent_if_unused(fdid)
        return released

    def _drop_parent_if_unused(self, fdid: int) -> None:
        """When no hold on this node, no share of a VM here and no child in the kernel remain
        for ``fdid``, forget its stale child and parent records and write ``unborrow``: it
        unregisters the parent and ends the driver's remembering, so a returning lender does
        not bring the parent back for a VM that is gone. The contract makes it succeed with no
        parent registered, so it is always sent."""
        name = device_name(fdid)
        if any(d.parent == name for d in self.bus.devices()):
            return
        hold = self._state.holds().get(fdid)
        if hold is not None and hold.holder.node == self.local_node:
            return
        if self._state.shares_here(fdid):
            # a VM here has a share of the drive whose child is not in the kernel (its prepare
            # makes it next, or the watcher once the lender is back): its records and the
            # parent stay for it
            return
        for m in self._state.mdevs():
            if m.fdid == fdid:
                # A child the driver took away with an unreachable lender: with no hold left
                # here no VM runs with it, so the watcher must not re-create it.
                self._state.remove_mdev(m.uuid)
        for made in self.made.all():
            if made.fdid == fdid:
                self._forget(made.uuid)  # the kernel has no child of it any more
        self._state.forget_unused_parent(fdid)
        self._unborrow(fdid)

    def _unborrow(self, fdid: int) -> None:
        try:
            self.driver.unregister_parent(fdid)
        except (FabricError, HostError) as e:
            log.warning("could not unregister mdev parent %s: %s", device_name(fdid), e)

    def borrow(self, fdid: int, holder: Holder) -> DeviceStatus:
        self._require_available(fdid)
        self._state.borrow(fdid, holder)
        return self.device(fdid)

    def give_back(self, fdid: int, holder: Holder) -> DeviceStatus:
        self._state.give_back(fdid, holder)
        return self.device(fdid)

    # --- mdevs on this node --------------------------------------------------------------------
    def ensure_mdev_parent(self, fdid: int) -> str:
        """Have the driver register ``fdid``'s parent, then record it: the registry names only
        parents the driver accepted. A parent this call registered is unregistered again when
        a later step (the parent not appearing, the registry refusing) fails."""
        self._require_available(fdid)
        name = device_name(fdid)
        had = (self.env.mdev_bus / name).exists()
        self.driver.register_parent(fdid)
        try:
            try:
                self.bus.parent(name).type(MDEV_TYPE)
            except MdevParentNotFoundError:
                raise MdevError(
                    f"the SmartIO driver accepted 'borrow {fdid:#x}' but no mdev parent {name}"
                    f" appeared under {self.env.mdev_bus}; see 'dmesg'"
                ) from None
            recorded = self._state.ensure_mdev_parent(fdid)  # lent, reachable, routed
            if recorded != name:
                raise FabricError(
                    f"registry names parent {recorded!r} for {fdid:#x}, driver {name!r}"
                )
        except BaseException:
            if not had:
                self._unborrow(fdid)
            raise
        return name

    def create_mdev(self, fdid: int, uuid: str, holder: Holder) -> MdevInfo:
        info = self._state.create_mdev(fdid, uuid, holder)  # checks the hold, records it
        self._note(info)
        try:
            # the hold's fencing token first: the driver refuses a step of an older hold
            hold = self._state.holds().get(fdid)
            if hold is not None and hold.token:
                self.driver.set_token(fdid, hold.token)
            self.bus.create(info.parent, info.type_id, info.uuid)
        except (MdevError, StaleTokenError):
            if info.created:  # undo only the record this call made, never another process's
                self._state.remove_mdev(info.uuid)
                self._forget(info.uuid)
            raise
        return info

    def _note(self, info: MdevInfo) -> None:
        """Note the child on this host before the kernel makes it. Without the note the child
        is still made and released as usual; only a release after a lease loss would leave
        it (and say how to remove it)."""
        made = MadeMdev(info.uuid, info.fdid or 0, info.parent, info.type_id, self.local_node,
                        info.vm)  # fmt: skip
        try:
            # the same child of the same VM again (a re-acquire): its noted RAM stays, or the
            # watcher could no longer write the windows of a child it re-creates
            old = self.made.get(info.uuid)
            if old is not None and old.ram is not None:
                made = old if msgspec.structs.replace(old, ram=None) == made else made
            self.made.note(made)
        except (UnsafePathError, OSError) as e:
            log.warning("could not note mdev %s on this host: %s", info.uuid, e)

    def _forget(self, uuid: str) -> None:
        try:
            self.made.forget(uuid)
        except (UnsafePathError, OSError) as e:
            log.warning("could not drop the note of mdev %s: %s", uuid, e)

    def remove_mdev(self, uuid: str) -> bool:
        dev = self.bus.device(uuid)
        if dev is not None and dev.type_id == SHARE_MDEV_TYPE:
            fdid = fdid_of(dev.parent)
            if fdid is not None:
                # the share's queues, guard and MSI end at the driver under the epoch this
                # child wrote, before the child goes (a newer epoch's run is left alone); a
                # refused clear still removes the child, whose removal ends its share only
                # under the epoch it wrote (docs/smartio-contract.md, section 7)
                try:
                    clear_share(self.driver, fdid, dev.uuid)
                except VmlendError as e:
                    log.warning("share of mdev %s not cleared before its removal: %s", uuid, e)
        removed = self.bus.remove(uuid)  # MdevBusyError keeps the record: it still exists
        recorded = self._state.remove_mdev(uuid)
        self._forget(uuid)
        return removed or recorded

    # --- NVMe shares (docs/smartio-contract.md section 7; ``lending.shares.ShareFabric``) -----
    def _require_shareable(self, fdid: int, paths: int) -> None:
        """The driver's word on whether ``fdid`` can be shared: its ``nvme_share``."""
        self.driver.require()
        support = share_support(self.driver, fdid)
        if not support.supported:
            raise SharingUnsupportedError(fdid, support.why)
        if paths > 1:
            raise SharingUnsupportedError(
                fdid,
                "a share with a backup path runs on the simulated fabric only (its relay rings"
                " are software); reserve it with one path",
            )

    def reserve_share(
        self,
        fdid: int,
        holder: Holder,
        queue_pairs: int,
        blocks: int,
        *,
        guest_ram: GuestRam | int = 0,
        paths: int = 1,
    ) -> Share:
        self._require_shareable(fdid, paths)
        # its interrupts' window only where the driver maps MSI over the NTB (section 6)
        return self._state.reserve_share(
            fdid,
            holder,
            queue_pairs,
            blocks,
            guest_ram=guest_ram,
            paths=paths,
            msi=self.driver.msi_capable(fdid),
        )

    def release_share(self, fdid: int, holder: Holder) -> bool:
        released = self._state.release_share(fdid, holder)
        self._drop_share_parent(fdid)
        return released

    def _drop_share_parent(self, fdid: int) -> None:
        """After a share's release: with no child left under ``fdid``'s parent here and no
        record needing it (another VM's share child, a hold on this node, another VM's share
        here whose child its prepare has yet to make), forget the parent and write
        ``unborrow``, as a borrowed device's release does. Also on a re-run."""
        if any(d.parent == device_name(fdid) for d in self.bus.devices()):
            return
        self._state.forget_unused_parent(fdid)
        with self._state.registry.read() as tx:
            if tx.parent(self.local_node, fdid) is not None:
                return
        self._unborrow(fdid)

    def shares_held(self, holder: Holder) -> list[int]:
        return self._state.shares_held(holder)

    def share_of(self, fdid: int, holder: Holder) -> Share | None:
        return self._state.share_of(fdid, holder)

    def share_values(self, fdid: int, holder: Holder) -> ShareValues:
        """What ``holder``'s share child of ``fdid`` is written: the registry's share under
        its epoch (``NvmeShareError`` when it has none)."""
        from vmlend.ledger import nvmeshares, sharemove

        with self._state.registry.read() as tx:
            share = nvmeshares.holder_share(tx, fdid, holder)
            epoch = sharemove.epoch(tx, fdid, holder)
        if share is None or epoch is None:
            raise NvmeShareError(
                f"{holder} has no share of device {fdid:#x}; reserve one before its mdev"
            )
        if share.paths != 1:
            self._require_shareable(fdid, share.paths)
        return sharefiles.share_values(share, epoch)

    def create_share_mdev(self, fdid: int, uuid: str, holder: Holder) -> MdevInfo:
        """Record ``holder``'s share child, create it (type ``smartio-nvme_share``) and write
        its ``nvme_share``. A refusal removes the child and the record this call made."""
        info = self._state.create_share_mdev(fdid, uuid, holder)  # checks the share, records
        self._note(info)
        made = False
        try:
            values = self.share_values(fdid, holder)
            try:
                self.bus.parent(info.parent).type(SHARE_MDEV_TYPE)
            except MdevTypeNotFoundError:
                raise SharingUnsupportedError(
                    fdid,
                    f"its mdev parent {info.parent} offers no {SHARE_MDEV_TYPE} type (a SmartIO"
                    " driver without section 7's share children); lend it whole",
                ) from None
            made = self.bus.device(info.uuid) is None
            self.bus.create(info.parent, SHARE_MDEV_TYPE, info.uuid)
            write_share(self.driver, fdid, info.uuid, sharefiles.format_share(values), values.epoch)
        except (VmlendError, OSError):
            if made:  # only the child this call made: a re-acquire's running share stays
                with contextlib.suppress(MdevError):
                    self.bus.remove(info.uuid)
            if info.created:
                self._state.remove_mdev(info.uuid)
                self._forget(info.uuid)
            raise
        return info

    def share_state(self, uuid: str) -> ShareState | None:
        """What the driver runs for share child ``uuid`` (None: no ``nvme_share_state``)."""
        return share_state(self.driver, uuid)

    # --- reconcile of the share children (``fabric.base.ChecksShares``) ---------------------
    def share_report(self, uuid: str) -> ShareReport | None:
        """Share child ``uuid``'s files as read (None: it has no ``nvme_share``)."""
        return share_report(self.driver, uuid)

    def registry_share(self, fdid: int, holder: Holder) -> ShareValues | None:
        """What ``holder``'s share child of ``fdid`` is to be written (None: the registry has
        no share of it for the VM)."""
        try:
            return self.share_values(fdid, holder)
        except NvmeShareError:
            return None

    def local_shares(self) -> list[tuple[int, Holder]]:
        """Every share the registry has for a VM of this node: (drive, its VM)."""
        from vmlend.ledger import nvmeshares

        with self._state.registry.read() as tx:
            entries = [nvmeshares.share_entry(r) for r in tx.runtime(None, SHARE_RECORD)]
        return [(e.fdid, e.holder) for e in entries if e.holder.node == self.local_node]

    def rewrite_share(self, fdid: int, uuid: str, holder: Holder) -> None:
        """Write the registry's share of ``holder`` to its child ``uuid`` again, under the
        share's epoch (``vmlend reconcile --fix``): a child that has another epoch is refused
        (``NvmeShareError``); one whose driver runs other values is cleared first (the driver
        refuses other values over a running share, EBUSY)."""
        values = self.share_values(fdid, holder)
        report = share_report(self.driver, uuid)
        if report is None or report.damaged:
            raise FabricError(
                f"share mdev {uuid} has no readable nvme_share"
                + (f" ({report.damaged})" if report is not None else "")
                + "; 'vmlend doctor' says what the SmartIO driver lacks"
            )
        if report.epoch != values.epoch and (report.written is not None or report.epoch):
            # (an empty file reads epoch 0: never written, any epoch may be its first)
            raise NvmeShareError(
                f"share mdev {uuid} has epoch {report.epoch}, the registry's share"
                f" {values.epoch}: not written again; stop the VM and start it again"
            )
        running = report.state.values if report.state is not None else None
        if running is not None and running != values:
            clear = sharefiles.format_clear(values.epoch)
            write_share(self.driver, fdid, uuid, clear, values.epoch)
        write_share(self.driver, fdid, uuid, sharefiles.format_share(values), values.epoch)

    # --- the data path of this node's children (docs/smartio-contract.md section 8) ---------
    def expected_windows(self, fdid: int, ram: GuestRam) -> tuple[Window, ...]:
        """The DMA windows of a guest with RAM ``ram`` for ``fdid``: the planner's
        ``window_groups`` with the segment size of the lender adapter the driver reports
        (``lender_adapter``), as the topology declares that adapter."""
        return windows_for(ram.ranges, self._segment_size(fdid))

    def _segment_size(self, fdid: int) -> int:
        dev = self.driver.device(fdid)
        topology = self.topology()
        ref = f"{topology.device(fdid).lender}:{dev.lender_adapter}"
        adapter = topology.adapter(ref)
        if adapter is None:
            raise FabricError(
                f"device {fdid:#x} is reached through adapter {ref} (the SmartIO driver's"
                " lender_adapter), which the topology does not declare; add it to the topology"
            )
        return adapter.segment_size

    def write_dma_windows(
        self, fdid: int, uuid: str, ram: GuestRam, *, holder: Holder
    ) -> tuple[Window, ...] | None:
        """Write child ``uuid``'s ``dma_windows``: the hold's fencing token and the guest's
        RAM as windows. A re-write of the same windows changes nothing at the driver. None
        when the driver has no ``smartio/`` group (it warned). Only for ``holder``'s VM
        while it holds ``fdid`` on this node: another VM's token would let this child's
        windows (``holder``'s RAM) pass the driver's fencing check for that VM's borrow."""
        windows = self.expected_windows(fdid, ram)
        hold = self._state.holds().get(fdid)
        if hold is None:
            raise DeviceNotReservedError(fdid, str(holder))
        if not same_holder(hold.holder, holder) or hold.holder.node != self.local_node:
            raise DeviceHeldError(fdid, hold.holder.node, hold.holder.vm)
        token = hold.token
        text = format_windows(token, windows)
        self._note_ram(uuid, ram)
        if not self.driver.write_dma_windows(fdid, uuid, token, text):
            return None
        return windows

    def _note_ram(self, uuid: str, ram: GuestRam) -> None:
        """Keep the VM's RAM in the child's note, before its windows are written: the watcher
        re-creating the child writes them from there. Without a note (it could not be made)
        only that re-creation lacks the windows, and it says so."""
        try:
            made = self.made.get(uuid)
            if made is not None and made.ram != ram:
                self.made.note(msgspec.structs.replace(made, ram=ram))
        except (UnsafePathError, OSError) as e:
            log.warning("could not note the RAM of mdev %s on this host: %s", uuid, e)

    def rewrite_windows(self, wanted: WantedMdev) -> None:
        """After the watcher re-created ``wanted``: write its DMA windows from the RAM this
        host noted when the VM started, with the hold's current token, as ``acquire_device``
        does. Without a note of this VM's with RAM the child is left without windows (a Bus
        Master enable is then refused ``ENODATA``), with one warning. The driver's refusal is
        raised (the watcher undoes the child)."""
        uuid = normalize_uuid(wanted.uuid)
        if wanted.type_id == SHARE_MDEV_TYPE:
            self._rewrite_share(uuid, wanted)
            return
        # First whose the device is now: a VM whose hold ended while its lender was away (its
        # lease too, and another VM's hold since) gets no child back (raised: the watcher
        # removes it again), with windows or without.
        rec = next((m for m in self._state.mdevs() if m.uuid == uuid), None)
        if rec is not None and rec.fdid is not None:
            hold = self._state.holds().get(rec.fdid)
            if hold is None:
                raise DeviceNotReservedError(rec.fdid, f"{self.local_node}/{wanted.vm}")
            if hold.holder.node != self.local_node or hold.holder.vm != wanted.vm:
                raise DeviceHeldError(rec.fdid, hold.holder.node, hold.holder.vm)
        try:
            made = self.made.get(uuid)
        except (UnsafePathError, OSError) as e:
            log.warning("could not read the note of mdev %s: %s", uuid, e)
            made = None
        problem = ""
        if made is None:
            problem = "this host has no note of it"
        elif (made.vm, made.node, made.parent) != (wanted.vm, self.local_node, wanted.parent):
            # the registry's record wins: a note naming another VM (or node, or parent) is
            # not this child's, and its RAM would map the wrong guest
            problem = f"its note names VM {made.vm!r} on {made.node}, not {wanted.vm!r}"
        elif made.ram is None or not made.ram.ranges:
            problem = "its note has no RAM layout (noted before vmlend kept one)"
        if problem or made is None or made.ram is None:
            log.warning(
                "re-created mdev %s of %s without DMA windows: %s; 'vmlend reconcile --fix'"
                " writes them", uuid, wanted.vm, problem,
            )  # fmt: skip
            return
        windows = self.write_dma_windows(
            made.fdid, uuid, made.ram, holder=Holder(self.local_node, wanted.vm)
        )
        if windows is not None:
            names = ", ".join(w.name for w in windows) or "none"
            log.info("DMA windows (%s) written to re-created mdev %s of %s", names, uuid, wanted.vm)

    def _rewrite_share(self, uuid: str, wanted: WantedMdev) -> None:
        """A share child the watcher re-created (its lender came back): write its share again,
        as the VM's share is in the registry now (its epoch included). A VM whose share ended
        meanwhile gets no child back (raised: the watcher removes it again)."""
        rec = next((m for m in self._state.mdevs() if m.uuid == uuid), None)
        fdid = rec.fdid if rec is not None else fdid_of(wanted.parent)
        if fdid is None:
            raise NvmeShareError(f"share mdev {uuid} has no SmartIO parent ({wanted.parent})")
        values = self.share_values(fdid, Holder(self.local_node, wanted.vm))
        write_share(self.driver, fdid, uuid, sharefiles.format_share(values), values.epoch)
        log.info("NVMe share written to re-created mdev %s of %s", uuid, wanted.vm)

    def dma_report(self, uuid: str) -> DmaReport | None:
        """What the driver says of child ``uuid``'s DMA windows (None: no ``smartio/``)."""
        return self.driver.dma_report(uuid)

    def record_dma(self, uuid: str) -> str | None:
        """Keep what the driver reports in child ``uuid``'s ``dma_state`` as its device's
        runtime records (after a ``SMARTIO_DMA`` event, or ``reconcile --fix``): one
        ``dma-window`` record per mapped window, none on ``none``, a ``dma-refusal`` for a
        refusal (``vmlend.memory.dmarecords``). Only a child this host made for the VM that
        holds its device now writes records, checked in the same transaction: a child vmlend
        did not record, another node's, or one whose VM's hold ended is ignored (None, logged).
        Returns the state's one line."""
        uuid = normalize_uuid(uuid)
        report = self.dma_report(uuid)  # the file before the registry: read no sysfs in a txn
        if report is None:
            log.info("mdev %s has no smartio/ group (gone, or not a SmartIO child); ignored", uuid)
            return None
        if report.damaged or report.state is None:
            log.warning("mdev %s: its dma_state cannot be read: %s", uuid, report.damaged)
            return None
        state = report.state
        topology = self.topology()

        def segment_size(ref: str) -> int | None:
            adapter = topology.adapter(ref)
            return None if adapter is None else adapter.segment_size

        def body(tx: StateTxn) -> str:
            rec = tx.mdev(uuid)
            if rec is None or rec.node != self.local_node:
                return "vmlend made no such child on this host"
            hold = tx.hold(rec.fdid)
            if hold is None or hold.holder.node != rec.node or hold.holder.vm != rec.vm:
                return f"its VM {rec.vm!r} does not hold device {rec.fdid:#x} now"
            lender = topology.device(rec.fdid).lender
            kept = state_records(state, uuid, lender, segment_size)
            tx.clear_runtime(rec.fdid, DMA_WINDOW)
            tx.clear_runtime(rec.fdid, DMA_REFUSAL)
            for name, data in kept.windows.items():
                tx.put_runtime(rec.fdid, DMA_WINDOW, name, data)
            if kept.refusal is not None:
                tx.put_runtime(rec.fdid, DMA_REFUSAL, REFUSAL_KEY, kept.refusal)
            return ""

        ignored = self._state.registry.transact(body)
        if ignored:
            log.info("SMARTIO_DMA of mdev %s ignored: %s", uuid, ignored)
            return None
        log.info("mdev %s: DMA %s", uuid, state.summary())
        return state.summary()

    def dma_claimed(self, holder: Holder) -> dict[str, int]:
        """The segments ``holder``'s VM's DMA-window claims hold per lender adapter (one claim
        per adapter, shared by the VM's devices: counted once, at its largest)."""
        share = vm_share(holder)
        out: dict[str, int] = {}
        with self._state.registry.read() as tx:
            for _fdid, c in tx.claims():
                if c.kind is ClaimKind.DMA and c.share == share:
                    out[c.adapter] = max(out.get(c.adapter, 0), c.segments)
        return out

    def dma_records(self, fdid: int) -> list[RuntimeRecord]:
        """The ``dma-window`` records of ``fdid`` (for ``vmlend reconcile``)."""
        with self._state.registry.read() as tx:
            return tx.runtime(fdid, DMA_WINDOW)

    def p2p_report(self, uuid: str, fdid: int) -> P2PReport | None:
        """What the driver says of child ``uuid``'s peer-to-peer (None: no such files)."""
        return P2PFiles(self.env, self.bus.writer).report(uuid, fdid)

    def p2p_drift(self, holder: Holder) -> list[P2PDifference]:
        """Where ``holder``'s VM's maps differ from what vmlend plans (``P2PSync.compare``)."""
        return P2PSync(self).compare(holder)

    def sync_p2p(self, holder: Holder) -> P2POutcome:
        """Plan and write ``holder``'s VM's maps again."""
        return P2PSync(self).sync(holder)

    def mdevs(self) -> list[MdevInfo]:
        """The children the kernel has under SmartIO parents (of any type, vmlend's or not),
        with the VM the registry knows for each ("" for a child vmlend did not record)."""
        records = {m.uuid: m for m in self._state.mdevs()}
        out = []
        for d in self.bus.devices():
            fdid = fdid_of(d.parent)
            if fdid is None:
                continue  # another driver's child (mtty, a GPU's vGPU...)
            rec = records.get(d.uuid)
            out.append(
                MdevInfo(
                    uuid=d.uuid,
                    parent=d.parent,
                    type_id=d.type_id,
                    fdid=fdid,
                    node=self.local_node,
                    vm=rec.vm if rec else "",
                )
            )
        return out

    def mdev_records(self) -> list[MdevInfo]:
        """The children the registry records on this node (made, or about to be: the record
        comes first), whether or not the kernel has them; and those this host noted that the
        registry no longer records (their records went with a lost lease, ``made_mdevs``)."""
        records = self._state.mdevs()
        known = {m.uuid for m in records}
        noted = [m.info() for m in self.made.all() if m.node == self.local_node]
        return records + [m for m in noted if m.uuid not in known]

    # --- reacting to the kernel ----------------------------------------------------------------
    def wanted_mdevs(self) -> list[WantedMdev]:
        """Children that must exist: those the registry records on this node (a record lives
        from the prepare hook to the release hook, i.e. while the VM runs)."""
        return [WantedMdev(m.uuid, m.parent, m.type_id, m.vm) for m in self._state.mdevs()]

    def watcher(self) -> ParentWatcher:
        """A udev watcher that re-creates running VMs' children when a parent returns and marks
        the device unavailable in the shared state while its parent is gone."""

        def mark(available: bool) -> Callable[[str], None]:
            def set_(parent: str) -> None:
                fdid = fdid_of(parent)
                if fdid is not None:
                    self._state.set_device_available(fdid, available)

            return set_

        def dma(change: DmaChange) -> Reaction | None:
            said = self.record_dma(change.uuid)
            if said is None:
                return None
            rec = next((m for m in self._state.mdevs() if m.uuid == change.uuid), None)
            parent, vm = (rec.parent, rec.vm) if rec is not None else ("", "")
            return Reaction(parent, Outcome.DMA_RECORDED, change.uuid, vm, said)

        return ParentWatcher(
            self.bus,
            self.wanted_mdevs,
            mark(False),
            mark(True),
            on_recreated=self.rewrite_windows,
            on_dma=dma,
            on_child=P2PSync(self).handle,  # the children's SMARTIO_BARS / SMARTIO_P2P
        )


def open_smartio_fabric(
    state_path: str | Path | RegistryLocation,
    node: str | None = None,
    env: HostEnv | None = None,
    writer: SysfsWriter | None = None,
) -> SmartioFabric:
    """The kernel backend over the registry at ``state_path`` (a path or registry URL; for
    ``vmlend.wiring.fabric``)."""
    env = env or HostEnv.from_env()
    registry = open_registry(state_path, topology_cache=env.topology_cache)
    try:
        return SmartioFabric(registry, env, local_node=node, writer=writer)
    except BaseException:
        registry.close()
        raise
