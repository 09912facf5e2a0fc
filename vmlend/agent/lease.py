"""One etcd lease for a host: grant, keep alive, revoke (over the registry's gateway)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import msgspec

from vmlend.errors import StateError
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
_MOVE_BATCH = 60
#: Re-reads when another writer changed a record between the read and the move.
_MOVE_ATTEMPTS = 5


class LeaseMove(msgspec.Struct):
    """What ``follow_lease`` did: the keys moved, and the old leases found and revoked."""

    moved: int = 0
    old: list[int] = msgspec.field(default_factory=list)
    revoked: list[int] = msgspec.field(default_factory=list)


def _old_leases(kvs: list[KeyValue], keys: Keys, node: str, current: int) -> set[int]:
    """The leases, other than ``current``, that this node's node-scoped records are on (its
    hold index, mdevs, mdev parents): each was an earlier lease of this host."""
    mine = (keys.holds_on(node), keys.mdevs_on(node), f"{keys.parents}{node}/")
    return {kv.lease for kv in kvs if kv.key.startswith(mine) and kv.lease not in (0, current)}


def follow_lease(
    gateway: EtcdGateway, keys: Keys, node: str, current: int, known: Iterable[int] = ()
) -> LeaseMove:
    """Move every record of this host that is attached to an earlier lease (``known``, plus
    any other lease this node's records are on) onto ``current``, fence tokens included, then
    revoke the earlier leases.

    Why: a lease nobody renews ends later (after an etcd outage a returning leader extends it
    by its TTL) and takes its holds with it while this host's VMs still use the devices. With
    up to ``_MOVE_BATCH`` keys (a host's usual load) the move is one Txn; a larger one is
    batched, and a crash between batches leaves the rest for the next start-up, which finds
    the old lease again through this node's records. A record changed since it was read is
    re-read; an old lease is revoked only when nothing of it is left."""
    result = LeaseMove()
    known = {lease for lease in known if lease not in (0, current)}
    for _attempt in range(_MOVE_ATTEMPTS):
        _rev, kvs = gateway.range(keys.base, prefix_end(keys.base))
        old = known | _old_leases(kvs, keys, node, current)
        result.old = sorted(old)
        moves = _moves(kvs, keys, old, current)
        if not moves:
            break
        conflict = False
        for i in range(0, len(moves), _MOVE_BATCH):
            compare, success = [], []
            for kv, value, lease in moves[i : i + _MOVE_BATCH]:
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
                result.moved += len(success)
            else:
                conflict = True
                break
        if not conflict:
            break
    else:
        log.warning("records of leases %s kept changing; left them", result.old)
        return result
    for lease in result.old:
        try:
            gateway.call("kv/lease/revoke", {"ID": lease})
            result.revoked.append(lease)
        except StateError as e:  # already ended: nothing of it is left either way
            log.debug("lease %x not revoked: %s", lease, e)
    return result


def _moves(
    kvs: list[KeyValue], keys: Keys, old: set[int], new: int
) -> list[tuple[KeyValue, bytes, int]]:
    """(read as, new value, new lease) for every key on an ``old`` lease, and the fences of
    the holds among them (their token is the holder's lease)."""
    moves: list[tuple[KeyValue, bytes, int]] = []
    held = set()
    for kv in kvs:
        if kv.lease in old:
            moves.append((kv, kv.value, new))
            if kv.key.startswith(keys.holds):
                held.add(kv.key.removeprefix(keys.holds))
    for kv in kvs:
        if kv.key.startswith(keys.fences) and kv.key.removeprefix(keys.fences) in held:
            fence = load(kv.value)
            if fence.get("token") in old:
                moves.append((kv, dump({**fence, "token": new}), 0))
    return moves
