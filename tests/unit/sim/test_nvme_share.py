"""One NVMe drive shared by VMs on different borrowers at the queue level: each VM's guest
driver sees a standard controller with one namespace of its share's size; its I/O queues live
in its own RAM and are fetched by the drive through its DMA windows; the guard keeps each VM
inside its LBA window. After every step the fabric's invariants hold with the open shares as
the only justification of the drive's shared mappings."""

from __future__ import annotations

import threading

import pytest

from tests.support.nvme_guest import guest_driver
from vmlend.errors import (
    ConfigError,
    DeviceHeldError,
    DmaFault,
    FabricError,
    ResourceExhaustedError,
)
from vmlend.nvme import spec
from vmlend.nvme.guard import asid_base
from vmlend.nvme.shares import PAGE_MODE, TRAP_MODE
from vmlend.sim.hardware import SimHardware
from vmlend.sim.invariants import ShareGrant, check_hardware
from vmlend.sim.nvme.controller import ControllerConfig
from vmlend.sim.nvme.driver import NvmeTimeoutError
from vmlend.sim.nvmeshare import SharedNvmeDrive
from vmlend.sim.nvmetopology import SHARED_NVME, sharing_topology
from vmlend.topology.model import GuestRange, MiB
from vmlend.topology.parse import load_topology, parse_topology

BLOCKS = 1 << 20  # 512 MiB namespace


@pytest.fixture
def hw():
    return SimHardware.from_topology(parse_topology(sharing_topology(3)), seed=3)


def holds(hw, drive=None):
    """The fabric's invariants, each mapping of the drive's shares justified by an open one."""
    found = check_hardware(hw, shares=drive.grants() if drive is not None else ())
    assert not found, "\n".join(map(str, found))


@pytest.fixture
def drive(hw, tmp_path):
    d = SharedNvmeDrive(hw, SHARED_NVME, tmp_path, blocks=BLOCKS)
    holds(hw, d)
    yield d
    holds(hw, d)
    d.close()
    holds(hw)


def boot(hw, drive, node, vm, *, ram=64 * MiB, pairs=2, blocks=4096):
    hw.create_guest(node, vm, [GuestRange(0, ram)])
    share = drive.open_share(node, vm, pairs, blocks)
    holds(hw, drive)
    share.set_master()  # the guest driver's pci_set_master: the share's windows are mapped
    holds(hw, drive)
    drv = guest_driver(share.bar0, hw.guest(node, vm))
    queues = drv.start(queues=pairs, entries=16)
    holds(hw, drive)
    return share, drv, queues


def test_each_vm_sees_a_controller_of_its_share(hw, drive):
    assert drive.mode == PAGE_MODE
    a, da, qa = boot(hw, drive, "b1", "vm-a", pairs=2, blocks=4096)
    b, db, qb = boot(hw, drive, "b2", "vm-b", pairs=3, blocks=8192)
    assert da.identify_namespace(1) == (4096, 512) and db.identify_namespace(1) == (8192, 512)
    assert da.active_namespaces() == [1]
    assert [q.qid for q in qa] == [1, 2] and [q.qid for q in qb] == [1, 2, 3]
    # real queue ids: each share's own doorbell page
    assert drive.manager.real_queues(a.name) == [a.share.real_qid(1), a.share.real_qid(2)]
    assert a.share.page != b.share.page
    windows = sorted([(a.share.lba_offset, 4096), (b.share.lba_offset, 8192)])
    assert windows[0][0] + windows[0][1] <= windows[1][0]


def test_vms_on_two_borrowers_write_and_read_back_concurrently(hw, drive):
    a, da, (qa,) = boot(hw, drive, "b1", "vm-a", pairs=1)
    b, db, (qb,) = boot(hw, drive, "b2", "vm-b", pairs=1)
    errors: list[BaseException] = []

    def work(drv, qp, tag):
        try:
            for i in range(40):
                data = bytes([tag, i]) * (4 * 256)  # 4 blocks, 2 pages
                assert drv.write(qp, 8 * i, data).ok
                done, back = drv.read(qp, 8 * i, 4)
                assert done.ok and back == data
        except BaseException as e:
            errors.append(e)

    threads = [
        threading.Thread(target=work, args=(da, qa, 0xA)),
        threading.Thread(target=work, args=(db, qb, 0xB)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    # both landed in the one namespace, each at its own offset
    ns = drive.namespace
    assert ns.read(a.share.lba_offset + 8, 1)[:2] == bytes([0xA, 1])
    assert ns.read(b.share.lba_offset + 8, 1)[:2] == bytes([0xB, 1])
    # the data crossed the NTB into each VM's own RAM, no software on the I/O doorbells
    assert a.traps == b.traps == 0
    assert a.interrupts[1] >= 80 and b.interrupts[1] >= 80


def test_guard_rejects_lbas_outside_the_window_and_the_neighbour_is_untouched(hw, drive):
    a, da, (qa,) = boot(hw, drive, "b1", "vm-a", pairs=1, blocks=1024)
    b, db, (qb,) = boot(hw, drive, "b2", "vm-b", pairs=1, blocks=1024)
    assert db.write(qb, 0, b"B" * 512).ok
    # A names the LBA just past its window (B's first block if they are adjacent)
    stray = da.write(qa, 1024, b"A" * 512)
    assert stray.status == spec.SC_LBA_OUT_OF_RANGE
    bad = spec.io_command(spec.IO_READ, 500, 1, 1000, 100, prp1=20 * MiB)
    assert da.submit_raw(qa, bad).status == spec.SC_LBA_OUT_OF_RANGE
    assert da.submit_raw(qa, spec.io_command(spec.IO_READ, 501, 2, 0, 1, prp1=20 * MiB)).status == (
        spec.SC_INVALID_NAMESPACE
    )
    assert drive.manager.rejections(a.name) == 3 and drive.manager.rejections(b.name) == 0
    assert db.read(qb, 0, 1)[1] == b"B" * 512
    assert drive.namespace.read(b.share.lba_offset, 1) == b"B" * 512
    assert a.status()["rejections"] == 3


def test_queues_pointed_outside_the_vm_fault_at_the_iommu(hw, drive):
    a, da, (qa, q2) = boot(hw, drive, "b1", "vm-a", ram=64 * MiB, pairs=2)
    b, db, (qb,) = boot(hw, drive, "b2", "vm-b", ram=256 * MiB, pairs=1)
    guest_b = hw.guest("b2", "vm-b")
    guest_b.write(128 * MiB, b"\x5a" * 4096)
    # A re-creates queue pair 2 at 128 MiB: B has RAM there, A does not
    da.delete_queue_pair(q2)
    bad = 128 * MiB
    flags = spec.QUEUE_PHYS_CONTIG | spec.CQ_IRQ_ENABLED
    da.admin_command(
        spec.Command(spec.ADMIN_CREATE_CQ, prp1=bad, cdw10=15 << 16 | 2, cdw11=flags | 2 << 16),
        "create CQ",
    )
    da.admin_command(
        spec.Command(
            spec.ADMIN_CREATE_SQ,
            prp1=bad + 4096,
            cdw10=15 << 16 | 2,
            cdw11=spec.QUEUE_PHYS_CONTIG | 2 << 16,
        ),
        "create SQ",
    )
    a.bar0.write(spec.doorbell_offset(2, False, 0), 4, 1)  # the drive fetches from there
    fault = drive.controller.stats.faults[-1]
    assert isinstance(fault, DmaFault) and fault.hop == "lender-iommu"
    assert drive.controller.sq_stopped(a.share.real_qid(2))
    assert guest_b.read(128 * MiB, 4096) == b"\x5a" * 4096
    # A names B's tagged IOVA directly: outside A's address space, refused by the drive
    theirs = asid_base(b.share.asid) + 20 * MiB
    cmd = spec.io_command(spec.IO_READ, 600, 1, 0, 1, prp1=theirs)
    assert da.submit_raw(qa, cmd).status == spec.SC_DATA_TRANSFER_ERROR
    # B is unaffected
    assert db.write(qb, 1, b"b" * 512).ok and db.read(qb, 1, 1)[1] == b"b" * 512


def test_a_vm_stops_while_the_other_keeps_doing_io(hw, drive):
    a, da, (qa,) = boot(hw, drive, "b1", "vm-a", pairs=1)
    b, db, (qb,) = boot(hw, drive, "b2", "vm-b", pairs=1)
    assert da.write(qa, 0, b"a" * 512).ok and db.write(qb, 0, b"b" * 512).ok
    real_a = a.share.real_qid(1)
    a.close()
    holds(hw, drive)
    hw.destroy_guest("b1", "vm-a")  # its RAM is unpinned: the guest can go
    assert real_a not in drive.controller.queue_ids()
    assert drive.manager.real_queues(b.name) == [b.share.real_qid(1)]
    for i in range(20):
        assert db.write(qb, i, bytes([i]) * 512).ok
        assert db.read(qb, i, 1)[1] == bytes([i]) * 512
    # A's crossing into b1 is gone: its LUT entry and domain were the last users
    assert hw.node("b1").iommu.attached() == {}
    with pytest.raises(FabricError):
        a.bar0.write(spec.doorbell_offset(1, False, 0), 4, 1)
    # its share is free again
    _, dc, (qc,) = boot(hw, drive, "b3", "vm-c", pairs=1)
    assert dc.write(qc, 0, b"c" * 512).ok


def test_doorbells_reach_only_the_vms_own_queue_ids(hw, drive):
    a, _, _ = boot(hw, drive, "b1", "vm-a", pairs=1)
    b, db, (qb,) = boot(hw, drive, "b2", "vm-b", pairs=1)
    db.submit_io(qb, spec.IO_WRITE, 0, 1, b"x" * 512)  # queued by B, not rung yet
    # A rings every doorbell of its page, including B's queue id 1 numbering
    for qid in range(0, 512):
        a.bar0.write(spec.doorbell_offset(qid, False, 0), 4, 1)
    assert drive.controller.queue_ids() == sorted([a.share.real_qid(1), b.share.real_qid(1)])
    assert db.reap(qb) == []  # B's command was not fetched by A's doorbell writes
    db.ring(qb)
    assert [c.ok for c in db.reap(qb)] == [True]


def test_the_manager_refuses_more_than_the_controller_has(hw, tmp_path):
    small = ControllerConfig(queue_pairs=1100, vectors=8, dstrd=0)  # 3 doorbell pages
    drive = SharedNvmeDrive(hw, SHARED_NVME, tmp_path, blocks=BLOCKS, config=small)
    try:
        for vm, node in (("a", "b1"), ("b", "b2")):
            hw.create_guest(node, vm, [GuestRange(0, 64 * MiB)])
        with pytest.raises(ResourceExhaustedError) as e:
            drive.open_share("b1", "a", 600, 10)  # more than a doorbell page holds
        assert "queue pairs" in str(e.value)
        drive.open_share("b1", "a", 5, 10)
        with pytest.raises(ResourceExhaustedError) as e:
            drive.open_share("b2", "b", 3, 10)  # 7 vectors left for I/O, 5 taken
        assert "vectors" in str(e.value)
        with pytest.raises(ResourceExhaustedError) as e:
            drive.open_share("b2", "b", 1, BLOCKS)
        assert "LBA" in str(e.value)
        with pytest.raises(ConfigError):
            drive.open_share("b2", "b", 0, 10)
        assert not hw.node("b2").iommu.attached()  # refusals mapped nothing
        drive.open_share("b2", "b", 2, 10)
        hw.create_guest("b3", "c", [GuestRange(0, 64 * MiB)])
        with pytest.raises(ResourceExhaustedError) as e:
            drive.open_share("b3", "c", 1, 10)  # both shareable doorbell pages are taken
        assert "queue pairs" in str(e.value)
    finally:
        drive.close()


def test_exclusive_and_shared_use_exclude_each_other(hw, tmp_path):
    hw.create_guest("b1", "solo", [GuestRange(0, 64 * MiB)])
    hw.borrow(SHARED_NVME, "b1", "solo")
    with pytest.raises(FabricError, match="exclusively"):
        SharedNvmeDrive(hw, SHARED_NVME, tmp_path)
    hw.give_back(SHARED_NVME)
    drive = SharedNvmeDrive(hw, SHARED_NVME, tmp_path, blocks=BLOCKS)
    try:
        with pytest.raises(DeviceHeldError):
            hw.borrow(SHARED_NVME, "b1", "solo")
    finally:
        drive.close()
    assert hw.borrowed(SHARED_NVME) is None


def test_a_drive_with_one_doorbell_page_traps_the_guest_doorbells(tmp_path):
    hw = SimHardware.from_topology(load_topology(), seed=3)
    drive = SharedNvmeDrive(hw, 0x12, tmp_path, blocks=BLOCKS)  # 16 KiB BAR0, MSI-X at 0x2000
    try:
        assert drive.mode == TRAP_MODE
        a, da, (qa,) = boot(hw, drive, "gamma", "vm-a", pairs=1)
        _, db, (qb,) = boot(hw, drive, "beta", "vm-b", pairs=1)
        before = a.traps
        assert da.write(qa, 3, b"t" * 512).ok and da.read(qa, 3, 1)[1] == b"t" * 512
        assert a.traps - before == 4  # SQ tail + CQ head, per command: one step each
        assert db.write(qb, 3, b"u" * 512).ok
        assert drive.namespace.read(a.share.lba_offset + 3, 1) == b"t" * 512
    finally:
        drive.close()


def test_a_vm_on_the_lender_shares_too(hw, drive):
    _, da, (qa,) = boot(hw, drive, "store", "local", pairs=1)
    _, db, (qb,) = boot(hw, drive, "b1", "remote", pairs=1)
    assert da.write(qa, 0, b"L" * 512).ok and db.write(qb, 0, b"R" * 512).ok
    assert da.read(qa, 0, 1)[1] == b"L" * 512 and db.read(qb, 0, 1)[1] == b"R" * 512


def _fabric_snapshot(hw):
    """What sharing may change in the hardware: LUTs, segments, IOMMU attachments and
    mappings, allocated host memory, borrows."""
    return (
        {a.ref: dict(a.lut()) for a in hw.adapters()},
        {a.ref: len(a.mapped_segments()) for a in hw.adapters()},
        {n: dict(hw.node(n).iommu.attached()) for n in hw.nodes},
        hw.lender_domain(SHARED_NVME).mappings(),
        {n: hw.node(n).memory.allocated_bytes for n in hw.nodes},
        hw.borrows(),
    )


def test_closing_the_drive_leaves_the_fabric_as_it_was(hw, tmp_path):
    before = _fabric_snapshot(hw)
    drive = SharedNvmeDrive(hw, SHARED_NVME, tmp_path, blocks=BLOCKS)
    for i, node in enumerate(("b1", "b1", "b2", "store")):  # two VMs on b1 share its crossing
        _, drv, (qp,) = boot(hw, drive, node, f"vm{i}", pairs=1)
        assert drv.write(qp, 0, b"z" * 512).ok
    first = drive.shares["vm:b1/vm0"]
    first.close()
    holds(hw, drive)
    hw.destroy_guest("b1", "vm0")
    assert hw.node("b1").iommu.attached(), "vm1 on b1 still needs the crossing"
    drive.close()
    holds(hw)
    for node, vm in (("b1", "vm1"), ("b2", "vm2"), ("store", "vm3")):
        hw.destroy_guest(node, vm)
    assert _fabric_snapshot(hw) == before
    assert hw.device(SHARED_NVME).resets >= 1  # given back clean


def test_a_manager_that_cannot_start_leaves_nothing_behind(hw, tmp_path, monkeypatch):
    from vmlend.sim.nvme.manager import NvmeManager

    before = _fabric_snapshot(hw)

    def broken(self):
        raise FabricError("the controller did not become ready")

    monkeypatch.setattr(NvmeManager, "start", broken)
    with pytest.raises(FabricError, match="ready"):
        SharedNvmeDrive(hw, SHARED_NVME, tmp_path, blocks=BLOCKS)
    assert _fabric_snapshot(hw) == before
    assert hw.borrowed(SHARED_NVME) is None
    assert hw.device(SHARED_NVME).raise_interrupt(1) == 0  # the manager's sink is gone too


def _sticky(domain, asid):
    """Make ``domain`` forget to unmap anything of address space ``asid``: a stale mapping."""
    unmap = domain.unmap

    def forgetful(iova, size):
        if iova >> 47 != asid:
            unmap(iova, size)

    domain.unmap = forgetful


@pytest.mark.parametrize("where", ["lender", "ingress"])
def test_the_checker_catches_a_mapping_a_closed_share_left_behind(hw, tmp_path, where):
    drive = SharedNvmeDrive(hw, SHARED_NVME, tmp_path, blocks=BLOCKS)
    try:
        a, _, _ = boot(hw, drive, "b1", "vm-a", pairs=1)
        boot(hw, drive, "b1", "vm-a2", pairs=1)  # keeps the crossing into b1 after A stops
        if where == "lender":
            _sticky(hw.lender_domain(SHARED_NVME), a.share.asid)
            kind, at = "lender-iommu", f"store:dev{SHARED_NVME:#x}"
        else:
            _sticky(next(iter(hw.node("b1").iommu.attached().values())), a.share.asid)
            kind, at = "share-domain", f"b1:nvme{SHARED_NVME:#x}"
        a.close()
        found = check_hardware(hw, shares=drive.grants())
        assert found and {v.kind for v in found} == {kind}, found
        assert all(v.where.startswith(at) for v in found)
        assert f"address space {a.share.asid} " in found[0].detail
    finally:
        drive.close()


def test_a_share_justifies_only_its_own_vm(hw, drive):
    boot(hw, drive, "b1", "vm-a", pairs=1)
    boot(hw, drive, "b2", "vm-b", pairs=1)
    # A's address space claimed for another VM: its mappings reach RAM that is not that VM's
    wrong = [
        g if g.vm != "vm-a" else ShareGrant(g.fdid, g.node, "vm-x", g.asid) for g in drive.grants()
    ]
    found = check_hardware(hw, shares=wrong)
    windows = [v for v in found if v.kind == "ntb-segment" and "window of" in v.where]
    mapped = [v for v in found if v.kind != "share-wire" and v not in windows]
    assert mapped and all("not of vm-x" in v.detail for v in mapped), found
    # its CPU's window onto its doorbell page, in b1's adapter, is no current share's either
    assert [v.where for v in windows] == ["b1:0 doorbell window of b1/vm-a"]
    # and what the manager keeps for A (queues, routes, doorbell page) is nobody's share now
    wires = [v for v in found if v.kind == "share-wire"]
    assert wires and all("b1/vm-a, which has no current share" in v.detail for v in wires)
    assert {v.where.split()[1] for v in wires} >= {"queue", "interrupt-route", "doorbell-page"}
    # without B's share, everything of B's crossing is unjustified, A's still is
    found = check_hardware(hw, shares=[g for g in drive.grants() if g.vm != "vm-b"])
    kinds = {v.kind for v in found}
    assert {"lender-iommu", "share-domain", "lut", "context", "share-wire"} <= kinds
    assert not any(v.where.startswith("b1") for v in found)


def test_a_shares_windows_follow_bus_master_of_its_controller(hw, drive):
    """As for a borrowed device: nothing of the VM is pinned or mapped until its driver sets
    Bus Master on the virtual controller, and clearing it takes the windows away."""
    before = _fabric_snapshot(hw)
    hw.create_guest("b1", "vm-a", [GuestRange(0, 64 * MiB)])
    a = drive.open_share("b1", "vm-a", 1, 4096)
    # a share opened: nothing mapped for DMA, only its CPU's window onto its doorbell page
    luts, segments, *rest = _fabric_snapshot(hw)
    assert a.doorbell_window is not None and len(a.doorbell_window[1]) == 1
    assert (luts, {**segments, "b1:0": segments["b1:0"] - 1}, *rest) == before
    drv = guest_driver(a.bar0, hw.guest("b1", "vm-a"))
    (qp,) = drv.start(queues=1, entries=16)  # admin emulation and queue creation need no DMA
    with pytest.raises(NvmeTimeoutError):  # the drive cannot fetch from the VM's RAM yet
        drv.write(qp, 0, b"a" * 512)
    assert drive.controller.sq_stopped(a.share.real_qid(1))
    assert drive.controller.stats.faults[-1].hop == "lender-iommu"
    holds(hw, drive)
    a.set_master()
    assert hw.node("b1").iommu.attached() and a.config.read(0x04, 2) & 0x4
    holds(hw, drive)
    drv.reset()
    (qp,) = drv.start(queues=1, entries=16)
    assert drv.write(qp, 0, b"a" * 512).ok and drv.read(qp, 0, 1)[1] == b"a" * 512
    a.set_master(False)
    assert not hw.node("b1").iommu.attached()
    assert hw.lender_domain(SHARED_NVME).mappings() == before[3]
    holds(hw, drive)
    a.close()
    hw.destroy_guest("b1", "vm-a")  # unpinned when Bus Master went off
    assert _fabric_snapshot(hw) == before
