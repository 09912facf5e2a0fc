"""``vmlend vm``: virsh's lifecycle commands, on simulated nodes (``sim:///NODE``) and libvirt
URIs alike. For libvirt this is a convenience; virsh stays the tool there."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import click

from vmlend.cli.common import (
    Seconds,
    emit_action,
    emit_json,
    emit_table,
    json_option,
    read_input,
)
from vmlend.cli.complete import complete_vms
from vmlend.cli.connect import (
    check_simulated_node,
    connect_option,
    open_hv,
    refuse_simulated_devices,
)
from vmlend.cli.context import CliContext
from vmlend.cli.progress import Wait
from vmlend.domain import DomainDocument
from vmlend.errors import UnknownDomainError
from vmlend.hypervisor import DomainInfo, Hypervisor


def _state(info: DomainInfo) -> str:
    return info.state.words


class _Session:
    """The hypervisor a command talks to, closed when the command ends."""

    def __init__(self, obj: CliContext, uri: str | None, *, check_node: bool = True) -> None:
        self.hv: Hypervisor = open_hv(obj, uri, check_node=check_node)

    def __enter__(self) -> Hypervisor:
        return self.hv

    def __exit__(self, *exc: object) -> None:
        self.hv.close()


def _stopping(obj: CliContext, uri: str | None, stop: Callable[[Hypervisor], None]) -> str | None:
    """Stop a VM with ``stop`` (its release hook runs): without reading the registry first,
    since a VM stopped during an etcd outage must stop within its release's bound
    (docs/cluster.md). A simulated node is checked against the fabric only when the domain is
    not found there, so an unknown node is still said as such. The hypervisor's node."""
    with _Session(obj, uri, check_node=False) as hv:
        try:
            stop(hv)
        except UnknownDomainError:
            check_simulated_node(obj, uri)
            raise
        return hv.node


@click.group("vm")
def vm_group() -> None:
    """Define, start, stop and list VMs (virsh's lifecycle commands)."""


@vm_group.command("list")
@connect_option
@click.option("--all", "show_all", is_flag=True, help="Also the VMs that are shut off.")
@json_option
@click.pass_obj
def vm_list(obj: CliContext, uri: str | None, show_all: bool, json_output: bool) -> None:
    """The running VMs (with --all: every defined one), like 'virsh list'."""
    with _Session(obj, uri) as hv:
        domains = [d for d in hv.list_domains() if show_all or d.active]
    if json_output:
        emit_json(
            {
                "vms": [
                    {
                        "name": d.name,
                        "uuid": d.uuid,
                        "state": _state(d),
                        "persistent": d.persistent,
                    }
                    for d in domains
                ]
            }
        )
        return
    emit_table(
        ["Name", "State", "Persistent"],
        [(d.name, _state(d), "yes" if d.persistent else "no") for d in domains],
    )


@vm_group.command("define")
@connect_option
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@json_option
@click.pass_obj
def vm_define(obj: CliContext, uri: str | None, file: Path, json_output: bool) -> None:
    """Define (or update) a VM from a domain XML FILE."""
    data = read_input(file)
    DomainDocument.parse(data, source=str(file))  # one clear line for a malformed file
    with _Session(obj, uri) as hv:
        info = hv.define(data)
        node = hv.node
    if json_output:
        emit_action("defined", vm=info.name, uuid=info.uuid, node=node, file=str(file))
        return
    click.echo(f"Domain '{info.name}' defined from {file}")


@vm_group.command("undefine")
@connect_option
@click.argument("name", shell_complete=complete_vms)
@json_option
@click.pass_obj
def vm_undefine(obj: CliContext, uri: str | None, name: str, json_output: bool) -> None:
    """Remove a VM's persistent definition (a running VM goes on, transient)."""
    with _Session(obj, uri) as hv:
        hv.undefine(name)
        node = hv.node
    if json_output:
        emit_action("undefined", vm=name, node=node)
        return
    click.echo(f"Domain '{name}' has been undefined")


@vm_group.command("start")
@connect_option
@click.argument("name", shell_complete=complete_vms)
@json_option
@click.pass_obj
def vm_start(obj: CliContext, uri: str | None, name: str, json_output: bool) -> None:
    """Start a defined VM (the vmlend hook prepares its remote devices)."""
    with _Session(obj, uri) as hv:
        refuse_simulated_devices(obj, hv, "start", name)
        hv.start(name)
        node = hv.node
    if json_output:
        emit_action("started", vm=name, node=node)
        return
    click.echo(f"Domain '{name}' started")


@vm_group.command("shutdown")
@connect_option
@click.argument("name", shell_complete=complete_vms)
@click.option(
    "--timeout",
    type=Seconds(min=0),
    default=60.0,
    show_default=True,
    help="Seconds to wait for the guest to power off.",
)
@json_option
@click.pass_obj
def vm_shutdown(
    obj: CliContext, uri: str | None, name: str, timeout: float, json_output: bool
) -> None:
    """Ask a VM's guest to power off and wait for it ('vmlend vm destroy' pulls the plug)."""

    def shutdown(hv: Hypervisor) -> None:
        hv.lookup(name)  # an unknown domain is its one error line, not a wait announced first
        with Wait(f"domain '{name}' to shut down", timeout):
            hv.shutdown(name, timeout)

    node = _stopping(obj, uri, shutdown)
    if json_output:
        emit_action("shut_off", vm=name, node=node)
        return
    click.echo(f"Domain '{name}' is shut off")


@vm_group.command("destroy")
@connect_option
@click.argument("name", shell_complete=complete_vms)
@json_option
@click.pass_obj
def vm_destroy(obj: CliContext, uri: str | None, name: str, json_output: bool) -> None:
    """Stop a VM at once, like pulling its power cord."""
    node = _stopping(obj, uri, lambda hv: hv.destroy(name))
    if json_output:
        emit_action("destroyed", vm=name, node=node)
        return
    click.echo(f"Domain '{name}' destroyed")


@vm_group.command("dumpxml")
@connect_option
@click.argument("name", shell_complete=complete_vms)
@click.option("--inactive", is_flag=True, help="The persistent definition, not the live XML.")
@click.pass_obj
def vm_dumpxml(obj: CliContext, uri: str | None, name: str, inactive: bool) -> None:
    """Print a VM's domain XML."""
    with _Session(obj, uri) as hv:
        data = hv.xml(name, inactive=inactive)
    click.echo(data.decode(), nl=not data.endswith(b"\n"))


@vm_group.command("domstate")
@connect_option
@click.argument("name", shell_complete=complete_vms)
@json_option
@click.pass_obj
def vm_domstate(obj: CliContext, uri: str | None, name: str, json_output: bool) -> None:
    """Print a VM's state: running, paused or shut off."""
    with _Session(obj, uri) as hv:
        info = hv.lookup(name)
        node = hv.node
    if json_output:
        emit_json({"vm": info.name, "uuid": info.uuid, "state": _state(info), "node": node})
        return
    click.echo(_state(info))


COMMANDS = [vm_group]
