"""DMA window planning: page sizes, segments, DMA limits, refusals, apply/undo with fakes.

The strongest check composes the three planned stages with fake translators and resolves
guest-physical addresses as a device would: RAM lands on the right host page, the PCI hole and
addresses past the end fault.
"""

from __future__ import annotations

import random

import pytest

from vmlend.errors import DmaLimitError, LayoutError, ResourceExhaustedError
from vmlend.memory.layout import PAGE, CpuVendor, MemoryConfig, compute_layout
from vmlend.memory.windows import (
    FrameRun,
    Mapping,
    apply_plan,
    plan_dma_windows,
    runs_from_pages,
    split_pages,
    unapply_plan,
)
from vmlend.topology.model import AdapterSpec, GiB, GuestRange, MiB, TiB

G4 = 4 * GiB
ADAPTER = AdapterSpec(node="alpha", index=0)  # 128 GiB window, 32 segments of 4 GiB
SMALL = AdapterSpec(node="beta", index=0, window_size=8 * GiB, segments=8)  # 1 GiB segments
NTB_BASE = 0x38_0000_0000


class FakeMapper:
    """Records map/unmap calls and translates like an IOMMU (None = fault)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.maps: list[tuple[int, int, int]] = []
        self.calls: list[str] = []
        self.fail_at = fail_at

    def map(self, iova: int, phys: int, size: int) -> None:
        if self.fail_at is not None and len(self.maps) == self.fail_at:
            raise RuntimeError("IOMMU full")
        self.maps.append((iova, phys, size))
        self.calls.append("map")

    def unmap(self, iova: int, size: int) -> None:
        self.maps = [m for m in self.maps if not (m[0] == iova and m[2] == size)]
        self.calls.append("unmap")

    def translate(self, addr: int) -> int | None:
        for iova, phys, size in self.maps:
            if iova <= addr < iova + size:
                return phys + (addr - iova)
        return None


def identity_backing(ranges: list[GuestRange], host_base: int) -> list[FrameRun]:
    """Each range backed contiguously; host address = host_base + GPA."""
    return [FrameRun(r.start, host_base + r.start, r.size) for r in ranges]


def host_of(backing: list[FrameRun], gpa: int) -> int:
    for run in backing:
        if run.gpa <= gpa < run.gpa + run.size:
            return run.host + gpa - run.gpa
    raise AssertionError(f"{gpa:#x} not backed")


def device_dma(stages: tuple[FakeMapper, FakeMapper, FakeMapper], gpa: int) -> int | None:
    """Lender IOMMU -> NTB segment -> borrower IOMMU, as the device's DMA travels."""
    borrower, ntb, lender = stages
    addr = lender.translate(gpa)
    if addr is None:
        return None
    addr = ntb.translate(addr)
    return None if addr is None else borrower.translate(addr)


def applied(plan_args: dict[str, object]) -> tuple[FakeMapper, FakeMapper, FakeMapper]:
    plan = plan_dma_windows(**plan_args)  # type: ignore[arg-type]
    stages = (FakeMapper(), FakeMapper(), FakeMapper())
    apply_plan(plan, *stages)
    return stages


# --- page sizes -----------------------------------------------------------------------------


def test_split_pages_prefers_large_pages() -> None:
    maps = split_pages(0, 8 * GiB, 2 * GiB + 2 * MiB + PAGE)
    assert [(m.page_size, m.entries) for m in maps] == [(GiB, 2), (2 * MiB, 1), (PAGE, 1)]


def test_split_pages_head_and_tail() -> None:
    maps = split_pages(GiB - PAGE, 5 * GiB - PAGE, GiB + 2 * PAGE)
    sizes = [(m.page_size, m.iova) for m in maps]
    assert sizes[0] == (PAGE, GiB - PAGE)
    assert (GiB, GiB) in sizes
    assert sum(m.size for m in maps) == GiB + 2 * PAGE


def test_split_pages_misaligned_host_uses_small_pages() -> None:
    maps = split_pages(0, GiB + PAGE, 4 * MiB)
    assert [(m.page_size, m.entries) for m in maps] == [(PAGE, 1024)]


def test_split_pages_rejects_partial_pages() -> None:
    with pytest.raises(LayoutError):
        split_pages(0, 0, 100)


def test_runs_from_pages() -> None:
    pages = [(0, 0x10000), (PAGE, 0x11000), (2 * PAGE, 0x50000), (3 * PAGE, 0x51000)]
    assert runs_from_pages(reversed(pages)) == [
        FrameRun(0, 0x10000, 2 * PAGE),
        FrameRun(2 * PAGE, 0x50000, 2 * PAGE),
    ]


@pytest.mark.parametrize("pages", [[(0, 0x1000), (0, 0x2000)], [(5, 0x1000)]])
def test_runs_from_pages_bad_input(pages: list[tuple[int, int]]) -> None:
    with pytest.raises(LayoutError):
        runs_from_pages(pages)


# --- plans ----------------------------------------------------------------------------------


def test_plan_q35_8g_with_1g_host_pages() -> None:
    ram = compute_layout(MemoryConfig("q35", 8 * GiB)).ranges()
    backing = identity_backing(ram, 64 * GiB)
    plan = plan_dma_windows(ram, backing, ADAPTER, range(32), ntb_base=NTB_BASE)
    low, high = plan.windows
    assert (low.name, high.name) == ("low", "high")
    assert low.entries() == {GiB: 2}
    assert high.entries() == {GiB: 6}
    assert plan.entries() == {GiB: 8}
    assert len(low.segments) == 1 and len(high.segments) == 2  # [4G,10G) -> 2 x 4 GiB
    assert high.span == GuestRange(G4, 12 * GiB)
    # lender IOMMU: IOVA = GPA, onto the window
    assert low.lender_maps[0].iova == 0
    assert low.lender_maps[0].phys == NTB_BASE + low.segments[0] * ADAPTER.segment_size
    assert {c.name for c in plan.checks} == {"dma-limit", "ntb-window", "ntb-segments"}


def test_plan_with_scattered_4k_frames() -> None:
    ram = [GuestRange(0, 2 * MiB)]
    rnd = random.Random(7)
    frames = rnd.sample(range(1 << 20), (2 * MiB) // PAGE)
    backing = runs_from_pages((i * PAGE, f * PAGE) for i, f in enumerate(frames))
    plan = plan_dma_windows(ram, backing, SMALL, range(8))
    assert plan.entries() == {PAGE: 512}
    stages = (FakeMapper(), FakeMapper(), FakeMapper())
    apply_plan(plan, *stages)
    for gpa in range(0, 2 * MiB, 64 * PAGE):
        assert device_dma(stages, gpa + 8) == frames[gpa // PAGE] * PAGE + 8


def test_every_ram_page_resolves_and_holes_fault() -> None:
    ram = compute_layout(MemoryConfig("pc", 5 * GiB)).ranges()  # [0,3G) + [4G,6G)
    # host frames: 2 MiB-aligned chunks in a shuffled order, so pages are mixed
    chunks = [r.start + i for r in ram for i in range(0, r.size, 64 * MiB)]
    rnd = random.Random(3)
    hosts = rnd.sample(range(len(chunks) * 2), len(chunks))
    backing = [
        FrameRun(c, 0x100_0000_0000 + h * 64 * MiB, 64 * MiB)
        for c, h in zip(chunks, hosts, strict=True)
    ]
    # fragmented free segments: the high window cannot be contiguous
    args = {"ram": ram, "backing": backing, "adapter": SMALL, "free_segments": [0, 2, 4, 5, 7, 6]}
    stages = applied(args)
    plan = plan_dma_windows(**args)  # type: ignore[arg-type]
    assert {len(w.segments) for w in plan.windows} == {3, 2}
    for r in ram:
        for gpa in [r.start, r.end - 1, *range(r.start, r.end, 32 * MiB + PAGE)]:
            assert device_dma(stages, gpa) == host_of(backing, gpa), hex(gpa)
    for hole in (3 * GiB, 3 * GiB + 512 * MiB, G4 - 1, 6 * GiB, 7 * GiB, TiB):
        assert device_dma(stages, hole) is None, hex(hole)


def test_backing_gap_refused() -> None:
    ram = [GuestRange(0, GiB)]
    backing = [FrameRun(0, 0, 256 * MiB), FrameRun(256 * MiB + PAGE, GiB, 512 * MiB)]
    with pytest.raises(LayoutError, match=r"0x10000000"):
        plan_dma_windows(ram, backing, ADAPTER, range(32))


# --- limits ---------------------------------------------------------------------------------


def test_40_bit_device_and_ram_above_1tib() -> None:
    layout = compute_layout(MemoryConfig("q35", 1000 * GiB, cpu_vendor=CpuVendor.AMD))
    ram = layout.ranges()
    assert ram[-1].start == TiB
    big = AdapterSpec(node="alpha", index=0, window_size=2 * TiB, segments=64)
    with pytest.raises(DmaLimitError) as exc:
        plan_dma_windows(ram, identity_backing(ram, 0), big, range(64), dma_bits=40, device="0x10")
    assert exc.value.need - exc.value.have == ram[-1].end - TiB
    assert "short by" in str(exc.value) and "40 bits" in str(exc.value)
    # the same guest on an Intel vCPU stays below 1 TiB and fits
    intel = compute_layout(MemoryConfig("q35", 1000 * GiB, cpu_vendor=CpuVendor.INTEL)).ranges()
    plan = plan_dma_windows(intel, identity_backing(intel, 0), big, range(64), dma_bits=40)
    assert plan.windows[-1].ranges[-1].end <= TiB


def test_ram_ending_exactly_at_the_dma_limit_fits() -> None:
    # q35 with 1022 GiB on an Intel vCPU: high RAM ends at exactly 1 TiB, the first address a
    # 40-bit device cannot reach; its last byte is the device's last reachable one
    ram = compute_layout(MemoryConfig("q35", 1022 * GiB, cpu_vendor=CpuVendor.INTEL)).ranges()
    assert ram[-1].end == TiB
    big = AdapterSpec(node="alpha", index=0, window_size=2 * TiB, segments=64)
    plan = plan_dma_windows(ram, identity_backing(ram, 0), big, range(64), dma_bits=40)
    assert plan.windows[-1].ranges[-1].end == TiB


def test_32_bit_device() -> None:
    ram = compute_layout(MemoryConfig("q35", 2 * GiB)).ranges()
    plan = plan_dma_windows(ram, identity_backing(ram, 0), SMALL, range(8), dma_bits=32)
    assert [w.name for w in plan.windows] == ["low"]
    ram = compute_layout(MemoryConfig("q35", 4 * GiB)).ranges()
    with pytest.raises(DmaLimitError) as exc:
        plan_dma_windows(ram, identity_backing(ram, 0), SMALL, range(8), dma_bits=32)
    assert exc.value.need - exc.value.have == 2 * GiB


def test_window_exactly_full_fits() -> None:
    ram = compute_layout(MemoryConfig("q35", 8 * GiB)).ranges()  # 2 + 6 segments of 1 GiB
    plan = plan_dma_windows(ram, identity_backing(ram, 0), SMALL, range(8))
    assert sorted(plan.segments_used) == list(range(8))


def test_window_too_small_names_the_shortfall() -> None:
    ram = compute_layout(MemoryConfig("q35", 10 * GiB)).ranges()  # 2 + 8 = 10 x 1 GiB
    with pytest.raises(ResourceExhaustedError) as exc:
        plan_dma_windows(ram, identity_backing(ram, 0), SMALL, range(8))
    assert exc.value.need - exc.value.have == 2 * GiB
    assert "short by 2147483648 bytes" in str(exc.value)


def test_not_enough_free_segments_changes_nothing() -> None:
    ram = compute_layout(MemoryConfig("q35", 4 * GiB)).ranges()  # 2 + 2 segments
    free = [1, 3, 5]
    with pytest.raises(ResourceExhaustedError, match="free NTB segments") as exc:
        plan_dma_windows(ram, identity_backing(ram, 0), SMALL, free)
    assert (exc.value.need, exc.value.have) == (4, 3)
    assert free == [1, 3, 5]


def test_segment_index_outside_window() -> None:
    ram = [GuestRange(0, GiB)]
    with pytest.raises(LayoutError, match="outside"):
        plan_dma_windows(ram, identity_backing(ram, 0), SMALL, [8])


def test_no_ram() -> None:
    with pytest.raises(LayoutError, match="no RAM"):
        plan_dma_windows([], [], SMALL, range(8))


# --- apply / undo ---------------------------------------------------------------------------


def test_apply_order_and_undo_on_failure() -> None:
    ram = compute_layout(MemoryConfig("q35", 4 * GiB)).ranges()
    plan = plan_dma_windows(ram, identity_backing(ram, 0), SMALL, range(8))
    borrower, ntb, lender = FakeMapper(), FakeMapper(), FakeMapper(fail_at=1)
    with pytest.raises(RuntimeError, match="IOMMU full"):
        apply_plan(plan, borrower, ntb, lender)
    assert borrower.maps == [] and ntb.maps == [] and lender.maps == []
    assert "unmap" in borrower.calls and "unmap" in ntb.calls


def test_unapply_removes_everything() -> None:
    ram = compute_layout(MemoryConfig("q35", 4 * GiB)).ranges()
    plan = plan_dma_windows(ram, identity_backing(ram, 0), SMALL, range(8))
    stages = (FakeMapper(), FakeMapper(), FakeMapper())
    apply_plan(plan, *stages)
    assert all(s.maps for s in stages)
    unapply_plan(plan, *stages)
    assert all(not s.maps for s in stages)


def test_mapper_without_unmap_is_tolerated() -> None:
    class MapOnly:
        def __init__(self) -> None:
            self.n = 0

        def map(self, iova: int, phys: int, size: int) -> None:
            self.n += 1

    ram = [GuestRange(0, GiB)]
    plan = plan_dma_windows(ram, identity_backing(ram, 0), SMALL, range(8))
    stages = (MapOnly(), MapOnly(), MapOnly())
    apply_plan(plan, *stages)
    assert all(s.n for s in stages)
    unapply_plan(plan, *stages)  # nothing to call, no crash


def test_mapping_entries() -> None:
    assert Mapping(0, 0, 2 * GiB, GiB).entries == 2


def test_large_segments_share_one_window() -> None:
    huge = AdapterSpec(node="alpha", index=1, window_size=128 * GiB, segments=8)  # 16 GiB each
    ram = compute_layout(MemoryConfig("q35", 8 * GiB)).ranges()
    plan = plan_dma_windows(ram, identity_backing(ram, 0), huge, range(8))
    assert [w.name for w in plan.windows] == ["low+high"]
    assert len(plan.segments_used) == 1
    stages = (FakeMapper(), FakeMapper(), FakeMapper())
    apply_plan(plan, *stages)
    assert device_dma(stages, 5 * GiB) == 5 * GiB
    assert device_dma(stages, 3 * GiB) is None  # the PCI hole stays unmapped
