"""Shared NVMe drives in the registry: who manages a drive, and each VM's share of it.

A drive lent for sharing is held by its manager (holder ``<lender>/nvme-manager``), so an
exclusive reservation of it is refused as for any held device, and sharing a drive a VM holds
is refused in turn: the two modes exclude each other. The controller's geometry and each share
(queue pairs, MSI-X vectors, LBA extent, address space) are runtime records of that hold, so
they go with it; a share is claimed at reserve (all or nothing, inside one write transaction)
and returned at release, together with the NTB resources its DMA path uses (LUT entries,
window segments: ``vmlend.ledger.nvmeadmit``), which are claims of the manager's hold. The data
path records what it sees (real queues, guard rejections) in the share's record so
``vmlend nvme status`` in any process shows it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec

from vmlend.errors import (
    ConfigError,
    DeviceHeldError,
    DeviceNotLentError,
    LenderIommuOffError,
    LenderUnavailableError,
    NotSharedError,
    SharesActiveError,
    UnknownDeviceError,
)
from vmlend.ledger.admission import guest_ram_of, vm_share
from vmlend.ledger.linkfaults import links_down_in
from vmlend.ledger.nvmeadmit import (
    check_cpu_windows,
    check_share_claims,
    cpu_window_claims,
    is_share_msi_claim,
    share_claims,
    share_msi_claims,
)
from vmlend.ledger.shareops import SHARE_RECORD as SHARE_RECORD  # its home: no geometry
from vmlend.nvme.shares import Geometry, Share, ShareBook
from vmlend.registry import Registry, StateTxn
from vmlend.registry.records import Claim, ClaimKind, HoldRecord, Phase, RuntimeRecord
from vmlend.topology.compiled import stored_topology
from vmlend.topology.model import MANAGER_VM, GuestRam, Holder
from vmlend.topology.paths import without_links

GEOMETRY_RECORD = "nvme-geometry"


class ShareEntry(msgspec.Struct, frozen=True):
    """A share as the registry keeps it, with what the data path last recorded."""

    fdid: int
    holder: Holder
    share: Share
    real_queues: tuple[int, ...] = ()
    rejections: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "fdid": f"{self.fdid:#x}",
            "node": self.holder.node,
            "vm": self.holder.vm,
            **self.share.as_dict(),
            "real_queues": list(self.real_queues),
            "guard_rejections": self.rejections,
        }


def is_manager(holder: Holder, lender: str | None = None) -> bool:
    """The manager of a shared drive: its reserved name (no VM may take it: ``reserve``
    refuses it), on the drive's lender when ``lender`` is given."""
    return holder.vm == MANAGER_VM and (lender is None or holder.node == lender)


def _geometry(tx: StateTxn, fdid: int) -> Geometry:
    for r in tx.runtime(fdid, GEOMETRY_RECORD):
        return Geometry(**r.data)
    raise NotSharedError(fdid)


def share_entry(r: RuntimeRecord) -> ShareEntry:
    """The share a runtime record of kind ``SHARE_RECORD`` keeps."""
    h = r.data["holder"]
    return ShareEntry(
        r.fdid,
        Holder(h["node"], h["vm"], h.get("vm_uuid", "")),
        Share.from_record(r.data["share"]),
        tuple(r.data.get("real_queues", ())),
        int(r.data.get("rejections", 0)),
    )


def _entries(tx: StateTxn, fdid: int | None = None) -> list[ShareEntry]:
    return [share_entry(r) for r in tx.runtime(fdid, SHARE_RECORD)]


def holder_share(tx: StateTxn, fdid: int, holder: Holder) -> Share | None:
    """``holder``'s share of ``fdid`` (inside a transaction), None when it has none."""
    key = vm_share(holder)
    for e in _entries(tx, fdid):
        if e.share.name == key:
            return e.share
    return None


def interrupt_windows(tx: StateTxn, fdid: int, holder: Holder) -> list[Claim]:
    """The interrupt windows ``holder``'s share of ``fdid`` was admitted with (MSI over the
    NTB, ``nvmeadmit.share_msi_claims``): none means its interrupts are relayed."""
    key = vm_share(holder)
    for r in tx.runtime(fdid, SHARE_RECORD):
        if r.key == key:
            return [c for c in claims_from(r.data.get("claims")) if is_share_msi_claim(c)]
    return []


def shares_held(tx: StateTxn, holder: Holder) -> list[int]:
    """The drives ``holder``'s VM has shares of."""
    key = vm_share(holder)
    return sorted({e.fdid for e in _entries(tx) if e.share.name == key})


def lend_shared(
    registry: Registry, fdid: int, geometry: Geometry, clock: Callable[[], float] = time.time
) -> None:
    """Hand ``fdid`` to its manager for sharing (idempotent)."""

    def body(tx: StateTxn) -> None:
        dev = tx.device(fdid)
        if dev is None:
            raise UnknownDeviceError(fdid)
        if not dev.lent:
            raise DeviceNotLentError(fdid, dev.lender)
        node = tx.node(dev.lender)
        if node is not None and not node.up:  # its manager runs there: nothing to share now
            raise LenderUnavailableError(fdid, dev.lender, node.why or "is down")
        if not stored_topology(tx.topology()).node(dev.lender).iommu:
            # every share is a VM's: the drive reaches its RAM through the lender's IOMMU
            raise LenderIommuOffError(fdid, dev.lender)
        hold = tx.hold(fdid)
        if hold is not None:
            if is_manager(hold.holder, dev.lender):
                if hold.phase is not Phase.BORROWED:  # shared again after its lender was down
                    tx.set_phase(fdid, Phase.BORROWED)
                return
            raise DeviceHeldError(fdid, hold.holder.node, hold.holder.vm)
        manager = Holder(dev.lender, MANAGER_VM)
        # the manager drives the device on its own node: no NTB crossing, so no claims
        tx.add_hold(HoldRecord(fdid, manager, clock(), Phase.BORROWED), [])
        tx.put_runtime(fdid, GEOMETRY_RECORD, "controller", msgspec.to_builtins(geometry))

    registry.transact(body)


def unshare(registry: Registry, fdid: int) -> bool:
    """End sharing (refused while shares exist); False when the drive was not shared."""

    def body(tx: StateTxn) -> bool:
        hold = tx.hold(fdid)
        if hold is None or not is_manager(hold.holder):
            return False
        active = [str(e.holder) for e in _entries(tx, fdid)]
        if active:
            raise SharesActiveError(fdid, active)
        tx.delete_hold(fdid)
        return True

    return registry.transact(body)


def claims_from(data: Any) -> list[Claim]:
    """Claims as a share record keeps them (plain data)."""
    return [
        Claim(
            c["adapter"], ClaimKind(c["kind"]), c["share"], c["entries"], c["segments"], c["bytes"]
        )
        for c in data or ()
    ]


def _claims_of(r: RuntimeRecord) -> list[Claim]:
    """What a share uses: its own path's claims and, while its VM moves hot
    (``vmlend.ledger.sharemove``), the destination's claimed beside them (``incoming``) or the
    source's kept until the hardware left them (``leaving``)."""
    incoming = r.data.get("incoming") or {}
    return (
        claims_from(r.data.get("claims"))
        + claims_from(incoming.get("claims"))
        + claims_from(r.data.get("leaving"))
    )


def store_claims(tx: StateTxn, fdid: int) -> None:
    """The manager's hold claims what its current shares use, and nothing more."""
    records = tx.runtime(fdid, SHARE_RECORD)
    for kind in (ClaimKind.LUT, ClaimKind.DMA, ClaimKind.BAR):  # BAR: CPU windows
        mine = [(fdid, c) for r in records for c in _claims_of(r) if c.kind is kind]
        tx.replace_claims(kind, [fdid], mine)


def reserve_share(
    registry: Registry,
    fdid: int,
    holder: Holder,
    queue_pairs: int,
    blocks: int,
    *,
    guest_ram: GuestRam | int = 0,
    paths: int = 1,
    msi: bool = True,
) -> Share:
    """Claim a share of ``fdid`` for ``holder`` (the same share again for the same VM) and
    the NTB resources its DMA path into RAM ``guest_ram`` uses (both paths' with ``paths=2``:
    a backup queue pair per queue pair through another adapter of the VM's host), and, with
    ``msi``, its interrupt windows where there is room (``nvmeadmit.share_msi_claims``);
    ``ResourceExhaustedError`` when the controller or an adapter has not enough left,
    ``NoBackupPathError`` when the host has no second adapter reached; nothing claimed."""
    key = vm_share(holder)
    if holder.vm == MANAGER_VM:
        raise ConfigError(
            f"the VM name {MANAGER_VM!r} is reserved for the manager of shared NVMe drives;"
            " rename the VM"
        )

    def body(tx: StateTxn) -> Share:
        hold = tx.hold(fdid)
        if hold is None:
            raise NotSharedError(fdid)
        if not is_manager(hold.holder):
            raise DeviceHeldError(fdid, hold.holder.node, hold.holder.vm)
        entries = _entries(tx, fdid)
        for e in entries:
            if e.share.name == key:
                return e.share
        book = ShareBook(_geometry(tx, fdid), [e.share for e in entries])
        share = book.allocate(key, queue_pairs, blocks, paths)
        # routed as the hardware routes it now: around the cables marked down
        topology = without_links(stored_topology(tx.topology()), links_down_in(tx))
        claims = share_claims(topology, fdid, holder, guest_ram_of(guest_ram), paths)
        # its CPU's windows onto its CMB extent and its doorbell page, in its adapter's window
        page = share.page is not None
        windows = cpu_window_claims(topology, fdid, holder, share.cmb_extent, page)
        check_cpu_windows(topology, tx.claims() + tx.set_aside(), fdid, holder, windows)
        claims += windows
        check_share_claims(topology, tx.claims() + tx.set_aside(), fdid, holder, claims)
        # its completion interrupts' window: never a refusal (none left: they are relayed)
        if msi:
            claims += share_msi_claims(topology, tx.claims(), fdid, holder, claims, paths)
        tx.put_runtime(
            fdid,
            SHARE_RECORD,
            key,
            {
                "holder": msgspec.to_builtins(holder),
                "share": share.record(),
                "claims": msgspec.to_builtins(claims),
            },
        )
        store_claims(tx, fdid)
        return share

    return registry.transact(body)


def release_share(registry: Registry, fdid: int, holder: Holder) -> bool:
    """Return ``holder``'s share of ``fdid`` and the NTB resources only it used; False when
    it had none."""

    def body(tx: StateTxn) -> bool:
        if not tx.clear_runtime(fdid, SHARE_RECORD, vm_share(holder)):
            return False
        store_claims(tx, fdid)
        return True

    return registry.transact(body)


def record_usage(
    registry: Registry, fdid: int, name: str, real_queues: list[int], rejections: int
) -> None:
    """What the data path sees of a share (shown by status)."""

    def body(tx: StateTxn) -> None:
        for r in tx.runtime(fdid, SHARE_RECORD):
            if r.key == name:
                data = {**r.data, "real_queues": sorted(real_queues), "rejections": rejections}
                tx.put_runtime(fdid, SHARE_RECORD, name, data)

    registry.transact(body)


def shared_drives(registry: Registry) -> dict[int, tuple[Holder, Geometry, list[ShareEntry]]]:
    """Every drive lent for sharing: its manager, geometry and shares."""
    with registry.read() as tx:
        out = {}
        for fdid, hold in sorted(tx.holds().items()):
            if is_manager(hold.holder):
                out[fdid] = (hold.holder, _geometry(tx, fdid), _entries(tx, fdid))
        return out
