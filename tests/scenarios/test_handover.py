"""When a device changes hands, the old owner keeps nothing (docs/simulator.md, "Hand-over").

Each test builds one hand-over the way a user or an attacker would reach it (the lender taking
a shared drive back, a release after a crash, the fabric's give-back, a VM opening another VM's
mdev) and then lets the old owner try what it could do before: ring doorbells, receive
interrupts, read and write config space. The invariant checker runs after each step, with the
registry's holds, claims and shares as the only justification.
"""

from __future__ import annotations

import pytest

from tests.support.nvme_guest import VmBar0, guest_driver, share_xml
from tests.support.simcluster import Cluster, domain_xml
from vmlend.errors import FabricError, MdevError, VmlendError
from vmlend.ledger import nvmeshares as ledger
from vmlend.nvme import spec
from vmlend.sim.hardware import Borrow, OpenMdev
from vmlend.sim.invariants import check_hardware, registry_grants
from vmlend.sim.nvmedrive import drive_geometry
from vmlend.sim.nvmeshare import SharedNvmeDrive
from vmlend.sim.pci import regs
from vmlend.sim.pci.config import MSI_OFFSET, MSIX_OFFSET
from vmlend.sim.simvm import SimVm
from vmlend.topology.model import GiB, Holder

NVME = 0x12
GPU = 0x10
BLOCKS = 1 << 20
ALL_ONES_16 = 0xFFFF


def no_violations(c: Cluster) -> None:
    with c.registry.read() as tx:
        holds, claims, grants = tx.holds(), tx.claims(), registry_grants(tx)
    found = check_hardware(c.hw, holds=holds, claims=claims, shares=grants)
    assert found == [], "\n".join(map(str, found))


@pytest.fixture
def shared(state_path, tmp_path):
    c = Cluster.create(state_path)
    ledger.lend_shared(c.registry, NVME, drive_geometry(c.hw.device(NVME).spec, BLOCKS))
    drive = SharedNvmeDrive(c.hw, NVME, tmp_path, blocks=BLOCKS)
    yield c, drive
    drive.close()
    c.close()


def _share_vm(c: Cluster, drive: SharedNvmeDrive, name: str, node: str):
    xml = share_xml(name)
    c.prepare(xml, node)
    vm = SimVm(xml, hardware=c.hw, fabric=c.fabric(node), nvme={NVME: drive})
    share = vm.nvme_share(NVME)
    share.set_master()
    driver = guest_driver(share.bar0, vm.guest)
    (queue,) = driver.start(queues=1)
    assert driver.write(queue, 0, name.encode() * 512).ok
    return vm, share, driver, queue


def test_reclaim_of_a_shared_drive_ends_every_share_in_the_same_step(shared, monkeypatch):
    c, drive = shared
    _va, a, _da, _qa = _share_vm(c, drive, "sa", "gamma")
    vb, b, _db, _qb = _share_vm(c, drive, "sb", "beta")
    no_violations(c)
    before = dict(b.interrupts)

    manager = c.fabric("alpha").reclaim(NVME)
    assert manager is not None and manager.vm == ledger.MANAGER_VM
    # nothing of any share is left wired: the checker (with the registry's shares) agrees
    no_violations(c)
    assert c.fabric().device(NVME).holder is None
    assert drive.manager.shares() == []

    # the old shares' controllers are gone as after a surprise removal
    for s in (a, b):
        assert s.bar0.read(spec.REG_CSTS, 4) == 0xFFFF_FFFF
        assert s.config.read(regs.COMMAND, 2) == ALL_ONES_16

    # C takes the drive exclusively and finds a reset controller
    xc = domain_xml("c", 1 * GiB, fdids=(NVME,))
    vc = c.start(xc, "gamma")
    vc.enable_device(NVME)
    bar = VmBar0(vc, NVME)
    assert bar.read(spec.REG_CSTS, 4) & spec.CSTS_RDY == 0
    vc.config_write(NVME, MSIX_OFFSET + regs.MSIX_FLAGS, 2, regs.MSIX_FLAGS_ENABLE)
    dc = guest_driver(bar, vc.guest)
    (qc,) = dc.start(queues=1)
    no_violations(c)

    # B rings what were its doorbells (and C's queue's): nothing reaches the drive
    reached: list[tuple[int, int]] = []
    real_write = drive.device.bars.write
    monkeypatch.setattr(
        drive.device.bars,
        "write",
        lambda index, offset, size, value: (
            reached.append((index, offset)),
            real_write(index, offset, size, value),
        ),
    )
    for offset in range(spec.DOORBELL_BASE, spec.DOORBELL_BASE + 64, 4):
        b.bar0.write(offset, 4, 1)
    assert reached == []
    monkeypatch.undo()

    # C's completions interrupt C only
    for i in range(4):
        assert dc.write(qc, i, b"c" * 512).ok
    assert b.interrupts == before
    assert dc.read(qc, 0, 4)[1] == b"c" * 2048
    no_violations(c)

    vb.stop()  # the old share's VM stops cleanly
    vc.stop()
    c.release(xc, "gamma")
    no_violations(c)


def test_lender_down_ends_every_share_of_its_drive(shared):
    c, drive = shared
    _va, a, _da, _qa = _share_vm(c, drive, "sa", "gamma")
    c.fabric().set_node_up("alpha", False, "lost power")
    assert c.hw.borrowed(NVME) is None
    assert a.bar0.read(spec.REG_CSTS, 4) == 0xFFFF_FFFF
    a.bar0.write(spec.DOORBELL_BASE, 4, 1)  # dropped, not an error: the device is gone
    with c.registry.read() as tx:
        holds, claims = tx.holds(), tx.claims()
    assert check_hardware(c.hw, holds=holds, claims=claims) == []


# --- config space of a device that changed hands ----------------------------------------------


@pytest.fixture
def cluster(state_path):
    c = Cluster.create(state_path)
    yield c
    c.close()


def _hand_over(c: Cluster, how: str) -> tuple[SimVm, SimVm]:
    """VM a (gamma) enables the GPU; it leaves a by ``how``; VM b (gamma) takes it over."""
    xa = domain_xml("a", 1 * GiB, fdids=(GPU,))
    a = c.start(xa)
    a.enable_device(GPU)
    a.config_write(GPU, MSI_OFFSET + regs.MSI_FLAGS, 2, regs.MSI_FLAGS_ENABLE)
    fabric = c.fabric()
    if how == "reclaim":
        c.fabric("alpha").reclaim(GPU)
    elif how == "release-after-crash":
        assert fabric.release(GPU, a.holder)
        for m in fabric.mdevs():
            if m.fdid == GPU:
                fabric.remove_mdev(m.uuid)
    elif how == "give-back":
        fabric.give_back(GPU, a.holder)
        fabric.release(GPU, a.holder)
        for m in fabric.mdevs():
            if m.fdid == GPU:
                fabric.remove_mdev(m.uuid)
    else:
        raise AssertionError(how)
    b = c.start(domain_xml("b", 1 * GiB, fdids=(GPU,)))
    b.enable_device(GPU)
    b.config_write(GPU, MSI_OFFSET + regs.MSI_FLAGS, 2, regs.MSI_FLAGS_ENABLE)
    return a, b


@pytest.mark.parametrize("how", ["reclaim", "release-after-crash", "give-back"])
def test_the_old_session_reads_all_ones_and_its_writes_are_dropped(cluster, how):
    a, b = _hand_over(cluster, how)
    dev = cluster.hw.device(GPU)
    command = dev.config.command
    assert command & regs.COMMAND_MASTER
    # the old VM's driver does what a driver does on a device that vanished
    assert a.config_read(GPU, regs.COMMAND, 2) == ALL_ONES_16
    assert a.config_read(GPU, 0, 4) == 0xFFFF_FFFF
    a.config_write(GPU, regs.COMMAND, 2, 0)
    a.config_write(GPU, MSI_OFFSET + regs.MSI_FLAGS, 2, 0)
    with pytest.raises(VmlendError):
        a.enable_device(GPU)  # enabling again is refused: the device is not a's any more
    assert dev.config.command == command
    assert dev.config.msi().enabled
    assert cluster.hw.borrowed(GPU).vm == "b"
    no_violations(cluster)
    a.stop()
    b.stop()
    no_violations(cluster)


def test_a_vm_cannot_open_or_hot_add_another_vms_mdev(cluster):
    a = cluster.start(domain_xml("a", 1 * GiB, fdids=(GPU,)))
    a.enable_device(GPU)
    # b's definition copies a's (same UUID, so the same derived mdev): b starts without it
    xa = domain_xml("a", 1 * GiB, fdids=(GPU,))
    forged = xa.replace(b"<name>a</name>", b"<name>b</name>")
    b = SimVm(forged, hardware=cluster.hw, fabric=cluster.fabric())
    assert b.devices() == []
    with pytest.raises((FabricError, MdevError)):
        b.add_device(GPU)
    assert b.devices() == []
    command = cluster.hw.device(GPU).config.command
    assert command & regs.COMMAND_MASTER and command & regs.COMMAND_MEMORY
    no_violations(cluster)
    b.stop()
    a.stop()


def test_an_mdev_is_open_in_one_vm_at_a_time(cluster):
    a = cluster.start(domain_xml("a", 1 * GiB, fdids=(GPU,)))
    (m,) = [m for m in cluster.fabric().mdevs() if m.fdid == GPU]
    with pytest.raises(MdevError, match="open"):
        cluster.hw.open_mdev(m.uuid, GPU, "gamma", "other")
    a.stop()
    cluster.hw.open_mdev(m.uuid, GPU, "gamma", "a")  # free again once a stopped
    cluster.hw.close_mdev(m.uuid, "gamma")


# --- the checker sees each hand-over gap ------------------------------------------------------


def test_checker_reports_a_config_write_outside_the_writers_borrow(cluster):
    hw = cluster.hw
    hw.borrow(GPU, "gamma", "b")
    hw.config_write(GPU, ("gamma", "b"), regs.COMMAND, 2, regs.COMMAND_MEMORY)
    assert check_hardware(hw) == []
    # what the old session did: a's write reached b's device
    hw.config_write(GPU, ("gamma", "a"), regs.COMMAND, 2, 0)
    (v,) = check_hardware(hw)
    assert v.kind == "config-write" and "gamma/a wrote 0x0 while gamma/b borrowed it" in v.detail


def test_checker_reports_an_mdev_open_in_a_vm_its_hold_does_not_name(cluster):
    a = cluster.start(domain_xml("a", 1 * GiB, fdids=(GPU,)))
    (m,) = [m for m in cluster.fabric().mdevs() if m.fdid == GPU]
    with cluster.registry.read() as tx:
        holds = tx.holds()
    assert check_hardware(cluster.hw, holds=holds) == []
    # the release forgot to cut the open mdev: the VM still has it, nobody holds the device
    cluster.hw.close_mdev(m.uuid, "gamma")
    assert cluster.fabric().release(GPU, a.holder)
    cluster.hw.open_mdev(m.uuid, GPU, "gamma", "a")
    (v,) = check_hardware(cluster.hw, holds={})
    assert v.kind == "mdev" and "open in gamma/a, held by nobody" in v.detail
    # two VMs with mdevs of one device open (a state ``open_mdev`` refuses, forged here)
    other = "66666666-2222-3333-4444-555555555555"
    cluster.hw._open[("gamma", other)] = OpenMdev(other, GPU, "gamma", "b")
    assert any("open in two VMs" in v.detail for v in check_hardware(cluster.hw))
    cluster.hw.close_mdev(other, "gamma")
    a.stop()


def test_vms_of_one_name_on_two_nodes_keep_their_own_share_mdevs(shared):
    """One domain (one name, one UUID) on two nodes derives one share mdev UUID, and an mdev
    UUID names an mdev on its own node only. The state machine found: gamma's VM lost its
    share behind its back (crash clean-up), the same domain started on beta with a share (the
    same UUID), then gamma's VM stopped and its share's close closed beta's open mdev, so a
    later release could no longer cut beta's share."""
    c, drive = shared
    vg, sg, _dg, _qg = _share_vm(c, drive, "sa", "gamma")
    gamma = c.fabric("gamma")
    assert gamma.release_share(NVME, vg.holder) and sg.revoked
    for m in gamma.mdevs():
        if m.fdid == NVME and m.vm == "sa":
            gamma.remove_mdev(m.uuid)
    vb, sb, db, qb = _share_vm(c, drive, "sa", "beta")
    assert sg.mdev == sb.mdev  # same domain, same derived UUID
    vg.stop()
    assert [(o.node, o.vm) for o in c.hw.open_mdevs() if o.fdid == NVME] == [("beta", "sa")]
    assert db.write(qb, 0, b"still beta's" * 512).ok
    no_violations(c)
    # a release behind beta's VM cuts its open share, as for any VM
    assert c.fabric("beta").release_share(NVME, vb.holder)
    assert sb.revoked and not any(o.fdid == NVME for o in c.hw.open_mdevs())
    vb.stop()


def test_checker_reports_shares_left_wired_after_the_drives_borrow_ended(shared):
    c, drive = shared
    _vm, share, _d, _q = _share_vm(c, drive, "sb", "beta")
    # what the drive did before: it never heard of the borrow's end, and nothing cut its VM
    drive._remove_end()
    assert share.mdev is not None and c.hw.close_mdev(share.mdev, "beta")
    c.fabric("alpha").reclaim(NVME)
    with c.registry.read() as tx:
        holds, claims = tx.holds(), tx.claims()
    found = {v.kind for v in check_hardware(c.hw, holds=holds, claims=claims)}
    assert {"share-wire", "teardown", "interrupt"} <= found
    drive._borrow_ended(Borrow(NVME, "alpha", ledger.MANAGER_VM, "alpha", None))  # clean up


def test_checker_reports_mappings_left_for_the_hardwares_fallback(cluster):
    hw = cluster.hw
    hw.borrow(GPU, "gamma", "a")
    hw.lender_domain(GPU).map(0, hw.device(GPU).bar_range(0)[0], 4096)  # nobody removes it
    hw.give_back(GPU)
    assert hw.lender_domain(GPU).mappings() == []  # the fallback still cleans up
    (v,) = check_hardware(hw)
    assert v.kind == "teardown" and "1 lender mappings nobody removed" in v.detail


# --- what a review of the hand-over found (each failed before its fix) ------------------------


def test_no_share_opens_on_a_drive_whose_manager_lost_it(shared):
    """The lender down and up: the drive's manager lost it. A VM whose prepare still got a
    share (the registry keeps the manager's hold) must not open it on the dead drive, or its
    RAM stays mapped for whoever borrows the drive next."""
    c, drive = shared
    c.fabric().set_node_up("alpha", False, "lost power")
    c.fabric().set_node_up("alpha", True)
    assert drive.ended is not None
    xb = share_xml("sb")
    c.prepare(xb, "beta")
    with pytest.raises(FabricError, match="not served by its manager"):
        SimVm(xb, hardware=c.hw, fabric=c.fabric("beta"), nvme={NVME: drive})
    c.release(xb, "beta")
    assert c.hw.lender_domain(NVME).mappings() == []
    c.fabric("alpha").reclaim(NVME)
    vc = c.start(domain_xml("c", 1 * GiB, fdids=(NVME,)), "gamma")
    vc.enable_device(NVME)
    no_violations(c)
    vc.stop()


def test_the_old_vm_cannot_make_the_device_do_dma_after_it_moved(cluster):
    a, b = _hand_over(cluster, "release-after-crash")
    b.guest.write(0x1000, b"b's data")
    with pytest.raises(VmlendError, match=r"no longer|held by"):
        a.dma_write(GPU, 0x1000, b"from a")
    with pytest.raises(VmlendError):
        a.dma_read(GPU, 0x1000, 8)
    assert b.guest.read(0x1000, 8) == b"b's data"
    assert b.dma_read(GPU, 0x1000, 8) == b"b's data"
    a.stop()
    b.stop()


def test_a_borrow_that_could_not_be_recorded_leaves_the_vm_its_device(cluster, monkeypatch):
    """The hardware borrow is undone when its record fails (the registry briefly away), but
    the hold is still the VM's: the next enable works, nothing was revoked."""
    from vmlend.errors import StateError

    vm = cluster.start(domain_xml("a", 1 * GiB, fdids=(GPU,)))
    fabric = cluster.fabric()
    real, calls = fabric.registry.transact, []

    def flaky(body):
        calls.append(body)
        if len(calls) == 1:
            raise StateError("the registry is briefly away")
        return real(body)

    monkeypatch.setattr(fabric.registry, "transact", flaky)
    with pytest.raises(VmlendError):
        vm.enable_device(GPU)
    assert cluster.hw.borrowed(GPU) is None and not vm.session(GPU).revoked
    vm.enable_device(GPU)
    assert vm.session(GPU).borrowed and vm.session(GPU).dma_active
    vm.stop()


def test_a_failing_revocation_still_resets_the_device_and_cuts_the_others(cluster):
    hw = cluster.hw
    hw.borrow(GPU, "gamma", "a")
    cut: list[str] = []

    def boom() -> None:
        raise RuntimeError("the VM's QEMU did not answer")

    hw.open_mdev("11111111-0000-0000-0000-000000000001", GPU, "gamma", "a", boom)
    hw.open_mdev("11111111-0000-0000-0000-000000000002", GPU, "gamma", "a", lambda: cut.append("2"))
    hw.device(GPU).config.write(
        regs.COMMAND, 2, regs.COMMAND_MEMORY | regs.COMMAND_MASTER, notify=False
    )
    resets = hw.device(GPU).resets
    with pytest.raises(RuntimeError):
        hw.give_back(GPU)
    assert hw.borrowed(GPU) is None and hw.open_mdevs() == [] and cut == ["2"]
    assert hw.device(GPU).resets == resets + 1  # reset for the next owner
    assert not hw.device(GPU).config.command & regs.COMMAND_MASTER


def test_config_written_before_the_first_borrow_reaches_the_device_when_borrowed(cluster):
    from vmlend.sim.pci.config import MSI_OFFSET as MSI

    vm = cluster.start(domain_xml("a", 1 * GiB, fdids=(GPU,)))
    dev = cluster.hw.device(GPU)
    vm.config_write(GPU, MSI + regs.MSI_ADDRESS_LO, 4, 0xFEE0_1000)
    assert vm.config_read(GPU, MSI + regs.MSI_ADDRESS_LO, 4) == 0xFEE0_1000  # the guest's view
    assert dev.config.read(MSI + regs.MSI_ADDRESS_LO, 4) == 0  # not the VM's device yet
    vm.enable_device(GPU)
    assert dev.config.read(MSI + regs.MSI_ADDRESS_LO, 4) == 0xFEE0_1000
    assert vm.config_read(GPU, MSI + regs.MSI_ADDRESS_LO, 4) == 0xFEE0_1000
    no_violations(cluster)
    vm.stop()


def test_the_managers_name_is_reserved_and_a_down_lender_shares_nothing(shared):
    c, _drive = shared
    with pytest.raises(VmlendError, match="reserved"):
        c.fabric().reserve(GPU, Holder("gamma", ledger.MANAGER_VM))
    with pytest.raises(VmlendError, match="reserved"):
        c.fabric().reserve_share(NVME, Holder("gamma", ledger.MANAGER_VM), 1, 1024)
    c.fabric().set_node_up("alpha", False, "lost power")
    with pytest.raises(VmlendError, match="alpha"):
        ledger.lend_shared(c.registry, NVME, drive_geometry(c.hw.device(NVME).spec, BLOCKS))
    assert c.fabric().holds()[NVME].phase.value == "reserved"


def test_checker_reports_an_interrupt_route_of_an_old_owner(cluster):
    hw = cluster.hw
    hw.borrow(GPU, "gamma", "b")
    remove = hw.device(GPU).on_interrupt(lambda _v: None, owner=("gamma", "b"))
    assert check_hardware(hw) == []
    stale = hw.device(GPU).on_interrupt(lambda _v: None, owner=("gamma", "a"))
    (v,) = check_hardware(hw)
    assert v.kind == "interrupt" and "a route to gamma/a while gamma/b borrows it" in v.detail
    stale()
    remove()
