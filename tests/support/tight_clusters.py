"""Small etcd clusters whose adapters a few VMs fill, for the tests of a node's own places
(etcd layout 6) and of a lender's lent entries (layout 7)."""

from __future__ import annotations

import hashlib
import time
import uuid

from vmlend.ledger.admission import port_usage, usage
from vmlend.registry import DeviceRecord, TopologyRecord, open_registry
from vmlend.registry.decider import Deciders
from vmlend.topology.compiled import compile_topology
from vmlend.topology.parse import parse_topology
from vmlend.topology.requesters import is_port
from vmlend.wiring.fabric import init_fabric, open_fabric


def _node(name: str, node_id: int, lends: int) -> str:
    devices = "".join(
        f"""
  [[node.device]]
  fdid = {node_id * 0x100 + i}
  bdf = "0000:{i + 1:02x}:00.0"
  kind = "nic"
  vendor = 0x8086
  device = 0x1521
  class = 0x020000
  bars = [ {{ index = 0, size = "16MiB" }} ]
"""
        for i in range(lends)
    )
    # 3 usable LUT entries (2 kept for the CPU), 4 window segments of 1 GiB
    return f"""
[[node]]
name = "{name}"
id = {node_id}
  [[node.adapter]]
  index = 0
  window = "4GiB"
  segments = 4
  lut_entries = 5
{devices}"""


def _within_capacity(fabric) -> None:
    """No adapter or switch port holds more claims than it has room for, counting what the
    registry sets aside for no hold (a lender's idle lent entries)."""
    topo = fabric.topology()
    with fabric.registry.read() as tx:
        claims = [*tx.claims(), *tx.set_aside()]
    for ref, u in usage(topo, claims).items():
        assert u.lut_used <= u.adapter.lut_usable, (ref, u)
        assert u.segments_used <= u.adapter.segments, (ref, u)
    ports = {c.adapter for _f, c in claims if is_port(c.adapter)}
    for port, n in port_usage(claims, ports).items():
        assert n <= topo.switch_requester_entries(port.split("/", 1)[0]), (port, n)


def _close(fabrics) -> None:
    for f in fabrics.values():
        f.close()


def _text(name: str, *nodes: str) -> str:
    return (
        f'name = "{name}"\n'
        + "".join(nodes)
        + ('\n[[switch]]\nname = "sw"\nports = ["a:0", "b:0", "c:0"]\n')
    )


_SMALL = 'window = "4GiB"\n  segments = 4\n  lut_entries = 5'


def _sized(node: str, node_id: int, lends: int, segments: int, lut: int = 18) -> str:
    size = f'window = "{segments}GiB"\n  segments = {segments}\n  lut_entries = {lut}'
    return _node(node, node_id, lends).replace(_SMALL, size)


def _open(url: str, text: str, procs: dict[str, str]) -> dict[str, object]:
    init_fabric(url, text, "picked.toml")
    fabrics = {}
    for proc, node in procs.items():
        fabrics[proc] = open_fabric(url, node)
        fabrics[proc].registry.deciders = Deciders()
    return fabrics


def _url(etcd_url: str) -> str:
    server, _cluster = etcd_url.rsplit("/", 1)
    return f"{server}/picked-{uuid.uuid4().hex[:12]}"


def amend_text(url: str, text: str) -> None:
    """Install ``text`` over the cluster's topology as an amend (what ``fabric discover``
    does: every record kept, a device's lent flag too, new devices lent)."""
    topo = parse_topology(text, "amended.toml")
    digest = hashlib.sha256(text.encode()).hexdigest()
    record = TopologyRecord(
        name=topo.name,
        source="amended.toml",
        text=text,
        digest=digest,
        local_node="",
        created=time.time(),
        compiled=compile_topology(topo, digest),
    )
    registry = open_registry(url)

    def amend(tx) -> None:
        before = tx.devices()
        lent = {d.fdid: before[d.fdid].lent if d.fdid in before else d.lent for d in topo.devices}
        records = [DeviceRecord(d.fdid, d.lender, lent[d.fdid]) for d in topo.devices]
        tx.amend_topology(record, [n.name for n in topo.nodes], records)

    try:
        registry.transact(amend)
    finally:
        registry.close()
