"""A topology written as a topology file (``render_topology``) reads back equal: the registry
stores a merged topology as that text."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given

from tests.support.discovery import TWO_HOSTS
from tests.support.simfabric import ports_topology, small_topology, star_topology
from tests.support.topology_strategies import lender_fabrics
from vmlend.errors import TopologyError
from vmlend.topology.model import Topology
from vmlend.topology.parse import parse_topology
from vmlend.topology.render import render_topology
from vmlend.wiring.fabric import default_topology_text, same_topology


def read_back(topo: Topology) -> Topology:
    return parse_topology(render_topology(topo, "a header\nof two lines"), "back.toml")


@pytest.mark.parametrize(
    "text",
    [
        default_topology_text()[0],  # PCIe trees, chassis, SR-IOV, two switches cascaded
        small_topology(isolated=True),
        star_topology(3, 4),
        TWO_HOSTS,
        ports_topology(requester_entries=3),  # a switch's requester table
    ],
)
def test_the_shipped_and_test_topologies_read_back_equal(text):
    topo = parse_topology(text, "t.toml")
    assert same_topology(read_back(topo), topo)


@given(lender_fabrics())
def test_generated_fabrics_read_back_equal(topo):
    # a file lists devices node by node: so does what it reads back
    grouped = tuple(d for n in topo.nodes for d in topo.devices_of(n.name))
    topo = msgspec.structs.replace(topo, devices=grouped)
    assert same_topology(read_back(topo), topo)


def test_the_header_is_a_comment_and_strings_are_escaped():
    topo = parse_topology(TWO_HOSTS, "t.toml")
    odd = msgspec.structs.replace(
        topo, nodes=(msgspec.structs.replace(topo.nodes[0], hostname='a "quoted"\\host'),
                     topo.nodes[1]),
    )  # fmt: skip
    text = render_topology(odd, "first\nsecond")
    assert text.startswith("# first\n# second\n")
    assert read_back(odd).node("a").hostname == 'a "quoted"\\host'


def _vfs(topo: Topology, **change: object) -> Topology:
    """The default cluster with beta's second VF changed."""
    vf = next(d for d in topo.devices if d.physfn is not None and d.fdid != 0x21)
    devices = tuple(msgspec.structs.replace(d, **change) if d is vf else d for d in topo.devices)
    return msgspec.structs.replace(topo, devices=devices)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"bdf": "0000:81:07.0"}, "are not at the PCI addresses that follow the PF's"),
        ({"fdid": 0x99}, "do not have consecutive fdids"),
        ({"device_id": 0x1234}, "differ from their PF's vendor, class or lending"),
        ({"lent": False}, "differ from their PF's vendor, class or lending"),
        ({"physfn": 0x77}, "is a VF of 0x77, which is no physical function of beta"),
    ],
)
def test_vfs_a_topology_file_cannot_declare_are_refused(change, problem):
    topo = parse_topology(*default_topology_text())
    with pytest.raises(TopologyError, match=problem):
        render_topology(_vfs(topo, **change))
