"""SimVm over the real SimFabric and a real state file: the hook's prepare reserves and makes
the mdevs, the guest's enable borrows, Bus Master maps the windows, stop gives everything back.

``Cluster`` (tests/support/simcluster.py) is one simulated cluster: one SimHardware, a
SimFabric per borrower node driving it, and the state file they share."""

from __future__ import annotations

import pytest

from tests.support.simcluster import domain_xml
from vmlend.errors import ConfigError, DmaFault, FabricError, PinError
from vmlend.sim.pci import regs
from vmlend.sim.simvm import SimVm
from vmlend.topology.model import DeviceState, GiB, MiB


def test_enable_borrows_maps_and_dma_lands_in_guest_ram(cluster):
    xml = domain_xml("web", 2 * GiB)
    vm = cluster.start(xml)
    assert vm.devices() == [0x12]
    assert cluster.fabric().device(0x12).state is DeviceState.RESERVED
    with pytest.raises(DmaFault) as e:
        vm.dma_write(0x12, 0x1000, b"x")
    assert e.value.hop == "bus-master"

    vm.enable_device(0x12)
    assert cluster.fabric().device(0x12).state is DeviceState.BORROWED
    vm.dma_write(0x12, 0x10_0000, b"hello")
    assert vm.guest.read(0x10_0000, 5) == b"hello"
    vm.guest.write(0x20_0000, b"from the guest")
    assert vm.dma_read(0x12, 0x20_0000, 14) == b"from the guest"
    records = {r.key: r.data for r in cluster.runtime() if r.fdid == 0x12}
    assert set(records) == {"low"}
    assert records["low"]["gpa_start"] == 0 and records["low"]["gpa_end"] == 2 * GiB
    assert records["low"]["adapter"] == "alpha:0" and records["low"]["segments"]


def test_disable_unmaps_and_unpins_enable_again_works(cluster):
    vm = cluster.start(domain_xml("web", 1 * GiB))
    vm.enable_device(0x12)
    assert vm.guest.pinned_bytes == 1 * GiB
    vm.disable_device(0x12)
    assert vm.guest.pinned_bytes == 0
    assert cluster.runtime() == []
    assert not vm.config_read(0x12, regs.COMMAND, 2) & regs.COMMAND_MASTER
    with pytest.raises(DmaFault):
        vm.dma_write(0x12, 0x1000, b"x")
    vm.config_write(0x12, regs.COMMAND, 2, regs.COMMAND_MEMORY | regs.COMMAND_MASTER)
    vm.dma_write(0x12, 0x1000, b"again")
    assert vm.guest.read(0x1000, 5) == b"again"


def test_guest_sees_virtual_bars_device_keeps_lender_addresses(cluster):
    vm = cluster.start(domain_xml("web", 1 * GiB, fdids=(0x10,)))
    dev = cluster.hw.device(0x10)
    physical = {i: dev.config.bar_address(i) for i in (0, 1, 3)}
    vm.enable_device(0x10)
    placed = {b.index: b for b in vm.bars(0x10)}
    s = vm.session(0x10)
    for i, bar in placed.items():
        assert s.guest_bar(i) == bar.address
        assert dev.config.bar_address(i) == physical[i]
    # 32-bit BAR in the hole above low RAM, 64-bit BARs above RAM, size aligned
    assert vm.layout.below_4g <= placed[0].address < 0xFEC0_0000
    assert placed[1].address >= 4 * GiB and placed[1].address % placed[1].size == 0
    # sizing on the virtual register: all ones reads back the size mask with the type bits
    vm.config_write(0x10, 0x10, 4, 0xFFFFFFFF)
    assert vm.config_read(0x10, 0x10, 4) == (~(16 * MiB - 1) & 0xFFFFFFFF)
    assert dev.config.bar_address(0) == physical[0]
    hi = 0x14 + 4
    vm.config_write(0x10, hi, 4, 0xFFFFFFFF)
    assert vm.config_read(0x10, hi, 4) == (~((32 * GiB - 1) >> 32) & 0xFFFFFFFF)


def test_stop_unmaps_gives_back_and_frees_the_guest(cluster):
    xml = domain_xml("web", 1 * GiB, fdids=(0x10, 0x12))
    vm = cluster.start(xml)
    vm.enable_device(0x10)
    vm.enable_device(0x12)
    vm.stop()
    assert cluster.hw.borrows() == []
    assert cluster.runtime() == []
    assert cluster.hw.adapter("alpha:0").mapped_segments() == []
    assert cluster.hw.lender_domain(0x10).mappings() == []
    assert cluster.hw.vm_domain("gamma", "web").mappings() == []
    states = {d.fdid: d.state for d in cluster.fabric().devices() if d.holder}
    assert states == {0x10: DeviceState.RESERVED, 0x12: DeviceState.RESERVED}
    cluster.release(xml)
    assert not [d for d in cluster.fabric().devices() if d.holder]
    with pytest.raises(ConfigError):
        vm.dma_write(0x10, 0, b"x")
    vm.stop()  # idempotent


def test_hot_remove_and_hot_add(cluster):
    xml = domain_xml("web", 1 * GiB, fdids=(0x12,))
    vm = cluster.start(xml)
    vm.enable_device(0x12)
    vm.remove_device(0x12)
    assert vm.devices() == []
    assert cluster.hw.borrowed(0x12) is None
    assert vm.guest.pinned_bytes == 0
    with pytest.raises(FabricError):
        vm.config_read(0x12, 0, 4)
    with pytest.raises(FabricError, match="no mdev"):
        vm.add_device(0x11)
    # what the CLI's hot-add does first: reserve and create the mdev
    xml2 = domain_xml("web", 1 * GiB, fdids=(0x12, 0x11))
    cluster.prepare(xml2)
    vm.add_device(0x11)
    vm.enable_device(0x11)
    vm.dma_write(0x11, 0x3000, b"gpu")
    assert vm.guest.read(0x3000, 3) == b"gpu"


def test_vm_starts_without_devices_whose_mdev_is_missing(cluster):
    xml = domain_xml("web", 1 * GiB, fdids=(0x12,))
    vm = SimVm(xml, hardware=cluster.hw, fabric=cluster.fabric())
    assert vm.devices() == []
    vm.stop()


def test_a_stopped_guest_cannot_be_pinned_and_stop_refuses_nothing_pinned(cluster):
    vm = cluster.start(domain_xml("web", 1 * GiB))
    vm.enable_device(0x12)
    with pytest.raises(PinError):
        vm.guest.stop()  # the windows pin it: the guest's RAM stays while a device maps it
    vm.stop()
    assert not vm.guest.running


def test_bad_domain_xml_is_refused_before_anything_exists(cluster):
    with pytest.raises(Exception, match="machine"):
        SimVm(
            domain_xml("web", 1 * GiB).replace(b'machine="q35"', b'machine="microvm"'),
            hardware=cluster.hw,
            fabric=cluster.fabric(),
        )
    assert cluster.hw.guests() == []


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def program_bar(self, fdid: int, bar_index: int, gpa: int, size: int) -> None:
        self.calls.append(("bar", fdid, bar_index, gpa, size))

    def remove_device(self, fdid: int) -> None:
        self.calls.append(("remove", fdid))


def test_p2p_observer_sees_guest_bar_addresses_and_removal(cluster):
    p2p = Recorder()
    vm = cluster.start(domain_xml("web", 1 * GiB, fdids=(0x10,)), p2p=p2p)
    vm.enable_device(0x10)
    placed = {b.index: b for b in vm.bars(0x10)}
    # nothing while decoding was off (firmware sizes BARs with decoding off)
    assert sorted(p2p.calls) == sorted(
        ("bar", 0x10, i, b.address, b.size) for i, b in placed.items()
    )
    p2p.calls.clear()
    vm.config_write(0x10, regs.COMMAND, 2, 0)  # decoding off: the BARs are gone for peers
    assert sorted(p2p.calls) == [("bar", 0x10, i, 0, b.size) for i, b in sorted(placed.items())]
    p2p.calls.clear()
    vm.config_write(0x10, regs.COMMAND, 2, regs.COMMAND_MEMORY)
    assert len(p2p.calls) == 3
    p2p.calls.clear()
    vm.remove_device(0x10)
    assert p2p.calls == [("remove", 0x10)]


def test_flr_by_the_guest_tears_down_windows_and_clears_bars(cluster):
    vm = cluster.start(domain_xml("web", 1 * GiB))
    vm.enable_device(0x12)
    from vmlend.sim.pci.config import EXP_OFFSET

    vm.config_write(0x12, EXP_OFFSET + regs.EXP_DEVCTL, 2, regs.EXP_DEVCTL_BCR_FLR)
    s = vm.session(0x12)
    assert not s.dma_active and vm.guest.pinned_bytes == 0
    assert s.guest_bar(0) is None
    assert cluster.runtime() == []
    assert cluster.hw.borrowed(0x12) is not None  # still the VM's device
    vm.enable_device(0x12)
    assert s.dma_active


def test_msi_and_command_writes_reach_the_physical_listeners(cluster):
    vm = cluster.start(domain_xml("web", 1 * GiB, fdids=(0x12,)))
    seen: list[tuple[int, int, int]] = []
    cluster.hw.device(0x12).config.add_listener(lambda o, s, v: seen.append((o, s, v)))
    vm.enable_device(0x12)
    from vmlend.sim.pci.config import MSI_OFFSET, MSIX_OFFSET

    vm.config_write(0x12, MSI_OFFSET + regs.MSI_FLAGS, 2, regs.MSI_FLAGS_ENABLE)
    vm.config_write(0x12, MSIX_OFFSET + regs.MSIX_FLAGS, 2, regs.MSIX_FLAGS_ENABLE)
    assert (MSI_OFFSET + regs.MSI_FLAGS, 2, regs.MSI_FLAGS_ENABLE) in seen
    assert (MSIX_OFFSET + regs.MSIX_FLAGS, 2, regs.MSIX_FLAGS_ENABLE) in seen
    assert any(o == regs.COMMAND and v & regs.COMMAND_MASTER for o, _s, v in seen)
    assert not any(regs.BASE_ADDRESS_0 <= o < 0x28 for o, _s, _v in seen)  # BARs are virtual
    assert cluster.hw.device(0x12).config.msix().enabled
    assert vm.config_read(0x12, MSIX_OFFSET + regs.MSIX_FLAGS, 2) & regs.MSIX_FLAGS_ENABLE


def test_guest_mmio_reaches_the_bar_at_the_guest_address(cluster):
    vm = cluster.start(domain_xml("web", 1 * GiB, fdids=(0x12,)))
    vm.enable_device(0x12)
    (bar0,) = vm.bars(0x12)
    table = bar0.address + 0x2000  # the MSI-X table (BAR 0, offset 0x2000)
    vm.mmio_write(table, 4, 0xFEE0_0000)
    assert cluster.hw.device(0x12).bars.msix_entry(0).address == 0xFEE0_0000
    assert vm.mmio_read(table + 12, 4) & 1  # vector control: masked at reset
    with pytest.raises(FabricError, match="decodes"):
        vm.mmio_read(vm.layout.below_4g, 4)
    vm.config_write(0x12, regs.COMMAND, 2, 0)  # decoding off: the guest address is dead
    with pytest.raises(FabricError):
        vm.mmio_read(table, 4)


def test_borrow_refused_leaves_the_device_disabled(cluster):
    xml = domain_xml("web", 1 * GiB, fdids=(0x12,))
    vm = cluster.start(xml)
    cluster.fabric().set_node_up("alpha", False, "cable pulled")
    with pytest.raises(Exception, match="alpha"):
        vm.enable_device(0x12)
    s = vm.session(0x12)
    assert not s.borrowed and cluster.hw.borrowed(0x12) is None
    assert not vm.config_read(0x12, regs.COMMAND, 2) & regs.COMMAND_MASTER
    cluster.fabric().set_node_up("alpha", True)
    vm.enable_device(0x12)
    assert s.borrowed and s.dma_active and s.refusal is None


def _layout(machine: str, memory: int):
    from vmlend.memory.domain_memory import domain_layout

    return domain_layout(domain_xml("x", memory, machine))


def test_firmware_places_32_bit_bars_in_the_hole_around_q35_mmconfig():
    from vmlend.errors import ResourceExhaustedError
    from vmlend.sim.simvm import GuestBarAllocator
    from vmlend.topology.model import BarKind, BarSpec

    alloc = GuestBarAllocator(_layout("q35", 2 * GiB))  # all low: RAM ends at 2 GiB
    half = BarSpec(0, 512 * MiB, BarKind.MEM32)
    assert alloc.place(half) == 2 * GiB
    assert alloc.place(half) == 3 * GiB  # 2.5 GiB would overlap MMCONFIG at 0xb0000000
    with pytest.raises(ResourceExhaustedError, match="32-bit PCI hole"):
        alloc.place(BarSpec(0, 1 * GiB, BarKind.MEM32))
    big = GuestBarAllocator(_layout("q35", 8 * GiB))  # high RAM ends at 10 GiB
    assert big.place(BarSpec(1, 32 * GiB, BarKind.MEM64)) == 32 * GiB
    assert big.place(BarSpec(3, 32 * MiB, BarKind.MEM64)) == 64 * GiB
    pc = GuestBarAllocator(_layout("pc", 4 * GiB))  # 3 GiB low: the hole starts there
    assert pc.place(BarSpec(0, 16 * MiB, BarKind.MEM32)) == 3 * GiB
    assert pc.place(BarSpec(2, 256, BarKind.IO)) == 0xC000


def test_release_while_the_vm_runs_takes_the_windows_down(cluster):
    # The lender resets the device when it is given back; the session must follow without
    # writing the registry inside the fabric's own transaction (that would wait on itself).
    xml = domain_xml("web", 1 * GiB, fdids=(0x12,))
    vm = cluster.start(xml)
    vm.enable_device(0x12)
    cluster.release(xml)
    s = vm.session(0x12)
    assert not s.dma_active and vm.guest.pinned_bytes == 0
    assert cluster.hw.borrowed(0x12) is None
    assert cluster.hw.adapter("alpha:0").mapped_segments() == []
    assert cluster.runtime() == []
    vm.stop()


def test_give_back_by_the_fabric_while_running_forgets_the_records(cluster):
    xml = domain_xml("web", 1 * GiB, fdids=(0x12,))
    vm = cluster.start(xml)
    vm.enable_device(0x12)
    cluster.fabric().give_back(0x12, vm.holder)
    assert not vm.session(0x12).dma_active
    vm.config_write(0x12, regs.COMMAND, 2, 0)  # any later guest access settles the records
    assert cluster.runtime() == []
    vm.stop()
