"""The hot way of ``vmlend migrate --live``: the VM's remote devices stay plugged while it moves;
at the switch-over their holds move to the destination under newer fencing tokens and each
device is re-pointed there (docs/migration.md, "Hot"; the registry side is
``vmlend.ledger.handover``).

1. **claim**: the whole VM is admitted on the destination and its room claimed there beside
   the source's, with the hand-over record by which the destination's prepare hook accepts
   the arriving devices, in one transaction. Refused: nothing changed.
2. **migrate** (``Hypervisor.migrate_live`` with a ``SwitchOver``): the destination's hooks run
   (its prepare accepts exactly the recorded devices, for exactly this VM, and borrows
   nothing); then, the guest paused, each device is quiesced (its kind's driver says how:
   ``vmlend.lending.quiesce``), the holds and mdev records move in one transaction (the
   hand-over record ends with the source's holds) and each device is re-pointed at the
   destination (``fabric.base.Repoints``); the guest runs there. The source's release hook
   then finds nothing of the VM's to return: the holds and mdev records are the
   destination's.
3. **release**: the source's claims go.

A failure before the hand-over (a destination hook, the hypervisor) releases the destination's
claims: the VM runs on the source with its devices, as before. A run killed anywhere is
finished by the same command (the journal keeps the way and the claims; a killed run's
hand-over record is replaced, with its claims, by the next claim).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from vmlend.domain import read_domain
from vmlend.errors import MigrationError, VmlendError
from vmlend.fabric.base import Fabric, RegistryFabric, Repoints
from vmlend.faults import fault_point
from vmlend.hypervisor import Hypervisor, LiveMigration
from vmlend.ledger import handover, sharemove
from vmlend.ledger.handover import Claimed
from vmlend.lending.devices import holder_for, recorded_for
from vmlend.messages import plural
from vmlend.ops.live_state import LiveJournal, drop_journal, save_journal
from vmlend.registry import Registry, same_holder
from vmlend.topology.model import Holder, format_fdid

Step = Callable[[str], None]


def registry_of(fabric: Fabric | None) -> Registry | None:
    """The registry a fabric keeps its holds in; None for one without (hot needs one)."""
    return fabric.registry if isinstance(fabric, RegistryFabric) else None


def cannot_repoint(fabric: Fabric, dst_fabric: Fabric | None) -> str | None:
    """Why these fabrics cannot hand a borrowed device over (None: they can)."""
    for f in (fabric, dst_fabric):
        if f is None or not isinstance(f, Repoints) or registry_of(f) is None:
            return (
                "this fabric backend cannot re-point a borrowed device (the SmartIO driver has"
                " no mdev migration states)"
            )
    return None


class HotSwitch:
    """The ``SwitchOver`` of a hot migration: the hand-over with the guest paused, and the
    times each device's blackout runs between (its quiesce, the guest running there)."""

    def __init__(
        self,
        journal: LiveJournal,
        claimed: Claimed,
        dst_fabric: Fabric,
        mdevs: dict[int, str],
        state_dir: Path,
        step: Step,
        clock: Callable[[], float],
    ) -> None:
        self.journal, self.claimed, self.dst_fabric = journal, claimed, dst_fabric
        self.mdevs, self.state_dir, self.step, self.clock = mdevs, state_dir, step, clock
        #: Whether the holds moved (then the VM must finish on the destination).
        self.switched = False

    def _hot(self) -> list[int]:
        return [d.fdid for d in self.journal.devices if d.fdid not in self.journal.unplug]

    def switch(self) -> None:
        j = self.journal
        now = self.clock()
        hot = self._hot()
        for fdid in hot:
            j.unplugged.setdefault(fdid, now)
        save_journal(self.state_dir, j)
        if not hot:
            return
        fds = ", ".join(format_fdid(f) for f in hot)
        # The simulated nodes run no device in this process: the quiesce is the promise of
        # each kind's driver (lending.quiesce), acted out with the hardware by vmlend.sim.hotmig.
        self.step(f"switch-over: {j.vm} paused; devices {fds} quiesced")
        registry = registry_of(self.dst_fabric)
        assert registry is not None and isinstance(self.dst_fabric, Repoints)
        tokens = _moved(registry, self.claimed, j.vm_uuid)
        if tokens is None:
            tokens = handover.hand_over(registry, self.claimed, self.mdevs, time.time())
        self.switched = True
        fault_point("hot-migrate:after-hand-over")
        for fdid, token in sorted(tokens.items()):
            if fdid in self.claimed.shares:
                # the drive's manager keeps serving it: its hardware side moves the share's
                # windows in the process that runs it (vmlend.sim.hotmig), under this epoch
                continue
            try:
                self.dst_fabric.repoint(fdid, self.claimed.destination, token)
            except VmlendError as e:  # the holds moved: the migration goes on, said
                self.step(
                    f"device {format_fdid(fdid)}: its lender was not told of the move ({e});"
                    f" 'vmlend reconcile -c sim:///{j.destination}' shows it"
                )
        said = ", ".join(
            f"{format_fdid(f)} {'share epoch' if f in self.claimed.shares else 'token'} {t}"
            for f, t in sorted(tokens.items())
        )
        self.step(f"holds and mdevs of {j.vm} handed over to {j.destination} ({said})")

    def resumed(self) -> None:
        j = self.journal
        now = self.clock()
        for fdid in self._hot():
            j.back[fdid] = now
        save_journal(self.state_dir, j)


def moved_tokens(registry: Registry, claimed: Claimed) -> dict[int, int] | None:
    """The destination's tokens and share epochs when the hand-over is done, else None."""
    return _moved(registry, claimed, claimed.source.vm_uuid)


def _moved(registry: Registry, claimed: Claimed, vm_uuid: str) -> dict[int, int] | None:
    """The destination's tokens (and share epochs) when every hold and share moved already
    (a killed run's hand-over); None when they are still the source's."""
    dst = claimed.destination
    with registry.read() as tx:
        holds = {f: tx.hold(f) for f in claimed.claims}
        epochs = {d: sharemove.epoch(tx, d, dst) for d in claimed.shares}
    if not holds and not epochs:
        return None
    if all(h is not None and same_holder(h.holder, dst) for h in holds.values()) and all(
        e is not None for e in epochs.values()
    ):
        tokens = {f: h.token for f, h in holds.items() if h is not None}
        return tokens | {d: e for d, e in epochs.items() if e is not None}
    return None


def leave_hot(
    src: Hypervisor,
    dst: Hypervisor,
    fabric: Fabric,
    dst_fabric: Fabric,
    journal: LiveJournal,
    how: LiveMigration,
    state_dir: Path,
    step: Step,
    clock: Callable[[], float],
) -> float | None:
    """Steps 1-2: the VM runs on the destination with its devices plugged; its downtime.
    On a failure before the hand-over it runs on the source as before, and the error says
    so."""
    name, source, dest = journal.vm, journal.source, journal.destination
    src_registry, dst_registry = registry_of(fabric), registry_of(dst_fabric)
    assert src_registry is not None and dst_registry is not None
    src_holder = holder_for(fabric, name, journal.vm_uuid)
    dst_holder = Holder(dest, name, src_holder.vm_uuid)
    shares = sorted(s for s in journal.shares if s not in journal.unplug)
    # mixed: the devices that cannot quiesce went unplugged already
    fdids = [d.fdid for d in journal.devices if d.fdid not in journal.shares + journal.unplug]
    claimed = journal.claimed
    done = claimed is not None and _moved(dst_registry, claimed, journal.vm_uuid) is not None
    if not done:
        ram = read_domain(src.xml(name), strict=False).guest_ram
        try:
            # a killed run's record and claims go in the same transaction
            claimed = handover.claim_destination(
                src_registry, fdids, src_holder, dst_holder, ram, shares=shares
            )
        except VmlendError as e:
            if journal.claimed is not None:
                handover.abandon(src_registry, journal.claimed)
            drop_journal(state_dir, name)
            raise MigrationError(f"cannot migrate VM {name!r} to {dest}: {e}") from e
        journal.claimed = claimed
        save_journal(state_dir, journal)
        step(f"claimed room for {plural(len(fdids) + len(shares), 'device')} of {name} on {dest}")
        fault_point("hot-migrate:after-claim")
    assert claimed is not None
    mdevs = {
        m.fdid: m.uuid
        for m in fabric.mdev_records()
        if (m.fdid in fdids or m.fdid in shares) and recorded_for(m, src_holder)
    }
    switch = HotSwitch(journal, claimed, dst_fabric, mdevs, state_dir, step, clock)
    step(f"migrating {name} live to {dest} ({dst.uri}), its devices plugged")
    try:
        stats = src.migrate_live(name, dst, how, switch_over=switch)
    except VmlendError as e:
        if switch.switched or done:
            raise MigrationError(
                f"live migration of VM {name!r} to {dest} failed after its devices were handed"
                f" over: {e}; run 'vmlend migrate {name} --to {dest} --live' again to finish it"
            ) from e
        handover.abandon(src_registry, claimed)
        drop_journal(state_dir, name)
        raise MigrationError(
            f"live migration of VM {name!r} to {dest} failed: {e}; it runs on {source} with"
            " all its devices, as before"
        ) from e
    journal.migrated = clock()
    journal.downtime = stats.downtime
    save_journal(state_dir, journal)
    said = "not measured" if stats.downtime is None else f"{stats.downtime * 1000:.1f} ms"
    step(f"{name} runs on {dest} with its devices plugged (downtime {said})")
    fault_point("hot-migrate:after-migrate")
    return stats.downtime


def finish_hot(dst_fabric: Fabric | None, journal: LiveJournal, step: Step) -> None:
    """Step 3: the source's claims go (idempotent)."""
    registry = registry_of(dst_fabric)
    if journal.claimed is None or registry is None:
        return
    handover.release_source(registry, journal.claimed)
    step(f"{journal.source}'s room for the devices of {journal.vm} released")


def abandon_hot(fabric: Fabric, journal: LiveJournal) -> None:
    """The VM stopped mid-way: the destination's claims go, if they are still the source's
    hold's."""
    registry = registry_of(fabric)
    if journal.claimed is not None and registry is not None:
        handover.abandon(registry, journal.claimed)
