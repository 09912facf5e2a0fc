"""The state database file: create it atomically, open and vet it, run transactions.

A state file is ours only if it is SQLite, carries our ``application_id``, passes
``PRAGMA quick_check`` of the tables walked at every open (``WALKED_AT_OPEN``: all but the
three whose size is the fabric's, checked page by page where they are read) and has a ``meta``
table with a schema version we understand. Anything else is refused with a ``StateError`` that
says what the file is and what to do; it is never written to. Writers take the database lock
up front (``BEGIN IMMEDIATE``), so of two processes racing for one device exactly one sees it
free.

A sound file the host will not let us use (read-only mount, full disk, permissions, another
process's lock) is a ``StateHostError`` naming that condition (``conditions.py``), never the
"move it away" advice. When the file can be read but not written, it is opened read-only, so
commands that only read work; the first write raises the condition.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from vmlend.errors import StateError, StateHostError, StateLockedError, StatePermissionError
from vmlend.registry import topopieces
from vmlend.registry.conditions import (
    Condition,
    FsFacts,
    classify,
    classify_errno,
    host_error,
    probe,
)
from vmlend.registry.decoded import Decoded
from vmlend.registry.keptclaims import KeptClaims, Staged
from vmlend.registry.records import Claim
from vmlend.registry.schema import (
    APPLICATION_ID,
    COMPILED_SINCE,
    GENERATION_2_SINCE,
    HEAD_SINCE,
    MIGRATIONS,
    SCHEMA_V1,
    SCHEMA_VERSION,
    TABLES,
    TOKEN_SINCE,
)
from vmlend.registry.topocache import TopologyCache, copy_beside
from vmlend.registry.txn import SqliteTxn

log = logging.getLogger(__name__)
#: How long a lock wait stays quiet before it says so.
_QUIET_WAIT = 1.0

T = TypeVar("T")


def _is_busy(e: sqlite3.Error) -> bool:
    return "locked" in str(e) or "busy" in str(e)


#: ``classify`` needs no file-system facts to tell a damaged file.
_NO_FACTS = FsFacts(read_only_fs=False, readable=True, writable=True, space_left=True)

#: How long a process waits for another one's write transaction before giving up. Writers hold
#: the lock for milliseconds; a hook waiting this long means something is stuck.
DEFAULT_BUSY_TIMEOUT = 10.0

_HINT = (
    "vmlend will not overwrite it: move it away and run 'vmlend fabric init',"
    " or point --state / VMLEND_STATE at another path"
)


def _refuse(path: Path, what: str) -> StateError:
    return StateError(f"{path} {what}; {_HINT}")


def _host_error(e: sqlite3.Error, path: Path, busy_timeout: float) -> StateHostError | None:
    """The host condition behind ``e``, if that is what it is."""
    condition = classify(getattr(e, "sqlite_errorname", None) or "", probe(path))
    return host_error(condition, path, busy_timeout) if condition else None


def _damaged(e: sqlite3.Error) -> bool:
    return classify(getattr(e, "sqlite_errorname", None) or "", _NO_FACTS) is Condition.DAMAGED


def _open_read_only(path: Path, busy_timeout: float, reason: StateHostError) -> sqlite3.Connection:
    """A read-only connection to a state that cannot be written; ``reason`` when there is none.

    ``mode=ro`` still needs the ``-shm`` file, which a read-only directory cannot get; then the
    file is opened ``immutable``, which reads the database file alone and so only when no
    ``-wal`` file holds changes not yet written back to it."""
    queries = ["mode=ro"]
    wal = Path(f"{path}-wal")
    with contextlib.suppress(OSError):
        if not wal.exists() or wal.stat().st_size == 0:
            queries.append("mode=ro&immutable=1")
    for query in queries:
        try:
            conn = _connect(path, busy_timeout, create=False, query=query)
        except sqlite3.Error:
            continue
        try:
            _vet_database(conn, path, busy_timeout)
        except StateError:
            conn.close()
            continue
        log.info("state %s opened read-only (%s): %s", path, query, reason)
        return conn
    raise reason


def _connect(
    path: Path, busy_timeout: float, *, create: bool, query: str = ""
) -> sqlite3.Connection:
    # mode=rw: opening must never create a file that vanished after our checks.
    uri = f"{path.resolve().as_uri()}?{query or ('mode=rwc' if create else 'mode=rw')}"
    conn = sqlite3.connect(uri, uri=True, timeout=busy_timeout, isolation_level=None)
    conn.execute("PRAGMA foreign_keys = ON")
    # each b-tree page's cells checked as the page is read: the tables not walked at open
    # (``WALKED_AT_OPEN``) are checked page by page where they are read
    conn.execute("PRAGMA cell_size_check = ON")
    conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
    return conn


class SqliteRegistry:
    """An open state database. Use ``read()`` / ``transact()`` (or ``write()``) for
    transactions. The SQLite backend of ``vmlend.registry.api.Registry``."""

    #: One host's state file may name the host's node (``topology.local_node``).
    shares_host_identity = True

    def __init__(
        self,
        conn: sqlite3.Connection,
        path: Path,
        busy_timeout: float,
        read_only: StateHostError | None = None,
    ) -> None:
        self._conn = conn
        self.path = path
        self.busy_timeout = busy_timeout
        #: Why this state was opened read-only (raised by ``write()``); None when writable.
        self.read_only = read_only
        #: Whether the topology table has the compiled column (``_migrate``).
        self._has_compiled = True
        self._has_token = True
        #: Whether the topology table has the head (and the pieces table): schema 6.
        self._has_head = True
        #: The generations read, by their head (which names their sha256): a process reads
        #: and verifies one generation once, not in every transaction (``SqliteTxn``).
        self._generations: dict[str, topopieces.StoredView] = {}
        #: Claims decoded from their rows, by row (``SqliteTxn._claims_of``).
        self._claims_seen: Decoded[tuple[object, ...], tuple[int, Claim]] = Decoded()
        #: The claims per adapter between transactions (``keptclaims``; made usable by
        #: ``open``, once the schema is current).
        self._kept = KeptClaims()
        #: This host's copy of the topology (``topocache``: mapped, verified as it is read),
        #: beside the state; set by ``open`` (a state being created has none yet).
        self._copy: TopologyCache | None = None
        self._where = str(Path(path).absolute())

    # --- opening -----------------------------------------------------------------------
    @classmethod
    def open(
        cls, path: str | Path, *, busy_timeout: float = DEFAULT_BUSY_TIMEOUT
    ) -> SqliteRegistry:
        """Open an existing state file; ``StateError`` if it is missing, corrupt or foreign,
        ``StateHostError`` if the host will not let it be read. A state that can be read but
        not written opens read-only."""
        path = Path(path)
        _vet_file(path)
        read_only: StateHostError | None = None
        try:
            conn = _connect(path, busy_timeout, create=False)
        except sqlite3.Error as e:
            raise _host_error(e, path, busy_timeout) or StateError(
                f"cannot open the vmlend state {path}: {e}"
            ) from None
        try:
            _vet_database(conn, path, busy_timeout)
        except StateHostError as e:
            conn.close()
            unreadable = isinstance(e, StatePermissionError) and e.access == "read"
            if unreadable or isinstance(e, StateLockedError):
                raise
            conn = _open_read_only(path, busy_timeout, e)
            read_only = e
        except BaseException:
            conn.close()
            raise
        try:
            reg = cls(conn, path, busy_timeout, read_only)
            # the topology read from a copy beside the state, mapped, a chunk at a time as it
            # is used, not from every piece in every process (6.6 MB at 1,024 nodes)
            reg._copy = copy_beside(path)
            reg._migrate()
            _vet_tables(conn, path, reg._has_head)
            reg._kept.attach(conn)
        except BaseException:
            conn.close()
            raise
        return reg

    @classmethod
    def create(
        cls,
        path: str | Path,
        init: Callable[[SqliteTxn], None],
        *,
        busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
    ) -> SqliteRegistry:
        """Create a new state file filled by ``init``; ``FileExistsError`` if one exists.

        The file is built under a temporary name and hard-linked into place, so other processes
        see either no file or a complete one, and an existing file is never replaced.
        """
        path = Path(path)
        import secrets  # creation only: every other open (the hook's) skips random and hmac

        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            conn = _connect(tmp, busy_timeout, create=True)
            try:
                conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                conn.execute("PRAGMA journal_mode = WAL")
                conn.executescript(SCHEMA_V1)
                for version in range(1, SCHEMA_VERSION):
                    for statement in MIGRATIONS[version]:
                        conn.execute(statement)
                reg = cls(conn, tmp, busy_timeout)
                reg._has_head = SCHEMA_VERSION >= HEAD_SINCE  # (tests create older states)
                with reg.write() as tx:
                    tx.set_meta("schema_version", str(SCHEMA_VERSION))
                    init(tx)
            finally:
                conn.close()  # checkpoints the WAL into the file before it is linked
            os.link(tmp, path)
            log.debug("created state %s", path)
        except sqlite3.Error as e:
            raise _host_error(e, tmp, busy_timeout) or StateError(
                f"cannot create the vmlend state {path}: {e}"
            ) from None
        except FileExistsError:
            raise
        except OSError as e:
            condition = classify_errno(e.errno or 0)
            err = host_error(condition, path, busy_timeout) if condition else None
            if err is not None:
                raise err from None
            raise StateError(
                f"cannot create the vmlend state {path}: {e.strerror};"
                " choose a writable place with --state / VMLEND_STATE"
            ) from None
        finally:
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(OSError):
                    os.unlink(f"{tmp}{suffix}")
        return cls.open(path, busy_timeout=busy_timeout)

    @property
    def where(self) -> str:
        return str(self.path)

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> SqliteRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- transactions --------------------------------------------------------------------
    @contextlib.contextmanager
    def read(self) -> Iterator[SqliteTxn]:
        """A consistent snapshot for reading."""
        with self._txn("BEGIN", writable=False) as tx:
            yield tx

    @contextlib.contextmanager
    def write(self) -> Iterator[SqliteTxn]:
        """An exclusive write transaction: taken before the first read, so decisions made on
        what it reads hold until it commits."""
        if self.read_only is not None:
            raise self.read_only
        with self._txn("BEGIN IMMEDIATE", writable=True) as tx:
            yield tx

    def _begin(self, begin: str) -> None:
        """``begin``, waiting up to the busy timeout for another process's lock; a wait longer
        than a second is announced once (a wait is never silent)."""
        quiet = min(_QUIET_WAIT, self.busy_timeout)
        try:
            self._set_busy(quiet)
            try:
                self._conn.execute(begin)
                return
            except sqlite3.OperationalError as e:
                if not _is_busy(e) or quiet >= self.busy_timeout:
                    raise
            log.warning(
                "waiting up to %g s for the vmlend state %s, locked by another process",
                self.busy_timeout - quiet,
                self.path,
            )
            self._set_busy(self.busy_timeout - quiet)
            self._conn.execute(begin)
        finally:
            self._set_busy(self.busy_timeout)

    def _set_busy(self, seconds: float) -> None:
        self._conn.execute(f"PRAGMA busy_timeout = {int(seconds * 1000)}")

    def transact(self, body: Callable[[SqliteTxn], T]) -> T:
        """Run ``body`` in one write transaction (once: the lock is taken before it reads)."""
        with self.write() as tx:
            return body(tx)

    @contextlib.contextmanager
    def _txn(self, begin: str, writable: bool) -> Iterator[SqliteTxn]:
        try:
            self._begin(begin)
        except sqlite3.OperationalError as e:
            raise self._sqlite_error(e) from None
        staged: Staged = {}
        try:
            self._kept.begin(self._conn)  # before the transaction's first read
            tx = SqliteTxn(
                self._conn,
                writable,
                self._has_compiled,
                self._has_token,
                self._has_head,
                self._generations,
                self._copy,
                self._where,
                self._claims_seen,
                self._kept,
            )
            yield tx
            if writable and self._kept.usable:
                staged = self._kept.staged(self._conn, tx.claim_pair)
        except sqlite3.Error as e:
            self._conn.rollback()
            raise self._sqlite_error(e) from None
        except BaseException:
            self._conn.rollback()
            raise
        try:
            self._conn.execute("COMMIT")
        except sqlite3.Error as e:
            self._conn.rollback()
            self._kept.forget()
            raise self._sqlite_error(e) from None
        self._kept.install(staged)

    def _sqlite_error(self, e: sqlite3.Error) -> StateError:
        if _damaged(e):
            return _refuse(self.path, f"is a corrupt database ({e})")
        found = _host_error(e, self.path, self.busy_timeout)
        return found or StateError(f"the vmlend state {self.path} failed: {e}")

    def _migrate(self) -> None:
        with self.read() as tx:
            version = _schema_version(tx, self.path)
        if version == SCHEMA_VERSION:
            self._has_token = version >= TOKEN_SINCE  # False only as an older vmlend
            self._has_head = version >= HEAD_SINCE
            return
        if version >= COMPILED_SINCE - 1 and self.read_only is not None:
            # Versions 3 to 6 only add the compiled topology (a cache of the text), hold
            # tokens (0 when not known) and the topology's generations (none in an older
            # state): a state this process may not write is read as it is (its topology
            # parsed, its tokens 0), not refused.
            self._has_compiled = version >= COMPILED_SINCE
            self._has_token = version >= TOKEN_SINCE
            self._has_head = version >= HEAD_SINCE
            return
        with self.write() as tx:
            version = _schema_version(tx, self.path)  # another process may have migrated
            while version < SCHEMA_VERSION:
                log.info("migrating state %s from schema %d", self.path, version)
                for statement in MIGRATIONS[version]:
                    self._conn.execute(statement)
                version += 1
                if version == GENERATION_2_SINCE:
                    tx.rewrite_topology_generation()
                tx.set_meta("schema_version", str(version))


def _schema_version(tx: SqliteTxn, path: Path) -> int:
    raw = tx.meta("schema_version")
    try:
        version = int(raw or "")
    except ValueError:
        raise StateError(
            f"the vmlend state {path} is corrupt (bad schema version {raw!r}); {_HINT}"
        ) from None
    if version > SCHEMA_VERSION:
        raise StateError(
            f"the vmlend state {path} has schema version {version}, newer than this vmlend"
            f" understands ({SCHEMA_VERSION}); upgrade vmlend"
        )
    if version < 1 or (version < SCHEMA_VERSION and version not in MIGRATIONS):
        raise StateError(f"the vmlend state {path} has unknown schema version {version}; {_HINT}")
    return version


def _vet_file(path: Path) -> None:
    """Refuse what is plainly not a state file before SQLite touches it.

    Only ``stat``, never ``open``: closing any descriptor of a file drops every POSIX lock this
    process holds on it, including those of an SQLite connection already open here, and another
    process could then checkpoint the WAL under that connection's feet. The content is judged
    by SQLite itself in ``_vet_database``.
    """
    try:
        st = path.stat()
    except FileNotFoundError:
        raise StateError(
            f"no vmlend state at {path}; run 'vmlend fabric init' first"
            " (or point --state / VMLEND_STATE at an existing one)"
        ) from None
    except PermissionError:
        raise StatePermissionError(str(path), "read") from None
    except OSError as e:
        raise StateError(f"cannot read the vmlend state {path}: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "is a directory, not a vmlend state file")
    if st.st_size == 0:
        raise _refuse(path, "is empty, so it is not a vmlend state file")


#: The tables ``PRAGMA quick_check`` walks at every open: the schema and every table whose
#: size is not the fabric's. The three that grow with it (a row per node, per device, the
#: topology's pieces: 7 MB at 1,024 nodes, ~5 ms a walk in every CLI command and hook call)
#: are left to what reads them: SQLite checks each b-tree page it reads (``cell_size_check``
#: on: a page it cannot read is SQLITE_CORRUPT, the same one-line refusal), every row passes
#: the typed decode layer (``txn.decoded``) and the pieces are verified against their head's
#: sha256 (``topopieces.join``). Given up: a check of a named table skips the free list and
#: pages lost or used twice, which a full ``quick_check`` finds.
WALKED_AT_OPEN = frozenset(
    {"sqlite_schema", "meta", "topology", "holds", "claims", "mdev_parents", "mdevs", "runtime"}
)


def _vet_database(conn: sqlite3.Connection, path: Path, busy_timeout: float) -> None:
    """The file is SQLite: check that it is ours and intact (``WALKED_AT_OPEN``)."""
    try:
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        tables = {
            r[0]
            for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
            )
        }
    except sqlite3.DatabaseError as e:
        if "not a database" in str(e):  # SQLite's word for a file without its header
            raise _refuse(
                path, "is not an SQLite database, so it is not a vmlend state file"
            ) from None
        if _damaged(e):
            raise _refuse(path, f"is a corrupt database ({e})") from None
        raise _host_error(e, path, busy_timeout) or StateError(
            f"cannot open the vmlend state {path}: {e}; check the disk (the kernel log)"
        ) from None
    if app_id != APPLICATION_ID:
        if app_id:
            raise _refuse(
                path,
                f"is an SQLite database of another application (application_id {app_id:#x}),"
                " not vmlend state",
            )
        if tables:
            listed = ", ".join(sorted(tables)[:5])
            raise _refuse(path, f"is an SQLite database of another application (tables: {listed})")
        raise _refuse(path, "is an empty SQLite database that vmlend did not create")
    problems: list[str] = []
    for table in sorted(WALKED_AT_OPEN & (tables | {"sqlite_schema"})):
        try:
            problems += [r[0] for r in conn.execute(f"PRAGMA quick_check({table})")]  # ours
        except sqlite3.DatabaseError as e:
            problems.append(str(e))
    problems = [p for p in problems if p != "ok"]
    if problems:
        raise _refuse(path, f"is corrupt (SQLite quick_check: {'; '.join(problems[:5])})")
    if "meta" not in tables or not tables <= TABLES:
        raise _refuse(path, "carries vmlend's mark but not its tables (corrupt or tampered with)")
    log.debug("state %s vetted (tables %s)", path, ", ".join(sorted(tables)))


def _vet_tables(conn: sqlite3.Connection, path: Path, has_head: bool = True) -> None:
    """After migration every table of the current schema must be there (a read-only state
    of before version 6 has no pieces)."""
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    wanted = TABLES if has_head else TABLES - {"topology_pieces"}
    missing = sorted(wanted - tables)
    if missing:
        raise _refuse(path, f"lacks vmlend tables ({', '.join(missing)}): it is damaged")
