"""A cluster registry held in memory: just enough of etcd's KV API (put, range, delete, a
transaction comparing a key's value or mod revision) for the stores that speak it directly
(``vmlend.registry.plugs``, ``vmlend.registry.migrations``), so that the fuzz suite can drive
a boundary over it thousands of times without a daemon."""

from __future__ import annotations

import base64
from typing import Any

from vmlend.registry.etcd_gateway import KeyValue
from vmlend.registry.etcd_keys import Keys


def _raw(text: str) -> bytes:
    return base64.b64decode(text)


class MemoryGateway:
    """etcd's KV, in a dict of raw key -> (value, mod revision, lease)."""

    def __init__(self) -> None:
        self.kv: dict[bytes, tuple[bytes, int, int]] = {}
        self.revision = 1

    def _put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        self.revision += 1
        self.kv[key] = (value, self.revision, lease)

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        key = _raw(body["key"])
        if path == "kv/put":
            self._put(key, _raw(body.get("value", "")), int(body.get("lease", 0)))
        elif path == "kv/deleterange":
            self.kv.pop(key, None)
        else:
            raise NotImplementedError(path)
        return {"header": {"revision": self.revision}}

    def range(self, key: str, range_end: str | None = None) -> tuple[int, list[KeyValue]]:
        start = key.encode("utf-8", "surrogateescape")
        end = range_end.encode("utf-8", "surrogateescape") if range_end is not None else None
        found = sorted(
            (k, v) for k, v in self.kv.items() if (k == start if end is None else start <= k < end)
        )
        return self.revision, [
            KeyValue(k.decode("utf-8", "surrogateescape"), value, rev, rev, lease)
            for k, (value, rev, lease) in found
        ]

    def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]]) -> tuple[bool, int]:
        for c in compare:
            now = self.kv.get(_raw(c["key"]))
            if c["target"] == "MOD":
                ok = (now[1] if now else 0) == int(c["mod_revision"])
            elif c["target"] == "VALUE":
                ok = now is not None and now[0] == _raw(c["value"])
            else:
                raise NotImplementedError(c["target"])
            if not ok:
                return False, self.revision
        for op in success:
            if "request_put" in op:
                put = op["request_put"]
                self._put(_raw(put["key"]), _raw(put.get("value", "")), int(put.get("lease", 0)))
            elif "request_delete_range" in op:
                self.kv.pop(_raw(op["request_delete_range"]["key"]), None)
            else:
                raise NotImplementedError(op)
        return True, self.revision


class MemoryRegistry:
    """What the stores take of an ``EtcdRegistry``: its gateway, keys and host lease."""

    def __init__(self, cluster: str = "fuzz", lease: int = 0x1EA5E) -> None:
        self.gateway = MemoryGateway()
        self.keys = Keys(cluster)
        self.lease = lease

    def host_lease(self) -> int:
        return self.lease

    def put_raw(self, key: bytes, value: bytes) -> None:
        """``value`` at ``key`` under the cluster's prefix, as any writer of the registry may."""
        self.gateway._put(self.keys.base.encode() + key, value)
