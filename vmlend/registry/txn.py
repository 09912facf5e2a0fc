"""Typed reads and writes of the state database inside one transaction.

A ``SqliteTxn`` (the SQLite ``vmlend.registry.api.StateTxn``) is only handed out by
``SqliteRegistry.read()`` / ``SqliteRegistry.write()``, which own BEGIN/COMMIT/ROLLBACK; the
methods here never commit.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from vmlend.errors import StateError, StateRecordError
from vmlend.registry import keptclaims, topopieces
from vmlend.registry.decoded import Decoded
from vmlend.registry.keptclaims import KeptClaims
from vmlend.registry.records import (
    Claim,
    ClaimKind,
    DeviceRecord,
    FenceRecord,
    HoldRecord,
    MdevRecord,
    NodeRecord,
    ParentRecord,
    Phase,
    RuntimeRecord,
    TopologyRecord,
    same_holder,
)
from vmlend.topology.model import Holder

if TYPE_CHECKING:
    from vmlend.registry.topocache import TopologyCache

_T = TypeVar("_T")
Row = tuple[Any, ...]  # what sqlite3 fetches: one value per selected column


def decoded(table: str, key: object, cls: type[_T], fields: dict[str, Any]) -> _T:
    """The record ``cls`` from one row's ``fields``, type-checked: a damaged row (text in an
    integer column, a phase or kind out of its set) is a ``StateRecordError`` naming ``table``
    and ``key``, never a traceback from deep inside a caller. SQLite has no boolean type:
    callers pass flags through ``_flag``."""
    try:
        return msgspec.convert(fields, cls, strict=True)
    except msgspec.ValidationError as e:
        raise StateRecordError(table, key, str(e)) from None
    except RecursionError:
        raise StateRecordError(table, key, _TOO_DEEP) from None


#: A record nested deeper than Python's recursion limit (no record vmlend writes nests more than
#: a few levels): JSON's decoder and msgspec raise RecursionError on it.
_TOO_DEEP = "its data nests deeper than any record vmlend writes"


def _flag(value: object) -> object:
    """A stored 0/1 as a bool; anything else as it is (the type check then names it)."""
    return bool(value) if type(value) is int and value in (0, 1) else value


def _key(value: object) -> str:
    return f"{value:#x}" if type(value) is int else repr(value)


def _pieces_of(state: str, generation: str) -> Callable[[int, int], bytes | None]:
    """Bytes of ``generation``'s content read from its pieces in the state file ``state``, on
    a connection of their own (a damaged chunk of the host's copy may be met in any thread,
    within any transaction); None when the generation is gone."""
    from urllib.parse import quote

    def read(start: int, length: int) -> bytes | None:
        n, at = divmod(start, topopieces.PIECE_BYTES)
        try:
            conn = sqlite3.connect(f"file:{quote(state)}?mode=ro", uri=True)
            try:
                row = conn.execute(
                    "SELECT CAST(data AS BLOB) FROM topology_pieces WHERE generation = ? AND n = ?",
                    (generation, n),
                ).fetchone()
            finally:
                conn.close()
        except sqlite3.Error:
            return None
        if row is None or not isinstance(row[0], bytes):
            return None
        return row[0][at : at + length]

    return read


class SqliteTxn:
    def __init__(
        self,
        conn: sqlite3.Connection,
        writable: bool,
        has_compiled: bool = True,
        has_token: bool = True,
        has_head: bool = True,
        generations: dict[str, topopieces.StoredView] | None = None,
        copy: TopologyCache | None = None,
        where: str = "",
        claims_seen: Decoded[Row, tuple[int, Claim]] | None = None,
        kept: KeptClaims | None = None,
    ) -> None:
        self._c = conn
        #: The claims per adapter this connection keeps between transactions (``keptclaims``).
        self._kept = kept
        #: Claims decoded before, by their row (``vmlend.registry.decoded``).
        self._claims_seen = Decoded() if claims_seen is None else claims_seen
        self._generations = {} if generations is None else generations
        #: This host's copy of the topology (``topocache``), the state's name in it.
        self._copy = copy
        self._where = where
        self.writable = writable
        #: False for a schema-2 file opened read-only: it has no compiled column (the
        #: migration that adds it needs a write), so its topology is parsed from the text.
        self._has_compiled = has_compiled
        self._has_token = has_token
        #: False for a state of before schema 6 (read-only, or written as an older vmlend
        #: in tests): no generations, the row holds the topology.
        self._has_head = has_head
        self._hold_cols = self._HOLD_COLS + (", token" if has_token else ", 0")

    def _write(self) -> None:
        if not self.writable:
            raise RuntimeError("write inside a read transaction")  # a programming error

    def prefetch(
        self,
        fdids: Iterable[int] = (),
        nodes: Iterable[str] = (),
        adapters: Iterable[str] = (),
        held_by: Iterable[Holder] = (),
        *,
        release_on: str | None = None,
    ) -> None:
        """Nothing to do: SQLite reads are local."""

    # --- meta --------------------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        row = self._c.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def set_meta(self, key: str, value: str) -> None:
        self._write()
        self._c.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?)"
            " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (key, value),
        )

    # --- topology ----------------------------------------------------------------------
    #
    # From schema 6 the row's ``head`` names a generation of pieces (``topopieces``), as in
    # etcd; its ``text`` is then empty and ``compiled`` NULL. One SQLite transaction writes
    # the pieces, switches the head and deletes the older generation's pieces, so readers
    # see one whole generation; each read verifies the pieces against the head's sha256.
    def topology(self) -> TopologyRecord:
        compiled = "compiled" if self._has_compiled else "NULL"
        head = "head" if self._has_head else "NULL"
        row = self._c.execute(
            f"SELECT name, source, text, digest, local_node, created, {compiled}, {head}"
            " FROM topology WHERE id = 1"
        ).fetchone()
        if row is None:
            raise StateError("the state database holds no topology; run 'vmlend fabric init'")
        if row[7] is None:
            return TopologyRecord(*row[:7])
        stored = self._generation(row[7])
        # the text and the compiled form are read when used (a hook call needs neither whole)
        return TopologyRecord(
            stored.name,
            stored.source,
            lambda: stored.text,
            stored.digest,
            row[4],
            stored.created,
            stored.compiled_view,
        )

    def _generation(self, raw: object) -> topopieces.StoredView:
        """The content of the generation the head ``raw`` names, verified."""
        if not isinstance(raw, str):
            raise StateRecordError("topology", "head", f"not text but {type(raw).__name__}")
        known = self._generations.get(raw)
        if known is not None:
            return known  # read and verified under this very head before
        head = topopieces.decode_head(raw.encode(), "head")
        # this host's copy of the generation: each chunk read and verified when first used
        copy = None
        if self._copy is not None:
            copy = self._copy.open(self._where, head, _pieces_of(self._where, head.generation))
        if copy is not None:
            stored = copy
        else:
            # row by row, not fetchall: each piece is copied into the content and dropped
            rows = self._c.execute(
                "SELECT n, CAST(data AS BLOB) FROM topology_pieces WHERE generation = ? ORDER BY n",
                (head.generation,),
            )
            try:
                verified = topopieces.assemble_verified(head, rows)
            finally:
                rows.close()  # refused halfway: no statement left running in the transaction
            stored = topopieces.unpack(head, verified.blob)
            if self._copy is not None:
                self._copy.put(self._where, head, verified.blob, digests=verified.digests)
        if len(self._generations) >= 2:  # a process sees one topology, rarely a few
            self._generations.clear()
        self._generations[raw] = stored
        return stored

    def has_topology(self) -> bool:
        return self._c.execute("SELECT 1 FROM topology WHERE id = 1").fetchone() is not None

    def topology_digest(self) -> str | None:
        # no WHERE: the one row, read from the digest's index (schema 5) alone
        row = self._c.execute("SELECT digest FROM topology").fetchone()
        return None if row is None else row[0]

    def replace_topology(
        self, rec: TopologyRecord, nodes: Iterable[str], devices: Iterable[DeviceRecord]
    ) -> None:
        """Install a topology, dropping everything that described the previous one."""
        self._write()
        devices = list(devices)
        nodes = list(nodes)
        for table in ("mdevs", "mdev_parents", "claims", "holds", "devices", "nodes", "topology"):
            self._c.execute(f"DELETE FROM {table}")  # constant names, not input
        if self._has_head:
            stored = topopieces.of_record(rec, nodes, devices)
            self._c.execute(
                "INSERT INTO topology (id, name, source, text, digest, local_node, created)"
                " VALUES (1, ?, ?, '', ?, ?, ?)",
                (rec.name, rec.source, rec.digest, rec.local_node, rec.created),
            )
            self._install(stored)
        else:
            self._c.execute(
                "INSERT INTO topology (id, name, source, text, digest, local_node, created,"
                " compiled) VALUES (1, ?, ?, ?, ?, ?, ?, ?)",
                (
                    rec.name, rec.source, rec.text, rec.digest, rec.local_node, rec.created,
                    rec.compiled_bytes(),
                ),
            )  # fmt: skip
        self._c.executemany("INSERT INTO nodes (name) VALUES (?)", [(n,) for n in nodes])
        self._c.executemany(
            "INSERT INTO devices (fdid, lender, lent, available) VALUES (?, ?, ?, ?)",
            [(d.fdid, d.lender, int(d.lent), int(d.available)) for d in devices],
        )

    def amend_topology(
        self, rec: TopologyRecord, nodes: Iterable[str], devices: Iterable[DeviceRecord]
    ) -> None:
        """Install a topology that keeps every node and device of the one in place; every
        record stays, new nodes and devices get theirs (``StateTxn.amend_topology``)."""
        self._write()
        devices = list(devices)
        nodes = list(nodes)
        if self._has_head:
            stored = topopieces.of_record(rec, nodes, devices)
            self._c.execute(
                "UPDATE topology SET name = ?, source = ?, digest = ?, created = ? WHERE id = 1",
                (rec.name, rec.source, rec.digest, rec.created),
            )
            self._install(stored)
        else:
            self._c.execute(
                "UPDATE topology SET name = ?, source = ?, text = ?, digest = ?, created = ?,"
                " compiled = ? WHERE id = 1",
                (rec.name, rec.source, rec.text, rec.digest, rec.created, rec.compiled_bytes()),
            )
        # the rows of known nodes and devices are their records: they stay as they are
        self._c.executemany("INSERT OR IGNORE INTO nodes (name) VALUES (?)", [(n,) for n in nodes])
        self._c.executemany(
            "INSERT OR IGNORE INTO devices (fdid, lender, lent, available) VALUES (?, ?, ?, ?)",
            [(d.fdid, d.lender, int(d.lent), int(d.available)) for d in devices],
        )

    def _install(self, stored: topopieces.StoredTopology) -> None:
        """Write ``stored`` as a new generation, name it in the row (whose text it then
        holds: the row's own is emptied) and delete every other generation's pieces."""
        blob = topopieces.pack(stored)
        pieces = topopieces.split(blob)
        generation = topopieces.new_generation()
        head = topopieces.head_of(generation, stored, blob, len(pieces))
        self._c.executemany(
            "INSERT INTO topology_pieces (generation, n, data) VALUES (?, ?, ?)",
            [(generation, n, piece) for n, piece in enumerate(pieces)],
        )
        self._c.execute(
            "UPDATE topology SET head = ?, text = '', compiled = NULL WHERE id = 1",
            (topopieces.encode_head(head).decode(),),
        )
        self._c.execute("DELETE FROM topology_pieces WHERE generation != ?", (generation,))

    def set_topology_compiled(self, compiled: bytes) -> None:
        """Store the compiled form of the topology already installed (one an older vmlend
        wrote without it): in a new generation when it has generations."""
        self._write()
        row = self._c.execute(
            "SELECT head FROM topology WHERE id = 1" if self._has_head else "SELECT NULL"
        ).fetchone()
        if row is not None and row[0] is not None:
            stored = self._generation(row[0])
            self._install(msgspec.structs.replace(stored.whole(), compiled=compiled))
            return
        self._c.execute("UPDATE topology SET compiled = ? WHERE id = 1", (compiled,))

    def rewrite_topology_generation(self) -> bool:
        """Write the topology's generation again in this vmlend's format (schema 7: format 2,
        read a chunk at a time, its compiled form compiled again) when it is of format 1, or
        compile a topology kept in the row (schema 5) again when this vmlend cannot read its
        compiled form; whether it did."""
        self._write()
        row = self._c.execute(
            "SELECT head FROM topology WHERE id = 1" if self._has_head else "SELECT NULL"
        ).fetchone()
        if row is None:
            return False
        if row[0] is None:  # the topology in the row (schema 5 and before): compile it again
            rec = self.topology()
            stored = topopieces.of_record(rec, [], [])
            again = topopieces.rewritten(stored)
            if again.compiled is None or again.compiled == stored.compiled:
                return False
            self._c.execute("UPDATE topology SET compiled = ? WHERE id = 1", (again.compiled,))
            return True
        head = topopieces.decode_head(str(row[0]).encode(), "head")
        if head.format == topopieces.PIECES_FORMAT:
            return False
        self._install(topopieces.rewritten(self._generation(row[0]).whole()))
        return True

    def set_local_node(self, node: str) -> None:
        self._write()
        self._c.execute("UPDATE topology SET local_node = ? WHERE id = 1", (node,))

    # --- nodes and devices ---------------------------------------------------------------
    def nodes(self) -> dict[str, NodeRecord]:
        rows = self._c.execute("SELECT name, up, why FROM nodes").fetchall()
        return {r[0]: self._node(r) for r in rows}

    def node(self, name: str) -> NodeRecord | None:
        r = self._c.execute("SELECT name, up, why FROM nodes WHERE name = ?", (name,)).fetchone()
        return None if r is None else self._node(r)

    @staticmethod
    def _node(r: Row) -> NodeRecord:
        return decoded(
            "node", _key(r[0]), NodeRecord, {"name": r[0], "up": _flag(r[1]), "why": r[2]}
        )

    def set_node_up(self, node: str, up: bool, why: str = "") -> None:
        self._write()
        self._c.execute("UPDATE nodes SET up = ?, why = ? WHERE name = ?", (int(up), why, node))

    def devices(self, fdids: Collection[int] | None = None) -> dict[int, DeviceRecord]:
        sql = "SELECT fdid, lender, lent, available FROM devices"
        if fdids is None:
            rows = self._c.execute(sql).fetchall()
        else:
            # by primary key, in batches under SQLite's limit of bound parameters
            wanted, rows = list(fdids), []
            for i in range(0, len(wanted), 500):
                batch = wanted[i : i + 500]
                marks = ", ".join("?" * len(batch))
                rows += self._c.execute(f"{sql} WHERE fdid IN ({marks})", batch).fetchall()
        return {r[0]: self._device(r) for r in rows}

    def device(self, fdid: int) -> DeviceRecord | None:
        r = self._c.execute(
            "SELECT fdid, lender, lent, available FROM devices WHERE fdid = ?", (fdid,)
        ).fetchone()
        return None if r is None else self._device(r)

    @staticmethod
    def _device(r: Row) -> DeviceRecord:
        fields = {"fdid": r[0], "lender": r[1], "lent": _flag(r[2]), "available": _flag(r[3])}
        return decoded("device", _key(r[0]), DeviceRecord, fields)

    def set_lent(self, fdid: int, lent: bool) -> None:
        self._write()
        self._c.execute("UPDATE devices SET lent = ? WHERE fdid = ?", (int(lent), fdid))

    def set_available(self, fdid: int, available: bool) -> None:
        self._write()
        self._c.execute("UPDATE devices SET available = ? WHERE fdid = ?", (int(available), fdid))

    # --- holds and claims ------------------------------------------------------------------
    _HOLD_COLS = "fdid, node, vm, vm_uuid, since, phase, guest_ram"

    @staticmethod
    def _hold(r: Row) -> HoldRecord:
        fields = {
            "fdid": r[0],
            "holder": {"node": r[1], "vm": r[2], "vm_uuid": r[3]},
            "since": r[4],
            "phase": r[5],
            "guest_ram": r[6],
            "token": r[7],
        }
        return decoded("hold", _key(r[0]), HoldRecord, fields)

    def holds(self) -> dict[int, HoldRecord]:
        rows = self._c.execute(f"SELECT {self._hold_cols} FROM holds").fetchall()
        return {r[0]: self._hold(r) for r in rows}

    def holds_of(self, holder: Holder) -> dict[int, HoldRecord]:
        """The holds of ``holder``'s VM (``same_holder``)."""
        rows = self._c.execute(
            f"SELECT {self._hold_cols} FROM holds WHERE node = ?", (holder.node,)
        ).fetchall()
        holds = (self._hold(r) for r in rows)
        return {h.fdid: h for h in holds if same_holder(h.holder, holder)}

    def hold(self, fdid: int) -> HoldRecord | None:
        r = self._c.execute(
            f"SELECT {self._hold_cols} FROM holds WHERE fdid = ?", (fdid,)
        ).fetchone()
        return None if r is None else self._hold(r)

    def add_hold(self, hold: HoldRecord, claims: Iterable[Claim]) -> None:
        self._write()
        h = hold.holder
        row = (hold.fdid, h.node, h.vm, h.vm_uuid, hold.since, hold.phase.value, hold.guest_ram)
        if self._has_token:
            # every new hold gets the next fencing token of this state (the write lock is held)
            token = int(self.meta("hold_token") or 0) + 1
            self.set_meta("hold_token", str(token))
            self._c.execute(
                f"INSERT INTO holds ({self._HOLD_COLS}, token) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (*row, token),
            )
        else:
            self._c.execute(
                f"INSERT INTO holds ({self._HOLD_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?)", row
            )
        self._c.executemany(
            "INSERT INTO claims (fdid, adapter, kind, share, entries, segments, bytes)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            [
                (hold.fdid, c.adapter, c.kind.value, c.share, c.entries, c.segments, c.bytes)
                for c in claims
            ],
        )

    def set_phase(self, fdid: int, phase: Phase) -> None:
        self._write()
        self._c.execute("UPDATE holds SET phase = ? WHERE fdid = ?", (phase.value, fdid))

    def delete_hold(self, fdid: int) -> None:
        """Drop the hold and (by cascade) its claims."""
        self._write()
        self._c.execute("DELETE FROM holds WHERE fdid = ?", (fdid,))

    def replace_claims(
        self, kind: ClaimKind, owners: Iterable[int], claims: Iterable[tuple[int, Claim]]
    ) -> None:
        """Replace the claims of ``kind`` held by the holds of ``owners`` with ``claims``
        (each ``(owner fdid, claim)``; the owner must have a hold)."""
        self._write()
        self._c.executemany(
            "DELETE FROM claims WHERE fdid = ? AND kind = ?",
            [(fdid, kind.value) for fdid in owners],
        )
        self._c.executemany(
            "INSERT INTO claims (fdid, adapter, kind, share, entries, segments, bytes)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            [
                (fdid, c.adapter, c.kind.value, c.share, c.entries, c.segments, c.bytes)
                for fdid, c in claims
            ],
        )

    def claims(self) -> list[tuple[int, Claim]]:
        rows = self._c.execute(f"SELECT {keptclaims.COLUMNS} FROM claims").fetchall()
        return self._claims_of(rows)

    def set_aside(self) -> list[tuple[int, Claim]]:
        return []  # a single-host state sets nothing aside

    def _claims_of(self, rows: list[Row]) -> list[tuple[int, Claim]]:
        """Each row's ``(fdid, claim)``, decoded once per open state."""
        seen, pair = self._claims_seen, self._claim_pair
        return [seen(r, pair) for r in rows]

    @classmethod
    def _claim_pair(cls, r: Row) -> tuple[int, Claim]:
        return r[0], cls._decode_claim(r)

    def claim_pair(self, r: Row) -> tuple[int, Claim]:
        """One claim row decoded, or as decoded before (``_claims_of`` of one row)."""
        return self._claims_seen(r, self._claim_pair)

    @staticmethod
    def _decode_claim(r: Row) -> Claim:
        fields = dict(
            zip(("adapter", "kind", "share", "entries", "segments", "bytes"), r[1:], strict=True)
        )
        return decoded("claim", f"{_key(r[0])} on {r[1]!r}", Claim, fields)

    # One host's state has no leases, so a hold never vanishes behind its holder's back and
    # nothing is ever fenced.
    def fence(self, fdid: int) -> FenceRecord | None:
        return None

    def fences(self) -> list[FenceRecord]:
        return []

    def clear_fence(self, fdid: int) -> bool:
        self._write()
        return False

    def claims_on(self, adapters: Iterable[str]) -> list[tuple[int, Claim]]:
        """The claims on the given adapters only (what one reservation's admission reads):
        those kept since an earlier transaction (``keptclaims``) and the rest read."""
        refs = list(dict.fromkeys(adapters))
        kept = self._kept
        if kept is None or not kept.usable or kept.changed(self._c):
            return self._claims_of(self._claim_rows(refs))
        out, missing = kept.lookup(refs)
        if missing:
            read = self._claims_of(self._claim_rows(missing))
            kept.store(missing, read)
            out += read
        return out

    def _claim_rows(self, refs: list[str]) -> list[Row]:
        return self._c.execute(
            f"SELECT {keptclaims.COLUMNS} FROM claims"
            f" WHERE adapter IN ({', '.join('?' * len(refs))})",
            refs,
        ).fetchall()

    # --- mdevs -----------------------------------------------------------------------------
    def parent(self, node: str, fdid: int) -> ParentRecord | None:
        r = self._c.execute(
            "SELECT node, fdid, name FROM mdev_parents WHERE node = ? AND fdid = ?",
            (node, fdid),
        ).fetchone()
        return None if r is None else self._parent(r)

    @staticmethod
    def _parent(r: Row) -> ParentRecord:
        fields = {"node": r[0], "fdid": r[1], "name": r[2]}
        return decoded("mdev parent", f"{r[0]!r}/{_key(r[1])}", ParentRecord, fields)

    def add_parent(self, rec: ParentRecord) -> None:
        self._write()
        self._c.execute(
            "INSERT OR IGNORE INTO mdev_parents (node, fdid, name) VALUES (?, ?, ?)",
            (rec.node, rec.fdid, rec.name),
        )

    def delete_parent(self, node: str, fdid: int) -> bool:
        self._write()
        cur = self._c.execute("DELETE FROM mdev_parents WHERE node = ? AND fdid = ?", (node, fdid))
        return cur.rowcount > 0

    _MDEV_COLS = "uuid, fdid, node, parent, type_id, vm, created"

    def mdevs(self, node: str | None = None) -> list[MdevRecord]:
        if node is None:
            rows = self._c.execute(f"SELECT {self._MDEV_COLS} FROM mdevs ORDER BY created")
        else:
            rows = self._c.execute(
                f"SELECT {self._MDEV_COLS} FROM mdevs WHERE node = ? ORDER BY created", (node,)
            )
        return [self._mdev(r) for r in rows.fetchall()]

    def mdev(self, uuid: str) -> MdevRecord | None:
        r = self._c.execute(
            f"SELECT {self._MDEV_COLS} FROM mdevs WHERE uuid = ?", (uuid,)
        ).fetchone()
        return None if r is None else self._mdev(r)

    _MDEV_FIELDS = ("uuid", "fdid", "node", "parent", "type_id", "vm", "created")

    @classmethod
    def _mdev(cls, r: Row) -> MdevRecord:
        return decoded("mdev", _key(r[0]), MdevRecord, dict(zip(cls._MDEV_FIELDS, r, strict=True)))

    def add_mdev(self, rec: MdevRecord) -> None:
        self._write()
        self._c.execute(
            f"INSERT INTO mdevs ({self._MDEV_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
            (rec.uuid, rec.fdid, rec.node, rec.parent, rec.type_id, rec.vm, rec.created),
        )

    def delete_mdev(self, uuid: str) -> bool:
        self._write()
        return self._c.execute("DELETE FROM mdevs WHERE uuid = ?", (uuid,)).rowcount > 0

    # --- runtime records (windows, vectors, P2P maps of held devices) --------------------
    def put_runtime(self, fdid: int, kind: str, key: str, data: dict[str, Any]) -> None:
        """Record (or replace) one runtime record of a held device."""
        import json  # runtime records only: reading devices and holds never loads it

        self._write()
        try:
            self._c.execute(
                "INSERT INTO runtime (fdid, kind, key, data) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (fdid, kind, key) DO UPDATE SET data = excluded.data",
                (fdid, kind, key, json.dumps(data, sort_keys=True)),
            )
        except sqlite3.IntegrityError:
            raise StateError(
                f"device {fdid:#x} is not held; runtime state can only be recorded for a held"
                " device"
            ) from None

    def runtime(self, fdid: int | None = None, kind: str | None = None) -> list[RuntimeRecord]:
        sql = "SELECT fdid, kind, key, data FROM runtime WHERE 1 = 1"
        args: list[object] = []
        if fdid is not None:
            sql += " AND fdid = ?"
            args.append(fdid)
        if kind is not None:
            sql += " AND kind = ?"
            args.append(kind)
        rows = self._c.execute(sql + " ORDER BY fdid, kind, key", args).fetchall()
        if not rows:
            return []
        import json

        records = []
        for f, k, key, d in rows:
            where = f"{_key(f)}/{k}/{key}"
            try:
                data = json.loads(d) if isinstance(d, str | bytes) else d
            except ValueError:  # JSONDecodeError, UnicodeDecodeError
                raise StateRecordError("runtime", where, "its data is not JSON") from None
            except RecursionError:
                raise StateRecordError("runtime", where, _TOO_DEEP) from None
            fields = {"fdid": f, "kind": k, "key": key, "data": data}
            records.append(decoded("runtime", where, RuntimeRecord, fields))
        return records

    def clear_runtime(self, fdid: int, kind: str | None = None, key: str | None = None) -> int:
        self._write()
        sql = "DELETE FROM runtime WHERE fdid = ?"
        args: list[int | str] = [fdid]
        if kind is not None:
            sql += " AND kind = ?"
            args.append(kind)
        if key is not None:
            sql += " AND key = ?"
            args.append(key)
        return self._c.execute(sql, args).rowcount
