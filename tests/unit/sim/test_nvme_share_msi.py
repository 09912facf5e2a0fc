"""A shared drive's completion interrupts cross the NTB as MSI (docs/nvme-sharing.md, "Share
interrupts"), as a borrowed device's do: a posted write from the drive through the lender
IOMMU (the share's address space), an NTB segment and the drive's ingress domain on the VM's
node to the VM's interrupt target, which signals the VMM's eventfd. Only with the interrupt
window admitted; without it (a full window) the share's interrupts are relayed. A write that
faults is lost; a closed share's interrupt reaches nothing; the checker proves what is mapped
is claimed and reaches its own VM only."""

from __future__ import annotations

import os

import msgspec
import pytest

from tests.support.nvme_guest import guest_driver, share_xml, shared_drive, start_sharing_vm
from tests.support.simcluster import assert_matches_registry
from vmlend.errors import DmaFault
from vmlend.ledger import nvmeshares
from vmlend.ledger.admission import guest_ram_of
from vmlend.memory.windows import window_segments
from vmlend.nvme.guard import asid_base
from vmlend.registry import Claim, ClaimKind
from vmlend.sim.hardware import SimHardware
from vmlend.sim.invariants import check_hardware, check_with_registry
from vmlend.sim.msitarget import MSI_IOVA, PAGE
from vmlend.sim.nvmeshare import SharedNvmeDrive
from vmlend.sim.simvm import SimVm
from vmlend.topology.model import GuestRange, Holder, MiB
from vmlend.topology.parse import load_topology
from vmlend.topology.paths import route

NVME = 0x12


@pytest.fixture
def setup(state_path, tmp_path):
    with shared_drive(state_path, tmp_path, fdid=NVME) as both:
        yield both


def msi_claims(c) -> list[str]:  # type: ignore[no-untyped-def]
    with c.registry.read() as tx:
        return sorted(cl.share for f, cl in tx.claims() if cl.share.startswith("msi:"))


def test_a_shares_interrupt_arrives_at_its_vms_eventfd_through_the_ntb(setup):
    c, drive = setup
    vm, drv, queue = start_sharing_vm(c, drive, "web", "gamma")
    share = vm.nvme_share(NVME)
    assert share.interrupt_path() == "ntb"
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    try:
        share.set_triggers({1: efd})
        assert drv.write(queue, 0, b"w" * 512).ok
        got = os.eventfd_read(efd)
        assert got >= 1 and share.msi.delivered == got
        assert share.msi.relayed == 0 and share.msi.lost == 0
        assert share.interrupts[1] == got  # the guest's vector fired for each, too
        stages = [h.stage for h in share.last_hops]
        assert stages == ["device", "lender-iommu", "ntb-segment", "lut", "borrower-iommu", "irq"]
        assert share.last_hops[-1].node == "gamma"
        assert share.last_hops[-1].detail == "msi-target:web"
        assert share.status()["interrupts"]["paths"] == {"primary": "ntb"}
        assert_matches_registry(c)
    finally:
        os.close(efd)


def test_two_vms_of_one_node_each_get_their_own_interrupts(setup):
    c, drive = setup
    vms = [start_sharing_vm(c, drive, name, "gamma") for name in ("web", "db")]
    fds = [os.eventfd(0, os.EFD_NONBLOCK) for _ in vms]
    try:
        for (vm, _d, _q), fd in zip(vms, fds, strict=True):
            vm.nvme_share(NVME).set_triggers({1: fd})
        (_vm, drv, queue) = vms[1]
        assert drv.write(queue, 0, b"d" * 512).ok
        assert os.eventfd_read(fds[1]) >= 1
        with pytest.raises(BlockingIOError):  # web's eventfd heard nothing of db's I/O
            os.eventfd_read(fds[0])
        assert_matches_registry(c)
    finally:
        for fd in fds:
            os.close(fd)


def test_a_full_window_relays_the_shares_interrupts_and_the_check_agrees(setup):
    c, drive = setup
    topo = c.fabric("gamma").topology()
    path = route(topo, topo.device(NVME).lender, "gamma")
    assert path is not None
    ref, seg = path.src.ref, path.src.segment_size
    # another VM's share (its DMA windows and its interrupt window) takes every segment but
    # the ones web's DMA windows need
    need = window_segments(guest_ram_of(256 * MiB).ranges, seg)
    free = c.fabric("gamma").usage()[ref].segments_free - need - 1
    ram = next(
        n * seg
        for n in range(free, 0, -1)
        if window_segments(guest_ram_of(n * seg).ranges, seg) == free
    )
    nvmeshares.reserve_share(c.registry, NVME, Holder("beta", "filler"), 1, 64, guest_ram=ram)
    vm, drv, queue = start_sharing_vm(c, drive, "web", "gamma")
    share = vm.nvme_share(NVME)
    assert c.fabric("gamma").usage()[ref].segments_free == 0
    assert msi_claims(c) == ["msi:beta/filler"] and share.interrupt_path() == "relay"
    assert drv.write(queue, 0, b"r" * 512).ok
    assert share.interrupts[1] >= 1 and share.msi.relayed == share.interrupts[1]
    assert share.msi.delivered == 0
    assert share.status()["interrupts"]["paths"] == {"primary": "relay"}
    assert_matches_registry(c)


def test_the_interrupt_window_goes_with_the_share_and_a_stale_write_reaches_nothing(setup):
    c, drive = setup
    xml = share_xml("web", fdid=NVME)
    c.prepare(xml, "gamma")
    vm = SimVm(xml, hardware=c.hw, fabric=c.fabric("gamma"), nvme={NVME: drive})
    share = vm.nvme_share(NVME)
    share.set_master()
    drv = guest_driver(share.bar0, vm.guest)
    (queue,) = drv.start(queues=1)
    assert msi_claims(c) == ["msi:gamma/web"]
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    try:
        share.set_triggers({1: efd})
        assert drv.write(queue, 0, b"s" * 512).ok
        heard = os.eventfd_read(efd)
        address = asid_base(share.share.asid) + MSI_IOVA
        assert c.hw.resolve_dma(NVME, address, write=True).kind == "irq"
        vm.stop()
        c.release(xml, "gamma")
        assert msi_claims(c) == []
        # the drive's write to the old share's interrupt address faults at the lender IOMMU
        with pytest.raises(DmaFault) as fault:
            c.hw.resolve_dma(NVME, address, write=True)
        assert fault.value.hop == "lender-iommu"
        assert heard >= 1
        with pytest.raises(BlockingIOError):
            os.eventfd_read(efd)
        assert_matches_registry(c)
    finally:
        os.close(efd)


def test_the_checker_catches_an_interrupt_route_left_behind_or_to_another_vm(setup):
    c, drive = setup
    vm, _drv, _queue = start_sharing_vm(c, drive, "web", "gamma")
    other, _d2, _q2 = start_sharing_vm(c, drive, "db", "gamma")
    web, db = vm.nvme_share(NVME), other.nvme_share(NVME)
    lender = c.hw.lender_domain(NVME)
    web_at = lender.lookup(asid_base(web.share.asid) + MSI_IOVA)
    db_at = lender.lookup(asid_base(db.share.asid) + MSI_IOVA)
    assert web_at is not None and db_at is not None and web_at.phys != db_at.phys
    assert_matches_registry(c)
    # web's address space pointed at db's slot: its interrupts would reach db's target
    lender.unmap(asid_base(web.share.asid) + MSI_IOVA, PAGE)
    lender.map(asid_base(web.share.asid) + MSI_IOVA, db_at.phys, PAGE)
    found = check_with_registry(c.hw, c.registry)
    assert [v.kind for v in found] == ["msi"] and "msi-target:db" in found[0].detail
    lender.unmap(asid_base(web.share.asid) + MSI_IOVA, PAGE)
    lender.map(asid_base(web.share.asid) + MSI_IOVA, web_at.phys, PAGE)
    assert_matches_registry(c)
    # db's slot in the drive's ingress domain on gamma pointed at web's target page
    assert db.msi_target is not None and web.msi_target is not None
    ingress = drive._domain("gamma")
    slot = MSI_IOVA + db.msi_target.slot * PAGE
    ingress.unmap(slot, PAGE)
    ingress.map(slot, web.msi_target.base, PAGE)
    found = check_with_registry(c.hw, c.registry)
    assert {v.kind for v in found} == {"msi"}  # db's address space now reaches web's target
    ingress.unmap(slot, PAGE)
    ingress.map(slot, db.msi_target.base, PAGE)
    assert_matches_registry(c)
    # db's share ends but its interrupt route is left behind in the lender IOMMU
    db_iova = asid_base(db.share.asid) + MSI_IOVA
    db_phys = db_at.phys
    other.stop()
    c.release(share_xml("db", fdid=NVME), "gamma")
    assert_matches_registry(c)
    c.hw.lender_domain(NVME).map(db_iova, db_phys, PAGE)
    found = check_with_registry(c.hw, c.registry)
    assert found and all(v.kind == "lender-iommu" for v in found)
    assert "is no current share" in found[0].detail


def test_a_share_without_its_window_admitted_may_not_map_an_interrupt_route(state_path, tmp_path):
    hw = SimHardware.from_topology(load_topology(), seed=3)
    drive = SharedNvmeDrive(hw, NVME, tmp_path, blocks=1 << 16)
    try:
        hw.create_guest("gamma", "web", [GuestRange(0, 64 * MiB)])
        window = Claim("alpha:0", ClaimKind.DMA, "msi:gamma/web", segments=1)
        share = drive.open_share("gamma", "web", 1, 4096, interrupts=[window])
        share.set_master()
        assert share.interrupt_path() == "ntb"
        assert check_hardware(hw, shares=drive.grants()) == []
        # the same mappings, judged against a share admitted without the window
        grants = [msgspec.structs.replace(g, msi=False) for g in drive.grants()]
        found = check_hardware(hw, shares=grants)
        assert {v.kind for v in found} >= {"msi", "share-domain"}
    finally:
        drive.close()


PRIMARY_PORT = "mxs824/gamma:0"
BACKUP_PORT = "mxs824b/gamma:1"


def windows(vm: str, *, backup: bool = False) -> list[Claim]:
    """The interrupt windows admission grants a share of ``vm`` on gamma (from alpha:0)."""
    out = [Claim("alpha:0", ClaimKind.DMA, f"msi:gamma/{vm}", segments=1)]
    if backup:
        out.append(Claim("alpha:0", ClaimKind.DMA, f"msi:gamma/{vm}#backup", segments=1))
    return out


@pytest.fixture
def hw():
    return SimHardware.from_topology(load_topology(), seed=5)


def entered_by(share) -> str:  # type: ignore[no-untyped-def]
    """The adapter of gamma the share's last interrupt entered by (its ``lut`` hop)."""
    lut = next(h for h in share.last_hops if h.stage == "lut")
    return lut.detail.split()[0]


def test_a_two_path_shares_interrupts_cross_the_backup_path_after_a_failover(hw, tmp_path):
    drive = SharedNvmeDrive(hw, NVME, tmp_path, blocks=1 << 16)
    try:
        hw.create_guest("gamma", "web", [GuestRange(0, 64 * MiB)])
        share = drive.open_share(
            "gamma", "web", 1, 4096, paths=2, interrupts=windows("web", backup=True)
        )
        share.set_master()
        drv = guest_driver(share.bar0, hw.guest("gamma", "web"))
        (queue,) = drv.start(queues=1, entries=32)
        assert (share.interrupt_path(0), share.interrupt_path(1)) == ("ntb", "ntb")
        assert drv.write(queue, 0, b"p" * 512).ok
        assert share.msi.delivered >= 1 and entered_by(share) == "gamma:0"
        assert check_hardware(hw, shares=drive.grants()) == []
        hw.link_down(PRIMARY_PORT)
        assert share.relay is not None and share.relay.status()["active"] == "backup"
        before = share.msi.delivered
        assert drv.write(queue, 1, b"b" * 512).ok
        # the backup pair's completion crossed the backup path to the VM's target
        assert share.msi.delivered > before and entered_by(share) == "gamma:1"
        assert share.msi.lost == 0 and share.msi.relayed == 0
        assert check_hardware(hw, shares=drive.grants()) == []
    finally:
        drive.close()


def test_a_one_path_shares_interrupts_follow_its_rerouted_crossing(hw, tmp_path):
    """As a borrowed device's MSI segment names no far adapter and follows its re-routed
    crossing, so does a share's."""
    drive = SharedNvmeDrive(hw, NVME, tmp_path, blocks=1 << 16)
    try:
        hw.create_guest("gamma", "web", [GuestRange(0, 64 * MiB)])
        share = drive.open_share("gamma", "web", 1, 4096, interrupts=windows("web"))
        share.set_master()
        drv = guest_driver(share.bar0, hw.guest("gamma", "web"))
        (queue,) = drv.start(queues=1, entries=32)
        assert drv.write(queue, 0, b"1" * 512).ok and entered_by(share) == "gamma:0"
        hw.link_down(PRIMARY_PORT)  # the drive's crossing into gamma moves to gamma:1
        before = share.msi.delivered
        assert drv.write(queue, 1, b"2" * 512).ok
        assert share.msi.delivered > before and entered_by(share) == "gamma:1"
        assert check_hardware(hw, shares=drive.grants()) == []
    finally:
        drive.close()


def test_an_interrupt_whose_write_faults_is_lost_not_delivered(hw, tmp_path):
    drive = SharedNvmeDrive(hw, NVME, tmp_path, blocks=1 << 16)
    try:
        hw.create_guest("beta", "web", [GuestRange(0, 64 * MiB)])  # beta: one adapter
        window = Claim("alpha:0", ClaimKind.DMA, "msi:beta/web", segments=1)
        share = drive.open_share("beta", "web", 1, 4096, interrupts=[window])
        share.set_master()
        drv = guest_driver(share.bar0, hw.guest("beta", "web"))
        (queue,) = drv.start(queues=1, entries=32)
        assert drv.write(queue, 0, b"1" * 512).ok
        heard = dict(share.interrupts)
        hw.link_down("mxs824/beta:0")  # no other way into beta
        drive.device.raise_interrupt(share.share.real_vector(1))
        assert share.msi.lost == 1 and share.msi_faults[-1].hop == "link-down"
        assert share.interrupts == heard  # nothing reached the VM
    finally:
        drive.close()


def test_a_hot_move_takes_the_destinations_window_or_the_relay(setup):
    """The share moves hot to beta, where the lender's window has room for its DMA windows
    but not for another interrupt window: admitted there without one, its interrupts are
    relayed on beta, and the checker holds at every phase (a route mapped without a claim
    would not)."""
    from vmlend.sim.hotmig import hot_migrate

    c, drive = setup
    vm, drv, queue = start_sharing_vm(c, drive, "sa", "gamma")
    assert vm.nvme_share(NVME).interrupt_path() == "ntb"
    topo = c.fabric("gamma").topology()
    path = route(topo, topo.device(NVME).lender, "beta")
    assert path is not None
    ref, seg = path.src.ref, path.src.segment_size
    need = window_segments(guest_ram_of(256 * MiB).ranges, seg)
    free = c.fabric("gamma").usage()[ref].segments_free - need - 1  # the filler's window too
    ram = next(
        n * seg
        for n in range(free, 0, -1)
        if window_segments(guest_ram_of(n * seg).ranges, seg) == free
    )
    nvmeshares.reserve_share(c.registry, NVME, Holder("beta", "filler"), 1, 64, guest_ram=ram)

    def check(step: str) -> None:
        found = check_with_registry(c.hw, c.registry)
        assert found == [], f"after {step}:\n" + "\n".join(map(str, found))

    hot_migrate(vm, c.fabric("beta"), c.registry, check=check)
    share = vm.nvme_share(NVME)
    assert vm.node == "beta" and share.interrupt_path() == "relay"
    assert msi_claims(c) == ["msi:beta/filler"]
    drv.memory = c.hw.guest("beta", "sa")
    relayed = share.msi.relayed
    assert drv.write(queue, 1, b"m" * 512).ok and share.msi.relayed > relayed
    assert_matches_registry(c)
