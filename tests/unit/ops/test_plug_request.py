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
