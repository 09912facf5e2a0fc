"""``vmlend migrate VM --to NODE --live --rollback``: undo an interrupted live migration (hot,
mixed or unplugged) so that the VM runs on the source with the devices it had there, under
newer fencing tokens wherever a hold changed hands, and nothing of it is left claimed on the
destination. Where the kill left it decides how (docs/migration.md, "Rolling back"):

- the VM still runs on the source: the destination's claims go (before the hand-over), or
  the hand-over is undone (``vmlend.ledger.handover.hand_back``: the holds come back under
  newer tokens with only the source's claims, the lenders serve the source again); an NVMe
  share moving unplugged is the source's again (``vmlend.ledger.shareunplug.give_back``: its
  destination claims dropped, or, handed over already, handed back under a newer epoch, the
  same blocks); every device that was unplugged is plugged back at its old address;
- the VM runs on the destination already: the interrupted move is finished there (the same
  code as its re-run), then the VM is moved back live the same way, which releases everything
  on the destination as any finished move does.

Nothing is done for a VM that runs on neither node, nor on the kernel backend (the
destination's agent plugs there; the re-run finishes such a move).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from vmlend.errors import MigrationError, UnknownDomainError
from vmlend.fabric.base import Fabric, Repoints
from vmlend.faults import fault_point
from vmlend.hypervisor import DomainInfo, Hypervisor, LiveMigration
from vmlend.ledger import handover
from vmlend.lending.devices import holder_for
from vmlend.ops.hot_move import moved_tokens, registry_of
from vmlend.ops.live_migrate import LiveMigrateResult, live_migrate, put_back_on_source
from vmlend.ops.live_mode import HOT, MIXED, UNPLUG
from vmlend.ops.live_state import LiveJournal, drop_journal, load_journal, save_journal
from vmlend.ops.unplug import DetachWait
from vmlend.registry import same_holder
from vmlend.topology.model import format_fdid

Progress = Callable[[str], None]


def _lookup(hv: Hypervisor, vm: str) -> DomainInfo | None:
    try:
        return hv.lookup(vm)
    except UnknownDomainError:
        return None


def roll_back_live(
    src: Hypervisor,
    dst: Hypervisor,
    fabric: Fabric,
    dst_fabric: Fabric | None,
    vm: str,
    dest_node: str,
    *,
    state_dir: Path,
    wait: DetachWait | None = None,
    progress: Progress = lambda _m: None,
    clock: Callable[[], float] = time.monotonic,
) -> LiveMigrateResult:
    """Undo the interrupted live migration of ``vm`` from this node (``src``, ``fabric``) to
    ``dest_node`` (``dst``, ``dst_fabric``), as the module docstring says. ``MigrationError``
    (nothing changed) when there is none to undo, or it went elsewhere."""
    source = fabric.local_node
    journal = load_journal(state_dir, vm)
    if journal is None:
        raise MigrationError(
            f"VM {vm!r} has no interrupted live migration from {source} to roll back; nothing"
            " was changed"
        )
    if journal.destination != dest_node:
        raise MigrationError(
            f"the interrupted live migration of VM {vm!r} went to {journal.destination}, not"
            f" {dest_node}: vmlend migrate {vm} --to {journal.destination} --live --rollback"
        )
    if dst_fabric is None:
        raise MigrationError(
            f"a live migration of VM {vm!r} on this backend cannot be rolled back: finish it"
            f" with 'vmlend migrate {vm} --to {dest_node} --live'"
        )
    here, there = _lookup(src, vm), _lookup(dst, vm)
    here_runs, there_runs = bool(here and here.active), bool(there and there.active)
    if here_runs == there_runs:
        where = "both nodes: the hypervisor is still migrating it" if here_runs else "neither node"
        raise MigrationError(
            f"VM {vm!r} runs on {where}; nothing was changed (start it, or move it cold)"
        )
    steps: list[str] = []

    def step(msg: str) -> None:
        steps.append(msg)
        progress(msg)

    if there_runs:
        return _back_from_destination(
            src, dst, fabric, dst_fabric, journal, state_dir, wait, step, clock, steps
        )
    step(f"rolling back the live migration of {journal.vm} to {dest_node}: it runs on {source}")
    _undo_hand_over(fabric, journal, state_dir, step)
    missing = put_back_on_source(
        src, fabric, journal, state_dir, wait=wait, progress=step, clock=clock
    )
    drop_journal(state_dir, journal.vm)
    if missing is not None:
        raise MigrationError(f"VM {journal.vm!r} runs on {source} without {missing}")
    step(
        f"{journal.vm} runs on {source} with all its devices; nothing of it is left on {dest_node}"
    )
    return LiveMigrateResult(
        journal.vm,
        dest_node,
        source,
        [format_fdid(d.fdid) for d in journal.devices],
        steps=steps,
        mode=journal.mode,
        rolled_back=True,
    )


def _undo_hand_over(fabric: Fabric, journal: LiveJournal, state_dir: Path, step: Progress) -> None:
    """A hot or mixed move's registry side, undone: the destination's claims go, or the
    hand-over is reversed under newer tokens and the lenders serve the source again.

    The hand-back commits before the lenders are re-pointed, so a run killed (or refused by a
    lender) in between leaves the registry the source's and a lender serving the destination's
    borrow. The journal says the hand-back began; a re-run that finds the holds the source's
    again re-points with their current tokens (the device takes a token equal to its newest)."""
    registry = registry_of(fabric)
    claimed = journal.claimed
    if journal.mode not in (HOT, MIXED) or claimed is None or registry is None:
        return
    src_holder = holder_for(fabric, journal.vm, journal.vm_uuid)
    if moved_tokens(registry, claimed) is None:
        handover.abandon(registry, claimed)
        if not journal.handing_back:
            step(f"room claimed for {journal.vm} on {journal.destination} released")
            return
        with registry.read() as tx:  # an earlier run's hand-back committed
            tokens = {
                f: h.token
                for f in claimed.claims
                if (h := tx.hold(f)) is not None and same_holder(h.holder, src_holder)
            }
    else:
        journal.handing_back = True
        save_journal(state_dir, journal)
        wanted = {d.fdid for d in journal.devices}
        with registry.read() as tx:
            mdevs = {
                m.fdid: m.uuid
                for m in tx.mdevs()
                if m.node == journal.destination and m.vm == journal.vm and m.fdid in wanted
            }
        tokens = handover.hand_back(registry, claimed, mdevs, time.time())
        fault_point("live-rollback:after-hand-back")
    for fdid, token in sorted(tokens.items()):
        if fdid not in claimed.shares and isinstance(fabric, Repoints):
            fabric.repoint(fdid, src_holder, token)
    said = ", ".join(f"{format_fdid(f)} token {t}" for f, t in sorted(tokens.items()))
    step(f"holds and mdevs of {journal.vm} handed back to {journal.source} ({said})")


def _back_from_destination(
    src: Hypervisor,
    dst: Hypervisor,
    fabric: Fabric,
    dst_fabric: Fabric,
    journal: LiveJournal,
    state_dir: Path,
    wait: DetachWait | None,
    step: Progress,
    clock: Callable[[], float],
    steps: list[str],
) -> LiveMigrateResult:
    """The VM left already: finish the move there, then move it back live the same way."""
    name, dest = journal.vm, journal.destination
    unplug = journal.mode == UNPLUG
    step(f"{name} runs on {dest} already: finishing the move there, then moving it back")
    live_migrate(
        src,
        dst,
        fabric,
        dst_fabric,
        name,
        dest,
        how=LiveMigration(),
        state_dir=state_dir,
        wait=wait,
        progress=step,
        clock=clock,
        unplug=unplug,
    )
    persistent = dst.lookup(name).persistent
    back = live_migrate(
        dst,
        src,
        dst_fabric,
        fabric,
        name,
        journal.source,
        how=LiveMigration(persistent=persistent, undefine_source=persistent),
        state_dir=state_dir,
        wait=wait,
        progress=step,
        clock=clock,
        unplug=unplug,
    )
    back.rolled_back, back.steps = True, steps
    return back
