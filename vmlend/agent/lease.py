"""One etcd lease for a host: grant, keep alive, revoke (over the registry's gateway)."""

from __future__ import annotations

import logging

from vmlend.registry.etcd_gateway import EtcdGateway, KeyValue, b64, prefix_end
from vmlend.registry.etcd_keys import Keys, dump, load

log = logging.getLogger(__name__)


class LeaseLost(Exception):
    """etcd no longer knows the lease: it expired (the agent was frozen or cut off too long)."""


class SessionLease:
    def __init__(self, gateway: EtcdGateway, ttl: int) -> None:
        self._gw = gateway
        answer = gateway.call("lease/grant", {"TTL": ttl, "ID": 0})
        self.id = int(answer["ID"])
        self.ttl = int(answer.get("TTL", ttl))  # etcd may grant more than asked (minimum 2 s)

    def refresh(self) -> int:
        """One keepalive; the TTL etcd restarted. ``LeaseLost`` when the lease is gone."""
        answer = self._gw.call("lease/keepalive", {"ID": self.id})
        ttl = int(answer.get("result", {}).get("TTL", -1))
        if ttl <= 0:
            raise LeaseLost(f"lease {self.id:x} expired")
        return ttl

    def put(self, key: str, value: bytes) -> None:
        """A key that lives as long as the lease."""
        self._gw.call("kv/put", {"key": b64(key), "value": b64(value), "lease": self.id})

    def revoke(self) -> None:
        self._gw.call("kv/lease/revoke", {"ID": self.id})


#: Keys moved per Txn: a compare and a put each, under etcd's default --max-txn-ops (128).
_ADOPT_BATCH = 60


def adopt_records(gateway: EtcdGateway, keys: Keys, old: int, new: int) -> int:
    """Move the records of lease ``old`` (this host's agent that died before its TTL ran out)
    to lease ``new``, fence tokens included, so the holds of the VMs still running here do not
    vanish when ``old`` expires. A key changed since it was read is left alone (its writer
    decided). Returns how many keys moved."""
    _rev, kvs = gateway.range(keys.base, prefix_end(keys.base))
    moves: list[tuple[KeyValue, bytes, int]] = []  # (read as, new value, new lease)
    held = set()  # the devices whose holds move: their fences take the new token
    for kv in kvs:
        if kv.lease == old:
            moves.append((kv, kv.value, new))
            if kv.key.startswith(keys.holds):
                held.add(kv.key.removeprefix(keys.holds))
    for kv in kvs:
        if kv.key.removeprefix(keys.fences) in held and kv.key.startswith(keys.fences):
            fence = load(kv.value)
            if fence.get("token") == old:
                moves.append((kv, dump({**fence, "token": new}), 0))
    moved = 0
    for i in range(0, len(moves), _ADOPT_BATCH):
        compare, success = [], []
        for kv, value, lease in moves[i : i + _ADOPT_BATCH]:
            compare.append(
                {
                    "key": b64(kv.key),
                    "target": "MOD",
                    "result": "EQUAL",
                    "mod_revision": kv.mod_revision,
                }
            )
            put: dict[str, object] = {"key": b64(kv.key), "value": b64(value)}
            if lease:
                put["lease"] = lease
            success.append({"request_put": put})
        ok, _ = gateway.txn(compare, success)
        if ok:
            moved += len(success)
        else:  # someone wrote meanwhile: move those that still are as read, one by one
            for c, s in zip(compare, success, strict=True):
                ok, _ = gateway.txn([c], [s])
                moved += ok
    return moved
