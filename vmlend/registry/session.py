"""One host's etcd session: its lease, the keys that say an agent serves a node, and moving the
host's records onto its current lease. The agent's policy (``vmlend.agent``) calls these and
never spells an etcd request itself (Patroni's layering: wire, store operations, policy).

- **The lease.** ``grant``, ``keepalive`` (the TTL etcd restarted, counted from the request's
  send time: the lease ends no earlier than that; a restarted agent adopts its predecessor's
  lease with one), ``revoke``.
- **The node's keys.** ``hosts/<node>`` lives on the lease (the agent is alive). ``agents/<node>``
  has no lease: it binds the node name to one host identity (its machine-id), so that a second
  host configured with the same name is refused, and it outlives a crashed agent (the node's
  lent devices show as unavailable until an agent runs there again).
- **Holds follow the lease** (``follow``): after any change of the host's lease, every record of
  this host still attached to an earlier lease moves onto the current one, fence tokens
  included, and the earlier leases are revoked.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from typing import Any

import msgspec

from vmlend.errors import StateError
from vmlend.registry.etcd_gateway import EtcdGateway, KeyValue, b64, prefix_end
from vmlend.registry.etcd_keys import Keys, dump, load

log = logging.getLogger(__name__)


class LeaseLost(StateError):
    """etcd no longer knows the lease: it expired (the agent was frozen, cut off or down too
    long) or was revoked. Every record that was attached to it is gone."""


class Grant(msgspec.Struct, frozen=True):
    """A lease and the TTL etcd granted (it may grant more than asked: at least 2 s)."""

    id: int
    ttl: int


class NodeBinding(msgspec.Struct, frozen=True):
    """Who ``agents/<node>`` says the node is: the host's machine-id ("" when an older vmlend
    wrote the key: bound to nobody in particular)."""

    machine_id: str = ""
    pid: int = 0


class HostKey(msgspec.Struct, frozen=True):
    """``hosts/<node>``: the lease it lives on and what the agent said of itself."""

    lease: int
    pid: int = 0
    ttl: int = 0
    #: It serves plug requests (it was given the host's hypervisor).
    plugs: bool = False
    machine_id: str = ""


#: Keys moved per Txn: a compare and a put each, under etcd's default --max-txn-ops (128).
_MOVE_BATCH = 60
#: Re-reads when another writer changed a record between the read and the move.
_MOVE_ATTEMPTS = 5


class LeaseMove(msgspec.Struct):
    """What ``follow`` did: the keys moved, and the old leases found and revoked."""

    moved: int = 0
    old: list[int] = msgspec.field(default_factory=list)
    revoked: list[int] = msgspec.field(default_factory=list)


class EtcdSession:
    """The session operations of one host (``node``) on the cluster behind ``gateway``."""

    def __init__(self, gateway: EtcdGateway, keys: Keys, node: str) -> None:
        self.gateway = gateway
        self.keys = keys
        self.node = node

    # --- the lease --------------------------------------------------------------------------
    def grant(self, ttl: int) -> Grant:
        answer = self.gateway.call("lease/grant", {"TTL": ttl, "ID": 0})
        return Grant(int(answer["ID"]), int(answer.get("TTL", ttl)))

    def keepalive(self, lease: int) -> int:
        """One keepalive; the TTL etcd restarted from now. ``LeaseLost`` when it is gone."""
        answer = self.gateway.call("lease/keepalive", {"ID": lease})
        ttl = int(answer.get("result", {}).get("TTL", -1))
        if ttl <= 0:
            raise LeaseLost(f"lease {lease:x} expired")
        return ttl

    def revoke(self, lease: int) -> None:
        self.gateway.call("kv/lease/revoke", {"ID": lease})

    # --- the node's keys ----------------------------------------------------------------------
    def host_key(self) -> HostKey | None:
        """``hosts/<node>``: None when no agent's lease holds it."""
        _rev, kvs = self.gateway.range(self.keys.host(self.node))
        if not kvs:
            return None
        try:
            data = json.loads(kvs[0].value)
            return HostKey(
                lease=kvs[0].lease,
                pid=int(data.get("pid", 0)),
                ttl=int(data.get("ttl", 0)),
                plugs=bool(data.get("plugs", False)),
                machine_id=str(data.get("machine_id", "")),
            )
        except (ValueError, TypeError, AttributeError):
            return HostKey(lease=kvs[0].lease)

    def announce(self, key: HostKey) -> None:
        """Write ``hosts/<node>`` on ``key.lease``: the node's agent is alive."""
        value = {"pid": key.pid, "ttl": key.ttl, "plugs": key.plugs, "machine_id": key.machine_id}
        self.gateway.call(
            "kv/put",
            {
                "key": b64(self.keys.host(self.node)),
                "value": b64(json.dumps(value)),
                "lease": key.lease,
            },
        )

    def binding(self) -> NodeBinding | None:
        """Which host ``agents/<node>`` binds the node to (None: no agent ever ran it)."""
        _rev, kvs = self.gateway.range(self.keys.agent(self.node))
        if not kvs:
            return None
        try:
            data = json.loads(kvs[0].value)
        except ValueError:
            return NodeBinding()  # an older vmlend's marker ("1")
        if not isinstance(data, dict):
            return NodeBinding()
        return NodeBinding(str(data.get("machine_id", "")), int(data.get("pid", 0) or 0))

    def bind(self, binding: NodeBinding, *, was: NodeBinding | None) -> bool:
        """Write ``agents/<node>`` as ``binding`` if it still is ``was`` (None: absent);
        whether it was written (False: another agent changed it meanwhile)."""
        key = b64(self.keys.agent(self.node))
        value = b64(json.dumps(msgspec.to_builtins(binding)))
        compare: list[dict[str, Any]]
        if was is None:
            compare = [{"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": 0}]
        else:
            _rev, kvs = self.gateway.range(self.keys.agent(self.node))
            if not kvs:
                return False
            compare = [
                {
                    "key": key,
                    "target": "MOD",
                    "result": "EQUAL",
                    "mod_revision": kvs[0].mod_revision,
                }
            ]
        ok, _rev = self.gateway.txn(compare, [{"request_put": {"key": key, "value": value}}])
        return ok

    def unbind(self, machine_id: str) -> bool:
        """Remove ``agents/<node>`` if it binds the node to ``machine_id`` (a node's keys are
        removed only by the host that owns them); whether it was removed."""
        _rev, kvs = self.gateway.range(self.keys.agent(self.node))
        if not kvs:
            return True
        binding = self.binding()
        if binding is None or binding.machine_id not in ("", machine_id):
            return False
        key = b64(self.keys.agent(self.node))
        ok, _rev = self.gateway.txn(
            [{"key": key, "target": "MOD", "result": "EQUAL", "mod_revision": kvs[0].mod_revision}],
            [{"request_delete_range": {"key": key}}],
        )
        return ok

    # --- holds follow the lease ---------------------------------------------------------------
    def follow(self, current: int, known: Iterable[int] = ()) -> LeaseMove:
        """Move every record of this host attached to an earlier lease (``known``, plus any
        other lease this node's records are on) onto ``current``, fence tokens included, then
        revoke the earlier leases.

        Why: a lease nobody renews ends later (after an etcd outage a returning leader extends
        it by its TTL) and takes its holds with it while this host's VMs still use the devices.
        With up to ``_MOVE_BATCH`` keys the move is one Txn; a larger one is batched, and a crash
        between batches leaves the rest for the next start-up, which finds the old lease again
        through this node's records. A record changed since it was read is re-read; an old
        lease is revoked only when nothing of it is left."""
        keys, gateway = self.keys, self.gateway
        result = LeaseMove()
        known = {lease for lease in known if lease not in (0, current)}
        for _attempt in range(_MOVE_ATTEMPTS):
            _rev, kvs = gateway.range(keys.base, prefix_end(keys.base))
            old = known | _old_leases(kvs, keys, self.node, current)
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
                self.revoke(lease)
                result.revoked.append(lease)
            except StateError as e:  # already ended: nothing of it is left either way
                log.debug("lease %x not revoked: %s", lease, e)
        return result


def _old_leases(kvs: list[KeyValue], keys: Keys, node: str, current: int) -> set[int]:
    """The leases, other than ``current``, that this node's node-scoped records are on (its
    VMs' markers, mdevs, mdev parents): each was an earlier lease of this host."""
    mine = (keys.vm_holds_on(node), keys.mdevs_on(node), f"{keys.parents}{node}/")
    return {kv.lease for kv in kvs if kv.key.startswith(mine) and kv.lease not in (0, current)}


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
