"""``vmlend units install``: the systemd units vmlend ships, rendered for this installation."""

from __future__ import annotations

from pathlib import Path

import click

from vmlend.cli.common import emit_json, json_option
from vmlend.cli.context import CliContext
from vmlend.hostenv import HostEnv


@click.group("units")
def units() -> None:
    """The systemd units vmlend ships: the agent, the interrupt relay, the mdev follower."""


@units.command("install")
@click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where to write them [default: etc/systemd/system under --root].",
)
@json_option
@click.pass_obj
def install_cmd(obj: CliContext, directory: Path | None, json_output: bool) -> None:
    """Write vmlend-agent.service, vmlend-relay.service and vmlend-mdev-watch.service, their
    ExecStart naming this installation's vmlend; unchanged units are left alone. Then:
    'systemctl daemon-reload && systemctl enable --now vmlend-agent'."""
    from vmlend import systemd_units

    where = directory or HostEnv.from_env(obj.root).etc / "systemd" / "system"
    done = systemd_units.install(where)
    if json_output:
        emit_json({"units": [{"name": u.name, "path": u.path, "action": u.action} for u in done]})
        return
    for u in done:
        click.echo(f"{u.action}: {u.path}")
    if any(u.action != "unchanged" for u in done):
        click.echo("then: systemctl daemon-reload && systemctl enable --now vmlend-agent", err=True)


COMMANDS = [units]
