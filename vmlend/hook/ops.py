"""What the hook does for each libvirt operation, over an injected ``Fabric``.

prepare is all or nothing: every change is pushed on an undo journal, and any failure undoes
them in reverse before the error propagates. release and reconnect are idempotent, so running
them twice, or after a crash half-way, converges on the same clean state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from vmlend.domain.info import DomainXMLInfo
from vmlend.domain.metadata import VmlendDevice
from vmlend.errors import HookError, RegistryUnreachableError, VmlendError
from vmlend.fabric.base import Fabric, RegistryFabric
from vmlend.faults import fault_point
from vmlend.hook.actionlog import ActionLog
from vmlend.journal import log_fields
from vmlend.ledger import handover_record
from vmlend.ledger.handover_record import HandOverRecord, HandOverRefusedError
from vmlend.lending.devices import (
    UndoJournal,
    acquire_device,
    holder_for,
    lost_holds,
    return_all,
)
from vmlend.lending.shares import acquire_share, return_shares
from vmlend.messages import plural
from vmlend.ops.restore import restore_running
from vmlend.release_journal import hold_tokens, pend_release, settle_own
from vmlend.topology.model import Holder, format_fdid

log = logging.getLogger(__name__)


class HookOps:
    def __init__(self, fabric: Fabric, actions: ActionLog) -> None:
        self.fabric = fabric
        self.actions = actions

    def _recorder(self, dom: DomainXMLInfo, operation: str) -> Callable[[str], None]:
        """One action-log line per step of ``operation`` on ``dom``."""
        return lambda msg: self.actions.record(dom.name, operation, msg)

    def holder(self, dom: DomainXMLInfo) -> Holder:
        return holder_for(self.fabric, dom.name, dom.uuid)

    def prepare(self, dom: DomainXMLInfo) -> None:
        """Reserve every device and create its mdev, or change nothing."""
        holder = self.holder(dom)

        record = self._recorder(dom, "prepare")
        # A pending release of its last run goes first; what of it cannot land yet and this
        # run takes again is this run's now (its release returns it).
        settle_own(self.fabric, holder, record, [(d.fdid, str(d.mdev)) for d in dom.devices])

        arriving = self._arrival(dom, holder, record)
        journal = UndoJournal()
        for dev in dom.devices:
            fd = format_fdid(dev.fdid)
            if arriving is not None and dev.fdid in arriving.shares:
                record(
                    f"NVMe share of {fd}: arrives with the hot migration from {arriving.source}"
                    f" (epoch {arriving.shares[dev.fdid]}); it moves here at the switch-over"
                )
                continue
            if arriving is not None and dev.fdid in arriving.devices:
                record(
                    f"device {fd}: arrives plugged with the hot migration from"
                    f" {arriving.source} (hold token {arriving.devices[dev.fdid]}); its hold"
                    " moves here at the switch-over"
                )
                continue
            with log_fields(fdid=fd):
                self._prepare_device(dom, dev, holder, journal, record)
            fault_point("prepare:after-device")
        if arriving is None:
            self._confirm_held(dom, holder, journal, record)
        record(f"{plural(len(dom.devices), 'device')} ready")

    def _arrival(
        self, dom: DomainXMLInfo, holder: Holder, record: Callable[[str], None]
    ) -> HandOverRecord | None:
        """The hot migration bringing this VM here with its devices, as the registry's
        hand-over record shows it (``vmlend.ledger.handover_record``); None for a plain
        start. Looked for only when this VM (by UUID) holds a device of its XML on another
        node: a start that borrows never reads more than it did. A record that does not
        match fails the start, nothing changed."""
        if not isinstance(self.fabric, RegistryFabric) or not holder.vm_uuid:
            return None
        own = [d.fdid for d in dom.devices if d.share is None]
        drives = [d.fdid for d in dom.devices if d.share is not None]
        with self.fabric.registry.read() as tx:
            holds = {f: tx.hold(f) for f in own}
            shares: dict[int, tuple[Holder, int] | None] = {}
            if drives:  # the NVMe share ledger only for a VM with shares: a fast start
                from vmlend.ledger import sharemove
            for d in drives:
                has = sharemove.share_holder(tx, d, holder.vm_uuid, holder.vm)
                got = None if has is None else sharemove.epoch(tx, d, has)
                shares[d] = None if has is None or got is None else (has, got)
            if not any(
                h is not None
                and h.holder.node != holder.node
                and h.holder.vm_uuid.lower() == holder.vm_uuid.lower()
                for h in holds.values()
            ) and not any(s is not None and s[0].node != holder.node for s in shares.values()):
                return None
            found = handover_record.read(tx, [*own, *drives], holder.vm_uuid)
        try:
            return handover_record.arrival(found, holds, holder, own, shares)
        except HandOverRefusedError as e:
            record(f"FAILED: {e}")
            raise HookError(f"cannot start VM {dom.name!r}: {e}") from e

    def _prepare_device(
        self,
        dom: DomainXMLInfo,
        dev: VmlendDevice,
        holder: Holder,
        journal: UndoJournal,
        record: Callable[[str], None],
    ) -> None:
        """Reserve one device (or claim one share) and create its mdev, or roll the whole
        prepare back and fail it."""
        fd = format_fdid(dev.fdid)
        try:
            if dev.share is not None:  # a queue-level share of an NVMe drive
                acquire_share(
                    self.fabric,
                    holder,
                    dev.fdid,
                    dev.mdev,
                    dev.share,
                    journal,
                    record,
                    guest_ram=dom.guest_ram,
                )
                return
            acquire_device(
                self.fabric,
                holder,
                dev.fdid,
                dev.mdev,
                journal,
                guest_ram=dom.guest_ram,
                interrupts=dom.interrupts_of(dev),
                record=record,
            )
        except VmlendError as e:
            record(f"device {fd}: FAILED: {e}")
            journal.rollback(record)
            raise HookError(f"cannot start VM {dom.name!r}: device {fd}: {e}") from e

    def _confirm_held(
        self,
        dom: DomainXMLInfo,
        holder: Holder,
        journal: UndoJournal,
        record: Callable[[str], None],
    ) -> None:
        """Read every reserved device once more, last thing before libvirt starts the VM: a
        prepare that outlived its host's lease (the hook frozen past the TTL, its agent dead)
        lost its holds, and starting the VM anyway would run it on a device another VM may
        have taken (``lending.lost_holds``). That fails the start, undone like any other
        failure."""
        own = [dev.fdid for dev in dom.devices if dev.share is None]  # shares: the lender's
        lost = lost_holds(self.fabric, holder, own)
        if lost:
            fdid, reason = lost[0]
            fd = format_fdid(fdid)
            record(f"device {fd}: FAILED: {reason}")
            journal.rollback(record)
            raise HookError(f"cannot start VM {dom.name!r}: device {fd}: {reason}")

    def release(self, dom: DomainXMLInfo) -> None:
        """Remove this VM's mdevs and return its devices. Idempotent; also cleans up what a
        crashed earlier run or a stale XML left behind (matched by VM UUID on this node)."""

        record = self._recorder(dom, "release")

        devices = [(d.fdid, d.mdev) for d in dom.devices if d.share is None]
        shared = [(d.fdid, d.mdev) for d in dom.devices if d.share is not None]
        holder = self.holder(dom)
        tokens: dict[int, int] = {}
        try:
            # First: a release that cannot land is kept with its holds' fencing tokens, so the
            # agent never ends a newer hold with it (``release_journal``).
            tokens = hold_tokens(self.fabric, holder)
            failures = return_shares(self.fabric, holder, [m for _f, m in shared], record)
            failures += return_all(self.fabric, holder, devices, record)
        except RegistryUnreachableError as e:  # kept on the host; the agent lands it later
            pending = pend_release(holder, devices, shared, e, record, tokens)
            if pending is not None:
                raise pending from e
            return
        for f in failures:
            record(f"FAILED: {f}")
        if failures:
            raise HookError(f"release of VM {dom.name!r} incomplete: " + "; ".join(failures))

    def reconnect(self, dom: DomainXMLInfo) -> list[str]:
        """libvirtd restarted while the VM runs: make the state match the running VM, with the
        repair ``vmlend reconcile --fix`` uses for a running VM (``restore_running``).

        Returns the problems found. They are logged, not fatal: a failing reconnect hook makes
        libvirt kill the guest, which is worse than a state that needs an operator's look.
        """
        record = self._recorder(dom, "reconnect")
        try:
            ram = dom.guest_ram
        except VmlendError as e:  # reported, not fatal: the guest keeps running
            record(f"PROBLEM: {e}")
            return [str(e)]
        problems = restore_running(
            self.fabric, self.holder(dom), dom.devices, ram, record, dom.interrupts_of
        )
        if not problems:
            record(f"{plural(len(dom.devices), 'device')} consistent")
        return problems
