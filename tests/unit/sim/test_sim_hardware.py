"""SimHardware: built from a topology, address maps, devices, borrowing, guests."""

from __future__ import annotations

import itertools

import pytest

from vmlend.errors import (
    DeviceHeldError,
    FabricError,
    PinError,
    ResourceExhaustedError,
    UnknownDeviceError,
    UnknownNodeError,
)
from vmlend.sim.hardware import SimHardware
from vmlend.sim.invariants import check_hardware
from vmlend.sim.iommu import IommuDomain, Requester
from vmlend.sim.pci import regs
from vmlend.topology.model import GiB, GuestRange, MiB
from vmlend.topology.parse import load_topology, parse_topology


@pytest.fixture(scope="module")
def topology():
    return load_topology()


@pytest.fixture
def hw(topology) -> SimHardware:
    return SimHardware.from_topology(topology)


def test_every_node_adapter_and_device_exists(hw, topology):
    assert set(hw.nodes) == {"alpha", "beta", "gamma"}
    assert [a.ref for a in hw.adapters()] == ["alpha:0", "beta:0", "gamma:0", "gamma:1"]
    assert [d.fdid for d in hw.devices()] == sorted(d.fdid for d in topology.devices)
    assert hw.adapter("gamma:0").peers == {"alpha", "beta"}


def test_bars_are_placed_naturally_aligned_without_overlap(hw):
    for node in hw.nodes.values():
        regions = node.address_map.regions()
        for a, b in itertools.pairwise(regions):
            assert a.end <= b.start
        for r in regions:
            if r.kind != "ram":
                assert r.start % r.size == 0
    gpu = hw.device(0x10)
    start, end = gpu.bar_range(0)
    assert end - start == 16 * MiB and end <= 4 * GiB  # a 32-bit BAR sits below 4 GiB
    start, end = gpu.bar_range(1)
    assert end - start == 32 * GiB and start >= 4 * GiB


def test_config_bars_hold_the_lender_addresses(hw):
    gpu = hw.device(0x10)
    for index in (0, 1, 3):
        assert gpu.config.bar_address(index) == gpu.bar_phys[index]
    assert gpu.config.command & regs.COMMAND_MEMORY
    assert not gpu.config.bus_master


def test_requester_ids_and_vfs(hw):
    assert hw.device(0x10).requester_id == 0x4100
    vf = hw.device(0x22)
    assert vf.spec.physfn == 0x21 and vf.requester_id == 0x8201
    assert vf.config.read(regs.INTERRUPT_PIN, 1) == 0
    assert vf.config.find_capability(regs.CAP_ID_MSIX) is not None


def test_each_device_has_its_own_lender_domain(hw):
    a, b = hw.lender_domain(0x10), hw.lender_domain(0x11)
    assert a is not b
    alpha = hw.node("alpha")
    assert alpha.iommu.domain_for(Requester(0x4100)) is a
    assert alpha.iommu.domain_for(Requester(0x4200)) is b


def test_lookups_of_unknown_things(hw):
    with pytest.raises(UnknownDeviceError):
        hw.device(0x99)
    with pytest.raises(UnknownNodeError):
        hw.vm_domain("delta", "x")
    with pytest.raises(FabricError, match="unknown NTB adapter"):
        hw.adapter("alpha:7")
    with pytest.raises(FabricError, match="no guest"):
        hw.guest("gamma", "nobody")


def test_borrow_uses_a_lut_entry_on_each_side(hw):
    b = hw.borrow(0x10, "gamma", "web")
    assert b.path.src.ref == "alpha:0" and b.path.dst.ref == "gamma:0"
    assert hw.adapter("alpha:0").lut_lookup(0x4100) == b.lender_entry
    assert hw.adapter("alpha:0").lut_free == 29
    assert hw.adapter("gamma:0").lut_free == 29
    assert hw.node("gamma").iommu.domain_for(b.ingress) is hw.vm_domain("gamma", "web")
    assert hw.borrow(0x10, "gamma", "web") == b  # idempotent
    assert hw.borrowed(0x10) == b


def test_borrow_is_exclusive(hw):
    hw.borrow(0x10, "gamma", "web")
    with pytest.raises(DeviceHeldError, match="gamma/web"):
        hw.borrow(0x10, "gamma", "db")
    with pytest.raises(DeviceHeldError):
        hw.give_back(0x10, "gamma", "db")


def test_give_back_frees_everything_and_resets_the_device(hw):
    b = hw.borrow(0x12, "gamma", "web")
    dev = hw.device(0x12)
    dev.config.write(regs.COMMAND, 2, regs.COMMAND_MEMORY | regs.COMMAND_MASTER)
    dev.bars.write(0, 0x2000 + 12, 4, 0)  # unmask MSI-X vector 0
    assert hw.give_back(0x12, "gamma", "web")
    assert hw.adapter("alpha:0").lut_free == 30 and hw.adapter("gamma:0").lut_free == 30
    assert hw.node("gamma").iommu.domain_for(b.ingress) is None
    assert not dev.config.bus_master and dev.bars.msix_entry(0).masked
    assert dev.config.bar_address(0) == dev.bar_phys[0]  # BARs restored after reset
    assert not hw.give_back(0x12)  # idempotent
    hw.borrow(0x12, "gamma", "db")  # free for someone else now


def test_local_borrow_needs_no_lut(hw):
    b = hw.borrow(0x10, "alpha", "local")
    assert b.path is None and b.lender_entry is None
    assert hw.adapter("alpha:0").lut_free == 30


SMALL_LUT = """
name = "small"
[[node]]
name = "a"
id = 1
  [[node.adapter]]
  index = 0
  window = "64GiB"
  lut_entries = 4
  cpus = 1
  [[node.device]]
  fdid = 1
  bdf = "0000:01:00.0"
  kind = "nic"
  vendor = 0x8086
  device = 0x1
  class = 0x020000
  [[node.device]]
  fdid = 2
  bdf = "0000:02:00.0"
  kind = "nic"
  vendor = 0x8086
  device = 0x1
  class = 0x020000
  [[node.device]]
  fdid = 3
  bdf = "0000:03:00.0"
  kind = "nic"
  vendor = 0x8086
  device = 0x1
  class = 0x020000
[[node]]
name = "b"
id = 2
  [[node.adapter]]
  index = 0
  window = "64GiB"
[[link]]
ends = ["a:0", "b:0"]
"""


def test_lut_exhaustion_on_borrow_changes_nothing():
    hw = SimHardware.from_topology(parse_topology(SMALL_LUT))
    hw.borrow(1, "b", "vm1")
    hw.borrow(2, "b", "vm1")
    with pytest.raises(ResourceExhaustedError, match="requester LUT entries on adapter a:0"):
        hw.borrow(3, "b", "vm1")
    assert hw.borrowed(3) is None
    assert hw.adapter("b:0").lut_free == 28  # the borrower side was not touched
    hw.give_back(1)
    hw.borrow(3, "b", "vm1")


def test_guests(hw):
    g = hw.create_guest("gamma", "web", [GuestRange(0, 64 * MiB)])
    assert hw.guest("gamma", "web") is g and g.running
    with pytest.raises(FabricError, match="already exists"):
        hw.create_guest("gamma", "web", [GuestRange(0, 64 * MiB)])
    g.pin(0, 4 * MiB)
    with pytest.raises(PinError):
        hw.destroy_guest("gamma", "web")
    g.unpin(0, 4 * MiB)
    hw.destroy_guest("gamma", "web")
    assert hw.node("gamma").memory.allocated_bytes == 0
    with pytest.raises(FabricError):
        hw.guest("gamma", "web")


def test_guest_created_stopped_has_no_memory(hw):
    g = hw.create_guest("gamma", "web", [GuestRange(0, 64 * MiB)], running=False)
    assert not g.can_pin(0)
    g.start()
    assert g.can_pin(0)


def test_vm_domains_are_per_vm(hw):
    assert hw.vm_domain("gamma", "a") is hw.vm_domain("gamma", "a")
    assert hw.vm_domain("gamma", "a") is not hw.vm_domain("gamma", "b")
    assert hw.vm_domain("gamma", "a") is not hw.vm_domain("beta", "a")


def test_interrupts_reach_every_sink_until_removed(hw):
    dev = hw.device(0x12)
    got: list[int] = []
    remove = dev.on_interrupt(got.append)
    assert dev.raise_interrupt(31) == 1
    remove()
    assert dev.raise_interrupt(0) == 0
    assert got == [31]
    with pytest.raises(ValueError):
        dev.raise_interrupt(32)


def test_flr_through_config_space_resets_the_device(hw):
    dev = hw.device(0x12)
    resets: list[bool] = []
    dev.on_reset(lambda: resets.append(True))
    dev.config.write(regs.COMMAND, 2, regs.COMMAND_MEMORY | regs.COMMAND_MASTER)
    exp = dev.config.find_capability(regs.CAP_ID_EXP)
    dev.config.write(exp + regs.EXP_DEVCTL, 2, regs.EXP_DEVCTL_BCR_FLR)
    assert resets == [True] and dev.resets == 1
    assert not dev.config.bus_master


def test_ingress_needs_a_borrow_and_a_crossing(hw):
    with pytest.raises(FabricError, match="borrow it"):
        hw.ingress(0x10, "gamma")
    with pytest.raises(FabricError, match="local"):
        hw.ingress(0x10, "alpha")
    b = hw.borrow(0x10, "gamma", "web")
    assert hw.ingress(0x10, "gamma") == b.ingress
    # beta's adapter does not know the device: nothing entering beta carries an id for it
    with pytest.raises(FabricError, match="no LUT entry on beta:0"):
        hw.ingress(0x10, "beta")
    domain = IommuDomain("beta:p2p")
    requester = hw.attach_ingress(0x10, "beta", domain)
    assert requester.rid >> 8 == hw.adapter("beta:0").bus
    assert hw.node("beta").iommu.domain_for(requester) is domain
    assert hw.detach_ingress(0x10, "beta")
    assert hw.adapter("beta:0").lut_lookup(hw.requester_key(0x10)) is None


def test_two_lenders_devices_enter_with_distinct_requester_ids(hw):
    # both are the first device lent by their lender: the same outbound LUT entry on alpha:0
    # and beta:0, yet gamma sees two ids, assigned by gamma:0's own entries
    a = hw.borrow(0x10, "gamma", "web")
    b = hw.borrow(0x20, "gamma", "db")
    assert a.lender_entry == b.lender_entry
    assert a.ingress is not None and b.ingress is not None
    assert a.ingress.rid != b.ingress.rid
    gamma0 = hw.adapter("gamma:0")
    assert a.ingress.rid == gamma0.assigned_requester_id(a.borrower_entry, hw.requester_key(0x10))
    assert b.ingress.rid == gamma0.assigned_requester_id(b.borrower_entry, hw.requester_key(0x20))
    assert check_hardware(hw) == []


def test_two_borrowed_devices_cross_with_distinct_requesters(hw):
    a = hw.borrow(0x10, "gamma", "web")
    b = hw.borrow(0x20, "gamma", "db")  # from beta, through the same switch
    assert a.ingress != b.ingress
    gamma = hw.node("gamma").iommu
    assert gamma.domain_for(a.ingress) is hw.vm_domain("gamma", "web")
    assert gamma.domain_for(b.ingress) is hw.vm_domain("gamma", "db")


SAME_BDF = """
name = "same-bdf"
[[node]]
name = "l1"
id = 1
  [[node.adapter]]
  index = 0
  [[node.device]]
  fdid = 1
  bdf = "0000:01:00.0"
  kind = "nic"
  vendor = 0x8086
  device = 0x1521
  class = 0x020000
[[node]]
name = "l2"
id = 3
  [[node.adapter]]
  index = 0
  [[node.device]]
  fdid = 2
  bdf = "0000:01:00.0"
  kind = "nic"
  vendor = 0x8086
  device = 0x1521
  class = 0x020000
[[node]]
name = "b"
id = 2
  [[node.adapter]]
  index = 0
[[switch]]
name = "sw"
ports = ["l1:0", "l2:0", "b:0"]
"""


def test_same_bdf_on_two_lenders_crosses_as_two_requesters():
    """Two lenders' devices at one BDF, borrowed by two VMs on one node: the borrower's LUT
    tells them apart by lender, so neither borrow nor give-back of one touches the other."""
    hw = SimHardware.from_topology(parse_topology(SAME_BDF))
    assert hw.device(1).requester_id == hw.device(2).requester_id
    first = hw.borrow(1, "b", "vm1")
    second = hw.borrow(2, "b", "vm2")
    assert first.borrower_entry != second.borrower_entry
    assert first.ingress is not None and second.ingress is not None
    assert first.ingress != second.ingress
    iommu = hw.node("b").iommu
    assert iommu.domain_for(first.ingress) is hw.vm_domain("b", "vm1")
    assert iommu.domain_for(second.ingress) is hw.vm_domain("b", "vm2")
    assert check_hardware(hw) == []
    hw.give_back(2)
    assert hw.ingress(1, "b") == first.ingress
    assert iommu.domain_for(first.ingress) is hw.vm_domain("b", "vm1")
    assert check_hardware(hw) == []


TOO_MANY_32BIT_BARS = """
name = "crowded"
[[node]]
name = "a"
id = 1
  [[node.device]]
  fdid = 1
  bdf = "0000:01:00.0"
  kind = "gpu"
  vendor = 0x10de
  device = 0x1
  class = 0x030000
  bars = [ { index = 0, size = "1GiB" }, { index = 1, size = "1GiB" } ]
"""


def test_32_bit_mmio_space_runs_out():
    with pytest.raises(ResourceExhaustedError, match="32-bit MMIO space on a"):
        SimHardware.from_topology(parse_topology(TOO_MANY_32BIT_BARS))


def test_io_bars_get_ports_not_memory():
    text = TOO_MANY_32BIT_BARS.replace(
        '{ index = 0, size = "1GiB" }, { index = 1, size = "1GiB" }',
        '{ index = 0, size = "256B", kind = "io" }, { index = 1, size = "4KiB" }',
    )
    hw = SimHardware.from_topology(parse_topology(text))
    dev = hw.device(1)
    assert 0x1000 <= dev.bar_phys[0] < 0x10000
    assert hw.node("a").address_map.find(dev.bar_phys[0]).kind == "ram"  # ports are not memory
    assert dev.config.command & regs.COMMAND_IO
    assert dev.config.read(regs.BASE_ADDRESS_0, 4) == dev.bar_phys[0] | regs.BAR_SPACE_IO
