"""``vmlend mdev``: the host's mediated devices, for any parent driver (SmartIO, mtty, ...)."""

from __future__ import annotations

import uuid as uuidlib

import click

from vmlend.cli.common import Seconds, emit_json, emit_table, json_option
from vmlend.cli.context import CliContext
from vmlend.hostenv import HostEnv
from vmlend.kernel.mdev import MdevBus


def _bus(obj: CliContext) -> MdevBus:
    return MdevBus(HostEnv.from_env(obj.root))


def _warn(bus: MdevBus) -> None:
    """One line on stderr for each parent or child a listing left out as damaged."""
    for problem in bus.unreadable:
        click.echo(f"vmlend: warning: left out: {problem}", err=True)


@click.group("mdev")
def mdev() -> None:
    """List, create and remove mdev children (sysfs under --root)."""


@mdev.command("types")
@json_option
@click.pass_obj
def types(obj: CliContext, json_output: bool) -> None:
    """Every mdev parent and the types it offers."""
    bus = _bus(obj)
    rows = [t for p in bus.parents() for t in p.types]
    _warn(bus)
    if json_output:
        emit_json(
            {
                "types": [
                    {
                        "parent": t.parent,
                        "type": t.type_id,
                        "name": t.name,
                        "device_api": t.device_api,
                        "available": t.available_instances,
                        "devices": list(t.devices),
                    }
                    for t in rows
                ]
            }
        )
        return
    emit_table(
        ["PARENT", "TYPE", "NAME", "API", "AVAILABLE", "DEVICES"],
        [
            (t.parent, t.type_id, t.name, t.device_api, t.available_instances, len(t.devices))
            for t in rows
        ],
    )


@mdev.command("list")
@json_option
@click.pass_obj
def list_(obj: CliContext, json_output: bool) -> None:
    """Every mdev child on this host."""
    bus = _bus(obj)
    devices = bus.devices()
    _warn(bus)
    if json_output:
        emit_json(
            {
                "mdevs": [
                    {
                        "uuid": d.uuid,
                        "parent": d.parent,
                        "type": d.type_id,
                        "iommu_group": d.iommu_group,
                    }
                    for d in devices
                ]
            }
        )
        return
    emit_table(
        ["UUID", "PARENT", "TYPE", "IOMMU GROUP"],
        [(d.uuid, d.parent, d.type_id, d.iommu_group) for d in devices],
    )


@mdev.command("create")
@click.argument("parent")
@click.argument("type_id", metavar="TYPE")
@click.argument("uuid", required=False)
@click.pass_obj
def create(obj: CliContext, parent: str, type_id: str, uuid: str | None) -> None:
    """Create a child of PARENT/TYPE (a fresh UUID unless given); prints its UUID."""
    dev = _bus(obj).create(parent, type_id, uuid or str(uuidlib.uuid4()))
    click.echo(dev.uuid)


@mdev.command("remove")
@click.argument("uuid")
@click.pass_obj
def remove(obj: CliContext, uuid: str) -> None:
    """Remove a child; succeeds quietly (with a note on stderr) when it does not exist."""
    if not _bus(obj).remove(uuid):
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
    the mdevs of the VMs that were running; while one is gone, mark its device unavailable in
    the shared state. Reactions are logged on stderr (-v shows them all)."""
    from vmlend.kernel.backend import open_smartio_fabric  # needs the registry
    from vmlend.kernel.udev import PyudevSource

    env = HostEnv.from_env(obj.root)
    source = PyudevSource.for_host(env)  # live uevents exist only for the real root
    with open_smartio_fabric(obj.location, obj.node, env) as fabric:
        watcher = fabric.watcher()
        watcher.discover()
        watcher.run(source, timeout=timeout)


COMMANDS = [mdev]
