"""Host RAM: scattered frames, huge pages while available, contents byte for byte."""

from __future__ import annotations

import itertools

import pytest

from vmlend.errors import ResourceExhaustedError
from vmlend.sim.addrmap import ram_ranges
from vmlend.sim.hostmem import FRAME, HUGE_1G, HUGE_2M, HostMemory
from vmlend.topology.model import GiB, MiB


@pytest.fixture
def mem() -> HostMemory:
    return HostMemory("alpha", ram_ranges(8 * GiB), seed=1)


def test_ram_layout_has_the_pci_hole():
    assert ram_ranges(1 * GiB) == [(0, 1 * GiB)]
    assert ram_ranges(8 * GiB) == [(0, 2 * GiB), (4 * GiB, 10 * GiB)]


def test_frames_are_scattered_and_distinct(mem):
    frames = [mem.alloc(FRAME, owner="vm1") for _ in range(64)]
    assert len(set(frames)) == 64
    assert all(f % FRAME == 0 and mem.contains(f, FRAME) for f in frames)
    steps = {b - a for a, b in itertools.pairwise(frames)}
    assert FRAME not in steps or len(steps) > 10  # not a bump allocator
    contiguous_pairs = sum(1 for a, b in itertools.pairwise(frames) if b == a + FRAME)
    assert contiguous_pairs < 8


def test_allocation_is_reproducible():
    a = HostMemory("alpha", ram_ranges(4 * GiB), seed=7)
    b = HostMemory("alpha", ram_ranges(4 * GiB), seed=7)
    c = HostMemory("alpha", ram_ranges(4 * GiB), seed=8)
    pa = [a.alloc(FRAME) for _ in range(10)]
    assert pa == [b.alloc(FRAME) for _ in range(10)]
    assert pa != [c.alloc(FRAME) for _ in range(10)]


def test_huge_pages_are_aligned(mem):
    m = mem.alloc(HUGE_2M)
    g = mem.alloc(HUGE_1G)
    assert m % HUGE_2M == 0 and g % HUGE_1G == 0
    assert not (g <= m < g + HUGE_1G)


def test_gigabytes_run_out_while_smaller_pages_remain(mem):
    gigs = mem.available(HUGE_1G)
    assert gigs == 8
    mem.alloc(FRAME)  # breaks one gigabyte
    assert mem.available(HUGE_1G) == 7
    for _ in range(7):
        mem.alloc(HUGE_1G)
    with pytest.raises(ResourceExhaustedError, match="1 GiB pages"):
        mem.alloc(HUGE_1G)
    assert mem.alloc(HUGE_2M) % HUGE_2M == 0


def test_freeing_coalesces_back_to_a_gigabyte(mem):
    frames = [mem.alloc(FRAME) for _ in range(3)]
    assert mem.available(HUGE_1G) == 7
    for f in frames:
        mem.free(f)
    assert mem.available(HUGE_1G) == 8
    assert mem.allocated_bytes == 0


def test_exhaustion_of_frames():
    small = HostMemory("tiny", [(0, 4 * MiB)])
    for _ in range(1024):
        small.alloc(FRAME)
    with pytest.raises(ResourceExhaustedError):
        small.alloc(FRAME)


def test_odd_tails_become_loose_frames():
    mem = HostMemory("odd", [(0, 2 * MiB + 3 * FRAME + 100)])
    assert mem.available(FRAME) == 512 + 3


def test_contents_byte_for_byte(mem):
    f = mem.alloc(FRAME)
    mem.write(f + 4090, b"hello, world")  # crosses into the next frame
    assert mem.read(f + 4090, 12) == b"hello, world"
    assert mem.read(f, 4) == b"\0\0\0\0"
    assert mem.pages_stored == 2


def test_free_forgets_contents(mem):
    f = mem.alloc(FRAME)
    mem.write(f, b"secret")
    mem.free(f)
    assert mem.read(f, 6) == bytes(6)


def test_owner_tags(mem):
    g = mem.alloc(HUGE_1G, owner="vm1")
    f = mem.alloc(FRAME, owner="vm2")
    assert mem.owner_of(g + 12345) == "vm1"
    assert mem.owner_of(f + 1) == "vm2"
    assert mem.owner_of(f + FRAME) in (None, "vm2") and mem.owner_of(f + FRAME) != "vm1"


def test_bad_requests(mem):
    with pytest.raises(ValueError):
        mem.alloc(8192)
    with pytest.raises(ValueError):
        mem.free(0x1234_5000)
    with pytest.raises(ValueError):
        mem.read(3 * GiB, 4)  # the PCI hole is not RAM
