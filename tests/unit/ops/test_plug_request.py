"""Serving a plug request (``vmlend.ops.plug_request``) on a simulated node: the destination
plugs the devices only into the VM the request names, by name and UUID. The requests' path
through etcd and the agent is tests/unit/agent/test_agent_plug.py's."""

from __future__ import annotations

import uuid

from vmlend.ops.live_state import LiveDevice
from vmlend.ops.plug_request import PlugOutcome, PlugRequest, serve_plug_request

VM_UUID = uuid.UUID("5c1e0000-0000-4000-8000-000000000001")


def request(vm_uuid: uuid.UUID) -> PlugRequest:
    return PlugRequest("req-1", "vm1", str(vm_uuid), "beta", "gamma", [LiveDevice(0x10)])


def test_a_vm_of_the_same_name_but_another_uuid_gets_nothing(cluster):
    cluster.define("beta", "vm1", running=True, vm_uuid=uuid.uuid4())  # not the migrated VM
    with cluster.fabric("beta") as f:
        outcome = serve_plug_request(cluster.hv("beta"), f, request(VM_UUID))
    assert [(o.fdid, o.plugged) for o in outcome] == [(0x10, False)]
    assert outcome[0].reason is not None
    assert outcome[0].reason.startswith("VM 'vm1' on beta is another VM (UUID ")
    assert outcome[0].reason.endswith(f", not {VM_UUID})")
    assert cluster.holds() == {} and cluster.mdevs("beta") == set()


def test_the_vm_the_request_names_gets_its_devices(cluster):
    cluster.define("beta", "vm1", running=True, vm_uuid=VM_UUID)
    with cluster.fabric("beta") as f:
        outcome = serve_plug_request(cluster.hv("beta"), f, request(VM_UUID))
    assert outcome == [PlugOutcome(0x10, True)]
    assert cluster.holds() == {0x10: "beta/vm1"}


def test_a_plug_request_matches_only_the_registrys_record_of_its_migration():
    """The policy the destination's agent applies before it reserves anything
    (``vmlend.ops.migration_record.refusal``): every field of the record must agree."""
    from vmlend.ops.migration_record import MigrationRecord, refusal

    uid = str(VM_UUID)
    record = MigrationRecord("vm1", uid, "gamma", "beta", {0x10: 7, 0x12: 9})
    ask = {"vm": "vm1", "vm_uuid": uid, "source": "gamma", "destination": "beta"}
    assert refusal(record, **ask, tokens={0x10: 7}) is None
    assert refusal(record, **ask | {"vm_uuid": uid.upper()}, tokens={0x12: 9}) is None
    refused = {
        "no record": refusal(None, **ask, tokens={0x10: 7}),
        "source": refusal(record, **ask | {"source": "alpha"}, tokens={0x10: 7}),
        "destination": refusal(record, **ask | {"destination": "alpha"}, tokens={0x10: 7}),
        "name": refusal(record, **ask | {"vm": "vm2"}, tokens={0x10: 7}),
        "uuid": refusal(record, **ask | {"vm_uuid": str(uuid.uuid4())}, tokens={0x10: 7}),
        "device": refusal(record, **ask, tokens={0x21: 7}),
        "token": refusal(record, **ask, tokens={0x10: 8}),
    }
    for why, line in refused.items():
        assert line is not None and "\n" not in line, why
        assert line.endswith("nothing was plugged"), why
    assert "in progress" in str(refused["no record"])
    assert "0x21" in str(refused["device"]) and "token 8" in str(refused["token"])
