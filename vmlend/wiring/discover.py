"""``vmlend fabric discover``: merge what this host's SmartIO driver says into the registry's
topology, in one transaction, as ``vmlend fabric init`` installs one.

The merge itself is ``vmlend.topology.merge`` (pure); reading the driver is
``vmlend.kernel.discover``. The merged topology is stored as the text of a topology file
(``vmlend.topology.render``), the registry's source of truth, which is parsed back and must
equal what was merged.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import msgspec

from vmlend.errors import DiscoveryConflictError, FabricError, StateError
from vmlend.hostenv import HostEnv
from vmlend.registry import DeviceRecord, StateTxn, TopologyRecord, create_registry, open_registry
from vmlend.registry.location import RegistryLocation, parse_location
from vmlend.topology.compiled import compile_topology
from vmlend.topology.discovered import FoundHost
from vmlend.topology.merge import Merge, merge_host
from vmlend.topology.model import Topology
from vmlend.wiring.fabric import Location, same_topology


class DiscoverResult(msgspec.Struct, frozen=True):
    #: "created" (a new state), "merged", "unchanged", or with --dry-run "would create",
    #: "would merge"
    action: str
    merge: Merge
    local_node: str = ""  # an SQLite state's local node ("" for a cluster registry)
    notes: tuple[str, ...] = ()  # about the state, beside the merge's own


def _source(node: str) -> str:
    return f"<fabric discover on {node}>"


def _stored(
    topology: Topology, node: str, was: str, local_node: str, clock: Callable[[], float]
) -> TopologyRecord:
    """The record the merged topology is stored as: the text of a topology file, checked to
    read back equal, and its compiled form."""
    from vmlend.topology.parse import parse_topology
    from vmlend.topology.render import render_topology

    header = (
        f"Written by 'vmlend fabric discover' on {node}: the topology from {was} with what its"
        " SmartIO driver publishes.\nThe cluster switches' wiring comes from a topology file"
        " ('vmlend fabric init --topology FILE')."
    )
    text = render_topology(topology, header)
    back = parse_topology(text, topology.source)
    if not same_topology(back, topology):
        raise FabricError(
            f"vmlend cannot write the merged topology of {node} as a topology file that reads"
            " back the same (a vmlend bug): nothing merged; describe the host in a topology"
            " file instead"
        )
    digest = hashlib.sha256(text.encode()).hexdigest()
    return TopologyRecord(
        name=topology.name,
        source=topology.source,
        text=text,
        digest=digest,
        local_node=local_node,
        created=clock(),
        compiled=compile_topology(back, digest),
    )


def _current(tx: StateTxn) -> tuple[Topology | None, TopologyRecord | None]:
    from vmlend.topology.parse import parse_topology

    if not tx.has_topology():
        return None, None
    old = tx.topology()
    # From its text, the source of truth (as 'fabric init' compares), not its compiled form.
    return parse_topology(old.text, old.source), old


def _merge(current: Topology | None, host: FoundHost, node: str | None) -> Merge:
    m = merge_host(current, host, node)
    if m.conflicts:
        raise DiscoveryConflictError(m.conflicts)
    if m.changes and m.topology is not None:
        # the text stored is vmlend's now, written from what this host's driver said
        m = msgspec.structs.replace(
            m, topology=msgspec.structs.replace(m.topology, source=_source(m.node))
        )
    return m


def _install(
    tx: StateTxn, m: Merge, old: TopologyRecord | None, local_node: str, clock: Callable[[], float]
) -> None:
    """Put the merged topology in place. Over an old one it is amended, not replaced: the
    merge only adds or describes better, so every hold, claim, mdev and record stays."""
    assert m.topology is not None
    topology = m.topology
    rec = _stored(topology, m.node, old.source if old else "no topology", local_node, clock)
    nodes = [n.name for n in topology.nodes]
    if old is None:
        fresh = [DeviceRecord(d.fdid, d.lender, d.lent) for d in topology.devices]
        tx.replace_topology(rec, nodes, fresh)
        return
    before = tx.devices()
    # a known device's default is what it is now (a cluster registry's records override
    # defaults; an SQLite state keeps its rows)
    tx.amend_topology(
        rec,
        nodes,
        [
            DeviceRecord(d.fdid, d.lender, before[d.fdid].lent if d.fdid in before else d.lent)
            for d in topology.devices
        ],
    )


def _in_use(tx: StateTxn, m: Merge) -> list[str]:
    """What the merge would describe anew while it is in use: a held device (or one with an
    mdev) whose BARs, DMA width... change, an adapter with claims whose window or LUT
    changes. Additions touch nothing in use."""
    devices = {
        int(c.subject, 16) for c in m.changes if c.what == "device" and c.action == "updated"
    }
    adapters = [c.subject for c in m.changes if c.what == "adapter" and c.action == "updated"]
    busy = [
        f"device {fdid:#x} is held by {h.holder}"
        for fdid, h in sorted(tx.holds().items())
        if fdid in devices
    ]
    busy += [
        f"device {r.fdid:#x} has mdev {r.uuid} on {r.node}" for r in tx.mdevs() if r.fdid in devices
    ]
    claimed = sorted({claim.adapter for _owner, claim in tx.claims_on(adapters)})
    busy += [f"adapter {ref} has claims" for ref in claimed]
    return busy


def discover_fabric(
    location: Location,
    host: FoundHost,
    node: str | None = None,
    dry_run: bool = False,
    clock: Callable[[], float] = time.time,
) -> DiscoverResult:
    """Merge ``host`` into the topology of the state at ``location`` (created when an SQLite
    state does not exist yet). ``node``: the name this host's node has (checked against a
    known node, the name of a new one; default: the short hostname). ``DiscoveryConflictError``
    when the driver and the topology disagree; ``StateError`` when it would describe anew a
    device or adapter in use (what is added merges beside the holds, which stay)."""
    loc = location if isinstance(location, RegistryLocation) else parse_location(location)
    cache = HostEnv.from_env().topology_cache
    if loc.path is not None and not loc.path.exists():
        m = _merge(None, host, node)
        if dry_run:
            return DiscoverResult("would create", m, m.node)
        assert m.topology is not None
        topology = m.topology
        rec = _stored(topology, m.node, "no topology", m.node, clock)

        def fill(tx: StateTxn) -> None:
            tx.replace_topology(
                rec,
                [n.name for n in topology.nodes],
                [DeviceRecord(d.fdid, d.lender, d.lent) for d in topology.devices],
            )

        try:
            create_registry(location, fill, cache).close()
            return DiscoverResult("created", m, m.node)
        except FileExistsError:
            pass  # made meanwhile: merge into it

    with open_registry(location, topology_cache=cache) as reg:
        shared = not reg.shares_host_identity

        def notes(m: Merge, old: TopologyRecord | None) -> tuple[tuple[str, ...], str]:
            if shared:
                return (), ""
            local = old.local_node if old is not None and old.local_node else m.node
            if local != m.node:
                return (
                    f"this state's local node is {local}, the driver says this host is"
                    f" {m.node}: 'vmlend fabric init --node {m.node}' makes it so",
                ), local
            return (), local

        if dry_run:
            with reg.read() as tx:
                current, old = _current(tx)
                m = _merge(current, host, node)
                busy = _in_use(tx, m) if old is not None else []
            said, local = notes(m, old)
            said += tuple(f"refused while in use: {b}" for b in busy)
            action = "would merge" if m.changes else "unchanged"
            return DiscoverResult(action, m, local, said)

        def update(tx: StateTxn) -> DiscoverResult:
            current, old = _current(tx)
            m = _merge(current, host, node)
            said, local = notes(m, old)
            if not m.changes:
                return DiscoverResult("unchanged", m, local, said)
            busy = _in_use(tx, m) if old is not None else []
            if busy:
                raise StateError(
                    "cannot describe anew what is in use: "
                    + ", ".join(busy)
                    + "; stop those VMs first, nothing merged ('vmlend fabric discover"
                    " --dry-run' shows the changes)"
                )
            _install(tx, m, old, local or m.node, clock)
            return DiscoverResult("merged", m, local, said)

        return reg.transact(update)
