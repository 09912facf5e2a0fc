"""``vmlend attach`` / ``vmlend detach``: hot-add and hot-remove a remote device.

The operations are in ``vmlend.ops.attach`` and ``vmlend.ops.detach``; this module parses the
options and prints. Like virsh, no flag (or ``--current``) means live on a running domain, config
on a stopped one; ``--persistent`` is the definition plus the running domain when it runs.
"""

from __future__ import annotations

import difflib
import logging

import click

from vmlend.cli.cmd_lend import FDID, FDID_OR_KIND
from vmlend.cli.common import Seconds, emit_json, json_option, verbose_option
from vmlend.cli.complete import complete_vms
from vmlend.cli.connect import connect_option, fabric_for, open_hv, refuse_simulated_devices
from vmlend.cli.context import CliContext
from vmlend.cli.impact import impact_options, resolve_impact
from vmlend.domain import PciAddress
from vmlend.errors import ConfigError, SimulatedDevicesError, VmlendError
from vmlend.fabric.base import Fabric
from vmlend.hypervisor import Hypervisor
from vmlend.ops.attach import AttachPlan, apply_attach, plan_attach
from vmlend.ops.detach import detach
from vmlend.ops.detach_preview import DetachPreview, preview_detach
from vmlend.ops.unplug import DetachWait
from vmlend.topology.choose import choose
from vmlend.topology.model import Check, InterruptPath, format_fdid
from vmlend.topology.selectors import DeviceWish

log = logging.getLogger(__name__)


def xml_diff(before: bytes, after: bytes, label: str) -> str:
    lines = difflib.unified_diff(
        before.decode().splitlines(keepends=True),
        after.decode().splitlines(keepends=True),
        fromfile=f"{label} (before)",
        tofile=f"{label} (after)",
    )
    return "".join(lines)


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
@click.argument("vm", shell_complete=complete_vms)
@click.argument("fdid", type=FDID_OR_KIND)
@impact_options("Hot-add to the running domain.", "Add to the persistent definition.")
@click.option("--address", metavar="BDF", help="Guest PCI address, e.g. 0000:00:05.0.")
@click.option(
    "--interrupts",
    type=click.Choice([p.value for p in InterruptPath]),
    help="How the device's MSI/MSI-X reach the VM: over the NTB (when its window has room,"
    " else the relay) or always the relay [default: the VM's, else ntb].",
)
@click.option("--dry-run", is_flag=True, help="Print the checks and the XML diff; change nothing.")
@connect_option
@json_option
@verbose_option
@click.pass_obj
def attach_cmd(
    obj: CliContext,
    vm: str,
    fdid: int | DeviceWish,
    live: bool,
    config: bool,
    persistent: bool,
    current: bool,
    address: str | None,
    interrupts: str | None,
    dry_run: bool,
    uri: str | None,
    json_output: bool,
) -> None:
    """Attach remote device FDID to VM (default: live if running, else its definition).

    FDID may be a kind (gpu, nvme,lender=alpha), vendor and product ids
    (vendor=10de,product=1db4) or an alias of the configuration file's [alias] table (a100):
    the available device that matches with the shortest path from the VM's node is chosen,
    preferring one close to the VM's other devices for peer-to-peer."""
    irq = None if interrupts is None else InterruptPath(interrupts)
    addr = _address(address)
    hv = open_hv(obj, uri)
    try:
        live, config = resolve_impact(
            hv, vm, live=live, config=config, persistent=persistent, current=current
        )
        if live:
            try:
                refuse_simulated_devices(obj, hv, "hot-add a device to", vm, adding=True)
            except SimulatedDevicesError as e:
                if not dry_run:
                    raise
                # the live attach's first refusal, predicted: nothing after it is planned
                shown = format_fdid(fdid) if isinstance(fdid, int) else str(fdid)
                _show_refusal(vm, shown, Check("hypervisor", False, str(e)), json_output)
                raise SystemExit(1) from None
        fabric = fabric_for(obj, hv)
        if isinstance(fdid, DeviceWish):
            fdid = _choose_one(obj, hv, fabric, vm, fdid)
        plan = plan_attach(
            hv, fabric, vm, fdid, live=live, config=config, address=addr, interrupts=irq
        )
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


def _choose_one(obj: CliContext, hv: Hypervisor, fabric: Fabric, vm: str, wish: DeviceWish) -> int:
    """The device for ``wish``, near the VM's node and its other remote devices (said on
    stderr with its path's cost)."""
    from vmlend.domain import read_domain

    has = set()
    for inactive in (False, True):
        try:
            has |= {d.fdid for d in read_domain(hv.xml(vm, inactive=inactive)).devices}
        except VmlendError:
            continue  # not running, or no such definition: plan_attach says which
    (pick,) = choose(
        fabric.topology(),
        fabric.devices(),
        [wish],
        fabric.local_node,
        exclude=has,
        aliases=obj.aliases,
    )
    click.echo(f"chose {pick.describe()}", err=True)
    return pick.fdid


def _show_refusal(vm: str, device: str, check: Check, json_output: bool) -> None:
    """A dry run refused before any plan: the one check that failed (as a plan's JSON)."""
    if json_output:
        checks = [{"name": check.name, "ok": check.ok, "detail": check.detail}]
        emit_json({"vm": vm, "fdid": device, "checks": checks, "ok": False})
        return
    click.echo(f"FAIL  {check.name:<12} {check.detail}")
    click.echo(f"dry run: device {device} would be refused; nothing was changed")


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
@click.argument("vm", shell_complete=complete_vms)
@click.argument("fdid", type=FDID)
@impact_options("Hot-remove from the running domain.", "Remove from the persistent definition.")
@click.option("--dry-run", is_flag=True, help="Print the XML diff; change nothing.")
@click.option(
    "--timeout",
    type=Seconds(min=0),
    default=DetachWait().timeout,
    show_default=True,
    help="Seconds a live detach waits for the guest to release the device (a slow guest OS"
    " may need more); on timeout the device stays the VM's.",
)
@connect_option
@json_option
@verbose_option
@click.pass_obj
def detach_cmd(
    obj: CliContext,
    vm: str,
    fdid: int,
    live: bool,
    config: bool,
    persistent: bool,
    current: bool,
    dry_run: bool,
    timeout: float,
    uri: str | None,
    json_output: bool,
) -> None:
    """Detach remote device FDID from VM; a live detach returns the device to the fabric."""
    hv = open_hv(obj, uri)
    try:
        live, config = resolve_impact(
            hv, vm, live=live, config=config, persistent=persistent, current=current
        )
        if dry_run:
            _show_detach_preview(
                preview_detach(hv, vm, fdid, live=live, config=config), json_output
            )
            return
        fabric = fabric_for(obj, hv)
        res = detach(
            hv,
            fabric,
            vm,
            fdid,
            live=live,
            config=config,
            progress=progress,
            wait=DetachWait(timeout=timeout),
        )
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


def _show_detach_preview(preview: DetachPreview, json_output: bool) -> None:
    diffs = {t: xml_diff(preview.before[t], preview.after[t], f"{t} XML") for t in preview.targets}
    fd = format_fdid(preview.fdid)
    if json_output:
        emit_json(
            {
                "vm": preview.name,
                "fdid": fd,
                "targets": list(preview.targets),
                "pending": list(preview.pending),
                "diff": diffs,
            }
        )
        return
    for t in preview.targets:
        click.echo(diffs[t] or f"({t} XML unchanged: the device is not there)\n", nl=False)
    if preview.pending:
        verdict = f"would be detached ({'+'.join(preview.pending)})"
    else:
        verdict = "is not attached"
    click.echo(f"dry run: device {fd} {verdict}; nothing was changed")


COMMANDS = [attach_cmd, detach_cmd]
