"""The pin probe over synthetic oracles: O(log n) probes, exact ends, mismatches reported."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from vmlend.errors import LayoutError
from vmlend.memory.layout import (
    AMD_ABOVE_1TB_START,
    PAGE,
    CpuVendor,
    Dimm,
    MemoryConfig,
    compute_layout,
)
from vmlend.memory.probe import linear_walk, probe_layout, probe_ranges
from vmlend.topology.model import GiB, GuestRange, MiB, TiB

G4 = 4 * GiB


def oracle(ranges: Sequence[GuestRange]) -> Callable[[int], bool]:
    def can_pin(gpa: int) -> bool:
        return any(r.start <= gpa < r.end for r in ranges)

    return can_pin


def test_finds_low_and_high() -> None:
    ram = [GuestRange(0, 2 * GiB), GuestRange(G4, G4 + 6 * GiB)]
    result = probe_ranges(oracle(ram))
    assert list(result.ranges) == ram


@pytest.mark.parametrize("end", [PAGE, 2 * PAGE, 3 * PAGE, 5 * PAGE, 640 * 1024, GiB - PAGE])
def test_exact_end_at_page_granularity(end: int) -> None:
    assert probe_ranges(oracle([GuestRange(0, end)])).ranges == (GuestRange(0, end),)


def test_no_high_memory() -> None:
    result = probe_ranges(oracle([GuestRange(0, GiB)]))
    assert result.ranges == (GuestRange(0, GiB),)


def test_nothing_pinnable() -> None:
    assert probe_ranges(lambda gpa: False).ranges == ()


def test_range_at_1tib_found() -> None:
    ram = [GuestRange(0, 2 * GiB), GuestRange(AMD_ABOVE_1TB_START, AMD_ABOVE_1TB_START + GiB)]
    assert list(probe_ranges(oracle(ram)).ranges) == ram


def test_probe_count_is_logarithmic() -> None:
    counts = {}
    for size in (GiB, 16 * GiB, TiB, 4 * TiB):
        ram = [GuestRange(0, 2 * GiB), GuestRange(G4, G4 + size)]
        result = probe_ranges(oracle(ram), starts=(0, G4))
        assert list(result.ranges) == ram
        counts[size] = result.probes
    # doubling the guest adds about two probes (one doubling step, one bisection step)
    assert counts[4 * TiB] - counts[TiB] <= 6
    assert counts[4 * TiB] < 2 * 2 * 42  # ~2 log2(pages) per range, far from 2**30 pages


def test_linear_walk_agrees_but_costs_a_probe_per_page() -> None:
    ram = [GuestRange(0, 8 * MiB), GuestRange(G4, G4 + 4 * MiB)]
    walk = linear_walk(oracle(ram))
    assert list(walk.ranges) == ram
    assert walk.probes == (12 * MiB) // PAGE + 2
    assert probe_ranges(oracle(ram)).probes < walk.probes // 50


def test_unaligned_start_refused() -> None:
    with pytest.raises(LayoutError, match="page aligned"):
        probe_ranges(oracle([]), starts=(123,))


def test_limit_bounds_the_search() -> None:
    result = probe_ranges(lambda gpa: True, starts=(0,), limit=64 * MiB)
    assert result.ranges == (GuestRange(0, 64 * MiB),)


# --- against computed layouts -----------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [
        MemoryConfig("q35", 8 * GiB),
        MemoryConfig("pc", 8 * GiB),  # 3 GiB low: a doubling step from 0 lands in high RAM
        MemoryConfig("pc", 1 * GiB),
        MemoryConfig("pc", 2 * MiB),  # tiny guest
        MemoryConfig("q35", 1024 * GiB, cpu_vendor=CpuVendor.INTEL),
        MemoryConfig("q35", 1024 * GiB, cpu_vendor=CpuVendor.AMD),  # AMD: high RAM at 1 TiB
        MemoryConfig("q35", 2 * GiB, maxmem=8 * GiB, slots=2, dimms=(Dimm(GiB), Dimm(GiB))),
        MemoryConfig(
            "pc", 3584 * MiB, maxmem=8 * GiB, slots=1, dimms=(Dimm(512 * MiB, base=6 * GiB),)
        ),
    ],
    ids=["q35-8G", "pc-8G", "pc-1G", "pc-2M", "q35-1T-intel", "q35-1T-amd", "dimms", "dimm-gap"],
)
def test_probe_matches_layout(cfg: MemoryConfig) -> None:
    layout = compute_layout(cfg)
    result = probe_layout(oracle(layout.ranges()), layout)
    assert list(result.ranges) == layout.ranges()


def test_amd_layout_probed_from_1tib() -> None:
    layout = compute_layout(MemoryConfig("q35", 1024 * GiB, cpu_vendor=CpuVendor.AMD))
    assert layout.high is not None and layout.high.start == TiB
    assert probe_layout(oracle(layout.ranges()), layout).ranges[-1] == layout.high


@pytest.mark.parametrize(
    "actual",
    [
        # a hole inside low RAM: the probe stops at it
        [GuestRange(0, GiB), GuestRange(GiB + PAGE, 2 * GiB), GuestRange(G4, 6 * GiB)],
        # high RAM one page short
        [GuestRange(0, 2 * GiB), GuestRange(G4, 6 * GiB - PAGE)],
        # RAM past the end
        [GuestRange(0, 2 * GiB), GuestRange(G4, 6 * GiB + PAGE)],
        # no high RAM at all
        [GuestRange(0, 2 * GiB)],
        # high RAM at 1 TiB though the layout says 4 GiB (an AMD guest taken for Intel)
        [GuestRange(0, 2 * GiB), GuestRange(TiB, TiB + 2 * GiB)],
        # extra RAM the layout does not know
        [GuestRange(0, 2 * GiB), GuestRange(G4, 6 * GiB), GuestRange(TiB, TiB + GiB)],
    ],
    ids=["hole", "short", "past-end", "no-high", "moved-to-1tib", "extra"],
)
def test_mismatch_is_a_layout_error(actual: list[GuestRange]) -> None:
    layout = compute_layout(MemoryConfig("q35", 4 * GiB))
    with pytest.raises(LayoutError, match="differs from the layout"):
        probe_layout(oracle(actual), layout)
