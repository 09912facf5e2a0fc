"""Live migrations in progress, in the cluster registry: ``migrations/<VM UUID>``, written by
the source when a live migration starts and deleted when it ends, on the source host's agent
lease (a source host that dies takes its records with it, as it does its holds). A
destination's agent plugs devices only for a plug request that such a record matches. The
store keeps the records as bytes: ``vmlend.ops.migration_record`` says what they hold."""

from __future__ import annotations

from vmlend.registry.etcd_gateway import b64
from vmlend.registry.etcd_store import EtcdRegistry


class MigrationStore:
    """The live-migration records of one cluster registry."""

    def __init__(self, registry: EtcdRegistry) -> None:
        self.registry = registry
        self.gateway = registry.gateway
        self.keys = registry.keys

    def key(self, vm_uuid: str) -> str:
        return self.keys.migration(vm_uuid)

    def put(self, vm_uuid: str, value: bytes) -> None:
        """Write the record of ``vm_uuid`` on this host's agent lease (``AgentNotRunningError``
        without one), replacing an earlier one."""
        lease = self.registry.host_lease()
        body = {"key": b64(self.key(vm_uuid)), "value": b64(value), "lease": lease}
        self.gateway.call("kv/put", body)

    def get(self, vm_uuid: str) -> bytes | None:
        _rev, kvs = self.gateway.range(self.key(vm_uuid))
        return kvs[0].value if kvs else None

    def drop(self, vm_uuid: str, value: bytes) -> bool:
        """Delete the record of ``vm_uuid`` if it still holds ``value`` (a newer migration's
        record is left alone); whether it was deleted."""
        key = b64(self.key(vm_uuid))
        ok, _rev = self.gateway.txn(
            [{"key": key, "target": "VALUE", "result": "EQUAL", "value": b64(value)}],
            [{"request_delete_range": {"key": key}}],
        )
        return ok
