"""NTB paths between nodes: pure logic over a ``Topology``.

A path is one crossing: an adapter of the source node cabled to an adapter of the destination
node, back-to-back or through one or more cluster switches (switches may be cascaded with
``switch_link``s). Hosts do not forward NTB traffic for others, so a route never passes
through a third host's adapter. The same node needs no NTB (``route`` returns None).
"""

from __future__ import annotations

from collections import deque

import msgspec

from vmlend.errors import NoPathError
from vmlend.topology.model import AdapterSpec, Topology


class NtbPath(msgspec.Struct, frozen=True):
    src: AdapterSpec  # adapter in the source node
    dst: AdapterSpec  # adapter in the destination node
    switches: tuple[str, ...] = ()  # cluster switches between them, in order; () back-to-back

    @property
    def switch(self) -> str | None:
        """The first switch on the way (None for a back-to-back cable)."""
        return self.switches[0] if self.switches else None

    def describe(self) -> str:
        via = f" via {', '.join(self.switches)}" if self.switches else ""
        return f"{self.src.ref} -> {self.dst.ref}{via}"


_Vertex = tuple[str, str]  # ("adapter", ref) or ("switch", name)


def _graph(topology: Topology) -> dict[_Vertex, list[_Vertex]]:
    """Adapters and switches, joined by cables; neighbours sorted, for deterministic routes."""
    edges: dict[_Vertex, set[_Vertex]] = {}

    def join(a: _Vertex, b: _Vertex) -> None:
        edges.setdefault(a, set()).add(b)
        edges.setdefault(b, set()).add(a)

    for link in topology.links:
        if link.switch is None:
            a, b = link.ends
            join(("adapter", a), ("adapter", b))
        else:
            for end in link.ends:
                join(("switch", link.switch), ("adapter", end))
    for a, b in topology.switch_links:
        join(("switch", a), ("switch", b))
    return {v: sorted(n) for v, n in edges.items()}


def _shortest(
    graph: dict[_Vertex, list[_Vertex]], start: _Vertex, targets: set[_Vertex]
) -> list[_Vertex] | None:
    """Breadth first from ``start`` through switches only (adapters end a path): the shortest
    path to a target, the first in sorted order among equally short ones."""
    parent: dict[_Vertex, _Vertex | None] = {start: None}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        if v in targets:
            path = [v]
            while (p := parent[path[-1]]) is not None:
                path.append(p)
            return path[::-1]
        if v != start and v[0] == "adapter":
            continue  # a host does not forward for others
        for n in graph.get(v, []):
            if n not in parent:
                parent[n] = v
                queue.append(n)
    return None


def route(topology: Topology, src: str, dst: str) -> NtbPath | None:
    """The shortest path from node ``src`` to node ``dst``; None when they are the same node.

    Raises ``UnknownNodeError`` for unknown nodes and ``NoPathError`` when no cable joins them.
    Deterministic: fewest switches, then the lowest source and destination adapter index, then
    the switch names in order.
    """
    src_node = topology.node(src)
    dst_node = topology.node(dst)
    if src_node.name == dst_node.name:
        return None
    graph = _graph(topology)
    by_ref = {a.ref: a for a in topology.adapters()}
    targets = {("adapter", a.ref) for a in dst_node.adapters}
    best: tuple[int, int, int, tuple[str, ...]] | None = None
    for a in sorted(src_node.adapters, key=lambda a: a.index):
        found = _shortest(graph, ("adapter", a.ref), targets)
        if found is None:
            continue
        switches = tuple(name for kind, name in found[1:-1] if kind == "switch")
        key = (len(switches), a.index, by_ref[found[-1][1]].index, switches)
        if best is None or key < best:
            best = key
            choice = NtbPath(src=a, dst=by_ref[found[-1][1]], switches=switches)
    if best is None:
        raise NoPathError(src, dst)
    return choice
