"""Guests: RAM ranges backed lazily by host pages, the pin oracle, guest memory access."""

from __future__ import annotations

import itertools

import pytest

from vmlend.errors import ConfigError, PinError
from vmlend.sim.addrmap import ram_ranges
from vmlend.sim.guest import SimGuest
from vmlend.sim.hostmem import FRAME, HUGE_1G, HUGE_2M, HostMemory
from vmlend.topology.model import GiB, GuestRange, MiB

# q35 with 3 GiB: 2 GiB low, 1 GiB high at 4 GiB.
Q35_3G = [GuestRange(0, 2 * GiB), GuestRange(4 * GiB, 5 * GiB)]


@pytest.fixture
def host() -> HostMemory:
    return HostMemory("gamma", ram_ranges(16 * GiB), seed=3)


def make(host, backing=HUGE_2M, ranges=Q35_3G, running=True) -> SimGuest:
    g = SimGuest("gamma", "web", ranges, host, backing=backing)
    if running:
        g.start()
    return g


def test_no_memory_before_the_guest_runs(host):
    g = make(host, running=False)
    assert not g.can_pin(0)
    with pytest.raises(PinError, match="not running"):
        g.pin(0, FRAME)
    assert host.allocated_bytes == 0
    g.start()
    assert g.can_pin(0)


def test_pin_oracle_follows_the_ranges(host):
    g = make(host)
    assert g.can_pin(0) and g.can_pin(2 * GiB - FRAME)
    assert not g.can_pin(2 * GiB)  # PCI hole
    assert not g.can_pin(3 * GiB)
    assert g.can_pin(4 * GiB) and g.can_pin(5 * GiB - 1)
    assert not g.can_pin(5 * GiB)
    assert host.allocated_bytes == 0  # probing allocates nothing


def test_memory_is_allocated_on_first_touch(host):
    g = make(host)
    g.pin(0, FRAME)
    assert host.allocated_bytes == HUGE_2M
    g.write(4 * GiB, b"x")
    assert host.allocated_bytes == 2 * HUGE_2M


def test_pin_returns_contiguous_pieces_per_backing_page(host):
    g = make(host)
    frames = g.pin(2 * MiB - 2 * FRAME, 4 * FRAME)
    assert [(f.gpa, f.size) for f in frames] == [
        (2 * MiB - 2 * FRAME, 2 * FRAME),
        (2 * MiB, 2 * FRAME),
    ]
    for f in frames:
        assert f.phys == g.host_address(f.gpa)
        assert host.owner_of(f.phys) == "web"


def test_pin_refuses_non_ram_all_or_nothing(host):
    g = make(host)
    with pytest.raises(PinError) as e:
        g.pin(2 * GiB - 2 * FRAME, 4 * FRAME)
    assert e.value.gpa == 2 * GiB
    assert g.pinned_bytes == 0
    with pytest.raises(PinError, match="aligned"):
        g.pin(0x100, FRAME)


def test_4k_backing_is_scattered(host):
    g = make(host, backing=FRAME)
    frames = g.pin(0, 32 * FRAME)
    assert len(frames) == 32
    phys = [f.phys for f in frames]
    assert len(set(phys)) == 32
    assert sum(1 for a, b in itertools.pairwise(phys) if b == a + FRAME) < 4


def test_1g_backing_straddles_low_and_high_ram_like_qemu(host):
    # q35 with 2816 MiB low: the second gigabyte page backs the low tail and the high head.
    low = 0xB000_0000
    g = make(host, backing=HUGE_1G, ranges=[GuestRange(0, low), GuestRange(4 * GiB, 5 * GiB)])
    tail = g.host_address(low - FRAME)
    head = g.host_address(4 * GiB)
    assert head == tail + FRAME


def test_unpin_and_stop(host):
    g = make(host)
    g.pin(0, 4 * MiB)
    g.pin(0, 2 * MiB)  # pins count
    with pytest.raises(PinError, match="still pinned"):
        g.stop()
    g.unpin(0, 4 * MiB)
    assert g.pinned_bytes == HUGE_2M
    g.unpin(0, 2 * MiB)
    g.stop()
    assert host.allocated_bytes == 0 and not g.running


def test_guest_memory_read_write_across_ranges(host):
    g = make(host, backing=FRAME)
    data = bytes(range(200)) * 50
    g.write(4 * GiB + 5, data)
    assert g.read(4 * GiB + 5, len(data)) == data
    assert host.read(g.host_address(4 * GiB + 5), 3) == data[:3]
    with pytest.raises(PinError):
        g.write(2 * GiB - 2, b"abcd")  # runs into the hole


def test_backed_does_not_touch(host):
    g = make(host)
    assert g.backed(0) is None
    addr = g.host_address(0x1234)
    assert g.backed(0x1234) == addr
    assert g.backed(3 * GiB) is None


@pytest.mark.parametrize(
    "ranges",
    [
        [GuestRange(0, 0x1800)],
        [GuestRange(0, 2 * MiB), GuestRange(1 * MiB, 3 * MiB)],
        [GuestRange(4096, 4096)],
    ],
)
def test_bad_ranges(host, ranges):
    with pytest.raises(ConfigError):
        SimGuest("gamma", "bad", ranges, host)


def test_bad_backing(host):
    with pytest.raises(ConfigError):
        SimGuest("gamma", "bad", Q35_3G, host, backing=64 * 1024)
