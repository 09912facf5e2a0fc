"""Attach: hot-add a remote device to a domain, or add it to its definition.

libvirt runs no hook for hot-plug (docs/hooks.md), so for a live attach vmlend borrows the device
itself with the hook's own steps (``vmlend.lending``): reserve, mdev parent, mdev child, then
``attach_device`` and the vmlend metadata. Every step pushes its undo; any failure undoes them
all and reports one line. A config change only edits the persistent definition: the hook
borrows the device at the next start.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from uuid import UUID

import msgspec

from vmlend.domain import (
    METADATA_KEY,
    NAMESPACE_URI,
    DomainDocument,
    PciAddress,
    TemplateSet,
    VmlendDevice,
    add_device,
    find_device,
    mdev_uuid,
    read_domain,
)
from vmlend.domain.indent import remove_child
from vmlend.domain.metadata import find_metadata
from vmlend.domain.model import DomainXML
from vmlend.domain.slots import free_hotplug_ports, machine_family
from vmlend.errors import FabricError, VmlendError
from vmlend.fabric.base import Fabric
from vmlend.faults import fault_point
from vmlend.hypervisor import Hypervisor
from vmlend.lending.devices import UndoJournal, acquire_device, holder_for, lost_holds
from vmlend.messages import plural
from vmlend.ops.definitions import (
    LIVE,
    hostdev_xml,
    plain_metadata,
    read_targets,
    resolve_targets,
)
from vmlend.ops.unplug import DetachWait, live_has_hostdev, wait_unplugged
from vmlend.topology.model import (
    DEFAULT_INTERRUPTS,
    Check,
    GuestRam,
    Holder,
    InterruptPath,
    format_fdid,
)


class AttachPlan(msgspec.Struct):
    """What an attach would do, computed without changing anything."""

    name: str
    fdid: int
    holder: Holder
    guest_ram: GuestRam | int
    targets: tuple[str, ...]
    before: dict[str, bytes]
    after: dict[str, DomainDocument]
    device: VmlendDevice
    checks: list[Check] = msgspec.field(default_factory=list)
    #: Targets whose XML already has the device's hostdev but not its metadata: an earlier
    #: attach stopped between libvirt's hot-plug and the metadata write. A re-run finishes it.
    plugged: tuple[str, ...] = ()
    #: The path the device's MSI/MSI-X ask for (its own, else the VM's default).
    interrupts: InterruptPath = DEFAULT_INTERRUPTS
    #: The templates the plan built its XML with (the metadata write builds the device again).
    templates: TemplateSet = msgspec.field(default_factory=TemplateSet)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def pending(self) -> tuple[str, ...]:
        """Targets that do not have the device yet."""
        return tuple(t for t in self.targets if self.after[t].to_bytes() != self.before[t])

    def refusal(self) -> FabricError:
        bad = next(c for c in self.checks if not c.ok)
        return FabricError(
            f"cannot attach device {format_fdid(self.fdid)} to VM {self.name!r}: {bad.detail}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "vm": self.name,
            "fdid": format_fdid(self.fdid),
            "mdev": str(self.device.mdev),
            "targets": list(self.targets),
            "interrupts": self.interrupts.value,
            "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks],
        }


def plan_attach(
    hv: Hypervisor,
    fabric: Fabric,
    vm: str,
    fdid: int,
    *,
    live: bool,
    config: bool,
    address: PciAddress | None = None,
    templates: TemplateSet | None = None,
    interrupts: InterruptPath | None = None,
) -> AttachPlan:
    info = hv.lookup(vm)
    targets = resolve_targets(info, live, config)
    before = read_targets(hv, info.name, targets)
    templates = templates or TemplateSet()
    after: dict[str, DomainDocument] = {}
    plugged: list[str] = []
    for t, x in before.items():
        doc = DomainDocument.parse(x, source=f"{t} XML of {info.name}")
        if _unrecorded_hostdev(doc, fdid):
            plugged.append(t)
        after[t] = add_device(
            doc, fdid, templates=templates, address=address, interrupts=interrupts
        )
    first = targets[0]
    device = find_device(after[first], fdid)
    assert device is not None
    dom = read_domain(before[first], strict=False)
    holder = holder_for(fabric, info.name, dom.uuid or info.uuid)
    guest_ram = dom.guest_ram  # the layout's ranges: DMA reach and window segments exactly
    irq = dom.interrupts_of(device)
    checks = fabric.admission(
        fdid, fabric.local_node, guest_ram, holder=holder, msi_over_ntb=irq is InterruptPath.NTB
    )
    if LIVE in before and address is None and hv.hotplug_ports:
        port = hotplug_port_check(DomainDocument.parse(before[LIVE]), fdid)
        if port is not None:
            checks = [*checks, port]
    return AttachPlan(
        info.name,
        fdid,
        holder,
        guest_ram,
        targets,
        before,
        after,
        device,
        checks,
        tuple(plugged),
        irq,
        templates,
    )


def hotplug_port_check(live: DomainDocument, fdid: int) -> Check | None:
    """Whether the running q35 guest ``live`` has a free port to hot-plug ``fdid``'s hostdev
    into (libvirt refuses "No more available PCI slots" otherwise, after vmlend borrowed the
    device): None where no port is needed (another machine type, the device already there)."""
    domain = DomainXML(live.root)
    if machine_family(domain.machine) != "q35" or find_device(live, fdid) is not None:
        return None
    vm_uuid = domain.uuid
    if vm_uuid is not None and any(
        h.uuid == mdev_uuid(vm_uuid, fdid) for h in domain.mdev_hostdevs()
    ):
        return None  # plugged by an interrupted attach: the re-run plugs nothing
    free = free_hotplug_ports(domain)
    if free:
        return Check("hotplug", True, plural(free, "free hot-pluggable PCIe port"))
    return Check(
        "hotplug",
        False,
        "the running q35 guest has no free hot-pluggable PCIe port and libvirt cannot add one"
        " while it runs; give its definition empty pcie-root-ports ('vmlend xml new"
        " --hotplug-slots N', or <controller type='pci' model='pcie-root-port'/>) and restart"
        " it, or attach with --config",
    )


def _unrecorded_hostdev(doc: DomainDocument, fdid: int) -> bool:
    """Whether ``doc`` has the hostdev of ``fdid``'s mdev (derived from the domain UUID) while
    its metadata does not name ``fdid``. Removes that hostdev from ``doc`` so that
    ``add_device`` builds the whole device again; the hypervisor keeps its plugged one."""
    domain = DomainXML(doc.root)
    if find_device(doc, fdid) is not None or domain.uuid is None:
        return False
    mdev = mdev_uuid(domain.uuid, fdid)
    for h in domain.mdev_hostdevs():
        if h.uuid == mdev:
            remove_child(h.element)
            return True
    return False


def apply_attach(
    hv: Hypervisor,
    fabric: Fabric,
    plan: AttachPlan,
    progress: Callable[[str], None],
    *,
    wait: DetachWait | None = None,
) -> None:
    """Carry out ``plan`` (checks passed): all of it, or nothing and one error line. A device
    the guest still has plugged after the rollback keeps its reservation and mdev."""
    held = UndoJournal()  # reservation and mdev
    plugged = UndoJournal()  # hostdevs and metadata
    fd = format_fdid(plan.fdid)
    name = plan.name
    try:
        if LIVE in plan.pending:
            acquire_device(
                fabric,
                plan.holder,
                plan.fdid,
                plan.device.mdev,
                held,
                guest_ram=plan.guest_ram,
                interrupts=plan.interrupts,
                record=progress,
            )
            fault_point("attach:after-acquire")
            if lost := lost_holds(fabric, plan.holder, [plan.fdid]):
                # a hot-add frozen past its host's lease: never plug a device another VM has
                raise FabricError(f"device {fd}: {lost[0][1]}")
        for t in plan.pending:
            _attach_to(hv, name, t, plan, plugged, progress, wait)
            if t == LIVE and LIVE not in plan.plugged:
                # the hot-plug may have hung past the lease its hold was on: the agent's
                # recovery did not know of the device yet, so it is unplugged here
                gone = lost_holds(fabric, plan.holder, [plan.fdid], unreadable_is_lost=False)
                if gone:
                    raise FabricError(f"device {fd}: {gone[0][1]}")
    except BaseException as e:  # Ctrl-C too: never leave a reservation or mdev behind
        failed = plugged.rollback(progress)
        mdev = plan.device.mdev
        if len(held) and _still_plugged(hv, name, mdev):
            failed.append(f"reserve and mdev {mdev} kept: the guest still has it")
        else:
            failed += held.rollback(progress)
        if not isinstance(e, VmlendError):
            raise
        tail = f"; could not undo: {'; '.join(failed)}" if failed else "; nothing was changed"
        raise FabricError(f"cannot attach device {fd} to VM {name!r}: {e}{tail}") from e


def attach_live(
    hv: Hypervisor,
    fabric: Fabric,
    vm: str,
    fdid: int,
    progress: Callable[[str], None],
    *,
    address: PciAddress | None = None,
    interrupts: InterruptPath | None = None,
    wait: DetachWait | None = None,
) -> None:
    """Hot-plug ``fdid`` into the running ``vm`` (plan, admission, apply): a live migration's
    re-plug, the agent's plug request, reconcile's finish of an interrupted attach. Refused
    or failed: the attach's one-line ``FabricError``, nothing left behind."""
    plan = plan_attach(
        hv, fabric, vm, fdid, live=True, config=False, address=address, interrupts=interrupts
    )
    if not plan.ok:
        raise plan.refusal()
    apply_attach(hv, fabric, plan, progress, wait=wait)


def _with_device_now(
    hv: Hypervisor, name: str, target: str, device: VmlendDevice, templates: TemplateSet
) -> DomainDocument:
    """The domain's XML as it is now with ``device`` recorded: not the planned copy, since
    another writer may have changed the metadata meanwhile (the agent's recovery unplugging a
    lost device from this VM while the attach waited for etcd), and writing the plan's copy
    would bring that device back into the metadata."""
    now = DomainDocument.parse(
        hv.xml(name, inactive=target != LIVE), source=f"{target} XML of {name}"
    )
    if find_device(now, device.fdid) is not None:
        return now
    _unrecorded_hostdev(now, device.fdid)  # the hostdev just plugged: add_device builds it again
    return add_device(
        now,
        device.fdid,
        templates=templates,
        address=device.address,
        interrupts=device.interrupts,
    )


def _unrecord(hv: Hypervisor, name: str, target: str, fdid: int) -> None:
    """Undo an attach's metadata write: ``fdid``'s entry out of the metadata as it is now.
    Not the copy read before the write: another writer may have changed it since (the
    agent's recovery taking a lost device out while the attach was frozen), and writing
    that copy back would bring the device back into the metadata."""
    now = DomainDocument.parse(
        hv.xml(name, inactive=target != LIVE), source=f"{target} XML of {name}"
    )
    meta = find_metadata(now.root)
    entry = meta.entry(fdid) if meta is not None else None
    if meta is None or entry is None:
        return  # taken out already
    remove_child(entry.element)
    left = plain_metadata(now) if meta.entries() else None
    hv.set_metadata(
        name, NAMESPACE_URI, METADATA_KEY, left, live=target == LIVE, config=target != LIVE
    )


def _still_plugged(hv: Hypervisor, name: str, mdev: UUID) -> bool:
    try:
        return live_has_hostdev(hv, name, mdev)
    except VmlendError:
        return True  # cannot tell: keeping the device held is the safe side


def _attach_to(
    hv: Hypervisor,
    name: str,
    target: str,
    plan: AttachPlan,
    journal: UndoJournal,
    progress: Callable[[str], None],
    wait: DetachWait | None,
) -> None:
    """Plug the hostdev into one definition (live or config) and update its metadata."""
    live = target == LIVE
    doc, device = plan.after[target], plan.device
    already_plugged = target in plan.plugged
    dev = hostdev_xml(doc, device)
    if already_plugged:
        # Plugged by an earlier, interrupted attach: not this run's to undo.
        progress(f"{target} hostdev mdev {device.mdev}: already plugged")
    else:
        hv.attach_device(name, dev, live=live, config=not live)

        def unplug() -> None:
            hv.detach_device(name, dev, live=live, config=not live)
            if live:
                wait_unplugged(hv, name, device.fdid, device.mdev, wait or DetachWait())

        journal.push(f"{target} hostdev", unplug)
        progress(f"attach {target} hostdev mdev {device.mdev}: ok")
    fault_point("attach:after-hotplug")
    now = _with_device_now(hv, name, target, device, plan.templates)
    hv.set_metadata(
        name, NAMESPACE_URI, METADATA_KEY, plain_metadata(now), live=live, config=not live
    )
    journal.push(f"{target} metadata", lambda: _unrecord(hv, name, target, device.fdid))
    progress(f"{target} metadata: ok")
    fault_point("attach:after-metadata")
