"""MSI/MSI-X over the NTB: the device's own posted write reaches the VM's eventfd through the
lender IOMMU, an NTB segment, the LUT and the borrower IOMMU; it faults like any DMA once the
mapping is gone; masking keeps its semantics; admission claims one segment or falls back to
the relay."""

from __future__ import annotations

import pytest

from tests.support.simfabric import make_fabric
from vmlend.irq import vectors as r
from vmlend.irq.eventfd import EventFd
from vmlend.irq.vectors import IrqIndex
from vmlend.ledger.msiadmit import is_msi_claim
from vmlend.sim.hardware import SimHardware
from vmlend.sim.msitarget import MSI_IOVA, MsiTargets
from vmlend.sim.ntbmsi import NTB, RELAY, NtbMsiRoute, interrupt_path
from vmlend.sim.pci import regs
from vmlend.topology.model import GiB, GuestRange, Holder, MiB
from vmlend.topology.parse import load_topology

NVME = 0x12  # on alpha: MSI (32, maskable) and MSI-X (32 entries, table in BAR 0)
LOCAL_GPU = 0x10  # alpha's, used by a VM on alpha: no NTB


@pytest.fixture
def hw() -> SimHardware:
    hw = SimHardware.from_topology(load_topology(), seed=3)
    hw.create_guest("gamma", "web", [GuestRange(0, 8 * MiB)])
    hw.borrow(NVME, "gamma", "web")
    return hw


@pytest.fixture
def route(hw):
    route = NtbMsiRoute(hw, MsiTargets(hw), NVME)
    yield route
    route.close()


def enable_msix(hw: SimHardware, fdid: int, entries: int, masked: frozenset[int] = frozenset()):
    """What the guest driver does: bus master on, program and unmask the table, enable."""
    dev = hw.device(fdid)
    dev.config.write(regs.COMMAND, 2, regs.COMMAND_MEMORY | regs.COMMAND_MASTER)
    msix = dev.spec.msix
    for v in range(entries):
        base = msix.table_offset + v * r.MSIX_ENTRY_SIZE
        dev.bars.write(msix.table_bar, base + r.MSIX_ENTRY_ADDR_LO, 4, 0xFEE0_0000)
        dev.bars.write(msix.table_bar, base + r.MSIX_ENTRY_DATA, 4, 0x4000 + v)
        dev.bars.write(msix.table_bar, base + r.MSIX_ENTRY_CTRL, 4, int(v in masked))
    cap = dev.config.find_capability(r.CAP_ID_MSIX)
    dev.config.write(cap + r.MSIX_FLAGS, 2, r.MSIX_FLAGS_ENABLE)


def mask_msix(hw: SimHardware, fdid: int, vector: int, masked: bool) -> None:
    dev = hw.device(fdid)
    msix = dev.spec.msix
    base = msix.table_offset + vector * r.MSIX_ENTRY_SIZE
    dev.bars.write(msix.table_bar, base + r.MSIX_ENTRY_CTRL, 4, int(masked))


def pba_bit(hw: SimHardware, fdid: int, vector: int) -> bool:
    dev = hw.device(fdid)
    msix = dev.spec.msix
    word = dev.bars.read(msix.pba_bar, msix.pba_offset + vector // 32 * 4, 4)
    return bool(word >> (vector % 32) & 1)


def read_all(efd: EventFd) -> int:
    return efd.drain()


@pytest.fixture
def vm_fds():
    fds = [EventFd() for _ in range(4)]
    yield fds
    for f in fds:
        f.close()


def test_an_interrupt_is_one_posted_write_through_the_ntb(hw, route, vm_fds):
    enable_msix(hw, NVME, 4)
    route.set_triggers(IrqIndex.MSIX, [f.fileno() for f in vm_fds])
    hw.device(NVME).raise_interrupt(2)
    assert [read_all(f) for f in vm_fds] == [0, 0, 1, 0]
    stages = [h.stage for h in route.last_hops]
    assert stages == ["device", "lender-iommu", "ntb-segment", "lut", "borrower-iommu", "irq"]
    assert route.last_hops[-1].node == "gamma"
    # vmlend's physical message, not the guest's (0xfee00000 / 0x4002)
    address, data = route.message(2)
    assert address == MSI_IOVA and data != 0x4002
    assert route.faults == []


def test_many_interrupts_on_many_vectors_all_arrive(hw, route, vm_fds):
    enable_msix(hw, NVME, 4)
    route.set_triggers(IrqIndex.MSIX, [f.fileno() for f in vm_fds])
    for i in range(400):
        hw.device(NVME).raise_interrupt(i % 4)
    assert [read_all(f) for f in vm_fds] == [100] * 4


def test_masked_vector_is_pending_and_delivered_on_unmask(hw, route, vm_fds):
    enable_msix(hw, NVME, 4, masked=frozenset({1}))
    route.set_triggers(IrqIndex.MSIX, [f.fileno() for f in vm_fds])
    hw.device(NVME).raise_interrupt(1)
    hw.device(NVME).raise_interrupt(1)
    assert read_all(vm_fds[1]) == 0 and pba_bit(hw, NVME, 1)
    mask_msix(hw, NVME, 1, False)
    assert read_all(vm_fds[1]) == 2 and not pba_bit(hw, NVME, 1)


def test_interrupts_before_the_vmm_assigns_eventfds_are_held(hw, route, vm_fds):
    enable_msix(hw, NVME, 4)
    hw.device(NVME).raise_interrupt(0)
    route.set_triggers(IrqIndex.MSIX, [vm_fds[0].fileno()])
    assert read_all(vm_fds[0]) == 1


def test_no_interrupt_reaches_the_vm_after_the_device_is_given_back(hw, route, vm_fds):
    enable_msix(hw, NVME, 4)
    route.set_triggers(IrqIndex.MSIX, [f.fileno() for f in vm_fds])
    hw.device(NVME).raise_interrupt(0)
    assert read_all(vm_fds[0]) == 1
    # The lender reclaims it (same as a detach): the route's mapping and its sink go with the
    # borrow, before the LUT entries and the crossing: the device's interrupts reach nobody.
    hw.give_back(NVME)
    assert hw.lender_domain(NVME).mappings() == []
    assert hw.device(NVME).interrupt_routes == 0
    enable_msix(hw, NVME, 4)  # even if something re-enabled it on the lender
    hw.device(NVME).raise_interrupt(0)
    assert read_all(vm_fds[0]) == 0
    assert route.faults == []  # nothing was even posted: the route no longer listens
    route.close()  # idempotent after the borrow ended


def test_after_a_reset_the_device_cannot_signal_until_the_guest_enables_it_again(hw, route, vm_fds):
    enable_msix(hw, NVME, 4)
    route.set_triggers(IrqIndex.MSIX, [f.fileno() for f in vm_fds])
    hw.device(NVME).reset()
    hw.device(NVME).raise_interrupt(0)  # MSI-X disabled by the reset: nothing sent
    cap = hw.device(NVME).config.find_capability(r.CAP_ID_MSIX)
    hw.device(NVME).config.write(cap + r.MSIX_FLAGS, 2, r.MSIX_FLAGS_ENABLE)  # no bus master
    mask_msix(hw, NVME, 0, False)  # the reset masked every entry
    blocked = hw.device(NVME).blocked_messages
    hw.device(NVME).raise_interrupt(0)
    assert read_all(vm_fds[0]) == 0
    # a message is a memory write: with Bus Master off the device does not issue it at all
    assert hw.device(NVME).blocked_messages == blocked + 1
    assert route.faults == []


def test_a_stale_route_after_close_reaches_nothing(hw, vm_fds):
    targets = MsiTargets(hw)
    route = NtbMsiRoute(hw, targets, NVME)
    enable_msix(hw, NVME, 4)
    route.set_triggers(IrqIndex.MSIX, [f.fileno() for f in vm_fds])
    route.close()
    hw.device(NVME).raise_interrupt(0)
    assert read_all(vm_fds[0]) == 0
    # The device's IOVA no longer leads anywhere, and the segment is free again.
    assert hw.lender_domain(NVME).lookup(MSI_IOVA) is None
    assert all(s.remote_addr != MSI_IOVA for s in hw.adapter("alpha:0").mapped_segments())


def test_intx_stays_on_the_relay(hw, route, vm_fds):
    dev = hw.device(NVME)
    dev.config.write(regs.COMMAND, 2, regs.COMMAND_MEMORY | regs.COMMAND_MASTER)
    dev.raise_interrupt(0)  # INTx enabled out of reset: not posted
    assert route.last_hops == () and route.faults == []
    with pytest.raises(Exception, match="relay"):
        route.set_triggers(IrqIndex.INTX, [vm_fds[0].fileno()])


def test_a_local_device_has_no_ntb_to_map_over(hw):
    hw.create_guest("alpha", "db", [GuestRange(0, 8 * MiB)])
    hw.borrow(LOCAL_GPU, "alpha", "db")
    with pytest.raises(Exception, match="use the relay"):
        NtbMsiRoute(hw, MsiTargets(hw), LOCAL_GPU)


def test_a_device_reaches_only_its_own_vms_target(hw):
    targets = MsiTargets(hw)
    web = NtbMsiRoute(hw, targets, NVME)
    other = targets.for_vm("gamma", "other")
    # The other VM's page is not mapped in web's IOMMU domain: no IOVA of NVME reaches it.
    dom = hw.vm_domain("gamma", "web")
    assert all(not (m.phys <= other.base < m.phys + m.size) for m in dom.mappings())
    web.close()


# --- admission ------------------------------------------------------------------------------
HOLDER = Holder("gamma", "web", "6f1c5a2e-0000-4000-8000-00000000000a")


def test_admission_claims_one_segment_per_vm_and_lender_adapter(state_path):
    fabric = make_fabric(state_path)
    before = fabric.usage()["alpha:0"].segments_used
    fabric.reserve(NVME, HOLDER, guest_ram=512 * MiB, msi_over_ntb=True)
    claim = fabric.interrupt_window(NVME)
    assert claim is not None and is_msi_claim(claim) and claim.segments == 1
    assert interrupt_path(fabric, NVME, IrqIndex.MSIX) == NTB
    assert interrupt_path(fabric, NVME, IrqIndex.INTX) == RELAY
    # 512 MiB of DMA window rounds to one segment; the interrupt window is one more.
    assert fabric.usage()["alpha:0"].segments_used == before + 2


def test_without_the_option_interrupts_use_the_relay_and_nothing_more_is_claimed(state_path):
    fabric = make_fabric(state_path)
    fabric.reserve(NVME, HOLDER, guest_ram=512 * MiB)
    assert fabric.interrupt_window(NVME) is None
    assert interrupt_path(fabric, NVME, IrqIndex.MSIX) == RELAY


def test_no_room_for_the_interrupt_window_falls_back_to_the_relay(state_path):
    fabric = make_fabric(state_path)
    seg = fabric.usage()["alpha:0"].adapter.segment_size
    free = fabric.usage()["alpha:0"].segments_free
    # A q35 VM whose DMA windows take every free segment of alpha's window: 2 GiB of low RAM
    # in one segment, the rest from 4 GiB in the others.
    ram = 2 * GiB + (free - 1) * seg
    checks = fabric.admission(NVME, "gamma", ram, holder=HOLDER)
    assert all(c.ok for c in checks)
    fabric.reserve(NVME, HOLDER, guest_ram=ram, msi_over_ntb=True)
    assert fabric.interrupt_window(NVME) is None
    assert interrupt_path(fabric, NVME, IrqIndex.MSIX) == RELAY


def test_the_admission_check_says_which_path(state_path):
    from vmlend.ledger.admission import admit

    fabric = make_fabric(state_path)
    with fabric._reg.read() as tx:
        topo = fabric._topology(tx)
        view = fabric._view(tx, topo, NVME, "gamma", HOLDER)
        adm = admit(topo, view, NVME, "gamma", 0, HOLDER, True)
    check = next(c for c in adm.checks if c.name == "msi-ntb")
    assert check.ok and check.data["path"] == NTB and "alpha:0" in check.detail


def test_the_vectors_are_recorded_for_status_with_their_path(hw, state_path):
    from vmlend.irq.records import RECORD_KIND, registry_vector_recorder
    from vmlend.registry import SqliteRegistry

    fabric = make_fabric(state_path)
    fabric.reserve(NVME, HOLDER, msi_over_ntb=True)
    registry = SqliteRegistry.open(state_path)
    route = NtbMsiRoute(hw, MsiTargets(hw), NVME, recorder=registry_vector_recorder(registry))
    enable_msix(hw, NVME, 2, masked=frozenset({1}))
    with registry.read() as tx:
        records = {rec.key: rec.data for rec in tx.runtime(NVME, RECORD_KIND)}
    assert set(records) == {f"MSIX.{v}" for v in range(32)}  # the table's size, as the relay
    assert records["MSIX.0"]["path"] == NTB and records["MSIX.0"]["via"] == "alpha:0"
    assert records["MSIX.1"]["masked"] is True
    route.close()
    with registry.read() as tx:
        assert tx.runtime(NVME, RECORD_KIND) == []
    registry.close()


def test_a_route_opens_only_for_a_hold_admitted_with_an_interrupt_window(hw, state_path):
    from vmlend.sim.ntbmsi import open_route

    fabric = make_fabric(state_path)
    targets = MsiTargets(hw)
    fabric.reserve(NVME, HOLDER)
    assert open_route(fabric, hw, targets, NVME) is None  # the relay's
    fabric.release(NVME, HOLDER)
    fabric.reserve(NVME, HOLDER, msi_over_ntb=True)
    route = open_route(fabric, hw, targets, NVME)
    assert route is not None
    route.close()


def test_multiple_message_msi_masks_and_releases_like_msix(hw, route, vm_fds):
    from tests.support.irq_devices import msi_enable, msi_mask

    dev = hw.device(NVME)
    dev.config.write(regs.COMMAND, 2, regs.COMMAND_MEMORY | regs.COMMAND_MASTER)
    msi_enable(dev.config, 4)
    msi_mask(dev.config, 0b0100)
    route.set_triggers(IrqIndex.MSI, [f.fileno() for f in vm_fds])
    for v in range(4):
        dev.raise_interrupt(v)
    assert [read_all(f) for f in vm_fds] == [1, 1, 0, 1]
    cap = dev.config.find_capability(r.CAP_ID_MSI)
    pending = cap + 20  # 64-bit form: mask at +16, pending at +20
    assert dev.config.read(pending, 4) == 0b0100
    msi_mask(dev.config, 0)
    assert read_all(vm_fds[2]) == 1 and dev.config.read(pending, 4) == 0
    assert {route.message(v)[0] for v in range(4)} == {MSI_IOVA}


@pytest.mark.parametrize("admitted", [True, False])
def test_the_demo_guest_wires_over_the_ntb_or_falls_back_to_the_relay(hw, admitted):
    from vmlend.demo.interrupts import VmInterrupts

    targets = MsiTargets(hw)
    enable_msix(hw, NVME, 32)

    def open_ntb(fdid: int) -> NtbMsiRoute | None:
        return NtbMsiRoute(hw, targets, fdid) if admitted else None

    irqs = VmInterrupts("gamma", open_ntb)
    try:
        wired = irqs.wire(hw.device(NVME), IrqIndex.MSIX, 4)
        expected = "ntb alpha->gamma" if admitted else "relay alpha->gamma"
        assert wired.path.startswith(expected)
        assert irqs.fire(hw.device(NVME), 40) == [10, 10, 10, 10]
        irqs.unwire(NVME)
        # Unwired: the route is closed, the device's message IOVA leads nowhere any more.
        assert hw.lender_domain(NVME).lookup(MSI_IOVA) is None
    finally:
        irqs.close()


def test_a_vm_started_on_a_simulated_node_gets_its_msix_over_the_ntb(state_path):
    """End to end: admission with the option, the real hook (a subprocess) reserving and
    creating the mdev, the guest's drivers enabling the device, interrupts arriving, and the
    vectors in the shared state that `vmlend status` reads."""
    import uuid

    from vmlend.demo.cluster import DemoCluster
    from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, new_domain
    from vmlend.irq.records import RECORD_KIND

    make_fabric(state_path)
    vm_uuid = uuid.UUID(HOLDER.vm_uuid)
    spec = DomainSpec("web", 512 * MiB, uuid=vm_uuid, devices=[DeviceRequest(NVME)])
    xml = new_domain(spec, templates=TemplateSet()).to_bytes()
    cluster = DemoCluster(state_path)
    try:
        cluster.fabric("gamma").reserve(NVME, HOLDER, guest_ram=512 * MiB, msi_over_ntb=True)
        hv = cluster.hypervisor("gamma")
        hv.define(xml)
        hv.start("web")
        [wired] = cluster.guest("gamma").load_drivers("web")
        assert wired.index is IrqIndex.MSIX and wired.path.startswith("ntb alpha->gamma")
        irqs = cluster.guest("gamma").guest("web").irqs
        n = len(wired.eventfds)
        assert irqs.fire(cluster.hw.device(NVME), 3 * n) == [3] * n
        with cluster.registry.read() as tx:
            paths = {r.data["path"] for r in tx.runtime(NVME, RECORD_KIND)}
        assert paths == {wired.path}
        hv.destroy("web")
        assert cluster.hw.lender_domain(NVME).lookup(MSI_IOVA) is None
    finally:
        cluster.close()
