"""Migrate: cold migration of a VM to another node of the fabric.

The VM keeps its devices because its XML names fdids, not host paths (DESIGN.md, mechanism 10).
Order, chosen so that a failure at any step leaves the VM defined (and startable) on exactly one
of the two hosts, never on neither:

1. checks that change nothing: the destination node exists and is not the source, it has no
   domain of that name, every device is admissible from it (path to the lender, LUT entry,
   window room), the XML rewrites for it;
2. stop the VM if it runs (graceful; ``--force`` destroys it after the timeout) and make sure its
   devices are back in the fabric (the release hook does it; leftovers are returned here);
3. the admission checks again, now exact (the VM's own holds are gone);
4. define on the destination, then undefine on the source (a failed undefine undoes the define);
5. ``--start``: start on the destination (its hook borrows the devices); if that fails, the
   definition moves back to the source.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vmlend.domain import DomainInfo as DomainXMLInfo
from vmlend.domain import read_domain, rewrite_for_destination
from vmlend.errors import (
    FabricError,
    MigrationError,
    ShutdownTimeoutError,
    UnknownDomainError,
    VmlendError,
)
from vmlend.fabric.base import Fabric
from vmlend.fabric.model import Check, Holder, format_fdid
from vmlend.hypervisor import Hypervisor
from vmlend.lending import holder_for, return_all
from vmlend.messages import about, plural
from vmlend.registry.records import same_holder

Progress = Callable[[str], None]


@dataclass
class MigrateResult:
    vm: str
    source: str
    destination: str
    devices: list[str]
    stopped: bool = False  # the VM was running and was shut down (or destroyed)
    started: bool = False
    steps: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "vm": self.vm,
            "from": self.source,
            "to": self.destination,
            "devices": self.devices,
            "stopped": self.stopped,
            "started": self.started,
            "steps": self.steps,
        }


def admission_problems(
    fabric: Fabric, dom: DomainXMLInfo, dest: str, holder: Holder, leaving: Holder | None
) -> list[str]:
    """Why a device of ``dom`` could not be taken from ``dest`` (empty: all admissible). A device
    held by ``leaving`` (the VM itself on the source, about to give it back) is not a problem."""
    problems = []
    for dev in dom.devices:
        checks: list[Check] = fabric.admission(dev.fdid, dest, dom.memory_bytes or 0, holder=holder)
        for c in checks:
            if c.ok:
                continue
            if c.name == "not-held" and leaving is not None and _held_by(fabric, dev.fdid, leaving):
                continue
            problems.append(about(f"device {format_fdid(dev.fdid)}", c.detail))
            break
    return problems


def _held_by(fabric: Fabric, fdid: int, holder: Holder) -> bool:
    h = fabric.device(fdid).holder
    return h is not None and same_holder(h, holder)


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
    progress: Progress = lambda _m: None,
) -> MigrateResult:
    source_node = fabric.local_node
    info = src.lookup(vm)
    name = info.name
    topo = fabric.topology()
    topo.node(dest_node)  # UnknownNodeError: nothing changed
    if dest_node == source_node:
        raise MigrationError(f"VM {name!r} is already on {dest_node}; nothing to migrate")
    if not info.persistent:
        raise MigrationError(
            f"VM {name!r} is transient (not defined) on {src.uri}; define it before migrating"
        )
    try:
        dst.lookup(name)
    except UnknownDomainError:
        pass
    else:
        raise MigrationError(
            f"{dst.uri} already has a domain named {name!r}; remove or rename it first"
        )
    xml = src.xml(name, inactive=True)
    dom = read_domain(xml, source=f"definition of {name}")
    new_xml = rewrite_for_destination(xml, dest_node, source=f"definition of {name}")
    src_holder = holder_for(fabric, name, dom.uuid or info.uuid)
    dst_holder = Holder(node=dest_node, vm=name, vm_uuid=src_holder.vm_uuid)
    result = MigrateResult(name, source_node, dest_node, [format_fdid(d.fdid) for d in dom.devices])

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
    failures = return_all(fabric, src_holder, [(d.fdid, d.mdev) for d in dom.devices], step)
    if failures:
        raise MigrationError(
            f"VM {name!r} is stopped on {source_node} but its devices could not all be returned"
            f" ({'; '.join(failures)}); it stays defined there"
        )
    step(f"devices returned on {source_node}")
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
    try:
        src.undefine(name)
    except VmlendError as e:
        _undo_define(dst, name, step)
        raise MigrationError(
            f"undefining VM {name!r} on {src.uri} failed: {e}; it stays defined on {source_node}"
        ) from e
    step(f"undefined on {source_node} ({src.uri})")

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
