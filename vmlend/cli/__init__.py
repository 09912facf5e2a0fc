"""The ``vmlend`` command. ``main`` only parses: each ``cmd_*.py`` module in this package
exposes ``COMMANDS`` (click commands or groups), collected here so command groups stay in
their own modules."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import click

from vmlend import __version__
from vmlend.cli.common import CliContext, VmlendGroup


@click.group(cls=VmlendGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--state",
    "state_path",
    envvar="VMLEND_STATE",
    type=click.Path(dir_okay=False),
    help="Shared state database [env VMLEND_STATE; default /var/lib/vmlend/state.db for root,"
    " else $XDG_STATE_HOME/vmlend/state.db].",
)
@click.option(
    "--registry",
    envvar="VMLEND_REGISTRY",
    metavar="URL",
    help="Shared state: etcd://HOST:PORT[,HOST:PORT...]/CLUSTER, sqlite:///PATH or a path"
    " [env VMLEND_REGISTRY; default: the --state file].",
)
@click.option(
    "--node",
    envvar="VMLEND_NODE",
    help="The fabric node this host is [env VMLEND_NODE; default: the SQLite state's local"
    " node; required with an etcd registry].",
)
@click.option(
    "--root",
    envvar="VMLEND_ROOT",
    type=click.Path(file_okay=False),
    help="Root of the host's sys/dev/etc/run trees [env VMLEND_ROOT; default /].",
)
@click.option("-v", "--verbose", count=True, help="More diagnostics on stderr.")
@click.version_option(__version__, prog_name="vmlend")
@click.pass_context
def main(
    ctx: click.Context,
    state_path: str | None,
    registry: str | None,
    node: str | None,
    root: str | None,
    verbose: int,
) -> None:
    """Lend remote PCIe devices across an NTB fabric to libvirt/QEMU guests."""
    ctx.obj = CliContext.create(
        state_path=state_path, node=node, verbose=verbose, root=root, registry=registry
    )


def _register() -> None:
    pkg = sys.modules[__name__]
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("cmd_"):
            module = importlib.import_module(f"{__name__}.{info.name}")
            for command in getattr(module, "COMMANDS", ()):
                main.add_command(command)


_register()
