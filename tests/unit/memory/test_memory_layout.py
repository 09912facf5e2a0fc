"""Layout rules: the split, max-ram-below-4g, machine types, AMD 1 TiB rule, DIMMs, NUMA."""

from __future__ import annotations

import pytest

from vmlend.errors import LayoutError
from vmlend.memory.layout import (
    AMD_ABOVE_1TB_START,
    CpuVendor,
    Dimm,
    Family,
    MemoryConfig,
    compute_layout,
    merge_ranges,
    parse_machine_type,
)
from vmlend.topology.model import GiB, GuestRange, MiB, TiB

G4 = 4 * GiB


def split(machine: str, ram: int, **kw: object) -> tuple[int, int]:
    lay = compute_layout(MemoryConfig(machine, ram, **kw))  # type: ignore[arg-type]
    return lay.below_4g, lay.above_4g


@pytest.mark.parametrize(
    ("machine", "ram", "low", "high"),
    [
        # pc: all low up to 3.5 GiB, then cut to 3 GiB (gigabyte aligned types)
        ("pc", 1 * GiB, 1 * GiB, 0),
        ("pc", 3583 * MiB, 3583 * MiB, 0),
        ("pc", 3584 * MiB, 3 * GiB, 512 * MiB),
        ("pc", 4 * GiB, 3 * GiB, 1 * GiB),
        ("pc-i440fx-7.2", 8 * GiB, 3 * GiB, 5 * GiB),
        # upstream's own example: pc-1.7 is not gigabyte aligned
        ("pc-1.7", 4 * GiB, 3584 * MiB, 512 * MiB),
        ("pc-i440fx-1.7", 4 * GiB, 3584 * MiB, 512 * MiB),
        ("pc-i440fx-2.0", 4 * GiB, 3 * GiB, 1 * GiB),
        # q35: 2.75 GiB low until RAM reaches 2816 MiB, then split at 2 GiB
        ("q35", 1 * GiB, 1 * GiB, 0),
        ("q35", 2815 * MiB, 2815 * MiB, 0),
        ("q35", 2816 * MiB, 2 * GiB, 768 * MiB),
        ("q35", 3 * GiB, 2 * GiB, 1 * GiB),
        ("pc-q35-7.2", 8 * GiB, 2 * GiB, 6 * GiB),
        ("pc-q35-2.4", 4 * GiB, 2 * GiB, 2 * GiB),
    ],
)
def test_split(machine: str, ram: int, low: int, high: int) -> None:
    assert split(machine, ram) == (low, high)


@pytest.mark.parametrize("machine", ["pc", "q35"])
def test_max_ram_below_4g_caps_low_memory(machine: str) -> None:
    assert split(machine, 4 * GiB, max_ram_below_4g=1 * GiB) == (1 * GiB, 3 * GiB)
    assert split(machine, 512 * MiB, max_ram_below_4g=1 * GiB) == (512 * MiB, 0)


def test_max_ram_below_4g_pc_examples_from_upstream() -> None:
    assert split("pc", 4 * GiB, max_ram_below_4g=2 * GiB) == (2 * GiB, 2 * GiB)
    # raising the limit lets a legacy guest keep almost 4 GiB low (no split below it)
    assert split("pc", 3968 * MiB, max_ram_below_4g=4 * GiB) == (3968 * MiB, 0)
    # but a RAM of at least the limit is still cut at 3 GiB on aligned types
    assert split("pc", 5 * GiB, max_ram_below_4g=4 * GiB) == (3 * GiB, 2 * GiB)


def test_max_ram_below_4g_q35_only_lowers() -> None:
    assert split("q35", 8 * GiB, max_ram_below_4g=4 * GiB) == (2 * GiB, 6 * GiB)


@pytest.mark.parametrize("bad", [0, 4 * GiB + 1, -1])
def test_max_ram_below_4g_out_of_range(bad: int) -> None:
    with pytest.raises(LayoutError, match="max-ram-below-4g"):
        split("pc", 1 * GiB, max_ram_below_4g=bad)


def test_ranges_low_and_high() -> None:
    lay = compute_layout(MemoryConfig("q35", 8 * GiB))
    assert lay.ranges() == [GuestRange(0, 2 * GiB), GuestRange(G4, G4 + 6 * GiB)]
    assert lay.low == GuestRange(0, 2 * GiB)
    assert lay.high == GuestRange(G4, 10 * GiB)
    assert lay.ram_size == 8 * GiB


def test_no_high_memory() -> None:
    lay = compute_layout(MemoryConfig("pc", 1 * GiB))
    assert lay.high is None
    assert lay.ranges() == [GuestRange(0, 1 * GiB)]


@pytest.mark.parametrize(
    ("vga", "expected"),
    [
        (False, [GuestRange(0, 0xC0000), GuestRange(0x100000, 2 * GiB), GuestRange(G4, 6 * GiB)]),
        (True, [GuestRange(0, 0xA0000), GuestRange(0x100000, 2 * GiB), GuestRange(G4, 6 * GiB)]),
    ],
)
def test_flat_view_sub_1mib_split(vga: bool, expected: list[GuestRange]) -> None:
    lay = compute_layout(MemoryConfig("q35", 4 * GiB))
    assert lay.flat_ram(vga=vga) == expected


def test_flat_view_tiny_guest() -> None:
    lay = compute_layout(MemoryConfig("pc", 512 * 1024))
    assert lay.flat_ram() == [GuestRange(0, 512 * 1024)]


@pytest.mark.parametrize(
    ("name", "family", "align", "amd"),
    [
        ("pc", Family.I440FX, True, True),
        ("q35", Family.Q35, True, True),
        ("pc-q35-7.2", Family.Q35, True, True),
        ("pc-q35-4.0.1", Family.Q35, True, False),
        ("pc-i440fx-7.0", Family.I440FX, True, False),
        ("pc-i440fx-7.1", Family.I440FX, True, True),
        ("pc-i440fx-10.1", Family.I440FX, True, True),
        ("pc-1.7", Family.I440FX, False, False),
        ("pc-q35-rhel9.4.0", Family.Q35, True, None),
    ],
)
def test_machine_types(name: str, family: Family, align: bool, amd: bool | None) -> None:
    mt = parse_machine_type(name)
    assert (mt.family, mt.gigabyte_align, mt.amd_1tb_hole) == (family, align, amd)


@pytest.mark.parametrize("name", ["microvm", "virt", "pc-q35", "pc-i440fx-x.y", "", "isapc"])
def test_unknown_machine_type(name: str) -> None:
    with pytest.raises(LayoutError, match="unknown machine type"):
        parse_machine_type(name)


def test_too_old_machine_type() -> None:
    with pytest.raises(LayoutError, match="older than"):
        parse_machine_type("pc-1.2")


@pytest.mark.parametrize("ram", [0, -GiB, 1000])
def test_bad_ram(ram: int) -> None:
    with pytest.raises(LayoutError):
        compute_layout(MemoryConfig("pc", ram))


# --- AMD 1 TiB rule -------------------------------------------------------------------------

BIG = {"maxmem": 1000 * GiB, "slots": 1}


def test_amd_moves_high_ram_above_1tib() -> None:
    lay = compute_layout(MemoryConfig("q35", 4 * GiB, cpu_vendor=CpuVendor.AMD, **BIG))
    assert lay.high == GuestRange(AMD_ABOVE_1TB_START, AMD_ABOVE_1TB_START + 2 * GiB)
    assert lay.notes


def test_intel_keeps_high_ram_at_4gib() -> None:
    lay = compute_layout(MemoryConfig("q35", 4 * GiB, cpu_vendor=CpuVendor.INTEL, **BIG))
    assert lay.high == GuestRange(G4, G4 + 2 * GiB)


def test_amd_rule_not_on_old_machine_types() -> None:
    lay = compute_layout(MemoryConfig("pc-q35-7.0", 4 * GiB, cpu_vendor=CpuVendor.AMD, **BIG))
    assert lay.high == GuestRange(G4, G4 + 2 * GiB)


def test_amd_rule_counts_the_64bit_pci_hole() -> None:
    # q35 reserves a 32 GiB hole above RAM: 980 GiB of RAM already reaches the HT range
    assert compute_layout(MemoryConfig("q35", 980 * GiB, cpu_vendor=CpuVendor.AMD)).high == (
        GuestRange(TiB, TiB + 978 * GiB)
    )
    # pc's 2 GiB hole does not reach it with the same RAM
    lay = compute_layout(MemoryConfig("pc", 980 * GiB, cpu_vendor=CpuVendor.AMD))
    assert lay.above_4g_start == G4
    # a smaller configured hole keeps q35 below too
    lay = compute_layout(
        MemoryConfig("q35", 980 * GiB, cpu_vendor=CpuVendor.AMD, pci_hole64_size=1 * GiB)
    )
    assert lay.above_4g_start == G4


def test_unknown_vendor_refused_only_when_it_matters() -> None:
    assert compute_layout(MemoryConfig("q35", 8 * GiB)).above_4g_start == G4
    with pytest.raises(LayoutError, match="HyperTransport"):
        compute_layout(MemoryConfig("q35", 4 * GiB, **BIG))


def test_downstream_type_refused_when_amd_rule_unknown() -> None:
    with pytest.raises(LayoutError, match="HyperTransport"):
        compute_layout(MemoryConfig("pc-q35-rhel9.4.0", 4 * GiB, cpu_vendor=CpuVendor.AMD, **BIG))


# --- hot-plug region, DIMMs, NUMA -----------------------------------------------------------


def test_hotplug_region_and_dimm_placement() -> None:
    cfg = MemoryConfig(
        "q35",
        2 * GiB,
        maxmem=8 * GiB,
        slots=3,
        dimms=(Dimm(512 * MiB), Dimm(1 * GiB), Dimm(2 * MiB)),
    )
    lay = compute_layout(cfg)
    # no high RAM: the region starts at 4 GiB; size = maxmem - ram + 1 GiB per slot
    assert lay.device_memory == GuestRange(G4, G4 + 6 * GiB + 3 * GiB)
    assert lay.dimms == (
        GuestRange(G4, G4 + 512 * MiB),
        GuestRange(G4 + 512 * MiB, G4 + 1536 * MiB),
        GuestRange(G4 + 1536 * MiB, G4 + 1538 * MiB),
    )
    assert lay.ranges() == [GuestRange(0, 2 * GiB), GuestRange(G4, G4 + 1538 * MiB)]
    assert lay.ram_size == 2 * GiB + 1538 * MiB


def test_dimm_region_starts_after_high_ram_rounded_to_1gib() -> None:
    cfg = MemoryConfig("pc", 3584 * MiB, maxmem=8 * GiB, slots=1, dimms=(Dimm(1 * GiB),))
    lay = compute_layout(cfg)
    assert lay.high == GuestRange(G4, G4 + 512 * MiB)
    assert lay.dimms == (GuestRange(5 * GiB, 6 * GiB),)


def test_dimm_fixed_base_and_first_fit() -> None:
    cfg = MemoryConfig(
        "q35",
        2 * GiB,
        maxmem=8 * GiB,
        slots=3,
        dimms=(Dimm(2 * MiB), Dimm(4 * MiB, base=5 * GiB), Dimm(2 * MiB)),
    )
    assert compute_layout(cfg).dimms == (
        GuestRange(G4, G4 + 2 * MiB),
        GuestRange(G4 + 2 * MiB, G4 + 4 * MiB),
        GuestRange(5 * GiB, 5 * GiB + 4 * MiB),
    )


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"dimms": (Dimm(GiB),)}, "maxMemory"),
        ({"maxmem": 8 * GiB, "slots": 0, "dimms": (Dimm(GiB),)}, "slots"),
        ({"maxmem": 3 * GiB, "slots": 1, "dimms": (Dimm(2 * GiB),)}, "exceed"),
        ({"maxmem": 8 * GiB, "slots": 1, "dimms": (Dimm(3 * MiB),)}, "2 MiB"),
        (
            {"maxmem": 8 * GiB, "slots": 2, "dimms": (Dimm(GiB, base=G4), Dimm(GiB, base=G4))},
            "overlaps",
        ),
        ({"maxmem": 8 * GiB, "slots": 1, "dimms": (Dimm(GiB, base=100 * GiB),)}, "does not fit"),
    ],
)
def test_bad_dimm_configs(kw: dict[str, object], match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        compute_layout(MemoryConfig("q35", 2 * GiB, **kw))  # type: ignore[arg-type]


def test_no_hotplug_on_pc_2_0() -> None:
    with pytest.raises(LayoutError, match="hot-plug"):
        compute_layout(MemoryConfig("pc-i440fx-2.0", GiB, maxmem=2 * GiB, slots=1))


def test_numa_nodes_fill_ram_in_order() -> None:
    lay = compute_layout(MemoryConfig("q35", 4 * GiB, numa_cells=(1 * GiB, 3 * GiB)))
    assert lay.node_ranges() == [
        [GuestRange(0, 1 * GiB)],
        [GuestRange(1 * GiB, 2 * GiB), GuestRange(G4, G4 + 2 * GiB)],
    ]
    # NUMA does not move RAM
    assert lay.ranges() == compute_layout(MemoryConfig("q35", 4 * GiB)).ranges()


def test_numa_cells_must_add_up() -> None:
    with pytest.raises(LayoutError, match="NUMA"):
        compute_layout(MemoryConfig("q35", 4 * GiB, numa_cells=(1 * GiB, 1 * GiB)))


def test_merge_ranges() -> None:
    assert merge_ranges([GuestRange(5, 9), GuestRange(0, 5), GuestRange(9, 9)]) == [
        GuestRange(0, 9)
    ]
