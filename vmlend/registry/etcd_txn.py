"""One optimistic transaction on etcd (a software transactional memory over etcd's Txn).

Reads are served from one snapshot (the revision of the first read) and remembered: a key by
its mod_revision (0 when absent), a range by the snapshot revision. Writes are buffered and
read back by later reads of the same transaction. ``commit`` sends one etcd Txn that applies
the writes only if
- every key read still has the mod_revision it had (so a change or a deletion fails it), and
- no key under a range read was created or changed after the snapshot (``MOD < R + 1`` with
  ``range_end``). A key deleted under a range is not seen by that compare; deletions only free
  things (a claim, an mdev), so a decision made on the larger set stays safe.
When the compares fail the caller (``EtcdRegistry.transact``) re-runs the whole body.
"""

from __future__ import annotations

import functools
import secrets
import threading
from collections.abc import Callable, Collection, Iterable
from typing import Any, Concatenate, ParamSpec, TypeVar

import msgspec

from vmlend.errors import ResourceExhaustedError, StateError, StateRecordError
from vmlend.registry import etcd_keys as enc
from vmlend.registry import topopieces
from vmlend.registry.api import LINKS_DOWN_KEY
from vmlend.registry.decider import (
    EXTENT_CHUNK,
    Deciders,
    NodeDecider,
    Pairs,
    Place,
    RunAgain,
    grows,
    own_usage,
)
from vmlend.registry.decoded import Decoded
from vmlend.registry.etcd_gateway import EtcdGateway, KeyValue, b64, prefix_end
from vmlend.registry.etcd_keys import Keys, aligned_size, unit_span
from vmlend.registry.etcd_topology import EtcdTopology
from vmlend.registry.etcd_warm import WarmCache, Write, reaches_into
from vmlend.registry.records import (
    Claim,
    ClaimKind,
    DeviceRecord,
    FenceRecord,
    HoldRecord,
    MdevRecord,
    NodeRecord,
    ParentRecord,
    Phase,
    RuntimeRecord,
    TopologyRecord,
    same_holder,
)
from vmlend.registry.schema import ETCD_SCHEMA_VERSION
from vmlend.registry.topopieces import StoredTopology, StoredView
from vmlend.topology.model import Holder, Topology
from vmlend.topology.requesters import is_port, port_switch, requester_share

_AGENT_GONE = (
    "its vmlend agent is not running (stopped or dead: it has no live lease); start the agent"
    " there, or decommission the node with 'vmlend drain'"
)


#: Per topology digest, the topology ``EtcdTxn._capacity`` reads adapters from: decoded once
#: per process, not once per opened registry, and then only the adapters' nodes it asks for.
_CAPACITIES: dict[str, Topology] = {}


class Snapshot:
    """The reads of one attempt and the compares they imply.

    Read from etcd, every item is at one revision (``revision``, that of the first read).
    With a ``WarmCache`` (``etcd_warm``), items an earlier commit knew are taken from it
    instead, each known at its own revision: the compares then name each item's own revision,
    so a commit is as safe as from fresh reads, but what is seen is no longer one snapshot
    (``warmed``), and only a commit checks it."""

    def __init__(self, gateway: EtcdGateway, warm: WarmCache | None = None) -> None:
        self._gw = gateway
        self._warm = warm
        #: Some item came from the warm cache: the attempt's view is not one revision's.
        self.warmed = False
        #: The revision of this attempt's reads from etcd (0: none yet).
        self.revision = 0
        self._keys: dict[str, KeyValue | None] = {}
        self._ranges: dict[str, dict[str, KeyValue]] = {}
        #: Ranges read without a prefix compare (``loose_range``); a key of one that is read
        #: through ``get`` is compared on its own.
        self._loose: dict[str, dict[str, KeyValue]] = {}
        #: The revision each key, range and loose range is known at.
        self._known: dict[str, int] = {}
        self._range_known: dict[str, int] = {}
        self._loose_known: dict[str, int] = {}
        #: Key ranges ``[start, end)`` compared as "nothing created or changed in them since
        #: the revision given" without being read themselves (``guard``).
        self._guards: dict[tuple[str, str], int] = {}
        self._expected: dict[str, int] = {}
        #: Ranges (compared or loose) whose content came from the warm cache: compared as
        #: ranges, they compare each of their keys too (``_warm_range``).
        self._remembered: set[str] = set()

    def _range(self, key: str, range_end: str | None) -> list[KeyValue]:
        revision, kvs = self._gw.range(key, range_end, self.revision)
        if not self.revision:
            self.revision = revision
        return kvs

    # --- the warm cache: items an earlier commit knew --------------------------------------
    def _warm_key(self, key: str) -> bool:
        found = self._warm.key(key) if self._warm is not None else None
        if found is None:
            return False
        self._keys[key], self._known[key] = found
        self.warmed = True
        return True

    def _warm_range(self, prefix: str) -> bool:
        """A compared range from the warm cache, if it holds few keys: each of them is then
        compared too (``compares``), since a range compare does not see a deletion, and a
        view mixing remembered and fresh items may no longer show the deletion's other
        writes (a release rewrites the VM's marker as it deletes the hold)."""
        found = self._warm.range(prefix) if self._warm is not None else None
        if found is None or len(found[0]) > WARM_RANGE_KEYS:
            return False
        self._ranges[prefix], self._range_known[prefix] = found
        self._remembered.add(prefix)
        self.warmed = True
        return True

    def _warm_loose(self, prefixes: list[str]) -> bool:
        """All of ``prefixes`` (the adapters of a path: their claims and units) from the
        warm cache, or none: a path's adapters are decided on together."""
        if self._warm is None or not prefixes:
            return False
        found = [self._warm.loose(p) for p in prefixes]
        if any(f is None for f in found):
            return False
        for prefix, hit in zip(prefixes, found, strict=True):
            assert hit is not None
            self._loose[prefix], self._loose_known[prefix] = hit
            self._remembered.add(prefix)
        self.warmed = True
        return True

    # --- reads ------------------------------------------------------------------------------
    def get(self, key: str) -> KeyValue | None:
        if key in self._keys:
            return self._keys[key]
        for prefix, kvs in self._ranges.items():
            if key.startswith(prefix):
                return kvs.get(key)
        for prefix, kvs in self._loose.items():
            if key.startswith(prefix):
                self._keys[key] = kvs.get(key)
                self._known[key] = self._loose_known[prefix]
                return self._keys[key]
        if self._warm_key(key):
            return self._keys[key]
        found = self._range(key, None)
        kv = found[0] if found else None
        self._keys[key] = kv
        self._known[key] = self.revision
        return kv

    def range(self, prefix: str) -> dict[str, KeyValue]:
        if prefix not in self._ranges:
            loose = self._loose.pop(prefix, None)  # read already: now compared as a prefix
            if loose is not None:
                self._ranges[prefix] = loose
                self._range_known[prefix] = self._loose_known.pop(prefix)
            elif not self._warm_range(prefix):
                kvs = self._range(prefix, prefix_end(prefix))
                self._ranges[prefix] = {kv.key: kv for kv in kvs}
                self._range_known[prefix] = self.revision
        return self._ranges[prefix]

    def loose_range(self, prefix: str) -> dict[str, KeyValue]:
        """A range that adds no compare: the caller compares what it decides on through
        other keys, or guards (``guard``) from the revision it was read at."""
        if prefix in self._ranges:
            return self._ranges[prefix]
        if prefix not in self._loose:  # the warm cache's only through ``prefetch``
            kvs = self._range(prefix, prefix_end(prefix))
            self._loose[prefix] = {kv.key: kv for kv in kvs}
            self._loose_known[prefix] = self.revision
        return self._loose[prefix]

    def prefetch(
        self, keys: Iterable[str], prefixes: Iterable[str], loose: Iterable[str] = ()
    ) -> None:
        """Read these keys, prefixes and ``loose`` ranges (see ``loose_range``) now, in one
        request, into the snapshot: a body that knows what it will read saves one round trip
        per read. What the warm cache knows is not read."""
        todo_keys = [
            k
            for k in dict.fromkeys(keys)
            if k not in self._keys
            and not any(k.startswith(p) for p in self._ranges)
            and not self._warm_key(k)
        ]
        todo_prefixes = [
            p for p in dict.fromkeys(prefixes) if p not in self._ranges and not self._warm_range(p)
        ]
        todo_loose = [
            p for p in dict.fromkeys(loose) if p not in self._ranges and p not in self._loose
        ]
        if self._warm_loose(todo_loose):
            todo_loose = []
        ranges: list[tuple[str, str | None]] = [(k, None) for k in todo_keys]
        ranges += [(p, prefix_end(p)) for p in todo_prefixes + todo_loose]
        if not ranges:
            return
        revision, results = self._gw.read_many(ranges, self.revision)
        if not self.revision:
            self.revision = revision
        for k, kvs in zip(todo_keys, results, strict=False):
            self._keys[k] = kvs[0] if kvs else None
            self._known[k] = self.revision
        rest = results[len(todo_keys) :]
        for p, kvs in zip(todo_prefixes, rest, strict=False):
            self._ranges[p] = {kv.key: kv for kv in kvs}
            self._range_known[p] = self.revision
        for p, kvs in zip(todo_loose, rest[len(todo_prefixes) :], strict=False):
            self._loose[p] = {kv.key: kv for kv in kvs}
            self._loose_known[p] = self.revision

    def peek(self, key: str) -> KeyValue | None:
        """``get`` without adding a compare when a loose range read the key already (for
        what is not decided on, e.g. the lease a rewritten key keeps)."""
        if key not in self._keys and not any(key.startswith(p) for p in self._ranges):
            for prefix, kvs in self._loose.items():
                if key.startswith(prefix):
                    return kvs.get(key)
        return self.get(key)

    def loose_before(self, prefix: str) -> dict[str, KeyValue]:
        """What a ``loose_range`` of ``prefix`` read (a compared range if it became one)."""
        return self._ranges.get(prefix) or self._loose.get(prefix) or {}

    def known_at(self, key: str) -> int:
        """The revision ``key`` is known at (read, or remembered): every change to it before
        that is in what was seen; one after it fails the commit's compares."""
        if key in self._known:
            return self._known[key]
        for prefix, revision in (*self._range_known.items(), *self._loose_known.items()):
            if key.startswith(prefix):
                return revision
        return self.revision

    def expect(self, key: str, mod_revision: int) -> None:
        """Compare at commit that ``key`` still has ``mod_revision`` (a key written outside
        this transaction, e.g. a staged topology generation's seal)."""
        self._expected[key] = mod_revision

    def guard(self, start: str, end: str, within: str) -> None:
        """Compare at commit that no key in ``[start, end)`` was created or changed after
        the range ``within`` (read loose, holding it) was read: the caller decided on what
        that range showed there."""
        known = self._range_known.get(within) or self._loose_known.get(within) or self.revision
        self._guards[(start, end)] = min(known, self._guards.get((start, end), known))

    def learned(
        self,
    ) -> tuple[
        dict[str, KeyValue | None],
        list[tuple[str, dict[str, KeyValue]]],
        list[tuple[str, dict[str, KeyValue], int]],
    ]:
        """What this attempt read, for ``WarmCache.learn``: the keys it compared, the
        ranges it compared, the loose ranges (with the revision each was read at)."""
        return (
            dict(self._keys),
            list(self._ranges.items()),
            [(p, kvs, self._loose_known[p]) for p, kvs in self._loose.items()],
        )

    def compares(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [
            {
                "key": b64(key),
                "target": "MOD",
                "result": "EQUAL",
                "mod_revision": kv.mod_revision if kv else 0,
            }
            for key, kv in self._keys.items()
        ]
        out += [
            {
                "key": b64(prefix),
                "range_end": b64(prefix_end(prefix)),
                "target": "MOD",
                "result": "LESS",
                "mod_revision": self._range_known[prefix] + 1,
            }
            for prefix in self._ranges
        ]
        out += [
            {"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": kv.mod_revision}
            for prefix in self._remembered
            if prefix in self._ranges
            for key, kv in self._ranges[prefix].items()
            if key not in self._keys
        ]
        out += [
            {
                "key": b64(start),
                "range_end": b64(end),
                "target": "MOD",
                "result": "LESS",
                "mod_revision": known + 1,
            }
            for (start, end), known in self._guards.items()
        ]
        out += [
            {"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": revision}
            for key, revision in self._expected.items()
        ]
        return out


#: A compared range is taken from the warm cache only if it holds at most this many keys
#: (each is compared as well: etcd allows 128 compares in a Txn).
WARM_RANGE_KEYS = 16


#: What decoding a damaged value raises (not JSON, bad UTF-8, a missing field, a wrong type, a
#: value out of its set): turned into one ``StateRecordError`` by ``_decoding``.
#: RecursionError: a value nested deeper than the decoder follows (msgspec and json raise it).
_DAMAGE = (ValueError, KeyError, TypeError, AttributeError, RecursionError, msgspec.MsgspecError)

_P = ParamSpec("_P")
_R = TypeVar("_R")
_Method = Callable[Concatenate["EtcdTxn", _P], _R]


def _decoding(table: str) -> Callable[[_Method[_P, _R]], _Method[_P, _R]]:
    """Run a ``StateTxn`` method so that a damaged record it decodes is one
    ``StateRecordError`` naming ``table`` and the record's key (the method's first argument),
    never a traceback: a hostile or corrupt value in etcd is an error of that record only."""

    def wrap(fn: _Method[_P, _R]) -> _Method[_P, _R]:
        @functools.wraps(fn)
        def decoding(self: EtcdTxn, /, *args: _P.args, **kw: _P.kwargs) -> _R:
            try:
                return fn(self, *args, **kw)
            except StateError:
                raise
            except _DAMAGE as e:
                key = args[0] if args else "(one of them)"
                shown = f"{key:#x}" if type(key) is int else str(key)
                raise StateRecordError(table, shown, f"{type(e).__name__}: {e}") from None

        return decoding

    return wrap


#: The largest unit block (units), and the largest aligned block a run is named by: a block
#: compares each aligned block that would hold it and starts before it, so with no block
#: above 16 a block of one unit compares at most 4 (2, 4, 8, 16) where on a switch port of
#: 256 entries it compared 8. A need of more takes several blocks of 16 (a key each): rare,
#: a GPU's 16 GiB of RAM takes 5 segments (one run).
MAX_BLOCK = 16


@functools.lru_cache(maxsize=1 << 13)
def _block_span(tail: str) -> tuple[int, int]:
    """``(start, size)`` of a unit block key's tail (``etcd_keys.unit_span``): parsed once,
    as the same tails recur on every adapter a reserve reads."""
    return unit_span(tail)


def _block_sizes(n: int) -> list[int]:
    """The sizes of the blocks ``n`` units take: one per bit, none above ``MAX_BLOCK``."""
    rest = n % MAX_BLOCK
    return [MAX_BLOCK] * (n // MAX_BLOCK) + [
        1 << b for b in reversed(range(rest.bit_length())) if rest >> b & 1
    ]


def _beyond(
    cap: int, n: int, free: Callable[[int, int], bool], taken: set[int]
) -> list[tuple[int, int]]:
    """``n`` units past the capacity ``cap``: the first free aligned blocks from it on.

    Admission decides on the claims, which count a claim two VMs share once, where each VM's
    units count it for itself (two functions of one device, held by two VMs); and a hand-over
    or a recount after a link event holds the units of the VM it gives back and of the one it
    makes at once. So units can run out where admission saw room: the rest is taken beyond the
    capacity, so that every claim keeps its units and its head block. While an adapter has
    units beyond its capacity, those below it may be fewer than its claims use, so every
    transaction that takes units there compares all of the adapter's (``_take_units``): as
    before blocks, and only there, a change to the adapter makes it run again."""
    out = []
    for size in _block_sizes(n):
        start = -(-cap // size) * size
        while not free(start, size):
            start += size
        taken.update(range(start, start + size))
        out.append((start, size))
    return out


#: Per (topology digest, node, a VM marker's stored form), its claims on the node's own
#: places (``_own_pairs``).
_OWN_PAIRS: dict[tuple[str, str, bytes], Pairs] = {}

#: Per (topology digest, fdid), the device's lender and requester share (``_covered``).
_LENT_SHARES: dict[tuple[str, int], tuple[str, str]] = {}


def _node_of_ref(ref: str) -> str | None:
    """The node an adapter ref ``node:index``, or a switch port toward one, names by its
    spelling (None: a port toward another switch); what ``prefetch`` reads before the
    topology is known."""
    toward = ref.split("/", 1)[1] if is_port(ref) else ref
    node, sep, index = toward.rpartition(":")
    return node if sep and index.isdigit() else None


class _Plan:
    """What one attempt decided for a node's own places (``EtcdTxn._decide``)."""

    def __init__(
        self,
        dec: NodeDecider,
        epoch: str,
        extents: dict[Place, list[tuple[int, int]]],
        taking: dict[str, Pairs] | None,
    ) -> None:
        self.dec = dec
        self.epoch = epoch
        #: The node's extents: as this process knows them, or as read (``extents_read``).
        self.extents = extents
        self.extents_read = False
        #: The node's VMs' claims read to take the node over (None: this process decides).
        self.taking = taking
        #: Per VM marker key, its claims on the node's own places after this attempt.
        self.changes: dict[str, Pairs] = {}
        self.write_epoch = False
        self.write_extents = False


class EtcdTxn:
    """The ``StateTxn`` of the etcd backend (see ``vmlend.registry.api``)."""

    def __init__(
        self,
        snapshot: Snapshot,
        keys: Keys,
        writable: bool,
        topology_cache: dict[str, StoredView],
        host_lease: Callable[[], int] | None = None,
        generations: EtcdTopology | None = None,
        claims_seen: Decoded[bytes, tuple[tuple[int, Claim], ...]] | None = None,
        deciders: Deciders | None = None,
    ) -> None:
        self._snap = snapshot
        #: This process's state of the nodes it decides for (``vmlend.registry.decider``).
        self._deciders = Deciders() if deciders is None else deciders
        #: Per node whose own places this attempt changes, what it decided (``_Plan``).
        self._plans: dict[str, _Plan] = {}
        #: The nodes whose VMs this attempt acts for (``prefetch``'s ``held_by``): their
        #: places are seen as their decider sees them, taking the node over if need be.
        self._acting: set[str] = set()
        #: The nodes whose epoch or extents this attempt changes (``_hold_change``).
        self._changing: set[str] = set()
        #: The commit was sent (its outcome is known only from etcd's answer), and more
        #: than once (``EtcdGateway.resent``).
        self.sent = False
        self.resent = False
        #: The claims of unit blocks decoded before, by their stored value
        #: (``vmlend.registry.decoded``).
        self._claims_seen = Decoded() if claims_seen is None else claims_seen
        self._k = keys
        self.writable = writable
        self._topo_cache = topology_cache
        self._generations = generations
        #: Generations this transaction wrote (``replace_topology``): the registry deletes
        #: them when it does not commit, and collects the older ones when it does.
        self.staged: list[str] = []
        self._host_lease = host_lease
        self._writes: dict[str, bytes | None] = {}
        self._leased: set[str] = set()
        #: Leased keys this transaction writes for a new hold: they take this host's lease
        #: even where the key exists (a hand-over re-makes the hold under its key).
        self._fresh: set[str] = set()
        self._range_deletes: list[str] = []
        #: Keys put on the lease of another key (``_put``'s ``lease_of``).
        self._lease_of: dict[str, str] = {}
        self._put_leases: dict[str, int] = {}  # the lease each put goes on (``operations``)
        self._capacities: dict[tuple[str, str, str], int] = {}  # ``_capacity``

    # --- the overlay of buffered writes over the snapshot --------------------------------
    def _write(self) -> None:
        if not self.writable:
            raise RuntimeError("write inside a read transaction")  # a programming error

    def _deleted_by_range(self, key: str) -> bool:
        return bool(self._range_deletes) and any(key.startswith(p) for p in self._range_deletes)

    def _get(self, key: str) -> bytes | None:
        if key in self._writes:
            return self._writes[key]
        if self._deleted_by_range(key):
            return None
        kv = self._snap.get(key)
        return None if kv is None else kv.value

    def _range(self, prefix: str) -> dict[str, bytes]:
        return self._overlaid(prefix, self._snap.range(prefix))

    def _loose_range(self, prefix: str) -> dict[str, bytes]:
        """``_range`` without a prefix compare (``Snapshot.loose_range``)."""
        return self._overlaid(prefix, self._snap.loose_range(prefix))

    def _overlaid(self, prefix: str, read: dict[str, KeyValue]) -> dict[str, bytes]:
        """The values under ``prefix`` as this transaction sees them: what was ``read``, less
        what it deleted, with what it wrote."""
        if reaches_into(self._range_deletes, prefix):
            out = {k: kv.value for k, kv in read.items() if not self._deleted_by_range(k)}
        else:  # no range this transaction deleted reaches in: each key need not be tested
            out = {k: kv.value for k, kv in read.items()}
        for k, v in self._writes.items():
            if k.startswith(prefix):
                if v is None:
                    out.pop(k, None)
                else:
                    out[k] = v
        return out

    # --- the VM's marker (``Keys.vm_holds``): what holds a VM has, read without an index ----
    #
    # Every hold a VM gains rewrites its marker ("n" counts them), so a concurrent reserve for
    # the same VM (which compares the marker) conflicts and one for another VM does not. The
    # marker lists the VM's holds ("fdids"): ``holds_of`` reads them there, and the markers of
    # a node are its index of holds. ``holds_of`` reads each hold it lists and keeps those of
    # this holder (a VM of the same name redefined has another UUID). The marker goes with
    # the VM's last hold.

    def _touch_vm(self, holder: Holder, fdid: int) -> None:
        """Rewrite the VM's marker as it gains the hold of ``fdid``."""
        key = self._k.vm_holds(holder.node, holder.vm)
        raw = self._get(key)
        d = enc.load(raw) if raw is not None else {}
        fdids = self._marker_fdids(d) | {fdid}
        n = int(d.get("n", 0)) + 1
        new = {**d, "vm": holder.vm, "n": n, "fdids": [f"{f:#x}" for f in sorted(fdids)]}
        self._put(key, enc.dump(new), leased=True)

    def _untrack_vm(self, node: str, vm: str, fdid: int) -> None:
        """Take ``fdid`` off the list of the VM's marker (after ``_forget_units``); the
        marker goes with the last hold it lists, when no unit is left in its ledger."""
        key = self._k.vm_holds(node, vm)
        raw = self._get(key)
        if raw is None:
            return
        d = enc.load(raw)
        listed = d.get("fdids", [])
        if f"{fdid:#x}" in listed:
            d["fdids"] = [f for f in listed if f != f"{fdid:#x}"]
            if not d["fdids"] and not d.get("ledger") and not d.get("blocks"):
                self._delete(key)
            else:
                self._put(key, enc.dump(d), leased=True)

    @staticmethod
    def _marker_fdids(marker: dict[str, Any]) -> set[int]:
        return {int(f, 16) for f in marker.get("fdids", [])}

    # --- adapter units: what makes two reserves that overcommit an adapter conflict ----------
    #
    # Admission reads the claims on an adapter without comparing them (a reserve on the same
    # adapter by another VM would otherwise always conflict). What keeps two reserves from
    # overcommitting it instead: the LUT entries and window segments in use are unit keys
    # ``units/<adapter>/<lut|seg>-blocks/<start>/<size>``, aligned blocks of a power of two
    # units below the adapter's usable count, or a VM's runs (an aligned block less its last
    # units, ``<start>/<size>/<free>``: layout 8), and a transaction that uses more of an
    # adapter creates blocks of that many free units, comparing that nothing was created
    # inside them and that no block holding them, nor a run it names reaching them, exists.
    # Reserves that together need more than is free must take overlapping units, so only one
    # commits (the other runs again and is refused); reserves that fit take blocks from their
    # own fdid on and rarely meet. A GPU reserve with 16 GiB of guest RAM takes its 5 window
    # segments on the lender's adapter as one run.
    #
    # A VM's units, and the claims they stand for (shared claims count once, as in
    # ``admission.usage``), are its unit ledger in its marker, which every reserve and release
    # of the VM compares and rewrites. The claims are also on the VM's head block of each
    # adapter (``Keys``): what ``claims_on`` reads, with the units, in one range. Admission
    # decides; the units only make racing decisions conflict, so where they run out while
    # admission saw room they are taken beyond the capacity (``_beyond``). A VM's blocks are
    # on its marker's lease, so they lapse with it.

    def _capacity(self, adapter: str, unit: str) -> int:
        """The adapter's usable LUT entries or window segments (0: not in the topology);
        looked up once per transaction and topology digest."""
        digest = self.topology_digest() or ""
        known = self._capacities.get((digest, adapter, unit))
        if known is None:
            known = self._capacity_in(digest, adapter, unit)
            self._capacities[(digest, adapter, unit)] = known
        return known

    def _capacity_in(self, digest: str, adapter: str, unit: str) -> int:
        topo = self._topo_compiled()
        if is_port(adapter):  # a switch port's requester table: entries only
            return topo.switch_requester_entries(port_switch(adapter)) if unit == "lut" else 0
        spec = topo.adapter(adapter)
        if spec is None:
            return 0
        return spec.lut_usable if unit == "lut" else spec.segments if unit == "seg" else 0

    @staticmethod
    def _units_needed(rows: Iterable[list[Any]]) -> dict[tuple[str, str], int]:
        """Per (adapter, unit), what claims ``[adapter, kind, share, entries, segments]``
        use: a shared claim (same adapter, kind and share) counts once, at its largest. On a
        switch port a requester's entry is one whatever claims it (a crossing's LUT claim, a
        peer-to-peer one), as ``admission.port_usage`` counts it."""
        groups: dict[tuple[str, str, str], tuple[int, int]] = {}
        ports: dict[str, bool] = {}  # rows name a few adapters, each many times
        for adapter, kind, share, entries, segments in rows:
            port = ports.get(adapter)
            if port is None:
                port = ports[adapter] = is_port(adapter)
            key = (adapter, "" if port else kind, share)
            # a damaged ledger row's negative amount counts as none, never as room
            e, s = max(0, int(entries)), max(0, int(segments))
            had = groups.get(key)
            groups[key] = (e, s) if had is None else (max(had[0], e), max(had[1], s))
        out: dict[tuple[str, str], int] = {}
        for (adapter, _kind, _share), (e, s) in groups.items():
            for unit, n in (("lut", e), ("seg", s)):
                if n:
                    out[(adapter, unit)] = out.get((adapter, unit), 0) + n
        return out

    @staticmethod
    def _row(c: dict[str, Any]) -> list[Any]:
        """A ledger claim (``etcd_keys.claim_to_dict``) as ``_units_needed`` counts it."""
        return [c["adapter"], c["kind"], c["share"], c.get("entries", 0), c.get("segments", 0)]

    def _spans(self, adapter: str, unit: str, keys: Iterable[str]) -> list[tuple[int, int]]:
        """The ``(start, size)`` of the blocks of ``adapter``'s ``unit`` among ``keys``."""
        blocks = self._k.unit_blocks(adapter, unit)
        at = len(blocks)
        return [_block_span(k[at:]) for k in keys if k.startswith(blocks)]

    def _take_units(
        self,
        adapter: str,
        unit: str,
        n: int,
        holder: Holder,
        hint: int,
        *,
        extent: bool = False,
        lent: str | None = None,
    ) -> list[tuple[int, int]]:
        """Create blocks of ``n`` units (``(start, size)`` each): a VM's as one run where an
        aligned block of ``n`` rounded up to a power of two (at most ``MAX_BLOCK`` and the
        capacity, up to which holding blocks are compared) has its first ``n`` units free;
        else one block per bit of ``n``, none larger than ``MAX_BLOCK``, split in halves where
        no aligned free block of that size is left; each the first free one from index
        ``hint`` on (modulo the capacity).
        The hint is the fdid the change is for, so reserves of distinct devices (numbered in
        a row per lender) start at distinct units and rarely meet unless the adapter is
        nearly full. What the capacity has no free unit for is taken beyond it, from the
        capacity on (``_beyond``).

        Aligned blocks of powers of two overlap only when one holds the other, and a run is
        within the block naming it, so two transactions that take one same unit conflict:
        each compares the key range of the starts of its own units (``Snapshot.guard``:
        nothing created there since the snapshot) and, for each aligned block that would
        hold one of its blocks (up to ``MAX_BLOCK``: none is larger), that neither it nor a
        run it names that reaches that block was created (``Keys.unit_blocks_reaching``).
        Blocks that share no unit do not meet."""
        every = self._k.units_of(adapter)  # both resources of the adapter, in one range
        read = self._loose_range(every)
        spans = self._spans(adapter, unit, read)
        cap = self._capacity(adapter, unit)
        if not cap:  # admission never asks it: a claim on what the topology does not have
            raise StateError(f"{adapter} has no {unit} units in the topology to take {n} of")
        taken: set[int] = set()
        for start, size in spans:
            taken.update(range(start, start + size))

        def free(start: int, size: int) -> bool:
            return taken.isdisjoint(range(start, start + size))

        within = min(n, cap - sum(1 for i in taken if i < cap))
        # a node's own place that has extents: its decider adds claims within them without
        # taking or comparing a block, so nothing goes beyond the capacity there (a take
        # beyond it decides on the adapter's blocks as a whole, which would not meet them),
        # and another host's VM counts every unit held, beyond the capacity too (units a
        # shared claim took there before the extents), so that its claims and the extents
        # stay within the capacity
        bounded = extent or (
            self._own_node(adapter) is not None and any(enc.is_extent(v) for v in read.values())
        )
        if bounded:
            within = max(0, min(n, cap - len(taken)))
            if n > within and not extent and self._shrink_for(adapter, unit, n - within):
                # the node gave claims back in this attempt: its extents' slack serves it
                return self._take_units(adapter, unit, n, holder, hint, lent=lent)
            if n > within:
                what, units = (
                    ("requester LUT", "entries")
                    if unit == "lut"
                    else ("NTB window segments", "segments")
                )
                raise ResourceExhaustedError(what, adapter, n, within, units)
        begin = hint % cap if cap else 0
        # blocks this transaction gave back (a hand-over moves a VM's units to its VM on the
        # destination): taken again first, a put over a delete being one operation, not two
        dropped = [k for k, v in self._writes.items() if v is None]
        freed = sorted(s for s in self._spans(adapter, unit, dropped) if s[0] + s[1] <= cap)
        picked: list[tuple[int, int]] = []
        # a VM's units in one run where an aligned block has room for them at its start:
        # one key, where blocks take one per bit of the count (layout 8)
        whole = aligned_size(within)
        if not extent and lent is None and 1 < within < whole <= min(cap, MAX_BLOCK):
            first = -(-begin // whole) * whole
            starts = (
                *(s for s, z in freed if z == within),
                *range(first, cap - within + 1, whole),
                *range(0, min(first, cap - within + 1), whole),
            )
            found = next((s for s in starts if free(s, within)), None)
            if found is not None:
                taken.update(range(found, found + within))
                picked.append((found, within))
        sizes = [] if picked else _block_sizes(within)
        while sizes:
            size = sizes.pop(0)
            first = -(-begin // size) * size
            starts = (
                *(s for s, z in freed if z == size),
                *range(first, cap - size + 1, size),
                *range(0, min(first, cap - size + 1), size),
            )
            found = next((s for s in starts if free(s, size)), None)
            if found is None:  # fragmented: two halves (a single unit is always found)
                sizes[:0] = [size // 2, size // 2]
                continue
            taken.update(range(found, found + size))
            picked.append((found, size))
        picked += _beyond(cap, n - within, free, taken)
        # a VM's block is on its marker's lease, its head's value written by ``_block_values``;
        # an extent (``extent``: of node ``holder.node``) is on no lease: its node's decider
        # gives it back
        if extent:
            owner = enc.extent_to_json(holder.node)
        elif lent is not None:  # a lent entry: its node's, on no lease (``_lent_entry``)
            owner = enc.lent_to_json(holder.node, lent)
        else:
            owner = enc.block_to_json(f"{holder.node}/{holder.vm}")
        marker = self._k.vm_holds(holder.node, holder.vm)
        run: list[int] = []  # blocks in a row: one guard for the run (fewer compares)
        holders: set[tuple[int, int]] = set()  # compared already, from its widest end
        for start, size in sorted(picked):
            if run and run[1] == start:
                run[1] = start + size
            else:
                if run:
                    block_range = self._k.unit_block_range(adapter, unit, *run)
                    self._snap.guard(*block_range, within=every)
                run = [start, start + size]
            outer = aligned_size(size) * 2
            # a block below the capacity is never held by one beyond it, nor the other way;
            # one beyond it needs no holding block compared (the whole adapter is, below)
            largest = min(cap, MAX_BLOCK) if start < cap else 0
            while outer <= largest:
                # an aligned block holding this one, starting before it, or a run it names
                # that reaches this block; one starting inside this run of blocks is in the
                # run's guarded range already (no compare of its own)
                holding = start - start % outer
                if holding < run[0] and (holding, outer) not in holders:
                    # the first block under it reaches furthest back: its range holds the
                    # later blocks' ranges
                    holders.add((holding, outer))
                    reaching = self._k.unit_blocks_reaching(adapter, unit, holding, outer, start)
                    self._snap.guard(*reaching, within=every)
                outer *= 2
            key = self._k.unit_block(adapter, unit, start, size)
            if extent or lent is not None:
                self._put(key, owner)
            else:
                self._put(key, owner, leased=True, lease_of=marker)
        if run:
            self._snap.guard(*self._k.unit_block_range(adapter, unit, *run), within=every)
        if n > within or any(start + size > cap for start, size in spans):
            # units beyond the capacity: fewer below it than the claims use, so the blocks
            # alone no longer make two overcommitting reserves meet; decided on everything
            # of the adapter instead (a compared prefix: any change there makes it run again)
            self._snap.range(every)
        else:
            # and nothing went beyond it since this view: a prefix compare does not see a
            # deletion, so one that went beyond from an older view (the units a release freed
            # since then still taken in it) would not meet this take of those units
            blocks = self._k.unit_blocks(adapter, unit)
            self._snap.guard(f"{blocks}{cap:06d}", prefix_end(blocks), within=every)
        return sorted(picked)

    def _block_values(
        self,
        adapter: str,
        owner: str,
        blocks: dict[str, list[list[int]]],
        claims: list[Any],
        *,
        check: bool = True,
    ) -> dict[str, bytes]:
        """The values of the VM ``owner``'s blocks on ``adapter`` (``blocks``: per unit,
        ``[start, size]`` each) by key: the first carries ``claims``, its claims there (its
        head), the others none. ``check``: a claim without a block is an error (not for
        what a ledger said before, which only tells what to rewrite)."""
        keys = sorted(
            self._k.unit_block(adapter, unit, s, z)
            for unit, spans in blocks.items()
            for s, z in spans
        )
        if claims and not keys and check:
            raise StateError(
                f"a claim on {adapter} uses no LUT entry nor window segment: it would be found"
                " nowhere (claims are kept on their VM's unit blocks)"
            )
        return {
            key: enc.block_to_json(owner, claims if i == 0 else None) for i, key in enumerate(keys)
        }

    @staticmethod
    def _claims_by_adapter(
        ledger: dict[str, list[dict[str, Any]]],
    ) -> dict[str, list[dict[str, Any]]]:
        """A ledger's claims per adapter, each with its hold's ``fdid``, by fdid: what the
        VM's head block there carries."""
        on: dict[str, list[dict[str, Any]]] = {}
        for f in sorted(ledger, key=lambda f: int(f, 16)):
            for c in ledger[f]:
                on.setdefault(c["adapter"], []).append({"fdid": int(f, 16), **c})
        return on

    def _on_blocks(
        self, ledger: dict[str, list[dict[str, Any]]], own: Collection[str]
    ) -> dict[str, list[dict[str, Any]]]:
        """A ledger's claims its VM's head blocks carry, per adapter: not on its node's own
        places, nor a lent device's requester entries (``_covered``)."""
        return {
            a: kept
            for a, claims in self._claims_by_adapter(ledger).items()
            if a not in own and (kept := [c for c in claims if not self._covered(c["fdid"], c)])
        }

    def _covered(self, fdid: int, c: dict[str, Any]) -> bool:
        """The claim (of the hold of ``fdid``, as ``etcd_keys.claim_to_dict``) is its
        device's requester entry on an adapter of its lender or on a switch port toward one:
        an entry the lender sets aside while the device is lent (``_lent_entry``), which the
        holds of the device use with no block of their VM (layout 7)."""
        if c.get("kind") != ClaimKind.LUT.value:
            return False
        lender_share = self._lent_share_of(fdid)
        if lender_share is None or c.get("share") != lender_share[1]:
            return False
        return self._own_node(str(c["adapter"])) == lender_share[0]

    def _lent_share_of(self, fdid: int) -> tuple[str, str] | None:
        """The lender and requester share of device ``fdid`` (None: not in the topology)."""
        digest = self.topology_digest() or ""
        found = _LENT_SHARES.get((digest, fdid))
        if found is None:
            topo = self._topo_compiled()
            if not topo.has_device(fdid):
                return None
            spec = topo.device(fdid)
            if len(_LENT_SHARES) >= 1 << 17:  # a process sees one topology, rarely a few
                _LENT_SHARES.clear()
            found = _LENT_SHARES[(digest, fdid)] = (spec.lender, requester_share(spec))
        return found

    def _lent_entry(self, adapter: str, share: str, fdid: int) -> None:
        """The requester entry of ``share`` on ``adapter`` that the lender of device
        ``fdid`` sets aside while it lends it. The device's record lists where it is (and
        every record of its requester's devices, its functions, the same): the record a
        reserve compares anyway, which an unlend that deletes the entry rewrites. Taken by
        the first hold after a lend, on no lease (the lender's), and listed in those records
        (written: two first holds of one requester conflict)."""
        lender, _share = self._lent_share_of(fdid) or ("", "")
        # its own record's listing, or another function's (one a topology amend added has
        # none of its own yet): every record read is compared
        where = next(
            (
                listed
                for f in (fdid, *(g for g in self._siblings(fdid) if g != fdid))
                if (listed := self._device_dict(f).get("entries", {}).get(adapter)) is not None
            ),
            None,
        )
        start: int | None = None
        if where is not None:
            key = self._k.unit_block(adapter, "lut", int(where), 1)
            raw = self._get(key)  # compared: a remembered view may be older than the record
            if raw is not None and enc.lent_share(raw) == share:
                return
            if raw is not None and self._covers_nothing(raw, lender):
                # a topology amend renumbered the device while it was lent and idle: its
                # entry, of a requester no device has now, becomes its new requester's
                self._put(key, enc.lent_to_json(lender, share))
                start = int(where)
        if start is None:
            (start, _size), *_rest = self._take_units(
                adapter, "lut", 1, Holder(lender, ""), fdid, lent=share
            )
        for sibling in self._siblings(fdid):
            d = self._device_dict(sibling)
            d["entries"] = {**d.get("entries", {}), adapter: start}
            self._put(self._k.device(sibling), enc.dump(d))

    def _covers_nothing(self, raw: bytes, lender: str) -> bool:
        """The block ``raw`` is a lent entry of ``lender`` for a requester none of its devices
        has in the topology now (an amend changed its address): no hold uses it."""
        share = enc.lent_share(raw)
        if share is None or enc.block_owner(raw) != lender:
            return False
        return all(
            (found := self._lent_share_of(d.fdid)) is None or found[1] != share
            for d in self._topo_compiled().devices_of(lender)
        )

    def _siblings(self, fdid: int) -> list[int]:
        """Device ``fdid`` and the other functions of its requester (same lender and
        requester share), which share its requester entries."""
        lender, share = self._lent_share_of(fdid) or ("", "")
        return [
            d.fdid
            for d in self._topo_compiled().devices_of(lender)
            if d.fdid == fdid or self._lent_share_of(d.fdid) == (lender, share)
        ]

    def _device_dict(self, fdid: int) -> dict[str, Any]:
        """Device ``fdid``'s record as stored (with the lent entries it lists), or as the
        topology starts it."""
        raw = self._get(self._k.device(fdid))
        if raw is not None:
            d: dict[str, Any] = enc.load(raw)
            return d
        rec = self.device(fdid)
        if rec is None:
            return {}
        return {"fdid": fdid, "lender": rec.lender, "lent": rec.lent, "available": rec.available}

    def _change_ledger(
        self,
        node: str,
        vm: str,
        fdid: int,
        change: Callable[[dict[str, list[dict[str, Any]]]], None],
    ) -> None:
        """Apply ``change`` to the unit ledger of VM ``vm`` on ``node`` (fdid -> its claims,
        as ``etcd_keys.claim_to_dict``), then create or delete unit blocks until the VM has
        what its claims use (``fdid``: the hold the change is for), and write its claims on
        the head block of each adapter it has them on. The ledger's ``blocks`` are ``[start,
        size]`` per adapter and unit."""
        key = self._k.vm_holds(node, vm)
        raw = self._get(key)
        try:  # a damaged marker is one error naming it, never a traceback
            d: dict[str, Any] = enc.load(raw) if raw is not None else {"vm": vm, "n": 0}
            old: dict[str, list[dict[str, Any]]] = d.get("ledger", {})
            ledger = {f: [dict(c) for c in claims] for f, claims in old.items()}
            change(ledger)
            ledger = {f: claims for f, claims in ledger.items() if claims}
            # the node's own places are decided by count (``_decide``), and a lent device's
            # requester entries are its lender's (``_lent_entry``): not the VM's blocks
            own = self._own_places_of(node, [*ledger.values(), *old.values()])
            rows = [
                self._row(c)
                for f, claims in ledger.items()
                for c in claims
                if c["adapter"] not in own and not self._covered(int(f, 16), c)
            ]
            need = self._units_needed(rows)
            held: dict[str, dict[str, list[list[int]]]] = d.get("blocks", {})
            on = self._on_blocks(ledger, own)
            was = self._on_blocks(old, own)
            mine_before = self._pairs_on(old, own)
            mine_after = self._pairs_on(ledger, own)
            lent = sorted(
                {
                    (c["adapter"], c["share"], int(f, 16))
                    for f, claims in ledger.items()
                    for c in claims
                    if self._covered(int(f, 16), c)
                }
            )
        except _DAMAGE as e:
            raise StateRecordError("VM marker", key, f"{type(e).__name__}: {e}") from None
        if mine_before or mine_after:
            self._decide(node, key, mine_before, mine_after, fdid)
        for adapter, share, of in lent:
            self._lent_entry(adapter, share, of)
        blocks: dict[str, dict[str, list[list[int]]]] = {}
        holder = Holder(node, vm)
        for adapter in sorted({a for a, _u in need} | set(held) | set(on)):
            mine: dict[str, list[list[int]]] = {}
            moved = False
            for unit in ("lut", "seg"):
                have = [(int(s), int(z)) for s, z in sorted(held.get(adapter, {}).get(unit, []))]
                want = need.get((adapter, unit), 0)
                total = sum(z for _s, z in have)
                while total > want:  # given back from the end
                    start, size = have.pop()
                    self._delete(self._k.unit_block(adapter, unit, start, size))
                    total -= size
                    moved = True
                    if total < want and start + size <= self._capacity(adapter, unit):
                        # the first units of a block or run are one at its start (aligned to
                        # what they round up to): kept in place, nothing taken anew
                        have.append((start, want - total))
                        total = want
                if total < want:
                    have += self._take_units(adapter, unit, want - total, holder, fdid)
                    moved = True
                if have:
                    mine[unit] = sorted([s, z] for s, z in have)
            if mine:
                blocks[adapter] = mine
            if moved or on.get(adapter) != was.get(adapter):
                # what the old ledger wrote there, so nothing need be read to know it
                owner = f"{node}/{vm}"
                before = self._block_values(
                    adapter, owner, held.get(adapter, {}), was.get(adapter, []), check=False
                )
                after = self._block_values(adapter, owner, mine, on.get(adapter, []))
                for block, value in after.items():
                    if before.get(block) != value or block in self._writes:
                        self._put(block, value, leased=True, lease_of=key)
        new = {**d, "ledger": ledger}
        new.pop("blocks", None)
        if blocks:
            new["blocks"] = blocks
        if new != d:
            self._put(key, enc.dump(new), leased=True)

    # --- a node's own places: decided in one process (``vmlend.registry.decider``) -------

    def _topo_compiled(self) -> Topology:
        digest = self.topology_digest() or ""
        topo = _CAPACITIES.get(digest)
        if topo is None:
            from vmlend.topology.compiled import stored_topology

            topo = stored_topology(self.topology())
            if len(_CAPACITIES) >= 4:  # a process sees one topology, rarely a few
                _CAPACITIES.clear()
            _CAPACITIES[digest] = topo
        return topo

    def _own_node(self, adapter: str) -> str | None:
        """The node whose own place ``adapter`` is: an adapter's node, a switch port's
        cabled to an adapter (None: a port toward another switch, or an unknown name)."""
        ref = adapter.split("/", 1)[1] if is_port(adapter) else adapter
        spec = self._topo_compiled().adapter(ref)
        return None if spec is None else spec.node

    def _own_places_of(self, node: str, ledgers: Iterable[list[dict[str, Any]]]) -> set[str]:
        """The adapters and ports of ``node``'s own among those the claims of ``ledgers``
        are on."""
        seen = {c["adapter"] for claims in ledgers for c in claims}
        return {a for a in seen if self._own_node(a) == node}

    def _pairs_on(
        self, ledger: dict[str, list[dict[str, Any]]], adapters: Collection[str]
    ) -> Pairs:
        """The ``(fdid, claim)`` of ``ledger`` on ``adapters``, but a lent device's requester
        entries (``_covered``: its lender's, even where the VM is on the lender's node, as a
        hot move's destination is while its claims still name the source's crossing)."""
        return tuple(
            (int(f, 16), enc.claim_from_dict(c))
            for f in sorted(ledger, key=lambda f: int(f, 16))
            for c in ledger[f]
            if c["adapter"] in adapters and not self._covered(int(f, 16), c)
        )

    def _own_pairs(self, node: str, raw: bytes) -> Pairs:
        """A marker's claims on its node's own places: a function of the topology and the
        marker's stored form, so kept per both (another node's reserves through this node's
        adapter read every marker of the node, mostly unchanged since the last)."""
        key = (self.topology_digest() or "", node, raw)
        found = _OWN_PAIRS.get(key)
        if found is None:
            ledger: dict[str, list[dict[str, Any]]] = enc.load(raw).get("ledger", {})
            found = self._pairs_on(ledger, self._own_places_of(node, ledger.values()))
            if len(_OWN_PAIRS) >= 1 << 12:  # a node holds a few hundred VMs at most
                _OWN_PAIRS.clear()
            _OWN_PAIRS[key] = found
        return found

    def _node_plan(self, node: str, *, take_over: bool) -> _Plan | None:
        """This attempt's plan for ``node``'s own places: as this process decides them (the
        epoch key names its epoch), or taking the node over (``take_over``: reading the
        markers of its VMs and its extents, compared, and writing a new epoch if it decides
        anything); None when it neither decides for the node nor takes it over."""
        plan = self._plans.get(node)
        if plan is not None:
            return plan
        dec = self._deciders.of(node)
        key = self._k.decider(node)
        kv = self._snap.get(key)  # compared: a takeover by another process fails this
        try:
            epoch = str(enc.load(kv.value)["epoch"]) if kv is not None else ""
        except _DAMAGE as e:
            raise StateRecordError("node decider", key, f"{type(e).__name__}: {e}") from None
        with dec.lock:
            current = dec.current(epoch)
            # a read older than this process's last takeover (the key absent then: its
            # first) says nothing of now
            older = (kv.mod_revision if kv is not None else self._snap.revision) < dec.revision
            if dec.revision and not current and (self._snap.warmed or older) and self.writable:
                # this registry's memory of the key may be older than another thread's
                # takeover: read it again before deciding the node was lost
                raise RunAgain(f"node {node}'s epoch as remembered is not this process's")
            if dec.revision and not current:
                dec.lose()  # another process took the node over since
            extents = {p: list(e) for p, e in dec.extents.items()}
        if current:
            plan = _Plan(dec, epoch, extents, None)
        elif take_over:
            self._hold_change(dec, node)
            taking = {
                k: self._own_pairs(node, raw)
                for k, raw in self._range(self._k.vm_holds_on(node)).items()
            }
            plan = _Plan(dec, secrets.token_hex(8), self._read_extents(node), taking)
            plan.extents_read = True
        else:
            return None
        self._plans[node] = plan
        return plan

    def _hold_change(self, dec: NodeDecider, node: str) -> None:
        """This attempt is to change the node's epoch or extents: one thread of the process
        at a time does (a takeover or a growth by each of ten threads at once would conflict
        nine times, each run again after a pause). Another thread's change in hand: wait
        until it settled, then run again at once (``RunAgain``). Nested in this thread's own
        attempt (a test's interleaving), the commits' compares decide alone."""
        if node in self._changing or not self.writable:
            return
        me = threading.get_ident()
        with dec.lock:
            if dec.changer is None:
                dec.changer = me
                self._changing.add(node)
                return
            if dec.changer == me:
                return
            # never wait holding another node's change (two attempts would wait on each
            # other): run again, after this attempt settled what it holds
            self._wait_change(dec, node)

    def _read_extents(self, node: str) -> dict[Place, list[tuple[int, int]]]:
        """The node's extents as its extents key lists them (compared: two attempts that
        change them conflict)."""
        key = self._k.extents(node)
        raw = self._get(key)
        try:
            d: dict[str, dict[str, list[list[int]]]] = enc.load(raw) if raw is not None else {}
            listed = {
                (a, u): [(int(s), int(z)) for s, z in spans]
                for a, units in d.items()
                for u, spans in units.items()
            }
        except _DAMAGE as e:
            raise StateRecordError("node extents", key, f"{type(e).__name__}: {e}") from None
        # only what stands as the node's extent blocks (a listing left by an older state
        # would make the node decide within units no block holds)
        out: dict[Place, list[tuple[int, int]]] = {}
        for (adapter, unit), spans in listed.items():
            blocks = self._loose_range(self._k.units_of(adapter))
            for start, size in spans:
                there = blocks.get(self._k.unit_block(adapter, unit, start, size))
                if there is not None and enc.is_extent(there) and enc.block_owner(there) == node:
                    out.setdefault((adapter, unit), []).append((start, size))
                elif self._snap.warmed:
                    # remembered blocks may be older than the key (another process cut an
                    # extent since): dropping a block listed now would leave it unlisted
                    raise RunAgain(f"node {node}'s extents as remembered are older than its key")
        return out

    def _decide(self, node: str, marker: str, before: Pairs, after: Pairs, hint: int) -> None:
        """The VM of ``marker`` goes from claims ``before`` to ``after`` on ``node``'s own
        places. What it gives back needs no decision; what it adds must fit the node's
        extents with everything else the node's VMs use there (committed, and in flight in
        this process), or the node takes one more extent (a block, which conflicts with any
        other taken there). The epoch key is compared, and written when the node is taken
        over; the extents key is read, compared and written when the extents change."""
        places = {(c.adapter, u) for _f, c in (*before, *after) for u in ("lut", "seg")}
        growing = grows(before, after)
        if not growing and node not in self._plans and not self._deciders.of(node).revision:
            return  # gives back, in a process that never decided for the node: nothing to tell
        plan = self._node_plan(node, take_over=growing)
        if plan is None:
            return  # it only gives back: nothing to decide (the decider's count errs high)
        plan.changes[marker] = after
        if not growing:
            if plan.taking is None:
                self._give_back(node, plan)
            return
        dec = plan.dec
        changed = [p for pairs in plan.changes.values() for p in pairs]
        if plan.taking is None:
            with dec.lock:
                if dec.changer not in (None, threading.get_ident()):
                    # another thread changes the extents: decide on what it leaves
                    self._wait_change(dec, node)
                self._still_deciding(plan, node)
                dec.flight[id(self)] = tuple(changed)
                use = own_usage(dec.pairs(), places)
                if not plan.extents_read:
                    # the extents as the process's last change left them: another thread
                    # may have given some back since this attempt's plan was made (in its
                    # admission), and a decision within extents compares no block
                    plan.extents = {p: list(e) for p, e in dec.extents.items()}
        else:
            use = own_usage([*(p for v in plan.taking.values() for p in v), *changed], places)
        for place in sorted(p for p in places if use.get(p, 0)):
            if use[place] <= sum(z for _s, z in plan.extents.get(place, [])):
                continue
            if not plan.extents_read:  # the extents as stored, which the growth rewrites
                self._hold_change(dec, node)
                plan.extents = self._read_extents(node)
                plan.extents_read = True
            short = use[place] - sum(z for _s, z in plan.extents.get(place, []))
            if short <= 0:
                continue
            adapter, unit = place
            # padded, but never to more than half of what is free: other hosts borrowing the
            # node's devices take their units there too
            pad = min(self._chunk(place), self._free_below_capacity(adapter, unit) // 2)
            take = max(short, pad)
            got = self._take_units(adapter, unit, take, Holder(node, ""), hint, extent=True)
            plan.extents.setdefault(place, []).extend(got)
            plan.write_extents = True
        if plan.taking is not None:
            # taking the node over: what its extents hold beyond what its VMs use now goes
            # back (a process that decided before kept what its VMs used at their most)
            plan.write_epoch = True
            every = [p for v in (*plan.taking.values(), *plan.changes.values()) for p in v]
            now = own_usage(every, plan.extents)
            for place, spans in plan.extents.items():
                for start, size in sorted(spans, key=lambda sz: (-sz[1], sz[0])):
                    if sum(z for _s, z in spans) - size >= now.get(place, 0):
                        spans.remove((start, size))
                        self._delete(self._k.unit_block(*place, start, size))
                        plan.write_extents = True
            self._put(self._k.decider(node), enc.dump({"epoch": plan.epoch}))
        if plan.write_extents:
            self._write_extents(node, plan)

    def _write_extents(self, node: str, plan: _Plan) -> None:
        listed: dict[str, dict[str, list[list[int]]]] = {}
        for (a, u), spans in sorted(plan.extents.items()):
            if spans:
                listed.setdefault(a, {})[u] = [[s, z] for s, z in sorted(spans)]
        if listed:
            self._put(self._k.extents(node), enc.dump(listed))
        else:
            self._delete(self._k.extents(node))

    def _give_back(self, node: str, plan: _Plan) -> None:
        """After a VM of the node gave claims back, in the process deciding for it: an
        extent block goes back where the node's slack on a place reaches two chunks, down to
        one chunk of slack (so a VM's reserve and release cycle does not take and give back
        every time, and other hosts borrowing the node's devices get the rest). What the
        node's VMs use counts this attempt's changes and every other attempt in flight; an
        attempt deciding after this one waits for it (``_hold_change``)."""
        dec = plan.dec
        with dec.lock:
            if dec.changer is not None or not dec.current(plan.epoch):
                # another change in hand, or the tally dropped (``_still_deciding``): the
                # next release gives back
                return
            use = own_usage(dec.pairs_with(plan.changes, id(self)), dec.extents)
            slack = {p: sum(z for _s, z in e) - use.get(p, 0) for p, e in dec.extents.items()}
        if not any(n >= 2 * self._chunk(p) for p, n in slack.items()):
            return
        self._hold_change(dec, node)
        plan.extents = self._read_extents(node)
        plan.extents_read = True
        with dec.lock:
            if not dec.current(plan.epoch):
                return
            use = own_usage(dec.pairs_with(plan.changes, id(self)), plan.extents)
        for place, spans in plan.extents.items():
            total = sum(z for _s, z in spans)
            chunk = self._chunk(place)
            if total - use.get(place, 0) < 2 * chunk:
                continue
            for start, size in sorted(spans, key=lambda sz: (-sz[1], sz[0])):
                if total - size >= use.get(place, 0) + chunk:
                    spans.remove((start, size))
                    total -= size
                    self._delete(self._k.unit_block(*place, start, size))
                    plan.write_extents = True
        if plan.write_extents:
            self._write_extents(node, plan)

    def _shrink_for(self, adapter: str, unit: str, short: int) -> bool:
        """Make ``short`` units of ``adapter``'s ``unit`` free for a VM's blocks by giving back
        extent blocks of the node whose own place it is, where what the node's VMs use once
        this attempt committed leaves that much slack (a hot move gives its source VM's
        claims back there, then takes them as its destination VM's blocks); this attempt
        decides for the node then (taking it over if it must). False: nothing given back."""
        node = self._own_node(adapter)
        if node is None:
            return False
        plan = self._node_plan(node, take_over=True)
        if plan is None:
            return False
        dec, place = plan.dec, (adapter, unit)
        self._hold_change(dec, node)
        if not plan.extents_read:
            plan.extents = self._read_extents(node)
            plan.extents_read = True
        if plan.taking is None:
            with dec.lock:
                self._still_deciding(plan, node)
                pairs = dec.pairs_with(plan.changes, id(self))
        else:
            taken = {**plan.taking, **plan.changes}
            pairs = [p for v in taken.values() for p in v]
        use = own_usage(pairs, [place]).get(place, 0)
        spans = plan.extents.get(place, [])
        total = sum(z for _s, z in spans)
        if total - use < short:
            return False
        keep = max(use, total - short)
        for start, size in sorted(spans, key=lambda sz: (sz[1], sz[0])):
            if total - size >= keep:
                spans.remove((start, size))
                total -= size
                self._delete(self._k.unit_block(adapter, unit, start, size))
        if total > keep:
            # the rest off one block too large to go whole (an extent of 8 units whose node
            # uses 1): it is cut to the aligned blocks of what stays, from its start
            start, size = min(spans, key=lambda sz: (sz[1], sz[0]))
            spans.remove((start, size))
            self._delete(self._k.unit_block(adapter, unit, start, size))
            at = start
            for part in _block_sizes(size - (total - keep)):
                spans.append((at, part))
                self._put(self._k.unit_block(adapter, unit, at, part), enc.extent_to_json(node))
                at += part
        plan.write_extents = True
        self._write_extents(node, plan)
        if plan.taking is not None and not plan.write_epoch:
            plan.write_epoch = True
            self._put(self._k.decider(node), enc.dump({"epoch": plan.epoch}))
        return True

    def _chunk(self, place: Place) -> int:
        """The slack an extent is padded to and kept at on ``place``: ``EXTENT_CHUNK``
        units, fewer on a small adapter (a quarter of it)."""
        return min(EXTENT_CHUNK, max(1, self._capacity(*place) // 4))

    def _wait_change(self, dec: NodeDecider, node: str) -> None:
        """(``dec.lock`` held) Wait until another thread's change of the node settled, then
        run again at once on what it left (``RunAgain``); if this attempt holds a change of
        its own, without waiting, and after a pause (``RunAgain.pause``)."""
        holding = bool(self._changing)
        while dec.changer is not None and not holding:
            dec.changed.wait()
        changed = f"another thread of this process changed node {node}'s decider"
        raise RunAgain(changed, pause=holding)

    def _free_below_capacity(self, adapter: str, unit: str) -> int:
        """How many of the adapter's units below its capacity no block holds."""
        cap = self._capacity(adapter, unit)
        spans = self._spans(adapter, unit, self._loose_range(self._k.units_of(adapter)))
        return max(0, cap - sum(min(s + z, cap) - s for s, z in spans if s < cap))

    def _own_view(self, node: str, adapter: str) -> list[tuple[int, Claim]] | None:
        """The claims of ``node``'s VMs on its own ``adapter`` as this attempt decides (None
        when it does not: it counts the node's extents there instead)."""
        acting = node in self._acting
        if not acting and node not in self._plans:
            # not for a VM of the node: seen as any other host sees it, whether this process
            # decides for it or not (no epoch read; its VMs' claims as their markers hold them)
            return None
        plan = self._node_plan(node, take_over=acting)
        if plan is None:
            return None
        pairs: list[tuple[int, Claim]] = [p for v in plan.changes.values() for p in v]
        if plan.taking is None:
            with plan.dec.lock:
                self._still_deciding(plan, node)
                pairs += plan.dec.pairs()
        else:
            pairs += [p for v in plan.taking.values() for p in v]
        return [(f, c) for f, c in pairs if c.adapter == adapter]

    @staticmethod
    def _still_deciding(plan: _Plan, node: str) -> None:
        """(``plan.dec.lock`` held) This attempt's plan decides from the process's tally:
        it must still be the one its plan began with. Another thread's commit that may have
        landed unanswered dropped it (``settle``: the node is to be taken over again), and
        what stays of it is only the attempts in flight: run again, taking the node over."""
        if not plan.dec.current(plan.epoch):
            raise RunAgain(f"node {node}'s tally was dropped meanwhile: take it over again")

    def settle(self, outcome: str, revision: int) -> None:
        """After the attempt: ``outcome`` is ``committed`` (at ``revision``), ``unknown`` (the
        body failed, or the commit's answer was lost) or anything else (not committed). The
        nodes it decided for learn what it committed; what was in flight is no longer. A
        commit that may have landed unanswered (lost, or sent twice and then refused: the
        first send may have landed) leaves the node to be taken over again."""
        for plan in self._plans.values():
            dec = plan.dec
            with dec.lock:
                dec.flight.pop(id(self), None)
                if outcome != "committed":
                    if self.sent and (outcome == "unknown" or self.resent):
                        dec.lose()  # it may have committed: what the node uses is read again
                elif plan.write_epoch:
                    read = {**(plan.taking or {}), **plan.changes}
                    dec.install(revision, plan.epoch, plan.extents, (revision, read))
                elif dec.revision and dec.epoch == plan.epoch:
                    dec.learn(revision, plan.changes)
                    if plan.write_extents:
                        dec.install(dec.revision, plan.epoch, plan.extents, None)
        for node in self._changing:  # whatever became of the attempt (after what it
            held = self._deciders.of(node)  # installed): the waiting threads go on
            with held.lock:
                held.changer = None
                held.changed.notify_all()

    def _put(
        self,
        key: str,
        value: bytes,
        *,
        leased: bool = False,
        fresh: bool = False,
        lease_of: str | None = None,
    ) -> None:
        """Buffer a put. ``leased``: the record goes with its host (holds, claims, mdevs,
        runtime): a new key gets this host's agent lease, a rewritten one keeps its lease.
        ``fresh``: a record of a new hold, which gets this host's lease even where its key
        exists (a hand-over's destination hold would otherwise stay on the source host's
        lease, and end with it while the destination's VM runs). ``lease_of``: the record
        goes on the lease of that key, written in this transaction (a VM's unit blocks on its
        marker's, whichever host writes them: they lapse together, so no block outlives its
        place in a ledger, nor a ledger its blocks)."""
        self._write()
        self._writes[key] = value
        if not leased:  # a key put again unleased in this attempt (an extent where a VM's
            self._leased.discard(key)  # block was given back) keeps none of its lease
            self._fresh.discard(key)
            self._lease_of.pop(key, None)
        if leased:
            self._leased.add(key)
            if fresh:
                self._fresh.add(key)
            if lease_of is not None:
                self._lease_of[key] = lease_of
            self._lease_for(key)  # no agent: refuse now, before anything else is decided

    def lease(self) -> int:
        """This host's agent lease (``AgentNotRunningError`` when there is none)."""
        return self._host_lease() if self._host_lease is not None else 0

    def _lease_for(self, key: str) -> int:
        if key in self._fresh:
            return self.lease()
        if key in self._lease_of:
            return self._lease_for(self._lease_of[key])
        if self._deleted_by_range(key):
            kv = None
        elif self._snap.warmed:
            # the lease of a remembered key may be old: compared, so a key put again since
            # (on another lease) fails the commit rather than moving to the lease it had
            kv = self._snap.get(key)
        else:
            kv = self._snap.peek(key)
        return kv.lease if kv is not None else self.lease()

    def _delete(self, key: str) -> None:
        self._write()
        self._writes[key] = None

    def _delete_range(self, prefix: str) -> None:
        self._write()
        for k in list(self._writes):
            if k.startswith(prefix):
                del self._writes[k]
        self._range_deletes.append(prefix)

    # --- commit ------------------------------------------------------------------------------
    def operations(self) -> list[dict[str, Any]]:
        ops: list[dict[str, Any]] = [
            {"request_delete_range": {"key": b64(p), "range_end": b64(prefix_end(p))}}
            for p in self._range_deletes
        ]
        for key, value in self._writes.items():
            if value is None:
                if self._deleted_by_range(key):
                    continue  # already gone with its range
                ops.append({"request_delete_range": {"key": b64(key)}})
            else:
                if self._deleted_by_range(key):
                    # etcd refuses a Txn that deletes a range and puts a key inside it.
                    raise RuntimeError(f"put of {key} inside a range this transaction deletes")
                put: dict[str, Any] = {"key": b64(key), "value": b64(value)}
                if key in self._leased and (lease := self._lease_for(key)):
                    put["lease"] = lease
                    self._put_leases[key] = lease
                ops.append({"request_put": put})
        return ops

    def compares(self) -> list[dict[str, Any]]:
        return self._snap.compares()

    @property
    def warmed(self) -> bool:
        """Whether this attempt took items from the warm cache (see ``Snapshot``)."""
        return self._snap.warmed

    def learn(self, warm: WarmCache, revision: int) -> None:
        """Tell ``warm`` what this attempt knew, after it committed at ``revision``."""
        writes: dict[str, Write] = {}
        for key, value in self._writes.items():
            if value is None:
                writes[key] = (None, 0)
            elif not self._deleted_by_range(key):
                writes[key] = (value, self._put_leases.get(key, 0))
        keys, ranges, loose = self._snap.learned()
        warm.learn(keys, ranges, loose, writes, self._range_deletes, revision)

    def prefetch(
        self,
        fdids: Iterable[int] = (),
        nodes: Iterable[str] = (),
        adapters: Iterable[str] = (),
        held_by: Iterable[Holder] = (),
        *,
        release_on: str | None = None,
    ) -> None:
        """A hint: the body is about to read these devices (record, hold, fence), nodes,
        adapters' claims and units, the holds of the ``held_by`` VMs (each VM's marker), and
        the topology digest; fetch them in one request. A release
        (``release_on``) also reads the devices' runtime records and that node's mdevs and
        mdev parents of them."""
        fdids = list(fdids)
        keys = [self._k.topology_digest, self._k.meta(LINKS_DOWN_KEY)]
        if not self._topo_cache:
            # The head too, while this process has not decoded a topology: its first
            # transaction needs it. Later ones decide on the digest (compared), which names the
            # content; the head is read again only when the digest changes.
            keys.append(self._k.topology_head)
        prefixes: list[str] = []
        # an adapter's claims and units, read without a prefix compare (see ``_take_units``),
        # and, for a node's own place, the markers of the node's VMs (``claims_on``)
        adapters = list(adapters)
        loose = [self._k.units_of(a) for a in adapters]
        loose += [self._k.vm_holds_on(n) for n in dict.fromkeys(map(_node_of_ref, adapters)) if n]
        for fdid in fdids:
            keys += [self._k.hold(fdid), self._k.fence(fdid), self._k.device(fdid)]
        for node in nodes:
            keys += [self._k.node(node), self._k.agent(node), self._k.host(node)]
        # The VM's own marker, which lists its holds (``holds_of``): not every marker of the
        # node (its index), a read that grew with the node's VMs.
        for h in held_by:
            keys.append(self._k.vm_holds(h.node, h.vm))
            if h.node not in self._acting:
                # the node's epoch and extents; and if this process does not decide for
                # the node yet, what taking it over reads (its VMs' markers). Loose: each
                # compared only once read (a release in a process that does not decide for
                # the node reads none of them, and would otherwise conflict with every
                # change to another VM of the node)
                self._acting.add(h.node)
                loose.append(self._k.decider_of(h.node))
                if not self._deciders.of(h.node).revision:
                    loose.append(self._k.vm_holds_on(h.node))
        if release_on is not None:
            keys += [self._k.parent(release_on, fdid) for fdid in fdids]
            prefixes += [self._k.runtime_of(fdid) for fdid in fdids]
            prefixes.append(self._k.mdevs_on(release_on))
        self._snap.prefetch(keys, prefixes, loose)

    # --- meta ----------------------------------------------------------------------------
    @_decoding("meta")
    def meta(self, key: str) -> str | None:
        raw = self._get(self._k.meta(key))
        return None if raw is None else raw.decode()

    def set_meta(self, key: str, value: str) -> None:
        self._put(self._k.meta(key), value.encode())

    # --- topology ----------------------------------------------------------------------
    def topology_digest(self) -> str | None:
        raw = self._get(self._k.topology_digest)
        return None if raw is None else raw.decode()

    def _topology(self) -> StoredView | None:
        digest = self.topology_digest()
        if digest is None:
            return None
        cached = self._topo_cache.get(digest)
        if cached is None:
            cached = self._read_topology(digest)
            self._topo_cache.clear()  # one topology at a time is all a process needs
            self._topo_cache[digest] = cached
        return cached

    def _read_topology(self, digest: str) -> StoredView:
        """The content of the generation the head names (this host's copy, else the pieces
        at this snapshot's revision), or the record vmlend wrote before generations."""
        raw = self._get(self._k.topology_head)
        if raw is not None:
            head = topopieces.decode_head(raw, self._k.topology_head)
            if head.digest != digest:
                raise StateRecordError(
                    "topology",
                    self._k.topology_head,
                    f"names topology {head.digest[:12]} while the digest key says"
                    f" {digest[:12]}; run 'vmlend fabric init --replace --topology FILE'",
                )
            if self._generations is None:
                raise RuntimeError("a transaction without the topology's generations")
            return self._generations.load(head, self._snap.known_at(self._k.topology_head))
        raw = self._get(self._k.topology_record)
        if raw is None:
            raise StateError(f"etcd holds a topology digest but no topology record ({digest})")
        return StoredView(self._k.topology_record, topopieces.legacy(enc.load(raw)))

    def _need_topology(self) -> StoredView:
        topo = self._topology()
        if topo is None:
            raise StateError("the registry holds no topology; run 'vmlend fabric init'")
        return topo

    @_decoding("topology")
    def topology(self) -> TopologyRecord:
        t = self._need_topology()
        # local_node stays empty: on a cluster, which node a host is is host configuration.
        # the text and the compiled form are read when used (a hook call needs neither whole)
        return TopologyRecord(
            t.name, t.source, lambda: t.text, t.digest, "", t.created, t.compiled_view
        )

    def has_topology(self) -> bool:
        return self.topology_digest() is not None

    def replace_topology(
        self, rec: TopologyRecord, nodes: Iterable[str], devices: Iterable[DeviceRecord]
    ) -> None:
        """Install a topology, dropping everything that described the previous one."""
        self._write()
        for prefix in (
            self._k.nodes,
            self._k.devices,
            self._k.holds,
            self._k.vm_markers,
            self._k.units,  # the claims, on their unit blocks
            self._k.deciders,  # the nodes' epochs and extents, with the blocks of the latter
            self._k.parents,
            self._k.mdevs,
            self._k.runtime,
        ):
            self._delete_range(prefix)
        self._install(topopieces.of_record(rec, nodes, devices))

    def amend_topology(
        self, rec: TopologyRecord, nodes: Iterable[str], devices: Iterable[DeviceRecord]
    ) -> None:
        """Install a topology that keeps every node and device of the one in place: a new
        generation, and nothing deleted (``StateTxn.amend_topology``). A node's or device's
        record overrides the generation's default, as before."""
        self._write()
        self._install(topopieces.of_record(rec, nodes, devices))

    def _install(self, stored: StoredTopology) -> None:
        """Write ``stored`` as a new generation now (pieces, several requests) and name it
        in this transaction (the head, compared against the generation's seal)."""
        if self._generations is None:
            raise RuntimeError("a transaction without the topology's generations")
        staged = self._generations.stage(stored)
        self.staged.append(staged.head.generation)
        self._snap.expect(staged.seal, staged.seal_revision)
        self._put(self._k.topology_head, topopieces.encode_head(staged.head))
        self._put(self._k.topology_digest, stored.digest.encode())
        self._delete(self._k.topology_record)  # the record of before generations, if any
        # Older vmlends read ``topology/record``: the version tells them to upgrade.
        self._put(self._k.meta("schema_version"), str(ETCD_SCHEMA_VERSION).encode())

    @_decoding("topology")
    def set_topology_compiled(self, compiled: bytes) -> None:
        """Store the compiled form of the topology already installed (one an older vmlend
        wrote without it): a new generation of the same content with it. The digest stays:
        another process's cached copy without it still describes the same topology."""
        self._write()
        # Read in this transaction (so the head is compared at commit), not the process's
        # cache of it: another host may have re-installed the same text.
        digest = self.topology_digest()
        if digest is None:
            raise StateError("the registry holds no topology; run 'vmlend fabric init'")
        current = self._read_topology(digest)
        self._install(msgspec.structs.replace(current.whole(), compiled=compiled))

    def store_topology_in_generations(self) -> bool:
        """Store a topology kept in one record (layout 2, ``topology/record``) as a generation
        of pieces, its content unchanged (``vmlend registry upgrade``); False when there is no
        such record (a topology in generations already, or none)."""
        self._write()
        digest = self.topology_digest()
        if digest is None or self._get(self._k.topology_head) is not None:
            return False
        current = self._read_topology(digest)
        self._install(current.whole())
        return True

    def rewrite_topology_generation(self) -> bool:
        """Write the topology's generation again in this vmlend's format (layout 4: format 2,
        read a chunk at a time, its compiled form compiled again) when it is of format 1
        (``vmlend registry upgrade``); whether it was."""
        self._write()
        digest = self.topology_digest()
        raw = self._get(self._k.topology_head)
        if digest is None or raw is None:
            return False
        head = topopieces.decode_head(raw, self._k.topology_head)
        if head.format == topopieces.PIECES_FORMAT:
            return False
        self._install(topopieces.rewritten(self._read_topology(digest).whole()))
        return True

    def live_hosts(self) -> list[str]:
        """The nodes whose agent's lease lives (``hosts/<node>``), read as a compared prefix:
        one that appears before the commit makes the transaction run again."""
        return sorted(k.removeprefix(self._k.hosts) for k in self._range(self._k.hosts))

    def set_local_node(self, node: str) -> None:
        """Nothing to do: the shared state never says which node a host is."""
        self._write()

    # --- nodes and devices: the topology's defaults, overridden by records -------------------
    @_decoding("node")
    def nodes(self) -> dict[str, NodeRecord]:
        topo = self._topology()
        out = {n: NodeRecord(n, True) for n in (topo.nodes if topo else [])}
        for raw in self._range(self._k.nodes).values():
            d = enc.load(raw)
            out[d["name"]] = NodeRecord(d["name"], bool(d["up"]), d.get("why", ""))
        managed = {k.removeprefix(self._k.agents) for k in self._range(self._k.agents)}
        alive = {k.removeprefix(self._k.hosts) for k in self._range(self._k.hosts)}
        for name in managed - alive:
            if name in out and out[name].up:
                out[name] = NodeRecord(name, False, _AGENT_GONE)
        return out

    @_decoding("node")
    def node(self, name: str) -> NodeRecord | None:
        raw = self._get(self._k.node(name))
        if raw is not None:
            d = enc.load(raw)
            rec: NodeRecord | None = NodeRecord(d["name"], bool(d["up"]), d.get("why", ""))
        else:
            topo = self._topology()
            rec = NodeRecord(name, True) if topo and name in topo.node_set else None
        if rec is not None and rec.up and self._agent_gone(name):
            return NodeRecord(name, False, _AGENT_GONE)
        return rec

    def _agent_gone(self, name: str) -> bool:
        """The node ran an agent that stopped without saying so (crash, power, cut off)."""
        return self._get(self._k.agent(name)) is not None and self._get(self._k.host(name)) is None

    def set_node_up(self, node: str, up: bool, why: str = "") -> None:
        if self.node(node) is None:
            self._write()
            return
        if up:
            self._delete(self._k.node(node))
        else:
            self._put(self._k.node(node), enc.dump({"name": node, "up": False, "why": why}))

    @staticmethod
    def _device_default(topo: StoredView | None, fdid: int) -> DeviceRecord | None:
        entry = topo.device_default(fdid) if topo else None
        return None if entry is None else DeviceRecord(fdid, entry[0], bool(entry[1]))

    @staticmethod
    def _device_from(raw: bytes) -> DeviceRecord:
        d = enc.load(raw)
        return DeviceRecord(int(d["fdid"]), d["lender"], bool(d["lent"]), bool(d["available"]))

    @_decoding("device")
    def devices(self, fdids: Collection[int] | None = None) -> dict[int, DeviceRecord]:
        if fdids is not None:
            # Keys are by fdid, not by lender: the given ones, read in one request
            self._snap.prefetch([self._k.device(f) for f in fdids], [])
            return {f: rec for f in fdids if (rec := self.device(f)) is not None}
        topo = self._topology()
        out: dict[int, DeviceRecord] = {}
        for hex_fdid, (lender, lent) in (topo.devices if topo else {}).items():
            out[int(hex_fdid, 16)] = DeviceRecord(int(hex_fdid, 16), lender, bool(lent))
        for raw in self._range(self._k.devices).values():
            rec = self._device_from(raw)
            out[rec.fdid] = rec
        return out

    @_decoding("device")
    def device(self, fdid: int) -> DeviceRecord | None:
        raw = self._get(self._k.device(fdid))
        if raw is not None:
            return self._device_from(raw)
        return self._device_default(self._topology(), fdid)

    def _set_device(self, fdid: int, **change: bool) -> None:
        d = self._device_dict(fdid)
        if not d:
            self._write()
            return
        d.update(change)
        self._put(self._k.device(fdid), enc.dump(d))

    def set_lent(self, fdid: int, lent: bool) -> None:
        rec = self.device(fdid)
        self._set_device(fdid, lent=lent)
        if rec is not None and rec.lent and not lent:
            self._unlent_entries(fdid)

    def _unlent_entries(self, fdid: int) -> None:
        """Device ``fdid`` is no longer lent: where no other function of its requester still
        is, the entries its record lists go (``_lent_entry``), from every record that lists
        them. The others' records are compared: a lend of one of them meanwhile makes this
        run again."""
        siblings = self._siblings(fdid)
        if any((rec := self.device(f)) is not None and rec.lent for f in siblings if f != fdid):
            return
        lender_share = self._lent_share_of(fdid)
        # what any function's record lists (one a topology amend added lists none)
        entries: dict[str, int] = {}
        for f in siblings:
            entries.update(self._device_dict(f).get("entries", {}))
        for place, start in sorted(entries.items()):
            key = self._k.unit_block(place, "lut", int(start), 1)
            raw = self._loose_range(self._k.units_of(place)).get(key)
            if lender_share is None or raw is None:
                continue
            if enc.lent_share(raw) == lender_share[1] or self._covers_nothing(raw, lender_share[0]):
                self._delete(key)
        for f in siblings:
            d = self._device_dict(f)
            if d.pop("entries", None) is not None:
                self._put(self._k.device(f), enc.dump(d))

    def set_available(self, fdid: int, available: bool) -> None:
        self._set_device(fdid, available=available)

    # --- holds and claims ------------------------------------------------------------------
    @_decoding("hold")
    def holds(self) -> dict[int, HoldRecord]:
        out = {}
        for key, raw in self._range(self._k.holds).items():
            d = enc.load(raw)
            hold = enc.hold_from_dict(d)
            out[hold.fdid] = msgspec.structs.replace(hold, token=self._token(key, d))
        return out

    @_decoding("hold")
    def holds_of(self, holder: Holder) -> dict[int, HoldRecord]:
        """Through the VM's marker, never every hold of the cluster nor of its node: the
        marker lists the VM's holds, and only those holds are fetched (in one request; none
        when it holds nothing)."""
        # Compared: the VM's marker, which every hold it gains rewrites, and each of its holds
        # (read below), which a release deletes.
        raw = self._get(self._k.vm_holds(holder.node, holder.vm))
        fdids = sorted(self._marker_fdids(enc.load(raw) if raw is not None else {}))
        self._snap.prefetch([self._k.hold(f) for f in fdids], [])
        out = {}
        for fdid in fdids:
            hold = self.hold(fdid)
            if hold is not None and same_holder(hold.holder, holder):
                out[fdid] = hold
        return out

    def _hold_dict(self, fdid: int) -> dict[str, Any] | None:
        raw = self._get(self._k.hold(fdid))
        return None if raw is None else enc.load(raw)

    @_decoding("hold")
    def hold(self, fdid: int) -> HoldRecord | None:
        d = self._hold_dict(fdid)
        if d is None:
            return None
        return msgspec.structs.replace(
            enc.hold_from_dict(d), token=self._token(self._k.hold(fdid), d)
        )

    def _token(self, key: str, d: dict[str, Any]) -> int:
        """The fencing token of the hold or fence record ``d`` read at ``key`` (0: written by
        this transaction, known once committed): its ``reissued`` token when it was re-made
        under a key that existed (``add_hold``), else the key's creation revision (a hold and
        the fence it leaves are made in one Txn, so theirs agree)."""
        if key in self._writes:
            return 0
        if d.get("reissued"):
            return int(d["reissued"])
        kv = self._snap.get(key)
        return 0 if kv is None else kv.create_revision

    def _reissue(self, fdid: int) -> int:
        """The token a hold of ``fdid`` made now carries in its records, or 0 when its hold
        and fence keys do not exist in the store (the put creates them: their creation
        revision, the commit's, is the token). A hand-over deletes the source's hold and adds
        the destination's in one Txn, which etcd commits as a put of an existing key: its
        creation revision would stay the old holder's, and the device's side, told "the same
        token", would not refuse the old holder. So the re-made records carry the revision
        after the one the hold and fence are known at (read, or remembered by an earlier
        commit: ``Snapshot.known_at``): newer than every token issued for the device so far
        (each issue wrote them, at or before that revision), older than any issued after the
        commit, and nobody else's, since a commit in between touching them fails the
        compares."""
        hold, fence = self._k.hold(fdid), self._k.fence(fdid)
        if self._snap.peek(hold) is None and self._snap.peek(fence) is None:
            return 0
        return max(self._snap.known_at(hold), self._snap.known_at(fence)) + 1

    def add_hold(self, hold: HoldRecord, claims: Iterable[Claim]) -> None:
        self._write()
        if self._hold_dict(hold.fdid) is not None:
            raise StateError(f"device {hold.fdid:#x} is already held")
        reissued = self._reissue(hold.fdid)
        record = enc.hold_to_json(hold, reissued)
        self._put(self._k.hold(hold.fdid), record, leased=True, fresh=True)
        self._touch_vm(hold.holder, hold.fdid)
        listed = [enc.claim_to_dict(c) for c in claims]
        if listed:
            self._set_ledger_claims(hold.holder.node, hold.holder.vm, hold.fdid, listed)
        # The fence outlives the hold when the lease ends. Written in the hold's Txn, its key's
        # creation revision is the hold's: its fencing token. Its "token" field keeps the lease
        # the hold was under (what the agent moves when the host's lease changes).
        h = hold.holder
        fence: dict[str, Any] = {"fdid": hold.fdid, "node": h.node, "vm": h.vm}
        fence |= {"vm_uuid": h.vm_uuid, "token": self.lease()}
        if reissued:
            fence["reissued"] = reissued
        self._put(self._k.fence(hold.fdid), enc.dump(fence))

    @_decoding("hold")
    def set_phase(self, fdid: int, phase: Phase) -> None:
        d = self._hold_dict(fdid)
        if d is None:
            self._write()
            return
        self._put(self._k.hold(fdid), enc.dump({**d, "phase": phase.value}), leased=True)

    @_decoding("hold")
    def delete_hold(self, fdid: int) -> None:
        """Drop the hold, its claims and its runtime records."""
        d = self._hold_dict(fdid)
        if d is None:
            self._write()
            return
        for key in self._range(self._k.runtime_of(fdid)):
            self._delete(key)
        self._delete(self._k.hold(fdid))
        self._delete(self._k.fence(fdid))  # a normal release needs no taking back
        self._forget_units(d["node"], d["vm"], fdid)
        self._untrack_vm(d["node"], d["vm"], fdid)

    def _set_ledger_claims(
        self, node: str, vm: str, fdid: int, claims: list[dict[str, Any]]
    ) -> None:
        """Record that ``fdid``'s hold has exactly ``claims`` (``claim_to_dict`` each) in its
        VM's ledger."""

        def change(ledger: dict[str, list[dict[str, Any]]]) -> None:
            ledger[f"{fdid:#x}"] = claims

        self._change_ledger(node, vm, fdid, change)

    def _forget_units(self, node: str, vm: str, fdid: int) -> None:
        """Drop ``fdid`` from its VM's unit ledger (the units no other claim needs go)."""
        raw = self._get(self._k.vm_holds(node, vm))
        if raw is None or f"{fdid:#x}" not in enc.load(raw).get("ledger", {}):
            return  # a hold without claims (a device used on its own node): nothing to give

        def drop(ledger: dict[str, list[dict[str, Any]]]) -> None:
            ledger.pop(f"{fdid:#x}", None)

        self._change_ledger(node, vm, fdid, drop)

    @_decoding("claim")
    def replace_claims(
        self, kind: ClaimKind, owners: Iterable[int], claims: Iterable[tuple[int, Claim]]
    ) -> None:
        """Replace the claims of ``kind`` held by the holds of ``owners`` with ``claims``
        (each ``(owner fdid, claim)``; the owner must have a hold): each owner's claims in
        its VM's ledger, and so its VM's units and head blocks."""
        self._write()
        replaced = set(owners)
        added: dict[int, list[dict[str, Any]]] = {}
        for fdid, c in claims:
            added.setdefault(fdid, []).append(enc.claim_to_dict(c))
        for fdid in sorted(replaced | set(added)):
            d = self._hold_dict(fdid)
            if d is None:
                if fdid in added:
                    raise StateError(f"device {fdid:#x} has no hold to own {kind.value} claims")
                continue
            raw = self._get(self._k.vm_holds(d["node"], d["vm"]))
            ledger = enc.load(raw).get("ledger", {}) if raw is not None else {}
            old: list[dict[str, Any]] = ledger.get(f"{fdid:#x}", [])
            keep = [c for c in old if not (fdid in replaced and c["kind"] == kind.value)]
            new = keep + added.get(fdid, [])
            if new != old:
                self._set_ledger_claims(d["node"], d["vm"], fdid, new)

    def drop_layout4_holds(self) -> int:
        """Layout 4 -> 5 (``vmlend registry upgrade``, every agent's lease ended): delete
        what is left of holds, markers, unit blocks, claims and the nodes' indexes, all of
        which the ended leases took with them but for records a process wrote without a
        lease. A hold deleted so is one whose lease ended: its fence stays, so its lender
        takes the device back. Returns how many keys went."""
        self._write()
        k = self._k
        gone = 0
        for prefix in (*k.layout4_prefixes(), k.vm_markers, k.units, k.deciders, k.holds):
            gone += len(self._snap.range(prefix))
            self._delete_range(prefix)
        return gone

    def _fence_from(self, key: str, raw: bytes) -> FenceRecord:
        d = enc.load(raw)
        holder = Holder(node=d["node"], vm=d["vm"], vm_uuid=d.get("vm_uuid", ""))
        return FenceRecord(int(d["fdid"]), holder, self._token(key, d))

    @_decoding("fence")
    def fence(self, fdid: int) -> FenceRecord | None:
        key = self._k.fence(fdid)
        raw = self._get(key)
        return None if raw is None else self._fence_from(key, raw)

    @_decoding("fence")
    def fences(self) -> list[FenceRecord]:
        return sorted(
            (self._fence_from(k, raw) for k, raw in self._range(self._k.fences).items()),
            key=lambda f: f.fdid,
        )

    @_decoding("fence")
    def clear_fence(self, fdid: int) -> bool:
        """Drop the fence of a hold that is gone (the lender took the device back)."""
        self._write()
        if self._hold_dict(fdid) is not None or self.fence(fdid) is None:
            return False
        self._delete(self._k.fence(fdid))
        return True

    def _claims_of(self, blocks: Iterable[bytes]) -> list[tuple[int, Claim]]:
        """The claims the unit blocks ``blocks`` carry (on their VMs' heads)."""
        seen = self._claims_seen
        out: list[tuple[int, Claim]] = []
        for raw in blocks:
            out += seen(raw, enc.claims_of_block)
        return out

    @_decoding("claim")
    def claims(self) -> list[tuple[int, Claim]]:
        """Every claim of a hold: on the VMs' head blocks, and in their markers' ledgers
        those on their own node's places and a lent device's requester entries."""
        out = self._claims_of(self._range(self._k.units).values())
        markers = self._range(self._k.vm_markers)
        for key, raw in markers.items():
            node = key.removeprefix(self._k.vm_markers).split("/", 1)[0]
            out += self._own_pairs(node, raw)
            ledger: dict[str, list[dict[str, Any]]] = enc.load(raw).get("ledger", {})
            out += [
                (int(f, 16), enc.claim_from_dict(c))
                for f in sorted(ledger, key=lambda f: int(f, 16))
                for c in ledger[f]
                if self._covered(int(f, 16), c)
            ]
        return out

    @_decoding("claim")
    def set_aside(self) -> list[tuple[int, Claim]]:
        """Every lent entry, as a claim of no hold (``_lent_claims``)."""
        out: list[tuple[int, Claim]] = []
        by_adapter: dict[str, dict[str, bytes]] = {}
        for key, raw in self._range(self._k.units).items():
            if enc.lent_share(raw) is not None:
                # ``<adapter>/lut-blocks/<start>/<size>``: a switch port's name has a "/"
                head = key.removeprefix(self._k.units).rpartition("-blocks/")[0]
                adapter = head.rpartition("/")[0]
                by_adapter.setdefault(adapter, {})[key] = raw
        for adapter, blocks in sorted(by_adapter.items()):
            out += self._lent_claims(adapter, blocks)
        return out

    def _lent_claims(self, adapter: str, blocks: dict[str, bytes]) -> list[tuple[int, Claim]]:
        """The lent entries among ``adapter``'s ``blocks``, as claims of no hold."""
        prefix = self._k.unit_blocks(adapter, "lut")
        return [
            (0, Claim(adapter, ClaimKind.LUT, share, entries=1))
            for key, raw in blocks.items()
            if key.startswith(prefix) and (share := enc.lent_share(raw)) is not None
        ]

    @_decoding("claim")
    def claims_on(self, adapters: Iterable[str]) -> list[tuple[int, Claim]]:
        """Read without a prefix compare: what keeps a decision on them safe is the units a
        transaction takes (``_take_units``) and, on a node's own places, its decider's
        epoch (``_decide``). There the node's VMs' claims are as its decider knows them, or
        for another process as their markers hold them: not the slack of the node's extents,
        which a take short of units makes the node give back (``_shrink_for``), and not what
        the node's decider has added since (the take finds no unit for that: refused). A
        lent device's requester entry, which its holds use with no block of their VM, is a
        claim of no hold (fdid 0) while it is set aside (``_lent_entry``): counted once by
        admission, however many holds use it."""
        out = []
        for a in dict.fromkeys(adapters):
            blocks = self._loose_range(self._k.units_of(a))
            out += self._claims_of(blocks.values())
            out += self._lent_claims(a, blocks)
            node = self._own_node(a)
            if node is None:
                continue
            view = self._own_view(node, a)
            if view is not None:
                out += view
                continue
            # as any other host sees the node: its VMs' claims there, read from their
            # markers (a reader finding a hold's claims needs them: a link event's recount)
            out += [
                (f, c)
                for raw in self._loose_range(self._k.vm_holds_on(node)).values()
                for f, c in self._own_pairs(node, raw)
                if c.adapter == a
            ]
        return out

    # --- mdevs -----------------------------------------------------------------------------
    @_decoding("mdev parent")
    def parent(self, node: str, fdid: int) -> ParentRecord | None:
        raw = self._get(self._k.parent(node, fdid))
        return None if raw is None else ParentRecord(node, fdid, raw.decode())

    def add_parent(self, rec: ParentRecord) -> None:
        self._write()
        if self.parent(rec.node, rec.fdid) is None:
            self._put(self._k.parent(rec.node, rec.fdid), rec.name.encode(), leased=True)

    def delete_parent(self, node: str, fdid: int) -> bool:
        self._write()
        if self.parent(node, fdid) is None:
            return False
        self._delete(self._k.parent(node, fdid))
        return True

    @_decoding("mdev")
    def mdevs(self, node: str | None = None) -> list[MdevRecord]:
        prefix = self._k.mdevs if node is None else self._k.mdevs_on(node)
        recs = [enc.mdev_from_dict(enc.load(raw)) for raw in self._range(prefix).values()]
        return sorted(recs, key=lambda m: (m.created, m.uuid))

    @_decoding("mdev")
    def mdev(self, uuid: str) -> MdevRecord | None:
        return next((m for m in self.mdevs() if m.uuid == uuid), None)

    def add_mdev(self, rec: MdevRecord) -> None:
        self._write()
        if self.mdev(rec.uuid) is not None:
            raise StateError(f"mdev {rec.uuid} is already recorded")
        self._put(self._k.mdev(rec.node, rec.uuid), enc.mdev_to_json(rec), leased=True)

    def delete_mdev(self, uuid: str) -> bool:
        self._write()
        rec = self.mdev(uuid)
        if rec is None:
            return False
        self._delete(self._k.mdev(rec.node, uuid))
        return True

    # --- runtime records (windows, vectors, P2P maps of held devices) --------------------
    def put_runtime(self, fdid: int, kind: str, key: str, data: dict[str, Any]) -> None:
        self._write()
        if self._hold_dict(fdid) is None:
            raise StateError(
                f"device {fdid:#x} is not held; runtime state can only be recorded for a held"
                " device"
            )
        value = enc.dump({"fdid": fdid, "kind": kind, "key": key, "data": data})
        self._put(self._k.runtime_record(fdid, kind, key), value, leased=True)

    def _runtime(self, prefix: str) -> list[tuple[str, RuntimeRecord]]:
        out = []
        for k, raw in self._range(prefix).items():
            d = enc.load(raw)
            out.append((k, RuntimeRecord(int(d["fdid"]), d["kind"], d["key"], d["data"])))
        return sorted(out, key=lambda kr: (kr[1].fdid, kr[1].kind, kr[1].key))

    @_decoding("runtime")
    def runtime(self, fdid: int | None = None, kind: str | None = None) -> list[RuntimeRecord]:
        prefix = self._k.runtime if fdid is None else self._k.runtime_of(fdid)
        return [r for _k, r in self._runtime(prefix) if kind is None or r.kind == kind]

    @_decoding("runtime")
    def clear_runtime(self, fdid: int, kind: str | None = None, key: str | None = None) -> int:
        self._write()
        gone = [
            k
            for k, r in self._runtime(self._k.runtime_of(fdid))
            if (kind is None or r.kind == kind) and (key is None or r.key == key)
        ]
        for k in gone:
            self._delete(k)
        return len(gone)
