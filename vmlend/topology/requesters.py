"""Requesters as the hardware counts them: pure logic over a ``Topology``.

An NTB adapter's requester LUT, and the requester table of each cluster switch port a
crossing passes, hold one entry per requester *device* (bus:device), not per function: the
functions of one device share it, as SmartIO (§8.6) counts "devices rather than functions".
Under ARI a function number above 7 spills into the device number bits, so a VF beyond
function 7 has a device number of its own (Linux shows it so: ``41:01.0`` is routing id
function 8 of bus 0x41) and its own entry.

A switch port is named by its switch and what its cable reaches (``sw/gamma:0`` for the port
cabled to adapter ``gamma:0``, ``sw/sw2`` for the one cabled to switch ``sw2``): a port to an
adapter is named as its cable is (``LinkSpec.names``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from vmlend.topology.model import DeviceSpec

if TYPE_CHECKING:  # the registry names ports without loading the routing
    from vmlend.topology.model import Topology
    from vmlend.topology.paths import NtbPath


def requester_device(spec: DeviceSpec) -> str:
    """The requester device ``spec``'s function belongs to on its lender:
    ``lender/domain:bus:device`` (``alpha/0000:41:00`` for ``0000:41:00.3``)."""
    return f"{spec.lender}/{spec.bdf.rpartition('.')[0]}"


def share_of(requester: str) -> str:
    """The claim share of the entries of ``requester`` (a ``requester_device``)."""
    return f"req:{requester}"


def requester_share(spec: DeviceSpec) -> str:
    """The claim share of ``spec``'s requester entries (LUT and switch ports): one for all
    the functions of its device, which then count once."""
    return share_of(requester_device(spec))


class SwitchPort(msgspec.Struct, frozen=True):
    """One port of cluster switch ``switch``, cabled to ``toward`` (an adapter ref or another
    switch's name)."""

    switch: str
    toward: str

    @property
    def name(self) -> str:
        return f"{self.switch}/{self.toward}"


def route_ports(path: NtbPath) -> tuple[SwitchPort, ...]:
    """The switch ports ``path`` passes, in order: for each switch, the port it enters by and
    the one it leaves by. () for a back-to-back cable."""
    out: list[SwitchPort] = []
    hops = (path.src.ref, *path.switches, path.dst.ref)
    for i, sw in enumerate(path.switches, start=1):
        out.append(SwitchPort(sw, hops[i - 1]))
        out.append(SwitchPort(sw, hops[i + 1]))
    return tuple(out)


def ports_between(topology: Topology, lender: str, node: str) -> set[str]:
    """The ports of every route from ``lender`` to ``node``, dead cables or not: where a
    crossing between them may hold entries (a re-routed one moves among them)."""
    from vmlend.topology.paths import routes

    if lender == node:
        return set()
    return {p.name for path in routes(topology, lender, node) for p in route_ports(path)}


def port_switch(name: str) -> str:
    """The switch of port ``name`` (switch names have no ``/``: the parser refuses one)."""
    return name.split("/", 1)[0]


def is_port(name: str) -> bool:
    """``name`` (a claim's ``adapter``) is a switch port, not an adapter ref: node names, and
    so adapter refs, have no ``/``."""
    return "/" in name
