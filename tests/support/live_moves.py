"""Set-ups for the live-migration tests on the CLI's simulated nodes: a running VM with
devices attached at given guest addresses, the registry's holds, a guest noting hot-plug
events. No tests here."""

from __future__ import annotations

from tests.support.cli_cluster import GAMMA, SimCluster
from vmlend.sim.hypervisor.node import IdleGuest


def running_with(cluster: SimCluster, fdids: dict[int, str]) -> None:
    """VM "vm1" runs on gamma with ``fdids`` (fdid -> guest address) hot-plugged."""
    cluster.define("gamma", "vm1", running=True)
    for fdid, address in fdids.items():
        r = cluster.cli("attach", "vm1", hex(fdid), "--address", address, "--live", *GAMMA)
        assert r.exit_code == 0, r.output


def holds(cluster: SimCluster) -> dict[int, tuple[str, int]]:
    """Each held device: its holder ("node/vm") and fencing token."""
    with cluster.fabric() as f, f.registry.read() as tx:
        return {d: (f"{h.holder.node}/{h.holder.vm}", h.token) for d, h in tx.holds().items()}


class Watching(IdleGuest):
    """A guest that notes every hot-plug and hot-unplug it sees."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def on_device_added(self, name: str, device_xml: bytes) -> None:
        self.events.append("added")

    def on_device_removed(self, name: str, device_xml: bytes) -> None:
        self.events.append("removed")
