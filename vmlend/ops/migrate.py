"""Migrate: cold migration of a VM to another node of the fabric.

The VM keeps its devices because its XML names fdids, not host paths (docs/design.md, mechanism 10).
Order, chosen so that a failure at any step leaves the VM defined (and startable) on exactly one
of the two hosts, never on neither:

1. checks that change nothing: the destination node exists and is not the source, it has no
   domain of that name, the whole VM is admissible from it (its devices together, summed per
   adapter: path to each lender, LUT entries, window room for DMA windows, BARs and
   peer-to-peer, DMA reach), the XML rewrites for it;
2. stop the VM if it runs (graceful; ``--force`` destroys it after the timeout) and make sure its
   devices are back in the fabric (the release hook does it; leftovers are returned here);
3. the same whole-VM admission again, now against the state without the VM's holds (another
   host may have taken room in between; the check is as exact as admission's claims, which
   count P2P room for the worst BAR placement);
4. define on the destination, then undefine on the source (a failed undefine undoes the define);
5. ``--start``: start on the destination (its hook borrows the devices); if that fails, the
   definition moves back to the source.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from vmlend.domain import DomainXMLInfo, read_domain, rewrite_for_destination
from vmlend.errors import (
    FabricError,
    MigrationError,
    ShutdownTimeoutError,
    StateError,
    UnknownDomainError,
    VmlendError,
)
from vmlend.fabric.base import Fabric
from vmlend.faults import fault_point
from vmlend.hypervisor import Hypervisor
from vmlend.lending.devices import holder_for, return_all
from vmlend.messages import about, plural
from vmlend.registry.conditions import classify_errno, host_error
from vmlend.safefile import open_nofollow
from vmlend.topology.model import GuestRam, Holder, format_fdid

Progress = Callable[[str], None]


class MigrateResult(msgspec.Struct):
    vm: str
    source: str
    destination: str
    devices: list[str]
    stopped: bool = False  # the VM was running and was shut down (or destroyed)
    started: bool = False
    resumed: bool = False  # finished what an interrupted earlier run began
    rolled_back: bool = False  # --rollback: the VM is back on the source only
    steps: list[str] = msgspec.field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "vm": self.vm,
            "from": self.source,
            "to": self.destination,
            "devices": self.devices,
            "stopped": self.stopped,
            "started": self.started,
            "resumed": self.resumed,
            "rolled_back": self.rolled_back,
            "steps": self.steps,
        }


def admission_problems(
    fabric: Fabric, dom: DomainXMLInfo, dest: str, holder: Holder, leaving: Holder | None
) -> list[str]:
    """Why ``dom`` could not run on ``dest`` (empty: admissible). The whole VM is admitted
    at once, as the destination would see it: its devices summed per adapter (DMA windows,
    BARs, LUT entries, peer-to-peer), with what ``leaving`` (the VM itself on the source, about
    to give its devices back) holds counted as gone."""
    return vm_admission_problems(
        fabric, [dev.fdid for dev in dom.devices], dom.guest_ram, dest, holder, leaving
    )


def vm_admission_problems(
    fabric: Fabric,
    fdids: list[int],
    ram: GuestRam | int,
    dest: str,
    holder: Holder,
    leaving: Holder | None,
) -> list[str]:
    """``admission_problems`` for devices ``fdids`` of a guest with RAM ``ram`` (a live
    migration's devices are out of the XML while it moves)."""
    problems = []
    results = fabric.vm_admission(fdids, dest, ram, holder=holder, leaving=leaving)
    for fdid in fdids:
        bad = next((c for c in results[fdid] if not c.ok), None)
        if bad is not None:
            problems.append(about(f"device {format_fdid(fdid)}", bad.detail))
    return problems


def migrate(
    src: Hypervisor,
    dst: Hypervisor,
    fabric: Fabric,
    vm: str,
    dest_node: str,
    *,
    start: bool = False,
    shutdown_timeout: float = 60.0,
    force: bool = False,
    rollback: bool = False,
    progress: Progress = lambda _m: None,
) -> MigrateResult:
    """Move ``vm`` from ``src`` to ``dest_node`` (``dst``). Re-runnable: after an interruption
    that left the VM defined on both hosts (same UUID) or on the destination only, a re-run
    finishes the move, and ``rollback`` moves it back to the source instead."""
    source_node = fabric.local_node
    fabric.topology().node(dest_node)  # UnknownNodeError: nothing changed
    if dest_node == source_node:
        raise MigrationError(f"VM {vm!r} is already on {dest_node}; nothing to migrate")
    try:
        info = src.lookup(vm)
    except UnknownDomainError:
        # Perhaps an earlier run got as far as the undefine here.
        moved = _defined_on_destination_only(src, dst, vm, source_node, dest_node)
        if moved is None:
            raise
        return _finish_or_roll_back(
            src, dst, moved, source_node, dest_node, start, rollback, progress
        )
    name = info.name
    if not info.persistent:
        raise MigrationError(
            f"VM {name!r} is transient (not defined) on {src.uri}; define it before migrating"
        )
    try:
        there = dst.lookup(name)
    except UnknownDomainError:
        there = None
    if there is not None:
        if there.uuid != info.uuid:
            raise MigrationError(
                f"{dst.uri} already has a domain named {name!r}; remove or rename it first"
            )
        if there.active or info.active:
            where = dest_node if there.active else source_node
            raise MigrationError(
                f"VM {name!r} is defined on both {source_node} and {dest_node} (same UUID) and"
                f" runs on {where}; shut it down, then re-run the migrate (or --rollback)"
            )
        # An earlier run stopped after the define there: finish it, or undo it.
        progress(f"{name} is defined on both {source_node} and {dest_node}: an interrupted migrate")
        if rollback:
            dst.undefine(name)
            msg = f"rolled back: undefined on {dest_node} ({dst.uri})"
            progress(msg)
            return MigrateResult(name, source_node, dest_node, [], rolled_back=True, steps=[msg])
    elif rollback:
        raise MigrationError(
            f"VM {name!r} is defined on {source_node} only: there is no interrupted migration"
            " to roll back"
        )
    xml = src.xml(name, inactive=True)
    dom = read_domain(xml, source=f"definition of {name}")
    new_xml = rewrite_for_destination(xml, dest_node, source=f"definition of {name}")
    src_holder = holder_for(fabric, name, dom.uuid or info.uuid)
    dst_holder = Holder(node=dest_node, vm=name, vm_uuid=src_holder.vm_uuid)
    result = MigrateResult(name, source_node, dest_node, [format_fdid(d.fdid) for d in dom.devices])
    result.resumed = there is not None

    def step(msg: str) -> None:
        result.steps.append(msg)
        progress(msg)

    problems = admission_problems(fabric, dom, dest_node, dst_holder, src_holder)
    if problems:
        raise FabricError(
            f"cannot migrate VM {name!r} to {dest_node}: {problems[0]}; nothing was changed"
        )
    step(f"checked {plural(len(dom.devices), 'device')}: all admissible from {dest_node}")

    if info.active:
        _stop(src, name, shutdown_timeout, force, step)
        result.stopped = True
        fault_point("migrate:after-stop")
    failures = return_all(fabric, src_holder, [(d.fdid, d.mdev) for d in dom.devices], step)
    if failures:
        raise MigrationError(
            f"VM {name!r} is stopped on {source_node} but its devices could not all be returned"
            f" ({'; '.join(failures)}); it stays defined there"
        )
    step(f"devices returned on {source_node}")
    fault_point("migrate:after-return")
    problems = admission_problems(fabric, dom, dest_node, dst_holder, None)
    if problems:
        raise FabricError(
            f"cannot migrate VM {name!r} to {dest_node}: {problems[0]};"
            f" it stays defined (stopped) on {source_node}"
        )

    try:
        dst.define(new_xml)
    except VmlendError as e:
        raise MigrationError(
            f"defining VM {name!r} on {dst.uri} failed: {e}; it stays defined on {source_node}"
        ) from e
    step(f"defined on {dest_node} ({dst.uri})")
    fault_point("migrate:after-define")
    try:
        src.undefine(name)
    except UnknownDomainError as e:
        # Someone else undefined it here meanwhile: it is defined on the destination only.
        raise MigrationError(
            f"VM {name!r} vanished from {src.uri} during the migrate (another process?);"
            f" it is defined on {dest_node} ({dst.uri})"
        ) from e
    except VmlendError as e:
        _undo_define(dst, name, step)
        raise MigrationError(
            f"undefining VM {name!r} on {src.uri} failed: {e}; it stays defined on {source_node}"
        ) from e
    step(f"undefined on {source_node} ({src.uri})")
    fault_point("migrate:after-undefine")

    if start:
        try:
            dst.start(name)
        except VmlendError as e:
            where = _move_back(src, dst, name, xml, step)
            raise MigrationError(
                f"starting VM {name!r} on {dest_node} failed: {e}; it is defined on {where}"
            ) from e
        result.started = True
        step(f"started on {dest_node}")
    return result


@contextlib.contextmanager
def migration_lock(lock_dir: Path, vm: str) -> Iterator[None]:
    """One migrate of ``vm`` at a time from this host: a second one is refused with the truth
    instead of racing the first (and perhaps undoing its define). ``flock``: a killed migrate
    holds nothing, so its re-run is never locked out."""
    digest = hashlib.sha256(vm.encode()).hexdigest()[:16]
    path = lock_dir / f".migrate-{digest}.lock"
    try:
        # no O_NOFOLLOW, and root would create or append through a link planted at the name
        f = os.fdopen(open_nofollow(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600), "a+b")
    except OSError as e:
        condition = classify_errno(e.errno or 0)
        raise (host_error(condition, path, 0) if condition else None) or StateError(
            f"cannot take the migrate lock {path}: {e.strerror}"
        ) from None
    with f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise MigrationError(
                f"VM {vm!r} is being migrated by another vmlend process right now; wait for it"
                " to finish, then see where the VM is with 'vmlend status'"
            ) from None
        yield


def _defined_on_destination_only(
    src: Hypervisor, dst: Hypervisor, vm: str, source_node: str, dest_node: str
) -> str | None:
    """The VM's name when ``dst`` has it (rewritten for ``dest_node`` by a migrate) and the
    source does not; None otherwise."""
    try:
        info = dst.lookup(vm)
    except UnknownDomainError:
        return None
    dom = read_domain(dst.xml(info.name, inactive=True), strict=False)
    return info.name if dom.host_node == dest_node else None


def _finish_or_roll_back(
    src: Hypervisor,
    dst: Hypervisor,
    name: str,
    source_node: str,
    dest_node: str,
    start: bool,
    rollback: bool,
    progress: Progress,
) -> MigrateResult:
    """The VM is defined on the destination only: the move itself is done."""
    xml = dst.xml(name, inactive=True)
    devices = [format_fdid(d.fdid) for d in read_domain(xml, strict=False).devices]
    result = MigrateResult(name, source_node, dest_node, devices)

    def step(msg: str) -> None:
        result.steps.append(msg)
        progress(msg)

    info = dst.lookup(name)
    if rollback:
        if info.active:
            raise MigrationError(
                f"VM {name!r} already runs on {dest_node}; shut it down there to roll back"
            )
        src.define(rewrite_for_destination(xml, source_node, source=f"definition of {name}"))
        step(f"rolled back: defined on {source_node} ({src.uri})")
        dst.undefine(name)
        step(f"undefined on {dest_node} ({dst.uri})")
        result.rolled_back = True
        return result
    step(f"{name} is already defined on {dest_node} only: the move was done")
    result.resumed = True
    if start and not info.active:
        dst.start(name)
        step(f"started on {dest_node}")
    result.started = start or info.active
    return result


def _stop(src: Hypervisor, name: str, timeout: float, force: bool, step: Progress) -> None:
    step(f"waiting up to {timeout:g} s for {name} to shut down")  # a wait is never silent
    try:
        src.shutdown(name, timeout)
        step(f"shut down {name}")
    except ShutdownTimeoutError as e:
        if not force:
            raise MigrationError(
                f"{e}; VM {name!r} still runs on {src.uri} (pass --force to destroy it after"
                " the timeout)"
            ) from e
        src.destroy(name)
        step(f"{name} ignored the shutdown request: destroyed (--force)")


def _undo_define(dst: Hypervisor, name: str, step: Progress) -> None:
    try:
        dst.undefine(name)
        step(f"undo: undefined on {dst.uri}")
    except VmlendError as e:  # defined on both is still "not on neither"
        step(f"undo: could not undefine on {dst.uri}: {e}")


def _move_back(src: Hypervisor, dst: Hypervisor, name: str, xml: bytes, step: Progress) -> str:
    """After a failed start on the destination: define the original XML on the source again
    and drop the destination's definition. Returns where the VM is defined now."""
    try:
        src.define(xml)
    except VmlendError as e:
        step(f"could not define {name} on {src.uri} again: {e}")
        return dst.uri
    step(f"moved back: defined on {src.uri}")
    _undo_define(dst, name, step)
    return src.uri
