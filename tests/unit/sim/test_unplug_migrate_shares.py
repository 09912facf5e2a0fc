"""Unplugged live migration of a VM with a queue-level NVMe share (``vmlend.sim.unplugmig``,
``vmlend.sim.shareunplug``): VM "sa" on gamma moves to beta while "sb" (gamma) and "sc" (beta)
share the same drive. Proof by data: what sa's guest wrote to its disk before the move it
reads back on beta through a new controller; its share keeps its blocks, queue ids and address
space under a newer epoch; a VM that asks for a share of the same drive during the move is
given other blocks; the neighbours keep working; the checker holds after every step."""

from __future__ import annotations

import pytest

from tests.support.nvme_guest import guest_driver, share_xml, shared_drive, start_sharing_vm
from tests.support.share_moves import two_adapter_topology
from tests.support.simcluster import Cluster
from vmlend.errors import FabricError, StaleTokenError
from vmlend.ledger import nvmeshares as ledger
from vmlend.ledger.admission import vm_share
from vmlend.ledger.nvmeshares import SHARE_RECORD
from vmlend.ledger.shareops import SHARE_MDEV_TYPE
from vmlend.sim.invariants import check_with_registry
from vmlend.sim.nvmedrive import drive_geometry
from vmlend.sim.nvmeshare import SharedNvmeDrive
from vmlend.sim.shareunplug import replug_share, unplug_share
from vmlend.sim.simvm import SimVm
from vmlend.sim.unplugmig import unplug_migrate
from vmlend.topology.model import Holder

NVME = 0x12
BLOCKS = 1 << 20
DISK = b"D" * 4096  # what sa's guest wrote to its disk before the move


@pytest.fixture
def setup(state_path, tmp_path):
    with shared_drive(state_path, tmp_path, fdid=NVME, blocks=BLOCKS) as both:
        yield both


start = start_sharing_vm


def record_of(c, holder):
    with c.registry.read() as tx:
        return {r.key: r.data for r in tx.runtime(NVME, SHARE_RECORD)}.get(vm_share(holder))


def extent(share) -> set[int]:
    return set(range(share.lba_offset, share.lba_offset + share.blocks))


def test_the_guest_reads_its_disk_back_after_an_unplugged_move(setup):
    c, drive = setup
    sa, da, qa = start(c, drive, "sa", "gamma")
    _sb, db, qb = start(c, drive, "sb", "gamma")
    _sc, dc, qc = start(c, drive, "sc", "beta")
    assert da.write(qa, 0, DISK).ok and da.write(qa, 64, b"e" * 512).ok
    for d, q, b in ((db, qb, b"b"), (dc, qc, b"c")):
        assert d.write(q, 0, b * 4096).ok
    share = drive.manager.book.shares["vm:gamma/sa"]
    steps: list[str] = []
    others: list[set[int]] = []

    def check(step: str) -> None:
        found = check_with_registry(c.hw, c.registry)
        assert found == [], f"after {step}:\n" + "\n".join(map(str, found))
        steps.append(step)
        # sa's blocks are allocated at every step: on the drive and in the registry
        mine = [s for n, s in drive.manager.book.shares.items() if n.endswith("/sa")]
        assert [extent(s) for s in mine] == [extent(share)], step
        if step in ("unplugged", "handed over", "migrated"):  # another VM asks meanwhile
            got = ledger.reserve_share(c.registry, NVME, Holder("alpha", f"x{step}"), 1, 4096)
            others.append(extent(got))

    done = unplug_migrate(sa, c.fabric("beta"), c.registry, check=check)
    assert steps == [
        "claimed",
        "unplugged",
        "handed over",
        "migrated",
        "source released",
        "plugged back",
    ]
    assert len(others) == 3 and all(not (o & extent(share)) for o in others)
    assert sa.node == "beta" and sa.shares() == [NVME] and done.epochs == {NVME: 1}
    moved = drive.manager.book.shares["vm:beta/sa"]
    assert "vm:gamma/sa" not in drive.manager.book.shares
    assert (moved.qid_base, moved.lba_offset, moved.blocks, moved.asid) == (
        share.qid_base,
        share.lba_offset,
        share.blocks,
        share.asid,
    )
    dst = Holder("beta", "sa", sa.holder.vm_uuid)
    rec = record_of(c, dst)
    assert rec is not None and rec["epoch"] == 1 and "leaving" not in rec
    assert record_of(c, Holder("gamma", "sa", sa.holder.vm_uuid)) is None
    mdevs = [m for m in c.fabric("beta").mdevs() if m.vm == "sa"]
    assert [(m.node, m.type_id) for m in mdevs] == [("beta", SHARE_MDEV_TYPE)]
    with pytest.raises(FabricError):
        c.hw.guest("gamma", "sa")
    # the guest's driver finds a new controller, starts it, and reads its disk as it left it
    vms = sa.nvme_share(NVME)
    vms.set_master()
    guest = c.hw.guest("beta", "sa")
    again = guest_driver(vms.bar0, guest)
    (q,) = again.start(queues=1)
    status, data = again.read(q, 0, 8)
    assert status.ok and data == DISK
    assert again.read(q, 64, 1)[1] == b"e" * 512
    assert again.write(q, 8, b"z" * 4096).ok and again.read(q, 8, 8)[1] == b"z" * 4096
    assert drive.manager.real_queues("vm:beta/sa") == [share.real_qid(1)]
    # the neighbours, untouched
    for d, q2, b in ((db, qb, b"b"), (dc, qc, b"c")):
        assert d.read(q2, 0, 8)[1] == b * 4096
    assert drive.manager.rejections("vm:beta/sa") == 0
    assert check_with_registry(c.hw, c.registry) == []


def test_a_share_plugged_back_under_an_epoch_not_newer_is_refused(setup):
    c, drive = setup
    sa, _da, _qa = start(c, drive, "sa", "gamma")
    gone = unplug_share(drive, sa.share_unplugged(NVME))
    with pytest.raises(StaleTokenError):
        replug_share(drive, gone, "gamma", 0)
    assert "vm:gamma/sa" in drive.manager.book.shares  # still allocated, still its name
    vms = replug_share(drive, gone, "gamma", 1)
    assert vms.epoch == 1 and vms.share.lba_offset == gone.share.lba_offset


def test_no_room_on_the_destination_changes_nothing(setup, monkeypatch):
    c, drive = setup
    sa, da, qa = start(c, drive, "sa", "gamma")
    from vmlend.ledger import sharemove

    def full(*_a, **_k):
        raise FabricError("no room")

    monkeypatch.setattr(sharemove, "check_share_claims", full)
    with pytest.raises(FabricError, match="share of 0x12: no room"):
        unplug_migrate(sa, c.fabric("beta"), c.registry)
    assert sa.node == "gamma" and sa.shares() == [NVME]
    assert "incoming" not in record_of(c, sa.holder)
    assert da.write(qa, 0, b"k" * 512).ok and da.read(qa, 0, 1)[1] == b"k" * 512
    assert check_with_registry(c.hw, c.registry) == []


def test_a_move_to_the_lender_where_no_vm_shares_the_drive_yet(setup):
    """The destination has no mdev parent of the drive yet (it is made first), and a VM on
    the lender reaches its share without crossing an NTB."""
    c, drive = setup
    sa, da, qa = start(c, drive, "sa", "gamma")
    assert da.write(qa, 3, DISK).ok
    done = unplug_migrate(sa, c.fabric("alpha"), c.registry, check=lambda _s: None)
    assert done.epochs == {NVME: 1} and check_with_registry(c.hw, c.registry) == []
    assert [m.node for m in c.fabric("alpha").mdevs() if m.vm == "sa"] == ["alpha"]
    vms = sa.nvme_share(NVME)
    vms.set_master()
    again = guest_driver(vms.bar0, c.hw.guest("alpha", "sa"))
    (q,) = again.start(queues=1)
    assert again.read(q, 3, 8)[1] == DISK


def test_a_share_of_two_paths_moves_unplugged_its_relay_made_again_there(state_path, tmp_path):
    """Its relay rings lived in gamma's memory: they are freed there and made again in
    beta's (beta has two adapters here); the guest's disk follows, both paths work."""
    c = Cluster.create(state_path, two_adapter_topology())
    ledger.lend_shared(c.registry, NVME, drive_geometry(c.hw.device(NVME).spec, BLOCKS))
    drive = SharedNvmeDrive(c.hw, NVME, tmp_path, blocks=BLOCKS)
    try:
        xml = share_xml("sa", paths=2)
        c.prepare(xml, "gamma")
        sa = SimVm(xml, hardware=c.hw, fabric=c.fabric("gamma"), nvme={NVME: drive})
        vms = sa.nvme_share(NVME)
        vms.set_master()
        da = guest_driver(vms.bar0, sa.guest)
        (qa,) = da.start(queues=1)
        assert da.write(qa, 0, DISK).ok
        was = vms.share
        assert vms.rings is not None
        rings = list(vms.rings.frames)
        gamma = c.hw.node("gamma").memory
        assert {gamma.owner_of(f) for f in rings} == {"sa"}
        unplug_migrate(sa, c.fabric("beta"), c.registry, check=checker_of(c))
        assert vms.rings is None and {gamma.owner_of(f) for f in rings} == {None}
        moved = sa.nvme_share(NVME)
        assert moved.relay is not None and moved.share.paths == 2
        assert (moved.share.lba_offset, moved.share.backup_asid) == (
            was.lba_offset,
            was.backup_asid,
        )
        assert moved.rings is not None and len(moved.rings.frames) == len(rings)
        beta = c.hw.node("beta").memory
        assert {beta.owner_of(f) for f in moved.rings.frames} == {"sa"}
        moved.set_master()
        again = guest_driver(moved.bar0, c.hw.guest("beta", "sa"))
        (q,) = again.start(queues=1)
        assert again.read(q, 0, 8)[1] == DISK
        assert check_with_registry(c.hw, c.registry) == []
    finally:
        drive.close()
        c.close()


def checker_of(c):
    def check(step: str) -> None:
        found = check_with_registry(c.hw, c.registry)
        assert found == [], f"after {step}:\n" + "\n".join(map(str, found))

    return check
