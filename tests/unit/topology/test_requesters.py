"""Requesters as the hardware counts them: one per bus:device, and the switch ports a route
passes, each with its requester table's size from the topology."""

from __future__ import annotations

import pytest

from tests.support.simfabric import ports_topology
from vmlend.errors import TopologyError
from vmlend.topology.model import DEFAULT_REQUESTER_ENTRIES
from vmlend.topology.parse import load_topology, parse_topology
from vmlend.topology.paths import route, routes
from vmlend.topology.requesters import (
    SwitchPort,
    ports_between,
    requester_device,
    requester_share,
    route_ports,
)


def test_functions_of_one_device_are_one_requester_and_ari_vfs_past_seven_are_their_own():
    topo = parse_topology(ports_topology())
    pf = topo.device(0x100)
    assert requester_device(pf) == "l1/0000:41:00"
    # VFs 1..7 are functions of the PF's device; 8 and 9 spill into device number 1 (ARI)
    assert {requester_device(topo.device(f)) for f in range(0x101, 0x108)} == {"l1/0000:41:00"}
    assert topo.device(0x108).bdf == "0000:41:01.0"
    assert requester_device(topo.device(0x108)) == requester_device(topo.device(0x109))
    assert requester_device(topo.device(0x108)) == "l1/0000:41:01"
    # another device, and the same BDF on another lender, are other requesters
    assert requester_device(topo.device(0x110)) == "l1/0000:42:00"
    assert requester_share(topo.device(0x200)) == "req:l2/0000:41:00" != requester_share(pf)


def test_a_route_passes_the_ports_it_enters_and_leaves_each_switch_by():
    topo = parse_topology(ports_topology())
    one, two = routes(topo, "l1", "b")  # through sw to b:0, then through sw and sw2 to b:1
    assert [p.name for p in route_ports(one)] == ["sw/l1:0", "sw/b:0"]
    assert route_ports(two) == (
        SwitchPort("sw", "l1:0"),
        SwitchPort("sw", "sw2"),
        SwitchPort("sw2", "sw"),
        SwitchPort("sw2", "b:1"),
    )
    assert ports_between(topo, "l1", "b") == {
        "sw/l1:0",
        "sw/b:0",
        "sw/sw2",
        "sw2/sw",
        "sw2/b:1",
    }
    assert ports_between(topo, "l1", "l1") == set()


def test_a_back_to_back_cable_passes_no_port():
    text = """
[[node]]
name = "a"
id = 1
  [[node.adapter]]
  index = 0
[[node]]
name = "b"
id = 2
  [[node.adapter]]
  index = 0
[[link]]
ends = ["a:0", "b:0"]
"""
    path = route(parse_topology(text), "a", "b")
    assert path is not None and route_ports(path) == ()


def test_requester_entries_per_switch_and_the_default():
    topo = parse_topology(ports_topology(requester_entries=3))
    assert topo.switch_requester_entries("sw") == 3
    assert topo.switch_requester_entries("sw2") == DEFAULT_REQUESTER_ENTRIES
    assert load_topology().switch_requester_entries("mxs824") == DEFAULT_REQUESTER_ENTRIES


@pytest.mark.parametrize(
    "value,problem",
    [
        ("0", "must be at least 1"),
        ("65537", "must be at most 65536"),
        ('"many"', "expected an integer"),
        ("true", "expected an integer"),
    ],
)
def test_bad_requester_entries_are_refused(value, problem):
    text = ports_topology(requester_entries=1).replace(
        "requester_entries = 1", f"requester_entries = {value}"
    )
    with pytest.raises(TopologyError, match=rf"switch\[0\]\.requester_entries: {problem}"):
        parse_topology(text)


@pytest.mark.parametrize("name", ["sw/1", "sw:1", "-sw"])
def test_a_switch_name_that_would_pass_for_a_port_or_an_adapter_is_refused(name):
    text = ports_topology().replace('name = "sw2"', f'name = "{name}"')
    text = text.replace('ends = ["sw", "sw2"]', f'ends = ["sw", "{name}"]')
    with pytest.raises(TopologyError, match=r"switch\[1\]\.name: use letters, digits"):
        parse_topology(text)
