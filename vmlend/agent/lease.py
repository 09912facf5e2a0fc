"""One etcd lease for a host: grant, keep alive, revoke (over the registry's gateway)."""

from __future__ import annotations

import logging

from vmlend.registry.etcd_gateway import EtcdGateway, b64

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
