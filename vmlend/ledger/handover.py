"""A hot migration's registry side: the VM's holds move to the destination without ending.

Three transactions, each all or nothing (docs/migration.md, "Hot"):

1. ``claim_destination``: the whole VM is admitted on the destination with its own holds
   counted as movable (``admit_vm``), and each hold gains the destination's claims beside the
   source's (LUT entries, DMA and BAR window segments, peer-to-peer, the interrupt window):
   room that nobody else can take while the memory is copied. The same transaction writes
   the hand-over record (``vmlend.ledger.handover_record``) the destination's prepare hook
   accepts the arriving devices by. Refused: nothing changed.
2. ``hand_over``: at the switch-over, each hold of the source's VM is replaced by the same
   VM's hold on the destination (in the same phase: a borrowed device never stops being
   borrowed),
   keeping both sets of claims, and each mdev record moves to the destination. The new hold
   has a newer fencing token: the device's side, told it by the switch-over, refuses every
   later step made for the source's hold.
3. ``release_source``: once the hardware follows, the source's claims go.

The VM's queue-level NVMe shares follow it in the same transactions
(``vmlend.ledger.sharemove``): admitted with its devices, moved under a newer epoch (a share's
fencing token), their source claims released in step 3.

``abandon`` undoes 1 (a migration that stopped before the switch-over). A claim the source's
hold already has (the lender's LUT entry of the device serves either borrower) is not added
twice, and so stays with the source when the destination's go.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from vmlend.errors import DeviceHeldError, DeviceNotReservedError, FabricError
from vmlend.ledger import handover_record, sharemove
from vmlend.ledger.admission import StateView, admit_vm
from vmlend.ledger.handover_record import HandOverRecord
from vmlend.ledger.ledger import MDEV_TYPE, parent_name
from vmlend.ledger.linkfaults import links_down_in
from vmlend.ledger.msiadmit import is_msi_claim, msi_share
from vmlend.registry import Claim, ClaimKind, HoldRecord, Registry, StateTxn, same_holder
from vmlend.registry.records import MdevRecord, ParentRecord
from vmlend.topology.compiled import stored_topology
from vmlend.topology.model import GuestRam, Holder, Topology
from vmlend.topology.paths import route, without_links


class Claimed(msgspec.Struct, frozen=True):
    """What ``claim_destination`` admitted: per device, the destination's claims (``claims``)
    and, of those, the ones it added beside the source's (``added``: the others the source's
    hold had already)."""

    source: Holder
    destination: Holder
    claims: dict[int, list[Claim]]
    added: dict[int, list[Claim]] = msgspec.field(default_factory=dict)
    #: The VM's NVMe shares (by drive) and the destination's claims of each.
    shares: dict[int, list[Claim]] = msgspec.field(default_factory=dict)


def admission_topology(tx: StateTxn) -> Topology:
    """The topology as admission sees it: without the cables that are down."""
    down = tuple(links_down_in(tx))
    full = stored_topology(tx.topology())
    return without_links(full, down) if down else full


def _own(tx: StateTxn, fdid: int, holder: Holder) -> HoldRecord:
    hold = tx.hold(fdid)
    if hold is None:
        raise DeviceNotReservedError(fdid, str(holder))
    if not same_holder(hold.holder, holder):
        raise DeviceHeldError(fdid, hold.holder.node, hold.holder.vm)
    return hold


def _msi_claims(
    topo: Topology, tx: StateTxn, fdid: int, source: Holder, destination: Holder
) -> list[Claim]:
    """The interrupt window (MSI over the NTB) on the destination's route, where the source's
    hold has one: one segment per lender adapter and VM, as at reserve."""
    out = []
    for f, c in tx.claims():
        if f != fdid or not is_msi_claim(c) or c.share != msi_share(source):
            continue
        path = route(topo, topo.device(fdid).lender, destination.node)
        if path is None:
            continue  # the VM arrives on the lender: no NTB to post across
        out.append(
            Claim(path.src.ref, c.kind, msi_share(destination), c.entries, c.segments, c.bytes)
        )
    return out


def _add_claims(tx: StateTxn, add: Mapping[int, Iterable[Claim]]) -> None:
    """Each hold keeps its claims and gains ``add[fdid]`` (kind by kind)."""
    current = tx.claims()
    for fdid, extra in add.items():
        extra = list(extra)
        for kind in ClaimKind:
            new = [c for c in extra if c.kind is kind]
            if not new:
                continue
            old = [c for f, c in current if f == fdid and c.kind is kind]
            tx.replace_claims(kind, [fdid], [(fdid, c) for c in old + new])


def _held_by(tx: StateTxn, fdids: Iterable[int], holder: Holder) -> list[int]:
    """Those of ``fdids`` that ``holder``'s VM holds now."""
    out = []
    for fdid in sorted(fdids):
        hold = tx.hold(fdid)
        if hold is not None and same_holder(hold.holder, holder):
            out.append(fdid)
    return out


def _minus(have: list[Claim], remove: Iterable[Claim]) -> list[Claim]:
    """``have`` without one instance of each of ``remove``."""
    out = list(have)
    for c in remove:
        if c in out:
            out.remove(c)
    return out


def _drop_added(tx: StateTxn, added: Mapping[int, Iterable[Claim]]) -> None:
    """Each hold loses what ``added`` says was added to it, and keeps the rest."""
    current = tx.claims()
    keep = {f: _minus([c for g, c in current if g == f], a) for f, a in added.items()}
    _drop_claims(tx, [f for f in added if tx.hold(f) is not None], keep)


def _drop_claims(tx: StateTxn, fdids: Iterable[int], keep: Mapping[int, Iterable[Claim]]) -> None:
    """Each hold of ``fdids`` keeps exactly ``keep[fdid]`` of its claims."""
    current = tx.claims()
    for fdid in fdids:
        wanted = list(keep.get(fdid, []))
        for kind in ClaimKind:
            old = [c for f, c in current if f == fdid and c.kind is kind]
            new = [c for c in wanted if c.kind is kind]
            if old != new:
                tx.replace_claims(kind, [fdid], [(fdid, c) for c in new])


def claim_destination(
    registry: Registry,
    fdids: list[int],
    source: Holder,
    destination: Holder,
    guest_ram: GuestRam | int,
    shares: list[int] | None = None,
) -> Claimed:
    """Step 1: admit the whole VM (its devices ``fdids``, its NVMe shares of drives
    ``shares``) on ``destination.node``, claim its room there beside the source's and write
    the hand-over record. ``FabricError`` naming the first device refused (nothing changed).
    A record of an earlier run of the same move (killed before its end) goes first, with what
    it claimed."""
    drives = sorted(shares or [])

    def body(tx: StateTxn) -> Claimed:
        holds = {fdid: _own(tx, fdid, source) for fdid in fdids}
        for recs in handover_record.read(tx, [*fdids, *drives], source.vm_uuid).values():
            for old in recs:
                _drop_added(tx, old.claims)
                for d in old.shares:
                    sharemove.drop_incoming(tx, d, source)
                handover_record.clear(tx, sorted({*old.devices, *old.shares}), source.vm_uuid)
        topo = admission_topology(tx)
        view = StateView(
            nodes=tx.nodes(),
            devices=tx.devices(),
            holds=tx.holds(),
            claims=tx.claims() + tx.set_aside(),
        )
        result = admit_vm(topo, view, fdids, destination.node, guest_ram, destination, source)
        for fdid, adm in result.items():
            if (e := adm.first_error()) is not None:
                raise FabricError(
                    f"cannot hot-migrate to {destination.node}: device {fdid:#x}: {e};"
                    " nothing was changed"
                )
        add: dict[int, list[Claim]] = {f: list(result[f].claims) for f in fdids}
        p2p = next((a.p2p for a in reversed(list(result.values())) if a.p2p is not None), None)
        for owner, c in p2p or []:
            add.setdefault(owner, []).append(c)
        for fdid in fdids:
            add[fdid] += _msi_claims(topo, tx, fdid, source, destination)
        have = tx.claims()
        added = {f: _minus(cs, [c for g, c in have if g == f]) for f, cs in add.items()}
        _add_claims(tx, added)
        # the shares on top of the devices' destination claims: one admission
        moving = {d: sharemove.claim(tx, topo, d, source, destination, guest_ram) for d in drives}
        epochs = {d: sharemove.epoch(tx, d, source) or 0 for d in drives}
        if fdids or drives:
            handover_record.put(
                tx,
                HandOverRecord(
                    source.vm,
                    source.vm_uuid,
                    source.node,
                    destination.node,
                    {f: holds[f].token for f in fdids},
                    added,
                    shares=epochs,
                ),
            )
        return Claimed(source, destination, add, added, moving)

    return registry.transact(body)


def abandon(registry: Registry, claimed: Claimed) -> None:
    """Undo ``claim_destination``: the holds keep only the source's claims again, and the
    hand-over record goes. Idempotent (also for holds that moved or ended meanwhile: a
    hold no longer the source's is left alone)."""

    def body(tx: StateTxn) -> None:
        ours = _held_by(tx, claimed.claims, claimed.source)
        handover_record.clear(tx, ours, claimed.source.vm_uuid)
        _drop_added(tx, {f: claimed.added.get(f, []) for f in ours})
        for d in sorted(claimed.shares):
            if sharemove.epoch(tx, d, claimed.source) is not None:
                handover_record.clear(tx, [d], claimed.source.vm_uuid)
                sharemove.drop_incoming(tx, d, claimed.source)

    registry.transact(body)


def hand_over(
    registry: Registry, claimed: Claimed, mdevs: Mapping[int, str], clock: float
) -> dict[int, int]:
    """Step 2: the holds, NVMe shares and mdev records of the source's VM become the
    destination's, in one transaction; returns each new hold's fencing token and each
    share's new epoch (by fdid). ``DeviceHeldError``, ``DeviceNotReservedError`` or
    ``NotSharedError`` (nothing changed) when a hold or share is no longer the source's."""
    src, dst = claimed.source, claimed.destination
    fdids = sorted(claimed.claims)
    drives = sorted(claimed.shares)
    epochs: dict[int, int] = {}

    def body(tx: StateTxn) -> list[tuple[int, list[Claim]]]:
        holds = [_own(tx, fdid, src) for fdid in fdids]
        every = tx.claims()
        moved = [(fdid, [c for f, c in every if f == fdid]) for fdid in fdids]
        for fdid in fdids:
            handover_record.clear(tx, [fdid], src.vm_uuid)  # it ends with the source's hold
            uuid = mdevs.get(fdid)
            if uuid is not None:
                tx.delete_mdev(uuid)
        _remake_holds(tx, holds, dst, src.node, dict(moved), mdevs, clock)
        for d in drives:
            handover_record.clear(tx, [d], src.vm_uuid)
            epochs[d] = sharemove.hand_over(tx, d, src, dst, mdevs.get(d), clock)
        return moved

    registry.transact(body)
    return _tokens_of(registry, fdids, dst) | epochs


def _remake_holds(
    tx: StateTxn,
    holds: list[HoldRecord],
    holder: Holder,
    left: str,
    claims: Mapping[int, list[Claim]],
    mdevs: Mapping[int, str],
    clock: float,
) -> None:
    """Each of ``holds`` made again as ``holder``'s with its ``claims`` (a new fencing
    token), its mdev record (``mdevs``, removed by the caller) made on ``holder``'s node under
    its parent, and the parent record on ``left``, the node it leaves, dropped. Every hold
    is dropped before any is made again: a VM's shared claims (its DMA windows on a lender)
    count once per VM, so the source's must be given back before the destination's are
    taken, or a tight adapter would hold them twice until the last device moved."""
    for hold in holds:
        tx.delete_hold(hold.fdid)
    for hold in holds:
        fdid = hold.fdid
        tx.add_hold(HoldRecord(fdid, holder, clock, hold.phase, hold.guest_ram), claims[fdid])
        mdev = mdevs.get(fdid)
        if mdev is not None:
            if tx.parent(holder.node, fdid) is None:
                tx.add_parent(ParentRecord(holder.node, fdid, parent_name(fdid)))
            tx.add_mdev(
                MdevRecord(mdev, fdid, holder.node, parent_name(fdid), MDEV_TYPE, holder.vm, clock)
            )
        if tx.parent(left, fdid) is not None:
            tx.delete_parent(left, fdid)


def release_source(registry: Registry, claimed: Claimed) -> None:
    """Step 3: the destination's holds keep only the destination's claims. Idempotent."""

    def body(tx: StateTxn) -> None:
        _drop_claims(tx, _held_by(tx, claimed.claims, claimed.destination), claimed.claims)
        for d in sorted(claimed.shares):
            sharemove.release_source(tx, d, claimed.destination)

    registry.transact(body)


def hand_back(
    registry: Registry, claimed: Claimed, mdevs: Mapping[int, str], clock: float
) -> dict[int, int]:
    """Undo ``hand_over`` (``vmlend migrate --live --rollback`` of a move interrupted after it,
    the VM still running on the source): the holds, shares and mdev records become the
    source's again under newer fencing tokens (epochs for shares), each hold with the claims
    it had before ``claim_destination`` only. Returns the new tokens by fdid.
    ``DeviceHeldError``/``DeviceNotReservedError`` (nothing changed) when a hold is no longer
    the destination's."""
    src, dst = claimed.source, claimed.destination
    fdids = sorted(claimed.claims)
    epochs: dict[int, int] = {}

    def body(tx: StateTxn) -> None:
        holds = [_own(tx, fdid, dst) for fdid in fdids]
        every = tx.claims()
        keep = {
            fdid: _minus([c for f, c in every if f == fdid], claimed.added.get(fdid, []))
            for fdid in fdids
        }
        for fdid in fdids:
            uuid = mdevs.get(fdid)
            if uuid is not None and tx.mdev(uuid) is not None:
                tx.delete_mdev(uuid)
        _remake_holds(tx, holds, src, dst.node, keep, mdevs, clock)
        for d in sorted(claimed.shares):
            got = sharemove.hand_back(tx, d, dst, src, mdevs.get(d), clock)
            if got is not None:
                epochs[d] = got

    registry.transact(body)
    return _tokens_of(registry, fdids, src) | epochs


def _tokens_of(registry: Registry, fdids: list[int], holder: Holder) -> dict[int, int]:
    """The fencing tokens of ``holder``'s holds of ``fdids``, read once committed (the store
    issues them). A hold that changed hands since (a release and another VM's reserve in
    between) is left out: the caller re-points only what ``holder`` still holds."""
    with registry.read() as tx:
        holds = {f: tx.hold(f) for f in fdids}
    return {f: h.token for f, h in holds.items() if h is not None and same_holder(h.holder, holder)}
