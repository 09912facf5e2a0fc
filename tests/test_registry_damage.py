"""A damaged record of the SQLite state (text in an integer column, a value out of its set,
runtime data that is not JSON) is a ``StateRecordError`` naming the table and the key, and the
CLI prints it as one line: never a traceback from deep inside a caller."""

from __future__ import annotations

import sqlite3

import pytest
from click.testing import CliRunner

from tests.cli_cluster import one_line
from tests.simfabric import make_fabric
from vmlend.cli import main
from vmlend.errors import StateRecordError
from vmlend.fabric.model import Holder
from vmlend.registry import SqliteRegistry

U1 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001"
WEB = Holder("gamma", "web", "11111111-1111-1111-1111-111111111111")


@pytest.fixture
def held(state_path):
    """The default fabric with 0x10 reserved for gamma/web and one runtime record of it."""
    fab = make_fabric(state_path)
    try:
        fab.reserve(0x10, WEB)
        with fab.registry.write() as tx:
            tx.put_runtime(0x10, "dma-window", "0", {"start": 0})
    finally:
        fab.close()
    return state_path


def _damage(path, sql: str, *args: object) -> None:
    with sqlite3.connect(path) as db:
        db.execute(sql, args)


def _read(path, what):
    reg = SqliteRegistry.open(path)
    try:
        with reg.read() as tx:
            return what(tx)
    finally:
        reg.close()


def test_text_in_an_integer_column_names_the_record(held):
    _damage(held, "UPDATE devices SET lent = 'yes' WHERE fdid = 16")
    with pytest.raises(StateRecordError, match=r"device record 0x10 is damaged \(Expected `bool"):
        _read(held, lambda tx: tx.devices())
    _damage(
        held,
        "INSERT INTO mdevs VALUES (?, 16, 'gamma', 'smartio-10', 'smartio-lend', 'web', 'x')",
        U1,
    )
    with pytest.raises(StateRecordError, match=f"mdev record '{U1}' is damaged"):
        _read(held, lambda tx: tx.mdevs())


def test_a_hold_with_text_for_its_time_names_the_record(held):
    _damage(held, "UPDATE holds SET since = 'yesterday' WHERE fdid = 16")
    with pytest.raises(StateRecordError, match=r"hold record 0x10 is damaged.*since"):
        _read(held, lambda tx: tx.hold(0x10))
    with pytest.raises(StateRecordError, match=r"hold record 0x10 is damaged"):
        _read(held, lambda tx: tx.holds_of(WEB))


def test_runtime_data_that_is_not_json_names_the_record(held):
    _damage(held, "UPDATE runtime SET data = '{not json' WHERE fdid = 16")
    with pytest.raises(StateRecordError, match="runtime record 0x10/dma-window/0 is damaged"):
        _read(held, lambda tx: tx.runtime(0x10))
    _damage(held, "UPDATE runtime SET data = '[1, 2]' WHERE fdid = 16")
    with pytest.raises(StateRecordError, match="Expected `object`, got `array`"):
        _read(held, lambda tx: tx.runtime(0x10))


def test_the_cli_prints_a_damaged_record_as_one_line(held):
    _damage(held, "UPDATE holds SET guest_ram = 'lots' WHERE fdid = 16")
    line = one_line(CliRunner().invoke(main, ["--state", str(held), "devices"]))
    assert "hold record 0x10 is damaged" in line and "guest_ram" in line
