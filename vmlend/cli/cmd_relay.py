"""``vmlend relay``: the interrupt relay daemon (foreground) and its status."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from types import FrameType

import click

from vmlend.cli.common import emit_json, emit_table, json_option
from vmlend.cli.context import CliContext
from vmlend.irq.client import RelayClient
from vmlend.irq.daemon import RelayDaemon

log = logging.getLogger(__name__)


def default_socket(ctx: CliContext) -> Path:
    """Beside the state database, so one --state (or VMLEND_STATE) keeps a node together."""
    return ctx.state_path.parent / "relay.sock"


@click.group(invoke_without_command=True)
@click.option(
    "--socket",
    "socket_path",
    envvar="VMLEND_RELAY_SOCKET",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Control socket [env VMLEND_RELAY_SOCKET; default: relay.sock beside the state].",
)
@click.pass_context
def relay(ctx: click.Context, socket_path: Path | None) -> None:
    """Run the interrupt relay daemon in the foreground (until SIGTERM or SIGINT).

    VMMs register their eventfds on the control socket (VFIO_DEVICE_SET_IRQS requests);
    lenders' transports are attached there too. See docs/interrupts.md.
    """
    cli: CliContext = ctx.obj
    path = socket_path or default_socket(cli)
    ctx.meta["relay_socket"] = path
    if ctx.invoked_subcommand is not None:
        return
    daemon = RelayDaemon(path)
    daemon.start()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("relay: %s, shutting down", signal.Signals(signum).name)
        daemon.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    click.echo(f"relay listening on {path} (pid {os.getpid()})", err=True)
    daemon.serve()


@relay.command("status")
@json_option
@click.pass_context
def status(ctx: click.Context, json_output: bool) -> None:
    """Devices and vectors the running relay daemon serves."""
    with RelayClient(ctx.meta["relay_socket"]) as client:
        reply = client.status()
    devices = reply["devices"]
    if json_output:
        emit_json({"devices": devices})
        return
    emit_table(
        ["FDID", "VECTORS", "RESAMPLE", "DELIVERED", "HELD", "TRANSPORT"],
        [
            [
                f"{d['fdid']:#x}",
                ",".join(f"{v['index']}:{v['vector']}" for v in d["vectors"]) or "-",
                "yes" if d["resample"] else "no",
                d["delivered"],
                d["held"],
                d["transport"],
            ]
            for d in devices
        ],
    )


COMMANDS = [relay]
