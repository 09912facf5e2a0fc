"""An unplugged live migration's steps for the VM's queue-level NVMe shares
(``vmlend.ops.live_migrate``; docs/migration.md, "NVMe shares follow their VM"): the shares
that move unplugged keep their identity and are handed over under a newer epoch
(``vmlend.ledger.shareunplug``), their controllers unplugged and plugged back by
``vmlend.ops.share_plug``. Every step is idempotent: the re-run after a kill, and the
rollback, call them again.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from vmlend.fabric.base import Fabric
from vmlend.faults import fault_point
from vmlend.ledger import shareunplug
from vmlend.ops.hot_move import registry_of
from vmlend.ops.live_mode import UNPLUG
from vmlend.ops.live_state import LiveJournal
from vmlend.registry import Registry
from vmlend.topology.model import GuestRam, Holder, format_fdid

Step = Callable[[str], None]


def moving(journal: LiveJournal) -> list[int]:
    """The drives of the VM's shares that move unplugged."""
    return sorted(d for d in journal.shares if journal.device_mode(d) == UNPLUG)


def _sides(fabric: Fabric, journal: LiveJournal) -> tuple[Registry, Holder, Holder] | None:
    """The registry, source and destination of the moving shares (None: none move)."""
    registry = registry_of(fabric)
    if not moving(journal) or registry is None:
        return None
    src = Holder(journal.source, journal.vm, journal.vm_uuid)
    return registry, src, Holder(journal.destination, journal.vm, journal.vm_uuid)


def _said(epochs: dict[int, int]) -> str:
    return ", ".join(f"{format_fdid(d)} epoch {e}" for d, e in sorted(epochs.items()))


def claim(fabric: Fabric, journal: LiveJournal, ram: GuestRam, step: Step) -> None:
    """Before anything is unplugged: the moving shares' room on the destination, all or
    nothing (``FabricError``)."""
    found = _sides(fabric, journal)
    if found is None:
        return
    registry, src, dst = found
    drives = moving(journal)
    shareunplug.claim(registry, drives, src, dst, ram)
    fds = ", ".join(format_fdid(d) for d in drives)
    step(
        f"claimed room on {journal.destination} for the NVMe share(s) of {fds}, which keep"
        " their blocks"
    )
    fault_point("share-move:after-claim")


def hand_over(fabric: Fabric, journal: LiveJournal, step: Step) -> None:
    """Their controllers unplugged: the moving shares become the destination's."""
    found = _sides(fabric, journal)
    if found is None:
        return
    registry, src, dst = found
    epochs = shareunplug.hand_over(registry, moving(journal), src, dst, time.time())
    step(
        f"NVMe share(s) of {journal.vm} handed over to {journal.destination}"
        f" ({_said(epochs)}): the same blocks, queues and address space"
    )
    fault_point("share-move:after-hand-over")


def give_back(fabric: Fabric, journal: LiveJournal, step: Step) -> None:
    """The VM stays on the source: the moving shares are its there again, with the source's
    claims only (handed back under a newer epoch if they had moved)."""
    found = _sides(fabric, journal)
    if found is None:
        return
    registry, src, dst = found
    epochs = shareunplug.give_back(registry, moving(journal), src, dst, time.time())
    if epochs:
        step(f"NVMe share(s) of {journal.vm} handed back to {journal.source} ({_said(epochs)})")


def finish(fabric: Fabric, journal: LiveJournal) -> None:
    """The VM runs on the destination: the moving shares' source claims go."""
    found = _sides(fabric, journal)
    if found is not None:
        registry, src, dst = found
        shareunplug.finish(registry, moving(journal), src, dst, time.time())


def release(fabric: Fabric, journal: LiveJournal) -> None:
    """The VM stopped mid-move: the moving shares go, as at any stop of it."""
    found = _sides(fabric, journal)
    if found is not None:
        registry, src, dst = found
        shareunplug.release(registry, moving(journal), src, dst)
