"""Named links and alternative routes between two nodes (issue 23 part 3).

Every cable has a name a link fault can address: a back-to-back ``[[link]]`` is ``a-b``, a
switch port ``switch/adapter``, a cable between switches ``s1-s2``. ``routes`` lists every way
between two nodes over different adapter pairs, cheapest first; ``route`` is the first."""

from __future__ import annotations

import json

import pytest

from vmlend.errors import ConfigError, NoPathError, UnknownNodeError
from vmlend.topology.parse import load_topology, parse_topology
from vmlend.topology.paths import route, routes
from vmlend.topology.pcie import device_to_ram, explain, explain_all


def _node(name: str, ident: int, adapters: int = 1) -> str:
    text = f'[[node]]\nname = "{name}"\nid = {ident}\n'
    for i in range(adapters):
        text += f"  [[node.adapter]]\n  index = {i}\n"
    return text


#: a:0 and d:0 on switch s1; a:1 cabled straight to d:1 (back to back).
TWO_WAYS = (
    'name = "two-ways"\n'
    + _node("a", 1, adapters=2)
    + _node("d", 4, adapters=2)
    + '[[switch]]\nname = "s1"\nports = ["a:0", "d:0"]\n[[link]]\nends = ["a:1", "d:1"]\n'
)


def test_every_cable_has_a_name():
    topo = load_topology()
    assert topo.link_names() == [
        "mxs824/alpha:0",
        "mxs824/beta:0",
        "mxs824/gamma:0",
        "mxs824b/gamma:1",
        "mxs824-mxs824b",
    ]
    assert parse_topology(TWO_WAYS, "t.toml").link_names() == ["a:1-d:1", "s1/a:0", "s1/d:0"]


def test_routes_lists_every_adapter_pair_cheapest_first():
    topo = parse_topology(TWO_WAYS, "t.toml")
    found = routes(topo, "a", "d")
    assert [(p.src.ref, p.dst.ref, p.switches, p.cost) for p in found] == [
        ("a:1", "d:1", (), 2),  # back to back: no switch
        ("a:0", "d:0", ("s1",), 3),
    ]
    assert found[0].links == ("a:1-d:1",) and found[1].links == ("s1/a:0", "s1/d:0")
    assert route(topo, "a", "d") == found[0]
    assert routes(topo, "a", "a") == [] and route(topo, "a", "a") is None


def test_routes_avoid_cables_that_are_down():
    topo = parse_topology(TWO_WAYS, "t.toml")
    assert [p.src.ref for p in routes(topo, "a", "d", down={"a:1-d:1"})] == ["a:0"]
    assert route(topo, "a", "d", down={"a:1-d:1"}).links == ("s1/a:0", "s1/d:0")
    with pytest.raises(NoPathError):
        route(topo, "a", "d", down={"a:1-d:1", "s1/d:0"})
    assert routes(topo, "a", "d", down={"a:1-d:1", "s1/d:0"}) == []


def test_routes_of_an_unknown_node_are_an_error():
    with pytest.raises(UnknownNodeError):
        routes(load_topology(), "gamma", "nowhere")


def test_default_topology_gives_gamma_a_backup_path_and_keeps_the_anchors():
    topo = load_topology()
    found = routes(topo, "alpha", "gamma")
    assert [(p.src.ref, p.dst.ref, p.switches) for p in found] == [
        ("alpha:0", "gamma:0", ("mxs824",)),
        ("alpha:0", "gamma:1", ("mxs824", "mxs824b")),
    ]
    assert found[1].links == ("mxs824/alpha:0", "mxs824-mxs824b", "mxs824b/gamma:1")
    # the primary is unchanged: the papers' Table-2 anchors still hold
    assert explain(topo, "0x10", "0x20", "gamma").hops == 21
    assert device_to_ram(topo, 0x12, "gamma").hops == 11
    backup = device_to_ram(topo, 0x12, "gamma", found[1])
    assert backup.hops == 12 and backup.links == found[1].links
    # beta and alpha have one adapter each: one way between them
    assert len(routes(topo, "alpha", "beta")) == 1


def test_explain_all_one_path_per_route_and_one_inside_a_host():
    topo = load_topology()
    all_ = explain_all(topo, "0x12", "gamma")
    assert [p.hops for p in all_] == [11, 12]
    assert [p.hops for p in explain_all(topo, "gamma", "0x20")] == [11, 12]
    assert len(explain_all(topo, "0x10", "alpha")) == 1  # the lender itself: no NTB
    assert len(explain_all(topo, "0x10", "0x20")) == 1  # alpha and beta: one way
    with pytest.raises(ConfigError, match="both nodes"):
        explain_all(topo, "gamma", "beta")


def test_path_all_command_lists_routes_with_cost(tmp_path):
    from click.testing import CliRunner

    from vmlend.cli import main

    state = ["--state", str(tmp_path / "s.db"), "--node", "gamma"]
    assert CliRunner().invoke(main, [*state, "fabric", "init"]).exit_code == 0
    r = CliRunner().invoke(main, [*state, "path", "--all", "0x12", "gamma"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0] == "device 0x12 -> RAM of gamma: 2 route(s), cheapest first"
    assert lines[2].split()[:6] == ["1", "11", "hops", "2", "+360", "ns"]
    assert "mxs824b/gamma:1" in lines[3] and lines[3].split()[1] == "12"
    data = json.loads(
        CliRunner().invoke(main, [*state, "path", "--all", "0x12", "gamma", "--json"]).output
    )
    assert [(p["hops"], p["links"][-1]) for p in data["routes"]] == [
        (11, "mxs824/gamma:0"),
        (12, "mxs824b/gamma:1"),
    ]
    bad = CliRunner().invoke(main, [*state, "path", "--all", "0x10", "0x20", "--via", "gamma"])
    assert bad.exit_code != 0 and "--via" in bad.output


def test_without_links_leaves_out_only_the_dead_cables():
    from vmlend.topology.paths import without_links

    topo = load_topology()
    live = without_links(topo, {"mxs824/gamma:0", "mxs824-mxs824b"})
    assert live.link_names() == ["mxs824/alpha:0", "mxs824/beta:0", "mxs824b/gamma:1"]
    assert live.nodes == topo.nodes and live.devices == topo.devices
    with pytest.raises(NoPathError):
        route(live, "alpha", "gamma")
    assert without_links(topo, ()) is topo
