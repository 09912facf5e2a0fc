"""Named links and alternative routes between two nodes (issue 23 part 3).

Every cable has a name a link fault can address: a back-to-back ``[[link]]`` is ``a-b``, a
switch port ``switch/adapter``, a cable between switches ``s1-s2``. ``routes`` lists every way
between two nodes over different adapter pairs, cheapest first (latency over the crossing and
the switches' chips, then hops); ``route`` is the first."""

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
    assert [(p.src.ref, p.dst.ref, p.switches, p.hops, p.latency_ns) for p in found] == [
        ("a:1", "d:1", (), 2, 350),  # back to back: no switch
        ("a:0", "d:0", ("s1",), 3, 350 + 170),  # a PM8536 cluster switch unless said
    ]
    assert found[0].links == ("a:1-d:1",) and found[1].links == ("s1/a:0", "s1/d:0")
    assert route(topo, "a", "d") == found[0]
    assert routes(topo, "a", "a") == [] and route(topo, "a", "a") is None


def _switch(name: str, ports: list[str], chip: str | None = None) -> str:
    chip_line = f'chip = "{chip}"\n' if chip else ""
    return f'[[switch]]\nname = "{name}"\nports = {ports!r}\n{chip_line}'.replace("'", '"')


def test_the_switch_chips_decide_between_adapter_pairs_before_their_indexes():
    # a:0-d:0 through a PM8536 (170 ns), a:1-d:1 through a PEX8733 (132 ns): same hops
    text = (
        _node("a", 1, adapters=2)
        + _node("d", 4, adapters=2)
        + _switch("slow", ["a:0", "d:0"])
        + _switch("fast", ["a:1", "d:1"], "PEX8733")
    )
    found = routes(parse_topology(text, "t.toml"), "a", "d")
    assert [(p.src.ref, p.switches, p.latency_ns, p.hops) for p in found] == [
        ("a:1", ("fast",), 482, 3),
        ("a:0", ("slow",), 520, 3),
    ]


def test_a_way_through_more_switches_is_taken_when_it_costs_less():
    # a:0 on switch s, d:0 on switch t; between them four PM8536 (680 ns) or five PEX8733
    # (660 ns, one hop more). Each switch in between holds a bystander node's adapter.
    slow = [f"p{i}" for i in range(4)]
    fast = [f"q{i}" for i in range(5)]
    text = _node("a", 1) + _node("d", 2)
    text += "".join(_node(f"x{sw}", 10 + i) for i, sw in enumerate(slow + fast))
    text += _switch("s", ["a:0"]) + _switch("t", ["d:0"])
    text += "".join(_switch(sw, [f"x{sw}:0"]) for sw in slow)
    text += "".join(_switch(sw, [f"x{sw}:0"], "PEX8733") for sw in fast)
    for chain in (slow, fast):
        for x, y in zip(["s", *chain], [*chain, "t"], strict=True):
            text += f'[[switch_link]]\nends = ["{x}", "{y}"]\n'
    (p,) = routes(parse_topology(text, "t.toml"), "a", "d")
    assert p.switches == ("s", *fast, "t")
    assert (p.latency_ns, p.hops) == (350 + 2 * 170 + 5 * 132, 9)
    # with the fast chain's middle cable down, the slow one: fewer hops, more latency
    (p,) = routes(parse_topology(text, "t.toml"), "a", "d", down={"q1-q2"})
    assert p.switches == ("s", *slow, "t") and (p.latency_ns, p.hops) == (350 + 6 * 170, 8)


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
    assert lines[0] == "device 0x12 -> RAM of gamma: 2 route(s), in the order used"
    assert lines[1].split() == ["ROUTE", "LATENCY", "HOPS", "ROOTS", "ADAPTERS", "LINKS"]
    # the 12-hop backup passes a second PM8536 cluster switch: 170 ns more
    assert lines[2].split()[:5] == ["1", "1348", "ns", "11", "2"]
    assert lines[3].split()[:5] == ["2", "1518", "ns", "12", "2"]
    assert "mxs824b/gamma:1" in lines[3]
    data = json.loads(
        CliRunner().invoke(main, [*state, "path", "--all", "0x12", "gamma", "--json"]).output
    )
    assert [(p["latency_ns"], p["hops"], p["links"][-1]) for p in data["routes"]] == [
        (1348, 11, "mxs824/gamma:0"),
        (1518, 12, "mxs824b/gamma:1"),
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
