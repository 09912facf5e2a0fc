"""Hot migration of a VM with a queue-level NVMe share (``vmlend.sim.hotmig``,
``SharedNvmeDrive.move_share``): VM "sa" on gamma moves to beta while "sb" (gamma) and "sc"
(beta) share the same drive. Proof by data: a read the drive DMAs into sa's RAM during the
pre-copy lands in beta's copy, sa's later commands land in beta's RAM and not in gamma's, its
queues and blocks are the same; sb and sc keep working, each into its own RAM. The checker
holds after every phase; the registry's share, its mdev and its claims follow the VM under a
newer epoch, and the source's claims go."""

from __future__ import annotations

import pytest

from tests.support.nvme_guest import shared_drive, start_sharing_vm
from vmlend.errors import FabricError, StaleTokenError
from vmlend.ledger.admission import vm_share
from vmlend.ledger.nvmeadmit import share_window_key
from vmlend.ledger.nvmeshares import SHARE_RECORD
from vmlend.ledger.shareops import SHARE_MDEV_TYPE
from vmlend.sim.hotmig import hot_migrate
from vmlend.sim.invariants import check_with_registry
from vmlend.topology.model import Holder, MiB

NVME = 0x12
BLOCKS = 1 << 20


@pytest.fixture
def setup(state_path, tmp_path):
    with shared_drive(state_path, tmp_path, fdid=NVME, blocks=BLOCKS) as both:
        yield both


start = start_sharing_vm


def checker(c, steps):
    def check(step: str) -> None:
        found = check_with_registry(c.hw, c.registry)
        assert found == [], f"after {step}:\n" + "\n".join(map(str, found))
        steps.append(step)

    return check


def record_of(c, holder):
    with c.registry.read() as tx:
        return {r.key: r.data for r in tx.runtime(NVME, SHARE_RECORD)}.get(vm_share(holder))


def share_keys(c):
    with c.registry.read() as tx:
        return sorted({cl.share for f, cl in tx.claims() if f == NVME})


PRECOPY = b"P" * 4096


def in_ram(guest, data: bytes) -> bool:
    """Whether the guest drivers' queue and buffer area holds ``data``."""
    return data in guest.read(16 * MiB, 16 * MiB)


def test_a_share_follows_its_vm_hot_and_its_neighbours_keep_working(setup):
    c, drive = setup
    sa, da, qa = start(c, drive, "sa", "gamma")
    sb, db, qb = start(c, drive, "sb", "gamma")
    sc, dc, qc = start(c, drive, "sc", "beta")
    for d, q, b in ((da, qa, b"a"), (db, qb, b"b"), (dc, qc, b"c")):
        assert d.write(q, 0, b * 4096).ok
    share = drive.manager.book.shares["vm:gamma/sa"]
    # on the disk only: sa's RAM gets it from the drive's DMA during the copy, nowhere else
    drive.namespace.write(share.lba_offset + 32, PRECOPY)
    assert not in_ram(c.hw.guest("gamma", "sa"), PRECOPY)

    def workload(n: int) -> None:
        if n == 1:  # after the first full copy: only the drive's dirty log knows
            status, data = da.read(qa, 32, 8)
            assert status.ok and data == PRECOPY

    steps: list[str] = []
    done = hot_migrate(
        sa, c.fabric("beta"), c.registry, workload=workload, check=checker(c, steps)
    )
    assert steps[:2] == ["claimed", "incoming"]
    assert steps[-3:] == ["switched", "source released", "resumed"]
    assert done.dma_pages >= 1  # the read's pages came from the drive's ingress dirty log
    assert sa.node == "beta" and sa.shares() == [NVME]
    # the same share (queues, blocks, address space), under beta's name and a newer epoch
    moved = drive.manager.book.shares["vm:beta/sa"]
    assert "vm:gamma/sa" not in drive.manager.book.shares
    assert (moved.qid_base, moved.lba_offset, moved.asid) == (
        share.qid_base,
        share.lba_offset,
        share.asid,
    )
    assert drive.manager.real_queues("vm:beta/sa") == [share.real_qid(1)]
    assert done.tokens[NVME] == 1 and NVME in done.blackout
    dst = Holder("beta", "sa", sa.holder.vm_uuid)
    rec = record_of(c, dst)
    assert rec is not None and rec["epoch"] == 1 and "leaving" not in rec
    assert record_of(c, Holder("gamma", "sa")) is None
    mdevs = [m for m in c.fabric("beta").mdevs() if m.vm == "sa"]
    assert [(m.node, m.type_id) for m in mdevs] == [("beta", SHARE_MDEV_TYPE)]
    keys = share_keys(c)
    assert share_window_key(NVME, dst) in keys
    assert share_window_key(NVME, Holder("gamma", "sa")) not in keys
    # the read during the copy is in beta's RAM
    guest = c.hw.guest("beta", "sa")
    assert in_ram(guest, PRECOPY)
    da.memory = guest  # the guest's own driver runs on beta now, on its copied RAM
    status, data = da.read(qa, 0, 8)
    assert status.ok and data == b"a" * 4096
    # sa's commands after the move go through beta's RAM (gamma's is gone)
    assert da.write(qa, 16, b"z" * 4096).ok
    assert da.read(qa, 16, 8)[1] == b"z" * 4096
    # and its completion interrupts reach its target on beta over the NTB
    moved_share = sa.nvme_share(NVME)
    assert moved_share.interrupt_path() == "ntb"
    assert [(h.stage, h.node) for h in moved_share.last_hops][-1] == ("irq", "beta")
    with pytest.raises(FabricError):
        c.hw.guest("gamma", "sa")
    # the neighbours, untouched: each command completes into its own RAM
    for vm, d, q, b in ((sb, db, qb, b"b"), (sc, dc, qc, b"c")):
        assert d.read(q, 0, 8)[1] == b * 4096
        mark = b.upper() * 4096  # on its blocks of the disk only, until it reads them
        drive.namespace.write(vm.nvme_share(NVME).share.lba_offset + 8, mark)
        own = c.hw.guest(vm.node, vm.name)
        assert not in_ram(own, mark)
        assert d.read(q, 8, 8)[1] == mark and in_ram(own, mark)
        assert not in_ram(guest, mark)  # nothing of theirs reaches sa's RAM
    assert drive.manager.rejections("vm:beta/sa") == 0
    assert check_with_registry(c.hw, c.registry) == []
    # a move under an epoch not newer is refused, nothing changed
    with pytest.raises(StaleTokenError):
        drive.move_share(sa.nvme_share(NVME), "gamma", 1)
    assert sa.nvme_share(NVME).node == "beta"


def test_no_room_for_the_share_on_the_destination_changes_nothing(setup, monkeypatch):
    c, drive = setup
    sa, da, qa = start(c, drive, "sa", "gamma")
    claims_before = share_keys(c)

    from vmlend.ledger import sharemove

    def full(*_a, **_k):
        raise FabricError("no room")

    monkeypatch.setattr(sharemove, "check_share_claims", full)
    with pytest.raises(FabricError, match="share of 0x12: no room"):
        hot_migrate(sa, c.fabric("beta"), c.registry, check=checker(c, []))
    assert sa.node == "gamma" and share_keys(c) == claims_before
    assert record_of(c, Holder("gamma", "sa"))["claims"] and "incoming" not in record_of(
        c, Holder("gamma", "sa")
    )
    assert da.write(qa, 0, b"k" * 512).ok and da.read(qa, 0, 1)[1] == b"k" * 512
    assert check_with_registry(c.hw, c.registry) == []
