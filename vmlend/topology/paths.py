"""NTB paths between nodes: pure logic over a ``Topology``.

A path is one crossing: an adapter of the source node cabled to an adapter of the destination
node, back-to-back or through one or more cluster switches (switches may be cascaded with
``switch_link``s). Hosts do not forward NTB traffic for others, so a route never passes
through a third host's adapter. The same node needs no NTB (``route`` returns None).

Routes rank by their cost, the one-way latency of the crossing and of each cluster switch's
chip (``vmlend.topology.chips``), then by hops: the cheapest is the one used.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection

import msgspec

from vmlend.errors import NoPathError
from vmlend.topology.chips import NTB_CROSSING_NS, Chip
from vmlend.topology.model import AdapterSpec, LinkSpec, Topology


class NtbPath(msgspec.Struct, frozen=True):
    src: AdapterSpec  # adapter in the source node
    dst: AdapterSpec  # adapter in the destination node
    switches: tuple[str, ...] = ()  # cluster switches between them, in order; () back-to-back
    #: The cables passed, by name (``LinkSpec.names``): what a link fault on the way cuts.
    links: tuple[str, ...] = ()
    #: Each switch's chip, in the order of ``switches``.
    chips: tuple[Chip, ...] = ()

    @property
    def switch(self) -> str | None:
        """The first switch on the way (None for a back-to-back cable)."""
        return self.switches[0] if self.switches else None

    @property
    def hops(self) -> int:
        """Its hops the papers' way: the two adapters and each cluster switch between them."""
        return 2 + len(self.switches)

    @property
    def latency_ns(self) -> int:
        """One way from adapter to adapter: the crossing and each switch's chip."""
        return NTB_CROSSING_NS + sum(c.ns for c in self.chips)

    def describe(self) -> str:
        via = f" via {', '.join(self.switches)}" if self.switches else ""
        return f"{self.src.ref} -> {self.dst.ref}{via}"


_Vertex = tuple[str, str]  # ("adapter", ref) or ("switch", name)
_Graph = dict[_Vertex, list[tuple[_Vertex, str]]]  # vertex -> (neighbour, cable name)


def _graph(topology: Topology, down: Collection[str] = ()) -> _Graph:
    """Adapters and switches, joined by the cables not in ``down``; neighbours sorted, for
    deterministic routes."""
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


class _Search(msgspec.Struct, frozen=True):
    """One source adapter's search through the switches: the order in which the search
    expands each vertex it reaches (the adapter itself first, then switches, cheapest first)
    and how it reached each switch (the vertex before it, the cable between)."""

    rank: dict[_Vertex, int]
    parent: dict[_Vertex, tuple[_Vertex, str]]


class RouteTable:
    """The routes of one topology (less the cables in ``down``), computed once: the graph
    when the table is made, each source adapter's search on its first use, each pair of
    nodes' routes on their first use. Pure: it reads nothing but the topology.

    A path is the cheapest one from the source adapter through switches only (a host does not
    forward for others): least latency over the switches' chips, then fewest switches, then
    the first found with neighbours in sorted order (Dijkstra's search; with one chip
    everywhere, the breadth-first search). Adapters are leaves, so that search is the search
    through the switches alone, and a target adapter is reached from the first vertex the
    search expands among those cabled to it (by its first cable in sorted order): one search
    per source adapter serves every destination, and never walks the adapters on a switch's
    ports."""

    def __init__(self, topology: Topology, down: Collection[str] = ()) -> None:
        self._topology = topology
        self._graph = _graph(topology, down)
        self._ns = {v: topology.switch_chip(v[1]).ns for v in self._graph if v[0] == "switch"}
        self._switches = {
            v: [(n, name) for n, name in near if n[0] == "switch"]
            for v, near in self._graph.items()
            if v[0] == "switch"
        }
        self._searches: dict[_Vertex, _Search] = {}
        self._pairs: dict[tuple[str, str], tuple[NtbPath, ...]] = {}

    def routes(self, src: str, dst: str) -> list[NtbPath]:
        """As ``routes`` (the module's function): every way from node ``src`` to ``dst``."""
        found = self._pairs.get((src, dst))
        if found is None:
            found = self._pairs[(src, dst)] = tuple(self._compute(src, dst))
        return list(found)

    def _compute(self, src: str, dst: str) -> list[NtbPath]:
        src_node = self._topology.node(src)
        dst_node = self._topology.node(dst)
        if src_node.name == dst_node.name:
            return []
        found: list[NtbPath] = []
        for a in src_node.adapters:
            for b in dst_node.adapters:
                steps = self._steps(("adapter", a.ref), ("adapter", b.ref))
                if steps is None:
                    continue
                switches = tuple(v[1] for v, _ in steps[:-1])
                links = tuple(name for _, name in steps)
                chips = tuple(self._topology.switch_chip(sw) for sw in switches)
                found.append(NtbPath(src=a, dst=b, switches=switches, links=links, chips=chips))
        found.sort(key=lambda p: (p.latency_ns, p.hops, p.src.index, p.dst.index, p.switches))
        return found

    def _search(self, start: _Vertex) -> _Search:
        done = self._searches.get(start)
        if done is not None:
            return done
        # (latency so far, switches so far, order found): ties go to the first found, as a
        # breadth-first search with sorted neighbours would take them
        best: dict[_Vertex, tuple[int, int, int]] = {start: (0, 0, 0)}
        parent: dict[_Vertex, tuple[_Vertex, str]] = {}
        rank: dict[_Vertex, int] = {}
        heap = [(0, 0, 0, start)]
        found = 1
        while heap:
            ns, hops, order, v = heapq.heappop(heap)
            if v in rank or best[v] != (ns, hops, order):
                continue  # reached again at a higher cost, or expanded already
            rank[v] = len(rank)
            near = self._graph.get(start, []) if v == start else self._switches[v]
            for n, name in near:
                if n[0] != "switch" or n in rank:
                    continue
                cost = (ns + self._ns[n], hops + 1)
                if n not in best or cost < best[n][:2]:
                    best[n] = (*cost, found)
                    parent[n] = (v, name)
                    heapq.heappush(heap, (*cost, found, n))
                    found += 1
        done = self._searches[start] = _Search(rank, parent)
        return done

    def _steps(self, start: _Vertex, target: _Vertex) -> list[tuple[_Vertex, str]] | None:
        """The cheapest way from adapter ``start`` to adapter ``target`` as (vertex, cable
        into it) steps, the first in sorted order among equally cheap ones; None: none."""
        search = self._search(start)
        best: tuple[int, str, _Vertex] | None = None
        for v, name in self._graph.get(target, []):
            r = search.rank.get(v)
            if r is not None and (best is None or (r, name) < best[:2]):
                best = (r, name, v)
        if best is None:
            return None
        _, name, v = best
        steps = [(target, name)]
        while v != start:
            before, cable = search.parent[v]
            steps.append((v, cable))
            v = before
        return steps[::-1]


def route_table(topology: Topology) -> RouteTable:
    """``topology``'s route table, made on the first call and kept with the topology (which
    is immutable: a changed topology is another object, with a table of its own)."""
    return topology.derived(RouteTable)


def routes(topology: Topology, src: str, dst: str, *, down: Collection[str] = ()) -> list[NtbPath]:
    """Every way from node ``src`` to node ``dst``: for each pair of a source and a destination
    adapter the cables join, the shortest path between them, avoiding the cables in ``down``.
    Cheapest first (least latency over the crossing and the switches' chips, then fewest
    hops), then by source and destination adapter index and switch names; [] for the same
    node or when nothing joins them. Raises ``UnknownNodeError``.

    Without ``down``, answered from the topology's ``route_table``; with it, from a table
    made for this call."""
    table = RouteTable(topology, down) if down else route_table(topology)
    return table.routes(src, dst)


def without_links(topology: Topology, down: Collection[str]) -> Topology:
    """``topology`` as routing sees it while the cables in ``down`` are dead: those cables
    (back-to-back links, switch ports, cables between switches) left out, nothing else
    changed. The topology itself when none is down."""
    if not down:
        return topology
    links: list[LinkSpec] = []
    for link in topology.links:
        if link.switch is None:
            if link.names[0] not in down:
                links.append(link)
            continue
        ends = tuple(e for e, n in zip(link.ends, link.names, strict=True) if n not in down)
        links.append(msgspec.structs.replace(link, ends=ends))
    pairs = tuple((a, b) for a, b in topology.switch_links if f"{a}-{b}" not in down)
    return msgspec.structs.replace(topology, links=tuple(links), switch_links=pairs)


def route(topology: Topology, src: str, dst: str, *, down: Collection[str] = ()) -> NtbPath | None:
    """The shortest path from node ``src`` to node ``dst`` (the first of ``routes``); None
    when they are the same node.

    Raises ``UnknownNodeError`` for unknown nodes and ``NoPathError`` when no cable (outside
    ``down``) joins them. Deterministic: least latency, then fewest hops, then the lowest
    source and destination adapter index, then the switch names in order.
    """
    if topology.node(src).name == topology.node(dst).name:
        return None
    found = routes(topology, src, dst, down=down)
    if not found:
        raise NoPathError(src, dst)
    return found[0]
