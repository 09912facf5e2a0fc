"""Taking a remote device for a VM on this node and giving it back: the steps shared by the
qemu hook (at VM start and stop) and the CLI (hot-add and hot-remove, where libvirt runs no
hook, and the clean-up before a migration).

Taking a device is reserve -> ensure the mdev parent -> create the mdev child. Every step that
changed something pushes its undo on an ``UndoJournal``, so a caller that fails later (another
device, libvirt refusing the hot-plug) rolls back exactly what was done, in reverse.
Returning is idempotent: it converges on "nothing held" however often it runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from uuid import UUID

import msgspec

from vmlend.errors import RegistryUnreachableError, StateRecordError, VmlendError
from vmlend.fabric.base import Fabric, WritesDmaWindows
from vmlend.faults import fault_point
from vmlend.messages import about
from vmlend.registry.records import ExpectedHold, HoldRecord, same_holder
from vmlend.topology.model import (
    DEFAULT_INTERRUPTS,
    GuestRam,
    Holder,
    InterruptPath,
    MdevInfo,
    format_fdid,
)

log = logging.getLogger(__name__)

#: Where a step reports what it did (the hook's action log, the CLI's progress lines).
Record = Callable[[str], None]


def _ignore(_msg: str) -> None:
    pass


class UndoJournal(msgspec.Struct):
    """Undo steps of an operation in progress, run in reverse on failure."""

    steps: list[tuple[str, Callable[[], object]]] = msgspec.field(default_factory=list)

    def push(self, what: str, undo: Callable[[], object]) -> None:
        self.steps.append((what, undo))

    def rollback(self, record: Record = _ignore) -> list[str]:
        """Undo every step (newest first); keeps going past failures and returns them."""
        failed: list[str] = []
        for what, undo in reversed(self.steps):
            try:
                undo()
                record(f"undo {what}: ok")
            except VmlendError as e:  # keep undoing the rest; say what could not be undone
                record(f"undo {what}: FAILED: {e}")
                failed.append(f"{what}: {e}")
        self.steps.clear()
        return failed

    def __len__(self) -> int:
        return len(self.steps)


def holder_for(fabric: Fabric, vm: str, vm_uuid: UUID | str | None) -> Holder:
    """The holder a VM on this node is in the shared state."""
    return Holder(node=fabric.local_node, vm=vm, vm_uuid=str(vm_uuid or ""))


def acquire_device(
    fabric: Fabric,
    holder: Holder,
    fdid: int,
    mdev: UUID | str,
    journal: UndoJournal,
    *,
    guest_ram: GuestRam | int = 0,
    interrupts: InterruptPath = DEFAULT_INTERRUPTS,
    record: Record = _ignore,
) -> str:
    """Reserve ``fdid`` for ``holder`` (with an interrupt window over the NTB when
    ``interrupts`` asks for it and there is room), make sure its mdev parent exists on this
    node and create the mdev child ``mdev``. Returns the parent's name. What this call newly
    did is pushed on ``journal``; what was already there (a re-run, or another process acting
    for the same VM) is left alone on rollback. Whether a step created something is the
    fabric's answer from inside its own write transaction, never a look taken before it:
    between a look and the write another process may create the very thing this call would
    then undo."""
    fd = format_fdid(fdid)
    uuid = str(mdev)
    msi_over_ntb = interrupts is InterruptPath.NTB
    if fabric.reserve(fdid, holder, guest_ram=guest_ram, msi_over_ntb=msi_over_ntb).created:
        journal.push(f"reserve {fd}", lambda: fabric.release(fdid, holder))
    record(f"reserve {fd}: ok")
    parent = fabric.ensure_mdev_parent(fdid)
    if fabric.create_mdev(fdid, uuid, holder).created:
        journal.push(f"mdev {uuid}", lambda: fabric.remove_mdev(uuid))
    record(f"mdev {uuid} for {fd} under {parent}: ok")
    if isinstance(fabric, WritesDmaWindows):
        # a refusal fails the step: the journal removes the child as for a refused create
        write_windows(fabric, fdid, uuid, guest_ram, record, holder)
    return parent


def write_windows(
    fabric: WritesDmaWindows,
    fdid: int,
    uuid: str,
    guest_ram: GuestRam | int,
    record: Record,
    holder: Holder,
) -> None:
    """Write the child's DMA windows (docs/smartio-contract.md section 8) where the guest's
    layout is known. A bare byte count (the agent re-taking a hold it recorded) says nothing
    of the ranges, and a guessed layout would map the wrong RAM: those windows are left to
    ``vmlend reconcile --fix``, which reads the domain's XML."""
    fd = format_fdid(fdid)
    if not isinstance(guest_ram, GuestRam) or not guest_ram.ranges:
        record(f"mdev {uuid}: DMA windows not written: the guest's layout is not known here")
        return
    windows = fabric.write_dma_windows(fdid, uuid, guest_ram, holder=holder)
    if windows is None:
        record(f"mdev {uuid}: DMA windows not written: the SmartIO driver has no smartio/ group")
    else:
        names = ", ".join(w.name for w in windows) or "none"
        record(f"DMA windows of {fd} ({names}) written to mdev {uuid}: ok")


def lost_holds(
    fabric: Fabric, holder: Holder, fdids: Iterable[int], *, unreadable_is_lost: bool = True
) -> list[tuple[int, str]]:
    """Which of ``fdids`` ``holder`` no longer holds, each with why (read now, device by
    device). A step that took devices and then waited (a hook or CLI frozen or starved past
    the TTL while its host's agent was dead) may have outlived the lease its holds were on:
    they ended with it, the lenders took the devices back and another VM may have one. Read
    last thing before the devices are handed to the guest (the VM starts, the hostdev is
    plugged); a lease that ends after that read is the agent's to handle.
    ``unreadable_is_lost`` false: a hold the registry cannot be read for counts as kept (a
    device already plugged stays on a guess: the agent checks before it resumes a VM)."""
    out: list[tuple[int, str]] = []
    for fdid in fdids:
        try:
            held = fabric.device(fdid).holder
        except VmlendError as e:
            if unreadable_is_lost:
                out.append((fdid, f"cannot confirm it is still held for the VM: {e}"))
            continue
        if held is not None and same_holder(held, holder):
            continue
        reason = "its hold ended meanwhile (this host's lease ended)"
        if held is not None:
            reason += f"; it is held by {held.node}/{held.vm} now"
        out.append((fdid, reason))
    return out


def return_device(
    fabric: Fabric, holder: Holder, fdid: int, mdev: UUID | str | None, record: Record = _ignore
) -> bool:
    """Remove mdev ``mdev`` if the registry records it as ``holder``'s (``recorded_for``) and
    end ``holder``'s reservation of ``fdid``. Idempotent; returns whether anything was still
    there. Never touches another holder's device, nor an mdev vmlend recorded for another VM or
    did not record at all (the action log says so)."""
    fd = format_fdid(fdid)
    changed = False
    if mdev is not None:
        uuid = _canonical(mdev)
        m = next((m for m in fabric.mdev_records() if m.uuid == uuid), None)
        if m is None:
            _note_unrecorded(fabric, {uuid}, record)
        elif not recorded_for(m, holder):
            record(left_alone(m))
        elif fabric.remove_mdev(uuid):
            record(f"mdev {mdev}: removed")
            changed = True
    if fabric.release(fdid, holder):
        record(f"device {fd}: returned")
        changed = True
    return changed


def return_all(
    fabric: Fabric,
    holder: Holder,
    devices: Iterable[tuple[int, UUID | str]],
    record: Record = _ignore,
) -> list[str]:
    """Return every device of a stopped VM: the ones its XML names (``(fdid, mdev)`` pairs) and
    whatever a crashed earlier run or a stale XML left held by it on this node (matched by VM
    UUID, else by name). The mdevs removed are exactly those the registry records for this VM
    (``recorded_for``), whether or not the host still has them: a record made before a crash
    cut off the creation is dropped. Nothing else under the parents of its devices is touched
    (children another driver, ``mdevctl`` or another share made), nor an mdev the XML names
    that vmlend recorded for another VM or not at all. Idempotent. Returns the failures
    (empty when all is clean); keeps going past them so one bad device does not keep the
    others."""
    failures: list[str] = []
    named = list(devices)
    wanted = {_canonical(m) for _f, m in named}
    records = fabric.mdev_records()

    stuck: set[int] = set()  # devices whose mdev could not be removed keep their hold
    for m in records:
        if not recorded_for(m, holder):
            if m.uuid in wanted:
                record(left_alone(m))
            continue
        try:
            if fabric.remove_mdev(m.uuid):
                record(f"mdev {m.uuid}: removed")
        except RegistryUnreachableError:
            raise  # the whole release is retried later (release_journal)
        except VmlendError as e:
            failures.append(f"mdev {m.uuid}: {e}")
            if m.fdid is not None:
                stuck.add(m.fdid)
    _note_unrecorded(fabric, wanted - {m.uuid for m in records}, record)
    fault_point("release:after-mdevs")
    fdids = {f for f, _m in named}
    try:
        fdids.update(held_by(fabric, holder))
    except StateRecordError as e:
        # one damaged record must not keep the others held: judge device by device
        failures.append(str(e))
        recorded = {m.fdid for m in records if m.fdid is not None}
        holds = _holders_one_by_one(fabric, fdids | recorded)
        fdids.update(f for f, h in holds.items() if h is not None and same_holder(h, holder))
    for fdid in sorted(fdids - stuck):
        try:
            if fabric.release(fdid, holder):
                record(f"device {format_fdid(fdid)}: returned")
        except RegistryUnreachableError:
            raise  # the whole release is retried later (release_journal)
        except VmlendError as e:
            failures.append(about(f"device {format_fdid(fdid)}", str(e)))
    for fdid in sorted(stuck):
        failures.append(
            f"device {format_fdid(fdid)} stays reserved while its mdev exists; "
            "remove the mdev and run the release again"
        )
    return failures


def return_pending(
    fabric: Fabric,
    holder: Holder,
    fdid: int,
    mdev: str,
    expected: ExpectedHold,
    held: Mapping[int, HoldRecord],
    records: Sequence[MdevInfo],
    record: Record = _ignore,
) -> str | None:
    """Land one device of a release recorded while the registry was away (``release_journal``;
    the caller knows the VM does not run here): this device only, never the VM's others.
    ``held``: the VM's holds now (``Fabric.holds_of``); ``records``: the node's mdev records.

    A hold of the VM that ``expected`` does not admit is newer than the release (the VM took
    the device again): neither it nor the VM's mdev on the device is touched. Else the VM's
    mdevs on the device go, then the hold, judged again in the transaction that ends it. None
    when the device needs nothing more (returned, or not this release's to return any more);
    else why it must wait (its mdev could not be removed, the release failed)."""
    fd = format_fdid(fdid)
    hold = held.get(fdid)
    if hold is not None and not expected.admits(hold):
        record(
            f"device {fd}: left alone: the VM holds it under a newer hold (token {hold.token})"
            " than this pending release"
        )
        return None
    wanted = _canonical(mdev)
    for m in records:
        if not recorded_for(m, holder) or (m.fdid != fdid and m.uuid != wanted):
            continue
        try:
            if fabric.remove_mdev(m.uuid):
                record(f"mdev {m.uuid}: removed")
        except RegistryUnreachableError:
            raise
        except VmlendError as e:
            return f"mdev {m.uuid}: {e}; device {fd} stays reserved while its mdev exists"
    try:
        if fabric.release(fdid, holder, expected=expected):
            record(f"device {fd}: returned")
        else:
            record(f"device {fd}: nothing of this release held it any more")
    except RegistryUnreachableError:
        raise
    except VmlendError as e:
        return about(f"device {fd}", str(e))
    return None


def _note_unrecorded(fabric: Fabric, uuids: set[str], record: Record) -> None:
    """Say which of ``uuids`` (mdevs a domain names that vmlend has no record of) the host
    has all the same: they are left alone (``not_recorded``). Lists the host's mdevs only
    when there is something to look for (a re-run of a release finds no records left)."""
    if uuids:
        for m in fabric.mdevs():
            if m.uuid in uuids:
                record(not_recorded(m))


def _holders_one_by_one(fabric: Fabric, fdids: Iterable[int]) -> dict[int, Holder | None]:
    """Who holds each of ``fdids``, read one device at a time; a damaged one holds nobody
    here (its own release then reports it)."""
    out: dict[int, Holder | None] = {}
    for fdid in fdids:
        try:
            out[fdid] = fabric.device(fdid).holder
        except VmlendError:
            out[fdid] = None
    return out


def _canonical(mdev: UUID | str) -> str:
    """The form mdev listings use; a malformed UUID is left for the fabric to refuse."""
    try:
        return str(UUID(str(mdev)))
    except ValueError:
        return str(mdev)


def recorded_for(m: MdevInfo, holder: Holder) -> bool:
    """Whether the registry records mdev ``m`` (one of ``Fabric.mdev_records``) as
    ``holder``'s: made on its node for its VM (``create_mdev`` records the VM before the
    child exists). The record alone decides: not the hold of its device (children of other
    types, or that vmlend never made, sit under the same parent), nor that a domain names it
    (a copied or forged XML must not take another VM's mdev away)."""
    return m.node == holder.node and bool(m.vm) and m.vm == holder.vm


def left_alone(m: MdevInfo) -> str:
    """The action-log line for an mdev a domain names but another VM owns: a copied or forged
    XML, whose release must not take the other VM's device away."""
    owner = f"{m.node}/{m.vm}" if m.vm else "another VM"
    return f"mdev {m.uuid}: named by this domain but serves {owner}; left alone"


def not_recorded(m: MdevInfo) -> str:
    """The action-log line for an mdev a domain names that this host has but vmlend has no
    record of: vmlend removes only what it recorded, so it stays."""
    return (
        f"mdev {m.uuid}: named by this domain but vmlend has no record of it; left alone"
        f" ('vmlend mdev remove {m.uuid}' removes it)"
    )


def held_by(fabric: Fabric, holder: Holder) -> list[int]:
    """The fdids ``holder``'s VM holds on its node (same VM: by UUID when both carry one,
    else by name)."""
    return [st.fdid for st in fabric.devices() if st.holder and same_holder(st.holder, holder)]
