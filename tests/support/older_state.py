"""State files as an older vmlend wrote them (``older_vmlend``), for the migration tests."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vmlend.registry import (
    DeviceRecord,
    HoldRecord,
    Phase,
    SqliteRegistry,
    TopologyRecord,
    topopieces,
)
from vmlend.registry import etcd_txn as etcd_txn_mod
from vmlend.registry import schema as schema_mod
from vmlend.registry import store as store_mod
from vmlend.registry import txn as txn_mod
from vmlend.registry import upgrade as upgrade_mod
from vmlend.topology import compiled as compiled_mod
from vmlend.topology.model import Holder, Topology


def _replace_topology_before_v3(
    self: txn_mod.SqliteTxn,
    rec: TopologyRecord,
    nodes: Iterable[str],
    devices: Iterable[DeviceRecord],
) -> None:
    """``SqliteTxn.replace_topology`` as vmlend wrote it before schema version 3: no compiled
    topology column."""
    for table in ("mdevs", "mdev_parents", "claims", "holds", "devices", "nodes", "topology"):
        self._c.execute(f"DELETE FROM {table}")
    self._c.execute(
        "INSERT INTO topology (id, name, source, text, digest, local_node, created)"
        " VALUES (1, ?, ?, ?, ?, ?, ?)",
        (rec.name, rec.source, rec.text, rec.digest, rec.local_node, rec.created),
    )
    self._c.executemany("INSERT INTO nodes (name) VALUES (?)", [(n,) for n in nodes])
    self._c.executemany(
        "INSERT INTO devices (fdid, lender, lent, available) VALUES (?, ?, ?, ?)",
        [(d.fdid, d.lender, int(d.lent), int(d.available)) for d in devices],
    )


@contextlib.contextmanager
def older_vmlend(monkeypatch: pytest.MonkeyPatch, version: int) -> Iterator[None]:
    """Within: state files are created and written as a vmlend of schema ``version`` did
    (before 7: topology generations of format 1, read whole)."""
    with monkeypatch.context() as m:
        m.setattr(store_mod, "SCHEMA_VERSION", version)
        if version < schema_mod.GENERATION_2_SINCE:
            m.setattr(topopieces, "PIECES_FORMAT", topopieces.PIECES_FORMAT_1)
            # and the compiled form of then, which this vmlend does not read
            m.setattr(compiled_mod, "COMPILED_FORMAT", "vmlend-topology/6")
        older = {v: steps for v, steps in schema_mod.MIGRATIONS.items() if v < version}
        m.setattr(store_mod, "MIGRATIONS", older)
        if version < 3:
            m.setattr(txn_mod.SqliteTxn, "replace_topology", _replace_topology_before_v3)
        yield


@dataclass(frozen=True)
class OlderState:
    """A state file an older vmlend left (``older_state_with_a_hold``)."""

    path: Path
    text: str  # the topology installed: the shipped default
    source: str
    hold: HoldRecord  # device 0x10's, as that vmlend read it back (its token, if it gave one)


#: The holder of an older state's one hold: VM ``old`` on node ``gamma`` of the default
#: topology.
OLD_HOLDER = Holder("gamma", "old")


def older_state_with_a_hold(
    monkeypatch: pytest.MonkeyPatch, path: Path, version: int
) -> OlderState:
    """A state file at ``path`` as a vmlend of schema ``version`` left it: the shipped default
    topology installed for node ``gamma`` (``fabric init``) and device 0x10 reserved for
    ``OLD_HOLDER``. Opening it afterwards, outside ``older_vmlend``, migrates it."""
    from vmlend.wiring.fabric import default_topology_text, init_fabric

    text, source = default_topology_text()
    with older_vmlend(monkeypatch, version):
        init_fabric(path, text, source, node="gamma")
        with SqliteRegistry.open(path) as reg:
            with reg.write() as tx:
                tx.add_hold(HoldRecord(0x10, OLD_HOLDER, 0.0, Phase.RESERVED), [])
            with reg.read() as tx:
                hold = tx.hold(0x10)
    assert hold is not None
    return OlderState(path, text, source, hold)


def stored_rows(path: Path, sql: str) -> list[tuple[Any, ...]]:
    """The rows ``sql`` selects from the state file at ``path``, read by sqlite3 itself: what
    the file holds, not what vmlend makes of it (and without migrating it)."""
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


@contextlib.contextmanager
def etcd_layout_3(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Within: clusters are written as a vmlend of etcd layout 3 did (generations of format
    1, read whole)."""
    with monkeypatch.context() as m:
        m.setattr(topopieces, "PIECES_FORMAT", topopieces.PIECES_FORMAT_1)
        m.setattr(compiled_mod, "COMPILED_FORMAT", "vmlend-topology/6")
        m.setattr(etcd_txn_mod, "ETCD_SCHEMA_VERSION", 3)
        m.setattr(upgrade_mod, "ETCD_SCHEMA_VERSION", 3)
        yield


def etcd_before_generations(url: str, text: str, source: str, *, compiled: bool = True) -> Topology:
    """Install ``text`` in the etcd registry at ``url`` as vmlend wrote it before topology
    generations (etcd schema 2): the whole topology one JSON value ``topology/record`` (with
    its compiled form in base64 unless ``compiled`` is False, as before that existed)."""
    import base64
    import hashlib

    from vmlend.registry import etcd_keys
    from vmlend.registry.etcd_gateway import b64
    from vmlend.registry.location import _gateway, parse_location
    from vmlend.topology.compiled import compile_topology
    from vmlend.topology.parse import parse_topology

    topo = parse_topology(text, source)
    digest = hashlib.sha256(text.encode()).hexdigest()
    record = {
        "name": topo.name,
        "source": source,
        "text": text,
        "digest": digest,
        "created": 1.0,
        "nodes": [n.name for n in topo.nodes],
        "devices": {f"{d.fdid:#x}": [d.lender, d.lent] for d in topo.devices},
    }
    blob = compile_topology(topo, digest) if compiled else None
    if blob is not None:
        record["compiled"] = base64.b64encode(blob).decode()
    loc = parse_location(url)
    keys = etcd_keys.Keys(loc.cluster)
    puts = {
        keys.meta("schema_version"): b"2",
        keys.topology_digest: digest.encode(),
        keys.topology_record: etcd_keys.dump(record),
    }
    gw = _gateway(loc)
    try:
        gw.txn([], [{"request_put": {"key": b64(k), "value": b64(v)}} for k, v in puts.items()])
    finally:
        gw.close()
    return topo
