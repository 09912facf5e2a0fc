"""Records kept as JSON keep their bytes: the agent's lease file and the NVMe ledger's runtime
records were written from ``msgspec.structs.asdict`` and are now from ``msgspec.to_builtins``;
a reader of an older file or row must see the very same text."""

from __future__ import annotations

import json
import sqlite3

import msgspec

from tests.support.simfabric import make_fabric
from vmlend.ledger import nvmeshares as ledger
from vmlend.registry import hostlease
from vmlend.registry.etcd_keys import dump
from vmlend.registry.records import Claim, ClaimKind
from vmlend.sim.nvmedrive import drive_geometry
from vmlend.topology.model import Holder

NVME = 0x12


def test_the_agent_lease_file_keeps_its_text(tmp_path):
    path = tmp_path / "run" / "vmlend" / "agent.lease"
    lease = hostlease.HostLease(7, "gamma", 10, 4242)
    hostlease.publish(path, lease)
    assert path.read_text() == '{"lease": 7, "node": "gamma", "ttl": 10, "pid": 4242}'
    assert hostlease.read(path) == lease


def test_the_nvme_ledger_rows_keep_their_text(state_path):
    fab = make_fabric(state_path)
    try:
        geometry = drive_geometry(fab.topology().device(NVME), 1 << 20)
        ledger.lend_shared(fab.registry, NVME, geometry)
        holder = Holder("gamma", "a", "u-1")
        share = ledger.reserve_share(fab.registry, NVME, holder, 4, 1000)
    finally:
        fab.close()
    with sqlite3.connect(state_path) as db:
        rows = dict(db.execute("SELECT kind, data FROM runtime WHERE fdid = ?", (NVME,)))
    assert len(rows) == 2
    geometry_row = rows.pop(ledger.GEOMETRY_RECORD)
    assert geometry_row == json.dumps(msgspec.structs.asdict(geometry), sort_keys=True)
    (share_row,) = rows.values()
    stored = json.loads(share_row)
    assert stored["holder"] == {"node": "gamma", "vm": "a", "vm_uuid": "u-1"}
    assert stored["share"] == share.record()
    old = {
        "holder": msgspec.structs.asdict(holder),
        "share": share.record(),
        "claims": [msgspec.structs.asdict(Claim(**c)) for c in stored["claims"]],
    }
    assert share_row == json.dumps(old, sort_keys=True)


def test_a_claim_encodes_the_same_both_ways_on_etcd():
    for kind in ClaimKind:
        claim = Claim("gamma:0", kind, "dev:18", 1, 2, 3)
        assert dump(msgspec.to_builtins(claim)) == dump(msgspec.structs.asdict(claim))
