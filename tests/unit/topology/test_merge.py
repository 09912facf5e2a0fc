"""Merging what a host's SmartIO driver describes into a topology (``merge_host``): a new
host, a host the topology knows, what is left for a topology file, and conflicts."""

from __future__ import annotations

import msgspec
import pytest

from tests.support.discovery import HOST_A, TWO_HOSTS, adapter, device, host
from vmlend.topology.merge import merge_host
from vmlend.topology.model import GiB, LinkSpec, Topology
from vmlend.topology.parse import parse_topology
from vmlend.topology.render import render_topology
from vmlend.wiring.fabric import default_topology_text, same_topology


@pytest.fixture
def two() -> Topology:
    return parse_topology(TWO_HOSTS, "two.toml")


def merged(m) -> Topology:
    assert m.conflicts == (), m.conflicts
    assert m.topology is not None
    # what is stored is the text: it must read back as what was merged
    back = parse_topology(render_topology(m.topology), "back")
    assert same_topology(back, m.topology)
    return m.topology


def lines(m) -> list[str]:
    return [c.line() for c in m.changes]


def test_a_host_the_topology_has_as_it_is_merges_nothing(two):
    m = merge_host(two, HOST_A)
    assert (m.node, m.new_node, m.changes, m.conflicts) == ("a", False, (), ())
    assert merged(m) == two


def test_a_first_host_makes_a_topology_of_its_own():
    h = host(
        7,
        (adapter(0, segments=64, link_up=False), adapter(1, peer=(9, 0))),
        (device(0x40), device(0x41, "0000:42:00.0", kind="gpu", class_code=0x030200, lent=False)),
        hostname="delta.example.org",
        ram=512 * GiB,
    )
    m = merge_host(None, h)
    topo = merged(m)
    assert (m.node, m.new_node) == ("delta", True)
    assert [n.name for n in topo.nodes] == ["delta"]
    node = topo.node("delta")
    assert (node.node_id, node.hostname, node.ram) == (7, "delta.example.org", 512 * GiB)
    assert [(a.index, a.segments) for a in node.adapters] == [(0, 64), (1, 32)]
    assert topo.links == ()  # node id 9 is nobody yet
    assert [(d.fdid, d.kind, d.lent) for d in topo.devices] == [
        (0x40, "nvme", True), (0x41, "gpu", False),
    ]  # fmt: skip
    assert lines(m)[0] == (
        "added node delta: node id 7, hostname delta.example.org, RAM 512GiB"
    )
    assert "added device 0x41: gpu 0000:42:00.0 8086:0a54, unlent" in lines(m)
    assert any("node id 9, which no node of the topology has" in n for n in m.notes)
    assert any("adapter delta:0 has no link" in n for n in m.notes)
    # the same host again: nothing
    again = merge_host(topo, h)
    assert again.changes == () and again.topology == topo


def test_a_new_host_joins_and_its_cable_to_a_known_adapter_is_merged(two):
    # node 3 cabled back to back to a:0? a:0 is taken (a conflict, below); to a new a:1 is not
    # in the topology: the cable waits for a's own discovery
    h = host(3, (adapter(0, peer=(1, 1)),), (device(0x30),), hostname="c")
    m = merge_host(two, h)
    topo = merged(m)
    assert topo.links == two.links
    assert any("leads to a:1, which is not in the topology" in n for n in m.notes)
    # a's discovery adds a:1 and the cable to c:0
    a = msgspec.structs.replace(HOST_A, adapters=(*HOST_A.adapters, adapter(1, peer=(3, 0))))
    m2 = merge_host(topo, a)
    topo2 = merged(m2)
    assert lines(m2) == [
        "added adapter a:1: PXH830, window 128GiB in 32 segments, 32 LUT entries",
        "added link a:1-c:0: back-to-back cable",
    ]
    assert topo2.links[:2] == (LinkSpec(("a:0", "b:0")), LinkSpec(("a:1", "c:0")))
    assert topo2.links[2].switch == "sw"  # cables first, switches after, as a file has them
    assert merge_host(topo2, a).changes == ()
    assert merge_host(topo2, h).changes == ()  # c sees the same cable from its end


def test_a_known_host_gets_its_new_devices_and_its_adapters_hardware(two):
    h = msgspec.structs.replace(
        HOST_A,
        adapters=(adapter(0, peer=(2, 0), window_size=64 * GiB, lut_entries=64),),
        devices=(
            device(0x10, dma_bits=48),
            device(0x11, "0000:43:00.0", kind="nic", class_code=0x020000, device_id=0x1521),
        ),
    )
    m = merge_host(two, h)
    topo = merged(m)
    assert lines(m) == [
        "updated adapter a:0: window_size 128GiB -> 64GiB; lut_entries 32 -> 64",
        "updated device 0x10: dma_bits 64 -> 48",
        "added device 0x11: nic 0000:43:00.0 8086:1521",
    ]
    old, new = two.device(0x10), topo.device(0x10)
    # what the driver does not publish stays the topology's
    assert new.msix == old.msix and new.kind == "nvme" and new.intx_pin == old.intx_pin
    assert topo.node("a").adapters[0].cpus == 1
    assert merge_host(topo, h).changes == ()


def test_sriov_functions_are_merged_as_the_pfs_vfs():
    vf_bars = device(0x20).bars
    h = host(
        5,
        (adapter(0, link_up=False),),
        (
            device(0x20, "0000:81:00.0", kind="nic", class_code=0x020000),
            # VFs as the parser places them: functions 1 and 2 of the PF's device
            device(0x22, "0000:81:00.2", kind="vf", class_code=0x020000, physfn=0x20,
                   device_id=0x1520, bars=vf_bars, lent=False),
            device(0x21, "0000:81:00.1", kind="vf", class_code=0x020000, physfn=0x20,
                   device_id=0x1520, bars=vf_bars),
        ),
        hostname="e",
    )  # fmt: skip
    topo = merged(merge_host(None, h))
    assert [(d.fdid, d.physfn, d.intx_pin, d.lent) for d in topo.devices] == [
        (0x20, None, 1, True), (0x21, 0x20, 0, True), (0x22, 0x20, 0, True),
    ]  # fmt: skip
    assert "sriov = { vfs = 2, first_fdid = 0x21" in render_topology(topo)


def test_the_default_cluster_merges_gamma_unchanged():
    topo = parse_topology(*default_topology_text())
    gamma = host(
        12,
        (adapter(0, switch_port=3), adapter(1, switch_port=0)),
        hostname="gamma.fabric.local",
    )
    m = merge_host(topo, gamma)
    assert (m.node, m.changes, m.conflicts, m.notes) == ("gamma", (), (), ())


def test_a_switch_port_not_in_the_topology_is_left_for_a_topology_file(two):
    h = host(3, (adapter(0, switch_port=4),), hostname="c")
    m = merge_host(two, h)
    merged(m)
    assert any(
        "c:0 is cabled to port 4 of a cluster switch" in n and "[[switch]]" in n for n in m.notes
    )


def test_devices_the_driver_no_longer_lists_are_kept_and_named(two):
    m = merge_host(two, msgspec.structs.replace(HOST_A, devices=()))
    assert m.changes == () and merged(m) == two
    assert m.notes == (
        "kept device 0x10 (0000:41:00.0): the driver does not list it (remove it with a"
        " topology file if it left the host)",
    )


@pytest.mark.parametrize(
    ("h", "node", "conflict"),
    [
        # an fdid the topology gives another node
        (host(2, (adapter(0, peer=(1, 0)),), (device(0x10),)), None,
         "device 0x10: the driver says it is installed here (b 0000:41:00.0), the topology"
         " has it on a (0000:41:00.0)"),
        # this host's node named otherwise than the node with its id
        (HOST_A, "b", "this host is node b (--node or the configuration), but the driver's"
         " node id 1 is a's"),
        # a new node whose name another node id has
        (host(9), "a", "node a has node id 1 in the topology, but the driver says this host"
         " is node id 9"),
        # a cable the topology runs elsewhere
        (msgspec.structs.replace(HOST_A, adapters=(adapter(0, peer=(2, 1)),)), None,
         "adapter a:0: the driver sees a cable to b:1, the topology has it in cable a:0-b:0"),
        # a back-to-back cable to an adapter the topology puts on a switch
        (host(2, (adapter(0, peer=(1, 0)), adapter(1, peer=(1, 0)))), None,
         "adapter b:1: the driver sees a cable to a:0, the topology has it on switch sw"),
        # a switch port where the topology has a cable
        (msgspec.structs.replace(HOST_A, adapters=(adapter(0, switch_port=1),)), None,
         "adapter a:0: the driver sees a cable to port 1 of a cluster switch, the topology has"
         " it in cable a:0-b:0"),
        # two functions at one address
        (msgspec.structs.replace(HOST_A, devices=(device(0x10), device(0x11))), None,
         "devices 0x10 and 0x11 both have PCI address 0000:41:00.0 on a"),
        # a VF whose PF is not in the host
        (msgspec.structs.replace(HOST_A, devices=(device(0x10), device(0x12, "0000:41:00.1",
                                 physfn=0x77))), None,
         "device 0x12 is a VF of 0x77, which is no physical function of a"),
        # a name no topology file can hold
        (host(9, hostname="bad name"), None, "'bad name' is no node name"),
    ],
)  # fmt: skip
def test_conflicts_merge_nothing(two, h, node, conflict):
    m = merge_host(two, h, node)
    assert m.topology is None
    assert any(conflict in c for c in m.conflicts), m.conflicts


def test_a_known_node_found_by_id_keeps_its_name_whatever_the_hostname(two):
    m = merge_host(two, msgspec.structs.replace(HOST_A, hostname="other"), fallback="zzz")
    assert m.node == "a" and m.changes == ()


def test_a_device_reached_through_an_unlisted_adapter_is_noted(two):
    h = msgspec.structs.replace(HOST_A, devices=(device(0x10, adapter_index=3),))
    m = merge_host(two, h)
    merged(m)
    assert any("0x10 is reached through adapter 3" in n for n in m.notes)
