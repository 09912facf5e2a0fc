"""The state database file: create, open, and refusal of missing, corrupt and foreign files."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.support.cli_cluster import one_line
from tests.support.daemon_marks import REGISTRIES
from tests.support.older_state import older_state_with_a_hold, older_vmlend, stored_rows
from tests.support.simfabric import fabric_topology
from tests.support.sqlite_pages import overflow_pages_of, pages_of, smash
from vmlend.cli import main
from vmlend.errors import StateError
from vmlend.registry import SqliteRegistry, TopologyRecord, create_registry, open_registry
from vmlend.registry import schema as schema_mod
from vmlend.registry import store as store_mod
from vmlend.wiring.fabric import default_topology_text, init_fabric


def _fill(tx):
    tx.replace_topology(TopologyRecord("t", "src", "text", "d", "gamma", 0.0), ["gamma"], [])


@pytest.fixture(params=REGISTRIES)
def location(request, tmp_path):
    """A new shared state of either backend: an SQLite path or an etcd cluster URL."""
    if request.param == "etcd":
        return request.getfixturevalue("etcd_url")
    return tmp_path / "s.db"


@pytest.fixture
def made(tmp_path):
    path = tmp_path / "state.db"
    SqliteRegistry.create(path, _fill).close()
    return path


def test_create_marks_the_file_as_ours_in_wal_mode(made):
    conn = sqlite3.connect(made)
    try:
        assert conn.execute("PRAGMA application_id").fetchone()[0] == schema_mod.APPLICATION_ID
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        version = conn.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        assert version == (str(schema_mod.SCHEMA_VERSION),)
    finally:
        conn.close()
    with SqliteRegistry.open(made) as reg, reg.read() as tx:
        assert tx.topology().local_node == "gamma"


def test_create_never_replaces_an_existing_file(made):
    before = made.read_bytes()
    with pytest.raises(FileExistsError):
        SqliteRegistry.create(made, _fill)
    assert made.read_bytes() == before
    assert sorted(p.name for p in made.parent.iterdir()) == ["state.db"]  # no temp files left


def test_missing_file_says_to_run_init(tmp_path):
    with pytest.raises(StateError, match=r"no vmlend state at .*run 'vmlend fabric init' first"):
        SqliteRegistry.open(tmp_path / "nope.db")
    assert not (tmp_path / "nope.db").exists()


def test_directory_is_refused(tmp_path):
    with pytest.raises(StateError, match="is a directory"):
        SqliteRegistry.open(tmp_path)


@pytest.mark.parametrize(
    ("content", "what"),
    [
        (bytes(range(256)) * 64, "is not an SQLite database"),
        (b"", "is empty"),
        (b"SQLite format", "is not an SQLite database"),
    ],
)
def test_garbage_is_refused_and_left_alone(tmp_path, content, what):
    path = tmp_path / "state.db"
    path.write_bytes(content)
    with pytest.raises(StateError, match=what) as e:
        SqliteRegistry.open(path)
    assert "will not overwrite" in str(e.value)
    assert path.read_bytes() == content


def _foreign(path, app_id=0):
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE recipes (name TEXT)")
    conn.execute("INSERT INTO recipes VALUES ('soup')")
    if app_id:
        conn.execute(f"PRAGMA application_id = {app_id}")
    conn.commit()
    conn.close()


def test_foreign_sqlite_database_is_refused(tmp_path):
    path = tmp_path / "state.db"
    _foreign(path)
    before = path.read_bytes()
    with pytest.raises(StateError, match=r"another application \(tables: recipes\)"):
        SqliteRegistry.open(path)
    assert path.read_bytes() == before


def test_foreign_application_id_is_refused(tmp_path):
    path = tmp_path / "state.db"
    _foreign(path, app_id=0x1234)
    with pytest.raises(StateError, match="application_id 0x1234"):
        SqliteRegistry.open(path)


def test_empty_sqlite_database_is_refused(tmp_path):
    path = tmp_path / "state.db"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 1")  # forces the header to be written
    conn.commit()
    conn.close()
    with pytest.raises(StateError, match="empty SQLite database"):
        SqliteRegistry.open(path)


def test_init_refuses_a_foreign_file_and_keeps_it(tmp_path):
    path = tmp_path / "state.db"
    _foreign(path)
    before = path.read_bytes()
    text, source = default_topology_text()
    with pytest.raises(StateError, match="another application"):
        init_fabric(path, text, source)
    assert path.read_bytes() == before


def test_corrupt_pages_are_refused(tmp_path):
    path = tmp_path / "state.db"
    text, source = default_topology_text()
    init_fabric(path, text, source, hostname="x")
    data = bytearray(path.read_bytes())
    page = 4096
    assert len(data) > 3 * page
    data[page : 3 * page] = b"\xa5" * (2 * page)  # smash the pages after the header page
    path.write_bytes(bytes(data))
    with pytest.raises(StateError, match="corrupt") as e:
        SqliteRegistry.open(path)
    assert "vmlend fabric init" in str(e.value)
    assert path.read_bytes() == bytes(data)


def _inited(tmp_path) -> Path:
    path = tmp_path / "state.db"
    init_fabric(path, *default_topology_text(), hostname="x")
    return path


@pytest.mark.parametrize(
    "table", ["meta", "topology", "holds", "claims", "mdev_parents", "mdevs", "runtime"]
)
def test_a_damaged_page_of_a_table_walked_at_open_is_refused_at_open(tmp_path, table):
    path = _inited(tmp_path)
    data = smash(path, pages_of(path, table))
    with pytest.raises(StateError, match="is corrupt") as e:
        SqliteRegistry.open(path)
    assert "vmlend fabric init" in str(e.value)
    assert path.read_bytes() == data


@pytest.mark.parametrize("table", ["devices", "nodes"])
def test_a_damaged_page_of_a_table_the_fabric_sizes_is_one_line_where_it_is_read(tmp_path, table):
    """Nodes and devices are not walked at every open (their size is the fabric's): a page
    of theirs damaged is refused, in one line, by the command that reads it."""
    path = _inited(tmp_path)
    data = smash(path, pages_of(path, table))
    line = one_line(CliRunner().invoke(main, ["--state", str(path), "devices"]))
    assert "corrupt" in line and "move it away" in line, line
    assert path.read_bytes() == data


@pytest.mark.parametrize(
    ("keep", "said"),
    [
        # the bytes of its last page: the head's sha256 refuses the pieces
        (4, "topology record generation"),
        # all of its first page, the link to the next one too: SQLite refuses the read
        (0, "corrupt"),
    ],
)
def test_a_damaged_page_of_the_topology_pieces_is_one_line_where_they_are_read(
    tmp_path, keep, said
):
    """The pieces are not walked at every open (7 MB at 1,024 nodes): what reads them
    refuses a damaged page in one line."""
    path = _inited(tmp_path)
    pages = overflow_pages_of(path, "topology_pieces")
    assert len(pages) >= 2  # the default topology's one piece overflows its row's page
    smash(path, pages[-1:] if keep else pages[:1], keep=keep)
    line = one_line(CliRunner().invoke(main, ["--state", str(path), "devices"]))
    assert said in line, line
    assert "fabric init" in line, line


_THREAD_IO = Path("/proc/thread-self/io")


def _bytes_read() -> int:
    """What this thread has read through read(2) and pread(2) so far (this thread's alone:
    a test runner's own threads read too)."""
    for line in _THREAD_IO.read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/thread-self/io")


def test_opening_a_state_reads_as_much_of_a_big_fabric_as_of_a_small_one(tmp_path):
    """Every CLI command and hook call opens the state: what the open checks must not grow
    with the fabric (it walked every page: 7 MB at 1,024 nodes)."""
    read = {}
    for nodes in (8, 128):
        path = tmp_path / f"{nodes}.db"
        init_fabric(path, fabric_topology(nodes, 16), "generated.toml")
        SqliteRegistry.open(path).close()  # this process's first open (imports) not counted
        before = _bytes_read()
        SqliteRegistry.open(path).close()
        read[nodes] = _bytes_read() - before
    assert (tmp_path / "128.db").stat().st_size > 5 * (tmp_path / "8.db").stat().st_size
    assert read[128] <= read[8] + 16 * 1024, read


def test_a_lenders_devices_read_as_little_of_a_big_topology_as_of_a_small_one(
    tmp_path, monkeypatch
):
    """A command reads the topology from this host's copy a chunk at a time: listing one
    lender's devices verifies the chunks of the few places it reads (the headers, the index
    entries, the records), at most 10 whatever the topology's size, not the 50 of a 128-node
    topology (it read and hashed every piece: 6.6 MB at 1,024 nodes, in every process)."""
    from vmlend.topology import chunked
    from vmlend.wiring.fabric import open_fabric

    checked: list[int] = []
    real = chunked.Chunked._check

    def check(self, i):
        checked.append(i)
        return real(self, i)

    monkeypatch.setattr(chunked.Chunked, "_check", check)
    counts, sizes = {}, {}
    for nodes in (8, 128):
        path = tmp_path / f"{nodes}" / "state.db"
        init_fabric(path, fabric_topology(nodes, 16), "generated.toml", node="n0")
        with open_fabric(path, "n0") as fabric:  # the first read keeps the host's copy
            assert len(fabric.devices("n5")) == 16
        copy = path.with_name("state.db-topology")
        sizes[nodes] = copy.stat().st_size
        checked.clear()
        with open_fabric(path, "n0") as fabric:
            found = fabric.devices("n5")
        assert [d.fdid for d in found] == [0x600 + i for i in range(16)]
        counts[nodes] = len(set(checked))
    assert sizes[128] > 10 * sizes[8] and sizes[128] > 40 * chunked.CHUNK_BYTES
    assert 0 < counts[8] <= counts[128] <= 10, counts


def test_newer_schema_is_refused(made):
    conn = sqlite3.connect(made)
    conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    with pytest.raises(StateError, match=r"schema version 99, newer .* upgrade vmlend"):
        SqliteRegistry.open(made)


def test_older_schema_is_migrated(made, monkeypatch):
    current = schema_mod.SCHEMA_VERSION
    monkeypatch.setattr(store_mod, "SCHEMA_VERSION", current + 1)
    monkeypatch.setattr(
        store_mod, "MIGRATIONS", {**schema_mod.MIGRATIONS, current: ("CREATE TABLE extra (x)",)}
    )
    monkeypatch.setattr(store_mod, "TABLES", schema_mod.TABLES | {"extra"})
    with SqliteRegistry.open(made) as reg, reg.read() as tx:
        assert tx.meta("schema_version") == str(current + 1)
    with SqliteRegistry.open(made) as reg, reg.read() as tx:  # idempotent: nothing left to do
        assert tx.meta("schema_version") == str(current + 1)


def test_a_version_1_state_keeps_its_claims_and_learns_p2p_claims(tmp_path, monkeypatch):
    from vmlend.registry import Claim, ClaimKind, HoldRecord, Phase
    from vmlend.topology.model import Holder

    path = tmp_path / "v1.db"
    with older_vmlend(monkeypatch, 1):
        init_fabric(path, *default_topology_text(), node="gamma")
        with SqliteRegistry.open(path) as reg, reg.write() as tx:
            hold = HoldRecord(0x10, Holder("gamma", "vm1"), 0.0, Phase.RESERVED, 8 << 30)
            tx.add_hold(hold, [Claim("alpha:0", ClaimKind.LUT, "dev:0x10", entries=1)])
            with pytest.raises(sqlite3.IntegrityError):  # version 1 knows no p2p claims
                tx.replace_claims(ClaimKind.P2P, [0x10], [(0x10, Claim("a:0", ClaimKind.P2P, "x"))])
    with SqliteRegistry.open(path) as reg:
        with reg.read() as tx:
            assert tx.meta("schema_version") == str(schema_mod.SCHEMA_VERSION)
            assert tx.claims() == [(0x10, Claim("alpha:0", ClaimKind.LUT, "dev:0x10", entries=1))]
        with reg.write() as tx:
            tx.replace_claims(ClaimKind.P2P, [0x10], [(0x10, Claim("a:0", ClaimKind.P2P, "x"))])
            assert len(tx.claims()) == 2
            tx.delete_hold(0x10)  # the rebuilt table still goes with its hold
            assert tx.claims() == []


def test_a_version_2_state_opens_from_its_toml_and_is_compiled_when_it_migrates(
    tmp_path, monkeypatch
):
    from vmlend.topology.compiled import decode_compiled
    from vmlend.topology.parse import parse_topology
    from vmlend.wiring.fabric import open_fabric

    path = tmp_path / "v2.db"
    text, source = default_topology_text()
    with older_vmlend(monkeypatch, 2):
        init_fabric(path, text, source, node="gamma")
    columns = [r[1] for r in stored_rows(path, "PRAGMA table_info(topology)")]
    assert "compiled" not in columns  # a version-2 file, as that vmlend left it
    with open_fabric(path, "gamma") as fabric:  # migrates: the column is added, NULL
        assert fabric.topology() == parse_topology(text, source)
        assert fabric.device(0x10).spec.fdid == 0x10
    with SqliteRegistry.open(path) as reg, reg.read() as tx:
        assert tx.meta("schema_version") == str(schema_mod.SCHEMA_VERSION)
        # schema 7's step compiles a topology this vmlend cannot read the compiled form of
        rec = tx.topology()
    assert decode_compiled(rec.compiled_bytes(), rec.digest) == parse_topology(text, source)
    assert init_fabric(path, text, source, node="gamma").action == "unchanged"
    with SqliteRegistry.open(path) as reg, reg.read() as tx:
        rec = tx.topology()
    assert decode_compiled(rec.compiled_bytes(), rec.digest) == parse_topology(text, source)


def test_a_version_3_state_learns_hold_tokens_and_every_new_hold_gets_a_larger_one(
    tmp_path, monkeypatch
):
    from vmlend.registry import HoldRecord, Phase
    from vmlend.topology.model import Holder

    path = older_state_with_a_hold(monkeypatch, tmp_path / "v3.db", 3).path
    with SqliteRegistry.open(path) as reg:
        with reg.read() as tx:
            assert tx.meta("schema_version") == str(schema_mod.SCHEMA_VERSION)
            assert tx.hold(0x10).token == 0  # made before tokens: not checked
        tokens = []
        for vm in ("a", "b", "c"):
            with reg.write() as tx:
                tx.add_hold(HoldRecord(0x11, Holder("gamma", vm), 0.0, Phase.RESERVED), [])
            with reg.read() as tx:
                tokens.append(tx.hold(0x11).token)
            with reg.write() as tx:
                tx.delete_hold(0x11)
        assert tokens == sorted(tokens) and len(set(tokens)) == 3 and tokens[0] > 0


def test_a_version_4_state_gains_the_indexes_and_reads_read_only_as_it_is(tmp_path, monkeypatch):
    """Schema 5 only adds indexes (the topology digest every transaction reads, holds by node,
    claims by fdid): a version-4 file migrates to them keeping its holds and tokens; one this
    process may not write is read as it is."""
    import os

    older = older_state_with_a_hold(monkeypatch, tmp_path / "v4.db", 4)
    path, token = older.path, older.hold.token
    if os.geteuid() != 0:  # root writes whatever the mode says: no read-only open as root
        path.chmod(0o444)
        tmp_path.chmod(0o555)
        try:
            with SqliteRegistry.open(path) as reg, reg.read() as tx:
                assert tx.meta("schema_version") == "4" and tx.hold(0x10).token == token
        finally:
            tmp_path.chmod(0o755)
            path.chmod(0o644)
    with SqliteRegistry.open(path) as reg, reg.read() as tx:
        assert tx.meta("schema_version") == str(schema_mod.SCHEMA_VERSION)
        assert tx.hold(0x10).token == token > 0 and tx.topology_digest()
    indexes = {r[0] for r in stored_rows(path, "SELECT name FROM sqlite_master WHERE type='index'")}
    assert {"topology_digest", "holds_node", "claims_fdid"} <= indexes, indexes


def test_a_version_6_state_migrates_to_a_generation_read_a_chunk_at_a_time(tmp_path, monkeypatch):
    """Schema 7 writes the topology's generation again in format 2 (addressable, verified a
    chunk at a time), its compiled form in this vmlend's format: a version-6 file keeps its
    records and its topology's content, and no piece of the old generation is left."""
    from vmlend.registry import topopieces
    from vmlend.topology.compiled import decode_compiled

    older = older_state_with_a_hold(monkeypatch, tmp_path / "v6.db", 6)
    path, text = older.path, older.text

    def heads() -> list[topopieces.TopologyHead]:
        rows = stored_rows(path, "SELECT head FROM topology")
        pieces = stored_rows(path, "SELECT DISTINCT generation FROM topology_pieces")
        found = [topopieces.decode_head(r[0].encode(), "head") for r in rows]
        assert [p[0] for p in pieces] == [h.generation for h in found]  # its pieces alone
        return found

    (old,) = heads()
    assert old.format == topopieces.PIECES_FORMAT_1
    with SqliteRegistry.open(path) as reg, reg.read() as tx:
        assert tx.meta("schema_version") == str(schema_mod.SCHEMA_VERSION) == "7"
        rec = tx.topology()
        assert rec.text == text and rec.local_node == "gamma" and rec.digest == old.digest
        assert decode_compiled(rec.compiled_bytes(), rec.digest) is not None
        assert tx.hold(0x10) is not None
    (new,) = heads()
    assert new.format == topopieces.PIECES_FORMAT and new.generation != old.generation
    with SqliteRegistry.open(path) as reg, reg.read() as tx:  # once: nothing more to do
        assert tx.topology().digest == old.digest
    assert heads() == [new]


def test_a_version_5_state_migrates_and_its_next_topology_is_a_generation(tmp_path, monkeypatch):
    """Schema 6 adds the topology's generations: a version-5 file keeps its topology in its
    row (read as it is, holds kept) until a topology is installed, which is then written as a
    generation of pieces, and installing another leaves that one's pieces alone."""
    from tests.support.simfabric import small_topology
    from vmlend.topology.compiled import decode_compiled

    older = older_state_with_a_hold(monkeypatch, tmp_path / "v5.db", 5)
    path, text = older.path, older.text
    with SqliteRegistry.open(path) as reg, reg.read() as tx:
        assert tx.meta("schema_version") == "7" == str(schema_mod.SCHEMA_VERSION)
        rec = tx.topology()
        assert rec.text == text and rec.local_node == "gamma" and tx.hold(0x10) is not None
        assert decode_compiled(rec.compiled_bytes(), rec.digest) is not None
    assert stored_rows(path, "SELECT head FROM topology") == [(None,)]
    assert not stored_rows(path, "SELECT * FROM topology_pieces")
    with SqliteRegistry.open(path) as reg, reg.write() as tx:
        tx.delete_hold(0x10)
    other = small_topology()
    for topology in (other, text):
        assert init_fabric(path, topology, "t.toml", replace=True).action == "replaced"
        with SqliteRegistry.open(path) as reg, reg.read() as tx:
            assert tx.topology().text == topology
        assert stored_rows(path, "SELECT text, compiled FROM topology") == [("", None)]
        assert len(stored_rows(path, "SELECT DISTINCT generation FROM topology_pieces")) == 1


def test_a_write_waits_then_fails_clearly_when_locked(made):
    with SqliteRegistry.open(made) as a, a.write() as tx:
        tx.set_meta("x", "1")
        with SqliteRegistry.open(made, busy_timeout=0.05) as b:
            with pytest.raises(StateError, match="locked by another process"), b.write():
                pass
            with b.read() as rtx:  # WAL: readers are not blocked by the writer
                assert rtx.meta("x") is None


def test_failed_write_changes_nothing(location):
    def boom(tx):
        tx.set_meta("x", "1")
        raise RuntimeError("boom")

    with create_registry(location, _fill) as reg:
        with pytest.raises(RuntimeError):
            reg.transact(boom)
        with reg.read() as tx:
            assert tx.meta("x") is None
        reg.transact(lambda tx: tx.set_meta("x", "2"))
    with open_registry(location) as reg, reg.read() as tx:
        assert tx.meta("x") == "2"
        assert tx.topology().name == "t"


def test_read_transaction_cannot_write(location):
    with create_registry(location, _fill) as reg, reg.read() as tx, pytest.raises(RuntimeError):
        tx.set_meta("x", "1")


def test_create_never_replaces_existing_state(location):
    create_registry(location, _fill).close()
    with pytest.raises(FileExistsError):
        create_registry(location, _fill)


def test_newer_schema_of_either_backend_is_refused_in_one_line(location):
    with create_registry(location, _fill) as reg:
        newer = max(schema_mod.SCHEMA_VERSION, schema_mod.ETCD_SCHEMA_VERSION) + 1
        reg.transact(lambda tx: tx.set_meta("schema_version", str(newer)))
    with pytest.raises(StateError, match=r"newer than this vmlend understands.*upgrade vmlend"):
        open_registry(location)


def test_create_in_an_unwritable_place_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StateError, match=r"cannot create the vmlend state .*--state"):
        SqliteRegistry.create(blocker / "sub" / "state.db", _fill)


def test_a_state_missing_a_table_is_refused(made):
    conn = sqlite3.connect(made)
    conn.execute("DROP TABLE mdevs")
    conn.commit()
    conn.close()
    with pytest.raises(StateError, match=r"lacks vmlend tables \(mdevs\)"):
        SqliteRegistry.open(made)


def test_a_state_with_unknown_tables_is_refused(made):
    conn = sqlite3.connect(made)
    conn.execute("CREATE TABLE intruder (x)")
    conn.commit()
    conn.close()
    with pytest.raises(StateError, match="carries vmlend's mark but not its tables"):
        SqliteRegistry.open(made)


def test_runtime_records_follow_the_hold(location):
    """Windows/vectors recorded for a held device are listed, replaced by key, and vanish
    with the hold; a device nobody holds cannot get any."""
    from tests.support.simfabric import make_fabric
    from vmlend.errors import StateError
    from vmlend.topology.model import Holder

    fabric = make_fabric(location)
    holder = Holder("gamma", "vm1", "u1")
    fabric.reserve(0x10, holder)
    reg = open_registry(location)

    def put(tx):
        tx.put_runtime(0x10, "dma-window", "low", {"start": 0, "end": 1 << 30})
        tx.put_runtime(0x10, "dma-window", "low", {"start": 0, "end": 2 << 30})
        tx.put_runtime(0x10, "irq-vector", "msi.0", {"eventfd": True})

    reg.transact(put)
    with reg.read() as tx:
        recs = tx.runtime(0x10)
        assert [(r.kind, r.key) for r in recs] == [("dma-window", "low"), ("irq-vector", "msi.0")]
        assert recs[0].data == {"start": 0, "end": 2 << 30}
        assert len(tx.runtime(kind="irq-vector")) == 1
    assert reg.transact(lambda tx: tx.clear_runtime(0x10, "irq-vector")) == 1
    with pytest.raises(StateError, match="not held"):
        reg.transact(lambda tx: tx.put_runtime(0x11, "dma-window", "low", {}))
    fabric.release(0x10, holder)
    with reg.read() as tx:
        assert tx.runtime() == []


def test_reopening_in_one_process_never_breaks_another_connections_locks(tmp_path):
    """Regression: vetting a state file must not open() it. Closing any descriptor of the file
    drops this process's SQLite locks, so another process's exit then checkpointed and
    truncated the WAL under a live connection, and the next open saw a 'corrupt' database."""
    import subprocess
    import sys

    from tests.support.simfabric import make_fabric
    from vmlend.topology.model import Holder
    from vmlend.wiring.fabric import open_fabric

    path = tmp_path / "s.db"
    keep = make_fabric(path)  # a connection that stays open in this process
    open_fabric(path)  # a second open (and vet) while `keep` is open
    step = (
        "import sys; from vmlend.wiring.fabric import open_fabric;"
        "from vmlend.topology.model import Holder;"
        "f = open_fabric(sys.argv[1]); h = Holder('gamma', 'vm', 'u');"
        "[getattr(f, sys.argv[2])(x, h) for x in (0x10, 0x12, 0x21, 0x22)]"
    )
    h = Holder("gamma", "vm", "u")
    for _ in range(3):
        for op in ("reserve", "release"):
            subprocess.run([sys.executable, "-c", step, str(path), op], check=True, timeout=60)
        here = open_fabric(path)
        for fdid in (0x10, 0x12, 0x21, 0x22):
            here.reserve(fdid, h)
            here.release(fdid, h)
    assert len(keep.devices()) == 9


def test_vector_records_replace_and_clear(location):
    from tests.support.simfabric import make_fabric
    from vmlend.irq.records import RECORD_KIND, registry_vector_recorder
    from vmlend.topology.model import Holder

    make_fabric(location).reserve(0x12, Holder("gamma", "vm1", "u1"))
    reg = open_registry(location)
    record = registry_vector_recorder(reg)
    record(0x12, [{"mode": "MSIX", "vector": i, "path": "relay"} for i in range(4)])
    record(0x12, [{"mode": "MSI", "vector": 0, "path": "relay"}])  # the guest switched modes
    with reg.read() as tx:
        assert [r.key for r in tx.runtime(0x12, RECORD_KIND)] == ["MSI.0"]
    record(0x12, None)
    with reg.read() as tx:
        assert tx.runtime(0x12, RECORD_KIND) == []


def test_a_lock_wait_longer_than_a_second_says_so_and_then_proceeds(made, caplog):
    import subprocess
    import sys

    # Another process holds the write lock for 1.5 s.
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3, sys, time\n"
            "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
            "c.execute('BEGIN IMMEDIATE'); print('locked', flush=True)\n"
            "time.sleep(1.5); c.execute('COMMIT')",
            str(made),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with SqliteRegistry.open(made, busy_timeout=10) as b:
            with caplog.at_level("WARNING", logger="vmlend.registry.store"), b.write() as tx:
                tx.set_meta("y", "2")  # got the lock once the other process committed
            with b.read() as rtx:
                assert rtx.meta("y") == "2"
    finally:
        holder.wait(timeout=10)
    waits = [r.getMessage() for r in caplog.records if "waiting up to" in r.getMessage()]
    assert len(waits) == 1 and "9 s" in waits[0] and "locked by another process" in waits[0]


def test_a_short_lock_wait_is_quiet(made, caplog):
    with SqliteRegistry.open(made) as a, a.write() as tx:
        tx.set_meta("x", "1")
        with (
            SqliteRegistry.open(made, busy_timeout=0.05) as b,
            caplog.at_level("WARNING"),
            pytest.raises(StateError, match="locked by another process"),
            b.write(),
        ):
            pass
    assert not [r for r in caplog.records if "waiting up to" in r.getMessage()]
