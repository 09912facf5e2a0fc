"""``vmlend migrate VM --to NODE [--live]``: cold or live migration to another node of the fabric.

The operations, and the order of their steps, are in ``vmlend.ops.migrate`` (cold) and
``vmlend.ops.live_migrate`` (live); this module parses the options and prints.
"""

from __future__ import annotations

import os

import click

from vmlend.cli.common import Seconds, emit_json, json_option
from vmlend.cli.complete import complete_nodes, complete_vms
from vmlend.cli.connect import connect_option, fabric_for, open_hv
from vmlend.cli.context import CliContext
from vmlend.errors import MigrationError
from vmlend.fabric.base import Fabric, RegistryFabric
from vmlend.hypervisor import Hypervisor, LiveMigration
from vmlend.ops.hvidentity import check_hypervisor_is
from vmlend.ops.live_migrate import LiveMigrateResult, live_migrate
from vmlend.ops.live_rollback import roll_back_live
from vmlend.ops.migrate import MigrateResult, migrate, migration_lock
from vmlend.ops.plug_request import PlugRequests
from vmlend.registry import EtcdRegistry
from vmlend.topology.model import format_fdid
from vmlend.wiring.fabric import BACKEND_ENV, open_fabric
from vmlend.wiring.hypervisor import sim_node

#: Options of a cold migration only, and of a live one only.
_COLD_ONLY = ("start", "force")
_LIVE_ONLY = ("persistent", "undefinesource", "migrate_uri", "listen_address", "unplug")


def _dest_uri(src: Hypervisor, to: str, dest_uri: str | None) -> str:
    if dest_uri:
        return dest_uri
    if sim_node(src.uri) is not None:
        return f"sim:///{to}"
    raise click.UsageError(
        f"--dest-uri is needed to migrate from {src.uri} (the libvirt URI of node {to})"
    )


@click.command("migrate")
@click.argument("vm", shell_complete=complete_vms)
@click.option(
    "--to",
    "to",
    required=True,
    metavar="NODE",
    shell_complete=complete_nodes,
    help="Destination fabric node.",
)
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
    help="Undo an interrupted migrate: keep the VM on this (source) host only; with --live,"
    " the VM runs here again with its devices, nothing left claimed on NODE.",
)
@click.option(
    "--live",
    is_flag=True,
    help="Move the running VM without stopping it: its remote devices (NVMe shares too) stay"
    " plugged where they can quiesce (hot), the others are unplugged, then plugged back in on"
    " the destination at the same guest addresses. A move that would unplug an NVMe share is"
    " refused (its blocks would not follow it).",
)
@click.option(
    "--unplug",
    is_flag=True,
    help="--live: unplug the remote devices while the VM moves, even where they could stay"
    " plugged.",
)
@click.option("--persistent", is_flag=True, help="--live: define the VM on the destination too.")
@click.option(
    "--undefinesource",
    is_flag=True,
    help="--live: remove the VM's definition from the source once it runs there.",
)
@click.option(
    "--migrate-uri",
    metavar="URI",
    help="--live: where the memory goes, e.g. tcp://10.0.0.2:49152 [default: libvirt's].",
)
@click.option(
    "--listen-address",
    metavar="ADDR",
    help="--live: the address the destination's QEMU listens on for the memory"
    " [default: libvirt's, every address].",
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
    live: bool,
    unplug: bool,
    persistent: bool,
    undefinesource: bool,
    migrate_uri: str | None,
    listen_address: str | None,
    uri: str | None,
    json_output: bool,
) -> None:
    """Move VM to node NODE keeping its remote devices, stopped or (--live) running.

    A running VM is shut down first, unless --live: then its remote devices (and its NVMe
    shares) stay plugged while it moves (hot) where the nodes and each device's driver allow
    it; the others, said in one line each (mixed), or all when the nodes cannot, leave the
    guest while it moves and come back at the same addresses (never an NVMe share: such a
    move is refused). --live --rollback undoes an interrupted live move: the VM runs here
    again with its devices."""
    given = click.get_current_context().params
    wrong = [o for o in (_COLD_ONLY if live else _LIVE_ONLY) if given.get(o)]
    if wrong:
        opt = "--" + wrong[0].replace("_", "-")
        raise click.UsageError(
            f"{opt} is for a {'cold' if live else 'live'} migration;"
            f" {'leave out --live' if live else 'add --live'} or {opt}"
        )
    how = LiveMigration(
        persistent=persistent,
        undefine_source=undefinesource,
        migration_uri=migrate_uri,
        listen_address=listen_address,
    )
    res: MigrateResult | LiveMigrateResult
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
                if live:
                    plugs = _plug_requests(fabric)
                    dst_fabric = (
                        None if plugs is not None else open_fabric(obj.location, to, root=obj.root)
                    )
                    if rollback:
                        res = roll_back_live(
                            src,
                            dst,
                            fabric,
                            dst_fabric,
                            vm,
                            to,
                            state_dir=obj.state_path.parent,
                            progress=progress,
                        )
                    else:
                        res = live_migrate(
                            src,
                            dst,
                            fabric,
                            dst_fabric,
                            vm,
                            to,
                            how=how,
                            state_dir=obj.state_path.parent,
                            progress=progress,
                            plugs=plugs,
                            unplug=unplug,
                        )
                else:
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
    elif isinstance(res, LiveMigrateResult):
        click.echo(_live_summary(res))
    elif res.rolled_back:
        click.echo(f"rolled back the migrate of VM {res.vm!r}: it is defined on {res.source} only")
    else:
        state = "running" if res.started else "stopped"
        click.echo(
            f"migrated VM {res.vm!r} from {res.source} to {res.destination} ({state}),"
            f" devices {', '.join(res.devices) or 'none'}"
        )


def _plug_requests(fabric: Fabric) -> PlugRequests | None:
    """On the kernel backend the destination's agent plugs the devices back (their mdevs are
    created in its sysfs), asked through the cluster registry; None: this process does."""
    from vmlend.kernel.backend import SmartioFabric

    if os.environ.get(BACKEND_ENV, "sim") != "smartio" and not isinstance(fabric, SmartioFabric):
        return None
    registry = fabric.registry if isinstance(fabric, RegistryFabric) else None
    if not isinstance(registry, EtcdRegistry):
        raise MigrationError(
            "a live migration on the kernel backend needs the destination's agent to plug the"
            " devices back, asked through a cluster registry: give --registry etcd://HOST:PORT/"
            "CLUSTER, or move the VM cold (leave out --live)"
        )
    return PlugRequests(registry)


def _live_summary(res: LiveMigrateResult) -> str:
    if res.rolled_back:
        return (
            f"rolled back the live migrate of VM {res.vm!r}: it runs on {res.destination} with"
            f" devices {', '.join(res.devices) or 'none'}"
        )
    if not res.devices and res.resumed and res.downtime is None:
        return f"VM {res.vm!r} already runs on {res.destination}: nothing to do"
    downtime = "not measured" if res.downtime is None else f"{res.downtime * 1000:.1f} ms"
    how = res.mode if res.mode in ("hot", "mixed") and res.devices else "live"
    kept = " (kept plugged)" if res.mode == "hot" and res.devices else ""
    if res.mode == "mixed":
        kept = f" ({sum(m == 'hot' for m in res.modes.values())} kept plugged)"
    out = [
        f"migrated VM {res.vm!r} {how} from {res.source} to {res.destination} (running),"
        f" devices {', '.join(res.devices) or 'none'}{kept}; downtime {downtime}"
    ]
    for fdid, seconds in sorted(res.blackout.items()):
        said = "not measured" if seconds is None else f"{seconds * 1000:.1f} ms"
        way = f" ({res.modes.get(fdid, res.mode)})" if res.mode == "mixed" else ""
        out.append(f"  device {format_fdid(fdid)}: blackout {said}{way}")
    return "\n".join(out)


COMMANDS = [migrate_cmd]
