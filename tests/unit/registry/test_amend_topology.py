"""``StateTxn.amend_topology`` on both backends, through ``vmlend fabric discover``'s merge: a
topology that keeps every node and device is installed while a VM holds a device, and every
record of the fabric stays (holds, claims, runtime records, lent and up/down records)."""

from __future__ import annotations

import pytest

from tests.support.daemon_marks import REGISTRIES
from tests.support.discovery import adapter, device, host
from tests.support.simfabric import make_fabric
from vmlend.registry import open_registry
from vmlend.sim.backend import SimFabric
from vmlend.topology.model import Holder
from vmlend.wiring.discover import discover_fabric


@pytest.fixture(params=REGISTRIES)
def location(request, tmp_path):
    """A new shared state of either backend: an SQLite path or an etcd cluster URL."""
    if request.param == "etcd":
        return request.getfixturevalue("etcd_url")
    return tmp_path / "s.db"


#: gamma of the shipped cluster, as its driver would describe it, with a drive of its own.
GAMMA = host(
    12,
    (adapter(0, switch_port=2), adapter(1, switch_port=0)),
    (device(0x40, "0000:05:00.0"),),
    hostname="gamma.fabric.local",
)


def test_a_merge_beside_a_hold_keeps_every_record(location):
    holder = Holder("gamma", "vm1", "u1")
    with make_fabric(location) as fabric:
        fabric.reserve(0x10, holder)
    reg = open_registry(location)
    try:

        def records(tx):
            tx.set_lent(0x20, False)
            tx.set_node_up("beta", False, "fan")
            tx.put_runtime(0x10, "irq-vector", "msi.0", {"eventfd": True})

        reg.transact(records)
        with reg.read() as tx:
            claims, digest = tx.claims(), tx.topology_digest()
        assert claims  # the hold claims adapter resources

        result = discover_fabric(location, GAMMA)
        assert result.action == "merged"
        assert [c.line() for c in result.merge.changes] == [
            "added device 0x40: nvme 0000:05:00.0 8086:0a54"
        ]
        with reg.read() as tx:
            assert tx.topology_digest() != digest
            assert tx.hold(0x10).holder == holder and tx.claims() == claims
            assert [r.key for r in tx.runtime(0x10)] == ["msi.0"]
            assert not tx.device(0x20).lent
            assert (tx.node("beta").up, tx.node("beta").why) == (False, "fan")
            new = tx.device(0x40)
            assert new is not None
            assert (new.lender, new.lent, new.available) == ("gamma", True, True)
    finally:
        reg.close()
    with SimFabric(open_registry(location), local_node="gamma") as f:
        assert f.topology().device(0x40).lender == "gamma"
        assert {st.fdid: st.holder for st in f.devices() if st.holder} == {0x10: holder}
    assert discover_fabric(location, GAMMA).action == "unchanged"
