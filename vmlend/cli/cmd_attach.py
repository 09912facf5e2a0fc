"""``vmlend attach`` / ``vmlend detach``: hot-add and hot-remove a remote device.

libvirt runs no hook for hot-plug (FACTS.md), so for a live attach the CLI borrows the device
itself with the hook's own steps (``vmlend.lending``): reserve, mdev parent, mdev child, then
``attach_device`` and the vmlend metadata. Every step pushes its undo; any failure undoes them
all and reports one line. A ``--config`` change only edits the persistent definition: the hook
borrows the device at the next start.

Like virsh, neither flag means "current": live on a running domain, config on a stopped one.
"""

from __future__ import annotations

import difflib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

import click
from lxml import etree

from vmlend.cli.cmd_lend import FDID
from vmlend.cli.common import CliContext, emit_json, json_option
from vmlend.cli.connect import connect_option, fabric_for, open_hv
from vmlend.domain import (
    METADATA_KEY,
    NAMESPACE_URI,
    DomainDocument,
    PciAddress,
    TemplateSet,
    VmlendDevice,
    add_device,
    find_device,
    read_domain,
    remove_device,
)
from vmlend.domain.metadata import find_metadata
from vmlend.domain.model import DomainXML
from vmlend.errors import (
    ConfigError,
    DetachTimeoutError,
    DomainStateError,
    FabricError,
    VmlendError,
)
from vmlend.fabric.base import Fabric
from vmlend.fabric.model import Check, GuestRam, Holder, format_fdid
from vmlend.hypervisor import DomainInfo, Hypervisor
from vmlend.lending import UndoJournal, acquire_device, held_by, holder_for, return_device

log = logging.getLogger(__name__)

LIVE, CONFIG = "live", "config"


def resolve_targets(info: DomainInfo, live: bool, config: bool) -> tuple[str, ...]:
    """Which definitions change: libvirt's rules, checked up front with a clear line."""
    if not live and not config:
        live, config = info.active, not info.active
    if live and not info.active:
        raise DomainStateError(
            "change",
            info.name,
            "domain is not running",
            hint="use --config to change its definition",
        )
    if config and not info.persistent:
        raise DomainStateError(
            "change", info.name, "transient domains have no persistent definition"
        )
    return tuple(t for t, on in ((LIVE, live), (CONFIG, config)) if on)


def read_targets(hv: Hypervisor, name: str, targets: tuple[str, ...]) -> dict[str, bytes]:
    return {t: hv.xml(name, inactive=t == CONFIG) for t in targets}


def plain_metadata(doc: DomainDocument) -> bytes | None:
    """vmlend's metadata element in the form libvirt's metadata API takes (no namespace: the
    API puts it in ``NAMESPACE_URI`` under prefix ``METADATA_KEY``); None when there is none."""
    meta = find_metadata(doc.root)
    if meta is None:
        return None

    def plain(el: etree._Element) -> etree._Element:
        out = etree.Element(
            etree.QName(el).localname, attrib={str(k): str(v) for k, v in el.attrib.items()}
        )
        for child in el:
            if isinstance(child.tag, str):
                out.append(plain(child))
        return out

    return etree.tostring(plain(meta.element))


def find_hostdev(doc: DomainDocument, device: VmlendDevice) -> bytes | None:
    """The hostdev element of ``device``'s mdev in ``doc``; None when the domain has none."""
    for h in DomainXML(doc.root).mdev_hostdevs():
        if h.uuid == device.mdev:
            return etree.tostring(h.element, with_tail=False)
    return None


def hostdev_xml(doc: DomainDocument, device: VmlendDevice) -> bytes:
    found = find_hostdev(doc, device)
    if found is None:
        raise ConfigError(f"the domain has no hostdev for mdev {device.mdev}")
    return found


@dataclass(frozen=True)
class DetachWait:
    """How long a live detach waits for the guest to let go of the hostdev: libvirt's live
    detach returns once it asked QEMU, which unplugs only when the guest acknowledges (a guest
    without an OS never does; FACTS.md). ``clock`` and ``sleep`` are injectable for tests."""

    timeout: float = 10.0
    interval: float = 0.2
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep

    def __post_init__(self) -> None:
        if self.timeout < 0 or self.interval <= 0:
            raise ValueError(f"bad detach wait: timeout {self.timeout}, interval {self.interval}")


def live_has_hostdev(hv: Hypervisor, name: str, mdev: UUID | str) -> bool:
    """Whether the running domain's XML still has an mdev hostdev with UUID ``mdev``."""
    doc = DomainDocument.parse(hv.xml(name), source=f"live XML of {name}")
    return any(str(h.uuid) == str(mdev) for h in DomainXML(doc.root).mdev_hostdevs())


def wait_unplugged(
    hv: Hypervisor, name: str, fdid: int, mdev: UUID | str, wait: DetachWait
) -> None:
    """Return once the hostdev of ``mdev`` has left the live XML; ``DetachTimeoutError`` when
    it is still there after ``wait.timeout`` (the caller must then keep the device held)."""
    deadline = wait.clock() + wait.timeout
    while live_has_hostdev(hv, name, mdev):
        if wait.clock() >= deadline:
            raise DetachTimeoutError(name, fdid, str(mdev), wait.timeout)
        wait.sleep(wait.interval)


def xml_diff(before: bytes, after: bytes, label: str) -> str:
    lines = difflib.unified_diff(
        before.decode().splitlines(keepends=True),
        after.decode().splitlines(keepends=True),
        fromfile=f"{label} (before)",
        tofile=f"{label} (after)",
    )
    return "".join(lines)


@dataclass
class AttachPlan:
    """What an attach would do, computed without changing anything."""

    name: str
    fdid: int
    holder: Holder
    guest_ram: GuestRam | int
    targets: tuple[str, ...]
    before: dict[str, bytes]
    after: dict[str, DomainDocument]
    device: VmlendDevice
    checks: list[Check] = field(default_factory=list)

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
) -> AttachPlan:
    info = hv.lookup(vm)
    targets = resolve_targets(info, live, config)
    before = read_targets(hv, info.name, targets)
    templates = templates or TemplateSet()
    after = {
        t: add_device(
            DomainDocument.parse(x, source=f"{t} XML of {info.name}"),
            fdid,
            templates=templates,
            address=address,
        )
        for t, x in before.items()
    }
    first = targets[0]
    device = find_device(after[first], fdid)
    assert device is not None
    dom = read_domain(before[first], strict=False)
    holder = holder_for(fabric, info.name, dom.uuid or info.uuid)
    guest_ram = dom.guest_ram  # the layout's ranges: DMA reach and window segments exactly
    checks = fabric.admission(fdid, fabric.local_node, guest_ram, holder=holder)
    return AttachPlan(info.name, fdid, holder, guest_ram, targets, before, after, device, checks)


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
                record=progress,
            )
        for t in plan.pending:
            _attach_to(hv, name, t, plan.after[t], plan.device, plugged, progress, wait)
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


def _still_plugged(hv: Hypervisor, name: str, mdev: UUID) -> bool:
    try:
        return live_has_hostdev(hv, name, mdev)
    except VmlendError:
        return True  # cannot tell: keeping the device held is the safe side


def _attach_to(
    hv: Hypervisor,
    name: str,
    target: str,
    doc: DomainDocument,
    device: VmlendDevice,
    journal: UndoJournal,
    progress: Callable[[str], None],
    wait: DetachWait | None,
) -> None:
    """Plug the hostdev into one definition (live or config) and update its metadata."""
    live = target == LIVE
    dev = hostdev_xml(doc, device)
    hv.attach_device(name, dev, live=live, config=not live)

    def unplug() -> None:
        hv.detach_device(name, dev, live=live, config=not live)
        if live:
            wait_unplugged(hv, name, device.fdid, device.mdev, wait or DetachWait())

    journal.push(f"{target} hostdev", unplug)
    progress(f"attach {target} hostdev mdev {device.mdev}: ok")
    old = hv.get_metadata(name, NAMESPACE_URI, inactive=not live)
    hv.set_metadata(
        name, NAMESPACE_URI, METADATA_KEY, plain_metadata(doc), live=live, config=not live
    )
    journal.push(
        f"{target} metadata",
        lambda: hv.set_metadata(name, NAMESPACE_URI, METADATA_KEY, old, live=live, config=not live),
    )
    progress(f"{target} metadata: ok")


@dataclass
class DetachResult:
    name: str
    fdid: int
    targets: tuple[str, ...]
    returned: bool


def detach(
    hv: Hypervisor,
    fabric: Fabric,
    vm: str,
    fdid: int,
    *,
    live: bool,
    config: bool,
    progress: Callable[[str], None],
    wait: DetachWait | None = None,
) -> DetachResult:
    """Remove ``fdid`` from the chosen definitions; a live detach returns the device once the
    guest has let go of it (``DetachTimeoutError``, device still held, when it does not)."""
    wait = wait or DetachWait()
    info = hv.lookup(vm)
    targets = resolve_targets(info, live, config)
    before = read_targets(hv, info.name, targets)
    docs = {t: DomainDocument.parse(x, source=f"{t} XML of {info.name}") for t, x in before.items()}
    present = {t: find_device(d, fdid) for t, d in docs.items()}
    todo = tuple(t for t in targets if present[t] is not None)
    fd = format_fdid(fdid)
    if not todo and LIVE in targets:
        # An earlier detach that stopped after libvirt unplugged the device: finish returning it.
        dom = read_domain(before[LIVE], strict=False)
        holder = holder_for(fabric, info.name, dom.uuid or info.uuid)
        if fdid in held_by(fabric, holder):
            leftover = next((m.uuid for m in fabric.mdevs() if m.fdid == fdid), None)
            if leftover is not None:
                _unplug_orphan(hv, info.name, docs[LIVE], fdid, leftover, wait, progress)
            return_device(fabric, holder, fdid, leftover, progress)
            return DetachResult(info.name, fdid, (), True)
    if not todo:
        raise ConfigError(
            f"device {fd} is not attached to VM {info.name!r} ({'+'.join(targets)});"
            " 'vmlend status' lists its devices"
        )
    returned = False
    for t in todo:
        is_live = t == LIVE
        device = present[t]
        assert device is not None
        dev = find_hostdev(docs[t], device)
        if dev is None:
            # An earlier detach stopped after libvirt unplugged it: finish the rest.
            progress(f"{t} hostdev mdev {device.mdev}: already gone")
        else:
            hv.detach_device(info.name, dev, live=is_live, config=not is_live)
            if is_live:
                wait_unplugged(hv, info.name, fdid, device.mdev, wait)
            progress(f"detach {t} hostdev mdev {device.mdev}: ok")
        after = remove_device(docs[t], fdid, unplugged=dev is None)
        hv.set_metadata(
            info.name,
            NAMESPACE_URI,
            METADATA_KEY,
            plain_metadata(after),
            live=is_live,
            config=not is_live,
        )
        progress(f"{t} metadata: ok")
        if is_live:
            dom = read_domain(before[t], strict=False)
            holder = holder_for(fabric, info.name, dom.uuid or info.uuid)
            returned = return_device(fabric, holder, fdid, device.mdev, progress)
    return DetachResult(info.name, fdid, todo, returned)


def _unplug_orphan(
    hv: Hypervisor,
    name: str,
    doc: DomainDocument,
    fdid: int,
    mdev: str,
    wait: DetachWait,
    progress: Callable[[str], None],
) -> None:
    """A hostdev the metadata no longer names (an attach rolled back while the guest still
    had it): unplug it before its mdev goes."""
    for h in DomainXML(doc.root).mdev_hostdevs():
        if str(h.uuid) == mdev:
            hv.detach_device(
                name, etree.tostring(h.element, with_tail=False), live=True, config=False
            )
            wait_unplugged(hv, name, fdid, mdev, wait)
            progress(f"detach live hostdev mdev {mdev}: ok")


def progress(msg: str) -> None:
    """Step-by-step lines: on stderr with ``-v`` (the CLI's logging), else quiet."""
    log.info("%s", msg)


def _address(value: str | None) -> PciAddress | None:
    if value is None:
        return None
    try:
        return PciAddress.parse(value)
    except ConfigError as e:
        raise click.BadParameter(str(e), param_hint="--address") from None


@click.command("attach")
@click.argument("vm")
@click.argument("fdid", type=FDID)
@click.option("--live", is_flag=True, help="Hot-add to the running domain.")
@click.option("--config", is_flag=True, help="Add to the persistent definition.")
@click.option("--address", metavar="BDF", help="Guest PCI address, e.g. 0000:00:05.0.")
@click.option("--dry-run", is_flag=True, help="Print the checks and the XML diff; change nothing.")
@connect_option
@json_option
@click.pass_obj
def attach_cmd(
    obj: CliContext,
    vm: str,
    fdid: int,
    live: bool,
    config: bool,
    address: str | None,
    dry_run: bool,
    uri: str | None,
    json_output: bool,
) -> None:
    """Attach remote device FDID to VM (default: live if running, else its definition)."""
    addr = _address(address)
    hv = open_hv(obj, uri)
    try:
        fabric = fabric_for(obj, hv)
        plan = plan_attach(hv, fabric, vm, fdid, live=live, config=config, address=addr)
        if dry_run:
            _show_plan(plan, json_output)
            if not plan.ok:
                raise SystemExit(1)
            return
        if not plan.ok:
            raise plan.refusal()
        fd = format_fdid(fdid)
        if not plan.pending:
            msg = f"device {fd} is already attached to VM {plan.name!r} ({'+'.join(plan.targets)})"
        else:
            apply_attach(hv, fabric, plan, progress)
            msg = (
                f"attached device {fd} to VM {plan.name!r} ({'+'.join(plan.pending)}),"
                f" mdev {plan.device.mdev}"
            )
        if json_output:
            emit_json(plan.to_json() | {"changed": list(plan.pending)})
        else:
            click.echo(msg)
    finally:
        hv.close()


def _show_plan(plan: AttachPlan, json_output: bool) -> None:
    diffs = {
        t: xml_diff(plan.before[t], plan.after[t].to_bytes(), f"{t} XML") for t in plan.targets
    }
    if json_output:
        emit_json(plan.to_json() | {"ok": plan.ok, "diff": diffs})
        return
    for c in plan.checks:
        click.echo(f"{'ok  ' if c.ok else 'FAIL'}  {c.name:<12} {c.detail}")
    for t in plan.targets:
        click.echo(diffs[t] or f"({t} XML unchanged: the device is already there)\n", nl=False)
    verdict = "would attach" if plan.ok else "would be refused"
    click.echo(f"dry run: device {format_fdid(plan.fdid)} {verdict}; nothing was changed")


@click.command("detach")
@click.argument("vm")
@click.argument("fdid", type=FDID)
@click.option("--live", is_flag=True, help="Hot-remove from the running domain.")
@click.option("--config", is_flag=True, help="Remove from the persistent definition.")
@connect_option
@json_option
@click.pass_obj
def detach_cmd(
    obj: CliContext,
    vm: str,
    fdid: int,
    live: bool,
    config: bool,
    uri: str | None,
    json_output: bool,
) -> None:
    """Detach remote device FDID from VM; a live detach returns the device to the fabric."""
    hv = open_hv(obj, uri)
    try:
        fabric = fabric_for(obj, hv)
        res = detach(hv, fabric, vm, fdid, live=live, config=config, progress=progress)
    finally:
        hv.close()
    fd = format_fdid(fdid)
    if json_output:
        emit_json(
            {"vm": res.name, "fdid": fd, "targets": list(res.targets), "returned": res.returned}
        )
        return
    if not res.targets:
        click.echo(
            f"device {fd} was no longer attached to VM {res.name!r}; returned what it still held"
        )
        return
    tail = "; device returned to the fabric" if res.returned else ""
    click.echo(f"detached device {fd} from VM {res.name!r} ({'+'.join(res.targets)}){tail}")


COMMANDS = [attach_cmd, detach_cmd]
