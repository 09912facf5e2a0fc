"""``vmlend migrate VM --to NODE --live`` moving a VM's queue-level NVMe share *unplugged*
(``--unplug``, or a share of two paths), between simulated nodes running the real vmlend hook:
the share keeps its identity (LBA extent, queue pairs, address space, paths) and follows its
VM under a newer epoch; its room on the destination is claimed before anything is unplugged;
its controller comes back at the same guest address; its blocks are never free for another
VM. The data path is proved in the simulator (tests/unit/sim/test_unplug_migrate_shares.py)."""

from __future__ import annotations

import json

import pytest

from tests.support.cli_cluster import GAMMA, SimCluster
from tests.support.handover_checks import assert_consistent, registry_violations
from tests.support.share_moves import (
    GPU,
    NVME,
    SHARE_AT,
    share_address,
    share_drive,
    share_mdevs,
    shares,
    start_sharing,
    two_adapter_cluster,
)
from vmlend.errors import FabricError, MigrationError
from vmlend.hypervisor import LiveMigration
from vmlend.ledger import nvmeshares, sharemove
from vmlend.ops.live_migrate import live_migrate
from vmlend.ops.live_state import load_journal
from vmlend.topology.model import GiB, Holder

LIVE = ("migrate", "vm1", "--to", "beta", "--live", *GAMMA)
#: What makes a share the same share: its queues, blocks, address space and vectors.
IDENTITY = ("qid_base", "queue_pairs", "lba_offset", "blocks", "asid", "vector_base", "paths")


@pytest.fixture
def shared(cluster: SimCluster) -> SimCluster:
    share_drive(cluster)
    start_sharing(cluster, "gamma", "vm1", gpu=True)
    start_sharing(cluster, "gamma", "sb")
    start_sharing(cluster, "beta", "sc")
    return cluster


def identity(record: dict) -> dict:
    return {k: record["share"][k] for k in IDENTITY}


def move(cluster: SimCluster, progress, **kw) -> object:  # type: ignore[no-untyped-def]
    with cluster.fabric("gamma") as f, cluster.fabric("beta") as g:
        return live_migrate(
            cluster.hv("gamma"),
            cluster.hv("beta"),
            f,
            g,
            "vm1",
            "beta",
            how=LiveMigration(),
            state_dir=cluster.state_path.parent,
            progress=progress,
            unplug=True,
            **kw,
        )


def test_an_unplugged_move_keeps_the_share_and_plugs_it_back_at_its_address(shared):
    cluster = shared
    before = shares(cluster)
    r = cluster.cli(*LIVE, "--unplug", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["mode"] == "unplug" and data["modes"] == {"0x10": "unplug", "0x12": "unplug"}
    assert "handed over to beta (0x12 epoch 1): the same blocks" in r.stderr
    after = shares(cluster)
    assert set(after) == {"vm:beta/vm1", "vm:gamma/sb", "vm:beta/sc"}
    moved, was = after["vm:beta/vm1"], before["vm:gamma/vm1"]
    assert identity(moved) == identity(was)
    assert moved["share"]["name"] == "vm:beta/vm1" and moved["epoch"] == 1
    assert "incoming" not in moved and "leaving" not in moved
    windows = {c["share"] for c in moved["claims"] if c["kind"] == "dma"}
    assert windows == {"nvme:0x12:beta/vm1", "msi:beta/vm1"}  # its interrupt window moved too
    assert after["vm:gamma/sb"] == before["vm:gamma/sb"]
    assert after["vm:beta/sc"] == before["vm:beta/sc"]
    assert share_mdevs(cluster) == {("beta", "vm1"), ("gamma", "sb"), ("beta", "sc")}
    assert share_address(cluster, "beta") == SHARE_AT
    assert registry_violations(cluster.fabric().registry) == []
    back = cluster.cli("migrate", "vm1", "--to", "gamma", "--live", "--unplug", "-c", "sim:///beta")
    assert back.exit_code == 0, back.output  # and back, a newer epoch, the same blocks
    home = shares(cluster)["vm:gamma/vm1"]
    assert home["epoch"] == 2 and identity(home) == identity(was)
    assert share_address(cluster, "gamma") == SHARE_AT


def test_the_blocks_are_never_free_and_the_room_is_claimed_before_any_unplug(shared):
    """After every step the VM's share exists (the source's or the destination's), the
    registry's invariants hold, and a share another VM asks for meanwhile gets other blocks."""
    cluster = shared
    was = shares(cluster)["vm:gamma/vm1"]
    extent = range(was["share"]["lba_offset"], was["share"]["lba_offset"] + was["share"]["blocks"])
    steps: list[str] = []
    others: list[dict] = []

    def check(line: str) -> None:
        steps.append(line)
        now = shares(cluster)
        mine = [d for k, d in now.items() if k.endswith("/vm1")]
        assert len(mine) == 1 and identity(mine[0]) == identity(was), line
        journal = load_journal(cluster.state_path.parent, "vm1")
        assert_consistent(cluster.fabric().registry, line, None, {"vm1"} if journal else ())
        if "handed over to beta" in line or line.startswith("unplugging device 0x10"):
            got = nvmeshares.reserve_share(
                cluster.fabric().registry, NVME, Holder("alpha", f"o{len(others)}"), 1, 4096
            )
            others.append({"lba": got.lba_offset, "blocks": got.blocks})

    res = move(cluster, check)
    assert res.mode == "unplug"  # type: ignore[attr-defined]
    claimed = next(i for i, s in enumerate(steps) if s.startswith("claimed room on beta"))
    first_unplug = next(i for i, s in enumerate(steps) if s.startswith("unplugging"))
    assert claimed < first_unplug
    assert len(others) == 2
    for o in others:
        assert not set(range(o["lba"], o["lba"] + o["blocks"])) & set(extent)


def test_no_room_for_the_share_on_the_destination_unplugs_nothing(shared, monkeypatch):
    """The first check passed; the claim just before the unplugs is refused (another host
    took the room meanwhile): nothing was unplugged, nothing is claimed for beta."""
    cluster = shared
    snap, before = cluster.snapshot(), shares(cluster)

    def full(*_a, **_k):
        raise FabricError("no window left on beta")

    monkeypatch.setattr(sharemove, "move_problems", lambda *_a, **_k: [])
    monkeypatch.setattr(sharemove, "check_share_claims", full)
    with pytest.raises(MigrationError) as e:
        move(cluster, lambda _l: None)
    assert "the NVMe share of 0x12: no window left on beta" in str(e.value)
    assert "it runs on gamma with all its devices, as before" in str(e.value)
    assert cluster.snapshot() == snap and shares(cluster) == before
    assert share_address(cluster, "gamma") == SHARE_AT


def test_a_move_that_fails_after_the_hand_over_gives_the_share_back(shared):
    """Another host takes the GPU while it is unplugged: the move is refused after the share
    was handed over; the share comes back to gamma (a newer epoch, the same blocks) and its
    controller is plugged back at its address."""
    cluster = shared
    was = shares(cluster)["vm:gamma/vm1"]

    def meanwhile(line: str) -> None:
        if "handed over to beta" in line:
            with cluster.fabric("beta") as f:
                f.reserve(GPU, Holder("beta", "other"), guest_ram=1 * GiB)

    with pytest.raises(MigrationError) as e:
        move(cluster, meanwhile)
    assert "it runs on gamma without device(s) 0x10" in str(e.value)
    home = shares(cluster)["vm:gamma/vm1"]
    assert home["epoch"] == 2 and identity(home) == identity(was)
    assert "incoming" not in home and "leaving" not in home
    assert "vm:beta/vm1" not in shares(cluster)
    assert share_address(cluster, "gamma") == SHARE_AT
    assert cluster.hv("gamma").lookup("vm1").active
    assert registry_violations(cluster.fabric().registry) == []


def test_a_share_of_two_paths_moves_unplugged_and_the_gpu_stays_plugged(state_path, monkeypatch):
    monkeypatch.delenv("VMLEND_NODE", raising=False)
    cluster = two_adapter_cluster(state_path)
    share_drive(cluster)
    start_sharing(cluster, "gamma", "vm1", gpu=True, paths=2)
    was = shares(cluster)["vm:gamma/vm1"]
    assert was["share"]["paths"] == 2
    r = cluster.cli(*LIVE, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["mode"] == "mixed" and data["modes"] == {"0x10": "hot", "0x12": "unplug"}
    assert (
        "device 0x12 (nvme) is an NVMe share of two paths (its relay rings live in gamma's"
        " memory): unplugged, plugged back on arrival" in r.stderr
    )
    assert "device 0x10 (gpu): stays plugged" in r.stderr
    moved = shares(cluster)["vm:beta/vm1"]
    assert identity(moved) == identity(was) and moved["epoch"] == 1
    assert share_address(cluster, "beta") == SHARE_AT
    assert registry_violations(cluster.fabric().registry) == []


def test_a_share_of_two_paths_with_no_backup_adapter_there_is_refused(shared):
    """beta has one adapter: the share's backup path cannot be made there. Refused in one
    line before anything changed."""
    cluster = shared
    start_sharing(cluster, "gamma", "web", paths=2)
    snap = cluster.snapshot()
    r = cluster.cli("migrate", "web", "--to", "beta", "--live", *GAMMA)
    assert r.exit_code == 1 and r.stderr.count("\n") == 1, r.output
    assert "the NVMe share of 0x12" in r.stderr and "nothing was changed" in r.stderr
    assert cluster.snapshot() == snap


class Killed(BaseException):
    """A kill at a fault point: nothing of the running command's cleanup runs."""


def test_a_vm_stopped_after_its_share_was_handed_over_leaves_no_share_behind(
    shared, monkeypatch
):
    """Killed after the hand-over, then the VM stops on the source (its release hook finds
    no share of it there): the re-run reports it, and the share goes as at any stop, not
    left on beta's key for a VM that does not run."""
    cluster = shared
    import vmlend.ops.share_move as steps

    def die(name: str) -> None:
        if name == "share-move:after-hand-over":
            raise Killed

    monkeypatch.setattr(steps, "fault_point", die)
    with pytest.raises(Killed):
        move(cluster, lambda _l: None)
    assert "vm:beta/vm1" in shares(cluster)
    cluster.hv("gamma").destroy("vm1")
    with pytest.raises(MigrationError, match="stopped during its live migration"):
        move(cluster, lambda _l: None)
    assert not [k for k in shares(cluster) if k.endswith("/vm1")]
    assert registry_violations(cluster.fabric().registry) == []
