"""A VM's marker (``held-vm/<node>/<digest>``) lists its holds, so that a reserve or a release
reads its own VM's records and not every VM's of its node; the markers of a node are its index
of holds. On a real etcd."""

from __future__ import annotations

import json

from tests.support.simfabric import fabric_topology
from vmlend.registry.etcd_gateway import EtcdGateway, b64
from vmlend.topology.model import Holder
from vmlend.wiring.fabric import init_fabric, open_fabric

APP = Holder("n0", "app", "33333333-3333-3333-3333-333333333333")


def _fabric(url: str, devices: int = 8):
    init_fabric(url, fabric_topology(2, devices), "gen.toml", node="n0")
    return open_fabric(url, "n0")


def _holds_of(f, holder: Holder) -> list[int]:
    with f.registry.read() as tx:
        return sorted(tx.holds_of(holder))


def _rewrite_marker(f, holder: Holder, **fields) -> None:
    """The VM's marker rewritten with ``fields`` (on the lease it has)."""
    key = f.registry.keys.vm_holds(holder.node, holder.vm)
    with f.registry.read() as tx:
        raw = tx._get(key)
    marker = {**json.loads(raw), **fields}
    for name in [k for k, v in fields.items() if v is None]:
        marker.pop(name)
    body = {"key": b64(key), "value": b64(json.dumps(marker)), "ignore_lease": True}
    f.registry.gateway.call("kv/put", body)


def test_a_reserve_and_release_read_no_more_on_a_node_crowded_with_vms(etcd_url, monkeypatch):
    read: list[int] = []
    real_call = EtcdGateway.call

    def counting(self, path, body):
        answer = real_call(self, path, body)
        read.append(len(json.dumps(answer)))
        return answer

    f = _fabric(etcd_url, devices=101)
    probe = Holder("n0", "probe")
    monkeypatch.setattr(EtcdGateway, "call", counting)

    def cycle() -> int:
        read.clear()
        f.reserve(0x200, probe)
        f.release(0x200, probe)
        return sum(read)

    cycle()  # the probe's marker is made
    alone = cycle()
    for i in range(100):  # a hundred VMs on n0, each holding one of n0's devices
        f.reserve(0x101 + i, Holder("n0", f"neighbour{i}"))
    crowded = cycle()
    assert crowded < 1.2 * alone, f"{crowded} bytes read with 100 VMs beside, {alone} alone"


def test_a_vms_holds_are_found_through_its_marker(etcd_url):
    f = _fabric(etcd_url)
    for fdid in (0x200, 0x201, 0x202):
        f.reserve(fdid, APP)
    f.release(0x201, APP)
    f.reserve(0x203, Holder("n0", "other"))
    assert _holds_of(f, APP) == [0x200, 0x202]


def test_the_marker_goes_with_the_vms_last_hold(etcd_url):
    """The markers of a node are its index of holds (layout 5): a VM's is made with its first
    hold and deleted with its last, so the index holds no VM that holds nothing."""
    f = _fabric(etcd_url)
    key = f.registry.keys.vm_holds(APP.node, APP.vm)

    def marker() -> dict | None:
        with f.registry.read() as tx:
            raw = tx._get(key)
        return None if raw is None else json.loads(raw)

    f.reserve(0x200, APP)
    f.reserve(0x201, APP)
    assert marker()["fdids"] == ["0x200", "0x201"]
    f.release(0x200, APP)
    assert marker()["fdids"] == ["0x201"]
    f.release(0x201, APP)
    assert marker() is None
    f.reserve(0x201, APP)  # made again, from nothing
    assert _holds_of(f, APP) == [0x201]


def test_a_listed_hold_that_is_another_vms_now_is_not_this_vms(etcd_url):
    """A list that names a hold no longer the VM's (as a damaged or hand-edited marker may):
    a VM of the same name (redefined, another UUID) may hold it since."""
    f = _fabric(etcd_url)
    f.reserve(0x200, APP)
    f.reserve(0x201, APP)
    _rewrite_marker(f, APP, fdids=["0x200", "0x201", "0x202"])  # 0x202: released long ago
    again = Holder("n0", "app", "44444444-4444-4444-4444-444444444444")
    f.reserve(0x202, again)
    assert _holds_of(f, APP) == [0x200, 0x201]
