"""Admission of an NVMe share claims the drive's requester entry on every cluster switch port
its crossing passes (``vmlend.ledger.nvmeadmit``), refuses a share whose port is full in one
line naming the switch and the port (nothing claimed), returns the entries with the share, and
moves them when the drive's crossing is re-routed."""

from __future__ import annotations

import pytest

from tests.support.simcluster import Cluster
from vmlend.errors import SwitchPortFullError
from vmlend.ledger import nvmeshares as shares
from vmlend.ledger.nvmeadmit import share_claims
from vmlend.sim.invariants import check_with_registry
from vmlend.sim.nvmedrive import drive_geometry
from vmlend.sim.nvmeshare import SharedNvmeDrive
from vmlend.topology.model import GuestRam, GuestRange, Holder, MiB
from vmlend.topology.parse import parse_topology
from vmlend.topology.requesters import is_port
from vmlend.wiring.fabric import default_topology_text

DRIVE = 0x12  # alpha's NVMe drive, 0000:43:00.0
RAM = 64 * MiB


def topology_text(entries: int | None = None) -> str:
    text, _source = default_topology_text()
    if entries is None:
        return text
    return text.replace('name = "mxs824"\n', f'name = "mxs824"\nrequester_entries = {entries}\n')


@pytest.fixture
def cluster(state_path, request):
    c = Cluster.create(state_path, topology_text(getattr(request, "param", None)))
    shares.lend_shared(c.registry, DRIVE, drive_geometry(c.hw.device(DRIVE).spec, 1 << 16))
    yield c
    c.close()


def ports_used(c: Cluster) -> dict[str, int]:
    return {p.port: p.used for p in c.fabric().port_usage()}


def reserve(c: Cluster, node: str, vm: str, paths: int = 1):
    return shares.reserve_share(
        c.registry, DRIVE, Holder(node, vm), 1, 1024, guest_ram=RAM, paths=paths
    )


def test_share_claims_name_the_ports_of_both_paths():
    topo = parse_topology(topology_text())
    ram = GuestRam((GuestRange(0, RAM),))
    one = {c.adapter for c in share_claims(topo, DRIVE, Holder("gamma", "web"), ram)}
    assert {a for a in one if is_port(a)} == {"mxs824/alpha:0", "mxs824/gamma:0"}
    two = share_claims(topo, DRIVE, Holder("gamma", "web"), ram, paths=2)
    ports = [c for c in two if is_port(c.adapter)]
    # the backup route through mxs824b: one claim per port, the lender's port once
    assert sorted(c.adapter for c in ports) == [
        "mxs824/alpha:0",
        "mxs824/gamma:0",
        "mxs824/mxs824b",
        "mxs824b/gamma:1",
        "mxs824b/mxs824",
    ]
    assert {(c.share, c.entries) for c in ports} == {("req:alpha/0000:43:00", 1)}
    assert share_claims(topo, DRIVE, Holder("alpha", "local"), ram) == []  # no crossing


def test_a_share_claims_its_ports_and_returns_them_with_the_share(cluster):
    reserve(cluster, "gamma", "one")
    reserve(cluster, "gamma", "two")  # the same entries: the drive's requester once per port
    assert ports_used(cluster) == {"mxs824/alpha:0": 1, "mxs824/gamma:0": 1}
    reserve(cluster, "beta", "three")
    assert ports_used(cluster) == {"mxs824/alpha:0": 1, "mxs824/beta:0": 1, "mxs824/gamma:0": 1}
    for node, vm in (("gamma", "one"), ("gamma", "two")):
        assert shares.release_share(cluster.registry, DRIVE, Holder(node, vm))
    assert ports_used(cluster) == {"mxs824/alpha:0": 1, "mxs824/beta:0": 1}
    shares.release_share(cluster.registry, DRIVE, Holder("beta", "three"))
    assert ports_used(cluster) == {}


@pytest.mark.parametrize("cluster", [1], indirect=True)
def test_a_full_port_refuses_the_share_in_one_line_and_claims_nothing(cluster):
    cluster.fabric().reserve(0x20, Holder("gamma", "gpu"))  # beta's GPU fills gamma's port
    with cluster.registry.read() as tx:
        before = (tx.claims(), tx.runtime(DRIVE, shares.SHARE_RECORD))
    with pytest.raises(SwitchPortFullError) as e:
        reserve(cluster, "gamma", "web")
    assert str(e.value).startswith(
        "switch mxs824 port mxs824/gamma:0: its requester table is full (1 of 1 entries used),"
        " no room for requester alpha/0000:43:00; release a device that crosses it"
    )
    assert "\n" not in str(e.value)
    with cluster.registry.read() as tx:
        assert (tx.claims(), tx.runtime(DRIVE, shares.SHARE_RECORD)) == before
    cluster.fabric().release(0x20, Holder("gamma", "gpu"))
    reserve(cluster, "gamma", "web")
    assert ports_used(cluster) == {"mxs824/alpha:0": 1, "mxs824/gamma:0": 1}
    # both ports are full now, but a second share into gamma needs no entry more: they hold
    # the drive's requester
    reserve(cluster, "gamma", "two")
    with pytest.raises(SwitchPortFullError, match="port mxs824/alpha:0: its requester table"):
        cluster.fabric().reserve(0x10, Holder("beta", "gpu"))  # alpha's GPU: another requester


def test_the_claims_follow_a_rerouted_crossing_and_back(cluster, state_path):
    drive = SharedNvmeDrive(cluster.hw, DRIVE, state_path.parent, blocks=1 << 16)
    share = reserve(cluster, "gamma", "web")
    cluster.hw.create_guest("gamma", "web", [GuestRange(0, RAM)])
    drive.open_share("gamma", "web", share=share).set_master()
    assert check_with_registry(cluster.hw, cluster.registry) == []
    cluster.fabric().set_link_up("mxs824/gamma:0", False)
    assert set(ports_used(cluster)) == {
        "mxs824/alpha:0",
        "mxs824/mxs824b",
        "mxs824b/gamma:1",
        "mxs824b/mxs824",
    }
    assert check_with_registry(cluster.hw, cluster.registry) == []
    cluster.fabric().set_link_up("mxs824/gamma:0", True)
    assert set(ports_used(cluster)) == {"mxs824/alpha:0", "mxs824/gamma:0"}
    assert check_with_registry(cluster.hw, cluster.registry) == []
    drive.close()
