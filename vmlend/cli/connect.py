"""``--connect URI`` (like ``virsh -c``) and opening the hypervisor and fabric a command uses.

A ``sim:///<node>`` URI is a simulated node: it keeps its domains beside the state database and
runs vmlend's hook as ``python -m vmlend.hook --state <state> --node <node>`` (libvirtd instead
runs the hook installed with ``vmlend hook install``). The fabric is then seen from that node.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import click

from vmlend.cli.context import CliContext
from vmlend.errors import SimulatedDevicesError, UnknownNodeError, VmlendError
from vmlend.fabric.base import Fabric
from vmlend.hypervisor import Hypervisor
from vmlend.wiring.fabric import open_fabric
from vmlend.wiring.hypervisor import hook_command, open_hypervisor, sim_node

log = logging.getLogger(__name__)


def connect_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "-c",
        "--connect",
        "uri",
        metavar="URI",
        help="Hypervisor URI, e.g. qemu:///system or sim:///gamma"
        " [default: $LIBVIRT_DEFAULT_URI, else libvirt's default].",
    )(f)


def _require_fabric_node(obj: CliContext, node: str) -> None:
    """A simulated node is a node of the fabric: every command refuses one that is not
    (``UnknownNodeError``), not only those that open the fabric themselves. When the fabric
    cannot be read now (no state yet, the registry unreachable) the commands that need it say
    so themselves; one that does not (a VM stopped while etcd is away) goes on."""
    try:
        open_fabric(obj.location, node, backend=obj.backend, root=obj.root).close()
    except UnknownNodeError:
        raise
    except VmlendError as e:
        log.debug("could not check node %s against the fabric: %s", node, e)


def _uri(obj: CliContext, uri: str | None) -> str | None:
    return uri or obj.uri or os.environ.get("LIBVIRT_DEFAULT_URI") or None


def check_simulated_node(obj: CliContext, uri: str | None) -> None:
    """``UnknownNodeError`` when ``uri`` is a simulated node the fabric does not have (what
    ``open_hv`` checks first, unless told not to)."""
    uri = _uri(obj, uri)
    simulated = sim_node(uri) if uri else None
    if simulated:
        _require_fabric_node(obj, simulated)


def open_hv(
    obj: CliContext, uri: str | None, node: str | None = None, *, check_node: bool = True
) -> Hypervisor:
    """The hypervisor at ``uri`` (None: ``LIBVIRT_DEFAULT_URI`` or libvirt's default). A libvirt
    host is the fabric node ``node`` (default ``--node``, else the state's local node); a
    simulated one is the node its URI names. ``check_node`` false: a simulated node is not
    checked against the fabric now (that reads the registry, which a command stopping a VM
    must not wait for: ``check_simulated_node`` then, if the domain is not found)."""
    uri = _uri(obj, uri)
    simulated = sim_node(uri) if uri else None
    if simulated and check_node:
        _require_fabric_node(obj, simulated)
    hook = hook_command(obj.location, simulated, obj.backend) if simulated else None
    node = node or (None if simulated else obj.node)
    return open_hypervisor(uri, state_dir=obj.state_path.parent, hook_command=hook, node=node)


def fabric_for(obj: CliContext, hv: Hypervisor, read_only: bool = False) -> Fabric:
    """The fabric seen from the node ``hv`` runs on (``read_only``: on a cluster registry,
    from no node when neither ``hv`` nor --node says which)."""
    return open_fabric(
        obj.location, hv.node or obj.node, backend=obj.backend, root=obj.root, observer=read_only
    )


def refuse_simulated_devices(
    obj: CliContext, hv: Hypervisor, op: str, domain: str, adding: bool = False
) -> None:
    """Refuse to start (or hot-add to) ``domain`` on a real libvirt hypervisor when the fabric
    is simulated only by default (no SmartIO driver here, no --backend chosen): libvirt would
    fail later with "Mediated host device assignment requires VFIO support" and no hint. A
    domain without vmlend metadata (unless ``adding`` a remote device), a ``sim:///`` node
    and an explicit --backend pass."""
    if obj.backend is not None or sim_node(hv.uri) or obj.host_backend() != "sim":
        return
    from vmlend.hook.prefilter import mentions_vmlend

    if adding or mentions_vmlend(hv.xml(domain, inactive=True)) or mentions_vmlend(hv.xml(domain)):
        raise SimulatedDevicesError(op, domain, hv.uri)
