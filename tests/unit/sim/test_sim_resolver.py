"""The DMA resolver: an end-to-end lent path, peer-to-peer, and every fault with its hop."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from vmlend.errors import DmaFault
from vmlend.sim.guest import SimGuest
from vmlend.sim.hardware import SimHardware
from vmlend.sim.hostmem import FRAME
from vmlend.sim.ntb import NtbAdapter
from vmlend.sim.pci import regs
from vmlend.topology.model import GiB, GuestRange, MiB
from vmlend.topology.parse import load_topology

NVME, GPU, GPU2, BETA_GPU = 0x12, 0x10, 0x11, 0x20
GUEST_RAM = [GuestRange(0, 8 * MiB), GuestRange(4 * GiB, 4 * GiB + 4 * MiB)]
BORROWER_IOVA = 0x40_0000_0000  # where the VM's low RAM sits in gamma's per-VM domain
SEGMENT = 5  # lender window segment of the low RAM; high RAM uses the next one


@dataclass
class Lent:
    hw: SimHardware
    guest: SimGuest
    window: NtbAdapter


@pytest.fixture(scope="module")
def topology():
    return load_topology()


def enable(hw: SimHardware, fdid: int) -> None:
    hw.device(fdid).config.write(regs.COMMAND, 2, regs.COMMAND_MEMORY | regs.COMMAND_MASTER)


def lend_to_guest(hw: SimHardware, fdid: int, backing: int = FRAME) -> Lent:
    """By hand, what the DMA-window code will do: pin the guest, make each RAM range
    contiguous in gamma's per-VM domain, point one alpha window segment at each, and map
    IOVA = GPA in the device's lender domain onto those segments."""
    guest = hw.create_guest("gamma", "web", GUEST_RAM, backing=backing)
    hw.borrow(fdid, "gamma", "web")
    vm_dom = hw.vm_domain("gamma", "web")
    window = hw.adapter("alpha:0")
    lender = hw.lender_domain(fdid)
    for i, r in enumerate(GUEST_RAM):
        iova = BORROWER_IOVA + i * window.segment_size
        window.map_segment(SEGMENT + i, "gamma", iova)
        for f in guest.pin(r.start, r.size):
            vm_dom.map(iova + f.gpa - r.start, f.phys, f.size)
        lender.map(r.start, window.segment_base(SEGMENT + i), r.size)
    enable(hw, fdid)
    return Lent(hw, guest, window)


@pytest.fixture
def hw(topology) -> SimHardware:
    return SimHardware.from_topology(topology, seed=11)


@pytest.fixture
def lent(hw) -> Lent:
    return lend_to_guest(hw, NVME)


def test_dma_write_lands_in_the_guest_page_byte_for_byte(lent):
    hw, guest = lent.hw, lent.guest
    data = bytes((i * 7 + 3) & 0xFF for i in range(3 * FRAME + 100))
    gpa = 4 * GiB + 0x1_0F00  # high RAM, crossing several scattered 4 KiB frames
    targets = hw.dma_write(NVME, gpa, data)
    assert guest.read(gpa, len(data)) == data
    frames = [t.address // FRAME for t in targets]
    assert len(set(frames)) == 4  # 0x100 bytes, three whole pages, the rest
    assert any(b != a + 1 for a, b in itertools.pairwise(frames))  # scattered
    for t in targets:
        assert t.node == "gamma" and t.kind == "ram" and t.owner == "web"
    # byte for byte in the host pages themselves, and nothing around them
    gamma = hw.node("gamma").memory
    assert gamma.read(guest.host_address(gpa), 16) == data[:16]
    assert guest.read(gpa - 8, 8) == bytes(8)
    assert hw.dma_read(NVME, gpa, len(data)) == data


def test_target_reports_every_hop(lent):
    t = lent.hw.resolve_dma(NVME, 0x1234, write=True)
    assert [h.stage for h in t.hops] == [
        "device",
        "lender-iommu",
        "ntb-segment",
        "lut",
        "borrower-iommu",
        "ram",
    ]
    assert [h.node for h in t.hops] == ["alpha", "alpha", "gamma", "gamma", "gamma", "gamma"]
    assert t.hops[1].address == lent.window.segment_base(SEGMENT) + 0x1234
    assert t.hops[2].address == BORROWER_IOVA + 0x1234
    assert t.address == lent.guest.host_address(0x1234)
    assert t.crossed_ntb
    assert "lender-iommu@alpha" in t.describe()


def test_dma_read_sees_what_the_guest_wrote(lent):
    lent.guest.write(0x2000, b"doorbell")
    assert lent.hw.dma_read(NVME, 0x2000, 8) == b"doorbell"


def test_hugepage_backed_guest(hw):
    lent = lend_to_guest(hw, NVME, backing=2 * MiB)
    assert hw.vm_domain("gamma", "web").entries()[2 * MiB] == 6
    hw.dma_write(NVME, 7 * MiB, b"end of low ram")
    assert lent.guest.read(7 * MiB, 14) == b"end of low ram"


# --- faults ----------------------------------------------------------------------------------


def fault(hw: SimHardware, fdid: int, iova: int, write: bool = False) -> DmaFault:
    with pytest.raises(DmaFault) as e:
        hw.resolve_dma(fdid, iova, write=write)
    return e.value


def test_fault_dma_limit(lent):
    hw = lent.hw
    enable(hw, GPU)
    f = fault(hw, GPU, 1 << 40)
    assert f.hop == "dma-limit" and "40 bits" in f.why
    assert fault(hw, GPU, (1 << 40) - FRAME).hop == "lender-iommu"  # just below is fine


def test_fault_bus_master_off(lent):
    lent.hw.device(NVME).config.write(regs.COMMAND, 2, regs.COMMAND_MEMORY)
    assert fault(lent.hw, NVME, 0x1000).hop == "bus-master"


def test_fault_lender_iommu_unmapped(lent):
    # the PCI hole of the guest is never mapped: exactly the RAM ranges are
    f = fault(lent.hw, NVME, 3 * GiB)
    assert f.hop == "lender-iommu" and "not mapped" in f.why and "alpha:dev0x12" in f.why


def test_fault_lender_iommu_read_only(hw):
    enable(hw, GPU)
    hw.lender_domain(GPU).map(0, 0x1000_0000, FRAME, writable=False)
    assert hw.resolve_dma(GPU, 0x10).node == "alpha"
    assert fault(hw, GPU, 0x10, write=True).hop == "lender-iommu"


def test_fault_ntb_segment_unmapped(lent):
    hw = lent.hw
    lent.window.unmap_segment(SEGMENT)
    f = fault(hw, NVME, 0x1000)
    assert f.hop == "ntb-segment" and f"segment {SEGMENT}" in f.why


def test_fault_lut_when_not_borrowed(lent):
    hw = lent.hw
    # a second device with a lender mapping into the same window but never borrowed
    enable(hw, GPU2)
    hw.lender_domain(GPU2).map(0, lent.window.segment_base(SEGMENT), 1 * MiB)
    f = fault(hw, GPU2, 0x1000)
    assert f.hop == "lut" and "42:00.0" in f.why


def test_fault_lut_after_give_back(lent):
    hw = lent.hw
    hw.give_back(NVME)
    enable(hw, NVME)
    # the end of the borrow emptied the device's own domain
    assert hw.lender_domain(NVME).mappings() == []
    assert fault(hw, NVME, 0x1000).hop == "lender-iommu"
    # a stale mapping made afterwards still cannot cross: the requester left the LUT
    hw.lender_domain(NVME).map(0, lent.window.segment_base(SEGMENT), 1 * MiB)
    assert fault(hw, NVME, 0x1000).hop == "lut"


def test_fault_borrower_iommu_unmapped(lent):
    hw = lent.hw
    hw.vm_domain("gamma", "web").unmap(BORROWER_IOVA + 0x1000, FRAME)
    f = fault(hw, NVME, 0x1000)
    assert f.hop == "borrower-iommu" and "gamma:vm:web" in f.why
    assert hw.resolve_dma(NVME, 0x2000).kind == "ram"


def test_fault_other_node_does_not_know_the_device(lent):
    # alpha's LUT lets the device cross, but beta's adapter has no entry naming it: dropped
    hw = lent.hw
    lent.window.map_segment(SEGMENT + 3, "beta", 0)
    hw.lender_domain(NVME).map(1 << 44, lent.window.segment_base(SEGMENT + 3), FRAME)
    f = fault(hw, NVME, 1 << 44)
    assert f.hop == "lut" and "requester LUT of beta:0" in f.why
    # with an entry, beta's IOMMU still knows nothing of the id it assigns: isolation holds
    hw.adapter("beta:0").lut_add(hw.requester_key(NVME))
    f = fault(hw, NVME, 1 << 44)
    assert f.hop == "borrower-iommu" and "no IOMMU domain on beta" in f.why


def test_fault_no_target_on_the_lender(hw):
    enable(hw, GPU)
    hw.lender_domain(GPU).map(0, 0xF000_0000, FRAME)  # the 32-bit hole: nothing decodes it
    f = fault(hw, GPU, 0)
    assert f.hop == "no-target" and "alpha" in f.why


def test_fault_no_target_hosts_do_not_forward(lent):
    hw = lent.hw
    gamma_window = hw.adapter("gamma:0").segment_base(0)
    hw.vm_domain("gamma", "web").map(0x80_0000_0000, gamma_window, FRAME)
    lent.window.map_segment(SEGMENT + 4, "gamma", 0x80_0000_0000)
    hw.lender_domain(NVME).map(1 << 45, lent.window.segment_base(SEGMENT + 4), FRAME)
    f = fault(hw, NVME, 1 << 45)
    assert f.hop == "no-target" and "do not forward" in f.why


def test_a_fault_writes_nothing(lent):
    hw = lent.hw
    # the last page of low RAM is mapped, the next (PCI hole) is not
    with pytest.raises(DmaFault):
        hw.dma_write(NVME, 8 * MiB - 4, b"12345678")
    assert lent.guest.read(8 * MiB - 4, 4) == bytes(4)


# --- peer-to-peer ----------------------------------------------------------------------------


def test_p2p_to_a_bar_on_the_same_lender(hw):
    enable(hw, GPU)
    peer = hw.device(GPU2)
    bar_start, _ = peer.bar_range(1)
    hw.lender_domain(GPU).map(0x80_0000_0000, bar_start, 1 * GiB)
    t = hw.resolve_dma(GPU, 0x80_0000_0000 + 0x40, write=True)
    assert (t.node, t.kind, t.owner, t.bar, t.offset) == ("alpha", "bar", GPU2, 1, 0x40)
    assert not t.crossed_ntb
    hw.dma_write(GPU, 0x80_0000_0000 + 0x40, b"p2p!")
    assert peer.bars.read_bytes(1, 0x40, 4) == b"p2p!"
    assert hw.dma_read(GPU, 0x80_0000_0040, 4) == b"p2p!"


def test_p2p_to_a_bar_on_another_lender(hw):
    # GPU on alpha borrowed by gamma/web writes into beta's GPU BAR through alpha -> beta.
    enable(hw, GPU)
    hw.borrow(GPU, "gamma", "web")
    beta_gpu = hw.device(BETA_GPU)
    bar_start, _ = beta_gpu.bar_range(3)
    beta_dom = hw.vm_domain("beta", "web")
    beta_dom.map(0x2000_0000, bar_start, 32 * MiB)
    requester = hw.attach_ingress(GPU, "beta", beta_dom)
    window = hw.adapter("alpha:0")
    window.map_segment(0, "beta", 0)
    hw.lender_domain(GPU).map(0xE000_0000, window.segment_base(0) + 0x2000_0000, 32 * MiB)
    hw.dma_write(GPU, 0xE000_0010, b"from alpha")
    assert beta_gpu.bars.read_bytes(3, 0x10, 10) == b"from alpha"
    t = hw.resolve_dma(GPU, 0xE000_0010)
    assert (t.node, t.owner, t.hops[2].node) == ("beta", BETA_GPU, "beta")
    hw.give_back(GPU)
    assert hw.node("beta").iommu.domain_for(requester) is None


def test_p2p_into_msix_table_obeys_its_rules(hw):
    enable(hw, GPU)
    nvme = hw.device(NVME)
    bar_start, _ = nvme.bar_range(0)
    hw.lender_domain(GPU).map(0, bar_start, 16 * 1024)
    hw.dma_write(GPU, 0x2000 + 12, b"\0\0\0\0")  # unmask vector 0 by a peer write
    assert not nvme.bars.msix_entry(0).masked


def test_p2p_write_past_a_bar_end_faults_and_writes_nothing(hw):
    enable(hw, GPU)
    nvme = hw.device(NVME)
    start, end = nvme.bar_range(0)
    hw.lender_domain(GPU).map(0, start, end - start)
    hw.dma_write(GPU, end - start - 4, b"last")  # up to the last byte is fine
    with pytest.raises(DmaFault) as e:
        hw.dma_write(GPU, end - start - 2, b"abcd")
    assert e.value.hop == "lender-iommu"
    assert nvme.bars.read_bytes(0, end - start - 4, 4) == b"last"


def test_p2p_to_a_bar_with_memory_decoding_off_faults(hw):
    enable(hw, GPU)
    peer = hw.device(GPU2)
    hw.lender_domain(GPU).map(0, peer.bar_range(0)[0], 16 * MiB)
    assert hw.resolve_dma(GPU, 0x100).owner == GPU2
    peer.config.write(regs.COMMAND, 2, 0)  # e.g. while the OS sizes its BARs
    f = fault(hw, GPU, 0x100)
    assert f.hop == "no-target" and "decoding is off" in f.why
