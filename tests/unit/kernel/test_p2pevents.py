"""What a child's section 8 uevent asks of vmlend, decided without I/O: which events count,
the writes of a plan, a plan against the VM's P2P claims, and the records kept from
``p2p_state``."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.support.hypothesis_tiers import examples
from vmlend.errors import P2PError
from vmlend.kernel.p2pevents import (
    Child,
    ChildEvent,
    child_event,
    chunks,
    over_claims,
    plan_writes,
    state_records,
)
from vmlend.kernel.p2pfiles import MapState, P2PLine
from vmlend.kernel.udev import Uevent
from vmlend.ledger.admission import p2p_claims
from vmlend.p2p import GuestBar
from vmlend.registry.records import Claim, ClaimKind
from vmlend.topology.model import GiB, Holder
from vmlend.topology.parse import load_topology

WEB = Holder("gamma", "web")
U = "83b8f4f2-509f-382f-3c1e-e6bfe0fa2001"
CHILDREN = [Child("a", 0x10, 5), Child("b", 0x20, 6)]
BARS = [GuestBar(0x20, 1, 0x90_0000_0000, 32 * GiB), GuestBar(0x10, 0, 0xC000_0000, 16 << 20)]


@pytest.fixture(scope="module")
def topo():
    return load_topology()


@pytest.mark.parametrize(
    ("ev", "want"),
    [
        (Uevent("change", U, "mdev", {"SMARTIO_BARS": "2"}), ChildEvent(U, True, False)),
        (Uevent("change", U, "mdev", {"SMARTIO_P2P": "0"}), ChildEvent(U, False, True)),
        (
            Uevent("change", U, "mdev", {"SMARTIO_BARS": "0", "SMARTIO_P2P": "0"}),
            ChildEvent(U, True, True),
        ),
        (Uevent("change", U, "mdev", {"SMARTIO_DMA": "mapped"}), None),
        (Uevent("add", U, "mdev", {"SMARTIO_BARS": "1"}), None),
        (Uevent("change", "smartio-10", "smartio", {"SMARTIO_BARS": "1"}), None),
    ],
)
def test_only_a_childs_change_with_bars_or_p2p_counts(ev, want):
    assert child_event(ev) == want


@pytest.mark.parametrize(
    ("gpa", "size", "want"),
    [
        (0, 4 * GiB, 1),
        (0x90_0000_0000, 32 * GiB, 8),
        (0xC000_0000, 16 << 20, 1),
        (4 * GiB - 4096, 8192, 2),  # straddles a segment boundary
    ],
)
def test_a_map_takes_one_segment_per_chunk_it_touches(gpa, size, want):
    assert chunks(gpa, size, 4 * GiB) == want


def test_every_child_gets_a_write_the_empty_ones_their_token_alone(topo):
    plan, writes = plan_writes(topo, "gamma", CHILDREN, BARS[:1])
    assert [(w.child.fdid, w.lines) for w in writes] == [
        (0x10, (P2PLine(0x20, 1, 0x90_0000_0000, 32 * GiB),)),
        (0x20, ()),
    ]
    assert [m.key for m in plan.maps] == ["0x20/bar1"]


def test_a_plan_within_admissions_claims_passes(topo):
    plan, _ = plan_writes(topo, "gamma", CHILDREN, BARS)
    claims = [c for _f, c in p2p_claims(topo, WEB, [topo.device(0x10), topo.device(0x20)])]
    assert over_claims(topo, WEB, plan.maps, claims) == []


def test_a_bar_the_guest_put_across_more_chunks_than_claimed_is_named(topo):
    plan, _ = plan_writes(topo, "gamma", CHILDREN, BARS)
    share = "p2p:gamma/web>0x20/bar1"
    claims = [Claim("alpha:0", ClaimKind.P2P, share, segments=7)]
    over = over_claims(topo, WEB, plan.maps, claims)
    assert over[0] == (
        "device 0x10 reaching BAR 1 of 0x20 at 0x9000000000+0x800000000 needs 8 segment(s) of"
        " alpha:0, admission claimed 7"
    )
    assert len(over) == 2  # and 0x20 reaching 0x10's BAR 0, never claimed


def test_records_follow_the_state_keeping_what_vmlend_knew():
    line = P2PLine(0x20, 1, 0x90_0000_0000, 32 * GiB)
    kept = {"0x20/bar1": {"iova": line.gpa, "size": line.size, "route": ["x"], "segments": None}}
    state = [
        MapState(line, "other-lender", 0, (31, 30)),
        MapState(P2PLine(0x11, 0, 0xC000_0000, 16 << 20), "same-lender", None, None),
    ]
    out = state_records(0x10, state, kept)
    assert out["0x20/bar1"] == {**kept["0x20/bar1"], "segments": [31, 30]}
    assert out["0x11/bar0"]["case"] == "same-lender" and out["0x11/bar0"]["segments"] is None
    assert state_records(0x10, [], kept) == {}
    moved = [MapState(P2PLine(0x20, 1, 0xA0_0000_0000, 32 * GiB), "other-lender", 0, (1,))]
    assert "route" not in state_records(0x10, moved, kept)["0x20/bar1"]  # not what was planned


VM = (0x10, 0x20, 0x21)  # two GPUs on alpha and beta, a NIC on beta


@settings(max_examples=examples(60), deadline=None)
@given(st.data())
def test_wherever_an_honest_guest_puts_its_bars_the_plan_fits_admissions_claims(topo, data):
    """Admission claims the most a BAR can touch (``p2p_claims``): any naturally aligned
    placement the planner accepts needs no more, so the watcher never refuses an honest
    guest."""
    bars = []
    for fdid in VM:
        for b in topo.device(fdid).bars:
            top = (4 * GiB if b.kind.value == "mem32" else 1 << 40) // b.size
            bars.append(GuestBar(fdid, b.index, data.draw(st.integers(1, top - 1)) * b.size,
                                 b.size))  # fmt: skip
    children = [Child(f"c{f:x}", f, 1) for f in VM]
    try:
        plan, _ = plan_writes(topo, "gamma", children, bars)
    except P2PError:
        assume(False)  # overlapping BARs: the planner refuses them before any claim matters
    claims = [c for _f, c in p2p_claims(topo, WEB, [topo.device(f) for f in VM])]
    assert over_claims(topo, WEB, plan.maps, claims) == []
