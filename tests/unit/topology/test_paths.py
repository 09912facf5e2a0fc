"""The route table (``vmlend.topology.paths.RouteTable``): routes computed once per topology
give exactly what a plain search over the whole graph gives, on every call, for generated
fabrics (several adapters per node, cascaded switches with cycles and chips of differing
latency, back-to-back cables, dead cables); no way through the switches costs less than the
route taken (every way enumerated); and a topology that changed never answers from the old
one's table."""

from __future__ import annotations

import heapq
from collections.abc import Collection

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.hypothesis_tiers import examples
from tests.support.simfabric import fabric_topology
from vmlend.errors import UnknownNodeError
from vmlend.topology.chips import NTB_CROSSING_NS, Chip
from vmlend.topology.model import AdapterSpec, GiB, Holder, LinkSpec, NodeSpec, Topology
from vmlend.topology.parse import parse_topology
from vmlend.topology.paths import NtbPath, RouteTable, route_table, routes, without_links
from vmlend.wiring.fabric import init_fabric, open_fabric

# --- the computation as it was before routes were compiled: the oracle ---------------------

_Vertex = tuple[str, str]
_Graph = dict[_Vertex, list[tuple[_Vertex, str]]]


def _plain_graph(topology: Topology, down: Collection[str]) -> _Graph:
    edges: dict[_Vertex, set[tuple[_Vertex, str]]] = {}

    def join(a: _Vertex, b: _Vertex, name: str) -> None:
        if name in down:
            return
        edges.setdefault(a, set()).add((b, name))
        edges.setdefault(b, set()).add((a, name))

    for link in topology.links:
        if link.switch is None:
            a, b = link.ends
            join(("adapter", a), ("adapter", b), link.names[0])
        else:
            for end, name in zip(link.ends, link.names, strict=True):
                join(("switch", link.switch), ("adapter", end), name)
    for a, b in topology.switch_links:
        join(("switch", a), ("switch", b), f"{a}-{b}")
    return {v: sorted(n) for v, n in edges.items()}


def _plain_shortest(
    topology: Topology, graph: _Graph, start: _Vertex, target: _Vertex
) -> list[tuple[_Vertex, str]] | None:
    """Dijkstra's search over the whole graph, adapters included (not passed through): a
    switch costs its chip's latency and a hop; among equal costs the first found wins."""
    parent: dict[_Vertex, tuple[_Vertex, str] | None] = {start: None}
    cost = {start: (0, 0)}
    heap = [(0, 0, 0, start)]
    done: set[_Vertex] = set()
    order = 1
    while heap:
        ns, hops, _, v = heapq.heappop(heap)
        if v in done:
            continue
        done.add(v)
        if v == target:
            steps: list[tuple[_Vertex, str]] = []
            while (p := parent[v]) is not None:
                steps.append((v, p[1]))
                v = p[0]
            return steps[::-1]
        if v != start and v[0] == "adapter":
            continue
        for n, name in graph.get(v, []):
            step = topology.switch_chip(n[1]).ns if n[0] == "switch" else 0
            new = (ns + step, hops + 1)
            if n not in cost or new < cost[n]:
                cost[n], parent[n] = new, (v, name)
                heapq.heappush(heap, (*new, order, n))
                order += 1
    return None


def _every_way(graph: _Graph, start: _Vertex, target: _Vertex) -> list[list[_Vertex]]:
    """Every simple way from adapter ``start`` to adapter ``target`` through switches: the
    switches passed, in order."""
    out: list[list[_Vertex]] = []

    def walk(v: _Vertex, passed: list[_Vertex]) -> None:
        for n, _name in graph.get(v, []):
            if n == target:
                out.append(passed)
            elif n[0] == "switch" and n not in passed:
                walk(n, [*passed, n])

    walk(start, [])
    return out


def plain_routes(
    topology: Topology, src: str, dst: str, down: Collection[str] = ()
) -> list[NtbPath]:
    """Every route from ``src`` to ``dst``, the graph built and searched afresh."""
    src_node, dst_node = topology.node(src), topology.node(dst)
    if src_node.name == dst_node.name:
        return []
    graph = _plain_graph(topology, down)
    found = []
    for a in src_node.adapters:
        for b in dst_node.adapters:
            steps = _plain_shortest(topology, graph, ("adapter", a.ref), ("adapter", b.ref))
            if steps is None:
                continue
            switches = tuple(v[1] for v, _ in steps[:-1])
            links = tuple(name for _, name in steps)
            chips = tuple(topology.switch_chip(sw) for sw in switches)
            found.append(NtbPath(src=a, dst=b, switches=switches, links=links, chips=chips))
    found.sort(key=lambda p: (p.latency_ns, p.hops, p.src.index, p.dst.index, p.switches))
    return found


# --- generated fabrics ---------------------------------------------------------------------


@st.composite
def cabled_fabrics(draw: st.DrawFn) -> Topology:
    """Two to five nodes with one to three adapters each; up to four switches, each with
    some of the adapters on its ports (an adapter may sit on several), cables between
    switches in any shape (chains, rings, parallel ways); some back-to-back cables."""
    nodes = []
    for i in range(draw(st.integers(2, 5))):
        name = f"n{i}"
        count = draw(st.integers(1, 3))
        adapters = tuple(AdapterSpec(name, k) for k in range(count))
        nodes.append(NodeSpec(name, i + 1, name, adapters=adapters))
    refs = [a.ref for n in nodes for a in n.adapters]
    switches = [f"s{i}" for i in range(draw(st.integers(0, 4)))]
    links = []
    for sw in switches:
        ports = draw(st.lists(st.sampled_from(refs), unique=True, max_size=len(refs)))
        chip = draw(st.sampled_from([None, *Chip]))
        if ports:
            links.append(LinkSpec(tuple(ports), sw, chip))
    pairs = st.tuples(st.sampled_from(refs), st.sampled_from(refs)).filter(
        lambda p: p[0].split(":")[0] != p[1].split(":")[0]
    )
    for a, b in draw(st.lists(pairs, max_size=4)):
        links.append(LinkSpec((a, b)))
    switch_links: list[tuple[str, str]] = []
    if len(switches) > 1:
        between = st.tuples(st.sampled_from(switches), st.sampled_from(switches))
        switch_links = [p for p in draw(st.lists(between, max_size=6)) if p[0] != p[1]]
    links = draw(st.permutations(links))
    return Topology("generated", tuple(nodes), tuple(links), (), switch_links=tuple(switch_links))


@st.composite
def fabrics_with_dead_cables(draw: st.DrawFn) -> tuple[Topology, frozenset[str]]:
    topo = draw(cabled_fabrics())
    names = topo.link_names()
    down = draw(st.sets(st.sampled_from(names), max_size=len(names))) if names else set()
    return topo, frozenset(down)


def _pairs(topo: Topology) -> list[tuple[str, str]]:
    return [(a.name, b.name) for a in topo.nodes for b in topo.nodes]


@settings(max_examples=examples(200), deadline=None)
@given(fabrics_with_dead_cables())
def test_the_route_table_gives_what_the_plain_search_gives(case):
    topo, down = case
    table = route_table(topo)
    for src, dst in _pairs(topo):
        expected = plain_routes(topo, src, dst)
        assert table.routes(src, dst) == expected
        assert table.routes(src, dst) == expected  # asked again: from the table, the same
        assert routes(topo, src, dst) == expected
        cut = plain_routes(topo, src, dst, down)
        assert routes(topo, src, dst, down=down) == cut
        assert RouteTable(topo, down).routes(src, dst) == cut
        assert routes(without_links(topo, down), src, dst) == cut


@settings(max_examples=200, deadline=None)
@given(cabled_fabrics())
def test_no_way_through_the_switches_costs_less_than_the_route(topo):
    """Every way between each pair of adapters enumerated: the route's latency and hops are
    the least of them, latency first."""
    graph = _plain_graph(topo, ())
    for src, dst in _pairs(topo):
        for p in routes(topo, src, dst):
            ways = _every_way(graph, ("adapter", p.src.ref), ("adapter", p.dst.ref))
            costs = [
                (NTB_CROSSING_NS + sum(topo.switch_chip(v[1]).ns for v in w), 2 + len(w))
                for w in ways
            ]
            assert (p.latency_ns, p.hops) == min(costs)


def test_the_table_is_made_once_per_topology_and_answers_copies():
    topo = parse_topology(fabric_topology(6, 1), "gen.toml")
    assert route_table(topo) is route_table(topo)
    first = routes(topo, "n0", "n5")
    first.clear()  # a caller's list is its own
    assert routes(topo, "n0", "n5") == plain_routes(topo, "n0", "n5") != []
    with pytest.raises(UnknownNodeError):
        routes(topo, "n0", "nope")


def test_a_changed_topology_does_not_reuse_stale_routes():
    topo = parse_topology(fabric_topology(4, 1), "gen.toml")
    assert routes(topo, "n0", "n3")[0].switches == ("sw",)
    # n3 leaves the switch and is cabled back to back to n0 instead
    (switch,) = topo.links
    moved = msgspec.structs.replace(
        topo,
        links=(
            LinkSpec(tuple(e for e in switch.ends if e != "n3:0"), "sw"),
            LinkSpec(("n0:0", "n3:0")),
        ),
    )
    assert route_table(moved) is not route_table(topo)
    assert routes(moved, "n0", "n3") == plain_routes(moved, "n0", "n3")
    assert routes(moved, "n0", "n3")[0].switches == ()
    assert routes(moved, "n1", "n3") == []
    # the old topology keeps its own routes
    assert routes(topo, "n1", "n3")[0].switches == ("sw",)
    # equal content, another object: equal routes, a table of its own
    twin = msgspec.msgpack.decode(msgspec.msgpack.encode(topo), type=Topology)
    assert twin == topo and route_table(twin) is not route_table(topo)
    assert routes(twin, "n0", "n3") == routes(topo, "n0", "n3")


def test_a_replaced_topology_in_the_state_is_routed_anew(tmp_path):
    """The ledger keeps the decoded topology while the state's digest stays, so its routes
    are computed once; a topology installed meanwhile (another process's ``fabric init
    --replace``) is decoded again, with routes of its own."""
    text = (
        'name = "two"\n'
        '[[node]]\nname = "l"\nid = 1\n  [[node.adapter]]\n  index = 0\n'
        "  [[node.device]]\n  fdid = 0x10\n"
        '  bdf = "0000:41:00.0"\n  kind = "nic"\n  vendor = 0x8086\n  device = 0x1521\n'
        '  class = 0x020000\n  bars = [ { index = 0, size = "16MiB" } ]\n'
        '[[node]]\nname = "b"\nid = 2\n  [[node.adapter]]\n  index = 0\n'
    )
    state = tmp_path / "state.db"
    init_fabric(state, text + '[[switch]]\nname = "sw1"\nports = ["l:0", "b:0"]\n', "t", node="b")
    f = open_fabric(state, "b")

    def path() -> str:
        (check,) = [c for c in f.admission(0x10, "b", GiB) if c.name == "path"]
        return check.detail

    assert path() == "l:0 -> b:0 via sw1"
    assert path() == "l:0 -> b:0 via sw1"
    replaced = text + '[[switch]]\nname = "sw2"\nports = ["l:0", "b:0"]\n'
    init_fabric(state, replaced, "t", node="b", replace=True)
    assert path() == "l:0 -> b:0 via sw2"
    f.reserve(0x10, Holder("b", "vm"), guest_ram=GiB)
    assert f.usage()["l:0"].lut_used == 1
    f.close()
