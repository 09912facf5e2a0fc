"""State files as an older vmlend wrote them (``older_vmlend``), for the migration tests."""

from __future__ import annotations

import contextlib

from vmlend.registry import schema as schema_mod
from vmlend.registry import store as store_mod
from vmlend.registry import txn as txn_mod


def _replace_topology_before_v3(self, rec, nodes, devices):
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
def older_vmlend(monkeypatch, version):
    """Within: state files are created and written as a vmlend of schema ``version`` did."""
    with monkeypatch.context() as m:
        m.setattr(store_mod, "SCHEMA_VERSION", version)
        older = {v: steps for v, steps in schema_mod.MIGRATIONS.items() if v < version}
        m.setattr(store_mod, "MIGRATIONS", older)
        if version < 3:
            m.setattr(txn_mod.SqliteTxn, "replace_topology", _replace_topology_before_v3)
        yield
