"""The ``vmlend`` command. ``main`` only parses: each ``cmd_*.py`` module in this package
exposes ``COMMANDS`` (click commands or groups), so command groups stay in their own modules.
A module is imported only when one of its commands runs (``lazy.LazyGroup``): ``COMMANDS``
below names each command's module and the summary ``vmlend --help`` shows."""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence
from typing import Any

import click

from vmlend import __version__
from vmlend.cli.lazy import LazyGroup

#: command -> (its module, the first sentence of its help). A new command goes here too;
#: tests/unit/cli/test_cli_lazy.py fails until it does (it would still work, loaded eagerly).
COMMANDS: dict[str, tuple[str, str]] = {
    "agent": (
        "cmd_agent",
        "Serve the libvirt hook and, on a cluster registry, hold this host's lease and take "
        "back devices whose borrower's lease ended.",
    ),
    "drain": (
        "cmd_agent",
        "Decommission this host's agent: give up its lease (every record of the host goes with"
        " it) and its node name.",
    ),
    "attach": (
        "cmd_attach",
        "Attach remote device FDID to VM (default: live if running, else its definition).",
    ),
    "demo": (
        "cmd_demo",
        "Run the whole vmlend story on the simulated cluster in the state (--state): a VM on "
        "gamma borrows two GPUs and an NVMe drive, DMA and interrupts flow, a VF is hot-added "
        "and removed, the VM moves to alpha, and everything is returned.",
    ),
    "detach": (
        "cmd_attach",
        "Detach remote device FDID from VM; a live detach returns the device to the fabric.",
    ),
    "devices": (
        "cmd_devices",
        "List the devices of the fabric: lender, PCI address, BARs, state and holder.",
    ),
    "doctor": (
        "cmd_doctor",
        "Check this host: the backend, KVM, IOMMU, vfio/mdev, SmartIO, libvirt and the hook.",
    ),
    "fabric": (
        "cmd_fabric",
        "The fabric: its nodes, NTB adapters and links, kept in the shared state.",
    ),
    "hook": (
        "cmd_hook",
        "The libvirt qemu hook that reserves devices when VMs start and returns them at stop.",
    ),
    "lend": ("cmd_lend", "Offer device FDID to the fabric so VMs on other nodes can borrow it."),
    "mdev": ("cmd_mdev", "List, create and remove mdev children (sysfs under --root)."),
    "migrate": (
        "cmd_migrate",
        "Move VM to node NODE keeping its remote devices, stopped or (--live) running.",
    ),
    "nvme": (
        "cmd_nvme",
        "Queue-level sharing of NVMe drives: each VM gets I/O queue pairs and an LBA window.",
    ),
    "path": ("cmd_path", "Explain the PCIe path from SRC to DST."),
    "reconcile": (
        "cmd_reconcile",
        "Compare running VMs, the state's holds and the host's mdevs; --fix returns what no "
        "running VM uses and re-creates what a running VM needs.",
    ),
    "registry": (
        "cmd_registry",
        "The cluster registry in etcd: who may write which of its keys, and its stored layout.",
    ),
    "relay": (
        "cmd_relay",
        "Run the interrupt relay daemon in the foreground (until SIGTERM or SIGINT).",
    ),
    "status": (
        "cmd_status",
        "Per VM its remote devices (state, holder, mdev, DMA windows, vectors, P2P maps) and "
        "NVMe shares (queue pairs, LBA window, real queues, guard rejections); per NTB adapter "
        "the LUT entries and window in use; per switch port in use its requester entries.",
    ),
    "units": (
        "cmd_units",
        "The systemd units vmlend ships: the agent, the interrupt relay, the mdev follower.",
    ),
    "unlend": ("cmd_lend", "Withdraw device FDID from the fabric (refused while a VM holds it)."),
    "vm": (
        "cmd_vm",
        "Define, start, stop and list VMs (virsh's lifecycle commands).",
    ),
    "xml": ("cmd_xml", "Write and edit libvirt domain XML that uses remote devices."),
}


class RootGroup(LazyGroup):
    """The ``vmlend`` group: the configuration file is its ``default_map`` (``cli.config``),
    read before the arguments are parsed."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        aliases: dict[str, Any] = {}
        if "default_map" not in extra:
            extra["default_map"], aliases = _configured(self, args)
        ctx = super().make_context(info_name, args, parent, **extra)
        ctx.meta[ALIASES_META] = aliases
        return ctx


#: Where the configuration file's ``[alias]`` table waits for ``main`` (``ctx.meta``).
ALIASES_META = "vmlend.aliases"


def _configured(
    group: click.Group, args: Sequence[str]
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    if any(a in ("-h", "--help", "--version") for a in args[:1]):
        return None, {}  # help and version never need the file (nor a broken one)
    from vmlend.cli.config import load_config
    from vmlend.errors import VmlendError
    from vmlend.messages import single_line

    try:
        return load_config(group, args)
    except VmlendError as e:
        raise click.ClickException(single_line(str(e))) from None


@click.group(
    cls=RootGroup,
    package=__name__,
    lazy=COMMANDS,
    context_settings={"help_option_names": ["-h", "--help"]},
)
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
@click.option(
    "--backend",
    type=click.Choice(["sim", "smartio"]),
    envvar="VMLEND_BACKEND",
    help="Fabric backend: smartio (the SmartIO driver) or sim (a simulated fabric, for"
    " sim:/// nodes) [env VMLEND_BACKEND; default: smartio where the driver is loaded, else"
    " sim].",
)
@click.option(
    "--config",
    "config_path",
    envvar="VMLEND_CONFIG",
    type=click.Path(dir_okay=False),
    help="Configuration file [env VMLEND_CONFIG; default /etc/vmlend/vmlend.toml under --root].",
)
@click.option("-v", "--verbose", count=True, help="More diagnostics on stderr.")
@click.option(
    "-c", "--connect", "uri", metavar="URI", help="Hypervisor URI for every command (as virsh -c)."
)
@click.version_option(__version__, prog_name="vmlend")
@click.pass_context
def main(
    ctx: click.Context,
    state_path: str | None,
    registry: str | None,
    node: str | None,
    root: str | None,
    verbose: int,
    uri: str | None,
    backend: str | None,
    config_path: str | None,
) -> None:
    """Lend remote PCIe devices across an NTB fabric to libvirt/QEMU guests."""
    from vmlend.cli.context import CliContext  # a command runs: --help never gets here

    ctx.obj = CliContext.create(
        state_path=state_path,
        node=node,
        verbose=verbose,
        root=root,
        registry=registry,
        backend=backend,
        config_path=config_path,
        aliases=ctx.meta.get(ALIASES_META),
    )
    ctx.obj.uri = uri


def run() -> None:
    """The ``vmlend`` executable: ``main`` as a program."""
    if "_VMLEND_COMPLETE" in os.environ:  # a shell asks for completions (or their script)
        from vmlend.cli import bashcomplete

        bashcomplete.install()
    try:
        main()
    finally:
        # Everything the command built lives until the process ends anyway; moved out of the
        # collector's reach, the interpreter's final full collection does not walk it (a
        # short command such as `vmlend devices` spends ~15 % of its CPU there, measured).
        gc.freeze()
