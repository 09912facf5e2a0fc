"""A damaged record of the SQLite state (text in an integer column, a value out of its set,
runtime data that is not JSON) is a ``StateRecordError`` naming the table and the key, and the
CLI prints it as one line: never a traceback from deep inside a caller."""

from __future__ import annotations

import logging
import os
import sqlite3
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.support.cli_cluster import one_line
from tests.support.cluster_hosts import VMLEND
from tests.support.simfabric import fabric_topology, make_fabric
from vmlend.cli import main
from vmlend.errors import StateRecordError
from vmlend.registry import SqliteRegistry
from vmlend.registry.topocache import COPY_SUFFIX
from vmlend.topology.chunked import CHUNK_BYTES
from vmlend.topology.model import GiB, Holder
from vmlend.wiring.fabric import init_fabric

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
    # and no copy of the topology beside the state (a new host's view): the pieces are read
    path.with_name(path.name + COPY_SUFFIX).unlink(missing_ok=True)


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


def test_runtime_data_nested_thousands_deep_is_one_record_error(held):
    deep = '{"start": ' + "[" * 100_000 + "]" * 100_000 + "}"
    _damage(held, "UPDATE runtime SET data = ? WHERE fdid = 16", deep)
    with pytest.raises(StateRecordError, match="runtime record 0x10/dma-window/0 is damaged"):
        _read(held, lambda tx: tx.runtime(0x10))
    args = ["--state", str(held), "--node", "gamma", "status", "-c", "sim:///gamma"]
    line = one_line(CliRunner().invoke(main, args))
    assert "runtime record 0x10/dma-window/0 is damaged" in line and "nests deeper" in line


def test_the_cli_prints_a_damaged_record_as_one_line(held):
    _damage(held, "UPDATE holds SET guest_ram = 'lots' WHERE fdid = 16")
    line = one_line(CliRunner().invoke(main, ["--state", str(held), "devices"]))
    assert "hold record 0x10 is damaged" in line and "guest_ram" in line


# --- the etcd backend: one typed error per damaged value, and release frees what it can -------

DAMAGE = [b"not json", b"\xff\xfe", b"[]", b'{"fdid": "x"}', b'{"fdid": 16, "node": 5}', b"{}"]
DAMAGE += [b'{"fdid": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"]  # deeper than msgspec follows


def _put_raw(url: str, key: str, value: bytes) -> None:
    from vmlend.registry import parse_location
    from vmlend.registry.etcd_gateway import EtcdGateway, b64

    gw = EtcdGateway(parse_location(url).endpoints)
    try:
        gw.call("kv/put", {"key": b64(key), "value": b64(value)})
    finally:
        gw.close()


@pytest.mark.parametrize("value", DAMAGE)
def test_a_damaged_etcd_hold_is_one_record_error(etcd_url, value):
    from vmlend.registry import parse_location
    from vmlend.registry.etcd_keys import Keys

    fab = make_fabric(etcd_url)
    try:
        fab.reserve(0x10, WEB)
        _put_raw(etcd_url, Keys(parse_location(etcd_url).cluster).hold(0x10), value)
        for read in (lambda tx: tx.hold(0x10), lambda tx: tx.holds()):
            with fab.registry.read() as tx, pytest.raises(StateRecordError, match="hold record"):
                read(tx)
    finally:
        fab.close()


def test_release_frees_every_device_it_can_when_one_record_is_damaged(etcd_url):
    """A VM holds 0x10 and 0x20; 0x10's hold is damaged. Its release hook returns 0x20 and
    reports 0x10 in one line (exit 1), instead of failing before it freed anything."""
    import io

    from tests.support.simcluster import domain_of
    from vmlend.hook.main import run
    from vmlend.registry import parse_location
    from vmlend.registry.etcd_keys import Keys
    from vmlend.wiring.fabric import open_fabric

    make_fabric(etcd_url).close()
    xml = domain_of("vm1", "6f1c5a2e-0000-4000-8000-000000000001", (0x10, 0x20))
    env = {"VMLEND_REGISTRY": etcd_url, "VMLEND_NODE": "gamma"}

    def hook(op: str, sub: str) -> tuple[int, str]:
        err = io.StringIO()
        argv = ["vm1", op, sub, "-"]
        code = run(argv, stdin=io.BytesIO(xml), stdout=io.BytesIO(), stderr=err, environ=env)
        return code, err.getvalue()

    assert hook("prepare", "begin") == (0, "")
    _put_raw(etcd_url, Keys(parse_location(etcd_url).cluster).hold(0x10), b"not json")
    code, err = hook("release", "end")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "0x10" in err and "damaged" in err and "Traceback" not in err
    with open_fabric(etcd_url, "gamma") as fabric:
        assert fabric.device(0x20).holder is None  # freed despite 0x10


def test_a_damaged_topology_in_the_state_is_blamed_on_the_state_not_on_the_default_file(held):
    # a topology row as written before generations (schema 5), its text damaged
    _damage(held, "UPDATE topology SET head = NULL, text = ?, compiled = NULL", "garbage = [")
    r = CliRunner().invoke(main, ["--state", str(held), "devices"])
    line = one_line(r)
    assert r.exit_code == 1 and "the state's copy of" in line and "fabric init" in line
    assert not line.startswith("Error: <builtin")


@pytest.mark.parametrize(
    "sql",
    [
        "UPDATE topology_pieces SET data = x'00' || data",  # a byte more
        "DELETE FROM topology_pieces",  # no piece at all
        "UPDATE topology_pieces SET generation = 'f00d'",  # another generation's
        "UPDATE topology_pieces SET n = n + 1",  # numbered from 1: piece 0 missing
        "UPDATE topology SET head = 'not json'",
    ],
)
def test_a_damaged_topology_generation_is_one_line_naming_the_topology(held, sql):
    _damage(held, sql)
    r = CliRunner().invoke(main, ["--state", str(held), "devices"])
    line = one_line(r)
    assert "topology" in line and "vmlend fabric init --replace" in line, line


def _damaged_copy(tmp_path):
    """A 16-node state listed once (its copy written), then a byte of the copy's last device
    record damaged: chunks past the first, which only a listing of every device reads."""
    state = tmp_path / "s.db"
    init_fabric(state, fabric_topology(16, 16), "f.toml", node="n0")
    first = CliRunner().invoke(main, ["--state", str(state), "devices", "--json"])
    assert first.exit_code == 0, first.output
    copy = state.with_name(state.name + COPY_SUFFIX)
    data = bytearray(copy.read_bytes())
    # the compiled topology's last device record, before the TOML that follows it
    at = data.rindex(b"0000:01:0f.0", 0, data.index(b'name = "generated"'))
    assert at > 2 * CHUNK_BYTES
    data[at + 3] ^= 0x20
    copy.write_bytes(bytes(data))
    return state, copy, first.output


def test_a_damaged_chunk_of_the_topologys_copy_is_read_from_the_state_instead(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="vmlend.registry.topocache")
    state, copy, listed = _damaged_copy(tmp_path)
    r = CliRunner().invoke(main, ["--state", str(state), "devices", "--json"])
    assert r.exit_code == 0 and r.output == listed, r.output
    assert not copy.exists() and "copy of the topology" in caplog.text  # logged (INFO)
    again = CliRunner().invoke(main, ["--state", str(state), "devices", "--json"])
    assert again.exit_code == 0 and again.output == listed
    assert copy.exists()  # written again from the pieces


def test_a_damaged_copy_that_cannot_be_removed_is_a_warning_naming_what_to_do(
    tmp_path, caplog, monkeypatch
):
    """Read past, the command still succeeds; but every later process would meet the copy
    again until its owner removes it, so that one is said above INFO."""
    state, copy, listed = _damaged_copy(tmp_path)
    real_unlink = Path.unlink

    def refuse(self: Path, missing_ok: bool = False) -> None:
        if self == copy:
            raise PermissionError(1, "Operation not permitted")
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse)
    caplog.set_level(logging.WARNING, logger="vmlend.registry.topocache")
    r = CliRunner().invoke(main, ["--state", str(state), "devices", "--json"])
    assert r.exit_code == 0 and r.output == listed, r.output
    warned = [rec for rec in caplog.records if rec.levelno == logging.WARNING]
    assert warned and "remove it as its owner" in warned[0].getMessage()


def test_a_damaged_copy_of_a_topology_the_state_no_longer_holds_is_one_line(tmp_path):
    state, copy, _listed = _damaged_copy(tmp_path)
    kept = copy.read_bytes()
    _damage(state, "UPDATE topology_pieces SET n = n + 100")  # the pieces gone
    copy.write_bytes(kept)  # and the damaged copy kept
    r = CliRunner().invoke(main, ["--state", str(state), "devices"])
    line = one_line(r)
    assert r.exit_code == 1 and "copy of the topology" in line and "is damaged" in line, line
    assert "run the command again" in line and "it was removed" in line and not copy.exists()


# --- a claim read before and changed since: read as it is now ------------------------------
# (An open registry keeps the claims it decoded, by their stored form: a changed or damaged
# one must never be answered from what it was.)


def _claims_on(reg, adapter: str):
    with reg.read() as tx:
        return {(f, c.kind.value): c for f, c in tx.claims_on([adapter])}


def test_a_claim_changed_under_an_open_sqlite_state_is_read_as_it_now_is(held):
    reg = SqliteRegistry.open(held)
    try:
        before = _claims_on(reg, "alpha:0")
        assert before[(0x10, "lut")].entries == 1
        _damage(held, "UPDATE claims SET entries = 3 WHERE fdid = 16 AND adapter = 'alpha:0'")
        assert _claims_on(reg, "alpha:0")[(0x10, "lut")].entries == 3
        _damage(held, "UPDATE claims SET entries = 'x' WHERE fdid = 16 AND adapter = 'alpha:0'")
        with pytest.raises(StateRecordError, match="claim record 0x10 on 'alpha:0' is damaged"):
            _claims_on(reg, "alpha:0")
    finally:
        reg.close()


def _head_on(etcd_url: str, adapter: str) -> tuple[str, dict]:
    """The key and value of the unit block of ``adapter`` that carries its VM's claims there
    (layout 5: its head)."""
    import json

    from vmlend.registry import parse_location
    from vmlend.registry.etcd_gateway import EtcdGateway, prefix_end
    from vmlend.registry.etcd_keys import Keys

    loc = parse_location(etcd_url)
    prefix = Keys(loc.cluster).units_of(adapter)
    gw = EtcdGateway(loc.endpoints)
    try:
        _rev, kvs = gw.range(prefix, prefix_end(prefix))
    finally:
        gw.close()
    return next((kv.key, d) for kv in kvs if "claims" in (d := json.loads(kv.value)))


def _with_claim(head: dict, kind: str, **change: object) -> bytes:
    import json

    claims = [{**c, **change} if c["kind"] == kind else c for c in head["claims"]]
    return json.dumps({**head, "claims": claims}).encode()


def test_a_claim_changed_under_an_open_etcd_registry_is_read_as_it_now_is(etcd_url):
    fab = make_fabric(etcd_url)
    try:
        # with guest RAM: its DMA window is the VM's block on the lender's adapter, whose
        # head carries the claims (its requester entry there is the lender's lent entry)
        fab.reserve(0x10, WEB, guest_ram=GiB)
        assert _claims_on(fab.registry, "alpha:0")[(0x10, "dma")].segments == 1
        key, head = _head_on(etcd_url, "alpha:0")
        _put_raw(etcd_url, key, _with_claim(head, "dma", segments=3))
        assert _claims_on(fab.registry, "alpha:0")[(0x10, "dma")].segments == 3
        _put_raw(etcd_url, key, _with_claim(head, "dma", segments="x"))
        with pytest.raises(StateRecordError, match="claim record"):
            _claims_on(fab.registry, "alpha:0")
    finally:
        fab.close()


# --- a negative amount is damage, never room --------------------------------------------------


@pytest.mark.parametrize("column", ["entries", "segments", "bytes"])
def test_a_claim_of_a_negative_amount_in_sqlite_is_a_damaged_record(held, column):
    """Counted as it is, -5 LUT entries would show five more free than the adapter has."""
    _damage(held, f"UPDATE claims SET {column} = -5 WHERE fdid = 16 AND adapter = 'alpha:0'")
    reg = SqliteRegistry.open(held)
    try:
        with pytest.raises(StateRecordError, match="claim record 0x10 on 'alpha:0' is damaged"):
            _claims_on(reg, "alpha:0")
    finally:
        reg.close()


@pytest.mark.parametrize("field", ["entries", "segments", "bytes"])
def test_a_claim_of_a_negative_amount_in_etcd_is_a_damaged_record(etcd_url, field):
    fab = make_fabric(etcd_url)
    try:
        fab.reserve(0x10, WEB, guest_ram=GiB)
        key, head = _head_on(etcd_url, "alpha:0")
        _put_raw(etcd_url, key, _with_claim(head, "dma", **{field: -5}))
        with pytest.raises(StateRecordError, match="claim record"):
            _claims_on(fab.registry, "alpha:0")
    finally:
        fab.close()


def test_a_command_that_fails_after_reading_past_a_damaged_copy_says_one_line(tmp_path):
    """A process run apart (as an operator runs it: the CLI's own logging, not pytest's)
    that reads past a damaged chunk and then fails for its own reason prints its error
    alone; the copy is removed all the same."""
    state, copy, _listed = _damaged_copy(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMLEND_")}
    r = subprocess.run(
        [VMLEND, "--state", str(state), "devices", "--kind", "bogus"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 1, r.stderr
    [line] = r.stderr.splitlines()
    assert line.startswith("Error: no device of kind 'bogus'"), line
    assert not copy.exists()


def test_a_damaged_ledger_in_a_vm_marker_is_one_error_naming_the_marker(etcd_url):
    """Layout 5 keeps a VM's claims in its marker's ledger: a claim there without its
    adapter makes the VM's next reserve refuse in one error naming the marker, not a
    KeyError traceback; other VMs are unaffected."""
    import json

    from vmlend.registry import parse_location
    from vmlend.registry.etcd_gateway import EtcdGateway
    from vmlend.registry.etcd_keys import Keys

    fab = make_fabric(etcd_url)
    loc = parse_location(etcd_url)
    key = Keys(loc.cluster).vm_holds(WEB.node, WEB.vm)
    gw = EtcdGateway(loc.endpoints)
    try:
        fab.reserve(0x10, WEB)
        marker = json.loads(gw.range(key)[1][0].value)
        marker["ledger"]["0x10"] = [{"kind": "lut", "share": "x", "entries": 1}]
        _put_raw(etcd_url, key, json.dumps(marker).encode())
        with pytest.raises(StateRecordError, match=r"VM marker record .*held-vm/gamma/"):
            fab.reserve(0x11, WEB)
        assert fab.reserve(0x11, Holder("gamma", "db")).created
    finally:
        gw.close()
        fab.close()
