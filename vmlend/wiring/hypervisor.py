"""Pick and open the hypervisor for a URI (``--connect``, like virsh)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import libvirt

from vmlend.errors import ConfigError, LibvirtError
from vmlend.hypervisor.base import Hypervisor
from vmlend.hypervisor.libvirt_hv import LibvirtHypervisor, one_line

if TYPE_CHECKING:  # the simulated node imports this package: no cycle at run time
    from vmlend.sim.hypervisor.node import GuestDriver

log = logging.getLogger(__name__)

SIM_SCHEME = "sim:///"


def _log_libvirt_error(_ctx: object, err: tuple[object, ...]) -> None:
    log.debug("libvirt: %s", err[2] if len(err) > 2 else err)


def sim_node(uri: str) -> str | None:
    """The node of a ``sim:///<node>`` URI, None for any other URI."""
    if not uri.startswith(SIM_SCHEME):
        return None
    node = uri[len(SIM_SCHEME) :].strip("/")
    if not node or "/" in node or node.startswith("."):
        raise ConfigError(f"bad simulated hypervisor URI {uri!r}; expected sim:///<node>")
    return node


def hook_command(state_path: Path | str, node: str, backend: str | None = None) -> list[str]:
    """How a simulated node runs vmlend's hook (absolute interpreter, as libvirtd needs);
    ``backend``: the one the caller chose (None: the hook's environment or default decides)."""
    option = "--state" if isinstance(state_path, Path) else "--registry"
    command = [sys.executable, "-m", "vmlend.hook", option, str(state_path), "--node", node]
    return [*command, "--backend", backend] if backend else command


def open_hypervisor(
    uri: str | None,
    *,
    state_dir: Path,
    hook_command: Sequence[str] | None,
    guest_driver: GuestDriver | None = None,
    node: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Hypervisor:
    """``None`` -> ``LIBVIRT_DEFAULT_URI`` (from ``env``, default the process environment) or
    libvirt's own default; ``sim:///<node>`` -> that node's simulated hypervisor with its data
    under ``state_dir/hv/<node>``; anything else -> libvirt.

    ``node`` names the fabric node a libvirt host is (``Hypervisor.node``); a simulated node
    takes it from its URI, and a different ``node`` is refused."""
    environ = os.environ if env is None else env
    if uri is None:
        uri = environ.get("LIBVIRT_DEFAULT_URI") or None
    simulated = sim_node(uri) if uri else None
    if simulated is not None:
        if node is not None and node != simulated:
            raise ConfigError(f"node {node!r} does not match the hypervisor URI {uri!r}")
        from vmlend.sim.hypervisor.node import SimHypervisor

        return SimHypervisor(simulated, state_dir / "hv" / simulated, hook_command, guest_driver)
    # libvirt prints every error to stderr unless a handler is set; ours goes to the log and
    # the error itself reaches the user once, as a VmlendError.
    libvirt.registerErrorHandler(_log_libvirt_error, None)
    try:
        conn = libvirt.open(uri)
    except libvirt.libvirtError as e:
        where = uri or "libvirt's default URI"
        raise LibvirtError(
            f"cannot connect to {where}: {one_line(e)}; is libvirtd running (or pass --connect)?"
        ) from None
    return LibvirtHypervisor(conn, node=node)
