"""Plug requests in the cluster registry: the source of a live migration asks the destination's
agent to plug the VM's devices back in. One request per VM under ``plugs/<destination
node>/<request id>`` (a re-run replaces it); the destination's agent writes the outcome into it,
the source reads it and deletes the request. The store keeps the requests as bytes:
``vmlend.ops.plug_request`` says what they hold."""

from __future__ import annotations

import json

from vmlend.registry.etcd_gateway import b64
from vmlend.registry.etcd_store import EtcdRegistry


class PlugStore:
    """The plug requests of one cluster registry."""

    def __init__(self, registry: EtcdRegistry) -> None:
        self.gateway = registry.gateway
        self.keys = registry.keys

    def agent_serves(self, node: str) -> bool:
        """Whether ``node``'s agent holds its lease (its ``hosts/<node>`` key lives on it) and
        serves plug requests (it was given the host's hypervisor, ``vmlend agent -c``)."""
        _rev, kvs = self.gateway.range(self.keys.host(node))
        if not kvs:
            return False
        try:
            return bool(json.loads(kvs[0].value).get("plugs", False))
        except (ValueError, AttributeError):
            return False

    def put(self, node: str, request_id: str, value: bytes) -> None:
        key = self.keys.plug(node, request_id)
        self.gateway.call("kv/put", {"key": b64(key), "value": b64(value)})

    def on(self, node: str) -> list[tuple[str, bytes, int]]:
        """Every request for ``node``: (request id, the key's last part; value; mod
        revision)."""
        prefix = self.keys.plugs_on(node)
        _rev, kvs = self.gateway.range(prefix, prefix[:-1] + "0")
        return [(kv.key[len(prefix) :], kv.value, kv.mod_revision) for kv in kvs]

    def where(self, node: str, request_id: str) -> str:
        """The request's key, as the logs name it (without the cluster's prefix)."""
        return self.keys.plug(node, request_id).removeprefix(self.keys.base)

    def replace(self, node: str, request_id: str, value: bytes, mod_revision: int) -> bool:
        """Write ``value`` unless the request changed or went since ``mod_revision``."""
        key = b64(self.keys.plug(node, request_id))
        ok, _rev = self.gateway.txn(
            [{"key": key, "target": "MOD", "result": "EQUAL", "mod_revision": mod_revision}],
            [{"request_put": {"key": key, "value": b64(value)}}],
        )
        return ok

    def get(self, node: str, request_id: str) -> bytes | None:
        _rev, kvs = self.gateway.range(self.keys.plug(node, request_id))
        return kvs[0].value if kvs else None

    def drop(self, node: str, request_id: str) -> None:
        self.gateway.call("kv/deleterange", {"key": b64(self.keys.plug(node, request_id))})

    def drop_unchanged(self, node: str, request_id: str, mod_revision: int) -> bool:
        """Delete the request unless it changed or went since ``mod_revision``."""
        key = b64(self.keys.plug(node, request_id))
        ok, _rev = self.gateway.txn(
            [{"key": key, "target": "MOD", "result": "EQUAL", "mod_revision": mod_revision}],
            [{"request_delete_range": {"key": key}}],
        )
        return ok
