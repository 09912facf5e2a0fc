"""The text of a child's ``guest_bars``, ``p2p`` and ``p2p_state`` (docs/smartio-contract.md
section 8): what vmlend writes, what it reads back, and what it makes of a difference."""

from __future__ import annotations

from pathlib import Path

import pytest

from vmlend.errors import P2PError, SysfsAttributeError
from vmlend.kernel.p2pfiles import (
    MAX_MAPS,
    MapState,
    P2PLine,
    WrittenP2P,
    compare_maps,
    format_p2p,
    lines_for,
    parse_guest_bars,
    parse_p2p,
    parse_p2p_state,
    segments_by_adapter,
)
from vmlend.p2p import GuestBar, PeerBar, PeerDevice, plan_p2p
from vmlend.topology.model import BarKind, GiB
from vmlend.topology.parse import load_topology

P = Path("sys/bus/mdev/devices/u/smartio/p2p")
#: The contract's example: device 0x10 reaching BAR 1 of 0x20 and BAR 0 of 0x11.
EXAMPLE = (P2PLine(0x11, 0, 0xFD00_0000, 0x100_0000), P2PLine(0x20, 1, 0x90_0000_0000, 32 * GiB))


def test_the_contracts_example_is_what_vmlend_writes():
    assert format_p2p(42, EXAMPLE) == (
        "token 42\n0x11 0 0xfd000000 0x1000000\n0x20 1 0x9000000000 0x800000000\n"
    )


def test_a_token_line_alone_removes_every_map():
    assert format_p2p(7, ()) == "token 7\n"
    assert parse_p2p("token 7\n", P) == WrittenP2P(7, ())


def test_more_than_64_maps_is_refused_before_writing():
    lines = [P2PLine(0x20, 0, (i + 1) << 32, 4096) for i in range(MAX_MAPS + 1)]
    with pytest.raises(P2PError, match="at most 64"):
        format_p2p(1, lines)
    assert format_p2p(1, lines[:MAX_MAPS]).count("\n") == MAX_MAPS + 1


def test_a_negative_token_is_a_bug():
    with pytest.raises(ValueError):
        format_p2p(-1, EXAMPLE)


def test_what_is_written_reads_back():
    assert parse_p2p(format_p2p(42, EXAMPLE), P) == WrittenP2P(42, EXAMPLE)
    assert parse_p2p("", P) is None


@pytest.mark.parametrize(
    "text",
    [
        "0x20 1 0x0 0x1000\n",  # no token line first
        "token x\n",
        "token 1 2\n",
        "token 1\n0x20 1 0x0\n",  # three words
        "token 1\n0x20 9 0x0 0x1000\n",  # no BAR 9
        "token 1\nzz 1 0x0 0x1000\n",
        "token 1\n0x20 1 0x0 0x0\n",  # empty
        "token 1\n0x20 1 0xfffffffffffff000 0x2000\n",  # past 2^52
        "token 1\n0x20 1 0x0 0x1000\n0x20 1 0x2000 0x1000\n",  # one BAR twice
    ],
)
def test_a_damaged_p2p_is_named(text):
    with pytest.raises(SysfsAttributeError, match="p2p"):
        parse_p2p(text, P)


def test_guest_bars_lists_the_decoded_memory_bars():
    bars = parse_guest_bars("0 0xfd000000 0x1000000\n2 0x9000000000 0x800000000\n", 0x20, P)
    assert bars == (
        GuestBar(0x20, 0, 0xFD00_0000, 0x100_0000),
        GuestBar(0x20, 2, 0x90_0000_0000, 32 * GiB),
    )
    assert parse_guest_bars("", 0x20, P) == ()


@pytest.mark.parametrize(
    "text",
    [
        "0 0xfd000000\n",  # two words
        "0 0xfd000000 0x1000 extra\n",
        "6 0xfd000000 0x1000\n",  # no BAR 6
        "-1 0xfd000000 0x1000\n",
        "1 0x1000 0x1000\n0 0x2000 0x1000\n",  # out of order
        "1 0x1000 0x1000\n1 0x2000 0x1000\n",  # twice
        "0 garbage 0x1000\n",
        "0 0x1000 0\n",
    ],
)
def test_damaged_guest_bars_are_named(text):
    with pytest.raises(SysfsAttributeError, match=r"guest_bars|p2p"):
        parse_guest_bars(text, 0x20, P)


STATE = (
    "0x11 0 0xfd000000 0x1000000 same-lender - -\n"
    "0x20 1 0x9000000000 0x800000000 other-lender 0 31,30,29,28,27,26,25,24\n"
)


def test_p2p_state_reads_the_contracts_example():
    state = parse_p2p_state(STATE, P)
    assert state == (
        MapState(EXAMPLE[0], "same-lender", None, None),
        MapState(EXAMPLE[1], "other-lender", 0, (31, 30, 29, 28, 27, 26, 25, 24)),
    )
    assert segments_by_adapter(state) == {0: set(range(24, 32))}
    assert parse_p2p_state("", P) == ()


@pytest.mark.parametrize(
    "text",
    [
        "0x11 0 0xfd000000 0x1000000 same-lender -\n",  # six words
        "0x11 0 0xfd000000 0x1000000 sideways - -\n",  # unknown case
        "0x11 0 0xfd000000 0x1000000 same-lender 0 1\n",  # same-lender has no adapter
        "0x20 1 0x9000000000 0x800000000 other-lender - -\n",  # across an NTB without one
        "0x20 1 0x9000000000 0x800000000 other-lender 0 -\n",
        "0x20 1 0x9000000000 0x800000000 other-lender 0 1,x\n",
        "0x20 1 0x9000000000 0x800000000 other-lender zero 1\n",
        STATE + STATE.splitlines()[0] + "\n",  # a BAR twice
    ],
)
def test_a_damaged_p2p_state_is_named(text):
    with pytest.raises(SysfsAttributeError, match="p2p"):
        parse_p2p_state(text, P)


def _plan():
    # two devices of the default topology's alpha, in its expansion chassis
    devs = [
        PeerDevice(f, "alpha", (PeerBar(0, 0x100_0000, BarKind.MEM32, 0),), slot="chassis1")
        for f in (0x10, 0x11)
    ]
    bars = [GuestBar(0x10, 0, 0xFC00_0000, 0x100_0000), GuestBar(0x11, 0, 0xFD00_0000, 0x100_0000)]
    return plan_p2p(load_topology(), "gamma", devs, bars)


def test_the_planners_maps_become_the_sources_lines():
    plan = _plan()
    assert lines_for(plan.from_source(0x10)) == (P2PLine(0x11, 0, 0xFD00_0000, 0x100_0000),)
    assert lines_for(plan.from_source(0x11)) == (P2PLine(0x10, 0, 0xFC00_0000, 0x100_0000),)


def test_a_state_equal_to_the_plan_has_no_difference():
    planned = _plan().from_source(0x10)
    state = parse_p2p_state("0x11 0 0xfd000000 0x1000000 same-lender - -\n", P)
    assert compare_maps(planned, state) == []


def test_each_difference_is_one_line():
    planned = _plan().from_source(0x10)
    assert compare_maps(planned, ()) == [
        "no peer-to-peer map to 0x11/bar0 (the guest decodes it at 0xfd000000+0x1000000,"
        " same-lender)"
    ]
    moved = parse_p2p_state("0x11 0 0xfe000000 0x1000000 same-lender - -\n", P)
    [line] = compare_maps(planned, moved)
    assert "is at 0xfe000000+0x1000000, the guest decodes it at 0xfd000000" in line
    extra = parse_p2p_state(
        "0x11 0 0xfd000000 0x1000000 same-lender - -\n0x12 0 0x1000 0x1000 same-lender - -\n", P
    )
    assert compare_maps(planned, extra) == [
        "a peer-to-peer map to 0x12/bar0 at 0x1000+0x1000 that the guest's BARs do not call for"
    ]
    wrong_case = parse_p2p_state("0x11 0 0xfd000000 0x1000000 other-lender 0 31\n", P)
    assert compare_maps(planned, wrong_case) == [
        "the peer-to-peer map to 0x11/bar0 is other-lender, vmlend plans same-lender"
    ]
