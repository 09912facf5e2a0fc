"""The simulated switch ports' requester tables and LUT entries per requester device, and
the invariant checker's proof that what admission claims on them is what is in use."""

from __future__ import annotations

import pytest

from tests.support.simfabric import ports_topology
from vmlend.errors import SwitchPortFullError
from vmlend.ledger.admission import bar_segments, device_share
from vmlend.registry import Claim, ClaimKind, HoldRecord, Phase
from vmlend.sim.hardware import SimHardware
from vmlend.sim.invariants import check_hardware
from vmlend.topology.model import Holder
from vmlend.topology.parse import parse_topology
from vmlend.topology.requesters import SwitchPort, requester_share

PF, VF1, VF8, GPU1, GPU2 = 0x100, 0x101, 0x108, 0x110, 0x200


def hardware(**kw) -> SimHardware:
    return SimHardware.from_topology(parse_topology(ports_topology(**kw)))


def test_functions_of_one_device_share_a_lut_entry_and_enter_with_their_own_ids():
    hw = hardware()
    pf, vf = hw.borrow(PF, "b", "vm1"), hw.borrow(VF1, "b", "vm2")
    assert pf.lender_entry == vf.lender_entry and pf.borrower_entry == vf.borrower_entry
    assert hw.adapter("l1:0").lut_used == hw.adapter("b:0").lut_used == 1
    # the function passes through: the borrower's IOMMU tells them apart
    assert pf.ingress is not None and vf.ingress is not None and pf.ingress != vf.ingress
    assert hw.borrow(VF8, "b", "vm3").borrower_entry != pf.borrower_entry  # ARI: device 1
    assert hw.adapter("b:0").lut_used == 2
    assert check_hardware(hw) == []
    hw.give_back(PF)
    assert hw.adapter("b:0").lut_lookup(hw.requester_key(VF1)) == vf.borrower_entry
    assert hw.adapter("b:0").lut_lookup(hw.requester_key(PF)) is None
    assert check_hardware(hw) == []


def test_a_borrow_holds_an_entry_on_each_port_of_its_route_until_it_ends():
    hw = hardware()
    hw.borrow(PF, "b", "vm1")
    hw.borrow(VF1, "b", "vm2")
    assert hw.switch_ports.ports() == ["sw/b:0", "sw/l1:0"]
    assert hw.switch_ports.entries("sw/b:0") == {"l1/0000:41:00": frozenset({PF, VF1})}
    hw.give_back(PF)
    hw.give_back(VF1)
    assert hw.switch_ports.ports() == []


def test_a_full_port_refuses_the_borrow_and_changes_nothing():
    hw = hardware(requester_entries=1)
    hw.borrow(PF, "b", "vm1")
    luts = {a.ref: a.lut() for a in hw.adapters()}
    with pytest.raises(SwitchPortFullError, match=r"^switch sw port sw/b:0: its requester"):
        hw.borrow(GPU2, "b", "vm2")
    assert hw.borrowed(GPU2) is None
    assert {a.ref: a.lut() for a in hw.adapters()} == luts
    assert hw.switch_ports.ports() == ["sw/b:0", "sw/l1:0"]
    hw.borrow(VF1, "b", "vm2")  # another function of the device the port holds
    assert check_hardware(hw) == []


def _claims(hw: SimHardware, fdid: int) -> list[tuple[int, Claim]]:
    """What admission claims for ``fdid``'s borrow: LUT entries on both adapters and on the
    ports of its route, under its requester's share, and its BAR windows' segments."""
    b = hw.borrowed(fdid)
    assert b is not None and b.path is not None
    spec = hw.device(fdid).spec
    share = requester_share(spec)
    where = [b.path.src.ref, b.path.dst.ref, *(p.name for p in hw.crossing_ports(fdid))]
    segs = bar_segments(spec, b.path.dst.segment_size)
    bars = Claim(b.path.dst.ref, ClaimKind.BAR, device_share(fdid), segments=segs)
    return [(fdid, Claim(w, ClaimKind.LUT, share, entries=1)) for w in where] + [(fdid, bars)]


def _holds(hw: SimHardware) -> dict[int, HoldRecord]:
    return {
        b.fdid: HoldRecord(b.fdid, Holder(b.node, b.vm), 0.0, Phase.BORROWED)
        for b in hw.borrows()
    }


def found(hw: SimHardware, claims: list[tuple[int, Claim]]) -> list[str]:
    return [str(v) for v in check_hardware(hw, holds=_holds(hw), claims=claims)]


def test_the_checker_proves_port_claims_equal_the_entries_in_use():
    hw = hardware()
    hw.borrow(GPU1, "b", "vm1")
    claims = _claims(hw, GPU1)
    assert found(hw, claims) == []
    # an entry in use that its hold does not claim
    assert found(hw, [c for c in claims if c[1].adapter != "sw/b:0"]) == [
        "claims sw/b:0: requester entry req:l1/0000:42:00 of 0x110 in use, not claimed by its"
        " hold"
    ]


def test_the_checker_catches_a_leaked_port_claim():
    """A claim left on a port of another route between the lender and the VM's node (what a
    re-route that did not move its claims leaves): claimed > in use."""
    hw = hardware()
    hw.borrow(GPU1, "b", "vm1")
    share = requester_share(hw.device(GPU1).spec)
    leaked = (GPU1, Claim("sw2/b:1", ClaimKind.LUT, share, entries=1))
    assert found(hw, [*_claims(hw, GPU1), leaked]) == [
        "claims sw2/b:1: requester entry req:l1/0000:42:00 claimed for 0x110, whose crossing"
        " does not hold it"
    ]


def test_the_checker_catches_port_entries_the_crossings_do_not_explain():
    hw = hardware()
    hw.borrow(GPU1, "b", "vm1")
    # left behind by a borrow that ended (the table says whose it was)
    hw.switch_ports.add([SwitchPort("sw", "c:0")], "l2/0000:41:00", GPU2)
    assert [v for v in found(hw, _claims(hw, GPU1)) if v.startswith("port")] == [
        "port sw/c:0 entry l2/0000:41:00: held for 0x200, whose crossing does not pass it"
    ]
    # and one a crossing needs, gone from its port
    hw = hardware()
    hw.borrow(GPU1, "b", "vm1")
    hw.switch_ports.remove([SwitchPort("sw", "l1:0")], "l1/0000:42:00", GPU1)
    assert [v for v in found(hw, _claims(hw, GPU1)) if v.startswith("port")] == [
        "port sw/l1:0: no entry for requester l1/0000:42:00 of 0x110, whose crossing passes it"
    ]
