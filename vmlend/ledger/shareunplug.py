"""An unplugged live migration's registry side for a VM's queue-level NVMe shares
(docs/migration.md, "NVMe shares"): the share keeps its identity (LBA extent, queue pairs,
address space, paths, CMB extent) and moves to the destination under a newer epoch, through
the same per-share steps as a hot move (``vmlend.ledger.sharemove``). Its blocks are never
free: the share record is the source's or the destination's at every commit.

1. ``claim``, before anything is unplugged: every moving share's path into the destination
   is admitted (one transaction: all or nothing) and kept beside the source's. A share of two
   paths may move this way: its relay rings are made again on the destination.
2. ``hand_over``, its controller unplugged from the guest on the source (its mdev removed):
   the record becomes the destination's, epoch + 1, both sets of claims kept.
3. ``finish``, the VM running on the destination: the source's claims go.

``give_back`` undoes 1 or 2 (the VM still runs on the source): the share is the source's again
with the source's claims only (a newer epoch if it had moved). ``release``: the VM stopped
mid-move, so its shares go wherever they are, as at any stop of it (its release hook found
none it could return once they were handed over). Every function is one
transaction and idempotent, so a re-run after ``kill -9`` anywhere converges.
"""

from __future__ import annotations

from vmlend.ledger import sharemove
from vmlend.ledger.admission import vm_share
from vmlend.ledger.handover import admission_topology
from vmlend.ledger.nvmeshares import SHARE_RECORD, store_claims
from vmlend.registry import Registry, StateTxn
from vmlend.topology.model import GuestRam, Holder


def _moved(tx: StateTxn, drive: int, destination: Holder) -> bool:
    return sharemove.epoch(tx, drive, destination) is not None


def claim(
    registry: Registry,
    drives: list[int],
    source: Holder,
    destination: Holder,
    guest_ram: GuestRam | int,
) -> None:
    """Step 1 for ``source``'s shares of ``drives`` (those handed over already are skipped).
    ``FabricError`` naming the first share refused: nothing claimed."""

    def body(tx: StateTxn) -> None:
        topo = admission_topology(tx)
        for d in sorted(drives):
            if not _moved(tx, d, destination):
                sharemove.claim(tx, topo, d, source, destination, guest_ram, hot=False)

    registry.transact(body)


def hand_over(
    registry: Registry, drives: list[int], source: Holder, destination: Holder, clock: float
) -> dict[int, int]:
    """Step 2: the shares become the destination's; each one's epoch there."""

    def body(tx: StateTxn) -> dict[int, int]:
        # the mdev went with the controller's unplug: the destination makes its own
        return {
            d: sharemove.hand_over(tx, d, source, destination, None, clock) for d in sorted(drives)
        }

    return registry.transact(body)


def finish(
    registry: Registry, drives: list[int], source: Holder, destination: Holder, clock: float
) -> dict[int, int]:
    """Step 3 (after 2, which it makes sure of): the source's claims go; each epoch."""

    def body(tx: StateTxn) -> dict[int, int]:
        epochs = {}
        for d in sorted(drives):
            epochs[d] = sharemove.hand_over(tx, d, source, destination, None, clock)
            sharemove.release_source(tx, d, destination)
        return epochs

    return registry.transact(body)


def give_back(
    registry: Registry, drives: list[int], source: Holder, destination: Holder, clock: float
) -> dict[int, int]:
    """Undo 1 or 2, the VM on the source: each share the source's with its claims only;
    returns the epochs of those that had moved (handed back under a newer one)."""

    def body(tx: StateTxn) -> dict[int, int]:
        back = {}
        for d in sorted(drives):
            if _moved(tx, d, destination):
                got = sharemove.hand_back(tx, d, destination, source, None, clock)
                if got is not None:
                    back[d] = got
            else:
                sharemove.drop_incoming(tx, d, source)
        return back

    return registry.transact(body)


def release(registry: Registry, drives: list[int], source: Holder, destination: Holder) -> None:
    """The VM stopped mid-move: its shares of ``drives`` go, the source's or the
    destination's (idempotent)."""

    def body(tx: StateTxn) -> None:
        for d in sorted(drives):
            gone = [tx.clear_runtime(d, SHARE_RECORD, vm_share(h)) for h in (source, destination)]
            if any(gone):
                store_claims(tx, d)

    registry.transact(body)
