"""``vmlend migrate VM --to NODE --live`` of a VM with a queue-level NVMe share, between
simulated nodes running the real vmlend hook: the share follows its VM hot (its record, claims
and mdev move under a newer epoch, the destination's prepare accepts it as arriving), the
other VMs' shares of the same drive are untouched; admission is all or nothing; the
registry's invariants hold after every step (``tests.support.handover_checks``). The data
path is proved in the simulator (tests/unit/sim/test_hot_migrate_shares.py)."""

from __future__ import annotations

import json
import uuid

import pytest

from tests.support.cli_cluster import GAMMA, TEMPLATES, SimCluster
from tests.support.handover_checks import assert_consistent, registry_violations
from vmlend.domain import (
    DeviceRequest,
    DomainSpec,
    NvmeShareRequest,
    PciAddress,
    new_domain,
    read_domain,
)
from vmlend.errors import FabricError
from vmlend.hypervisor import LiveMigration
from vmlend.ledger.nvmeshares import SHARE_RECORD
from vmlend.ledger.shareops import SHARE_MDEV_TYPE
from vmlend.ops.live_migrate import live_migrate
from vmlend.ops.live_state import load_journal
from vmlend.topology.model import MiB

GPU, NVME = 0x10, 0x12
SHARE_AT = "0000:00:0b.0"  # the guest address of each VM's share controller
LIVE = ("migrate", "vm1", "--to", "beta", "--live", *GAMMA)


def start_sharing(cluster: SimCluster, node: str, name: str, *, gpu: bool = False) -> None:
    """Define and start ``name`` on ``node`` with a share of the NVMe drive (and the GPU)."""
    spec = DomainSpec(
        name=name,
        memory_bytes=512 * MiB,
        virt_type="qemu",
        uuid=uuid.uuid5(uuid.NAMESPACE_DNS, name),
        devices=[
            DeviceRequest(
                NVME, PciAddress.parse(SHARE_AT), share=NvmeShareRequest(1, 32 * MiB)
            ),
            *([DeviceRequest(GPU)] if gpu else []),
        ],
    )
    hv = cluster.hv(node)
    hv.define(new_domain(spec, templates=TEMPLATES).to_bytes())
    hv.start(name)


@pytest.fixture
def shared(cluster: SimCluster) -> SimCluster:
    r = cluster.cli("nvme", "share", hex(NVME), "--size", "2G")
    assert r.exit_code == 0, r.output
    start_sharing(cluster, "gamma", "vm1", gpu=True)
    start_sharing(cluster, "gamma", "sb")
    start_sharing(cluster, "beta", "sc")
    return cluster


def shares(cluster: SimCluster) -> dict[str, dict]:
    with cluster.fabric() as f, f.registry.read() as tx:
        return {r.key: r.data for r in tx.runtime(NVME, SHARE_RECORD)}


def share_mdevs(cluster: SimCluster) -> set[tuple[str, str]]:
    with cluster.fabric() as f, f.registry.read() as tx:
        return {(m.node, m.vm) for m in tx.mdevs() if m.type_id == SHARE_MDEV_TYPE}


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
    assert windows == {"nvme:0x12:beta/vm1"}  # the source's windows went with the release
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


def share_address(cluster: SimCluster, node: str) -> str | None:
    dom = read_domain(cluster.hv(node).xml("vm1"))
    return next(str(d.address) for d in dom.devices if d.share is not None and d.address)


def test_an_unplugged_move_of_a_share_is_refused_and_changes_nothing(shared):
    """Unplugged, a share would be returned on the source and made again on the destination
    on whatever blocks the drive gives there: the guest's disk would not follow it, and its
    blocks could go to another VM meanwhile. Refused in one line; nothing changed."""
    cluster = shared
    before = shares(cluster)
    mdevs = share_mdevs(cluster)
    address = share_address(cluster, "gamma")
    r = cluster.cli(*LIVE, "--unplug")
    assert r.exit_code == 1, r.output
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "would move its queue-level NVMe shares (0x12) unplugged" in r.stderr
    assert "does not keep a share's blocks; move it cold" in r.stderr
    assert shares(cluster) == before and share_mdevs(cluster) == mdevs
    assert share_address(cluster, "gamma") == address
    assert registry_violations(cluster.fabric().registry) == []
