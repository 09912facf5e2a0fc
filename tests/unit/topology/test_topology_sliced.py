"""The compiled topology decoded per node and device (``vmlend.topology.sliced``): every
lookup answers what the parsed topology answers, and only the records asked for are decoded."""

from __future__ import annotations

import msgspec
import pytest

from tests.support.simfabric import fabric_topology, star_topology
from vmlend.errors import UnknownDeviceError, UnknownNodeError
from vmlend.topology.compiled import compile_topology, decode_compiled
from vmlend.topology.model import Topology
from vmlend.topology.parse import parse_topology
from vmlend.topology.paths import route
from vmlend.topology.sliced import DeviceTable, NodeTable
from vmlend.wiring.fabric import default_topology_text


def decoded(parsed: Topology) -> Topology:
    topology = decode_compiled(compile_topology(parsed, "d"), "d")
    assert topology is not None
    return topology


def tables(topology: Topology) -> tuple[NodeTable, DeviceTable]:
    nodes, devices = topology.nodes, topology.devices
    assert isinstance(nodes, NodeTable) and isinstance(devices, DeviceTable)
    return nodes, devices


def decoded_count(table: NodeTable | DeviceTable) -> int:
    slices = table._slices
    return len(slices._every) if slices._every is not None else len(slices._one)


@pytest.mark.parametrize(
    "text",
    [default_topology_text()[0], star_topology(3, 4), fabric_topology(6, 5)],
    ids=["default", "star", "fabric"],
)
def test_every_lookup_answers_what_the_parsed_topology_answers(text):
    parsed = parse_topology(text, "t.toml")
    lazy = decoded(parsed)
    for n in parsed.nodes:
        assert lazy.node(n.name) == n and lazy.has_node(n.name)
        assert lazy.devices_of(n.name) == parsed.devices_of(n.name)
        assert lazy.devices_of(n.name) == [d for d in parsed.devices if d.lender == n.name]
        for a in n.adapters:
            assert lazy.adapter(a.ref) == parsed.adapter(a.ref) == a
    for d in parsed.devices:
        assert lazy.device(d.fdid) == d and lazy.has_device(d.fdid)
    for src in parsed.nodes:
        for dst in parsed.nodes:
            assert route(lazy, src.name, dst.name) == route(parsed, src.name, dst.name)
    assert lazy == parsed and hash(lazy) == hash(parsed)
    assert lazy.nodes[-1] == parsed.nodes[-1] and lazy.devices[1:3] == parsed.devices[1:3]
    assert list(lazy.devices) == list(parsed.devices) and len(lazy.nodes) == len(parsed.nodes)


def test_unknown_keys_are_refused_as_in_the_parsed_topology():
    lazy = decoded(parse_topology(fabric_topology(4, 3), "t.toml"))
    with pytest.raises(UnknownNodeError):
        lazy.node("nowhere")
    with pytest.raises(UnknownDeviceError):
        lazy.device(0xFFFF)
    assert not lazy.has_device(0) and not lazy.has_node("n0:0")
    assert lazy.adapter("n1:7") is None and lazy.adapter("nowhere:0") is None
    assert lazy.adapter("n1") is None and lazy.devices_of("nowhere") == []
    with pytest.raises(IndexError):
        lazy.nodes[len(lazy.nodes)]


def test_a_lookup_decodes_only_what_it_asks_for():
    lazy = decoded(parse_topology(fabric_topology(64, 16), "t.toml"))
    nodes, devices = tables(lazy)
    lazy.node("n40")
    lazy.device(0x2A05)  # n41's sixth device
    lazy.adapter("n3:0")
    assert decoded_count(nodes) == 2 and decoded_count(devices) == 1
    assert [d.fdid for d in lazy.devices_of("n7")] == list(range(0x800, 0x810))
    assert decoded_count(devices) == 17
    route(lazy, "n1", "n60")
    assert decoded_count(nodes) == 4  # n1 and n60 added (devices_of decodes no node)
    assert len(list(lazy.devices)) == 64 * 16 and decoded_count(devices) == 64 * 16


def test_a_topology_whose_keys_a_slice_cannot_answer_alike_is_not_compiled():
    parsed = parse_topology(fabric_topology(2, 2), "t.toml")
    twice = msgspec.structs.replace(parsed, nodes=(parsed.nodes[0], *parsed.nodes))
    stray = msgspec.structs.replace(
        parsed, devices=(msgspec.structs.replace(parsed.devices[0], lender="ghost"),)
    )
    assert compile_topology(parsed, "d") is not None
    assert compile_topology(twice, "d") is None
    assert compile_topology(stray, "d") is None
