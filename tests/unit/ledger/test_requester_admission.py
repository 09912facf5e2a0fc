"""Admission charges requesters as the hardware counts them (issue 40, point 3): one LUT entry
per requester bus:device on each adapter of a crossing, and one entry in the requester table
of every cluster switch port on its route; a full port refuses in one line naming the switch
and the port, and nothing is claimed."""

from __future__ import annotations

import uuid

import pytest

from tests.support.simcluster import Cluster, domain_of
from tests.support.simfabric import make_fabric, ports_topology
from vmlend.errors import ResourceExhaustedError, SwitchPortFullError, VmlendError
from vmlend.ledger.admission import port_usage
from vmlend.registry import ClaimKind
from vmlend.sim.invariants import check_with_registry
from vmlend.topology.model import GiB, Holder

VM1, VM2, VM3 = Holder("b", "vm1"), Holder("b", "vm2"), Holder("b", "vm3")
PF, VF1, VF7, VF8, VF9, GPU1, GPU2 = 0x100, 0x101, 0x107, 0x108, 0x109, 0x110, 0x200


def lut(fabric, ref: str) -> int:
    return fabric.usage()[ref].lut_used


def port_entries(fabric, *ports: str) -> dict[str, int]:
    with fabric.registry.read() as tx:
        return port_usage(tx.claims(), ports)


def test_two_functions_of_one_device_charge_one_lut_entry(tmp_path):
    f = make_fabric(tmp_path / "s.db", ports_topology(), node="b")
    f.reserve(PF, VM1, guest_ram=GiB)
    f.reserve(VF1, VM2, guest_ram=GiB)  # function 1 of the same device, another VM
    assert (lut(f, "l1:0"), lut(f, "b:0")) == (1, 1)
    f.reserve(VF7, VM3, guest_ram=GiB)
    assert (lut(f, "l1:0"), lut(f, "b:0")) == (1, 1)
    assert port_entries(f, "sw/l1:0", "sw/b:0") == {"sw/l1:0": 1, "sw/b:0": 1}
    # the entry stays while a function of the device still crosses
    f.release(PF, VM1)
    f.release(VF1, VM2)
    assert (lut(f, "l1:0"), lut(f, "b:0")) == (1, 1)
    f.release(VF7, VM3)
    assert (lut(f, "l1:0"), lut(f, "b:0")) == (0, 0)
    assert port_entries(f, "sw/l1:0", "sw/b:0") == {"sw/l1:0": 0, "sw/b:0": 0}
    f.close()


def test_ari_vfs_beyond_function_seven_charge_their_own_entry(tmp_path):
    f = make_fabric(tmp_path / "s.db", ports_topology(), node="b")
    f.reserve(PF, VM1, guest_ram=GiB)
    f.reserve(VF8, VM2, guest_ram=GiB)  # 41:01.0: device number 1 under ARI
    assert (lut(f, "l1:0"), lut(f, "b:0")) == (2, 2)
    f.reserve(VF9, VM3, guest_ram=GiB)  # 41:01.1 shares device 1's entry
    assert (lut(f, "l1:0"), lut(f, "b:0")) == (2, 2)
    f.close()


def test_a_full_lut_still_takes_another_function_of_a_device_it_has(tmp_path):
    # b:0 has 3 entries, 2 for its CPU: one usable
    f = make_fabric(tmp_path / "s.db", ports_topology(borrower_lut_entries=3), node="b")
    f.reserve(PF, VM1)
    f.reserve(VF1, VM2)  # no entry more: it shares the PF's
    checks = f.admission(GPU1, "b", holder=VM3)
    check = next(c for c in checks if c.name == "lut")
    assert not check.ok and "requester LUT on b:0" in check.detail
    with pytest.raises(ResourceExhaustedError, match="requester LUT on b:0"):
        f.reserve(GPU1, VM3)
    f.close()


def test_a_full_switch_port_refuses_in_one_line_naming_the_switch_and_port(tmp_path):
    f = make_fabric(tmp_path / "s.db", ports_topology(requester_entries=1), node="b")
    f.reserve(PF, VM1, guest_ram=GiB)  # sw/l1:0 and sw/b:0 now hold l1's 41:00
    with f.registry.read() as tx:
        before = sorted(tx.claims(), key=repr)
    with pytest.raises(SwitchPortFullError) as refused:
        f.reserve(GPU2, VM2, guest_ram=GiB)  # l2's GPU: sw/l2:0 has room, sw/b:0 has none
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("switch sw port sw/b:0: its requester table is full (1 of 1")
    assert "requester l2/0000:41:00" in message
    assert (refused.value.switch, refused.value.port) == ("sw", "sw/b:0")
    # nothing claimed, nothing held
    with f.registry.read() as tx:
        assert sorted(tx.claims(), key=repr) == before
        assert tx.hold(GPU2) is None
    # the dry run says the same in its "ports" check
    checks = f.admission(GPU2, "b", GiB, holder=VM2)
    ports = next(c for c in checks if c.name == "ports")
    assert not ports.ok and ports.detail == message
    # another function of the device the port holds passes; another borrower's ports are free
    f.reserve(VF1, VM2, guest_ram=GiB)
    f.reserve(GPU2, Holder("c", "vm4"), guest_ram=GiB)
    assert port_entries(f, "sw/b:0", "sw/c:0", "sw/l2:0") == {
        "sw/b:0": 1,
        "sw/c:0": 1,
        "sw/l2:0": 1,
    }
    f.close()


def test_a_vm_refused_on_a_full_port_claims_nothing(state_path):
    """The hook's prepare of a VM whose second device finds a port full: all or nothing."""
    c = Cluster.create(state_path, ports_topology(requester_entries=1), node="b")
    try:
        first = domain_of("first", str(uuid.uuid4()), (PF,))
        c.prepare(first, "b")
        claims = c.claims()
        second = domain_of("second", str(uuid.uuid4()), (VF1, GPU2))  # VF1 fits, GPU2 does not
        with pytest.raises(VmlendError, match="switch sw port sw/b:0: its requester table is full"):
            c.prepare(second, "b")
        assert c.claims() == claims
        assert set(c.fabric("b").holds()) == {PF}
    finally:
        c.close()


def test_the_claims_follow_a_rerouted_crossing_onto_its_ports(state_path):
    """A cable of the route goes down: the crossing moves to the route through sw2, and the
    hold's port claims move with it (the checker proves claimed == in use on every port)."""
    c = Cluster.create(state_path, ports_topology(), node="b")
    try:
        f = c.fabric("b")
        f.reserve(GPU1, VM1, guest_ram=GiB)
        f.borrow(GPU1, VM1)
        assert check_with_registry(c.hw, c.registry) == []

        def ports() -> set[str]:
            return {
                cl.adapter
                for fd, cl in c.claims()
                if fd == GPU1 and cl.kind is ClaimKind.LUT and "/" in cl.adapter
            }

        assert ports() == {"sw/l1:0", "sw/b:0"}
        change = f.set_link_up("sw/b:0", False)
        assert [x.state for x in change.faults] == ["rerouted"]
        assert ports() == {"sw/l1:0", "sw/sw2", "sw2/sw", "sw2/b:1"}
        assert c.hw.switch_ports.entries("sw/b:0") == {}
        assert check_with_registry(c.hw, c.registry) == []
    finally:
        c.close()
