"""The invariant checker finds each kind of unjustified state, and nothing in a clean one."""

from __future__ import annotations

import pytest

from vmlend.registry import Claim, ClaimKind, HoldRecord, Phase
from vmlend.sim.hardware import SimHardware
from vmlend.sim.invariants import check_hardware
from vmlend.sim.iommu import IommuDomain, Requester
from vmlend.sim.ntb import requester_device
from vmlend.topology.model import GiB, GuestRange, Holder, MiB
from vmlend.topology.parse import load_topology

GPU, GPU2, NVME, BETA_GPU = 0x10, 0x11, 0x12, 0x20


@pytest.fixture
def hw() -> SimHardware:
    hw = SimHardware.from_topology(load_topology())
    hw.create_guest("gamma", "web", [GuestRange(0, 1 * GiB)], backing=GiB)
    hw.create_guest("gamma", "db", [GuestRange(0, 1 * GiB)], backing=GiB)
    return hw


def kinds(hw: SimHardware, **kw) -> list[str]:
    return sorted({v.kind for v in check_hardware(hw, **kw)})


def test_a_clean_cluster_and_plain_borrows_violate_nothing(hw):
    assert check_hardware(hw) == []
    hw.borrow(GPU, "gamma", "web")
    hw.borrow(BETA_GPU, "gamma", "web")
    hw.borrow(NVME, "gamma", "db")
    assert check_hardware(hw) == []
    hw.give_back(GPU)
    assert check_hardware(hw) == []


def test_a_mapping_of_a_device_nobody_borrowed(hw):
    hw.lender_domain(GPU).map(0, hw.device(GPU2).bar_range(0)[0], 4096)
    (v,) = check_hardware(hw)
    assert (v.kind, v.where.split()[0]) == ("lender-iommu", "alpha:dev0x10")
    assert "not borrowed" in str(v)


def test_a_peer_mapping_into_another_vms_device(hw):
    hw.borrow(GPU, "gamma", "web")
    hw.borrow(GPU2, "gamma", "db")
    hw.lender_domain(GPU).map(0, hw.device(GPU2).bar_range(1)[0], 2 * MiB)
    (v,) = check_hardware(hw)
    assert v.kind == "lender-iommu" and "held by gamma/db" in v.detail


def test_stale_segment_lut_entry_and_context(hw):
    adapter = hw.adapter("alpha:0")
    adapter.map_segment(3, "gamma", 0)
    adapter.lut_add(hw.device(NVME).requester_id)
    hw.node("gamma").iommu.attach(Requester(0xF0AA), hw.vm_domain("gamma", "web"))
    assert kinds(hw) == ["context", "lut", "ntb-segment"]


def test_a_crossing_into_another_vms_domain(hw):
    hw.borrow(NVME, "gamma", "web")
    ingress = hw.ingress(NVME, "gamma")
    hw.node("gamma").iommu.detach(ingress)
    hw.node("gamma").iommu.attach(ingress, hw.vm_domain("gamma", "db"))
    (v,) = check_hardware(hw)
    assert v.kind == "context" and "gamma:vm:db" in v.detail


def test_a_vm_domain_mapping_ram_of_another_guest(hw):
    hw.borrow(NVME, "gamma", "web")
    db = hw.guest("gamma", "db")
    (frame,) = db.pin(0, 4096)
    hw.vm_domain("gamma", "web").map(0, frame.phys - frame.phys % 4096, 4096)
    (v,) = check_hardware(hw)
    assert v.kind == "domain" and "RAM of db" in v.detail
    db.unpin(0, 4096)


def test_two_lenders_devices_for_two_vms_on_one_node(hw):
    # the first device of each lender: once both entered gamma as f0:00.2 (issue 10 part 2)
    hw.borrow(GPU, "gamma", "web")
    hw.borrow(BETA_GPU, "gamma", "db")
    assert check_hardware(hw) == []
    rids = {r.rid for r in hw.node("gamma").iommu.attached()}
    assert len(rids) == 2


def test_two_devices_entering_a_node_as_one_requester_id(hw):
    """A borrower LUT that gives two devices one entry: gamma's IOMMU sees one requester id
    for both, so whichever domain it is attached to translates the other VM's DMA too."""
    web = hw.borrow(GPU, "gamma", "web")
    hw.borrow(BETA_GPU, "gamma", "db")
    assert check_hardware(hw) == []
    gamma0 = hw.adapter("gamma:0")
    # the LUT programmed wrong: the entry of beta's GPU's device is that of alpha's
    gamma0._lut[requester_device(hw.requester_key(BETA_GPU))] = web.borrower_entry
    assert hw.ingress(BETA_GPU, "gamma") == web.ingress
    found = [v for v in check_hardware(hw) if v.kind == "requester-id"]
    rid = gamma0.assigned_requester_id(web.borrower_entry, hw.requester_key(GPU))
    assert [(v.where, v.detail) for v in found] == [
        (f"gamma rid {rid:#06x}", "0x10 and 0x20 enter as it")
    ]


def test_a_crossing_attached_where_its_device_is_not_borrowed(hw):
    hw.borrow(GPU, "gamma", "web")
    hw.attach_ingress(GPU, "beta", IommuDomain("beta:p2p:gamma/db", owner=("gamma", "db")))
    assert kinds(hw) == ["context"]


def test_an_interrupt_route_without_a_borrow(hw):
    remove = hw.device(GPU).on_interrupt(lambda vector: None)
    assert kinds(hw) == ["interrupt"]
    hw.borrow(GPU, "gamma", "web")
    assert kinds(hw) == []
    remove()


def test_holds_against_borrows(hw):
    hw.borrow(GPU, "gamma", "web")
    web = HoldRecord(GPU, Holder("gamma", "web"), 0.0, Phase.BORROWED)
    assert kinds(hw, holds={GPU: web}) == []
    reserved = HoldRecord(GPU, Holder("gamma", "web"), 0.0, Phase.RESERVED)
    assert kinds(hw, holds={GPU: reserved}) == ["hold"]
    assert kinds(hw, holds={}) == ["hold"]
    nobody = HoldRecord(NVME, Holder("", ""), 0.0, Phase.RESERVED)
    found = check_hardware(hw, holds={GPU: web, NVME: nobody})
    assert [v.detail.split(" (")[0] for v in found] == ["hold without a holder"]


def test_window_segments_equal_their_claims(hw):
    from vmlend.memory.layout import MemoryConfig, compute_layout
    from vmlend.sim.dmawin import VmDmaWindows

    layout = compute_layout(MemoryConfig("q35", 1 * GiB))
    guest = hw.guest("gamma", "web")
    hw.borrow(NVME, "gamma", "web")
    windows = VmDmaWindows(hw, guest, layout)
    windows.enable(NVME)
    mapped = len(hw.adapter("alpha:0").mapped_segments())
    assert mapped >= 1

    path = hw.borrowed(NVME).path
    luts = [(NVME, Claim(a.ref, ClaimKind.LUT, "dev", entries=1)) for a in (path.src, path.dst)]

    def claims(n: int) -> list[tuple[int, Claim]]:
        return [*luts, (NVME, Claim("alpha:0", ClaimKind.DMA, "vm:gamma/web", segments=n))]

    assert kinds(hw, claims=[]) == ["claims"]  # mapped without a claim
    assert kinds(hw, claims=claims(mapped)) == []
    assert kinds(hw, claims=claims(mapped + 1)) == ["claims"]  # promised more than it maps
    assert kinds(hw, claims=claims(mapped - 1)) == ["claims"]  # maps more than it was promised
    # a claim shared by the VM's devices counts once, at its largest
    assert kinds(hw, claims=claims(mapped) + claims(mapped - 1)) == []
    assert kinds(hw, claims=claims(mapped)[1:]) == ["claims"]  # a LUT entry without a claim
    windows.close()
    assert kinds(hw, claims=luts) == []  # the borrow's LUT entries stay, its windows went
