"""Where each record lives in etcd, and how it is encoded (pure: no I/O).

Everything of one cluster sits under ``/vmlend/<cluster>/``, one key per record:

- ``meta/<key>``: metadata, e.g. ``meta/schema_version``;
- ``topology/digest`` and ``topology/generation``: the digest of the topology's TOML (a small
  key every transaction reads) and the head naming the current generation of the topology
  (``topopieces``); the generation's content (the TOML text, the initial node and device
  states, the compiled topology) is in pieces ``topology/gen/<generation>/<n>``, fetched only
  when the digest changes and kept on each host (``topocache``). Before generations (schema
  version 2) the content was one JSON value ``topology/record``, still read when there is no
  head: too large for etcd's default request limit from ~200 nodes of 16 devices on;
- ``nodes/<name>``, ``devices/<fdid>``: only once a node or device differs from what the
  topology says (down, unlent, vanished), so initialising a 1,000-device fabric writes two
  keys instead of exceeding etcd's 128 operations per transaction;
- ``held-vm/<node>/<hash of VM name>``: the VM's marker, created with its first hold and
  deleted with its last: it lists the VM's holds, so the markers under ``held-vm/<node>/``
  are the node's index, and it is rewritten with every hold the VM gains (a reserve compares
  it). It also keeps the VM's unit ledger: each hold's claims, and the unit blocks they use;
- ``holds/<fdid>``: who holds a device; ``fence/<fdid>``: written with every hold, without a
  lease, removed with it by a normal release (so a hold that vanished by lease expiry leaves a
  fence that only the lender's agent removes);
- ``hosts/<node>``: the host's agent is alive (attached to its lease); ``agents/<node>``: the
  node runs an agent, bound to its host's machine-id (no lease; removed by ``vmlend drain``),
  so ``agents`` without ``hosts`` means its agent is not running (stopped or dead, not
  drained) and the node's devices are unavailable;
- ``units/<adapter>/<lut|seg>-blocks/<start>/<size>``: the LUT entries or window segments in
  use, in aligned blocks (``size`` a power of two, ``start`` a multiple of it, zero-padded,
  below the adapter's usable count), so two reserves that together overcommit an adapter must
  take overlapping blocks (one same block, or one inside the other) and cannot both commit,
  while reserves that fit do not conflict (a reserve compares the blocks it creates, not
  every claim on the adapter). A *run* (layout 8) is an aligned block less the last units it
  leaves free, ``<start>/<size>/<free>`` (``free`` two digits, 1 to ``size - 1``): a DMA
  window of 5 segments is one key, not a block of 4 and one of 1. Each block names its VM;
  the VM's first block on an adapter
  (its *head*, the first by key) also carries the VM's claims there, so one range per
  adapter is both its claims and its units. Every claim uses a unit of its VM on its adapter,
  so every claim has a head to be found in;
- ``parents/<node>/<fdid>``, ``mdevs/<node>/<uuid>``: mdev parents and children per node;
- ``runtime/<fdid>/<n>``: what the data path set up for a held device.

Layout 4 (before version 5) also kept ``held-on/<node>/<fdid>`` (the node's index of its
holds) and one ``claims/<adapter>/<fdid>/<n>`` key per claim; ``vmlend registry upgrade``
deletes what is left of them (``Keys.layout4_prefixes``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from typing import Any

import msgspec

from vmlend.errors import ConfigError
from vmlend.registry.records import (
    Claim,
    ClaimKind,
    HoldRecord,
    MdevRecord,
    Phase,
)
from vmlend.topology.model import Holder

ROOT = "/vmlend/"
_CLUSTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def check_cluster_name(name: str) -> str:
    if not _CLUSTER_NAME.match(name):
        raise ConfigError(
            f"bad cluster name {name!r} in the registry URL: use letters, digits, '.', '_', '-'"
            " (e.g. etcd://127.0.0.1:2379/lab)"
        )
    return name


def aligned_size(size: int) -> int:
    """The smallest power of two holding ``size`` units: the aligned block a run is named by."""
    return 1 << max(0, size - 1).bit_length()


def unit_span(tail: str) -> tuple[int, int]:
    """``(start, size)`` of a unit block key's tail ``<start>/<size>`` or a run's
    ``<start>/<size>/<free>`` (``Keys.unit_block``). A damaged free count (none of 1 to
    ``size - 1``, or more parts) reads as the whole block used: damage is never room."""
    start, size, *free = tail.split("/")
    whole = int(size)
    left = int(free[0]) if len(free) == 1 else 0
    return int(start), whole - left if 0 < left < whole else whole


class Keys:
    """The key layout of one cluster."""

    def __init__(self, cluster: str) -> None:
        self.cluster = check_cluster_name(cluster)
        self.base = f"{ROOT}{cluster}/"

    def meta(self, key: str) -> str:
        return f"{self.base}meta/{key}"

    @property
    def topology_digest(self) -> str:
        return self.base + "topology/digest"

    @property
    def topology_record(self) -> str:
        """The whole topology in one JSON value, as vmlend wrote it before generations (still
        read when there is no head; deleted when a generation is installed)."""
        return self.base + "topology/record"

    @property
    def topology_head(self) -> str:
        """The head naming the current generation (``topopieces.TopologyHead``, JSON)."""
        return self.base + "topology/generation"

    @property
    def topology_generations(self) -> str:
        return self.base + "topology/gen/"

    def topology_generation_prefix(self, generation: str) -> str:
        return f"{self.topology_generations}{generation}/"

    def topology_piece(self, generation: str, n: int) -> str:
        return f"{self.topology_generation_prefix(generation)}{n:06d}"

    def topology_seal(self, generation: str) -> str:
        """Written with a generation's last piece: the installing transaction compares it."""
        return f"{self.topology_generation_prefix(generation)}seal"

    @property
    def nodes(self) -> str:
        return self.base + "nodes/"

    def node(self, name: str) -> str:
        return self.nodes + name

    @property
    def devices(self) -> str:
        return self.base + "devices/"

    def device(self, fdid: int) -> str:
        return f"{self.devices}{fdid:#x}"

    @property
    def holds(self) -> str:
        return self.base + "holds/"

    def hold(self, fdid: int) -> str:
        return f"{self.holds}{fdid:#x}"

    def vm_holds(self, node: str, vm: str) -> str:
        """The marker of VM ``vm`` on ``node`` (leased): rewritten with every hold it gains,
        what a reserve compares to know the VM's own set of holds did not grow, so reserves
        of unrelated VMs on one node do not conflict."""
        digest = hashlib.sha256(vm.encode()).hexdigest()[:24]
        return f"{self.vm_holds_on(node)}{digest}"

    @property
    def vm_markers(self) -> str:
        return self.base + "held-vm/"

    def vm_holds_on(self, node: str) -> str:
        """Every marker of ``node``'s VMs: the node's index of its holds."""
        return f"{self.vm_markers}{node}/"

    def layout4_prefixes(self) -> list[str]:
        """What layout 4 kept and layout 5 does not: the nodes' indexes of their holds and
        the claims, one key each (deleted by ``vmlend registry upgrade``)."""
        return [self.base + "held-on/", self.base + "claims/"]

    @property
    def deciders(self) -> str:
        return self.base + "decider/"

    def decider_of(self, node: str) -> str:
        """The prefix of ``node``'s epoch and extents."""
        return f"{self.base}decider/{node}/"

    def decider(self, node: str) -> str:
        """The epoch of the process deciding ``node``'s own places
        (``vmlend.registry.decider``): written when a process takes the node over."""
        return f"{self.base}decider/{node}/epoch"

    def extents(self, node: str) -> str:
        """The extents of ``node``'s own places: written when they change."""
        return f"{self.base}decider/{node}/extents"

    @property
    def units(self) -> str:
        return self.base + "units/"

    def units_of(self, adapter: str) -> str:
        """Every unit block of an adapter, and so its claims (a reserve reads them in one
        range)."""
        return f"{self.units}{adapter}/"

    def unit_blocks(self, adapter: str, unit: str) -> str:
        """The block keys of one adapter resource (``unit_block``)."""
        return f"{self.units_of(adapter)}{unit}-blocks/"

    def unit_block(self, adapter: str, unit: str, start: int, size: int) -> str:
        """The units ``[start, start + size)``: ``start`` a multiple of ``size`` rounded up
        to a power of two; a size that is not one is a run, the aligned block less its last
        units (``unit_span`` reads it back). The start is zero-padded so a block's sub-blocks
        are one key range."""
        whole = aligned_size(size)
        tail = "" if whole == size else f"/{whole - size:02d}"
        return f"{self.unit_blocks(adapter, unit)}{start:06d}/{whole}{tail}"

    def unit_blocks_reaching(
        self, adapter: str, unit: str, start: int, size: int, at: int
    ) -> tuple[str, str]:
        """The key range of the blocks and runs named by the aligned block ``[start, start
        + size)`` that reach unit ``at`` (inside it, after ``start``): the whole block, and
        the runs leaving fewer than ``start + size - at`` units free. The free count sorts
        after the whole block's key, so they are one range, and a run that ends before
        ``at`` is not in it (taking units after it does not conflict with it)."""
        named = f"{self.unit_blocks(adapter, unit)}{start:06d}/{size}"
        return named, f"{named}/{start + size - at:02d}"

    def unit_block_range(self, adapter: str, unit: str, start: int, end: int) -> tuple[str, str]:
        """The key range of every block starting in ``[start, end)``."""
        prefix = self.unit_blocks(adapter, unit)
        return f"{prefix}{start:06d}", f"{prefix}{end:06d}"

    @property
    def fences(self) -> str:
        return self.base + "fence/"

    def fence(self, fdid: int) -> str:
        return f"{self.fences}{fdid:#x}"

    @property
    def hosts(self) -> str:
        return self.base + "hosts/"

    def host(self, node: str) -> str:
        return f"{self.hosts}{node}"

    @property
    def agents(self) -> str:
        return self.base + "agents/"

    def agent(self, node: str) -> str:
        return f"{self.agents}{node}"

    @property
    def plugs(self) -> str:
        """Plug requests: a live migration's source asks the destination's agent to plug the
        VM's devices back (``vmlend.ops.plug_request``)."""
        return self.base + "plugs/"

    def plugs_on(self, node: str) -> str:
        return f"{self.plugs}{node}/"

    def plug(self, node: str, request_id: str) -> str:
        return f"{self.plugs_on(node)}{request_id}"

    @property
    def migrations(self) -> str:
        """Live migrations in progress, one per VM UUID, on the source host's lease: what a
        destination's agent checks a plug request against (``vmlend.ops.migration_record``)."""
        return self.base + "migrations/"

    def migration(self, vm_uuid: str) -> str:
        return f"{self.migrations}{vm_uuid}"

    @property
    def parents(self) -> str:
        return self.base + "parents/"

    def parent(self, node: str, fdid: int) -> str:
        return f"{self.parents}{node}/{fdid:#x}"

    @property
    def mdevs(self) -> str:
        return self.base + "mdevs/"

    def mdevs_on(self, node: str) -> str:
        return f"{self.mdevs}{node}/"

    def mdev(self, node: str, uuid: str) -> str:
        return f"{self.mdevs_on(node)}{uuid}"

    @property
    def runtime(self) -> str:
        return self.base + "runtime/"

    def runtime_of(self, fdid: int) -> str:
        return f"{self.runtime}{fdid:#x}/"

    def runtime_record(self, fdid: int, kind: str, key: str) -> str:
        # kind and key are free text: a digest keeps them from adding "/" levels to the key.
        name = hashlib.sha256(f"{kind}\0{key}".encode()).hexdigest()[:24]
        return f"{self.runtime_of(fdid)}{name}"


# --- values: JSON ---------------------------------------------------------------------------
def dump(data: Any) -> bytes:
    """Compact JSON, keys sorted (one record, one form). msgspec: a reserve and release
    encode about 30 values, and ``json.dumps`` took a tenth of vmlend's own time in a cycle
    (issue 38, point 5); text other than ASCII is UTF-8 rather than escaped, which readers
    decode alike."""
    return msgspec.json.encode(data, order="sorted")


def load(raw: bytes) -> Any:
    return json.loads(raw)


def compiled_of(record: dict[str, Any]) -> bytes | None:
    """The compiled topology (base64 under ``compiled``) of a ``topology/record`` as vmlend
    wrote it before generations; None when it has none (a vmlend before the compiled
    topology wrote it) or the key is not base64 (the TOML is then parsed, as without it)."""
    raw = record.get("compiled")
    if not isinstance(raw, str):
        return None
    try:
        return base64.b64decode(raw, validate=True)
    except binascii.Error:
        return None


def hold_to_json(hold: HoldRecord, reissued: int = 0) -> bytes:
    """``reissued``: the fencing token of a hold re-made under a key that exists (0: none, the
    key's creation revision is the token; ``EtcdTxn.add_hold``)."""
    h = hold.holder
    d: dict[str, Any] = {
        "fdid": hold.fdid,
        "node": h.node,
        "vm": h.vm,
        "vm_uuid": h.vm_uuid,
        "since": hold.since,
        "phase": hold.phase.value,
        "guest_ram": hold.guest_ram,
    }
    if reissued:
        d["reissued"] = reissued
    return dump(d)


def hold_from_dict(d: dict[str, Any]) -> HoldRecord:
    return HoldRecord(
        fdid=int(d["fdid"]),
        holder=Holder(node=d["node"], vm=d["vm"], vm_uuid=d.get("vm_uuid", "")),
        since=float(d["since"]),
        phase=Phase(d["phase"]),
        guest_ram=int(d.get("guest_ram", 0)),
    )


def claim_to_dict(c: Claim) -> dict[str, Any]:
    return {
        "adapter": c.adapter,
        "kind": c.kind.value,
        "share": c.share,
        "entries": c.entries,
        "segments": c.segments,
        "bytes": c.bytes,
    }


def claim_from_dict(d: dict[str, Any]) -> Claim:
    entries, segments, size = (int(d.get(f, 0)) for f in ("entries", "segments", "bytes"))
    if min(entries, segments, size) < 0:  # as ``Amount`` refuses in SQLite: not room to give
        raise ValueError(f"a claim takes no negative amount: {entries}, {segments}, {size}")
    return Claim(
        adapter=d["adapter"],
        kind=ClaimKind(d["kind"]),
        share=d["share"],
        entries=entries,
        segments=segments,
        bytes=size,
    )


def mdev_to_json(m: MdevRecord) -> bytes:
    return dump(
        {
            "uuid": m.uuid,
            "fdid": m.fdid,
            "node": m.node,
            "parent": m.parent,
            "type_id": m.type_id,
            "vm": m.vm,
            "created": m.created,
        }
    )


def mdev_from_dict(d: dict[str, Any]) -> MdevRecord:
    return MdevRecord(
        uuid=d["uuid"],
        fdid=int(d["fdid"]),
        node=d["node"],
        parent=d["parent"],
        type_id=d["type_id"],
        vm=d.get("vm", ""),
        created=float(d["created"]),
    )


def block_to_json(owner: str, claims: list[dict[str, Any]] | None = None) -> bytes:
    """A unit block's value: the VM it is of (``<node>/<vm>``); its head block on an adapter
    (``claims`` not None) also lists the VM's claims there, each with its hold's ``fdid``."""
    d: dict[str, Any] = {"vm": owner}
    if claims is not None:
        d["claims"] = claims
    return dump(d)


def extent_to_json(node: str) -> bytes:
    """An extent's value: a unit block of ``node``'s own share of a place, no VM's."""
    return dump({"vm": node, "extent": True})


def is_extent(raw: bytes) -> bool:
    """The unit block is an extent (``extent_to_json``)."""
    return b'"extent"' in raw and load(raw).get("extent") is True


def lent_to_json(node: str, share: str) -> bytes:
    """A lent entry's value: a unit block of the requester entry ``node`` sets aside for its
    lent device(s) of requester ``share`` on its adapter or the switch port toward it (layout
    7): the holds of those devices use it, with no block of their VM."""
    return dump({"vm": node, "lent": share})


def lent_share(raw: bytes) -> str | None:
    """The requester share of a lent entry (``lent_to_json``); None: another block."""
    if b'"lent"' not in raw:
        return None
    share = load(raw).get("lent")
    return share if isinstance(share, str) else None


def block_owner(raw: bytes) -> str:
    """The ``<node>/<vm>`` a unit block is of."""
    owner = load(raw)["vm"]
    if not isinstance(owner, str):
        raise TypeError(f"a unit block's owner is not text: {owner!r}")
    return owner


def claims_of_block(raw: bytes) -> tuple[tuple[int, Claim], ...]:
    """The claims a unit block carries (``(fdid, claim)`` each): none but on a head."""
    listed = load(raw).get("claims", [])
    if not isinstance(listed, list):
        raise TypeError(f"a unit block's claims are not a list: {listed!r}")
    return tuple((int(d["fdid"]), claim_from_dict(d)) for d in listed)
