"""NTB paths between nodes: pure logic over a ``Topology``.

A path is one crossing: an adapter of the source node cabled, back-to-back or through a switch,
to an adapter of the destination node. Hosts do not forward NTB traffic for others, so there are
no multi-host paths. The same node needs no NTB (``route`` returns None).
"""

from __future__ import annotations

from dataclasses import dataclass

from vmlend.errors import NoPathError
from vmlend.fabric.model import AdapterSpec, Topology


@dataclass(frozen=True)
class NtbPath:
    src: AdapterSpec  # adapter in the source node
    dst: AdapterSpec  # adapter in the destination node
    switch: str | None  # switch between them, None for a back-to-back cable

    @property
    def hops(self) -> int:
        """Devices a TLP crosses between the two adapters (the switch, if any)."""
        return 1 if self.switch else 0

    def describe(self) -> str:
        via = f" via {self.switch}" if self.switch else ""
        return f"{self.src.ref} -> {self.dst.ref}{via}"


def route(topology: Topology, src: str, dst: str) -> NtbPath | None:
    """The path from node ``src`` to node ``dst``; None when they are the same node.

    Raises ``UnknownNodeError`` for unknown nodes and ``NoPathError`` when no cable joins them.
    Among several, the first by adapter index wins (deterministic).
    """
    src_node = topology.node(src)
    dst_node = topology.node(dst)
    if src_node.name == dst_node.name:
        return None
    adapters = {a.ref: a for a in topology.adapters()}
    for link in topology.links:
        ends = [adapters[e] for e in link.ends if e in adapters]
        a_side = sorted((a for a in ends if a.node == src), key=lambda a: a.index)
        b_side = sorted((a for a in ends if a.node == dst), key=lambda a: a.index)
        if a_side and b_side:
            return NtbPath(src=a_side[0], dst=b_side[0], switch=link.switch)
    raise NoPathError(src, dst)
