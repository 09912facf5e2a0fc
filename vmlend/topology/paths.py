"""NTB paths between nodes: pure logic over a ``Topology``.

A path is one crossing: an adapter of the source node cabled to an adapter of the destination
node, back-to-back or through one or more cluster switches (switches may be cascaded with
``switch_link``s). Hosts do not forward NTB traffic for others, so a route never passes
through a third host's adapter. The same node needs no NTB (``route`` returns None).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection

import msgspec

from vmlend.errors import NoPathError
from vmlend.topology.model import AdapterSpec, LinkSpec, Topology


class NtbPath(msgspec.Struct, frozen=True):
    src: AdapterSpec  # adapter in the source node
    dst: AdapterSpec  # adapter in the destination node
    switches: tuple[str, ...] = ()  # cluster switches between them, in order; () back-to-back
    #: The cables passed, by name (``LinkSpec.names``): what a link fault on the way cuts.
    links: tuple[str, ...] = ()

    @property
    def switch(self) -> str | None:
        """The first switch on the way (None for a back-to-back cable)."""
        return self.switches[0] if self.switches else None

    @property
    def cost(self) -> int:
        """Its hops the papers' way: the two adapters and each cluster switch between them."""
        return 2 + len(self.switches)

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


def _shortest(graph: _Graph, start: _Vertex, target: _Vertex) -> list[tuple[_Vertex, str]] | None:
    """Breadth first from ``start`` through switches only (adapters end a path): the shortest
    way to ``target`` as (vertex, cable into it) steps, the first in sorted order among
    equally short ones."""
    parent: dict[_Vertex, tuple[_Vertex, str] | None] = {start: None}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        if v == target:
            steps: list[tuple[_Vertex, str]] = []
            while (p := parent[v]) is not None:
                steps.append((v, p[1]))
                v = p[0]
            return steps[::-1]
        if v != start and v[0] == "adapter":
            continue  # a host does not forward for others
        for n, name in graph.get(v, []):
            if n not in parent:
                parent[n] = (v, name)
                queue.append(n)
    return None


def routes(topology: Topology, src: str, dst: str, *, down: Collection[str] = ()) -> list[NtbPath]:
    """Every way from node ``src`` to node ``dst``: for each pair of a source and a destination
    adapter the cables join, the shortest path between them, avoiding the cables in ``down``.
    Cheapest first (fewest switches), then by source and destination adapter index and switch
    names; [] for the same node or when nothing joins them. Raises ``UnknownNodeError``."""
    src_node = topology.node(src)
    dst_node = topology.node(dst)
    if src_node.name == dst_node.name:
        return []
    graph = _graph(topology, down)
    found: list[NtbPath] = []
    for a in src_node.adapters:
        for b in dst_node.adapters:
            steps = _shortest(graph, ("adapter", a.ref), ("adapter", b.ref))
            if steps is None:
                continue
            switches = tuple(v[1] for v, _ in steps[:-1])
            links = tuple(name for _, name in steps)
            found.append(NtbPath(src=a, dst=b, switches=switches, links=links))
    found.sort(key=lambda p: (len(p.switches), p.src.index, p.dst.index, p.switches))
    return found


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
    ``down``) joins them. Deterministic: fewest switches, then the lowest source and
    destination adapter index, then the switch names in order.
    """
    if topology.node(src).name == topology.node(dst).name:
        return None
    found = routes(topology, src, dst, down=down)
    if not found:
        raise NoPathError(src, dst)
    return found[0]
