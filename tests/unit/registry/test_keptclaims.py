"""An open SQLite state keeps the claims per adapter between its transactions
(``vmlend.registry.keptclaims``), and never answers from them once the state file holds
something else: another connection's commit, this connection's own inserts, releases
(cascades), rewrites and rolled-back transactions, explored at random over two open
registries and a raw connection; kept claims are not fetched again."""

from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path

import msgspec
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tests.support.simfabric import make_fabric, star_topology
from tests.support.stateful import derandomized
from vmlend.registry import SqliteRegistry
from vmlend.registry.records import Claim, ClaimKind, HoldRecord, Phase
from vmlend.topology.model import Holder

FDIDS = (0x100, 0x101, 0x102, 0x103)
ADAPTERS = ("l:0", "h0:0", "sw/l:0", "sw/h0:0")
VM = Holder("h0", "vm")


def _state(directory: Path) -> Path:
    path = directory / "state.db"
    make_fabric(path, star_topology(1, len(FDIDS)), node="h0").close()
    return path


def _claims_on(reg: SqliteRegistry, refs=ADAPTERS) -> list[tuple[int, Claim]]:
    with reg.read() as tx:
        return sorted(tx.claims_on(refs), key=repr)


def _rows_now(path: Path, refs=ADAPTERS) -> list[tuple[int, Claim]]:
    """What the file holds, read on a connection of its own."""
    with sqlite3.connect(path) as db:
        rows = db.execute(
            "SELECT fdid, adapter, kind, share, entries, segments, bytes FROM claims"
            f" WHERE adapter IN ({', '.join('?' * len(refs))})",
            refs,
        ).fetchall()
    return sorted(
        (
            (f, Claim(a, ClaimKind(k), s, entries=e, segments=g, bytes=b))
            for f, a, k, s, e, g, b in rows
        ),
        key=repr,
    )


def _hold(reg: SqliteRegistry, fdid: int, *claims: Claim) -> None:
    with reg.write() as tx:
        tx.add_hold(HoldRecord(fdid, VM, 0.0, Phase.RESERVED), claims)


def _fetches(reg: SqliteRegistry) -> list[str]:
    """The claim rows ``reg``'s connection fetches from now on (statements it runs)."""
    seen: list[str] = []
    reg._conn.set_trace_callback(
        lambda sql: seen.append(sql) if "FROM claims" in sql and "SELECT" in sql else None
    )
    return seen


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return _state(tmp_path)


def test_claims_read_once_are_not_fetched_again_nor_after_this_registrys_own_reserve(state):
    reg = SqliteRegistry.open(state)
    try:
        _hold(reg, 0x100, Claim("l:0", ClaimKind.LUT, "req:a", entries=1))
        first = _claims_on(reg)
        fetched = _fetches(reg)
        assert _claims_on(reg) == first
        _hold(reg, 0x101, Claim("l:0", ClaimKind.LUT, "req:b", entries=1))
        assert _claims_on(reg) == _rows_now(state) and len(_rows_now(state)) == 2
        assert fetched == []  # the new claim joined what was kept
    finally:
        reg.close()


def test_a_claim_another_connection_commits_is_seen_by_the_next_transaction(state):
    one, two = SqliteRegistry.open(state), SqliteRegistry.open(state)
    try:
        assert _claims_on(one) == []
        _hold(two, 0x100, Claim("h0:0", ClaimKind.BAR, "dev:0x100", segments=2, bytes=2))
        assert _claims_on(one) == _rows_now(state) != []
        with two.write() as tx:
            tx.delete_hold(0x100)
        assert _claims_on(one) == []
    finally:
        one.close()
        two.close()


def test_a_release_forgets_the_claims_its_cascade_deleted(state):
    reg = SqliteRegistry.open(state)
    try:
        _hold(reg, 0x100, Claim("l:0", ClaimKind.LUT, "req:a", entries=1))
        assert len(_claims_on(reg)) == 1
        with reg.write() as tx:
            tx.delete_hold(0x100)  # its claims go by ON DELETE CASCADE
        assert _claims_on(reg) == []
    finally:
        reg.close()


def test_a_transaction_that_rolls_back_leaves_nothing_of_its_claims(state):
    reg = SqliteRegistry.open(state)
    try:
        assert _claims_on(reg) == []
        with pytest.raises(RuntimeError), reg.write() as tx:
            tx.add_hold(
                HoldRecord(0x100, VM, 0.0, Phase.RESERVED),
                [Claim("l:0", ClaimKind.LUT, "req:a", entries=1)],
            )
            assert [c.share for _f, c in tx.claims_on(ADAPTERS)] == ["req:a"]  # its own
            raise RuntimeError("the body fails after writing")
        assert _claims_on(reg) == [] == _rows_now(state)
    finally:
        reg.close()


def test_a_claim_changed_in_place_by_another_connection_is_read_as_it_now_is(state):
    reg = SqliteRegistry.open(state)
    try:
        _hold(reg, 0x100, Claim("l:0", ClaimKind.DMA, "vm:h0/vm", segments=1, bytes=1))
        assert _claims_on(reg)[0][1].segments == 1
        with sqlite3.connect(state) as db:
            db.execute("UPDATE claims SET segments = 7")
        assert _claims_on(reg)[0][1].segments == 7
    finally:
        reg.close()


claims = st.builds(
    Claim,
    adapter=st.sampled_from(ADAPTERS),
    kind=st.sampled_from(list(ClaimKind)),
    share=st.sampled_from(["req:a", "req:b", "vm:h0/vm", "dev:0x100"]),
    entries=st.integers(0, 3),
    segments=st.integers(0, 3),
    bytes=st.integers(0, 3),
)


def _flip(tx, fdid: int, made: list[Claim]) -> None:
    """After reading the adapters' claims (as admission does): release ``fdid``'s hold if it
    has one, else reserve it with the claims ``made``."""
    tx.claims_on(ADAPTERS)
    if tx.hold(fdid) is not None:
        tx.delete_hold(fdid)
    else:
        tx.add_hold(HoldRecord(fdid, VM, 0.0, Phase.RESERVED), made)


class KeptClaimsMachine(RuleBasedStateMachine):
    """Two registries open on one state file, and a raw connection beside them: whatever
    each does, each one's next transaction reads what the file holds."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory(prefix="kept-")
        self.path = _state(Path(self.tmp.name))
        self.regs = [SqliteRegistry.open(self.path), SqliteRegistry.open(self.path)]

    def teardown(self) -> None:
        for reg in self.regs:
            reg.close()
        self.tmp.cleanup()

    @rule(who=st.integers(0, 1), refs=st.lists(st.sampled_from(ADAPTERS), min_size=1))
    def read(self, who: int, refs: list[str]) -> None:
        assert _claims_on(self.regs[who], refs) == _rows_now(self.path, refs)

    @rule(who=st.integers(0, 1), fdid=st.sampled_from(FDIDS), made=st.lists(claims, max_size=4))
    def reserve(self, who: int, fdid: int, made: list[Claim]) -> None:
        with self.regs[who].write() as tx:
            if tx.hold(fdid) is None:
                tx.claims_on(ADAPTERS)  # read first, as admission does
                tx.add_hold(HoldRecord(fdid, VM, 0.0, Phase.RESERVED), made)

    @rule(who=st.integers(0, 1), fdid=st.sampled_from(FDIDS))
    def release(self, who: int, fdid: int) -> None:
        with self.regs[who].write() as tx:
            if tx.hold(fdid) is not None:
                tx.delete_hold(fdid)

    @rule(
        who=st.integers(0, 1),
        kind=st.sampled_from(list(ClaimKind)),
        made=st.lists(st.tuples(st.sampled_from(FDIDS), claims), max_size=3),
    )
    def rewrite(self, who: int, kind: ClaimKind, made: list[tuple[int, Claim]]) -> None:
        """``replace_claims`` (peer-to-peer's, a link event's recount), then a read in the
        same transaction: it sees its own rows."""
        with self.regs[who].write() as tx:
            held = {f for f in FDIDS if tx.hold(f) is not None}
            new = [(f, msgspec.structs.replace(c, kind=kind)) for f, c in made if f in held]
            tx.replace_claims(kind, held, new)
            mine = sorted(tx.claims_on(ADAPTERS), key=repr)
            assert sum(c.kind is kind for _f, c in mine) == len(new)

    @rule(who=st.integers(0, 1), fdid=st.sampled_from(FDIDS), made=st.lists(claims, max_size=3))
    def rolled_back(self, who: int, fdid: int, made: list[Claim]) -> None:
        try:
            with self.regs[who].write() as tx:
                _flip(tx, fdid, made)
                tx.claims_on(ADAPTERS)
                raise RuntimeError("rolled back")
        except RuntimeError:
            pass

    @rule(who=st.integers(0, 1), fdid=st.sampled_from(FDIDS), made=st.lists(claims, max_size=3))
    def interrupted_after_commit(self, who: int, fdid: int, made: list[Claim]) -> None:
        """Ctrl-C lands between the commit and keeping what it changed: the commit stands,
        its adapters are read again."""
        from vmlend.registry.keptclaims import KeptClaims

        def interrupted(kept: KeptClaims, staged: object) -> None:
            raise KeyboardInterrupt

        install, KeptClaims.install = KeptClaims.install, interrupted  # type: ignore[method-assign]
        try:
            with self.regs[who].write() as tx:
                _flip(tx, fdid, made)
        except KeyboardInterrupt:
            pass
        finally:
            KeptClaims.install = install  # type: ignore[method-assign]

    @rule(who=st.integers(0, 1), to=st.sampled_from(ADAPTERS))
    def replaced_in_place(self, who: int, to: str) -> None:
        """This connection moves a row with INSERT OR REPLACE (its deletion fires no delete
        statement)."""
        with self.regs[who].write() as tx:
            tx._c.execute(
                "INSERT OR REPLACE INTO claims"
                " (rowid, fdid, adapter, kind, share, entries, segments, bytes)"
                " SELECT rowid, fdid, ?, kind, share, entries, segments, bytes FROM claims"
                " WHERE rowid = (SELECT MIN(rowid) FROM claims)",
                (to,),
            )

    @rule(amount=st.integers(0, 5))
    def raw_update(self, amount: int) -> None:
        """Another writer changes rows in place (an older vmlend, a repair by hand)."""
        with sqlite3.connect(self.path) as db:
            first = "(SELECT MIN(rowid) FROM claims)"
            db.execute(f"UPDATE claims SET entries = ? WHERE rowid = {first}", (amount,))

    @invariant()
    def each_reads_what_the_file_holds(self) -> None:
        for reg in self.regs:
            assert _claims_on(reg) == _rows_now(self.path)


KeptClaimsMachine.TestCase.settings = derandomized(60, 25)
test_kept_claims_are_what_the_file_holds = KeptClaimsMachine.TestCase


def test_an_interruption_between_the_commit_and_keeping_its_claims_forgets_them(
    state, monkeypatch
):
    """Ctrl-C during the commit's fsync lands after it: the adapters the commit changed are
    read again, never kept without its claims."""
    from vmlend.registry.keptclaims import KeptClaims

    reg = SqliteRegistry.open(state)
    try:
        assert _claims_on(reg) == []  # every adapter kept, empty
        install = KeptClaims.install

        def interrupted(self, staged):
            raise KeyboardInterrupt

        monkeypatch.setattr(KeptClaims, "install", interrupted)
        with pytest.raises(KeyboardInterrupt):
            _hold(reg, 0x100, Claim("l:0", ClaimKind.LUT, "req:a", entries=1))
        monkeypatch.setattr(KeptClaims, "install", install)
        assert _claims_on(reg) == _rows_now(state) != []
    finally:
        reg.close()


def test_a_claims_table_rebuilt_on_the_connection_keeps_nothing_from_then_on(state):
    """A rebuild (as a schema migration does) drops the TEMP triggers with the table: the
    connection's own changes would go unlogged, so nothing is kept any more."""
    reg = SqliteRegistry.open(state)
    try:
        assert _claims_on(reg) == []
        conn = reg._conn
        conn.execute("CREATE TABLE claims_copy AS SELECT * FROM claims")
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute("DROP TABLE claims")
        conn.execute("ALTER TABLE claims_copy RENAME TO claims")
        conn.execute("PRAGMA foreign_keys = ON")
        _hold(reg, 0x100, Claim("l:0", ClaimKind.LUT, "req:a", entries=1))
        assert _claims_on(reg) == _rows_now(state) != []
    finally:
        reg.close()


def test_a_claim_replaced_in_place_by_this_connection_is_read_again(state):
    """INSERT OR REPLACE deletes the row it replaces without a delete statement: that
    deletion is logged too (recursive triggers), so the old row is not kept."""
    reg = SqliteRegistry.open(state)
    try:
        _hold(reg, 0x100, Claim("l:0", ClaimKind.LUT, "req:a", entries=1))
        assert len(_claims_on(reg)) == 1
        with reg.write() as tx:
            tx._c.execute(
                "INSERT OR REPLACE INTO claims"
                " (rowid, fdid, adapter, kind, share, entries, segments, bytes)"
                " SELECT rowid, fdid, 'h0:0', kind, share, entries, segments, bytes FROM claims"
            )
        assert _claims_on(reg) == _rows_now(state)
        assert [c.adapter for _f, c in _claims_on(reg)] == ["h0:0"]
    finally:
        reg.close()
