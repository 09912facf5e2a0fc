"""``vmlend migrate VM --to NODE --live`` of a VM with a queue-level NVMe share, between
simulated nodes running the real vmlend hook: the share follows its VM hot (its record, claims
and mdev move under a newer epoch, the destination's prepare accepts it as arriving), the
other VMs' shares of the same drive are untouched; admission is all or nothing; the
registry's invariants hold after every step (``tests.support.handover_checks``). The data
path is proved in the simulator (tests/unit/sim/test_hot_migrate_shares.py)."""

from __future__ import annotations

import json

import pytest

from tests.support.cli_cluster import GAMMA, SimCluster
from tests.support.handover_checks import assert_consistent, registry_violations
from tests.support.share_moves import share_drive, share_mdevs, shares, start_sharing
from vmlend.errors import FabricError
from vmlend.hypervisor import LiveMigration
from vmlend.ops.live_migrate import live_migrate
from vmlend.ops.live_state import load_journal

LIVE = ("migrate", "vm1", "--to", "beta", "--live", *GAMMA)


@pytest.fixture
def shared(cluster: SimCluster) -> SimCluster:
    share_drive(cluster)
    start_sharing(cluster, "gamma", "vm1", gpu=True)
    start_sharing(cluster, "gamma", "sb")
    start_sharing(cluster, "beta", "sc")
    return cluster


def test_a_share_follows_its_vm_hot_and_the_neighbours_shares_stay(shared):
    cluster = shared
    before = shares(cluster)
    assert set(before) == {"vm:gamma/vm1", "vm:gamma/sb", "vm:beta/sc"}
    r = cluster.cli(*LIVE, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["mode"] == "hot" and sorted(data["devices"]) == ["0x10", "0x12"]
    assert set(data["blackout"]) == {"0x10", "0x12"}
    assert "checked 1 device and 1 NVMe share: all admissible from beta" in r.stderr
    assert "0x12 share epoch 1" in r.stderr
    after = shares(cluster)
    assert set(after) == {"vm:beta/vm1", "vm:gamma/sb", "vm:beta/sc"}
    moved, was = after["vm:beta/vm1"], before["vm:gamma/vm1"]
    assert moved["epoch"] == 1 and "leaving" not in moved and "incoming" not in moved
    keep = ("qid_base", "lba_offset", "asid", "vector_base")
    assert {k: moved["share"][k] for k in keep} == {k: was["share"][k] for k in keep}
    assert moved["share"]["name"] == "vm:beta/vm1"
    windows = {c["share"] for c in moved["claims"] if c["kind"] == "dma"}
    # the source's windows (DMA and interrupt) went with the release
    assert windows == {"nvme:0x12:beta/vm1", "msi:beta/vm1"}
    # the neighbours' shares: the very same records
    assert after["vm:gamma/sb"] == before["vm:gamma/sb"]
    assert after["vm:beta/sc"] == before["vm:beta/sc"]
    assert share_mdevs(cluster) == {("beta", "vm1"), ("gamma", "sb"), ("beta", "sc")}
    assert registry_violations(cluster.fabric().registry) == []
    back = cluster.cli("migrate", "vm1", "--to", "gamma", "--live", "-c", "sim:///beta")
    assert back.exit_code == 0, back.output  # and back, hot again, a newer epoch
    assert shares(cluster)["vm:gamma/vm1"]["epoch"] == 2


def test_the_invariants_hold_after_every_step(shared):
    cluster = shared
    steps: list[str] = []
    with cluster.fabric("gamma") as f, cluster.fabric("beta") as g:

        def check(line: str) -> None:
            steps.append(line)
            journal = load_journal(cluster.state_path.parent, "vm1")
            assert_consistent(f.registry, line, None, {"vm1"} if journal else ())

        res = live_migrate(
            cluster.hv("gamma"),
            cluster.hv("beta"),
            f,
            g,
            "vm1",
            "beta",
            how=LiveMigration(),
            state_dir=cluster.state_path.parent,
            progress=check,
        )
    assert res.mode == "hot"
    assert any(s.startswith("claimed room for 2 devices of vm1 on beta") for s in steps)
    assert any("gamma's room for the devices of vm1 released" in s for s in steps)


def test_no_room_for_the_share_on_the_destination_changes_nothing(shared, monkeypatch):
    cluster = shared
    snap, before = cluster.snapshot(), shares(cluster)
    from vmlend.ledger import sharemove

    def full(*_a, **_k):
        raise FabricError("no window left on beta")

    monkeypatch.setattr(sharemove, "check_share_claims", full)
    r = cluster.cli(*LIVE)
    assert r.exit_code != 0
    assert "the NVMe share of 0x12: no window left on beta; nothing was changed" in r.output
    assert cluster.snapshot() == snap and shares(cluster) == before
    assert cluster.hv("gamma").lookup("vm1").active
