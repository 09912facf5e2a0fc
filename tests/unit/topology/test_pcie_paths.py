"""PCIe paths with hops and roots, and NTB routes through cascaded switches (issues 10 and 23).

Hops count the switching elements a TLP passes, as the papers do: in-host switches, root
complexes (root ports are part of them), NTB adapters, cluster switches and the three elements
of a transparent link to an expansion chassis; never the end devices. Roots count the root
complexes. Where peer-to-peer turns follows each host's IOMMU. The default topology reproduces
the papers' Table-2 anchors (docs/design.md)."""

from __future__ import annotations

import json

import pytest

from tests.support.simcluster import Cluster, domain_xml
from vmlend.errors import ConfigError, NoPathError, TopologyError, UnknownDeviceError
from vmlend.topology.chips import NTB_CROSSING_NS
from vmlend.topology.model import GiB
from vmlend.topology.parse import load_topology, parse_topology
from vmlend.topology.paths import route
from vmlend.topology.pcie import (
    Hop,
    cpu_to_bar,
    device_to_device,
    device_to_ram,
    device_via_ram,
    explain,
)


def _node(name: str, ident: int, adapters: int = 1, device: int | None = None) -> str:
    text = f'[[node]]\nname = "{name}"\nid = {ident}\n'
    for i in range(adapters):
        text += f"  [[node.adapter]]\n  index = {i}\n"
    if device is not None:
        text += f"""  [[node.device]]
  fdid = {device:#x}
  bdf = "0000:01:00.0"
  kind = "nvme"
  vendor = 0x8086
  device = 0x0a54
  class = 0x010802
  bars = [ {{ index = 0, size = "16KiB", kind = "mem64" }} ]
"""
    return text


#: a and d hang on switches s1 and s3, cascaded s1 - s2 - s3; b and c sit on s2.
CASCADE = (
    'name = "cascade"\n'
    + _node("a", 1, device=0x100)
    + _node("b", 2)
    + _node("c", 3)
    + _node("d", 4)
    + """
[[switch]]
name = "s1"
ports = ["a:0"]
[[switch]]
name = "s2"
ports = ["b:0", "c:0"]
[[switch]]
name = "s3"
ports = ["d:0"]
[[switch_link]]
ends = ["s1", "s2"]
[[switch_link]]
ends = ["s3", "s2"]
"""
)


#: The transparent link to the default topology's expansion chassis, climbed from inside it.
CHASSIS_UP = ["chassis1 switch", "chassis1 link adapter", "host link adapter to chassis1"]


def names(path) -> list[str]:
    return [s.name for s in path.stages]


# --- the papers' anchors (docs/design.md) on the default topology ---------------------------


def test_local_vm_p2p_is_7_hops_through_1_root():
    p = device_to_device(load_topology(), 0x10, 0x11)  # alpha's two GPUs, VM on alpha
    assert (p.hops, p.roots, p.added_ns) == (7, 1, 0)
    # each chassis side: its PEX8796 switch and the link's two PEX8733 adapters
    assert p.latency_ns == 2 * (150 + 132 + 132)
    assert names(p) == [
        "gpu 0x10",
        *CHASSIS_UP,
        "alpha root complex via rp1",
        *CHASSIS_UP[::-1],
        "gpu 0x11",
    ]


def test_remote_vm_via_borrower_ram_is_21_hops_through_3_roots():
    # a VM on gamma whose GPUs on alpha and beta exchange data through its RAM
    p = device_via_ram(load_topology(), 0x10, 0x20, "gamma")
    assert (p.hops, p.roots, p.ntb_crossings) == (21, 3, 2)
    assert p.added_ns == 2 * NTB_CROSSING_NS
    # four chassis sides, two crossings, two PM8536 cluster switch passes; roots cost nothing
    assert p.latency_ns == 4 * (150 + 132 + 132) + 2 * 350 + 2 * 170 == 2696
    kinds = [s.kind for s in p.stages]
    assert kinds.count(Hop.NTB) == 4 and kinds.count(Hop.CLUSTER_SWITCH) == 2
    assert [s.node for s in p.stages if s.kind is Hop.ROOT_COMPLEX] == ["alpha", "gamma", "beta"]


def test_device_to_ram_cpu_to_bar_and_direct_p2p_between_lenders():
    topo = load_topology()
    local = device_to_ram(topo, 0x10, "alpha")
    assert (local.hops, local.roots, local.added_ns) == (4, 1, 0)
    remote = device_to_ram(topo, 0x10, "gamma")
    assert (remote.hops, remote.roots, remote.added_ns) == (11, 2, NTB_CROSSING_NS)
    assert names(remote)[-4:] == ["alpha:0", "mxs824", "gamma:0", "gamma root complex via rp1"]
    bar = cpu_to_bar(topo, "gamma", 0x12)
    assert (bar.hops, bar.roots) == (11, 2) and names(bar)[-1] == "nvme 0x12"
    p2p = device_to_device(topo, 0x10, 0x20)  # straight from alpha to beta, not via gamma
    assert (p2p.hops, p2p.roots, p2p.ntb_crossings) == (17, 2, 1)
    assert "gamma:0" not in names(p2p)
    assert [leg for leg, _stages in p2p.legs()] == ["alpha", "fabric", "beta"]


# --- the papers' bare-metal cases: where peer-to-peer turns follows the host's IOMMU ---------

#: One host, two root ports with a switch each: 0x1 and 0x2 under sw0, 0x3 under sw1.
TWO_SWITCHES = """
[[node]]
name = "h"
id = 1
IOMMU
  [[node.pcie]]
  name = "rp0"
  kind = "root-port"
  [[node.pcie]]
  name = "sw0"
  kind = "switch"
  parent = "rp0"
  [[node.pcie]]
  name = "rp1"
  kind = "root-port"
  [[node.pcie]]
  name = "sw1"
  kind = "switch"
  parent = "rp1"
""" + "".join(
    f"""  [[node.device]]
  fdid = {fdid}
  bdf = "0000:0{fdid}:00.0"
  kind = "gpu"
  vendor = 0x10de
  device = 0x1db4
  class = 0x030200
  slot = "{slot}"
"""
    for fdid, slot in ((1, "sw0"), (2, "sw0"), (3, "sw1"))
)


def two_switches(iommu: bool | None):
    line = "" if iommu is None else f"iommu = {str(iommu).lower()}"
    return parse_topology(TWO_SWITCHES.replace("IOMMU", line), "h.toml")


def test_under_one_switch_iommu_off_is_1_hop_0_roots_and_on_3_hops_1_root():
    off = device_to_device(two_switches(False), 0x1, 0x2)
    assert (off.hops, off.roots) == (1, 0)
    assert names(off) == ["gpu 0x1", "sw0", "gpu 0x2"]
    on = device_to_device(two_switches(True), 0x1, 0x2)
    assert (on.hops, on.roots) == (3, 1)
    assert names(on) == ["gpu 0x1", "sw0", "h root complex via rp0", "sw0", "gpu 0x2"]
    assert device_to_device(two_switches(None), 0x1, 0x2) == on  # the IOMMU is on by default
    assert two_switches(None).node("h").iommu and not two_switches(False).node("h").iommu


def test_with_no_switch_in_common_iommu_off_still_goes_through_the_root_complex():
    p = device_to_device(two_switches(False), 0x1, 0x3)
    assert names(p) == ["gpu 0x1", "sw0", "h root complex via rp0, rp1", "sw1", "gpu 0x3"]
    assert (p.hops, p.roots) == (3, 1)
    # into RAM (or from a CPU) always through the root complex, IOMMU or not
    assert names(device_to_ram(two_switches(False), 0x1, "h")) == [
        "gpu 0x1",
        "sw0",
        "h root complex via rp0",
    ]


def iommu_off(*nodes: str):
    """The default topology with the IOMMU off on ``nodes``."""
    text = _default_text()
    for n in nodes:
        text = text.replace(f'name = "{n}"\n', f'name = "{n}"\niommu = false\n', 1)
    return parse_topology(text, "off.toml")


def _default_text() -> str:
    from importlib import resources

    return resources.files("vmlend.data").joinpath("default-topology.toml").read_text()


def test_a_lender_with_its_iommu_off_turns_at_the_chassis_switch():
    topo = iommu_off("alpha", "beta")
    assert not topo.node("alpha").iommu and topo.node("gamma").iommu
    local = device_to_device(topo, 0x10, 0x11)
    assert (local.hops, local.roots) == (1, 0)
    assert names(local) == ["gpu 0x10", "chassis1 switch", "gpu 0x11"]
    # to the NTB adapter in the same chassis without visiting alpha's root, into gamma's RAM
    remote = device_to_ram(topo, 0x10, "gamma")
    assert names(remote) == [
        "gpu 0x10",
        "chassis1 switch",
        "alpha:0",
        "mxs824",
        "gamma:0",
        "gamma root complex via rp1",
    ]
    assert (remote.hops, remote.roots, remote.added_ns) == (5, 1, NTB_CROSSING_NS)
    across = device_to_device(topo, 0x10, 0x20)
    assert (across.hops, across.roots, across.ntb_crossings) == (5, 0, 1)
    via = device_via_ram(topo, 0x10, 0x20, "gamma")
    assert (via.hops, via.roots) == (9, 1)  # the borrower's root holds the bounce buffer
    # only the host whose IOMMU is off changes: beta still goes up through its root
    half = device_to_device(iommu_off("alpha"), 0x10, 0x20)
    assert (half.hops, half.roots) == (11, 1)


def test_a_bad_iommu_value_is_refused_with_its_field():
    for bad in ('"off"', "1", '"false"'):
        with pytest.raises(TopologyError, match=r"node\[0\] 'h'\.iommu: expected true or false"):
            parse_topology(TWO_SWITCHES.replace("IOMMU", f"iommu = {bad}"), "h.toml")


def test_fabric_init_refuses_a_bad_iommu_value_and_installs_a_good_one(tmp_path):
    from click.testing import CliRunner

    from vmlend.cli import main

    state = ["--state", str(tmp_path / "s.db")]
    bad = tmp_path / "bad.toml"
    bad.write_text(TWO_SWITCHES.replace("IOMMU", 'iommu = "off"'))
    r = CliRunner().invoke(main, [*state, "fabric", "init", "--topology", str(bad)])
    assert r.exit_code == 1
    (line,) = [x for x in r.output.splitlines() if x.strip()]
    assert "iommu: expected true or false, got 'off'" in line
    good = tmp_path / "good.toml"
    good.write_text(TWO_SWITCHES.replace("IOMMU", "iommu = false"))
    r = CliRunner().invoke(main, [*state, "fabric", "init", "--topology", str(good)])
    assert r.exit_code == 0, r.output
    data = json.loads(CliRunner().invoke(main, [*state, "path", "0x1", "0x2", "--json"]).output)
    assert (data["hops"], data["roots"]) == (1, 0)


def test_an_endpoint_without_a_slot_sits_in_a_root_port_of_its_own():
    topo = parse_topology(CASCADE, "c.toml")
    p = device_to_ram(topo, 0x100, "a")
    assert names(p) == ["nvme 0x100", "a root complex"]  # its root port is part of the root
    assert p.hops == 1


def test_bad_path_requests_are_refused():
    topo = load_topology()
    with pytest.raises(ConfigError, match="both nodes"):
        explain(topo, "gamma", "alpha")
    with pytest.raises(ConfigError, match="give two devices"):
        explain(topo, "0x10", "gamma", via="gamma")
    with pytest.raises(UnknownDeviceError):
        explain(topo, "0x99", "gamma")
    with pytest.raises(ConfigError, match="bad fabric device id 'delta'"):
        explain(topo, "delta", "gamma")
    with pytest.raises(Exception, match="both ends"):
        explain(topo, "0x10", "0x10")


# --- routes through cascaded switches ----------------------------------------------------------


def test_routes_cross_cascaded_switches_in_order():
    topo = parse_topology(CASCADE, "c.toml")
    ad = route(topo, "a", "d")
    assert (ad.src.ref, ad.dst.ref, ad.switches) == ("a:0", "d:0", ("s1", "s2", "s3"))
    assert ad.describe() == "a:0 -> d:0 via s1, s2, s3" and len(ad.switches) == 3
    assert route(topo, "d", "a").switches == ("s3", "s2", "s1")
    assert route(topo, "b", "c").switches == ("s2",)
    p = device_to_ram(topo, 0x100, "d")
    assert [s.name for s in p.stages if s.kind is Hop.CLUSTER_SWITCH] == ["s1", "s2", "s3"]
    assert p.ntb_crossings == 1  # one crossing, however many switches


def test_the_shortest_route_wins_and_ties_are_deterministic():
    # a has two adapters: a:0 on the long way (s1 - s2 - s3), a:1 cabled straight to d:1
    text = (
        'name = "two-ways"\n'
        + _node("a", 1, adapters=2)
        + _node("d", 4, adapters=2)
        + """
[[switch]]
name = "s1"
ports = ["a:0"]
[[switch]]
name = "s2"
ports = ["d:0"]
[[switch_link]]
ends = ["s1", "s2"]
[[link]]
ends = ["a:1", "d:1"]
"""
    )
    topo = parse_topology(text, "t.toml")
    p = route(topo, "a", "d")
    assert (p.src.ref, p.dst.ref, p.switches) == ("a:1", "d:1", ())
    # two equally short ways: the lower adapter index wins, every time
    tie = text.replace(
        '[[link]]\nends = ["a:1", "d:1"]', '[[switch]]\nname = "s9"\nports = ["a:1", "d:1"]'
    )
    tied = parse_topology(tie, "t.toml")
    assert {route(tied, "a", "d").src.ref for _ in range(5)} == {"a:1"}


def test_a_host_does_not_forward_between_its_adapters():
    # b joins a and c with two cables, but hosts do not forward NTB traffic for others
    text = (
        'name = "chain"\n'
        + _node("a", 1)
        + _node("b", 2, adapters=2)
        + _node("c", 3)
        + '[[link]]\nends = ["a:0", "b:0"]\n[[link]]\nends = ["b:1", "c:0"]\n'
    )
    topo = parse_topology(text, "t.toml")
    with pytest.raises(NoPathError, match="no NTB path from a to c"):
        route(topo, "a", "c")
    assert route(topo, "a", "b").dst.ref == "b:0"


def test_the_simulated_fabric_borrows_and_dmas_across_cascaded_switches(state_path):
    c = Cluster.create(state_path, CASCADE, node="d")
    try:
        vm = c.start(domain_xml("web", 1 * GiB, fdids=(0x100,)), node="d")
        vm.enable_device(0x100)
        vm.dma_write(0x100, 0x10_0000, b"over three switches")
        assert vm.guest.read(0x10_0000, 19) == b"over three switches"
        vm.stop()
    finally:
        c.close()


# --- the topology format ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (('ends = ["s3", "s2"]', 'ends = ["s3", "s7"]'), "switch_link[1].ends[1]: no switch 's7'"),
        (('ends = ["s3", "s2"]', 'ends = ["s3", "s3"]'), "cannot be linked to itself"),
        (('ends = ["s3", "s2"]', 'ends = ["s2", "s1"]'), "switch_link[1].ends: switches s1 and s2"),
        (('ends = ["s3", "s2"]', 'ends = ["s3"]'), "joins exactly two switches"),
        (('[[switch_link]]\nends = ["s1", "s2"]', '[[switch_link]]\nend = ["s1", "s2"]'),
         "switch_link[0]: unknown key 'end'"),
        (('name = "s3"', 'name = "s1"'), "switch[2].name: duplicate switch name 's1'"),
    ],
)  # fmt: skip
def test_switch_link_mistakes_are_named(edit, message):
    with pytest.raises(TopologyError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_topology(CASCADE.replace(*edit), "c.toml")


PCIE = """
  [[node.pcie]]
  name = "rp0"
  kind = "root-port"
  [[node.pcie]]
  name = "sw0"
  kind = "switch"
  parent = "rp0"
"""


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (('kind = "switch"', 'kind = "hub"'), "pcie[1].kind: expected root-port, switch"),
        (('parent = "rp0"', 'parent = "rp9"'), "pcie[1].parent: no PCIe element 'rp9'"),
        (('  parent = "rp0"\n', ""), "pcie[1].parent: a switch needs a parent"),
        (('kind = "root-port"', 'kind = "root-port"\n  parent = "sw0"'), "a root port sits on"),
        (('name = "sw0"', 'name = "rp0"'), "duplicate PCIe element name 'rp0'"),
        (('kind = "switch"', 'kind = "switch"\n  speed = 8'), "pcie[1]: unknown key 'speed'"),
    ],
)  # fmt: skip
def test_pcie_tree_mistakes_are_named(edit, message):
    text = CASCADE.replace("id = 1\n", "id = 1\n" + PCIE.replace(*edit), 1)
    with pytest.raises(TopologyError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_topology(text, "c.toml")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (('kind = "switch"', 'kind = "switch"\n  chip = "PEX9999"'),
         "pcie[1].chip: unknown chip 'PEX9999': name one of PEX8733 (132 ns), PEX8796 (150 ns),"
         " PM8536 (170 ns)"),
        (('kind = "switch"', 'kind = "switch"\n  chip = "pex8733"'), "unknown chip 'pex8733'"),
        (('kind = "switch"', 'kind = "switch"\n  chip = 8733'), "pcie[1].chip: unknown chip 8733"),
        (('kind = "switch"', 'kind = "switch"\n  chip = ["PM8536"]'), "unknown chip ['PM8536']"),
        (('kind = "root-port"', 'kind = "root-port"\n  chip = "PEX8733"'),
         "pcie[0].chip: a root port is part of the root complex, which has no chip"),
    ],
)  # fmt: skip
def test_a_chip_vmlend_has_no_figure_for_is_named_with_the_ones_it_has(edit, message):
    text = CASCADE.replace("id = 1\n", "id = 1\n" + PCIE.replace(*edit), 1)
    with pytest.raises(TopologyError) as e:
        parse_topology(text, "c.toml")
    assert message in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(TopologyError, match=r"switch\[1\]\.chip: unknown chip 'MXS824'"):
        parse_topology(CASCADE.replace('name = "s2"', 'name = "s2"\nchip = "MXS824"'), "c.toml")


def test_the_chips_a_topology_names_are_what_its_paths_cost():
    # sw0 a PM8536 (170 ns) instead of the default PEX8796 (150 ns), the cluster switches s1
    # and s3 PEX8733 (132 ns) instead of PM8536, s2 left to its default
    one_host = two_switches(True)
    assert device_to_device(one_host, 0x1, 0x2).latency_ns == 2 * 150
    fast = TWO_SWITCHES.replace("IOMMU", "").replace(
        'name = "sw0"\n  kind = "switch"', 'name = "sw0"\n  kind = "switch"\n  chip = "PM8536"'
    )
    p = device_to_device(parse_topology(fast, "h.toml"), 0x1, 0x2)
    assert [(s.name, s.chip, s.ns) for s in p.stages if s.kind is Hop.SWITCH] == [
        ("sw0", "PM8536", 170),
        ("sw0", "PM8536", 170),
    ]
    assert p.latency_ns == 2 * 170 and p.summary() == "3 hops, 1 root(s), 340 ns"
    cheap = CASCADE.replace('name = "s1"', 'name = "s1"\nchip = "PEX8733"').replace(
        'name = "s3"', 'name = "s3"\nchip = "PEX8733"'
    )
    topo = parse_topology(cheap, "c.toml")
    assert [topo.switch_chip(s) for s in ("s1", "s2", "s3")] == ["PEX8733", "PM8536", "PEX8733"]
    ram = device_to_ram(topo, 0x100, "d")  # a:0, s1, s2, s3, d:0: 350 + 132 + 170 + 132
    assert [s.ns for s in ram.stages if s.kind in (Hop.NTB, Hop.CLUSTER_SWITCH)] == [
        350, 132, 170, 132, 0
    ]  # fmt: skip
    assert ram.latency_ns == 350 + 132 + 170 + 132 == route(topo, "a", "d").latency_ns
    assert device_to_ram(parse_topology(CASCADE, "c.toml"), 0x100, "d").latency_ns == 350 + 3 * 170


def test_slots_must_name_an_element_of_their_node():
    text = CASCADE.replace("id = 1\n", "id = 1\n" + PCIE, 1)
    ok = parse_topology(
        text.replace('bdf = "0000:01:00.0"', 'bdf = "0000:01:00.0"\n  slot = "sw0"')
    )
    assert ok.device(0x100).slot == "sw0"
    with pytest.raises(TopologyError, match=r"device\[0\]\.slot: no PCIe element 'sw9'"):
        parse_topology(text.replace('bdf = "0000:01:00.0"', 'bdf = "0000:01:00.0"\n  slot = "sw9"'))
    bad_adapter = text.replace("  index = 0\n", '  index = 0\n  slot = "nope"\n', 1)
    with pytest.raises(TopologyError, match=r"adapter\[0\]\.slot: no PCIe element 'nope'"):
        parse_topology(bad_adapter)


def test_default_topology_keeps_its_names_and_places_devices_in_a_chassis():
    topo = load_topology()
    assert [n.name for n in topo.nodes] == ["alpha", "beta", "gamma"]
    assert [d.fdid for d in topo.devices] == [0x10, 0x11, 0x12, 0x20, 0x21, 0x22, 0x23, 0x24, 0x25]
    assert {d.slot for d in topo.devices} == {"chassis1"}  # VFs follow their PF
    assert topo.node("gamma").adapters[0].slot == "rp1"


# --- the command ---------------------------------------------------------------------------------


def test_path_command_explains_stage_by_stage(cluster):
    r = cluster.cli("path", "0x10", "0x20", "--via", "gamma")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0] == (
        "device 0x10 -> device 0x20 via RAM of gamma: 21 hops, 3 root complex(es),"
        " 2 NTB crossing(s), about 2696 ns one way (700 ns of it the NTB)"
    )
    assert lines[1].split() == ["#", "HOST", "KIND", "ELEMENT", "CHIP", "NS"]
    assert lines[2].split() == ["-", "alpha", "device", "gpu", "0x10", "-", "-"]  # not a hop
    assert lines[2 + 1].split()[-2:] == ["PEX8796", "150"]  # the chassis switch
    assert lines[2 + 4].split()[-2:] == ["-", "-"]  # the root complex: no figure
    assert lines[2 + 8].split()[-3:] == ["alpha:0", "(crossing)", "350"]
    assert lines[2 + 9].split() == ["9", "(fabric)", "cluster-switch", "mxs824", "PM8536", "170"]
    assert lines[2 + 10].split()[-3:] == ["gamma:0", "(crossing)", "-"]
    assert lines[-1].split() == ["-", "beta", "device", "gpu", "0x20", "-", "-"]
    assert len(lines) == 2 + 21 + 2  # the hops, numbered, and both end devices
    data = json.loads(cluster.cli("path", "gamma", "0x12", "--json").stdout)
    assert (data["hops"], data["roots"], data["added_ns"]) == (11, 2, 350)
    assert data["latency_ns"] == sum(s["ns"] for s in data["stages"]) == 1348
    assert data["stages"][0] == {
        "kind": "root-complex",
        "name": "gamma root complex via rp1",
        "node": "gamma",
        "chip": None,
        "ns": 0,
    }
    # the CPU's write enters the NTB at gamma's adapter: the crossing's cost is there
    assert [(s["name"], s["ns"]) for s in data["stages"][1:4]] == [
        ("gamma:0", 350),
        ("mxs824", 170),
        ("alpha:0", 0),
    ]
    bad = cluster.cli("path", "gamma", "beta")
    assert bad.exit_code == 1
    assert bad.output.strip().splitlines()[-1].startswith("Error: gamma and beta are both nodes")


def test_fabric_show_lists_switch_links(tmp_path):
    from click.testing import CliRunner

    from vmlend.cli import main

    topo = tmp_path / "cascade.toml"
    topo.write_text(CASCADE)
    state = ["--state", str(tmp_path / "s.db")]
    init = CliRunner().invoke(main, [*state, "fabric", "init", "--topology", str(topo)])
    assert init.exit_code == 0, init.output
    shown = CliRunner().invoke(main, [*state, "fabric", "show"])
    assert "switch link: s1 <-> s2" in shown.output and "switch link: s2 <-> s3" in shown.output
    data = json.loads(CliRunner().invoke(main, [*state, "fabric", "show", "--json"]).output)
    assert data["switch_links"] == [["s1", "s2"], ["s2", "s3"]]
    routed = CliRunner().invoke(main, [*state, "path", "0x100", "d"])
    assert "1 NTB crossing(s)" in routed.output and "s3" in routed.output
