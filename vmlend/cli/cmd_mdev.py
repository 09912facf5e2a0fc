"""``vmlend mdev``: the host's mediated devices, for any parent driver (SmartIO, mtty, ...)."""

from __future__ import annotations

import uuid as uuidlib
from collections.abc import Iterable
from typing import Any

import click

from vmlend.cli.common import Seconds, emit_action, emit_json, emit_table, json_option
from vmlend.cli.context import CliContext
from vmlend.hostenv import HostEnv
from vmlend.kernel.mdev import MdevBus, normalize_uuid


def _bus(obj: CliContext) -> MdevBus:
    return MdevBus(HostEnv.from_env(obj.root))


def _warn(bus: MdevBus) -> None:
    """One line on stderr for each parent or child a listing left out as damaged."""
    for problem in bus.unreadable:
        click.echo(f"vmlend: warning: left out: {problem}", err=True)


@click.group("mdev")
def mdev() -> None:
    """List, create and remove mdev children (sysfs under --root)."""


#: ``-p/--parent``: mdevctl's name for the filter and for the parent of a new child.
_parent_filter = click.option(
    "-p", "--parent", "parent_filter", metavar="PARENT", help="Only this parent's (as mdevctl -p)."
)


def _by_parent(items: Iterable[tuple[str, str, dict[str, Any]]]) -> dict[str, Any]:
    """mdevctl's ``--dumpjson`` shape inside ``"parents"``: parent -> list of one-key objects
    ``{type-or-uuid: {...}}``, in the order listed."""
    out: dict[str, list[dict[str, Any]]] = {}
    for parent, key, fields in items:
        out.setdefault(parent, []).append({key: fields})
    return out


@mdev.command("types")
@_parent_filter
@json_option
@click.pass_obj
def types(obj: CliContext, parent_filter: str | None, json_output: bool) -> None:
    """Every mdev parent and the types it offers (like 'mdevctl types')."""
    bus = _bus(obj)
    rows = [t for p in bus.parents() if parent_filter in (None, p.name) for t in p.types]
    _warn(bus)
    if json_output:
        parents = _by_parent(
            (
                t.parent,
                t.type_id,
                {
                    "available_instances": t.available_instances,
                    "device_api": t.device_api,
                    "name": t.name,
                    "description": t.description,
                    "devices": list(t.devices),
                },
            )
            for t in rows
        )
        emit_json({"parents": parents})
        return
    emit_table(
        ["PARENT", "TYPE", "NAME", "API", "AVAILABLE", "DEVICES"],
        [
            (t.parent, t.type_id, t.name, t.device_api, t.available_instances, len(t.devices))
            for t in rows
        ],
    )


@mdev.command("list")
@click.option(
    "-u", "--uuid", "uuid_filter", metavar="UUID", help="Only this child (as mdevctl -u)."
)
@_parent_filter
@json_option
@click.pass_obj
def list_(
    obj: CliContext, uuid_filter: str | None, parent_filter: str | None, json_output: bool
) -> None:
    """Every mdev child on this host (like 'mdevctl list': vmlend's are transient, so there is
    no --defined)."""
    bus = _bus(obj)
    wanted = None if uuid_filter is None else normalize_uuid(uuid_filter)
    devices = [
        d for d in bus.devices() if wanted in (None, d.uuid) and parent_filter in (None, d.parent)
    ]
    _warn(bus)
    if json_output:
        parents = _by_parent(
            (
                d.parent,
                d.uuid,
                # "start": "manual" as mdevctl says of a child it has no definition for: it
                # exists until removed (vmlend's hook removes it when its VM stops).
                {"mdev_type": d.type_id, "start": "manual", "iommu_group": d.iommu_group},
            )
            for d in devices
        )
        emit_json({"parents": parents})
        return
    emit_table(
        ["UUID", "PARENT", "TYPE", "IOMMU GROUP"],
        [(d.uuid, d.parent, d.type_id, d.iommu_group) for d in devices],
    )


def _one(option: str | None, argument: str | None, name: str) -> str | None:
    """An mdevctl-style option or vmlend's positional argument, not two different values."""
    if option is not None and argument is not None and option != argument:
        raise click.UsageError(f"{name} given twice: {argument!r} and {option!r}")
    return option if option is not None else argument


@mdev.command("create")
@click.argument("parent_arg", metavar="[PARENT TYPE [UUID]]", required=False)
@click.argument("type_arg", required=False, expose_value=True, metavar="")
@click.argument("uuid_arg", required=False, metavar="")
@click.option("-p", "--parent", help="The parent device (as mdevctl start -p).")
@click.option("-t", "--type", "type_id", metavar="TYPE", help="The mdev type (as mdevctl -t).")
@click.option("-u", "--uuid", help="The child's UUID (as mdevctl -u) [default: a fresh one].")
@json_option
@click.pass_obj
def create(
    obj: CliContext,
    parent_arg: str | None,
    type_arg: str | None,
    uuid_arg: str | None,
    parent: str | None,
    type_id: str | None,
    uuid: str | None,
    json_output: bool,
) -> None:
    """Create a child of PARENT/TYPE (a fresh UUID unless given), like 'mdevctl start' of a
    device it has no definition for; prints its UUID. The same child again changes nothing."""
    parent = _one(parent, parent_arg, "PARENT")
    type_id = _one(type_id, type_arg, "TYPE")
    uuid = _one(uuid, uuid_arg, "UUID")
    if parent is None or type_id is None:
        raise click.UsageError("give PARENT and TYPE (-p PARENT -t TYPE, or positionally)")
    bus = _bus(obj)
    u = normalize_uuid(uuid) if uuid is not None else str(uuidlib.uuid4())
    existed = bus.device(u) is not None
    dev = bus.create(parent, type_id, u)
    if json_output:
        emit_action(
            "unchanged" if existed else "created",
            uuid=dev.uuid,
            parent=dev.parent,
            mdev_type=dev.type_id,
            iommu_group=dev.iommu_group,
        )
    else:
        click.echo(dev.uuid)


@mdev.command("remove")
@click.argument("uuid_arg", metavar="[UUID]", required=False)
@click.option("-u", "--uuid", help="The child to remove (as mdevctl stop -u).")
@json_option
@click.pass_obj
def remove(obj: CliContext, uuid_arg: str | None, uuid: str | None, json_output: bool) -> None:
    """Remove a child, like 'mdevctl stop'; succeeds quietly (with a note on stderr) when it does
    not exist."""
    uuid = _one(uuid, uuid_arg, "UUID")
    if uuid is None:
        raise click.UsageError("give the UUID (-u UUID, or positionally)")
    removed = _bus(obj).remove(uuid)
    if json_output:
        emit_action("removed" if removed else "unchanged", uuid=normalize_uuid(uuid))
    elif not removed:
        click.echo(f"vmlend: mdev {uuid} does not exist", err=True)


@mdev.command("watch")
@click.option(
    "--timeout",
    type=Seconds(min=0),
    default=None,
    help="Stop after this many seconds without events (default: run until interrupted).",
)
@click.pass_obj
def watch(obj: CliContext, timeout: float | None) -> None:
    """Follow SmartIO mdev parents on this host: when one returns (a lender rebooted), re-create
    the mdevs of the VMs that were running, with their DMA windows; while one is gone, mark its
    device unavailable in the shared state. The driver's SMARTIO_DMA events are kept as the
    devices' dma-window records; when a guest decodes, moves or drops a BAR of a VM's device
    (SMARTIO_BARS), plan and write the VM's peer-to-peer maps. Reactions are logged on stderr
    (-v shows them all)."""
    from vmlend.kernel.backend import open_smartio_fabric  # needs the registry
    from vmlend.kernel.udev import PyudevSource

    env = HostEnv.from_env(obj.root)
    source = PyudevSource.for_host(env)  # live uevents exist only for the real root
    with open_smartio_fabric(obj.location, obj.node, env) as fabric:
        watcher = fabric.watcher()
        watcher.discover()
        watcher.run(source, timeout=timeout)


COMMANDS = [mdev]
