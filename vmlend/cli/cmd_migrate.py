"""``vmlend migrate VM --to NODE``: cold migration to another node of the fabric.

The operation, and the order of its steps, is in ``vmlend.ops.migrate``; this module parses
the options and prints.
"""

from __future__ import annotations

import click

from vmlend.cli.common import Seconds, emit_json, json_option
from vmlend.cli.connect import connect_option, fabric_for, open_hv
from vmlend.cli.context import CliContext
from vmlend.hypervisor import Hypervisor
from vmlend.ops.hvidentity import check_hypervisor_is
from vmlend.ops.migrate import migrate, migration_lock
from vmlend.wiring.hypervisor import sim_node


def _dest_uri(src: Hypervisor, to: str, dest_uri: str | None) -> str:
    if dest_uri:
        return dest_uri
    if sim_node(src.uri) is not None:
        return f"sim:///{to}"
    raise click.UsageError(
        f"--dest-uri is needed to migrate from {src.uri} (the libvirt URI of node {to})"
    )


@click.command("migrate")
@click.argument("vm")
@click.option("--to", "to", required=True, metavar="NODE", help="Destination fabric node.")
@click.option(
    "--dest-uri",
    metavar="URI",
    help="Hypervisor URI of the destination [default for sim:/// sources: sim:///NODE].",
)
@click.option("--start", is_flag=True, help="Start the VM on the destination.")
@click.option(
    "--shutdown-timeout",
    type=Seconds(min=0),
    default=60.0,
    show_default=True,
    metavar="S",
    help="Seconds to wait for a running VM to shut down.",
)
@click.option("--force", is_flag=True, help="Destroy the VM if it does not shut down in time.")
@click.option(
    "--rollback",
    is_flag=True,
    help="Undo an interrupted migrate: keep the VM on this (source) host only.",
)
@connect_option
@json_option
@click.pass_obj
def migrate_cmd(
    obj: CliContext,
    vm: str,
    to: str,
    dest_uri: str | None,
    start: bool,
    shutdown_timeout: float,
    force: bool,
    rollback: bool,
    uri: str | None,
    json_output: bool,
) -> None:
    """Move VM (stopped, or shut down first) to node NODE keeping its remote devices."""
    src = open_hv(obj, uri)
    try:
        target = _dest_uri(src, to, dest_uri)
        dst = open_hv(obj, target, node=to)
        try:
            fabric = fabric_for(obj, src)
            # Both ends by their host UUIDs: a --dest-uri reaching another node's hypervisor
            # would move the VM there while the fabric records it on --to.
            check_hypervisor_is(fabric, src, fabric.local_node, "the source")
            check_hypervisor_is(fabric, dst, to, "--dest-uri")

            def progress(msg: str) -> None:
                click.echo(f"vmlend: {msg}", err=True)

            with migration_lock(obj.state_path.parent, vm):
                res = migrate(
                    src,
                    dst,
                    fabric,
                    vm,
                    to,
                    start=start,
                    shutdown_timeout=shutdown_timeout,
                    force=force,
                    rollback=rollback,
                    progress=progress,
                )
        finally:
            dst.close()
    finally:
        src.close()
    if json_output:
        emit_json(res.to_json())
    elif res.rolled_back:
        click.echo(f"rolled back the migrate of VM {res.vm!r}: it is defined on {res.source} only")
    else:
        state = "running" if res.started else "stopped"
        click.echo(
            f"migrated VM {res.vm!r} from {res.source} to {res.destination} ({state}),"
            f" devices {', '.join(res.devices) or 'none'}"
        )


COMMANDS = [migrate_cmd]
