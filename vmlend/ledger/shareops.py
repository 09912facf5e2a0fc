"""NVMe shares in the ledger (``vmlend.lending.shares.ShareFabric``): a share is the
registry's (``vmlend.ledger.nvmeshares``), its mdev a child of type ``smartio-nvme_share`` under the
drive's parent; a parent may have one such child per VM.

The ledger (and the NVMe geometry behind it) is imported on first use: every ``Ledger``
carries these operations, while the hook's prepare of a VM without shares never calls them.
"""

from __future__ import annotations

import uuid as uuidlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from vmlend.errors import ConfigError, MdevError, MdevOwnedError
from vmlend.registry import Registry, StateTxn
from vmlend.registry.records import Claim, MdevRecord
from vmlend.topology.model import GuestRam, Holder, MdevInfo

if TYPE_CHECKING:
    from vmlend.nvme.shares import Share

#: The mdev type a shared drive's parent offers: one child per VM, its virtual controller.
SHARE_MDEV_TYPE = "smartio-nvme_share"
#: The runtime record kind of a VM's share of a drive (``vmlend.ledger.nvmeshares``): here, so
#: the ledger's parent bookkeeping reads it without importing the NVMe geometry.
SHARE_RECORD = "nvme-share"


def shares_on(tx: StateTxn, fdid: int, node: str) -> list[str]:
    """The VMs on ``node`` the registry has a share of ``fdid`` for (their share records'
    holders), whether or not their child exists yet: a prepare makes the share first."""
    out = []
    for r in tx.runtime(fdid, SHARE_RECORD):
        holder = r.data.get("holder") if isinstance(r.data, dict) else None
        if isinstance(holder, dict) and holder.get("node") == node:
            out.append(str(holder.get("vm", "")))
    return out


class ShareRevoker(Protocol):
    """The hardware's cut of a VM's open mdevs of a device (``SimHardware.revoke``)."""

    def revoke(self, fdid: int, node: str | None = None, vm: str | None = None) -> int: ...


class ShareOps:
    """Mixed into ``Ledger``, whose registry, node, clock and hardware it uses."""

    _reg: Registry
    _clock: Callable[[], float]
    _hw: ShareRevoker | None
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
        msi: bool = True,
    ) -> Share:
        """``msi``: ask for the share's interrupt windows (MSI over the NTB; never a
        refusal). The kernel backend asks only where the driver can map them."""
        from vmlend.ledger import nvmeshares as ledger

        return ledger.reserve_share(
            self._reg,
            fdid,
            holder,
            queue_pairs,
            blocks,
            guest_ram=guest_ram,
            paths=paths,
            msi=msi,
        )

    def release_share(self, fdid: int, holder: Holder) -> bool:
        from vmlend.ledger import nvmeshares as ledger

        if self._hw is not None:  # hardware first: the VM's share ends before its record goes
            self._hw.revoke(fdid, holder.node, holder.vm)
        return ledger.release_share(self._reg, fdid, holder)

    def shares_held(self, holder: Holder) -> list[int]:
        from vmlend.ledger import nvmeshares as ledger

        with self._reg.read() as tx:
            return ledger.shares_held(tx, holder)

    def shares_here(self, fdid: int) -> list[str]:
        """The VMs of this node the registry has a share of ``fdid`` for (``shares_on``)."""
        with self._reg.read() as tx:
            return shares_on(tx, fdid, self.local_node)

    def share_of(self, fdid: int, holder: Holder) -> Share | None:
        from vmlend.ledger import nvmeshares as ledger

        with self._reg.read() as tx:
            return ledger.holder_share(tx, fdid, holder)

    def share_interrupt_windows(self, fdid: int, holder: Holder) -> list[Claim]:
        """The interrupt windows (MSI over the NTB) ``holder``'s share of ``fdid`` has: none,
        its interrupts are relayed."""
        from vmlend.ledger import nvmeshares as ledger

        with self._reg.read() as tx:
            return ledger.interrupt_windows(tx, fdid, holder)

    def create_share_mdev(self, fdid: int, uuid: str, holder: Holder) -> MdevInfo:
        from vmlend.ledger import nvmeshares as ledger

        try:
            uuid = str(uuidlib.UUID(uuid))
        except (ValueError, TypeError, AttributeError):
            raise ConfigError(f"bad mdev UUID {uuid!r}") from None
        if holder.node != self.local_node:
            raise MdevError(
                f"the mdev for {holder} belongs on {holder.node}, not on {self.local_node}"
            )

        def body(tx: StateTxn) -> MdevInfo:
            found = existing_mdev(tx, uuid, fdid, holder, self.local_node)
            if found is not None:
                return found
            parent = tx.parent(self.local_node, fdid)
            if parent is None:
                raise MdevError(f"no mdev parent for device {fdid:#x} on {self.local_node}")
            if ledger.holder_share(tx, fdid, holder) is None:
                raise MdevError(
                    f"{holder} has no share of device {fdid:#x}; reserve one before its mdev"
                )
            rec = MdevRecord(
                uuid,
                fdid,
                self.local_node,
                parent.name,
                SHARE_MDEV_TYPE,
                holder.vm,
                self._clock(),
            )
            tx.add_mdev(rec)
            return mdev_info(rec, created=True)  # the kernel backend undoes only its own

        return self._reg.transact(body)


def mdev_info(m: MdevRecord, *, created: bool = False) -> MdevInfo:
    return MdevInfo(
        uuid=m.uuid,
        parent=m.parent,
        type_id=m.type_id,
        fdid=m.fdid,
        node=m.node,
        vm=m.vm,
        created=created,
    )


def existing_mdev(tx: StateTxn, uuid: str, fdid: int, holder: Holder, node: str) -> MdevInfo | None:
    """What a create of mdev ``uuid`` for ``holder``'s ``fdid`` on ``node`` finds already: the
    same mdev (an idempotent re-create: returned), nothing (None), or a refusal: another VM's
    mdev is never handed over (``MdevOwnedError``), nor one of another device or node."""
    existing = tx.mdev(uuid)
    if existing is None:
        return None
    if existing.vm != holder.vm:
        raise MdevOwnedError(uuid, f"{existing.node}/{existing.vm}", str(holder))
    if existing.fdid == fdid and existing.node == node:
        return mdev_info(existing)
    raise MdevError(f"mdev {uuid} already exists for device {existing.fdid:#x} on {existing.node}")
