"""Live migration of a VM with remote devices: hot (they stay plugged while the VM moves:
``vmlend.ops.hot_move``) where the hypervisor, the backend and every device's driver allow it
(``vmlend.ops.live_mode``), else unplugged: unplug them, move the VM while it runs, plug them
back on the destination at the same guest addresses. The rest of this docstring is the
unplugged way.

The destination's start hook would refuse a running VM whose devices the source still holds,
and a VFIO device cannot be migrated with its state on today's hardware; so the guest loses its
remote devices for a while (their *blackout*) and keeps its memory and CPUs (the VM's own
*downtime* is the hypervisor's short switch-over). The lender stays the same; the borrower
changes. Order:

1. checks that change nothing: the destination exists and is not the source, the VM runs here,
   the whole VM is admissible from the destination with its own current holds counted as
   movable (as cold migration: ``vm_admission``), the XML rewrites for it. Then the journal
   (``vmlend.ops.live_state``) records the devices, their guest addresses and the tokens of
   the VM's holds; when the destination's agent plugs the devices back, the registry records
   the migration as in progress (``vmlend.ops.migration_record``) until it ends;
2. each device is hot-unplugged from the running guest (waiting for the guest to let go, as
   ``detach`` does) and returned; the VM's persistent definition keeps it. A queue-level NVMe
   share is never returned: its room on the destination is claimed before anything is
   unplugged, and once its controller is out it is handed over under a newer epoch, keeping
   its blocks (``vmlend.ops.share_move``);
3. the whole VM again, now without its holds (another host may have taken room meanwhile);
4. the live migration (``Hypervisor.migrate_live``; the destination's hook rewrites the XML);
5. each device is reserved for the VM on the destination and hot-plugged at its old address:
   by this process through the destination's fabric (the simulated nodes), or, on the kernel
   backend, where the mdev must be created in the destination host's sysfs, by the
   destination's ``vmlend agent`` answering a plug request (``vmlend.ops.plug_request``).

A failure in 2-4 puts the devices back into the guest on the source (the VM never left it).
A failure in 5 leaves the VM running on the destination without the devices that could not come
back; the error names them and the command that finishes. A re-run after any interruption
(``kill -9`` included) reads the journal and finishes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from uuid import UUID

import msgspec
from lxml import etree

from vmlend.domain import (
    METADATA_KEY,
    NAMESPACE_URI,
    DomainDocument,
    mdev_uuid,
    read_domain,
    rewrite_for_destination,
)
from vmlend.domain.model import DomainXML
from vmlend.errors import (
    FabricError,
    MigrationError,
    StateError,
    UnknownDomainError,
    VmlendError,
)
from vmlend.fabric.base import Fabric
from vmlend.faults import fault_point
from vmlend.hypervisor import DomainInfo, Hypervisor, LiveMigration
from vmlend.ledger import sharemove
from vmlend.lending.devices import held_by, holder_for
from vmlend.messages import plural
from vmlend.ops import share_move
from vmlend.ops.attach import attach_live
from vmlend.ops.detach import detach
from vmlend.ops.hot_move import (
    abandon_hot,
    cannot_repoint,
    finish_hot,
    leave_hot,
    registry_of,
)
from vmlend.ops.live_mode import HOT, MIXED, UNPLUG, choose_mode
from vmlend.ops.live_state import (
    LiveDevice,
    LiveJournal,
    LiveRecord,
    drop_journal,
    load_journal,
    record,
    save_journal,
)
from vmlend.ops.migrate import vm_admission_problems
from vmlend.ops.migration_record import MigrationRecord
from vmlend.ops.plug_request import (
    DEFAULT_PLUG_TIMEOUT,
    PlugRequest,
    PlugRequests,
    plug_remotely,
)
from vmlend.ops.share_plug import plug_share, unplug_controller
from vmlend.ops.unplug import DetachWait
from vmlend.topology.compiled import stored_topology
from vmlend.topology.model import GuestRam, Holder, format_fdid

Progress = Callable[[str], None]


class LiveMigrateResult(msgspec.Struct):
    vm: str
    source: str
    destination: str
    devices: list[str]
    downtime: float | None = None
    #: Seconds each device was out of the guest (by fdid); None: not known (it came back in
    #: an earlier, interrupted run that did not get to write the time down).
    blackout: dict[int, float | None] = msgspec.field(default_factory=dict)
    resumed: bool = False
    steps: list[str] = msgspec.field(default_factory=list)
    #: "hot" (the devices stayed plugged), "unplug" (unplugged and plugged back) or "mixed".
    mode: str = UNPLUG
    #: How each device moved (by fdid): "hot" or "unplug".
    modes: dict[int, str] = msgspec.field(default_factory=dict)
    #: ``--rollback``: an interrupted move was undone; the VM runs on ``destination`` (the
    #: source of the move it undid) again.
    rolled_back: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "vm": self.vm,
            "from": self.source,
            "to": self.destination,
            "live": True,
            "mode": self.mode,
            "modes": {format_fdid(f): m for f, m in sorted(self.modes.items())},
            "devices": self.devices,
            "downtime": self.downtime,
            "blackout": {format_fdid(f): s for f, s in sorted(self.blackout.items())},
            "resumed": self.resumed,
            "rolled_back": self.rolled_back,
            "steps": self.steps,
        }


class _Run:
    """One run of a live migration: the hosts, the journal, and where progress goes."""

    def __init__(
        self,
        src: Hypervisor,
        dst: Hypervisor,
        fabric: Fabric,
        dst_fabric: Fabric | None,
        how: LiveMigration,
        state_dir: Path,
        wait: DetachWait,
        progress: Progress,
        clock: Callable[[], float],
        plugs: PlugRequests | None = None,
        plug_timeout: float = DEFAULT_PLUG_TIMEOUT,
        unplug: bool = False,
    ) -> None:
        self.plugs, self.plug_timeout, self.unplug = plugs, plug_timeout, unplug
        self.src, self.dst = src, dst
        self.fabric, self.dst_fabric = fabric, dst_fabric
        self.how = how
        self.state_dir = state_dir
        self.wait = wait
        self.clock = clock
        self.progress = progress
        self.steps: list[str] = []

    def step(self, msg: str) -> None:
        self.steps.append(msg)
        self.progress(msg)


def live_migrate(
    src: Hypervisor,
    dst: Hypervisor,
    fabric: Fabric,
    dst_fabric: Fabric | None,
    vm: str,
    dest_node: str,
    *,
    how: LiveMigration,
    state_dir: Path,
    wait: DetachWait | None = None,
    progress: Progress = lambda _m: None,
    clock: Callable[[], float] = time.monotonic,
    now: Callable[[], float] = time.time,
    plugs: PlugRequests | None = None,
    plug_timeout: float = DEFAULT_PLUG_TIMEOUT,
    unplug: bool = False,
) -> LiveMigrateResult:
    """Move the running ``vm`` from ``src`` (this node; ``fabric`` seen from it) to
    ``dest_node`` (``dst``; ``dst_fabric`` seen from there) keeping its remote devices: hot
    where it can, else unplugged (``unplug``: unplugged in any case).
    Re-runnable: a journal under ``state_dir`` says what an interrupted run left to do.
    ``plugs``: the destination's agent plugs the devices back (answering a plug request within
    ``plug_timeout`` seconds) instead of this process through ``dst_fabric``."""
    source_node = fabric.local_node
    fabric.topology().node(dest_node)  # UnknownNodeError: nothing changed
    if dest_node == source_node:
        raise MigrationError(f"VM {vm!r} is already on {dest_node}; nothing to migrate")
    run = _Run(
        src,
        dst,
        fabric,
        dst_fabric,
        how,
        state_dir,
        wait or DetachWait(),
        progress,
        clock,
        plugs,
        plug_timeout,
        unplug,
    )
    journal = load_journal(state_dir, vm)
    if journal is not None and journal.destination != dest_node:
        raise MigrationError(
            f"a live migration of VM {vm!r} to {journal.destination} was interrupted; finish it"
            f" first: vmlend migrate {vm} --to {journal.destination} --live"
        )
    here, there = _lookup(src, vm), _lookup(dst, vm)
    if journal is None:
        if here is None or not here.active:
            if there is not None and there.active and _rewritten_for(dst, there.name, dest_node):
                run.step(f"{there.name} already runs on {dest_node}: the live migration was done")
                return LiveMigrateResult(
                    there.name, source_node, dest_node, [], resumed=True, steps=run.steps
                )
            if here is None:
                raise UnknownDomainError(vm, src.uri)
            raise MigrationError(
                f"VM {here.name!r} is not running on {source_node}; a live migration moves a"
                " running VM (leave out --live to move it cold)"
            )
        if plugs is not None and not plugs.agent_serves(dest_node):
            raise MigrationError(
                f"no vmlend agent with a hypervisor (-c) runs on {dest_node}, which plugs the"
                f" devices of {here.name!r} back in after a live migration on the kernel"
                " backend; start 'vmlend agent -c URI' there, then retry; nothing was changed"
            )
        journal = _begin(run, here, there, dest_node)
        try:
            _record_begins(run, journal)
        except VmlendError as e:
            drop_journal(state_dir, journal.vm)
            raise MigrationError(
                f"cannot record the live migration of VM {journal.vm!r} in the registry: {e};"
                " nothing was changed"
            ) from e
    else:
        journal.resumed = True
        run.step(f"resuming the interrupted live migration of {journal.vm} to {dest_node}")
        _record_begins(run, journal)  # again: the source's lease it was on may have ended
    name = journal.vm
    here_runs = here is not None and here.active
    there_runs = there is not None and there.active
    if here_runs and there_runs:
        raise MigrationError(
            f"VM {name!r} runs on both {source_node} and {dest_node}: the hypervisor is still"
            " migrating it; wait for that to end, then run this command again"
        )
    if not here_runs and not there_runs:
        if journal.mode in (HOT, MIXED):
            abandon_hot(fabric, journal)
        share_move.release(fabric, journal)
        drop_journal(state_dir, name)
        _record_ends(run, journal)
        raise MigrationError(
            f"VM {name!r} stopped during its live migration and runs on neither {source_node}"
            f" nor {dest_node}; its definition keeps its devices: start it, or move it cold"
            f" with 'vmlend migrate {name} --to {dest_node}'"
        )
    downtime = journal.downtime
    if here_runs and journal.mode == HOT:
        assert dst_fabric is not None  # the mode says so
        downtime = leave_hot(
            src, dst, fabric, dst_fabric, journal, how, state_dir, run.step, clock
        )
    elif here_runs and journal.mode == MIXED:
        downtime = _leave_mixed(run, journal)
    elif here_runs:
        downtime = _leave_source(run, journal)
    return _arrive(run, journal, downtime, now)


def put_back_on_source(
    src: Hypervisor,
    fabric: Fabric,
    journal: LiveJournal,
    state_dir: Path,
    *,
    wait: DetachWait | None = None,
    progress: Progress = lambda _m: None,
    clock: Callable[[], float] = time.monotonic,
) -> str | None:
    """Plug every journalled device the guest on the source lacks back in at its old address
    (a rollback); what could not come back and how to plug it, None when all did. An unplug
    the interruption cut short is finished first (its hostdev may be gone, its hold not)."""
    run = _Run(
        src, src, fabric, None, LiveMigration(), state_dir, wait or DetachWait(), progress, clock
    )
    begun = [
        d
        for d in journal.devices
        if d.fdid in journal.unplugged and journal.device_mode(d.fdid) == UNPLUG
    ]
    _unplug(run, journal, begun)
    share_move.give_back(run.fabric, journal, run.step)
    fault_point("live-rollback:after-share-hand-back")
    missing = _plug_back(run, src, fabric, journal, False)
    return _missing(missing, journal.vm, src.uri) if missing else None


def _record(journal: LiveJournal) -> MigrationRecord:
    return MigrationRecord(
        journal.vm,
        journal.vm_uuid,
        journal.source,
        journal.destination,
        {d.fdid: journal.tokens.get(d.fdid, 0) for d in journal.devices},
    )


def _record_begins(run: _Run, journal: LiveJournal) -> None:
    """The registry shows the migration in progress (the destination's agent plugs only for
    one it shows); only when that agent is asked to plug (``run.plugs``)."""
    if run.plugs is not None:
        run.plugs.migrations.begin(_record(journal))


def _record_ends(run: _Run, journal: LiveJournal) -> None:
    """The migration ended (done, or rolled back): its record goes. A record that cannot be
    deleted now ends with this host's lease; the migration's outcome stands."""
    if run.plugs is None:
        return
    try:
        run.plugs.migrations.end(_record(journal))
    except StateError as e:
        run.step(
            f"could not delete the registry's record of this migration ({e}); it ends"
            " with this host's lease"
        )


def _lookup(hv: Hypervisor, vm: str) -> DomainInfo | None:
    try:
        return hv.lookup(vm)
    except UnknownDomainError:
        return None


def _rewritten_for(hv: Hypervisor, name: str, node: str) -> bool:
    return read_domain(hv.xml(name), strict=False).host_node == node


def _begin(run: _Run, here: DomainInfo, there: DomainInfo | None, dest_node: str) -> LiveJournal:
    """Step 1: every check, then the journal. Nothing else is changed."""
    name = here.name
    if there is not None and there.uuid != here.uuid:
        raise MigrationError(
            f"{run.dst.uri} already has a domain named {name!r}; remove or rename it first"
        )
    xml = run.src.xml(name)
    dom = read_domain(xml, source=f"live XML of {name}")
    shares = sorted(d.fdid for d in dom.devices if d.share is not None)
    rewrite_for_destination(xml, dest_node, source=f"live XML of {name}")  # refuses bad XML
    backed = {
        d.fdid: f"is an NVMe share of two paths (its relay rings live in {run.fabric.local_node}'s"
        " memory)"
        for d in dom.devices
        if d.share is not None and d.share.paths > 1
    }
    mode = choose_mode(
        name,
        {d.fdid: run.fabric.device(d.fdid).spec.kind for d in dom.devices},
        hypervisor=None
        if run.src.hot_migration and run.dst.hot_migration
        else f"{run.src.uri} calls nothing at the switch-over, which a device needs to stay"
        " plugged",
        backend=cannot_repoint(run.fabric, run.dst_fabric) if run.plugs is None else (
            "this fabric backend cannot re-point a borrowed device (the SmartIO driver has no"
            " mdev migration states)"
        ),
        unplug=run.unplug,
        unplugged=backed,
    )
    src_holder = holder_for(run.fabric, name, dom.uuid or here.uuid)
    dst_holder = Holder(node=dest_node, vm=name, vm_uuid=src_holder.vm_uuid)
    fdids = [d.fdid for d in dom.devices if d.share is None]
    registry = registry_of(run.fabric)
    if shares and (run.plugs is not None or registry is None):
        raise MigrationError(
            f"VM {name!r} has queue-level NVMe shares ({_fds(shares)}), which the destination's"
            " agent cannot plug back (it plugs devices back through an mdev it makes, not a"
            " share's controller); detach them first"
        )
    problems = vm_admission_problems(
        run.fabric, fdids, dom.guest_ram, dest_node, dst_holder, src_holder
    )
    if shares and registry is not None:
        with registry.read() as tx:
            topology = stored_topology(tx.topology())
            for hot in (True, False):
                problems += sharemove.move_problems(
                    tx,
                    topology,
                    [f for f in shares if (mode.device_mode(f) == UNPLUG) != hot],
                    src_holder,
                    dst_holder,
                    dom.guest_ram,
                    hot=hot,
                )
    holds = run.fabric.holds_of(src_holder)
    if problems:
        raise FabricError(
            f"cannot migrate VM {name!r} to {dest_node}: {problems[0]}; nothing was changed"
        )
    said = plural(len(fdids), "device") + (
        f" and {plural(len(shares), 'NVMe share')}" if shares else ""
    )
    run.step(f"checked {said}: all admissible from {dest_node}")
    run.step(mode.line)
    for line in mode.lines:
        run.step(line)
    doc = DomainDocument.parse(xml, source=f"live XML of {name}")
    addresses = {str(h.uuid): h.guest_address for h in DomainXML(doc.root).mdev_hostdevs()}
    devices = [
        LiveDevice(d.fdid, d.address or addresses.get(str(d.mdev)), d.interrupts, d.share)
        for d in dom.devices
    ]
    journal = LiveJournal(
        name,
        src_holder.vm_uuid,
        run.fabric.local_node,
        dest_node,
        devices,
        tokens={f: holds[f].token for f in fdids if f in holds},
        shell=_without_devices(run.src.get_metadata(name, NAMESPACE_URI)),
        mode=mode.mode,
        shares=shares,
        unplug=list(mode.unplugged),
    )
    save_journal(run.state_dir, journal)
    return journal


def _fds(fdids: list[int]) -> str:
    return ", ".join(format_fdid(f) for f in fdids)


def _without_devices(plain: bytes | None) -> bytes | None:
    """vmlend's metadata element (libvirt's plain form) without its device entries."""
    if plain is None:
        return None
    root = etree.fromstring(plain, parser=etree.XMLParser(resolve_entities=False, no_network=True))
    for child in list(root):
        if isinstance(child.tag, str) and etree.QName(child).localname == "device":
            root.remove(child)
    return etree.tostring(root)


def _guest_ram(run: _Run, journal: LiveJournal) -> GuestRam:
    return read_domain(run.src.xml(journal.vm), strict=False).guest_ram


def _guest_fdids(hv: Hypervisor, name: str) -> set[int]:
    return {d.fdid for d in read_domain(hv.xml(name), strict=False).devices}


def _leave_source(run: _Run, journal: LiveJournal) -> float | None:
    """Steps 2-4. On failure the devices go back into the guest here, and the error says so."""
    name, dest = journal.vm, journal.destination
    try:
        share_move.claim(run.fabric, journal, _guest_ram(run, journal), run.step)
        _unplug(run, journal, journal.devices)
        share_move.hand_over(run.fabric, journal, run.step)
        ram = read_domain(run.src.xml(name), strict=False).guest_ram
        _unplugged_admissible(run, journal, journal.devices, ram)
        if journal.shell is not None and run.src.get_metadata(name, NAMESPACE_URI) is None:
            # The last unplug took vmlend's metadata with it: a VM without any would pass the
            # destination's migrate hook unrewritten.
            run.src.set_metadata(
                name, NAMESPACE_URI, METADATA_KEY, journal.shell, live=True, config=False
            )
        run.step(f"migrating {name} live to {dest} ({run.dst.uri})")
        stats = run.src.migrate_live(name, run.dst, run.how)
    except VmlendError as e:
        raise MigrationError(
            f"live migration of VM {name!r} to {dest} failed: {e}; {_back_on_source(run, journal)}"
        ) from e
    journal.migrated = run.clock()
    journal.downtime = stats.downtime
    save_journal(run.state_dir, journal)
    said = "not measured" if stats.downtime is None else f"{stats.downtime * 1000:.1f} ms"
    run.step(f"{name} runs on {dest} (downtime {said})")
    fault_point("live-migrate:after-migrate")
    return stats.downtime


def _unplugged_admissible(
    run: _Run, journal: LiveJournal, devices: list[LiveDevice], ram: GuestRam
) -> None:
    """``devices``, unplugged and returned, are admissible from the destination still
    (another host may have taken room meanwhile); ``FabricError`` when not."""
    dest = journal.destination
    dst_holder = Holder(node=dest, vm=journal.vm, vm_uuid=journal.vm_uuid)
    fdids = [d.fdid for d in devices if d.share is None]
    # the shares' room there is claimed already (``share_move.claim``)
    problems = vm_admission_problems(run.fabric, fdids, ram, dest, dst_holder, None)
    if problems:
        raise FabricError(f"{problems[0]} (taken while the devices were unplugged)")


def _leave_mixed(run: _Run, journal: LiveJournal) -> float | None:
    """A mixed move: the devices that cannot quiesce are unplugged and returned (and the
    destination's room for them checked again), then the others move hot. A failure before
    the hot hand-over puts the unplugged ones back into the guest here."""
    name, dest = journal.vm, journal.destination
    out = [d for d in journal.devices if d.fdid in journal.unplug]
    try:
        share_move.claim(run.fabric, journal, _guest_ram(run, journal), run.step)
        _unplug(run, journal, out)
        share_move.hand_over(run.fabric, journal, run.step)
        ram = read_domain(run.src.xml(name), strict=False).guest_ram
        _unplugged_admissible(run, journal, out, ram)
    except VmlendError as e:
        raise MigrationError(
            f"live migration of VM {name!r} to {dest} failed: {e}; {_back_on_source(run, journal)}"
        ) from e
    assert run.dst_fabric is not None  # the mode says so
    try:
        return leave_hot(
            run.src,
            run.dst,
            run.fabric,
            run.dst_fabric,
            journal,
            run.how,
            run.state_dir,
            run.step,
            run.clock,
        )
    except MigrationError as e:
        if load_journal(run.state_dir, name) is not None:
            raise  # handed over: the re-run finishes on the destination
        share_move.give_back(run.fabric, journal, run.step)
        missing = _plug_back(run, run.src, run.fabric, journal, False)
        if not missing:
            raise MigrationError(f"{e} (the unplugged devices are back in it)") from e
        raise MigrationError(
            f"{e}; but without {_missing(missing, name, run.src.uri)}"
        ) from e


def _unplug(run: _Run, journal: LiveJournal, devices: list[LiveDevice]) -> None:
    """Unplug ``devices`` from the guest on the source and return them (idempotent)."""
    name, source = journal.vm, journal.source
    holder = holder_for(run.fabric, name, journal.vm_uuid)
    present = _guest_fdids(run.src, name)
    held = set(held_by(run.fabric, holder))
    for dev in devices:
        if dev.share is not None:
            _unplug_share(run, journal, dev, dev.fdid in present)
            continue
        if dev.fdid not in present and dev.fdid not in held:
            continue  # unplugged and returned by an earlier run
        fd = format_fdid(dev.fdid)
        journal.unplugged.setdefault(dev.fdid, run.clock())
        save_journal(run.state_dir, journal)
        if dev.fdid in present:
            run.step(
                f"unplugging device {fd} from {name}: waiting up to"
                f" {run.wait.timeout:g} s for the guest to let go"
            )
        detach(
            run.src,
            run.fabric,
            name,
            dev.fdid,
            live=True,
            config=False,
            progress=run.step,
            wait=run.wait,
        )
        run.step(f"device {fd} unplugged from {name} and returned on {source}")
        fault_point("live-migrate:after-unplug")


def _unplug_share(run: _Run, journal: LiveJournal, dev: LiveDevice, present: bool) -> None:
    """Unplug one NVMe share's controller on the source (idempotent); the share stays the
    VM's, and moves with ``share_move.hand_over``."""
    fd = format_fdid(dev.fdid)
    journal.unplugged.setdefault(dev.fdid, run.clock())
    save_journal(run.state_dir, journal)
    if present:
        run.step(
            f"unplugging the NVMe share of {fd} from {journal.vm}: waiting up to"
            f" {run.wait.timeout:g} s for the guest to let go"
        )
    unplug_controller(run.src, run.fabric, journal.vm, dev.fdid, run.step, run.wait)
    run.step(f"controller of the NVMe share of {fd} unplugged from {journal.vm}; the share stays")
    fault_point("live-migrate:after-unplug")


def _back_on_source(run: _Run, journal: LiveJournal) -> str:
    """Plug every journalled device the guest lacks back in on the source; what to tell."""
    name, source = journal.vm, journal.source
    share_move.give_back(run.fabric, journal, run.step)
    missing = _plug_back(run, run.src, run.fabric, journal, False)
    drop_journal(run.state_dir, name)
    _record_ends(run, journal)
    if not missing:
        return f"it runs on {source} with all its devices, as before"
    return f"it runs on {source} without {_missing(missing, name, run.src.uri)}"


def _plug_back(
    run: _Run,
    hv: Hypervisor,
    fabric: Fabric,
    journal: LiveJournal,
    timed: bool,
) -> list[tuple[LiveDevice, str]]:
    """Hot-plug each journalled device ``hv``'s guest lacks at its old address; the ones
    that could not come back, each with why. ``timed``: journal when each came back."""
    name = journal.vm
    present = _guest_fdids(hv, name)
    missing: list[tuple[LiveDevice, str]] = []
    for dev in journal.devices:
        if dev.fdid in present:
            continue
        fd = format_fdid(dev.fdid)
        try:
            if dev.share is not None:
                plug_share(hv, fabric, name, dev.fdid, dev.share, run.step, address=dev.address)
            else:
                attach_live(
                    hv,
                    fabric,
                    name,
                    dev.fdid,
                    run.step,
                    address=dev.address,
                    interrupts=dev.interrupts,
                    wait=run.wait,
                )
        except VmlendError as e:
            run.step(f"device {fd}: could not plug it back into {name}: {e}")
            missing.append((dev, str(e)))
            continue
        at = f" at {dev.address}" if dev.address is not None else ""
        run.step(f"device {fd} plugged back into {name}{at} on {fabric.local_node}")
        if timed:
            journal.back[dev.fdid] = run.clock()
            save_journal(run.state_dir, journal)
            fault_point("live-migrate:after-replug")
    return missing


def _plug_remotely(
    run: _Run, plugs: PlugRequests, journal: LiveJournal
) -> list[tuple[LiveDevice, str]]:
    """Step 5 through the destination's agent: a plug request for every journalled device the
    guest there lacks; the ones that could not come back, each with why."""
    name, dest = journal.vm, journal.destination
    present = _guest_fdids(run.dst, name)
    wanted = [d for d in journal.devices if d.fdid not in present]
    if not wanted:
        return []
    vm_uuid = UUID(journal.vm_uuid)
    req = PlugRequest(
        id=str(vm_uuid),
        vm=name,
        vm_uuid=journal.vm_uuid,
        node=dest,
        source=journal.source,
        devices=wanted,
        mdevs={d.fdid: str(mdev_uuid(vm_uuid, d.fdid)) for d in wanted},
        tokens={d.fdid: journal.tokens.get(d.fdid, 0) for d in wanted},
    )
    outcome = {
        o.fdid: o for o in plug_remotely(plugs, req, timeout=run.plug_timeout, progress=run.step)
    }
    missing: list[tuple[LiveDevice, str]] = []
    for dev in wanted:
        fd = format_fdid(dev.fdid)
        got = outcome.get(dev.fdid)
        if got is None or not got.plugged:
            reason = got.reason if got is not None and got.reason else f"{dest} did not plug it"
            run.step(f"device {fd}: {dest} could not plug it back into {name}: {reason}")
            missing.append((dev, reason))
            continue
        at = f" at {dev.address}" if dev.address is not None else ""
        run.step(f"device {fd} plugged back into {name}{at} on {dest} by its agent")
        journal.back[dev.fdid] = run.clock()
    save_journal(run.state_dir, journal)
    fault_point("live-migrate:after-replug")
    return missing


def _missing(missing: list[tuple[LiveDevice, str]], name: str, uri: str) -> str:
    fds = ", ".join(format_fdid(d.fdid) for d, _ in missing)
    first = missing[0][1]
    commands = "; ".join(
        f"vmlend attach {name} {format_fdid(d.fdid)} --live -c {uri}"
        + (f" --address {d.address}" if d.address is not None else "")
        for d, _ in missing
    )
    return f"device(s) {fds} ({first}); plug them back with: {commands}"


def _arrive(
    run: _Run, journal: LiveJournal, downtime: float | None, now: Callable[[], float]
) -> LiveMigrateResult:
    """Step 5: the VM runs on the destination; bring its devices back."""
    name, dest = journal.vm, journal.destination
    _fix_definition(run, name, dest)
    if journal.mode in (HOT, MIXED):
        finish_hot(run.dst_fabric, journal, run.step)
    share_move.finish(run.fabric, journal)
    if run.plugs is not None:
        missing = _plug_remotely(run, run.plugs, journal)
    elif run.dst_fabric is not None:
        missing = _plug_back(run, run.dst, run.dst_fabric, journal, True)
    else:
        raise MigrationError(f"no way to plug the devices of {name!r} back in on {dest}")
    if missing:
        fds = ", ".join(format_fdid(d.fdid) for d, _ in missing)
        raise MigrationError(
            f"VM {name!r} runs on {dest} without device(s) {fds}: {missing[0][1]}; once that is"
            f" fixed, run 'vmlend migrate {name} --to {dest} --live' again to plug them back"
        )
    blackout: dict[int, float | None] = {}
    for dev in journal.devices:
        gone, returned = journal.unplugged.get(dev.fdid), journal.back.get(dev.fdid)
        blackout[dev.fdid] = None if gone is None or returned is None else returned - gone
    modes = {d.fdid: journal.device_mode(d.fdid) for d in journal.devices}
    rec = LiveRecord(
        journal.source, dest, now(), downtime, blackout, journal.resumed, journal.mode, modes
    )
    record(run.state_dir, name, rec)
    drop_journal(run.state_dir, name)
    _record_ends(run, journal)
    if journal.mode == HOT:
        run.step(f"{plural(len(journal.devices), 'device')} stayed plugged in {name} on {dest}")
    elif journal.mode == MIXED:
        kept = len(journal.devices) - len(journal.unplug)
        run.step(
            f"{plural(kept, 'device')} stayed plugged in {name} on {dest},"
            f" {plural(len(journal.unplug), 'device')} plugged back"
        )
    else:
        run.step(f"{plural(len(journal.devices), 'device')} back in {name} on {dest}")
    return LiveMigrateResult(
        name,
        journal.source,
        dest,
        [format_fdid(d.fdid) for d in journal.devices],
        downtime=downtime,
        blackout=blackout,
        resumed=journal.resumed,
        steps=run.steps,
        mode=journal.mode,
        modes=modes,
    )


def _fix_definition(run: _Run, name: str, dest: str) -> None:
    """The destination's persistent definition (``--persistent``) is the source's as it was:
    rewrite it for the destination as cold migration does."""
    info = run.dst.lookup(name)
    if not info.persistent:
        return
    xml = run.dst.xml(name, inactive=True)
    if read_domain(xml, strict=False).host_node == dest:
        return
    run.dst.define(rewrite_for_destination(xml, dest, source=f"definition of {name}"))
    run.step(f"definition of {name} on {dest} rewritten for {dest}")
