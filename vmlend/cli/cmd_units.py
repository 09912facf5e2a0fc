"""``vmlend units install`` / ``uninstall``: the systemd units vmlend ships."""

from __future__ import annotations

from pathlib import Path

import click

from vmlend import systemd_units
from vmlend.cli.common import emit_json, json_option
from vmlend.cli.context import CliContext
from vmlend.hostenv import HostEnv
from vmlend.ownership import summary


@click.group("units")
def units() -> None:
    """The systemd units vmlend ships: the agent, the interrupt relay, the mdev follower."""


def _where(obj: CliContext, directory: Path | None) -> Path:
    return directory or HostEnv.from_env(obj.root).etc / "systemd" / "system"


_DIR = click.option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the units are [default: etc/systemd/system under --root].",
)


def _emit(done: list[systemd_units.InstalledUnit], json_output: bool) -> None:
    if json_output:
        emit_json({"units": [{"name": u.name, "path": u.path, "action": u.action} for u in done]})
        return
    for u in done:
        click.echo(f"{u.action}: {u.path}")


@units.command("install")
@_DIR
@click.option(
    "--force", is_flag=True, help="Install even when non-root can change what they run."
)
@json_option
@click.pass_obj
def install_cmd(obj: CliContext, directory: Path | None, force: bool, json_output: bool) -> None:
    """Write vmlend-agent.service, vmlend-relay.service and vmlend-mdev-watch.service, their
    ExecStart naming this installation's vmlend; unchanged units are left alone. Refused when
    non-root could change what they run as root (--force: a warning). Then:
    'systemctl daemon-reload && systemctl enable --now vmlend-agent'."""
    done, problems = systemd_units.install(_where(obj, directory), force=force)
    if problems:
        click.echo(
            f"vmlend: WARNING: INSECURE: systemd will run {systemd_units.vmlend_command()[0]}"
            f" as root from {len(problems)} path(s) non-root can change:"
            f" {summary(problems)}; anyone who can write there becomes root",
            err=True,
        )
    _emit(done, json_output)
    if not json_output and any(u.action != "unchanged" for u in done):
        click.echo("then: systemctl daemon-reload && systemctl enable --now vmlend-agent", err=True)


@units.command("uninstall")
@_DIR
@click.option("--force", is_flag=True, help="Also remove same-named units vmlend did not write.")
@json_option
@click.pass_obj
def uninstall_cmd(obj: CliContext, directory: Path | None, force: bool, json_output: bool) -> None:
    """Remove the units 'units install' wrote (a same-named unit vmlend did not write is kept).
    Stop and disable them first: 'systemctl disable --now vmlend-agent vmlend-relay
    vmlend-mdev-watch'; then 'systemctl daemon-reload'. Idempotent."""
    done = systemd_units.uninstall(_where(obj, directory), force=force)
    _emit(done, json_output)
    kept = [u.path for u in done if u.action == "kept"]
    if kept:
        click.echo(
            f"vmlend: warning: kept {', '.join(kept)}: not written by 'vmlend units install'"
            " (--force removes it)",
            err=True,
        )
    if not json_output and any(u.action == "removed" for u in done):
        click.echo("then: systemctl daemon-reload", err=True)


COMMANDS = [units]
