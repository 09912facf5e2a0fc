"""BAR memory: sparse contents, the MSI-X table and the PBA at their spec'd places."""

from __future__ import annotations

import pytest

from vmlend.sim.pci.bar import BarMemory
from vmlend.topology.model import BarKind, BarSpec, GiB, MsixSpec

MSIX = MsixSpec(vectors=70, table_bar=0, table_offset=0x2000, pba_bar=2, pba_offset=0x100)


@pytest.fixture
def mem() -> BarMemory:
    bars = (
        BarSpec(0, 0x4000, BarKind.MEM32),
        BarSpec(2, 32 * GiB, BarKind.MEM64, prefetch=True),
        BarSpec(4, 256, BarKind.IO),
    )
    return BarMemory(bars, MSIX)


def test_memory_reads_back_what_was_written(mem):
    mem.write(2, 31 * GiB, 8, 0x1122_3344_5566_7788)
    assert mem.read(2, 31 * GiB, 8) == 0x1122_3344_5566_7788
    assert mem.read(2, 31 * GiB, 1) == 0x88  # little endian
    assert mem.read(2, 31 * GiB + 8, 4) == 0


def test_large_bar_costs_nothing_until_written(mem):
    assert mem.read(2, 32 * GiB - 4, 4) == 0
    assert mem.read_bytes(2, 5 * GiB, 3) == b"\0\0\0"


def test_bulk_dma_access_crosses_pages(mem):
    data = bytes(range(256)) * 40
    mem.write_bytes(2, 0x1F00, data)
    assert mem.read_bytes(2, 0x1F00, len(data)) == data


def test_msix_entries_start_masked(mem):
    for v in (0, 69):
        e = mem.msix_entry(v)
        assert e.masked and e.address == 0 and e.data == 0


def test_msix_entry_fields(mem):
    base = 0x2000 + 16 * 5
    mem.write(0, base, 4, 0xFEE0_0003)  # address is dword aligned
    mem.write(0, base + 4, 4, 0x1)
    mem.write(0, base + 8, 4, 0x4055)
    mem.write(0, base + 12, 4, 0xFFFF_FFFE)  # reserved bits are read-only; unmask
    e = mem.msix_entry(5)
    assert e.address == 0x1_FEE0_0000
    assert e.data == 0x4055
    assert not e.masked
    assert mem.read(0, base + 12, 4) == 0
    mem.write(0, base + 8, 8, 0x1_0000_4056)  # one 64-bit write over data and control
    assert mem.msix_entry(5) == type(e)(0x1_FEE0_0000, 0x4056, True)


def test_pba_is_read_only_to_software(mem):
    mem.write(2, 0x100, 8, 0xFFFF_FFFF_FFFF_FFFF)
    assert mem.read(2, 0x100, 8) == 0
    mem.set_msix_pending(65, True)
    assert mem.msix_pending(65)
    assert mem.read(2, 0x108, 1) == 0b10  # second qword, bit 1
    mem.set_msix_pending(65, False)
    assert not mem.msix_pending(65)


def test_memory_next_to_the_table_is_ordinary(mem):
    mem.write(0, 0x2000 + 16 * 70, 4, 0xDEAD_BEEF)
    assert mem.read(0, 0x2000 + 16 * 70, 4) == 0xDEAD_BEEF


def test_listeners_see_cpu_writes_not_dma(mem):
    seen = []
    remove = mem.add_listener(lambda *a: seen.append(a))
    mem.write(0, 0x2000 + 12, 4, 0)
    mem.write_bytes(0, 0, b"\1")
    remove()
    mem.write(0, 0, 4, 1)
    assert seen == [(0, 0x200C, 4, 0)]


def test_reset_masks_and_clears(mem):
    mem.write(0, 0x2000 + 12, 4, 0)
    mem.write(2, 0, 4, 7)
    mem.set_msix_pending(1, True)
    mem.reset()
    assert mem.msix_entry(0).masked
    assert mem.read(2, 0, 4) == 0
    assert not mem.msix_pending(1)


@pytest.mark.parametrize(
    ("bar", "offset", "size"), [(0, 0x4000, 4), (0, 0x3FFE, 4), (0, 0, 3), (1, 0, 4), (4, 0, 4)]
)
def test_bad_accesses_are_refused(mem, bar, offset, size):
    with pytest.raises(ValueError):
        mem.read(bar, offset, size)


def test_vector_out_of_range(mem):
    with pytest.raises(ValueError):
        mem.msix_entry(70)
    with pytest.raises(ValueError):
        BarMemory((BarSpec(0, 4096),), None).msix_entry(0)


def test_msix_in_a_missing_bar_is_refused():
    with pytest.raises(ValueError):
        BarMemory((BarSpec(0, 0x4000),), MSIX)
