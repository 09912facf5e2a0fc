"""``vmlend migrate VM --to NODE --live`` the hot way (``vmlend.ops.hot_move``) between simulated
nodes running the real vmlend hook: the devices stay plugged, their holds and mdevs move at the
switch-over under newer tokens and the lender serves the new borrow; a device that cannot
quiesce makes the VM move unplugged, said in one line; a failure before the switch leaves
everything on the source; the destination's prepare hook accepts arriving devices only as the
hand-over record names them, for that VM. The registry's invariants are checked after every
step (``tests.support.handover_checks``)."""

from __future__ import annotations

import json
import uuid

import msgspec
import pytest

from tests.support.cli_cluster import GAMMA, SimCluster, hostdev_uuids
from tests.support.handover_checks import assert_consistent, registry_violations
from tests.support.live_moves import Watching, holds, running_with
from vmlend.domain import read_domain
from vmlend.errors import HookFailedError, MigrationError, QuiesceError
from vmlend.hypervisor import LiveMigration
from vmlend.ledger.handover_record import KIND, HandOverRecord
from vmlend.ops.live_migrate import live_migrate
from vmlend.ops.live_state import history, load_journal
from vmlend.sim.hypervisor.node import SimHypervisor
from vmlend.sim.register import LENDERS_ENV, LenderRegister

GPU, NVME, NIC = 0x10, 0x12, 0x21
ADDRS = {GPU: "0000:00:0a.0", NVME: "0000:00:0b.0"}
LIVE = ("migrate", "vm1", "--to", "beta", "--live", *GAMMA)


@pytest.fixture
def lenders(tmp_path, monkeypatch) -> LenderRegister:
    """The simulated lenders' register, shared with the hooks (they inherit the variable)."""
    where = tmp_path / "lenders"
    monkeypatch.setenv(LENDERS_ENV, str(where))
    return LenderRegister(where)


def handover_records(cluster: SimCluster) -> list[object]:
    with cluster.fabric() as f, f.registry.read() as tx:
        return tx.runtime(kind=KIND)


def test_live_keeps_the_devices_plugged_through_the_cli(cluster, lenders):
    running_with(cluster, ADDRS)
    before = holds(cluster)
    mdevs = sorted(hostdev_uuids(cluster.hv("gamma").xml("vm1")))
    r = cluster.cli(*LIVE, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["mode"] == "hot" and data["devices"] == ["0x10", "0x12"]
    assert set(data["blackout"]) == {"0x10", "0x12"}
    assert all(b is not None and b >= 0 for b in data["blackout"].values())
    assert "moving VM 'vm1' hot: its devices 0x10 (gpu), 0x12 (nvme) stay plugged" in r.stderr
    assert "unplugging" not in r.stderr and "plugged back" not in r.stderr
    # the same hostdevs (same mdev UUIDs) at the same guest addresses, now on beta
    live = cluster.hv("beta").xml("vm1")
    assert sorted(hostdev_uuids(live)) == mdevs
    assert read_domain(live).host_node == "beta"
    after = holds(cluster)
    assert {f: h for f, (h, _t) in after.items()} == {GPU: "beta/vm1", NVME: "beta/vm1"}
    assert all(after[f][1] > before[f][1] for f in (GPU, NVME))  # newer fencing tokens
    assert {f for _u, f in cluster.mdevs("beta")} == {GPU, NVME}
    assert cluster.mdevs("gamma") == set()
    # the lenders serve the new borrow under its token; the source's is refused from now on
    for f in (GPU, NVME):
        serving = lenders.read(f)
        assert (serving.token, serving.borrower) == (after[f][1], "beta/vm1")
    assert handover_records(cluster) == []
    assert registry_violations(cluster.fabric().registry, lenders) == []
    (rec,) = history(cluster.state_path.parent, "vm1")
    assert rec.mode == "hot" and set(rec.blackout) == {GPU, NVME}
    text = cluster.cli("migrate", "vm1", "--to", "gamma", "--live", "-c", "sim:///beta")
    assert text.exit_code == 0, text.output  # and back, hot again
    assert text.stdout.startswith(
        "migrated VM 'vm1' hot from beta to gamma (running), devices 0x10, 0x12 (kept plugged);"
    )


def test_no_unplug_event_and_the_invariants_hold_after_every_step(cluster, lenders):
    running_with(cluster, ADDRS)
    src_guest, dst_guest = Watching(), Watching()
    steps: list[str] = []
    with cluster.fabric("gamma") as f, cluster.fabric("beta") as g:

        def check(line: str) -> None:
            steps.append(line)
            journal = load_journal(cluster.state_path.parent, "vm1")
            assert_consistent(f.registry, line, lenders, {"vm1"} if journal else ())

        res = live_migrate(
            cluster.hv("gamma", guest=src_guest),
            cluster.hv("beta", guest=dst_guest),
            f,
            g,
            "vm1",
            "beta",
            how=LiveMigration(),
            state_dir=cluster.state_path.parent,
            progress=check,
        )
    assert res.mode == "hot"
    assert src_guest.events == [] and dst_guest.events == []  # never unplugged, never re-plugged
    assert any(s.startswith("claimed room for 2 devices of vm1 on beta") for s in steps)
    assert any(s.startswith("holds and mdevs of vm1 handed over to beta") for s in steps)
    assert load_journal(cluster.state_path.parent, "vm1") is None


def test_a_nic_makes_the_vm_move_unplugged_said_in_one_line(cluster):
    running_with(cluster, {NIC: "0000:00:0c.0"})
    r = cluster.cli("migrate", "vm1", "--to", "alpha", "--live", "--json", *GAMMA)
    assert r.exit_code == 0, r.output
    said = [ln for ln in r.stderr.splitlines() if "cannot quiesce" in ln]
    assert said == [
        "vmlend: device 0x21 (nic) cannot quiesce: VM 'vm1' moves with its devices unplugged"
    ]
    assert "unplugging device 0x21 from vm1" in r.stderr
    data = json.loads(r.stdout)
    assert data["mode"] == "unplug" and set(data["blackout"]) == {"0x21"}
    assert holds(cluster)[NIC][0] == "alpha/vm1"


class RefusesQuiesce(SimHypervisor):
    """A source whose NVMe drive cannot complete a command at the switch-over: its driver
    refuses the quiesce (``QuiesceError``), the destination's hooks having run."""

    def migrate_live(self, name, dst, how, switch_over=None):
        class Refusing:
            def switch(self) -> None:
                raise QuiesceError(NVME, "nvme", "injected: a command did not complete")

            def resumed(self) -> None:
                raise AssertionError("never resumed there")

        assert switch_over is not None, "a hot migration passes its switch-over"
        return super().migrate_live(name, dst, how, switch_over=Refusing())


def test_a_failure_before_the_switch_leaves_everything_on_the_source(cluster, lenders):
    running_with(cluster, ADDRS)
    before, snap = holds(cluster), cluster.snapshot()
    served = {f: lenders.read(f) for f in (GPU, NVME)}
    src = cluster.hv("gamma")
    src.__class__ = RefusesQuiesce
    with (
        cluster.fabric("gamma") as f,
        cluster.fabric("beta") as g,
        pytest.raises(MigrationError) as e,
    ):
        live_migrate(
            src,
            cluster.hv("beta"),
            f,
            g,
            "vm1",
            "beta",
            how=LiveMigration(),
            state_dir=cluster.state_path.parent,
        )
    assert str(e.value) == (
        "live migration of VM 'vm1' to beta failed: device 0x12 (nvme) cannot be quiesced:"
        " injected: a command did not complete; it runs on gamma with all its devices, as"
        " before"
    )
    assert cluster.hv("gamma").lookup("vm1").active
    assert [d.name for d in cluster.hv("beta").list_domains()] == []
    assert holds(cluster) == before  # the same holds, the same tokens
    assert cluster.snapshot() == snap  # claims (adapter usage), mdevs, domain files
    assert handover_records(cluster) == []
    assert {f: lenders.read(f) for f in (GPU, NVME)} == served
    assert load_journal(cluster.state_path.parent, "vm1") is None
    r = cluster.cli(*LIVE)  # nothing is left over: the same move, run again, goes hot
    assert r.exit_code == 0, r.output
    assert holds(cluster)[GPU][0] == "beta/vm1"


def forge(cluster: SimCluster, fdid: int, record: HandOverRecord) -> None:
    """Whoever may write the registry writes a hand-over record on ``fdid``."""
    data = msgspec.to_builtins(record, str_keys=True)
    with cluster.fabric() as f:
        f.registry.transact(lambda tx: tx.put_runtime(fdid, KIND, record.vm_uuid, data))


def test_a_forged_hand_over_record_for_another_vm_is_refused_by_the_hook(cluster):
    running_with(cluster, {GPU: "0000:00:0a.0"})
    token = holds(cluster)[GPU][1]
    other = uuid.uuid4()
    cluster.define("beta", "intruder", [GPU], vm_uuid=other)
    forge(cluster, GPU, HandOverRecord("intruder", str(other), "gamma", "beta", {GPU: token}))
    before = cluster.snapshot()
    with pytest.raises(HookFailedError) as e:
        cluster.hv("beta").start("intruder")
    assert "device 0x10" in str(e.value) and "gamma/vm1" in str(e.value)
    assert not cluster.hv("beta").lookup("intruder").active
    assert holds(cluster) == {GPU: ("gamma/vm1", token)}
    assert cluster.snapshot() == before


def test_a_record_of_the_vm_itself_must_match_its_holds(cluster):
    """The VM's own UUID, but a token that is not its hold's (a record of an older hold):
    refused by the record check itself, nothing borrowed."""
    running_with(cluster, {GPU: "0000:00:0a.0"})
    vm_uuid = read_domain(cluster.hv("gamma").xml("vm1")).uuid
    token = holds(cluster)[GPU][1]
    forge(cluster, GPU, HandOverRecord("vm1", str(vm_uuid), "gamma", "beta", {GPU: token - 1}))
    cluster.define("beta", "vm1", [GPU], vm_uuid=vm_uuid)  # a copy of it, started there
    beta = cluster.hv("beta")
    with pytest.raises(HookFailedError) as e:
        beta.start("vm1")
    assert "the hot migration of VM 'vm1'" in str(e.value)
    assert f"device 0x10's hold has token {token}, the record {token - 1}" in str(e.value)
    assert holds(cluster) == {GPU: ("gamma/vm1", token)}
