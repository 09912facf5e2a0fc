"""``vmlend registry upgrade``: a stored cluster of an older etcd layout brought to this
vmlend's, with every agent's lease ended; refused in one line while one lives (also when an
agent starts during the upgrade), for a newer layout and for SQLite; running it again changes
nothing."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner, Result

from tests.support.older_state import etcd_before_generations, etcd_layout_3
from vmlend.cli import main
from vmlend.registry import etcd_keys as enc
from vmlend.registry import open_registry, parse_location, topopieces
from vmlend.registry import upgrade as upgrade_mod
from vmlend.registry.etcd_gateway import b64, prefix_end
from vmlend.registry.etcd_keys import Keys
from vmlend.registry.location import _gateway
from vmlend.registry.schema import ETCD_SCHEMA_VERSION
from vmlend.wiring.fabric import default_topology_text, open_fabric


def _run(url: str, *args: str) -> Result:
    return CliRunner().invoke(main, ["--registry", url, "registry", "upgrade", *args])


def _stored(url: str) -> dict[str, tuple[bytes, int]]:
    """Every key of the cluster: its value and mod revision."""
    keys = Keys(parse_location(url).cluster)
    gw = _gateway(parse_location(url))
    try:
        _rev, kvs = gw.range(keys.base, prefix_end(keys.base))
    finally:
        gw.close()
    return {kv.key: (kv.value, kv.mod_revision) for kv in kvs}


def _put(url: str, key: str, value: bytes, lease: int = 0) -> None:
    gw = _gateway(parse_location(url))
    try:
        body = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = lease
        gw.call("kv/put", body)
    finally:
        gw.close()


def _layout2(url: str) -> Keys:
    """A cluster as a vmlend of layout 2 left it, its agents stopped: the topology in one
    record, a device unlent, and the fence a lapsed hold left (records without a lease)."""
    text, source = default_topology_text()
    etcd_before_generations(url, text, source)
    keys = Keys(parse_location(url).cluster)
    fence = {"fdid": 0x10, "node": "gamma", "vm": "web", "vm_uuid": "", "token": 7}
    _put(url, keys.fence(0x10), json.dumps(fence).encode())
    device = {"fdid": 0x11, "lender": "alpha", "lent": False, "available": True}
    _put(url, keys.device(0x11), json.dumps(device).encode())
    return keys


@pytest.mark.parametrize("version", [1, 2, 3])
def test_an_older_cluster_is_upgraded_once_and_keeps_its_records(etcd_url, version, monkeypatch):
    """Layouts 1 and 2 (the version was SQLite's then: the same etcd records) keep the topology
    in one record, layout 3 in a generation of format 1 (read whole); after the upgrade it is
    a generation of format 2, and the records without a lease are as they were (4 -> 5 finds
    no hold to delete)."""
    if version == 3:
        with etcd_layout_3(monkeypatch):  # layout 2 upgraded by a vmlend of layout 3
            keys = _layout2(etcd_url)
            assert _run(etcd_url).exit_code == 0
        head = _stored(etcd_url)[keys.topology_head][0]
        assert topopieces.decode_head(head, "head").format == topopieces.PIECES_FORMAT_1
    else:
        keys = _layout2(etcd_url)
        _put(etcd_url, keys.meta("schema_version"), str(version).encode())
    before = _stored(etcd_url)
    r = _run(etcd_url, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    latest = ETCD_SCHEMA_VERSION
    assert (out["action"], out["before"], out["after"]) == ("upgraded", version, latest)
    # 2 -> 3 installs a generation of this vmlend's format, so it reaches layout 4 at once
    assert [step.split(":")[0] for step in out["steps"]] == {
        1: ["1 -> 2", "2 -> 4", "4 -> 5", "5 -> 6", "6 -> 7", "7 -> 8"],
        2: ["2 -> 4", "4 -> 5", "5 -> 6", "6 -> 7", "7 -> 8"],
        3: ["3 -> 4", "4 -> 5", "5 -> 6", "6 -> 7", "7 -> 8"],
    }[version]
    after = _stored(etcd_url)
    assert keys.topology_record not in after
    head = topopieces.decode_head(after[keys.topology_head][0], "head")
    assert head.format == topopieces.PIECES_FORMAT
    assert after[keys.meta("schema_version")][0] == str(latest).encode()
    for kept in (keys.fence(0x10), keys.device(0x11)):
        assert after[kept] == before[kept]  # not even rewritten
    assert after[keys.topology_digest][0] == before[keys.topology_digest][0]
    with open_fabric(etcd_url, "gamma") as fabric:
        assert len(fabric.devices()) == 9
    with open_registry(etcd_url) as reg, reg.read() as tx:
        assert tx.fence(0x10) is not None and tx.hold(0x10) is None
        device = tx.device(0x11)
        assert device is not None and not device.lent

    again = _run(etcd_url, "--json")
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["action"] == "unchanged"
    assert _stored(etcd_url) == after  # nothing written
    text = _run(etcd_url)
    assert text.exit_code == 0 and "nothing to upgrade" in text.stdout, text.output


def _layout4_leftovers(url: str, keys: Keys) -> list[str]:
    """What a layout-4 vmlend writing without a lease (no agent) left of a hold of 0x12 by
    gamma's VM db: its hold, fence, index entry, claim, unit block and VM marker."""
    fence = {"fdid": 0x12, "node": "gamma", "vm": "db", "vm_uuid": "", "token": 0}
    _put(url, keys.fence(0x12), json.dumps(fence).encode())
    left = [
        keys.hold(0x12),
        keys.base + "held-on/gamma/0x12",
        keys.base + "claims/alpha:0/0x12/0",
        keys.unit_block("alpha:0", "lut", 18, 1),
        keys.vm_holds("gamma", "db"),
    ]
    for key in left:
        _put(url, key, b"{}")
    return left


def test_a_layout_4_cluster_is_refused_until_upgraded_and_its_lapsed_holds_go(etcd_url):
    """A vmlend of layout 5 does not read layout 4's claims (one key each) nor its nodes'
    indexes, so it opens such a cluster only to upgrade it: anything else is refused in one
    line that says what to run. The upgrade deletes what was left of holds without a lease
    and keeps their fences, so the lenders take the devices back."""
    keys = _layout2(etcd_url)
    assert _run(etcd_url).exit_code == 0  # layout 8 now: made layout 4 again below
    _put(etcd_url, keys.meta("schema_version"), b"4")
    left = _layout4_leftovers(etcd_url, keys)
    status = CliRunner().invoke(main, ["--registry", etcd_url, "devices"])
    assert status.exit_code != 0
    lines = status.stderr.strip().splitlines()
    assert len(lines) == 1 and "has layout 4" in lines[0], status.output
    assert "'vmlend registry upgrade'" in lines[0] and "Traceback" not in status.output
    r = _run(etcd_url, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert (out["before"], out["after"]) == (4, 8)
    assert "5 record(s)" in out["steps"][0], out["steps"]
    after = _stored(etcd_url)
    assert not set(left) & set(after)
    assert keys.fence(0x12) in after and keys.fence(0x10) in after
    with open_registry(etcd_url) as reg, reg.read() as tx:
        assert tx.hold(0x12) is None and tx.fence(0x12) is not None
        assert tx.claims() == []


def test_a_layout_5_cluster_is_refused_until_upgraded(etcd_url):
    """A vmlend of layout 5 takes its VMs' unit blocks on their own node's places, where
    layout 6 decides by count within the node's extents: a layout-5 cluster is opened only to
    be upgraded, and the upgrade deletes what was left without a lease."""
    keys = _layout2(etcd_url)
    assert _run(etcd_url).exit_code == 0
    _put(etcd_url, keys.meta("schema_version"), b"5")
    left = [keys.unit_block("gamma:0", "seg", 4, 2), keys.vm_holds("gamma", "db")]
    for key in left:
        _put(etcd_url, key, b"{}")
    status = CliRunner().invoke(main, ["--registry", etcd_url, "devices"])
    assert status.exit_code != 0
    lines = status.stderr.strip().splitlines()
    assert len(lines) == 1 and "has layout 5" in lines[0], status.output
    r = _run(etcd_url, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert (out["before"], out["after"]) == (5, 8)
    assert "2 record(s)" in out["steps"][0], out["steps"]
    assert not set(left) & set(_stored(etcd_url))


def test_a_layout_6_cluster_is_refused_until_upgraded(etcd_url):
    """A vmlend of layout 6 takes a VM's blocks for a lent device's requester entries and
    does not count the lender's lent entries, which layout 7's holds use instead: a
    layout-6 cluster is opened only to be upgraded, and the upgrade deletes what was left
    without a lease (a node's extents too: no hold needs them)."""
    keys = _layout2(etcd_url)
    assert _run(etcd_url).exit_code == 0
    _put(etcd_url, keys.meta("schema_version"), b"6")
    left = [keys.unit_block("alpha:0", "lut", 0, 1), keys.vm_holds("gamma", "db")]
    for key in left:
        _put(etcd_url, key, b"{}")
    status = CliRunner().invoke(main, ["--registry", etcd_url, "devices"])
    assert status.exit_code != 0
    lines = status.stderr.strip().splitlines()
    assert len(lines) == 1 and "has layout 6" in lines[0], status.output
    r = _run(etcd_url, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert (out["before"], out["after"]) == (6, 8)
    assert "2 record(s)" in out["steps"][0], out["steps"]
    assert not set(left) & set(_stored(etcd_url))


def test_a_layout_7_cluster_is_refused_until_upgraded_and_keeps_what_has_no_lease(etcd_url):
    """A vmlend of layout 7 neither parses a VM's run of units nor compares one when it
    takes units inside the block that names it: a layout-7 cluster is opened only to be
    upgraded. What layout 7 keeps without a lease (a lender's lent entry, a node's extent)
    is layout 8's too, so the upgrade keeps it."""
    keys = _layout2(etcd_url)
    assert _run(etcd_url).exit_code == 0
    _put(etcd_url, keys.meta("schema_version"), b"7")
    kept = {
        keys.unit_block("alpha:0", "lut", 3, 1): enc.lent_to_json("alpha", "req:alpha/x"),
        keys.unit_block("gamma:0", "seg", 0, 4): enc.extent_to_json("gamma"),
    }
    for key, value in kept.items():
        _put(etcd_url, key, value)
    status = CliRunner().invoke(main, ["--registry", etcd_url, "devices"])
    assert status.exit_code != 0
    lines = status.stderr.strip().splitlines()
    assert len(lines) == 1 and "has layout 7" in lines[0], status.output
    r = _run(etcd_url, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert (out["before"], out["after"]) == (7, 8)
    assert out["steps"] == [
        "7 -> 8: no record changes (a VM's window segments may be one run from now on)"
    ], out["steps"]
    assert set(kept) <= set(_stored(etcd_url))


def test_a_live_agent_refuses_the_upgrade_in_one_line_and_nothing_changes(etcd, etcd_url):
    keys = _layout2(etcd_url)
    lease = _grant(etcd_url)
    _put(etcd_url, keys.host("alpha"), b"1", lease)
    before = _stored(etcd_url)
    r = _run(etcd_url, "--json")
    assert r.exit_code != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "agents of alpha have a live lease" in lines[0], r.output
    assert "vmlend registry upgrade" in lines[0] and "Traceback" not in r.output
    assert _stored(etcd_url) == before


def test_an_agent_that_starts_during_the_upgrade_makes_it_refuse(etcd_url, monkeypatch):
    """The step's transaction compares the agents' prefix it read: an agent whose lease
    appears between that read and the commit makes it run again and be refused."""
    keys = _layout2(etcd_url)
    step = upgrade_mod.STEPS[2]
    started: list[int] = []

    def step_while_an_agent_starts(tx):
        out = step(tx)
        if not started:
            started.append(_grant(etcd_url))
            _put(etcd_url, keys.host("beta"), b"1", started[0])
        return out

    monkeypatch.setitem(upgrade_mod.STEPS, 2, step_while_an_agent_starts)
    r = _run(etcd_url)
    assert r.exit_code != 0 and "agents of beta have a live lease" in r.stderr, r.output
    after = _stored(etcd_url)
    assert after[keys.meta("schema_version")][0] == b"2"
    assert keys.topology_record in after and keys.topology_head not in after


def test_a_newer_layout_and_an_sqlite_state_are_refused_in_one_line(etcd_url, tmp_path):
    keys = _layout2(etcd_url)
    _put(etcd_url, keys.meta("schema_version"), b"99")
    r = _run(etcd_url)
    assert r.exit_code != 0 and "newer than this vmlend" in r.stderr, r.output
    assert len(r.stderr.strip().splitlines()) == 1
    sqlite = _run(str(tmp_path / "state.db"))
    assert sqlite.exit_code != 0 and "is for a cluster registry" in sqlite.stderr, sqlite.output
    assert len(sqlite.stderr.strip().splitlines()) == 1


def test_an_empty_cluster_is_refused_in_one_line(etcd_url):
    r = _run(etcd_url)
    assert r.exit_code != 0 and "no vmlend state" in r.stderr, r.output


def _grant(url: str, ttl: int = 600) -> int:
    gw = _gateway(parse_location(url))
    try:
        return int(gw.call("lease/grant", {"TTL": ttl, "ID": 0})["ID"])
    finally:
        gw.close()


@pytest.fixture(autouse=True)
def _no_prompt(monkeypatch):
    monkeypatch.delenv("VMLEND_REGISTRY", raising=False)
