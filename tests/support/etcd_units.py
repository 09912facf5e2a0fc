"""What the etcd registry's adapter unit keys hold against what the claims use, for the
unit tests of ``_take_units`` and of commits from remembered reads."""

from __future__ import annotations

import json

from tests.support.simfabric import star_topology
from vmlend.ledger.admission import port_usage, usage
from vmlend.registry import parse_location
from vmlend.registry.decider import own_usage
from vmlend.registry.etcd_gateway import EtcdGateway, prefix_end
from vmlend.registry.etcd_keys import (
    Keys,
    aligned_size,
    block_owner,
    claim_from_dict,
    claims_of_block,
    is_extent,
    lent_share,
    unit_span,
)
from vmlend.registry.etcd_txn import EtcdTxn
from vmlend.topology.model import GiB, Holder
from vmlend.topology.requesters import is_port


def _read(url: str, prefix_of) -> tuple[Keys, list]:
    loc = parse_location(url)
    keys = Keys(loc.cluster)
    prefix = prefix_of(keys)
    gw = EtcdGateway(loc.endpoints)
    try:
        _rev, kvs = gw.range(prefix, prefix_end(prefix))
    finally:
        gw.close()
    return keys, kvs


def _block_of(keys: Keys, key: str) -> tuple[str, str, int, int]:
    """``(adapter, lut|seg, start, size)`` of a block key ``units/<adapter>/<unit>-blocks/
    <start>/<size>`` or a run's ``.../<start>/<size>/<free>`` (a switch port's name,
    "switch/toward", has a "/" of its own)."""
    head, sep, tail = key.removeprefix(keys.units).rpartition("-blocks/")
    assert sep, key
    adapter, unit = head.rsplit("/", 1)
    start, size = unit_span(tail)
    # the shape two takes' compares rely on: aligned to its size rounded up to a power of
    # two, and the key vmlend makes of that span (a run's free count from 1 to its block's
    # size less 1)
    assert start % aligned_size(size) == 0 and keys.unit_block(adapter, unit, start, size) == key
    return adapter, unit, start, size


def own_node_of(adapter: str) -> str:
    """The node whose own place ``adapter`` is (an adapter's, or a switch port's cabled to
    an adapter; "" for a port toward another switch): the tests' adapter refs are
    ``node:index``, their switch names have no colon."""
    ref = adapter.split("/", 1)[1] if is_port(adapter) else adapter
    return ref.rpartition(":")[0]


def unit_blocks_held(
    url: str, *, extents: bool | None = None
) -> dict[tuple[str, str], list[tuple[int, int]]]:
    """Per (adapter, lut|seg), the ``(start, size)`` of each unit block the registry holds,
    in order: the VMs', the nodes' extents and lent entries (``extents`` None), the extents
    alone (True) or the VMs' alone (False)."""
    keys, kvs = _read(url, lambda k: k.units)
    out: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for kv in kvs:
        if extents is not None and is_extent(kv.value) != extents:
            continue
        if extents is False and lent_share(kv.value) is not None:
            continue  # a lent entry: its lender's, no VM's
        adapter, unit, start, size = _block_of(keys, kv.key)
        out.setdefault((adapter, unit), []).append((start, size))
    return {k: sorted(v) for k, v in out.items()}


def lent_entries_held(url: str) -> dict[str, list[str]]:
    """Per adapter or switch port, the requester shares of the lent entries there."""
    keys, kvs = _read(url, lambda k: k.units)
    out: dict[str, list[str]] = {}
    for kv in kvs:
        share = lent_share(kv.value)
        if share is not None:
            out.setdefault(_block_of(keys, kv.key)[0], []).append(share)
    return {k: sorted(v) for k, v in out.items()}


def ledgers_agree_with_blocks(url: str) -> None:
    """What the VMs' markers say against the unit blocks in etcd (layout 5): each block is
    of a VM whose marker lists it, and each listed block is there; each VM has the units its
    ledger's claims use (``_units_needed``), each of its blocks on its marker's lease; its
    first block on each adapter (its head)
    carries exactly its ledger's claims there, its other blocks none; every hold a marker's
    ledger has claims for is listed in that marker."""
    keys, blocks = _read(url, lambda k: k.units)
    _k, markers = _read(url, lambda k: k.vm_markers)
    _k, deciders = _read(url, lambda k: k.base + "decider/")
    devices = _device_requesters(url)
    owned: dict[tuple[str, str], dict[str, bytes]] = {}  # (owner, adapter) -> key -> value
    leases: dict[str, set[int]] = {}  # owner -> the leases its blocks are on
    extents: dict[tuple[str, str, str], list[tuple[int, int]]] = {}  # (node, place) -> spans
    lent: dict[tuple[str, str], int] = {}  # (place, requester share) -> its lent entries
    for kv in blocks:
        adapter, unit, start, size = _block_of(keys, kv.key)
        share = lent_share(kv.value)
        if share is not None:
            assert own_node_of(adapter) == block_owner(kv.value), ("lent off its node", kv.key)
            assert (unit, size, kv.lease) == ("lut", 1, 0), ("a lent entry is one LUT unit", kv.key)
            lent[(adapter, share)] = lent.get((adapter, share), 0) + 1
            continue
        if is_extent(kv.value):
            node = block_owner(kv.value)
            assert own_node_of(adapter) == node, ("an extent off its node's own", kv.key)
            assert kv.lease == 0, ("an extent on a lease", kv.key)
            extents.setdefault((node, adapter, unit), []).append((start, size))
            continue
        owner = block_owner(kv.value)
        owned.setdefault((owner, adapter), {})[kv.key] = kv.value
        leases.setdefault(owner, set()).add(kv.lease)
    listed: set[tuple[str, str]] = set()
    own_claims: dict[str, list] = {}  # node -> its VMs' claims on its own places
    for kv in markers:
        node = kv.key.removeprefix(keys.vm_markers).split("/", 1)[0]
        d = json.loads(kv.value)
        owner = f"{node}/{d['vm']}"
        # on the marker's lease: they lapse together (a block left without its ledger
        # entry could be given back by its VM's next change while another VM uses it)
        assert leases.get(owner, {kv.lease}) == {kv.lease}, (owner, leases[owner], kv.lease)
        ledger = d.get("ledger", {})
        assert set(ledger) <= set(d.get("fdids", [])), (kv.key, "claims of a hold not listed")

        # on its node's own places a VM has no blocks: its node's decider counts its claims;
        # nor for a lent device's requester entries, its lender's lent entries
        def covered(f: int, c: dict) -> bool:
            lender, share = devices.get(f, ("", ""))
            return (
                c["kind"] == "lut" and c["share"] == share and own_node_of(c["adapter"]) == lender
            )

        for f, claims in ledger.items():
            for c in claims:
                if covered(int(f, 16), c):
                    assert lent.get((c["adapter"], c["share"])) == 1, (
                        "a lent device's entry held with no lent entry (or two)",
                        kv.key,
                        c,
                    )
        rows = [
            EtcdTxn._row(c)
            for f, claims in ledger.items()
            for c in claims
            if own_node_of(c["adapter"]) != node and not covered(int(f, 16), c)
        ]
        own_claims.setdefault(node, []).extend(
            (int(f, 16), claim_from_dict(c))
            for f, claims in ledger.items()
            for c in claims
            if own_node_of(c["adapter"]) == node and not covered(int(f, 16), c)
        )
        need = EtcdTxn._units_needed(rows)
        have: dict[tuple[str, str], int] = {}
        on = {
            a: kept
            for a, c in EtcdTxn._claims_by_adapter(ledger).items()
            if own_node_of(a) != node and (kept := [x for x in c if not covered(x["fdid"], x)])
        }
        for adapter in set(d.get("blocks", {})) | set(on):
            spans = d.get("blocks", {}).get(adapter, {})
            want = sorted(
                keys.unit_block(adapter, unit, s, z)
                for unit, held in spans.items()
                for s, z in held
            )
            there = owned.get((owner, adapter), {})
            assert sorted(there) == want, (owner, adapter, sorted(there), want)
            for i, key in enumerate(want):
                assert claims_of_block(there[key]) == tuple(
                    (c["fdid"], claim_from_dict(c)) for c in (on.get(adapter, []) if i == 0 else [])
                ), (owner, key)
            for unit, held in spans.items():
                have[(adapter, unit)] = sum(z for _s, z in held)
            listed.add((owner, adapter))
        assert have == need, (owner, have, need)
    assert set(owned) <= listed, ("blocks of no marker", set(owned) - listed)
    assert all(n == 1 for n in lent.values()), ("two lent entries of one requester", lent)
    # each node's epoch key lists its extents, and what its VMs use of its own places fits
    listed_extents: dict[tuple[str, str, str], list[tuple[int, int]]] = {}
    for kv in deciders:
        node, _sep, what = kv.key.removeprefix(keys.base + "decider/").rpartition("/")
        if what != "extents":
            continue
        for adapter, units in json.loads(kv.value).items():
            for unit, spans in units.items():
                listed_extents[(node, adapter, unit)] = sorted((s, z) for s, z in spans)
    assert {k: sorted(v) for k, v in extents.items()} == listed_extents, (
        extents,
        listed_extents,
    )
    for node, pairs in own_claims.items():
        places = {(c.adapter, u) for _f, c in pairs for u in ("lut", "seg")}
        for (adapter, unit), n in own_usage(pairs, places).items():
            room = sum(z for _s, z in extents.get((node, adapter, unit), []))
            assert n <= room, (node, adapter, unit, n, room)


def _device_requesters(url: str) -> dict[int, tuple[str, str]]:
    """Per device of the cluster's topology, its lender and requester share."""
    from vmlend.registry import open_registry
    from vmlend.topology.compiled import stored_topology
    from vmlend.topology.requesters import requester_share

    registry = open_registry(url)
    try:
        with registry.read() as tx:
            record = tx.topology()
    finally:
        registry.close()
    if record is None:
        return {}
    topo = stored_topology(record)
    return {d.fdid: (d.lender, requester_share(d)) for d in topo.devices}


def own_units_fit(url: str, fabric) -> None:
    """What the claims use is on the VMs' blocks exactly where hosts contend (but a lent
    device's requester entries, on its lender's lent entries), and within their node's
    extents on a node's own places (``ledgers_agree_with_blocks``)."""
    with fabric.registry.read() as tx:
        claims, holds = tx.claims(), tx.holds()
    devices = _device_requesters(url)

    def lent(f: int, c) -> bool:  # a lent device's requester entry: its lender's lent entry
        lender, share = devices.get(f, ("", ""))
        return c.kind.value == "lut" and c.share == share and own_node_of(c.adapter) == lender

    contended = [
        (f, c)
        for f, c in claims
        if own_node_of(c.adapter) != holds[f].holder.node and not lent(f, c)
    ]
    assert unit_keys_held(url, extents=False) == _usage_of(fabric, contended)
    ledgers_agree_with_blocks(url)


def unit_keys_held(url: str, *, extents: bool | None = None) -> dict[tuple[str, str], int]:
    """Per (adapter, lut|seg), how many units the registry's unit keys hold (``extents`` as
    for ``unit_blocks_held``); fails on a unit that two keys hold."""
    out: dict[tuple[str, str], int] = {}
    for (adapter, unit), spans in unit_blocks_held(url, extents=extents).items():
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
    with fabric.registry.read() as tx:
        claims = tx.claims()
    return _usage_of(fabric, claims)


def _usage_of(fabric, claims) -> dict[tuple[str, str], int]:
    out = {}
    for ref, u in usage(fabric.topology(), claims).items():
        for unit, n in (("lut", u.lut_used), ("seg", u.segments_used)):
            if n:
                out[(ref, unit)] = n
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


def set_aside_lut(fabric) -> dict[str, int]:
    """Per adapter or switch port, the LUT entries the registry sets aside for no hold (a
    lender's lent entries, etcd layout 7; none on SQLite)."""
    with fabric.registry.read() as tx:
        aside = tx.set_aside()
    out: dict[str, int] = {}
    for _fdid, claim in aside:
        out[claim.adapter] = out.get(claim.adapter, 0) + claim.entries
    return out
