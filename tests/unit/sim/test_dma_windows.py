"""The DMA windows proven with the resolver: every RAM page a guest has (sampled densely, plus
every range and IOMMU mapping boundary) resolves to the host page the guest uses, and nothing
else does: the PCI hole, the end, other VMs (same borrower, another borrower) all fault.
Refusals change nothing; devices of one VM from one lender share the window segments."""

from __future__ import annotations

import random

import pytest
from lxml import etree

from tests.support.simcluster import Cluster, domain_xml
from tests.support.simfabric import small_topology
from vmlend.errors import (
    DmaFault,
    DmaLimitError,
    HookError,
    LayoutError,
    ResourceExhaustedError,
    WindowExhaustedError,
)
from vmlend.memory.domain_memory import domain_layout
from vmlend.sim.dmawin import RegistryWindowLedger, VmDmaWindows
from vmlend.sim.hostmem import FRAME, HUGE_1G, HUGE_2M
from vmlend.sim.pci import regs
from vmlend.sim.simvm import SimVm
from vmlend.topology.model import GiB, GuestRange, MiB

PAGE = FRAME
FOUR_GIB = 4 * GiB


def boundary_pages(vm: SimVm, fdid: int) -> set[int]:
    """First and last page of every RAM range and of every IOMMU mapping run on the path."""
    pages: set[int] = set()
    for r in vm.guest.ranges:
        pages |= {r.start, r.start + PAGE, r.end - PAGE}
    domains = [vm.hw.lender_domain(fdid), vm.hw.vm_domain(vm.node, vm.name)]
    for dom in domains:
        for m in dom.mappings():
            for at in (m.iova, m.iova + m.size - PAGE):
                if vm.guest.is_ram(at):
                    pages.add(at)
    return pages


def aligned_pages(ranges: list[GuestRange], align: int, limit: int = 256) -> set[int]:
    """The pages on either side of every ``align`` boundary inside the ranges (at most
    ``limit`` boundaries per range, evenly spread)."""
    pages: set[int] = set()
    for r in ranges:
        first = -(-r.start // align) * align
        count = max(0, (r.end - first) // align)
        step = max(1, count // limit)
        for k in range(0, count + 1, step):
            b = first + k * align
            pages |= {p for p in (b - PAGE, b) if r.start <= p < r.end}
    return pages


def sampled_pages(vm: SimVm, fdid: int, per_range: int = 600, seed: int = 7) -> list[int]:
    rng = random.Random(seed)
    pages = boundary_pages(vm, fdid)
    ranges = vm.guest.ranges
    pages |= aligned_pages(ranges, 2 * MiB) | aligned_pages(ranges, GiB)
    for r in ranges:
        n = r.size // PAGE
        pages |= {r.start + rng.randrange(n) * PAGE for _ in range(per_range)}
    return sorted(pages)


def assert_maps_exactly_ram(vm: SimVm, fdid: int) -> int:
    """Every sampled RAM page lands in the guest's own host page; returns how many."""
    pages = sampled_pages(vm, fdid)
    for gpa in pages:
        t = vm.hw.resolve_dma(fdid, gpa + 0x123, write=True)
        assert (t.node, t.kind, t.owner) == (vm.node, "ram", vm.name), hex(gpa)
        assert t.address == vm.guest.host_address(gpa) + 0x123, hex(gpa)
    return len(pages)


def not_ram_pages(vm: SimVm) -> list[int]:
    """The PCI hole (both ends and inside), just past the end, and a little further."""
    out: list[int] = []
    low_end = vm.layout.below_4g
    high = vm.layout.high
    if high is not None or low_end < FOUR_GIB:
        out += [low_end, low_end + PAGE, 0xFEC0_0000, FOUR_GIB - PAGE]
    end = max(r.end for r in vm.guest.ranges)
    out += [end, end + PAGE, end + 2 * MiB, end + GiB]
    if high is None:
        out.append(FOUR_GIB)
    # the rest of the last NTB segment a window uses is mapped on the NTB but not for the device
    return sorted({p for p in out if not vm.guest.is_ram(p)})


def assert_faults(vm: SimVm, fdid: int, pages: list[int]) -> None:
    for gpa in pages:
        with pytest.raises(DmaFault):
            vm.hw.resolve_dma(fdid, gpa, write=True)


CASES = [
    ("pc", 1 * GiB, HUGE_2M),
    ("pc", 3584 * MiB, HUGE_2M),  # 3 GiB low + 512 MiB high
    ("pc", 4 * GiB, HUGE_2M),
    ("pc", 8 * GiB, HUGE_1G),
    ("q35", 2 * GiB, HUGE_2M),  # all low (below 2816 MiB)
    ("q35", 2816 * MiB, HUGE_2M),  # 2 GiB low + 768 MiB high
    ("q35", 8 * GiB, HUGE_2M),
    ("q35", 64 * GiB, HUGE_1G),
    ("pc", 64 * MiB, FRAME),  # 4 KiB backing: scattered frames, 4 KiB IOMMU pages
]


@pytest.mark.parametrize(("machine", "memory", "backing"), CASES)
def test_every_ram_page_resolves_to_the_guests_host_page(cluster, machine, memory, backing):
    vm = cluster.start(domain_xml("web", memory, machine), backing=backing)
    vm.enable_device(0x12)
    assert vm.guest.ranges == vm.layout.ranges()
    assert assert_maps_exactly_ram(vm, 0x12) > 100
    assert_faults(vm, 0x12, not_ram_pages(vm))
    # the window records describe what is mapped
    records = {r.key: r.data for r in cluster.runtime()}
    assert records["low"]["gpa_end"] == vm.layout.below_4g
    if vm.layout.high is not None:
        assert records["high"]["gpa_start"] == vm.layout.high.start
        assert records["high"]["gpa_end"] == vm.layout.high.end
    else:
        assert "high" not in records
    entries = sum(n for rec in records.values() for n in rec["iommu_entries"].values())
    assert entries == sum(vm.hw.vm_domain("gamma", "web").entries().values())
    if backing == HUGE_1G:
        assert records["low"]["iommu_entries"].get("1G", 0) >= 1

    # clearing Bus Master: everything faults, and the mappings themselves are gone
    vm.disable_device(0x12)
    pages = sampled_pages(vm, 0x12, per_range=50)
    for gpa in pages:
        with pytest.raises(DmaFault) as e:
            vm.hw.resolve_dma(0x12, gpa)
        assert e.value.hop == "bus-master"
    dev = cluster.hw.device(0x12)
    dev.config.write(regs.COMMAND, 2, regs.COMMAND_MEMORY | regs.COMMAND_MASTER)  # bypass
    for gpa in pages:
        with pytest.raises(DmaFault) as e:
            vm.hw.resolve_dma(0x12, gpa)
        assert e.value.hop == "lender-iommu"
    assert cluster.hw.adapter("alpha:0").mapped_segments() == []
    assert cluster.hw.vm_domain("gamma", "web").mappings() == []
    assert vm.guest.pinned_bytes == 0
    assert cluster.runtime() == []


def test_another_vm_on_the_same_borrower_is_out_of_reach(cluster):
    small = cluster.start(domain_xml("small", 1 * GiB, fdids=(0x12,)))
    big = cluster.start(domain_xml("big", 8 * GiB, fdids=(0x11,)))
    small.enable_device(0x12)
    big.enable_device(0x11)
    assert_maps_exactly_ram(small, 0x12)
    assert_maps_exactly_ram(big, 0x11)
    # big's RAM addresses are not small's: they fault for small's device
    beyond = [1 * GiB, 2 * GiB, FOUR_GIB, FOUR_GIB + GiB, 8 * GiB]
    assert_faults(small, 0x12, beyond)
    # even pointed at big's NTB segment, small's device lands in small's own domain
    big_seg = {r.key: r.data for r in cluster.runtime() if r.fdid == 0x11}["low"]["ntb_window"]
    cluster.hw.lender_domain(0x12).map(3 * GiB, big_seg, 2 * MiB)
    t = cluster.hw.resolve_dma(0x12, 3 * GiB + 0x40)
    # the segment leads to borrower IOVA 0, which small's own domain translates
    assert (t.owner, t.address) == ("small", small.guest.host_address(0x40))
    cluster.hw.lender_domain(0x12).unmap(3 * GiB, 2 * MiB)


def test_a_vm_on_another_borrower_is_out_of_reach(cluster):
    here = cluster.start(domain_xml("here", 2 * GiB, fdids=(0x12,)))
    there = cluster.start(domain_xml("there", 2 * GiB, fdids=(0x11,)), node="beta")
    here.enable_device(0x12)
    there.enable_device(0x11)
    assert_maps_exactly_ram(there, 0x11)
    t = cluster.hw.resolve_dma(0x12, 0x1000)
    assert t.node == "gamma" and t.owner == "here"
    # point 0x12 at the segment that leads to beta: beta's adapter has no LUT entry naming
    # it (its requests are dropped there), and beta's IOMMU does not know its crossing
    seg = {r.key: r.data for r in cluster.runtime() if r.fdid == 0x11}["low"]["ntb_window"]
    cluster.hw.lender_domain(0x12).map(3 * GiB, seg, 2 * MiB)
    with pytest.raises(DmaFault) as e:
        cluster.hw.resolve_dma(0x12, 3 * GiB)
    assert e.value.hop == "lut" and "beta:0" in str(e.value)
    cluster.hw.adapter("beta:0").lut_add(cluster.hw.requester_key(0x12))
    with pytest.raises(DmaFault) as e:
        cluster.hw.resolve_dma(0x12, 3 * GiB)
    assert e.value.hop == "borrower-iommu"
    assert "beta" in str(e.value)


def snapshot(cluster: Cluster, vm: SimVm) -> tuple:
    hw = cluster.hw
    return (
        cluster.claims(),
        [(r.fdid, r.kind, r.key, r.data) for r in cluster.runtime()],
        [(a.ref, a.mapped_segments(), a.lut()) for a in hw.adapters()],
        [(d.fdid, hw.lender_domain(d.fdid).mappings()) for d in hw.devices()],
        hw.vm_domain(vm.node, vm.name).mappings(),
        vm.guest.pinned_bytes,
        hw.borrows(),
    )


def refuse(cluster: Cluster, vm: SimVm, fdid: int) -> Exception:
    """Enable decoding (the borrow), then Bus Master; the bus master write must be refused
    without changing anything, and the guest must read Bus Master back as 0."""
    vm.program_bars(fdid)
    vm.config_write(fdid, regs.COMMAND, 2, regs.COMMAND_MEMORY)
    before = snapshot(cluster, vm)
    vm.config_write(fdid, regs.COMMAND, 2, regs.COMMAND_MEMORY | regs.COMMAND_MASTER)
    assert snapshot(cluster, vm) == before
    assert not vm.config_read(fdid, regs.COMMAND, 2) & regs.COMMAND_MASTER
    with pytest.raises(DmaFault) as e:
        vm.dma_write(fdid, 0x1000, b"x")
    assert e.value.hop == "bus-master"
    refusal = vm.session(fdid).refusal
    assert refusal is not None
    with pytest.raises(type(refusal)):
        vm.enable_device(fdid)
    assert snapshot(cluster, vm) == before
    return refusal


def amd_xml(name: str, fdids: tuple[int, ...] = (0x10,)) -> bytes:
    """q35, 4 GiB, an AMD vCPU and a 1000 GiB hot-plug region: high RAM moves to 1 TiB. (A KVM
    guest's vendor is the host's whatever the model, so QEMU is told it: vendor_id.)"""
    root = etree.fromstring(domain_xml(name, 4 * GiB, "q35", fdids=fdids))
    maxmem = etree.Element("maxMemory", slots="2", unit="GiB")
    maxmem.text = "1000"
    root.find("memory").addprevious(maxmem)
    cpu = etree.SubElement(root, "cpu", mode="custom")
    etree.SubElement(cpu, "model", vendor_id="AuthenticAMD").text = "EPYC"
    return etree.tostring(root)


def test_40_bit_gpu_refused_when_ram_crosses_1_tib(cluster):
    assert domain_layout(amd_xml("amd")).high.start == 1 << 40
    # refused when the VM starts (admission knows the layout), not at Bus Master enable
    with pytest.raises(HookError) as e:
        cluster.start(amd_xml("amd"))
    err = e.value.__cause__
    assert isinstance(err, DmaLimitError)
    assert cluster.fabric().device(0x10).holder is None
    assert err.need - err.have == 2 * GiB  # RAM ends 2 GiB past the 40-bit limit
    assert "short by 2147483648 bytes" in str(err)
    # a 64-bit device reaches the same layout, high RAM at 1 TiB included
    other = cluster.start(amd_xml("amd64", (0x12,)))
    other.enable_device(0x12)
    assert_maps_exactly_ram(other, 0x12)
    assert_faults(other, 0x12, [FOUR_GIB, (1 << 40) - PAGE, (1 << 40) + 2 * GiB])


def test_window_too_small_is_refused_with_the_shortfall(state_path):
    # one 4 GiB segment: a pc guest with 4 GiB has low (3 GiB) and high (1 GiB) RAM, one
    # segment each; admission counts as the planner does, so the VM is refused at its start
    c = Cluster.create(state_path, small_topology(lender_window="4GiB", lender_segments=1), "b")
    try:
        with pytest.raises(HookError) as e:
            c.start(domain_xml("web", 4 * GiB, "pc", fdids=(0x100,)), node="b")
        err = e.value.__cause__
        assert isinstance(err, WindowExhaustedError)
        assert (err.need, err.have) == (8 * GiB, 4 * GiB)
        assert "2 segments" in str(err)
        assert c.fabric("b").device(0x100).holder is None
    finally:
        c.close()


def test_segments_taken_by_another_vm_are_refused_with_the_shortfall(state_path):
    c = Cluster.create(state_path, small_topology(lender_window="8GiB", lender_segments=2), "b")
    try:
        first = c.start(domain_xml("first", 1 * GiB, "pc", fdids=(0x100,)), node="b")
        first.enable_device(0x100)
        with pytest.raises(HookError) as e:  # needs 2 segments (low and high), 1 is left
            c.start(domain_xml("second", 4 * GiB, "pc", fdids=(0x101,)), node="b")
        err = e.value.__cause__
        assert isinstance(err, WindowExhaustedError)
        assert (err.need, err.have) == (8 * GiB, 4 * GiB)
        # the first VM is untouched and works
        assert_maps_exactly_ram(first, 0x100)
    finally:
        c.close()


def test_two_devices_from_one_lender_share_the_segments(cluster):
    vm = cluster.start(domain_xml("web", 8 * GiB, fdids=(0x10, 0x11, 0x12)))
    for fdid in (0x10, 0x11, 0x12):
        vm.enable_device(fdid)
    adapter = cluster.hw.adapter("alpha:0")
    records = {}
    for r in cluster.runtime():
        records.setdefault(r.fdid, {})[r.key] = r.data
    segs = {
        f: sorted(s for w in recs.values() for s in w["segments"]) for f, recs in records.items()
    }
    assert segs[0x10] == segs[0x11] == segs[0x12]
    assert [m.index for m in adapter.mapped_segments()] == segs[0x10]
    # the claims count the VM's windows once, exactly as mapped: low 0-2 GiB in 1 segment,
    # high 4-10 GiB in 2, whatever the device count; plus the VM's one interrupt window (MSI
    # over the NTB, the default), claimed at reservation and mapped only when interrupts are
    # wired, which this guest does not do
    usage = cluster.fabric().usage()["alpha:0"]
    assert usage.segments_used == len(adapter.mapped_segments()) + 1 == 3 + 1
    for fdid in (0x10, 0x11, 0x12):
        assert_maps_exactly_ram(vm, fdid)
    vm.disable_device(0x10)
    vm.disable_device(0x12)
    assert [m.index for m in adapter.mapped_segments()] == segs[0x11]
    assert_maps_exactly_ram(vm, 0x11)
    assert_faults(vm, 0x10, [0x1000])
    vm.disable_device(0x11)
    assert adapter.mapped_segments() == []
    assert vm.guest.pinned_bytes == 0


def test_devices_from_two_lenders_share_the_vm_domain(cluster):
    vm = cluster.start(domain_xml("web", 4 * GiB, fdids=(0x12, 0x21)))
    vm.enable_device(0x12)
    vm.enable_device(0x21)
    assert_maps_exactly_ram(vm, 0x21)
    vm.disable_device(0x12)
    assert_maps_exactly_ram(vm, 0x21)  # beta's windows still have the VM domain behind them
    assert cluster.hw.adapter("alpha:0").mapped_segments() == []
    vm.disable_device(0x21)
    assert cluster.hw.vm_domain("gamma", "web").mappings() == []


def test_a_device_local_to_the_vm_maps_without_the_ntb(cluster):
    vm = cluster.start(domain_xml("local", 4 * GiB, "pc", fdids=(0x21,)), node="beta")
    vm.enable_device(0x21)
    assert assert_maps_exactly_ram(vm, 0x21)
    assert not cluster.hw.resolve_dma(0x21, 0x1000).crossed_ntb
    assert_faults(vm, 0x21, not_ram_pages(vm))
    records = {r.key: r.data for r in cluster.runtime()}
    assert set(records) == {"low", "high"} and records["low"]["ntb_window"] is None
    vm.stop()
    assert cluster.hw.lender_domain(0x21).mappings() == []


def test_probe_mismatch_is_refused_and_changes_nothing(cluster):
    layout = domain_layout(domain_xml("odd", 2 * GiB))
    guest = cluster.hw.create_guest("gamma", "odd", [GuestRange(0, 1 * GiB)])
    cluster.hw.borrow(0x12, "gamma", "odd")
    windows = VmDmaWindows(cluster.hw, guest, layout)
    with pytest.raises(LayoutError, match="differs from the layout"):
        windows.enable(0x12)
    assert guest.pinned_bytes == 0
    assert cluster.hw.lender_domain(0x12).mappings() == []
    assert cluster.hw.adapter("alpha:0").mapped_segments() == []


def test_enable_needs_the_borrow_first(cluster):
    layout = domain_layout(domain_xml("odd", 1 * GiB))
    guest = cluster.hw.create_guest("gamma", "odd", layout.ranges())
    with pytest.raises(Exception, match="not borrowed"):
        VmDmaWindows(cluster.hw, guest, layout).enable(0x12)
    assert guest.pinned_bytes == 0


def test_segments_promised_at_admission_are_kept_for_their_vm(state_path):
    # two 4 GiB segments; "later" (1 GiB) is admitted first but enables last. "greedy" (pc,
    # 4 GiB) needs two (low and high apart): admission refuses it the segment promised to
    # "later", and even a greedy VM that got past admission could not take it at Bus Master.
    c = Cluster.create(state_path, small_topology(lender_window="8GiB", lender_segments=2), "b")
    try:
        later_xml = domain_xml("later", 1 * GiB, "pc", fdids=(0x100,))
        later = c.start(later_xml, node="b")
        greedy_xml = domain_xml("greedy", 4 * GiB, "pc", fdids=(0x101,))
        with pytest.raises(HookError, match="short by 4 GiB"):
            c.start(greedy_xml, node="b")
        c.hw.borrow(0x101, "b", "greedy")  # past admission by hand: the ledger still holds
        layout = domain_layout(greedy_xml)
        guest = c.hw.create_guest("b", "greedy", layout.ranges())
        windows = VmDmaWindows(c.hw, guest, layout, RegistryWindowLedger(c.registry), "x")
        with pytest.raises(ResourceExhaustedError) as e:
            windows.enable(0x101)
        assert (e.value.need, e.value.have) == (2, 1)
        c.hw.give_back(0x101, "b", "greedy")
        c.hw.destroy_guest("b", "greedy")
        later.enable_device(0x100)
        assert_maps_exactly_ram(later, 0x100)
        # once "later" is gone (stopped and released), both segments are greedy's to take
        later.stop()
        c.release(later_xml, node="b")
        greedy = c.start(greedy_xml, node="b")
        greedy.enable_device(0x101)
        assert_maps_exactly_ram(greedy, 0x101)
    finally:
        c.close()
