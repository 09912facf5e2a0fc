"""The hook's side of NVMe shares: prepare claims the VM's share and creates its mdev of the
share type; release removes the mdev and returns the share (docs/nvme-sharing.md).

Backends that can share implement ``ShareFabric``: the simulated one, and the kernel backend
(``SmartioFabric``: it writes the share child's ``nvme_share``, docs/smartio-contract.md
section 7, and refuses with ``SharingUnsupportedError`` naming what the SmartIO driver lacks).
With any other backend a domain asking for a share fails to start with
``SharingUnsupportedError``; ``vmlend doctor`` says what the SmartIO driver offers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable
from uuid import UUID

from vmlend.errors import (
    MdevOwnedError,
    RegistryUnreachableError,
    SharingUnsupportedError,
    VmlendError,
)
from vmlend.ledger.shareops import SHARE_MDEV_TYPE
from vmlend.lending.devices import Record, UndoJournal, left_alone
from vmlend.topology.model import GuestRam, Holder, MdevInfo, format_fdid

if TYPE_CHECKING:  # the fabric imports this module: no lxml, no NVMe geometry for it
    from vmlend.domain import NvmeShareRequest
    from vmlend.nvme.shares import Share

BLOCK = 512


@runtime_checkable
class ShareFabric(Protocol):
    local_node: str

    def reserve_share(
        self,
        fdid: int,
        holder: Holder,
        queue_pairs: int,
        blocks: int,
        *,
        guest_ram: GuestRam | int = 0,
        paths: int = 1,
    ) -> Share: ...

    def release_share(self, fdid: int, holder: Holder) -> bool: ...

    def shares_held(self, holder: Holder) -> list[int]: ...

    def share_of(self, fdid: int, holder: Holder) -> Share | None: ...

    def ensure_mdev_parent(self, fdid: int) -> str: ...

    def create_share_mdev(self, fdid: int, uuid: str, holder: Holder) -> MdevInfo: ...

    def remove_mdev(self, uuid: str) -> bool: ...

    def mdevs(self) -> list[MdevInfo]: ...


def _ignore(_msg: str) -> None:
    pass


def acquire_share(
    fabric: object,
    holder: Holder,
    fdid: int,
    mdev: UUID | str,
    request: NvmeShareRequest,
    journal: UndoJournal,
    record: Record = _ignore,
    *,
    guest_ram: GuestRam | int = 0,
) -> str:
    """Claim ``holder``'s share of ``fdid`` (with the NTB resources its DMA windows into RAM
    ``guest_ram`` use) and create its share mdev ``mdev``; what this call newly did is pushed
    on ``journal``. Returns the parent's name."""
    fd = format_fdid(fdid)
    if not isinstance(fabric, ShareFabric):
        raise SharingUnsupportedError(
            fdid,
            f"this backend ({type(fabric).__name__}) does not share NVMe drives at the queue"
            " level; 'vmlend doctor' says what the SmartIO driver offers",
        )
    uuid = str(mdev)
    existing = next((m for m in fabric.mdevs() if m.uuid == uuid), None)
    if existing is not None and not _serves(existing, holder):
        # before the share is claimed: a reconnect rolls nothing back (create_share_mdev
        # refuses it too, inside its transaction)
        raise MdevOwnedError(uuid, f"{existing.node}/{existing.vm}", str(holder))
    had_mdev = existing is not None
    had_share = fdid in fabric.shares_held(holder)
    share = fabric.reserve_share(
        fdid,
        holder,
        request.queue_pairs,
        request.size // BLOCK,
        guest_ram=guest_ram,
        paths=request.paths,
    )
    if not had_share:
        journal.push(f"share of {fd}", lambda: fabric.release_share(fdid, holder))
    record(
        f"share of {fd}: {share.queue_pairs} queue pair(s), "
        f"LBAs {share.lba_offset}+{share.blocks}"
        + (f", {share.paths} paths" if share.paths > 1 else "")
        + ": ok"
    )
    parent = fabric.ensure_mdev_parent(fdid)
    fabric.create_share_mdev(fdid, uuid, holder)
    if not had_mdev:
        journal.push(f"mdev {uuid}", lambda: fabric.remove_mdev(uuid))
    record(f"mdev {uuid} ({SHARE_MDEV_TYPE}) for {fd} under {parent}: ok")
    return parent


def _serves(m: MdevInfo, holder: Holder) -> bool:
    """Whether mdev ``m`` is ``holder``'s as the registry records it: its node and VM name
    (what a share is keyed by, ``vm_share``; libvirt runs one domain per name on a node)."""
    return m.node in ("", holder.node) and m.vm == holder.vm


def return_shares(
    fabric: object, holder: Holder, named: Iterable[UUID | str], record: Record = _ignore
) -> list[str]:
    """Remove ``holder``'s share mdevs (the ones its XML names, and any of this VM's left by a
    crash) and return its shares. Idempotent; returns the failures.

    Only what the registry says is this VM's is touched: a share mdev whose record names
    another VM stays, even when the XML names it (libvirt runs release after every failed
    start, also of a copied or forged domain); the action log says so."""
    if not isinstance(fabric, ShareFabric):
        return []
    failures: list[str] = []
    named_uuids = {str(u) for u in named}
    for m in fabric.mdevs():
        if m.type_id != SHARE_MDEV_TYPE:
            continue
        if not _serves(m, holder):
            if m.uuid in named_uuids:
                record(left_alone(m))
            continue
        try:
            if fabric.remove_mdev(m.uuid):
                record(f"mdev {m.uuid}: removed")
        except RegistryUnreachableError:
            raise  # the whole release is retried later (release_journal)
        except VmlendError as e:
            failures.append(f"mdev {m.uuid}: {e}")
    for fdid in fabric.shares_held(holder):
        try:
            if fabric.release_share(fdid, holder):
                record(f"share of {format_fdid(fdid)}: returned")
        except RegistryUnreachableError:
            raise  # the whole release is retried later (release_journal)
        except VmlendError as e:
            failures.append(f"share of {format_fdid(fdid)}: {e}")
    return failures


def return_pending_shares(
    fabric: object,
    holder: Holder,
    shares: Sequence[tuple[int | None, str]],
    record: Record = _ignore,
) -> tuple[list[tuple[int | None, str]], list[str]]:
    """Land the shares of a release recorded while the registry was away (``release_journal``;
    the caller knows the VM does not run here): ``(fdid, mdev)`` each, the fdid None when the
    record did not keep it (an older vmlend's). Only those: the VM's share mdev among them and
    its share of that drive, never its other shares. The shares still pending, and why."""
    if not isinstance(fabric, ShareFabric):
        return [], []  # no backend that shares: nothing was ever claimed
    mine = [m for m in fabric.mdevs() if m.type_id == SHARE_MDEV_TYPE and _serves(m, holder)]
    held = set(fabric.shares_held(holder))
    pending: list[tuple[int | None, str]] = []
    failures: list[str] = []
    for fdid, uuid in shares:
        named = [m for m in mine if m.uuid == uuid or (fdid is not None and m.fdid == fdid)]
        if fdid is None:
            fdid = next((m.fdid for m in named if m.fdid is not None), None)
        try:
            for m in named:
                if fabric.remove_mdev(m.uuid):
                    record(f"mdev {m.uuid}: removed")
            if fdid is None:
                record(f"share mdev {uuid}: its drive is not known any more; nothing to return")
            elif fdid in held and fabric.release_share(fdid, holder):
                record(f"share of {format_fdid(fdid)}: returned")
        except RegistryUnreachableError:
            raise
        except VmlendError as e:
            pending.append((fdid, uuid))
            failures.append(f"share mdev {uuid}: {e}")
    return pending, failures
