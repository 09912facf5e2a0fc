"""A hot migration's registry side for a VM's queue-level NVMe shares (docs/migration.md,
"Hot"): the share follows its VM like a borrowed device's hold, in the same three steps and
the same transactions (``vmlend.ledger.handover``).

A share is no hold of the VM's: it is a runtime record on the drive, which its manager holds
(``vmlend.ledger.nvmeshares``), keyed by the VM's node and name, with the NTB claims its DMA
path uses. So:

1. ``claim``: the destination's path is admitted against everything claimed (the VM's own
   devices' destination claims included: one admission, all or nothing) and kept in the
   record as ``incoming``, which the manager's hold claims beside the source's.
2. ``hand_over``: the record moves to the destination's key with the same queues, vectors,
   LBA extent and address space (its name follows its VM's node), the source's claims kept as
   ``leaving``; its mdev record moves to the destination. Its *epoch* grows by one: the
   share's fencing token, which the drive's side is told with the move and checks (it refuses
   every later step made for an older one).
3. ``release_source``: ``leaving`` goes.

``drop_incoming`` undoes 1. Every function runs inside the caller's transaction.
"""

from __future__ import annotations

from typing import Any

import msgspec

from vmlend.errors import FabricError, NotSharedError
from vmlend.ledger.admission import guest_ram_of, vm_share
from vmlend.ledger.ledger import parent_name
from vmlend.ledger.nvmeadmit import (
    check_cpu_windows,
    check_share_claims,
    cpu_window_claims,
    is_share_msi_claim,
    share_claims,
    share_msi_claims,
)
from vmlend.ledger.nvmeshares import SHARE_RECORD, claims_from, share_entry, store_claims
from vmlend.ledger.shareops import SHARE_MDEV_TYPE
from vmlend.nvme.shares import Share
from vmlend.registry import Claim, StateTxn
from vmlend.registry.records import MdevRecord, ParentRecord, RuntimeRecord
from vmlend.topology.model import GuestRam, Holder, Topology, format_fdid


def _record(tx: StateTxn, fdid: int, holder: Holder) -> RuntimeRecord | None:
    key = vm_share(holder)
    return next((r for r in tx.runtime(fdid, SHARE_RECORD) if r.key == key), None)


def epoch(tx: StateTxn, fdid: int, holder: Holder) -> int | None:
    """The fencing token of ``holder``'s share of ``fdid`` (None: it has none)."""
    r = _record(tx, fdid, holder)
    return None if r is None else int(r.data.get("epoch", 0))


def share_holder(tx: StateTxn, fdid: int, vm_uuid: str, vm: str) -> Holder | None:
    """Who has the share of ``fdid`` of VM ``vm`` (``vm_uuid``) now, on any node."""
    for r in tx.runtime(fdid, SHARE_RECORD):
        e = share_entry(r)
        if e.holder.vm == vm and e.holder.vm_uuid.lower() == vm_uuid.lower():
            return e.holder
    return None


def _put(tx: StateTxn, fdid: int, key: str, data: dict[str, Any]) -> None:
    tx.put_runtime(fdid, SHARE_RECORD, key, data)
    store_claims(tx, fdid)


def claim(
    tx: StateTxn,
    topology: Topology,
    fdid: int,
    source: Holder,
    destination: Holder,
    guest_ram: GuestRam | int,
    *,
    hot: bool = True,
) -> list[Claim]:
    """Step 1 for one share: admit its path into ``destination.node`` on top of every claim
    the transaction has now, and keep it beside the source's. ``FabricError`` (the caller's
    transaction then changes nothing) when it does not fit or (``hot``) the share cannot move
    hot; unplugged (``vmlend.ledger.shareunplug``) a share of two paths may: its relay rings
    are made again on the destination."""
    r = _record(tx, fdid, source)
    if r is None:
        raise NotSharedError(fdid)
    share = share_entry(r).share
    fd = format_fdid(fdid)
    if share.paths > 1 and hot:
        raise FabricError(
            f"the NVMe share of {fd} has a backup path, whose relay rings live in the source"
            " host's memory: it moves unplugged (--unplug)"
        )
    claims = share_claims(topology, fdid, destination, guest_ram_of(guest_ram), share.paths)
    windows = cpu_window_claims(
        topology, fdid, destination, share.cmb_extent, share.page is not None
    )
    try:  # its CPU's windows onto the drive, from the destination
        check_cpu_windows(topology, tx.claims() + tx.set_aside(), fdid, destination, windows)
        claims += windows
        check_share_claims(topology, tx.claims() + tx.set_aside(), fdid, destination, claims)
    except FabricError as e:
        raise FabricError(f"the NVMe share of {fd}: {e}") from e
    # its interrupt window follows it: the destination's, admitted like the rest (never a
    # refusal), for a share that had one; the source's stays in ``leaving`` until the source
    # is released
    if any(is_share_msi_claim(c) for c in claims_from(r.data.get("claims"))):
        claims += share_msi_claims(topology, tx.claims(), fdid, destination, claims, share.paths)
    incoming = {"holder": msgspec.to_builtins(destination), "claims": msgspec.to_builtins(claims)}
    _put(tx, fdid, r.key, {**r.data, "incoming": incoming})
    return claims


def drop_incoming(tx: StateTxn, fdid: int, source: Holder) -> None:
    """Undo ``claim`` (idempotent; a share no longer the source's is left alone)."""
    r = _record(tx, fdid, source)
    if r is not None and "incoming" in r.data:
        _put(tx, fdid, r.key, {k: v for k, v in r.data.items() if k != "incoming"})


def hand_over(
    tx: StateTxn,
    fdid: int,
    source: Holder,
    destination: Holder,
    mdev: str | None,
    clock: float,
) -> int:
    """Step 2 for one share: it becomes the destination's; returns its new epoch. The same
    again after a killed run finds it moved and returns its epoch. ``NotSharedError`` when
    the source has no share of ``fdid`` (nothing changed)."""
    there = epoch(tx, fdid, destination)
    r = _record(tx, fdid, source)
    if r is None:
        if there is not None:
            return there
        raise NotSharedError(fdid)
    old = share_entry(r).share
    moved: Share = msgspec.structs.replace(old, name=vm_share(destination))
    incoming = r.data.get("incoming") or {}
    now = int(r.data.get("epoch", 0)) + 1
    tx.clear_runtime(fdid, SHARE_RECORD, r.key)
    data = {
        "holder": msgspec.to_builtins(destination),
        "share": moved.record(),
        "claims": incoming.get("claims", []),
        "leaving": r.data.get("claims", []),
        "epoch": now,
    }
    _put(tx, fdid, vm_share(destination), data)
    if mdev is not None and tx.mdev(mdev) is not None:
        tx.delete_mdev(mdev)
        # the source's parent stays: other VMs of that node may share the drive through it
        if tx.parent(destination.node, fdid) is None:
            tx.add_parent(ParentRecord(destination.node, fdid, parent_name(fdid)))
        tx.add_mdev(
            MdevRecord(
                mdev,
                fdid,
                destination.node,
                parent_name(fdid),
                SHARE_MDEV_TYPE,
                destination.vm,
                clock,
            )
        )
    return now


def release_source(tx: StateTxn, fdid: int, destination: Holder) -> None:
    """Step 3 for one share: the source's claims go (idempotent)."""
    r = _record(tx, fdid, destination)
    if r is not None and "leaving" in r.data:
        _put(tx, fdid, r.key, {k: v for k, v in r.data.items() if k != "leaving"})


def leaving(tx: StateTxn, fdid: int, destination: Holder) -> list[Claim]:
    """The source's claims a moved share still keeps (empty once released)."""
    r = _record(tx, fdid, destination)
    return [] if r is None else claims_from(r.data.get("leaving"))


def move_problems(
    tx: StateTxn,
    topology: Topology,
    fdids: list[int],
    source: Holder,
    destination: Holder,
    guest_ram: GuestRam | int,
    *,
    hot: bool = True,
) -> list[str]:
    """Why ``source``'s shares of drives ``fdids`` could not move to ``destination.node`` now
    (each against what is claimed now; ``claim`` checks them again, together with the VM's
    devices). ``hot``: moved plugged, which a share of two paths may not (unplugged, its
    relay rings are made again on the destination). Reads only."""
    problems = []
    for fdid in sorted(fdids):
        fd = format_fdid(fdid)
        r = _record(tx, fdid, source)
        if r is None:
            problems.append(f"the NVMe share of {fd}: {source} has none")
            continue
        moving = share_entry(r).share
        paths = moving.paths
        if paths > 1 and hot:
            problems.append(f"the NVMe share of {fd} has a backup path: it moves unplugged")
            continue
        try:
            claims = share_claims(topology, fdid, destination, guest_ram_of(guest_ram), paths)
            windows = cpu_window_claims(
                topology, fdid, destination, moving.cmb_extent, moving.page is not None
            )
            check_cpu_windows(topology, tx.claims() + tx.set_aside(), fdid, destination, windows)
            claims += windows
            check_share_claims(topology, tx.claims() + tx.set_aside(), fdid, destination, claims)
        except FabricError as e:
            problems.append(f"the NVMe share of {fd}: {e}")
    return problems


def hand_back(
    tx: StateTxn,
    fdid: int,
    destination: Holder,
    source: Holder,
    mdev: str | None,
    clock: float,
) -> int | None:
    """Undo ``hand_over`` for one share (a rollback, its VM still on the source): the share is
    the source's again, with the source's claims only, under a newer epoch; its mdev record
    goes back. None when the destination has no such share (nothing changed)."""
    r = _record(tx, fdid, destination)
    if r is None:
        return epoch(tx, fdid, source)
    old = share_entry(r).share
    now = int(r.data.get("epoch", 0)) + 1
    tx.clear_runtime(fdid, SHARE_RECORD, r.key)
    data = {
        "holder": msgspec.to_builtins(source),
        "share": msgspec.structs.replace(old, name=vm_share(source)).record(),
        "claims": r.data.get("leaving", []),
        "epoch": now,
    }
    _put(tx, fdid, vm_share(source), data)
    if mdev is not None and tx.mdev(mdev) is not None:
        tx.delete_mdev(mdev)
        if tx.parent(source.node, fdid) is None:
            tx.add_parent(ParentRecord(source.node, fdid, parent_name(fdid)))
        parent = parent_name(fdid)
        tx.add_mdev(MdevRecord(mdev, fdid, source.node, parent, SHARE_MDEV_TYPE, source.vm, clock))
    return now
