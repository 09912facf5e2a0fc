"""What the etcd registry's adapter unit keys hold against what the claims use, for the
unit tests of ``_take_units`` and of commits from remembered reads."""

from __future__ import annotations

from tests.support.simfabric import star_topology
from vmlend.ledger.admission import port_usage
from vmlend.registry import parse_location
from vmlend.registry.etcd_gateway import EtcdGateway, prefix_end
from vmlend.registry.etcd_keys import Keys
from vmlend.registry.etcd_txn import EtcdTxn
from vmlend.topology.model import GiB, Holder
from vmlend.topology.requesters import is_port


def unit_blocks_held(url: str) -> dict[tuple[str, str], list[tuple[int, int]]]:
    """Per (adapter, lut|seg), the ``(start, size)`` of each unit key the registry holds, in
    order: blocks, and single units of vmlend before blocks as blocks of one."""
    loc = parse_location(url)
    keys = Keys(loc.cluster)
    prefix = keys.base + "units/"
    gw = EtcdGateway(loc.endpoints)
    try:
        _rev, kvs = gw.range(prefix, prefix_end(prefix))
    finally:
        gw.close()
    out: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for kv in kvs:
        # units/<adapter>/<unit>-blocks/<start>/<size>, or one unit: units/<adapter>/<unit>/<i>
        # (a switch port's name, "switch/toward", has a "/" of its own: read from the end)
        body = kv.key.removeprefix(prefix)
        if "-blocks/" in body:
            head, first, count = body.rsplit("/", 2)
            start, size = int(first), int(count)
        else:
            head, first = body.rsplit("/", 1)
            start, size = int(first), 1
        adapter, unit = head.rsplit("/", 1)
        out.setdefault((adapter, unit.removesuffix("-blocks")), []).append((start, size))
    return {k: sorted(v) for k, v in out.items()}


def unit_keys_held(url: str) -> dict[tuple[str, str], int]:
    """Per (adapter, lut|seg), how many units the registry's unit keys hold; fails on a unit
    that two keys hold."""
    out: dict[tuple[str, str], int] = {}
    for (adapter, unit), spans in unit_blocks_held(url).items():
        covered: set[int] = set()
        for start, size in spans:
            for i in range(start, start + size):
                assert i not in covered, f"unit {i} of {adapter} {unit} taken twice"
                covered.add(i)
        out[(adapter, unit)] = len(covered)
    return out


def taking(registry, take: tuple[int, int]) -> tuple[EtcdTxn, list[tuple[int, int]]]:
    """A transaction of ``registry`` that has taken ``take[0]`` units of ``l:0``'s segments
    from index ``take[1]`` on (nothing committed yet), and the ``(start, size)`` blocks it
    picked."""
    tx = registry._txn(writable=True)
    return tx, tx._take_units("l:0", "seg", take[0], Holder("h0", f"vm{take[1]}"), take[1])


def units_claimed(fabric) -> dict[tuple[str, str], int]:
    """Per (adapter, lut|seg), what the claims use (``admission.usage``), and per switch
    port the requester entries (``admission.port_usage``)."""
    out = {}
    for ref, u in fabric.usage().items():
        for unit, n in (("lut", u.lut_used), ("seg", u.segments_used)):
            if n:
                out[(ref, unit)] = n
    with fabric.registry.read() as tx:
        claims = tx.claims()
    ports = {c.adapter for _f, c in claims if is_port(c.adapter)}
    for port, n in port_usage(claims, ports).items():
        if n:
            out[(port, "lut")] = n
    return out


def last_capacity(limit: str, extra: int) -> tuple[str, int]:
    """Three devices of ``l`` for borrowers h0 and h1 (each with its own adapter), with room
    on ``l``'s adapter for ``1 + extra`` reservations: one usable LUT entry each (less the
    two the CPU keeps), or two 1 GiB segments each, what 2 GiB of guest RAM's DMA windows take."""
    if limit == "lut":
        return star_topology(2, 3, lut_entries=3 + extra), 0
    window = f"{2 * (1 + extra)}GiB"
    return star_topology(2, 3, lender_window=window, lender_segments=2 * (1 + extra)), 2 * GiB
