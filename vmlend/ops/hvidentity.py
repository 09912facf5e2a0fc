"""Which hypervisor is which fabric node: a node's libvirt host UUID, recorded in the registry
the first time vmlend talks to that node's hypervisor.

A URI does not identify a hypervisor (``qemu:///system`` reaches a different one on every host,
and two daemons on one machine have different URIs), so ``migrate --to beta --dest-uri URI``
could move a VM to alpha's hypervisor while the fabric recorded it on beta. The host UUID
(``<host><uuid>`` of libvirt's capabilities; the simulated nodes derive a stable one) tells
them apart: once recorded for a node, another UUID behind that node's URI is refused, and so is
a hypervisor already recorded for another node.
"""

from __future__ import annotations

import logging

from vmlend.errors import ConfigError
from vmlend.fabric.base import Fabric, RegistryFabric
from vmlend.hypervisor import Hypervisor
from vmlend.registry import StateTxn

log = logging.getLogger(__name__)

#: ``meta`` key prefix: ``hypervisor-host-uuid/<node>`` -> the UUID.
META_PREFIX = "hypervisor-host-uuid/"


def check_hypervisor_is(fabric: Fabric, hv: Hypervisor, node: str, what: str) -> None:
    """Refuse (``ConfigError``) when ``hv`` is not node ``node``'s hypervisor by the host UUIDs
    the registry recorded; record ``hv``'s for ``node`` when none is yet. ``what`` names the
    option that gave ``hv`` (e.g. "--dest-uri"). A backend without a registry, or a
    hypervisor that reports no host UUID, checks nothing."""
    if not isinstance(fabric, RegistryFabric):
        return
    host = hv.host_uuid()
    if not host:
        log.info("%s reports no host UUID: not checked as node %s's hypervisor", hv.uri, node)
        return

    def body(tx: StateTxn) -> None:
        recorded = tx.meta(META_PREFIX + node)
        owner = next(
            (n for n in sorted(tx.nodes()) if n != node and tx.meta(META_PREFIX + n) == host),
            None,
        )
        if owner is not None:
            raise ConfigError(
                f"{what} {hv.uri} is node {owner}'s hypervisor (host UUID {host}), not"
                f" {node}'s: give the libvirt URI of node {node}"
            )
        if recorded is not None and recorded != host:
            raise ConfigError(
                f"{what} {hv.uri} is not node {node}'s hypervisor: its host UUID is {host},"
                f" {node}'s is {recorded}; give the libvirt URI of node {node}"
            )
        if recorded is None:
            tx.set_meta(META_PREFIX + node, host)

    fabric.registry.transact(body)
