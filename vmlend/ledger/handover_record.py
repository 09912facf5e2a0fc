"""The registry's record of a hot migration in progress, and what a destination's prepare hook
accepts because of it (docs/migration.md, "Hot").

A hot migration starts the VM on the destination (libvirt runs the prepare hook there) while
the source still holds every device: the holds move only at the switch-over. A plain prepare
refuses a device another node holds, so ``vmlend.ledger.handover.claim_destination`` writes,
in the very transaction that claims the destination's room, a *hand-over record* on each of
the VM's devices: a runtime record of kind ``hand-over`` keyed by the VM's UUID. It lives on
the source's hold (it goes with it: at the hand-over, or with the source host's lease) and
names the VM, its UUID, the source, the destination, every device with the fencing token of
the source's hold on it, and the destination's claims.

``arrival`` is the prepare hook's judgement, pure: a record names this VM's UUID and this node
as destination, or nothing arrives (a plain prepare, which refuses held devices as always).
When one does, it must be the same record on every device it names, those devices must be
exactly the VM's, and each must be held by the same VM (by UUID) on the record's source under
the record's token; likewise its NVMe shares: exactly the VM's, each the same VM's share on the
source at the record's epoch (``vmlend.ledger.sharemove``). Anything else is refused: a record
written for another VM's UUID cannot make a prepare accept a device that VM does not hold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from uuid import UUID

import msgspec

from vmlend.errors import FabricError
from vmlend.registry import Claim, HoldRecord, StateTxn
from vmlend.topology.model import Holder, format_fdid

#: Runtime record kind of a hand-over record (its key: the VM's UUID).
KIND = "hand-over"


class HandOverRecord(msgspec.Struct, frozen=True):
    """VM ``vm`` (``vm_uuid``) moves hot from ``source`` to ``destination``."""

    vm: str
    vm_uuid: str
    source: str
    destination: str
    #: Each device (fdid) with the fencing token of the source's hold on it.
    devices: dict[int, int]
    #: Each device's claims on the destination's side (admitted beside the source's).
    claims: dict[int, list[Claim]] = msgspec.field(default_factory=dict)
    #: Each NVMe drive the VM has a queue-level share of, with the share's epoch (its
    #: fencing token) on the source.
    shares: dict[int, int] = msgspec.field(default_factory=dict)


class HandOverRefusedError(FabricError):
    """A prepare whose VM a hand-over record names, refused: the record does not match."""


def _canonical(text: str) -> str | None:
    try:
        return str(UUID(text))
    except (ValueError, TypeError, AttributeError):
        return None


def put(tx: StateTxn, record: HandOverRecord) -> None:
    """Write ``record`` on each device it names (each must be held)."""
    data = msgspec.to_builtins(record, str_keys=True)
    for fdid in sorted({*record.devices, *record.shares}):
        tx.put_runtime(fdid, KIND, record.vm_uuid, data)


def clear(tx: StateTxn, fdids: Sequence[int], vm_uuid: str) -> None:
    """Remove the hand-over records of ``vm_uuid`` on ``fdids`` (those still held)."""
    for fdid in fdids:
        if tx.hold(fdid) is not None:
            tx.clear_runtime(fdid, KIND, vm_uuid)


def read(tx: StateTxn, fdids: Sequence[int], vm_uuid: str) -> dict[int, list[HandOverRecord]]:
    """The hand-over records on ``fdids`` naming ``vm_uuid``, by device.
    ``HandOverRefusedError`` for one that is no record vmlend wrote."""
    want = _canonical(vm_uuid)
    found: dict[int, list[HandOverRecord]] = {}
    if want is None:
        return found
    for fdid in fdids:
        for r in tx.runtime(fdid, KIND):
            if _canonical(r.key) != want:
                continue
            try:
                rec = msgspec.convert(r.data, HandOverRecord, strict=False)
            except msgspec.ValidationError as e:
                raise HandOverRefusedError(
                    f"the hand-over record of VM {vm_uuid} on device {format_fdid(fdid)} is no"
                    f" record vmlend wrote ({e}); nothing was borrowed"
                ) from None
            found.setdefault(fdid, []).append(rec)
    return found


def arrival(
    found: Mapping[int, Sequence[HandOverRecord]],
    holds: Mapping[int, HoldRecord | None],
    holder: Holder,
    fdids: Sequence[int],
    shares: Mapping[int, tuple[Holder, int] | None] | None = None,
) -> HandOverRecord | None:
    """The hot migration that brings ``holder``'s VM (its devices ``fdids``, its NVMe shares
    ``shares``: by drive, who has the VM's share now and its epoch) to ``holder.node``, as
    ``found`` (``read``) and ``holds`` (each device's hold now) show it; None when none does
    (a plain start). ``HandOverRefusedError`` when a
    record names this VM arriving here but does not match (the module docstring's rules)."""
    me = _canonical(holder.vm_uuid)
    if me is None:
        return None
    mine = [
        r
        for recs in found.values()
        for r in recs
        if _canonical(r.vm_uuid) == me and r.destination == holder.node
    ]
    if not mine:
        return None
    rec = mine[0]
    who = f"VM {holder.vm!r} ({me})"

    def refuse(why: str) -> HandOverRefusedError:
        return HandOverRefusedError(
            f"the hot migration of {who} from {rec.source} does not match: {why}; nothing was"
            " borrowed"
        )

    if any(r != rec for r in mine):
        raise refuse("its devices carry different hand-over records")
    shares = dict(shares or {})
    if set(rec.shares) != set(shares):
        raise refuse(
            f"the record names NVMe shares of {_fdids(rec.shares)}, the VM's XML of"
            f" {_fdids(shares)}"
        )
    for fdid in sorted(rec.shares):
        fd = format_fdid(fdid)
        if rec not in found.get(fdid, ()):
            raise refuse(f"drive {fd} carries no record of it")
        has = shares[fdid]
        if has is None or has[0].node != rec.source or _canonical(has[0].vm_uuid) != me:
            raise refuse(f"this VM has no share of drive {fd} on {rec.source}")
        if has[1] != rec.shares[fdid]:
            raise refuse(
                f"its share of drive {fd} is at epoch {has[1]}, the record's {rec.shares[fdid]}"
            )
    if set(rec.devices) != set(fdids):
        raise refuse(
            f"the record names devices {_fdids(rec.devices)}, the VM's XML {_fdids(fdids)}"
        )
    for fdid in sorted(rec.devices):
        fd = format_fdid(fdid)
        if rec not in found.get(fdid, ()):
            raise refuse(f"device {fd} carries no record of it")
        hold = holds.get(fdid)
        if hold is None:
            raise refuse(f"device {fd} is held by nobody")
        h = hold.holder
        if h.node != rec.source or _canonical(h.vm_uuid) != me:
            raise refuse(f"device {fd} is held by {h.node}/{h.vm}, not by this VM on {rec.source}")
        if hold.token != rec.devices[fdid]:
            raise refuse(
                f"device {fd}'s hold has token {hold.token}, the record {rec.devices[fdid]}"
            )
    return rec


def _fdids(fdids: Sequence[int] | Mapping[int, object]) -> str:
    return ", ".join(format_fdid(f) for f in sorted(fdids)) or "none"
