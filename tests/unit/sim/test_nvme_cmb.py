"""Queues near the drive: a shared drive's controller memory buffer in lender memory, an extent
of it per share. The guest finds its extent as its own CMB (CAP.CMBS, CMBLOC, CMBSZ), puts its
submission queue there, and the drive fetches each command in the lender, crossing no NTB;
completions still land in guest RAM. One share never reaches another's extent, a full CMB
refuses the next share with nothing left behind, and a share's end returns its extent. After
every step the fabric's invariants hold (the checker also checks each mapped extent against the
share's claimed one)."""

from __future__ import annotations

import pytest

from tests.support.nvme_guest import guest_driver
from vmlend.errors import CmbFullError, ConfigError, DmaFault
from vmlend.nvme import cmb, spec
from vmlend.nvme.guard import asid_base
from vmlend.sim.hardware import SimHardware
from vmlend.sim.hostmem import FRAME
from vmlend.sim.invariants import ShareGrant, check_hardware
from vmlend.sim.nvme.cmb import GuestWithCmb
from vmlend.sim.nvme.driver import NvmeDriver, QueuePair
from vmlend.sim.nvmeshare import SharedNvmeDrive, VmNvmeShare
from vmlend.sim.nvmetopology import SHARED_NVME, sharing_topology
from vmlend.topology.model import GuestRange, MiB
from vmlend.topology.parse import parse_topology

BLOCKS = 1 << 20
EXTENT = 64 * 1024  # one queue pair's extent: 1024 entries (CAP.MQES + 1) of 64 bytes
ENTRIES = 16


@pytest.fixture
def hw():
    return SimHardware.from_topology(parse_topology(sharing_topology(3)), seed=3)


def holds(hw, drive=None):
    found = check_hardware(hw, shares=drive.grants() if drive is not None else ())
    assert not found, "\n".join(map(str, found))


def make_drive(hw, tmp_path, cmb_bytes):
    d = SharedNvmeDrive(hw, SHARED_NVME, tmp_path, blocks=BLOCKS, cmb_bytes=cmb_bytes)
    holds(hw, d)
    return d


def boot_cmb(hw, drive, node, vm) -> tuple[VmNvmeShare, NvmeDriver, QueuePair]:
    """A guest whose one I/O submission queue is in its CMB, its completion queue in RAM."""
    guest = hw.create_guest(node, vm, [GuestRange(0, 64 * MiB)])
    share = drive.open_share(node, vm, 1, 4096)
    share.set_master()
    holds(hw, drive)
    assert share.cmb is not None
    drv = guest_driver(share.bar0, guest)
    drv.memory = GuestWithCmb(guest, share.cmb)
    drv.reset()
    drv.enable()
    drv.identify_namespace(1)
    assert drv.set_queue_count(1) == 1
    qp = drv.create_queue_pair_at(
        1, cmb.GUEST_CMB_BASE, drv.alloc(ENTRIES * spec.CQE_SIZE), ENTRIES, vector=1
    )
    holds(hw, drive)
    return share, drv, qp


def test_the_guest_sees_its_extent_as_a_cmb_of_submission_queues(hw, tmp_path):
    drive = make_drive(hw, tmp_path, 4 * EXTENT)
    hw.create_guest("b1", "vm-a", [GuestRange(0, 64 * MiB)])
    share = drive.open_share("b1", "vm-a", 1, 4096)
    bar = share.bar0
    assert bar.read(spec.REG_CAP, 8) & cmb.CAP_CMBS
    size, sqs = cmb.decode_cmbsz(bar.read(cmb.REG_CMBSZ, 4))
    assert (size, sqs) == (EXTENT, True) == (share.share.cmb_bytes, True)
    assert not bar.read(cmb.REG_CMBSZ, 4) & cmb.CMBSZ_CQS  # completions stay in RAM
    assert cmb.decode_cmbloc(bar.read(cmb.REG_CMBLOC, 4)) == (cmb.CMB_BAR, 0)
    bar.write(cmb.REG_CMBSZ, 4, 0)  # read-only
    assert cmb.decode_cmbsz(bar.read(cmb.REG_CMBSZ, 4))[0] == EXTENT
    drive.close()


def test_a_drive_without_cmb_advertises_none(hw, tmp_path):
    drive = make_drive(hw, tmp_path, 0)
    hw.create_guest("b1", "vm-a", [GuestRange(0, 64 * MiB)])
    share = drive.open_share("b1", "vm-a", 1, 4096)
    assert share.cmb is None and share.share.cmb_extent is None
    assert not share.bar0.read(spec.REG_CAP, 8) & cmb.CAP_CMBS
    assert share.bar0.read(cmb.REG_CMBSZ, 4) == 0
    drive.close()


def test_a_command_in_the_cmb_is_fetched_in_the_lender_and_completes_into_guest_ram(
    hw, tmp_path
):
    drive = make_drive(hw, tmp_path, 4 * EXTENT)
    share, drv, qp = boot_cmb(hw, drive, "b1", "vm-a")
    data = b"near the drive".ljust(4096, b"\x00")
    assert drv.write(qp, 8, data).ok
    done, got = drv.read(qp, 8, 8)
    assert done.ok and got == data
    holds(hw, drive)
    base = asid_base(share.share.asid)
    # the fetch: the drive's read of its SQ ends in lender RAM, no NTB crossed
    fetch = hw.resolve_dma(SHARED_NVME, base + qp.sq)
    lender = drive.device.lender
    assert (fetch.kind, fetch.node, fetch.crossed_ntb) == ("ram", lender, False)
    assert fetch.address in drive.cmb_frames()
    # the completion: a posted write through the NTB into the guest's RAM
    completion = hw.resolve_dma(SHARED_NVME, base + qp.cq, write=True)
    assert (completion.node, completion.owner, completion.crossed_ntb) == ("b1", "vm-a", True)
    # the commands are in the lender's memory, not in the guest's
    raw = drive.cmb.memory.read(fetch.address, spec.SQE_SIZE)  # type: ignore[union-attr]
    assert spec.Command.decode(raw).opcode in (spec.IO_READ, spec.IO_WRITE)
    # the guest's CPU wrote them through its adapter and the lender's (posted writes)
    access = share.cmb.resolve(0, spec.SQE_SIZE)  # type: ignore[union-attr]
    assert access.crossed_ntb and [h.stage for h in access.hops] == [
        "cpu",
        "borrower-adapter",
        "lender-adapter",
        "ram",
    ]
    drive.close()
    holds(hw)


def test_a_guest_ram_queue_still_crosses_the_ntb(hw, tmp_path):
    """The other way, on the same drive: an SQ in guest RAM is fetched across the NTB."""
    drive = make_drive(hw, tmp_path, 4 * EXTENT)
    hw.create_guest("b1", "vm-a", [GuestRange(0, 64 * MiB)])
    share = drive.open_share("b1", "vm-a", 1, 4096)
    share.set_master()
    drv = guest_driver(share.bar0, hw.guest("b1", "vm-a"))
    (qp,) = drv.start(queues=1, entries=ENTRIES)
    assert drv.write(qp, 0, b"\x01" * 512).ok
    fetch = hw.resolve_dma(SHARED_NVME, asid_base(share.share.asid) + qp.sq)
    assert (fetch.node, fetch.crossed_ntb) == ("b1", True)
    drive.close()


def test_one_share_never_reaches_another_share_s_extent(hw, tmp_path):
    drive = make_drive(hw, tmp_path, 4 * EXTENT)
    a, da, qa = boot_cmb(hw, drive, "b1", "vm-a")
    b, db, qb = boot_cmb(hw, drive, "b2", "vm-b")
    assert a.share.cmb_extent != b.share.cmb_extent
    assert da.write(qa, 0, b"\xaa" * 512).ok and db.write(qb, 0, b"\xbb" * 512).ok
    assert a.cmb is not None and b.cmb is not None
    b_before = b.cmb.read(0, b.cmb.size)
    # the guest's CPU: its window ends with its extent, faulting at the first hop
    with pytest.raises(DmaFault) as fault:
        a.cmb.write(a.cmb.size, b"\xee" * spec.SQE_SIZE)
    assert fault.value.hop == "cmb"
    with pytest.raises(DmaFault):
        a.cmb.read(-spec.SQE_SIZE, spec.SQE_SIZE)
    with pytest.raises(DmaFault):  # a write straddling its end writes nothing at all
        a.cmb.write(a.cmb.size - 8, b"\xee" * 16)
    assert b.cmb.read(0, b.cmb.size) == b_before
    # the drive: past its extent, the share's address space maps nothing of the CMB
    past = asid_base(a.share.asid) + cmb.GUEST_CMB_BASE + a.share.cmb_bytes
    with pytest.raises(DmaFault) as fault:
        hw.resolve_dma(SHARED_NVME, past)
    assert fault.value.hop == "lender-iommu"
    b_frames = set(drive.cmb.extent_frames(*b.share.cmb_extent))  # type: ignore[union-attr,misc]
    for m in hw.lender_domain(SHARED_NVME).mappings():
        if m.iova >> 47 == a.share.asid:
            assert not any(m.phys <= f < m.phys + m.size for f in b_frames), m
    # the guest asking for a queue that leaves its extent is refused by its controller
    done = da.admin_command(
        spec.Command(
            spec.ADMIN_CREATE_SQ,
            prp1=cmb.GUEST_CMB_BASE + a.share.cmb_bytes - spec.PAGE,
            cdw10=(128 - 1) << 16 | 1,  # 8 KiB of entries from its last 4 KiB page
            cdw11=spec.QUEUE_PHYS_CONTIG | 1 << 16,
        ),
        "create SQ past its extent",
        check=False,
    )
    assert done.status == spec.SC_INVALID_FIELD
    holds(hw, drive)
    drive.close()


def test_a_completion_queue_in_the_cmb_is_refused(hw, tmp_path):
    drive = make_drive(hw, tmp_path, 4 * EXTENT)
    hw.create_guest("b1", "vm-a", [GuestRange(0, 64 * MiB)])
    share = drive.open_share("b1", "vm-a", 1, 4096)
    share.set_master()
    drv = guest_driver(share.bar0, hw.guest("b1", "vm-a"))
    drv.reset()
    drv.enable()
    drv.set_queue_count(1)
    done = drv.admin_command(
        spec.Command(
            spec.ADMIN_CREATE_CQ,
            prp1=cmb.GUEST_CMB_BASE,
            cdw10=(ENTRIES - 1) << 16 | 1,
            cdw11=spec.QUEUE_PHYS_CONTIG | spec.CQ_IRQ_ENABLED | 1 << 16,
        ),
        "create CQ in the CMB",
        check=False,
    )
    assert done.status == spec.SC_INVALID_FIELD
    drive.close()


def test_no_room_in_the_cmb_refuses_the_share_and_leaves_nothing(hw, tmp_path):
    drive = make_drive(hw, tmp_path, EXTENT)
    a, _da, _qa = boot_cmb(hw, drive, "b1", "vm-a")
    hw.create_guest("b2", "vm-b", [GuestRange(0, 64 * MiB)])
    before = (
        drive.manager.book.free_queue_pairs(),
        sorted(drive.shares),
        hw.share_wiring(),
        list(hw.lender_domain(SHARED_NVME).mappings()),
    )
    with pytest.raises(CmbFullError) as refused:
        drive.open_share("b2", "vm-b", 1, 4096)
    message = str(refused.value)
    assert "\n" not in message
    assert "controller memory buffer" in message and "release a share" in message
    assert "--cmb" in message
    after = (
        drive.manager.book.free_queue_pairs(),
        sorted(drive.shares),
        hw.share_wiring(),
        list(hw.lender_domain(SHARED_NVME).mappings()),
    )
    assert after == before
    holds(hw, drive)
    assert a.open
    drive.close()


def test_a_share_s_end_returns_its_extent_wiped(hw, tmp_path):
    drive = make_drive(hw, tmp_path, EXTENT)
    a, da, qa = boot_cmb(hw, drive, "b1", "vm-a")
    for lba in range(3):  # three commands in a's queue, where b will write one
        assert da.write(qa, lba, b"\x5a" * 512).ok
    extent = a.share.cmb_extent
    a_space = a.share.asid
    a.close()
    holds(hw, drive)
    # nothing of the CMB stays mapped in the ended share's address space
    assert not [m for m in hw.lender_domain(SHARED_NVME).mappings() if m.iova >> 47 == a_space]
    b, db, qb = boot_cmb(hw, drive, "b2", "vm-b")
    assert b.share.cmb_extent == extent  # the same extent, free again
    assert b.cmb is not None
    assert db.write(qb, 0, b"\x11" * 512).ok
    # what a left in it is gone: only b's commands are there
    raw = b.cmb.read(0, b.cmb.size)
    used = [raw[i : i + spec.SQE_SIZE] for i in range(0, len(raw), spec.SQE_SIZE)]
    assert sum(1 for e in used if any(e)) == qb.sq_tail
    drive.close()
    holds(hw)


def test_the_cmb_goes_with_the_drive(hw, tmp_path):
    drive = make_drive(hw, tmp_path, 4 * EXTENT)
    lender = hw.node(drive.device.lender).memory
    frames = drive.cmb_frames()
    assert len(frames) == 4 * EXTENT // FRAME
    assert all(lender.owner_of(f) for f in frames)
    drive.close()
    assert not any(lender.owner_of(f) for f in frames)


def test_a_bad_cmb_size_is_refused_before_anything_is_taken(hw, tmp_path):
    with pytest.raises(ConfigError, match="--cmb"):
        SharedNvmeDrive(hw, SHARED_NVME, tmp_path, blocks=BLOCKS, cmb_bytes=1000)
    assert hw.borrowed(SHARED_NVME) is None


def test_the_checker_finds_an_extent_mapped_into_another_share(hw, tmp_path):
    drive = make_drive(hw, tmp_path, 4 * EXTENT)
    a, _da, _qa = boot_cmb(hw, drive, "b1", "vm-a")
    b, _db, _qb = boot_cmb(hw, drive, "b2", "vm-b")
    b_frame = drive.cmb.extent_frames(*b.share.cmb_extent)[0]  # type: ignore[union-attr,misc]
    iova = asid_base(a.share.asid) + cmb.GUEST_CMB_BASE + 0x100000
    domain = hw.lender_domain(SHARED_NVME)
    domain.map(iova, b_frame, FRAME)
    found = check_hardware(hw, shares=drive.grants())
    assert any(v.kind == "cmb" and "outside its extent" in v.detail for v in found), found
    domain.unmap(iova, FRAME)
    holds(hw, drive)
    drive.close()


def test_the_checker_finds_a_mapped_extent_other_than_the_claimed_one(hw, tmp_path):
    drive = make_drive(hw, tmp_path, 4 * EXTENT)
    a, _da, _qa = boot_cmb(hw, drive, "b1", "vm-a")
    grants = drive.grants()
    assert a.share.cmb_extent is not None
    offset, size = a.share.cmb_extent
    smaller = [
        ShareGrant(g.fdid, g.node, g.vm, g.asid, g.backup, (offset, size // 2))
        if g.vm == "vm-a"
        else g
        for g in grants
    ]
    found = check_hardware(hw, shares=smaller)
    assert any(v.kind == "cmb" for v in found), found
    overlapping = [*grants, ShareGrant(SHARED_NVME, "b2", "vm-b", 99, cmb=(offset, FRAME))]
    found = check_hardware(hw, shares=overlapping)
    assert any(v.kind == "cmb" and "overlaps" in v.detail for v in found), found
    drive.close()


def test_the_checker_finds_a_window_onto_another_share_s_extent(hw, tmp_path):
    drive = make_drive(hw, tmp_path, 4 * EXTENT)
    a, _da, _qa = boot_cmb(hw, drive, "b1", "vm-a")
    b, _db, _qb = boot_cmb(hw, drive, "b2", "vm-b")
    assert a.cmb is not None and b.cmb is not None
    mine = a.cmb.frames
    a.cmb.frames = b.cmb.frames  # a's CPU would now write into b's queue
    found = check_hardware(hw, shares=drive.grants())
    assert any(v.kind == "cmb" and "CMB window of b1/vm-a" in v.where for v in found), found
    a.cmb.frames = mine
    holds(hw, drive)
    without_a = [g for g in drive.grants() if g.vm != "vm-a"]
    found = check_hardware(hw, shares=without_a)
    assert any(v.kind == "cmb" and "no current share" in v.detail for v in found), found
    drive.close()


def test_a_share_moved_hot_reaches_its_extent_from_its_new_node(hw, tmp_path):
    """After a hot move the guest's CPU reaches its CMB extent through the destination's
    adapter: its commands still complete, and a dead cable of the new route (not the old
    one) cuts its CMB writes."""
    drive = make_drive(hw, tmp_path, 4 * EXTENT)
    share, drv, qp = boot_cmb(hw, drive, "b1", "vm-a")
    data = b"before the move".ljust(4096, b"\x00")
    assert drv.write(qp, 8, data).ok
    before = share.doorbell_route()
    there = hw.create_guest("b2", "vm-a", [GuestRange(0, 64 * MiB)])
    there.write(0, hw.guest("b1", "vm-a").read(0, 64 * MiB))  # the migration's copy
    drive.move_share(share, "b2", 1)
    holds(hw, drive)
    assert share.cmb is not None and share.cmb.node == "b2"
    access = share.cmb.resolve(0, spec.SQE_SIZE)
    assert [h.node for h in access.hops][:2] == ["b2", "b2"]  # cpu, borrower adapter
    drv.memory = GuestWithCmb(there, share.cmb)
    done, got = drv.read(qp, 8, 8)
    assert done.ok and got == data
    route = share.doorbell_route()
    assert before is not None and route is not None
    (b1_only,) = set(before.links) - set(route.links)
    (b2_only,) = set(route.links) - set(before.links)
    hw.link_down(b1_only)  # the old route's own cable: nothing of the share's goes there now
    assert share.cmb.resolve(0, spec.SQE_SIZE).node == drive.device.lender
    hw.link_down(b2_only)
    with pytest.raises(DmaFault) as e:
        share.cmb.resolve(0, spec.SQE_SIZE)
    assert e.value.hop == "link-down"
    drive.close()
