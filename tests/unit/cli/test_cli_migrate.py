"""``vmlend migrate`` (cold) between simulated hypervisor nodes running the real vmlend hook:
the VM keeps its fdids and its devices work there; a failure at any step leaves the VM defined
(and startable) on exactly one of the two hosts; bad input changes nothing."""

from __future__ import annotations

import json

import pytest

from tests.support.cli_cluster import GAMMA, SimCluster, make_cluster, one_line
from tests.support.simfabric import small_topology
from vmlend.domain import read_domain
from vmlend.errors import (
    DomainDefinitionError,
    HookFailedError,
    MigrationError,
    UnknownDomainError,
)
from vmlend.hypervisor import DomainState
from vmlend.ops.migrate import migrate
from vmlend.registry import SqliteRegistry
from vmlend.sim.hypervisor.node import IdleGuest
from vmlend.topology.model import GiB


def where(cluster: SimCluster, name: str = "vm1") -> dict[str, tuple[str, bool]]:
    """Node -> (state, persistent) of every simulated node that has the domain."""
    out = {}
    for node in ("alpha", "beta", "gamma"):
        try:
            info = cluster.hv(node).lookup(name)
        except UnknownDomainError:
            continue
        out[node] = (info.state.value, info.persistent)
    return out


def test_stopped_vm_moves_keeping_its_fdids_and_borrows_there(cluster):
    cluster.define("gamma", "vm1", [0x10, 0x21])
    r = cluster.cli("migrate", "vm1", "--to", "beta", *GAMMA)
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == (
        "migrated VM 'vm1' from gamma to beta (stopped), devices 0x10, 0x21"
    )
    assert where(cluster) == {"beta": ("shutoff", True)}
    xml = cluster.hv("beta").xml("vm1", inactive=True)
    dom = read_domain(xml)
    assert [d.fdid for d in dom.devices] == [0x10, 0x21]
    assert dom.host_node == "beta"
    assert cluster.holds() == {}
    cluster.hv("beta").start("vm1")  # the destination's hook borrows them
    assert cluster.holds() == {0x10: "beta/vm1", 0x21: "beta/vm1"}
    assert {f for _u, f in cluster.mdevs("beta")} == {0x10, 0x21}


def test_running_vm_is_shut_down_moved_and_started(cluster):
    cluster.define("gamma", "vm1", [0x10, 0x12], running=True)
    assert cluster.holds() == {0x10: "gamma/vm1", 0x12: "gamma/vm1"}
    r = cluster.cli("migrate", "vm1", "--to", "beta", "--start", "--json", *GAMMA)
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["from"] == "gamma" and data["to"] == "beta"
    assert data["devices"] == ["0x10", "0x12"]
    assert data["stopped"] is True and data["started"] is True
    assert "shut down vm1" in r.stderr and "started on beta" in r.stderr  # progress lines
    assert where(cluster) == {"beta": ("running", True)}
    assert cluster.holds() == {0x10: "beta/vm1", 0x12: "beta/vm1"}
    assert cluster.mdevs("gamma") == set()


def test_leftovers_held_by_the_vm_on_the_source_are_returned(cluster):
    xml = cluster.define("gamma", "vm1", [0x10])
    dom = read_domain(xml)
    with cluster.fabric() as f:  # a crashed release left the device held and its mdev
        from vmlend.lending.devices import UndoJournal, acquire_device, holder_for

        acquire_device(f, holder_for(f, "vm1", dom.uuid), 0x10, dom.devices[0].mdev, UndoJournal())
    r = cluster.cli("migrate", "vm1", "--to", "beta", *GAMMA)
    assert r.exit_code == 0, r.output
    assert "device 0x10: returned" in r.stderr
    assert cluster.holds() == {} and cluster.mdevs("gamma") == set()


# --- refusals: one line, nothing changed -----------------------------------------------------


def test_unknown_node(cluster):
    cluster.define("gamma", "vm1", [0x10], running=True)
    before = cluster.snapshot()
    line = one_line(cluster.cli("migrate", "vm1", "--to", "delta", *GAMMA))
    assert line == "Error: unknown node 'delta'; 'vmlend fabric show' lists the nodes"
    assert cluster.snapshot() == before


def test_node_that_cannot_reach_a_lender(state_path, monkeypatch):
    monkeypatch.delenv("VMLEND_NODE", raising=False)
    cluster = make_cluster(state_path, small_topology(isolated=True), node="b")
    cluster.define("b", "vm1", [0x100], running=True)
    before = cluster.snapshot()
    line = one_line(cluster.cli("migrate", "vm1", "--to", "x", "-c", "sim:///b"))
    assert line.startswith("Error: cannot migrate VM 'vm1' to x: device 0x100: ")
    assert "no NTB path" in line and line.endswith("nothing was changed")
    assert cluster.snapshot() == before


def test_device_held_by_another_vm_blocks_the_move(cluster):
    cluster.define("gamma", "vm1", [0x10])
    cluster.define("beta", "other", [0x10], running=True)
    before = cluster.snapshot()
    line = one_line(cluster.cli("migrate", "vm1", "--to", "beta", *GAMMA))
    assert "to beta: device 0x10 is held by beta/other;" in line
    assert cluster.snapshot() == before


def test_migrating_to_its_own_node(cluster):
    cluster.define("gamma", "vm1", [0x10])
    before = cluster.snapshot()
    assert "already on gamma" in one_line(cluster.cli("migrate", "vm1", "--to", "gamma", *GAMMA))
    assert cluster.snapshot() == before


def test_same_name_on_the_destination(cluster):
    cluster.define("gamma", "vm1", [0x10])
    cluster.define("beta", "vm1")
    before = cluster.snapshot()
    line = one_line(cluster.cli("migrate", "vm1", "--to", "beta", *GAMMA))
    assert "sim:///beta already has a domain named 'vm1'" in line
    assert cluster.snapshot() == before


def test_vm_that_does_not_exist(cluster):
    line = one_line(cluster.cli("migrate", "ghost", "--to", "beta", *GAMMA))
    assert "no domain 'ghost' on sim:///gamma" in line


def test_libvirt_source_needs_dest_uri(cluster):
    r = cluster.cli("migrate", "vm1", "--to", "beta", "-c", "test:///default")
    assert r.exit_code == 2, r.output
    assert "--dest-uri" in r.output


def test_dest_uri_naming_another_node_is_refused(cluster):
    cluster.define("gamma", "vm1", [0x10])
    before = cluster.snapshot()
    line = one_line(
        cluster.cli("migrate", "vm1", "--to", "beta", "--dest-uri", "sim:///alpha", *GAMMA)
    )
    assert "does not match the hypervisor URI" in line
    assert cluster.snapshot() == before


# --- a failure at each step leaves the VM on exactly one host --------------------------------


class Failing:
    """Wraps a hypervisor; ``fail`` names the method that raises."""

    def __init__(self, hv, fail: str) -> None:
        self._hv, self._fail = hv, fail

    def __getattr__(self, name):
        attr = getattr(self._hv, name)
        if name != self._fail:
            return attr

        def refuse(*a, **kw):
            raise DomainDefinitionError(name, "vm1", f"injected {name} failure")

        return refuse


class StubbornGuest(IdleGuest):
    def on_shutdown_request(self, name: str) -> bool:
        return False


class CrashingGuest(IdleGuest):
    def on_started(self, name: str, domain_xml: bytes) -> None:
        raise HookFailedError("start", name, "guest crashed")


def run_migrate(cluster, src, dst, **kw):
    with cluster.fabric() as f:
        return migrate(src, dst, f, "vm1", "beta", **kw)


def assert_startable_on(cluster, node: str) -> None:
    assert list(where(cluster)) == [node]
    hv = cluster.hv(node)
    if hv.lookup("vm1").state is DomainState.SHUTOFF:
        hv.start("vm1")
    assert set(cluster.holds().values()) == {f"{node}/vm1"}


def test_destination_define_fails(cluster):
    cluster.define("gamma", "vm1", [0x10], running=True)
    with pytest.raises(MigrationError, match="injected define failure; it stays defined on gamma"):
        run_migrate(cluster, cluster.hv("gamma"), Failing(cluster.hv("beta"), "define"))
    assert_startable_on(cluster, "gamma")


def test_source_undefine_fails_undoes_the_define(cluster):
    cluster.define("gamma", "vm1", [0x10])
    with pytest.raises(MigrationError, match="injected undefine failure; it stays defined on"):
        run_migrate(cluster, Failing(cluster.hv("gamma"), "undefine"), cluster.hv("beta"))
    assert_startable_on(cluster, "gamma")


def test_start_on_the_destination_fails_moves_back(cluster):
    cluster.define("gamma", "vm1", [0x10, 0x20])
    dst = cluster.hv("beta", guest=CrashingGuest())
    with pytest.raises(MigrationError, match="guest crashed; it is defined on sim:///gamma"):
        run_migrate(cluster, cluster.hv("gamma"), dst, start=True)
    assert cluster.holds() == {}  # the failed start returned what its hook took
    assert_startable_on(cluster, "gamma")


def test_shutdown_timeout_without_force_leaves_it_running(cluster):
    cluster.define("gamma", "vm1", [0x10], running=True)
    src = cluster.hv("gamma", guest=StubbornGuest())
    with pytest.raises(MigrationError, match="pass --force"):
        run_migrate(cluster, src, cluster.hv("beta"), shutdown_timeout=0)
    assert where(cluster) == {"gamma": ("running", True)}
    assert cluster.holds() == {0x10: "gamma/vm1"}


def test_shutdown_timeout_with_force_destroys_and_moves(cluster):
    cluster.define("gamma", "vm1", [0x10], running=True)
    src = cluster.hv("gamma", guest=StubbornGuest())
    res = run_migrate(cluster, src, cluster.hv("beta"), shutdown_timeout=0, force=True)
    assert res.stopped and any("destroyed" in s for s in res.steps)
    assert_startable_on(cluster, "beta")


def test_a_lost_hook_release_is_cleaned_up_before_the_move(cluster):
    cluster.define("gamma", "vm1", [0x10], running=True)
    src = cluster.hv("gamma")
    src.hooks.command = None  # as if the release hook never ran: the device stays held
    res = run_migrate(cluster, src, cluster.hv("beta"), start=True)
    assert "device 0x10: returned" in res.steps
    assert cluster.holds() == {0x10: "beta/vm1"}


def test_runtime_records_go_with_the_release(cluster):
    cluster.define("gamma", "vm1", [0x10], running=True)
    with SqliteRegistry.open(cluster.state_path) as reg, reg.write() as tx:
        tx.put_runtime(0x10, "dma-window", "low", {"start": 0, "end": 1 << 29})
    run_migrate(cluster, cluster.hv("gamma"), cluster.hv("beta"))
    with SqliteRegistry.open(cluster.state_path) as reg, reg.read() as tx:
        assert tx.runtime() == []


def test_devices_that_fit_one_by_one_but_not_together_keep_the_vm_running(cluster):
    # a VM on alpha borrows beta's GPU: its 64 GiB of DMA windows take 17 of beta:0's segments,
    # its interrupt window (MSI over the NTB, the default) one more
    cluster.define("alpha", "other", [0x20], memory=64 * GiB, running=True)
    cluster.define("gamma", "vm1", [0x10, 0x11], running=True)
    holds = cluster.holds()
    # on beta each GPU's BARs need 10 segments of beta:0 (14 free): both need 20
    r = cluster.cli("migrate", "vm1", "--to", "beta", *GAMMA)
    assert r.exit_code == 1
    line = one_line(r)
    assert "device 0x11: NTB window beta:0 short by 16.05 GiB" in line  # 0x10 took 10 of 14
    assert "nothing was changed" in line
    assert where(cluster) == {"gamma": ("running", True)}
    assert cluster.holds() == holds
