"""The topology's pieces in etcd: writing a generation, reading one, deleting old ones.

A new topology is written *before* the transaction that installs it (``stage``): its pieces
under ``topology/gen/<generation>/<n>`` in requests of at most ``PIECES_PER_REQUEST`` pieces
(well under etcd's 1.5 MiB and 128 operations), the last request also writing the
generation's seal ``topology/gen/<generation>/seal``. The installing transaction then puts the
head (``topology/generation``) and compares the seal's revision, so it commits only if the
whole generation is still there. Generations are deleted whole (one range delete each), so a
generation whose seal exists has every piece. After a commit, every generation the head does
not name is deleted (``collect``): a staged one of a writer that lost the race then fails its
seal compare and that writer's transaction runs again, staging anew; so two writers racing
leave one whole generation, never a mix.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vmlend.errors import VmlendError
from vmlend.registry import topopieces
from vmlend.registry.etcd_gateway import EtcdGateway, b64, prefix_end
from vmlend.registry.etcd_keys import Keys
from vmlend.registry.topocache import TopologyCache
from vmlend.registry.topopieces import StoredTopology, StoredView, TopologyHead

log = logging.getLogger(__name__)

#: Pieces per write request: 2 x 512 KiB, with base64 and keys well under 1.5 MiB.
PIECES_PER_REQUEST = 2
#: Pieces per read request (a response has no default limit; this keeps each one ~4 MiB).
PIECES_PER_READ = 8
#: Generations deleted per request (etcd's default is 128 operations).
DELETES_PER_REQUEST = 64


class Staged:
    """A generation written and sealed, not yet named by the head."""

    def __init__(self, head: TopologyHead, seal: str, seal_revision: int) -> None:
        self.head = head
        self.seal = seal
        self.seal_revision = seal_revision


class EtcdTopology:
    """The topology generations of one cluster, and this host's copy of the current one."""

    def __init__(self, gateway: EtcdGateway, keys: Keys, cache: TopologyCache | None) -> None:
        self._gw = gateway
        self._k = keys
        self._cache = cache
        self._where = f"{gateway.where}/{keys.cluster}"

    # --- writing ---------------------------------------------------------------------------
    def stage(self, stored: StoredTopology) -> Staged:
        """Write ``stored`` as a new generation, sealed (several requests)."""
        blob = topopieces.pack(stored)
        pieces = topopieces.split(blob)
        generation = topopieces.new_generation()
        head, verified = topopieces.named(generation, stored, blob, len(pieces))
        seal = self._k.topology_seal(generation)
        revision = 0
        for first in range(0, len(pieces), PIECES_PER_REQUEST):
            ops: list[dict[str, Any]] = [
                {
                    "request_put": {
                        "key": b64(self._k.topology_piece(generation, n)),
                        "value": b64(pieces[n]),
                    }
                }
                for n in range(first, min(first + PIECES_PER_REQUEST, len(pieces)))
            ]
            if first + PIECES_PER_REQUEST >= len(pieces):
                ops.append({"request_put": {"key": b64(seal), "value": b64(head.sha256)}})
            _ok, revision = self._gw.txn([], ops)
        log.debug("staged topology generation %s: %d pieces", generation, len(pieces))
        if self._cache is not None:
            # this host installs it: keep it
            self._cache.put(self._where, head, blob, digests=verified.digests)
        return Staged(head, seal, revision)

    def drop(self, generation: str) -> None:
        """Delete a staged generation that was not installed."""
        prefix = self._k.topology_generation_prefix(generation)
        self._gw.txn([], [_delete_prefix(prefix)])

    def collect(self) -> int:
        """Delete every generation the head does not name; how many. Done in requests that
        compare the head, so a head switched meanwhile stops it (its writer collects)."""
        revision, found = self._gw.read_many([(self._k.topology_head, None)])
        head_kv = found[0][0] if found[0] else None
        current = ""
        if head_kv is not None:
            current = topopieces.decode_head(head_kv.value, self._k.topology_head).generation
        base = self._k.topology_generations
        _rev, kvs = self._gw.range(base, prefix_end(base), revision)
        others = sorted({kv.key[len(base) :].split("/", 1)[0] for kv in kvs} - {current})
        compare = [
            {
                "key": b64(self._k.topology_head),
                "target": "MOD",
                "result": "EQUAL",
                "mod_revision": head_kv.mod_revision if head_kv else 0,
            }
        ]
        done = 0
        for first in range(0, len(others), DELETES_PER_REQUEST):
            batch = others[first : first + DELETES_PER_REQUEST]
            ops = [_delete_prefix(self._k.topology_generation_prefix(g)) for g in batch]
            ok, _rev = self._gw.txn(compare, ops)
            if not ok:
                break
            done += len(batch)
        return done

    # --- reading ---------------------------------------------------------------------------
    def load(self, head: TopologyHead, revision: int) -> StoredView:
        """The content ``head`` names: this host's copy when it is that generation's, else
        its pieces as of ``revision`` (then kept on the host)."""
        if self._cache is not None:
            copy = self._cache.open(self._where, head, self._pieces_of(head.generation))
            if copy is not None:
                return copy
        keys = [self._k.topology_piece(head.generation, n) for n in range(head.pieces)]
        pieces: list[bytes] = []
        for first in range(0, len(keys), PIECES_PER_READ):
            ranges: list[tuple[str, str | None]] = [
                (k, None) for k in keys[first : first + PIECES_PER_READ]
            ]
            _rev, results = self._gw.read_many(ranges, revision)
            pieces += [kvs[0].value for kvs in results if kvs]
        verified = topopieces.join_verified(head, pieces)
        stored = topopieces.unpack(head, verified.blob)
        if self._cache is not None:
            self._cache.put(self._where, head, verified.blob, digests=verified.digests)
        return stored


    def _pieces_of(self, generation: str) -> Callable[[int, int], bytes | None]:
        """Bytes of ``generation``'s content read from its pieces in etcd (as they are now),
        for a chunk of the host's copy that does not match; None when they are gone."""

        def read(start: int, length: int) -> bytes | None:
            n, at = divmod(start, topopieces.PIECE_BYTES)
            try:
                _rev, kvs = self._gw.range(self._k.topology_piece(generation, n))
            except VmlendError:
                return None
            return kvs[0].value[at : at + length] if kvs else None

        return read


def _delete_prefix(prefix: str) -> dict[str, Any]:
    return {"request_delete_range": {"key": b64(prefix), "range_end": b64(prefix_end(prefix))}}
