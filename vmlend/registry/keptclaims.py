"""The claims on each adapter, kept between the transactions of one SQLite connection.

A reserve reads the claims on its path's adapters and ports: about 45 rows on an empty fabric,
141 on a full one. Fetched row by row (about 1 us each), they made a reserve on a full fabric
cost 1.3x one on an empty fabric, at 64 nodes as at 1,024 (issue 38, point 3). Kept here per
adapter, as the committed state this connection last saw, they are used again while that is
still what the state file holds:

- another connection's commit (another process, or another registry in this one) changes
  ``PRAGMA data_version``, read first in every transaction: everything kept is forgotten;
- this connection's own changes to ``claims`` are logged by TEMP triggers, cascades from a
  deleted hold and rows INSERT OR REPLACE deletes included: before the commit the adapters
  the log touches are forgotten, after it an inserted row's adapter is kept again with it (an
  adapter a row was deleted from or changed on is not); a transaction that rolls back rolls
  its log back with it;
- inside a transaction that has changed claims already nothing kept is used (its own
  uncommitted rows must be seen) and nothing read is kept.

TEMP objects live in the connection, not in the state file: no schema change, nothing another
vmlend sees. A connection that cannot make them keeps nothing.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from vmlend.errors import StateRecordError
from vmlend.registry.records import Claim

Row = tuple[Any, ...]
Pair = tuple[int, Claim]  # (fdid, claim): what ``SqliteTxn._claims_of`` makes of a row
#: What ``KeptClaims.staged`` returns: each adapter's claims once its transaction committed.
Staged = dict[str, tuple[Pair, ...]]

#: The columns of a claim row, in ``SqliteTxn.claims_on``'s order.
COLUMNS = "fdid, adapter, kind, share, entries, segments, bytes"

_LOG = "vmlend_claims_log"
#: Unqualified names in a TEMP trigger resolve to the temp schema first.
_SETUP = (
    f"CREATE TEMP TABLE IF NOT EXISTS {_LOG} (op TEXT NOT NULL, {COLUMNS})",
    f"CREATE TEMP TRIGGER IF NOT EXISTS {_LOG}_insert AFTER INSERT ON main.claims BEGIN"
    f" INSERT INTO {_LOG} VALUES ('+', NEW.fdid, NEW.adapter, NEW.kind, NEW.share,"
    " NEW.entries, NEW.segments, NEW.bytes); END",
    f"CREATE TEMP TRIGGER IF NOT EXISTS {_LOG}_delete AFTER DELETE ON main.claims BEGIN"
    f" INSERT INTO {_LOG} (op, adapter) VALUES ('-', OLD.adapter); END",
    f"CREATE TEMP TRIGGER IF NOT EXISTS {_LOG}_update AFTER UPDATE ON main.claims BEGIN"
    f" INSERT INTO {_LOG} (op, adapter) VALUES ('-', OLD.adapter);"
    f" INSERT INTO {_LOG} (op, adapter) VALUES ('-', NEW.adapter); END",
)

#: The triggers the log needs, by name: a table rebuilt on this connection (``DROP TABLE``,
#: a migration) drops them silently, and each transaction checks they are all still there.
_TRIGGERS = tuple(f"{_LOG}_{op}" for op in ("insert", "delete", "update"))
#: The data version and whether every trigger is there, in one statement (``begin``).
_BEGIN = (
    "SELECT (SELECT data_version FROM pragma_data_version()),"
    " (SELECT count(*) FROM temp.sqlite_master WHERE type = 'trigger' AND name IN (?, ?, ?))"
)

#: Adapters kept at most (all forgotten past that): a full 1,024-node fabric has about 2,000
#: adapters and switch ports; a host's own reserves use a few.
LIMIT = 4096


class KeptClaims:
    """One connection's claims per adapter (``begin``, ``changed``, ``lookup``/``store``,
    ``staged``/``install``). Not shared between connections: each has its own log and data
    version."""

    __slots__ = ("_on", "_version", "usable")

    def __init__(self) -> None:
        self._on: dict[str, tuple[Pair, ...]] = {}
        self._version: int | None = None
        #: False until ``attach`` made the log (and after it failed): nothing is kept.
        self.usable = False

    def attach(self, conn: sqlite3.Connection) -> None:
        """Make the log of ``conn``'s own changes to claims (outside any transaction, after
        every migration of the schema)."""
        try:
            # a row that INSERT OR REPLACE deletes fires the delete trigger only so
            conn.execute("PRAGMA recursive_triggers = ON")
            for statement in _SETUP:
                conn.execute(statement)
        except sqlite3.Error:
            self.usable = False  # e.g. no room for temp objects: read every time, as before
            for name in _TRIGGERS:  # none left half made, logging for nobody
                with contextlib.suppress(sqlite3.Error):
                    conn.execute(f"DROP TRIGGER IF EXISTS temp.{name}")
            return
        self.usable = True

    def begin(self, conn: sqlite3.Connection) -> None:
        """At the start of a transaction, as its first read (which opens its snapshot, so the
        version read is the snapshot's): forget everything if another connection committed
        since the last one. A connection whose triggers are gone keeps nothing from then on."""
        if not self.usable:
            return
        version, triggers = conn.execute(_BEGIN, _TRIGGERS).fetchone()
        if triggers != len(_TRIGGERS):
            self.usable = False
            self._on.clear()
        elif version != self._version:
            self._on.clear()
            self._version = version

    def changed(self, conn: sqlite3.Connection) -> bool:
        """Whether this connection has changed claims in the open transaction."""
        return bool(conn.execute(f"SELECT EXISTS (SELECT 1 FROM {_LOG})").fetchone()[0])

    def lookup(self, refs: Iterable[str]) -> tuple[list[Pair], list[str]]:
        """The kept claims on ``refs``, and the refs not kept."""
        out: list[Pair] = []
        missing: list[str] = []
        for ref in refs:
            kept = self._on.get(ref)
            if kept is None:
                missing.append(ref)
            else:
                out.extend(kept)
        return out, missing

    def store(self, refs: Sequence[str], pairs: Iterable[Pair]) -> None:
        """Keep the claims just read on ``refs`` (every one of them: a ref with none keeps an
        empty list). Only from a transaction that has changed no claim."""
        on: dict[str, list[Pair]] = {ref: [] for ref in refs}
        for pair in pairs:
            on[pair[1].adapter].append(pair)
        if len(self._on) + len(on) > LIMIT:
            self._on.clear()
        self._on.update((ref, tuple(items)) for ref, items in on.items())

    def staged(self, conn: sqlite3.Connection, decode: Callable[[Row], Pair]) -> Staged:
        """Before the transaction commits: take its changes to claims off the log (a rollback
        puts them back), forget every adapter they touch, and return what those adapters
        hold once it has committed (an inserted claim joins the ones kept; an adapter a claim
        left or changed on is not kept). ``install`` it after the commit: an interruption
        between leaves the adapters forgotten, never kept without the commit's claims."""
        rows = conn.execute(f"SELECT op, {COLUMNS} FROM {_LOG}").fetchall()
        if not rows:
            return {}
        conn.execute(f"DELETE FROM {_LOG}")
        after: dict[str, tuple[Pair, ...] | None] = {}
        for op, *row in rows:
            adapter = row[1]
            if adapter not in after:
                after[adapter] = self._on.pop(adapter, None)
            kept = after[adapter]
            if op != "+" or kept is None:
                after[adapter] = None
                continue
            try:
                after[adapter] = (*kept, decode(tuple(row)))
            except StateRecordError:  # a row it wrote and cannot read: read it again
                after[adapter] = None
        return {adapter: kept for adapter, kept in after.items() if kept is not None}

    def install(self, staged: Staged) -> None:
        """Keep what ``staged`` returned, once its transaction committed."""
        self._on.update(staged)

    def forget(self) -> None:
        self._on.clear()
