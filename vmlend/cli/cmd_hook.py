"""`vmlend hook …`: install the libvirt hook, read its action log, run it by hand."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from vmlend.cli.common import emit_action, emit_json, hook_socket_option, json_option
from vmlend.cli.context import CliContext
from vmlend.config import config_path
from vmlend.errors import ConfigError
from vmlend.hook.actionlog import ActionLog, log_path_for_state
from vmlend.hook.install import DEFAULT_NAME, install_hook, uninstall_hook
from vmlend.hook.sockplace import check_socket_directory
from vmlend.hostenv import HostEnv
from vmlend.registry import hostlease


@click.group("hook")
def hook() -> None:
    """The libvirt qemu hook that reserves devices when VMs start and returns them at stop."""


@hook.command("install")
@click.option(
    "--libvirt-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="libvirt's config dir; the hook goes to <dir>/hooks/<name> [default: /etc/libvirt"
    " under --root].",
)
@click.option("--name", default=DEFAULT_NAME, show_default=True, help="'qemu' or 'qemu.d/<name>'.")
@click.option(
    "--force",
    is_flag=True,
    help="Replace a hook vmlend did not install; install even when non-root can change what"
    " the hook runs (with a warning).",
)
@hook_socket_option("The agent's hook socket to pin (as 'vmlend agent --hook-socket')")
@json_option
@click.pass_obj
def install(
    cli: CliContext,
    libvirt_dir: Path | None,
    name: str,
    force: bool,
    hook_socket: Path | None,
    json_output: bool,
) -> None:
    """Install the hook, pinned to this interpreter and this state path or registry URL."""
    if libvirt_dir is not None and not libvirt_dir.is_dir():
        # A typo here would create a hooks dir libvirtd never reads.
        raise ConfigError(
            f"--libvirt-dir {libvirt_dir} does not exist; give libvirt's config dir (the one"
            " that holds libvirtd.conf, usually /etc/libvirt)"
        )
    host_libvirt = HostEnv.from_env(cli.root).libvirt_config
    if (
        libvirt_dir is not None
        and cli.config_path is None
        and os.path.abspath(libvirt_dir) != os.path.abspath(host_libvirt)
    ):
        # The host's file is the host libvirtd's hook's: pinning another daemon's settings
        # there would change what the first hook does.
        raise ConfigError(
            f"--libvirt-dir {libvirt_dir} is not this host's libvirt ({host_libvirt}): name the"
            " configuration file its hook reads with --config FILE (created if missing), so"
            f" {config_path(None, root=cli.root)} keeps the host hook's settings"
        )
    libvirt_dir = libvirt_dir or host_libvirt
    socket_path = hook_socket or hostlease.hook_socket_path(HostEnv.from_env(cli.root))
    result = install_hook(
        libvirt_dir,
        cli.state_path,
        cli.node,
        name=name,
        force=force,
        registry=cli.registry,
        hook_socket=socket_path,
        backend=cli.backend,
        config_file=config_path(cli.config_path, root=cli.root),
        root=cli.root,
    )
    if result.untrusted:
        from vmlend.hook import trust

        click.echo(
            f"vmlend: WARNING: INSECURE: libvirtd will run {result.path} as root from"
            f" {len(result.untrusted)} path(s) non-root can change: "
            f"{trust.summary(result.untrusted)}; anyone who can write there becomes root",
            err=True,
        )
    if socket_path.parent.exists():  # a missing one the agent creates 0755
        try:
            check_socket_directory(socket_path.parent)
        except ConfigError as e:
            # The hook still works (in-process); only the agent will not serve it there.
            click.echo(
                f"vmlend: warning: 'vmlend agent' will refuse to serve the hook: {e}", err=True
            )
    if json_output:
        emit_json(
            {
                "path": str(result.path),
                "changed": result.changed,
                "restart_needed": result.restart_needed,
                "pins": result.pins,
                "config": result.config,
            }
        )
    else:
        click.echo(result.advice())
        pins = result.pins
        click.echo(f"  config       {pins['config']} ({result.config})")
        click.echo(f"  root         {pins['root']}")
        click.echo(f"  interpreter  {pins['interpreter']}")
        click.echo(f"  registry     {pins['state']}")
        if "registry" in pins:
            click.echo(f"  registry URL {pins['registry']}")
        click.echo(f"  node         {pins.get('node', '(the state local node)')}")
        default = "(the host's: smartio where the driver is loaded, else sim)"
        click.echo(f"  backend      {pins.get('backend', default)}")
        click.echo(f"  hook socket  {pins['hook socket']} (served by 'vmlend agent' when it runs)")


@hook.command("uninstall")
@click.option(
    "--libvirt-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="libvirt's config dir [default: /etc/libvirt under --root].",
)
@click.option("--name", default=DEFAULT_NAME, show_default=True)
@json_option
@click.pass_obj
def uninstall(cli: CliContext, libvirt_dir: Path | None, name: str, json_output: bool) -> None:
    """Remove the hook vmlend installed."""
    libvirt_dir = libvirt_dir or HostEnv.from_env(cli.root).libvirt_config
    removed = uninstall_hook(libvirt_dir, name)
    if json_output:
        path = str(libvirt_dir / "hooks" / name)
        emit_action("removed" if removed else "unchanged", path=path)
        return
    click.echo(f"removed {libvirt_dir / 'hooks' / name}" if removed else "no vmlend hook installed")


@hook.command("log")
@click.option("-n", "--lines", default=20, show_default=True, type=click.IntRange(1, 100000))
@json_option
@click.pass_obj
def show_log(cli: CliContext, lines: int, json_output: bool) -> None:
    """Show the hook's last actions (one line each)."""
    log = ActionLog(log_path_for_state(cli.state_path))
    entries = log.tail(lines)
    if json_output:
        emit_json({"path": str(log.path), "entries": entries})
        return
    if not entries:
        click.echo(f"no hook actions recorded yet ({log.path})", err=True)
    for line in entries:
        click.echo(line)


@hook.command(
    "run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False}
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_obj
def run_hook(cli: CliContext, args: tuple[str, ...]) -> None:
    """Run the hook by hand exactly as libvirt does: ARGS = DOMAIN OPERATION SUB-OP [EXTRA],
    domain XML on stdin."""
    from vmlend.hook.entry import CALLER_ENV, LIBVIRTD
    from vmlend.hook.main import run

    # as libvirtd's: a VM on devices only the simulator has is refused the same way
    env = {"VMLEND_STATE": str(cli.state_path), CALLER_ENV: LIBVIRTD}
    if cli.registry:
        env["VMLEND_REGISTRY"] = cli.registry
    if cli.node:
        env["VMLEND_NODE"] = cli.node
    if cli.backend:
        env["VMLEND_BACKEND"] = cli.backend
    if cli.root:
        env["VMLEND_ROOT"] = str(cli.root)
    sys.exit(run(list(args), environ=env))


COMMANDS = [hook]
