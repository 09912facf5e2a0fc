"""Open the fabric a process works with, and initialise the shared state with a topology.

The CLI and the hook call ``open_fabric``; ``vmlend fabric init`` calls ``init_fabric``. Both
take a registry location: an SQLite path or a registry URL (``vmlend.registry.location``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from vmlend.errors import ConfigError, StateError
from vmlend.fabric.base import Fabric
from vmlend.hostenv import HostEnv
from vmlend.registry import (
    DeviceRecord,
    RegistryLocation,
    StateTxn,
    TopologyRecord,
    create_registry,
    hostlease,
    open_registry,
)
from vmlend.topology.compiled import compile_topology, decode_compiled
from vmlend.topology.model import Topology

#: Where the shared state is: an SQLite path, a registry URL, or a parsed location.
Location = str | Path | RegistryLocation

BACKENDS = ("sim", "smartio")
#: Chooses the backend when the caller does not (the hook runs with libvirtd's environment,
#: so ``vmlend hook install`` pins it like the state path).
BACKEND_ENV = "VMLEND_BACKEND"


def default_backend(host: HostEnv) -> str:
    """The backend when none is chosen: "smartio" where the SmartIO driver is loaded (what
    ``vmlend.kernel.driver.SmartioDriver.loaded`` checks: its ``node_id``), else "sim"."""
    return "smartio" if (host.smartio / "node_id").is_file() else "sim"


def open_fabric(
    state_path: Location,
    node: str | None = None,
    backend: str | None = None,
    root: Path | None = None,
    observer: bool = False,
) -> Fabric:
    """The fabric described by the registry at ``state_path``, seen from ``node`` (default:
    the SQLite state's local node; a cluster registry needs it). ``backend``: "sim" or
    "smartio" (the kernel: Linux mdev sysfs and the SmartIO driver), else $VMLEND_BACKEND,
    else the host's ``default_backend``.
    ``StateError`` when there is no usable state. ``root``: the host root (default
    ``$VMLEND_ROOT``) whose ``etc/vmlend/node`` names the node when ``node`` is None, and
    whose agent lease a cluster registry's writes use. ``observer``: for reading only, a
    cluster registry opens without a node (``local_node == ""``) when none is given."""
    backend = backend or os.environ.get(BACKEND_ENV) or default_backend(HostEnv.from_env(root))
    if backend not in BACKENDS:
        raise ConfigError(f"unknown fabric backend {backend!r} (available: {', '.join(BACKENDS)})")
    if backend == "smartio":
        from vmlend.kernel.backend import open_smartio_fabric

        return open_smartio_fabric(state_path, node, env=HostEnv.from_env(root))
    from vmlend.sim.backend import SimFabric
    from vmlend.sim.register import LenderRegister

    host = HostEnv.from_env(root)
    node = node or host.configured_node()
    registry = open_registry(state_path, hostlease.lease_path(host), host.topology_cache)
    try:
        # $VMLEND_SIM_LENDERS: the simulated lenders' register (tests); unset, none
        lenders = LenderRegister.from_env()
        return SimFabric(registry, local_node=node, observer=observer, lenders=lenders)
    except BaseException:
        registry.close()
        raise


def default_topology_text() -> tuple[str, str]:
    """The shipped default cluster: its TOML text and a source name for messages."""
    from importlib import resources  # init only: the hook and most commands never need it

    from vmlend.topology.parse import DEFAULT_TOPOLOGY

    text = resources.files("vmlend.data").joinpath(DEFAULT_TOPOLOGY).read_text()
    return text, f"<builtin {DEFAULT_TOPOLOGY}>"


def choose_local_node(topology: Topology, hostname: str) -> str:
    """The node this host is: the one whose hostname matches, else the first node that lends
    nothing (a borrower), else the first node."""
    short = hostname.split(".")[0]
    for n in topology.nodes:
        if hostname in (n.hostname, n.name) or short in (n.hostname.split(".")[0], n.name):
            return n.name
    lenders = {d.lender for d in topology.devices}
    for n in topology.nodes:
        if n.name not in lenders:
            return n.name
    return topology.nodes[0].name


class InitResult(msgspec.Struct, frozen=True):
    action: str  # "created", "unchanged", "local node set", "replaced"
    topology: Topology
    local_node: str


def same_topology(a: Topology, b: Topology) -> bool:
    """Equal in meaning: where the text came from and how it was written do not matter."""
    replace = msgspec.structs.replace
    return replace(a, source="", name="") == replace(b, source="", name="")


def init_fabric(
    state_path: Location,
    text: str,
    source: str,
    node: str | None = None,
    replace: bool = False,
    hostname: str | None = None,
    clock: Callable[[], float] = time.time,
) -> InitResult:
    """Put a topology into the registry at ``state_path``, creating the state if needed.

    The same topology again changes nothing (except, in an SQLite state, the local node when
    ``node`` is given; a cluster registry never records which node a host is; and the
    compiled form of a topology an older vmlend stored without one); a different one is
    refused unless ``replace`` and nothing is held or has an mdev.
    """
    import hashlib
    import socket

    # Only here: opening a fabric decodes the compiled topology and never loads the parser.
    from vmlend.topology.parse import parse_topology

    topo = parse_topology(text, source)
    if node is not None:
        topo.node(node)
    local = node or choose_local_node(topo, hostname or socket.gethostname())
    digest = hashlib.sha256(text.encode()).hexdigest()
    rec = TopologyRecord(
        name=topo.name,
        source=source,
        text=text,
        digest=digest,
        local_node=local,
        created=clock(),
        compiled=compile_topology(topo, digest),
    )

    def fill(tx: StateTxn) -> None:
        tx.replace_topology(
            rec,
            [n.name for n in topo.nodes],
            [DeviceRecord(d.fdid, d.lender, d.lent) for d in topo.devices],
        )

    # this host installs the topology: it keeps its copy (``vmlend.registry.topocache``)
    cache = HostEnv.from_env().topology_cache
    try:
        reg = create_registry(state_path, fill, cache)
        shared = not reg.shares_host_identity
        reg.close()
        # A cluster registry records no host's identity: report only what was asked for.
        return InitResult("created", topo, (node or "") if shared else local)
    except FileExistsError:
        pass  # an existing state: same topology is a no-op, another needs --replace

    with open_registry(state_path, topology_cache=cache) as reg:
        shared = not reg.shares_host_identity
        if shared:
            local = node or ""

        def update(tx: StateTxn) -> InitResult:
            if not tx.has_topology():
                fill(tx)
                return InitResult("created", topo, local)
            old = tx.topology()
            # From its text, not its compiled form: that form is what may need repair here.
            old_topo = parse_topology(old.text, old.source)
            if same_topology(old_topo, topo):
                compiled = compile_topology(old_topo, old.digest)
                stored = decode_compiled(old.compiled_bytes(), old.digest)
                if compiled is not None and stored != old_topo:
                    # Installed by an older vmlend, in another compiled format, damaged, or
                    # compiled by a parser that derived something else: compile it now, so
                    # that opening the fabric decodes what its text says.
                    tx.set_topology_compiled(compiled)
                if node is not None and node != old.local_node and not shared:
                    tx.set_local_node(node)
                    return InitResult("local node set", topo, node)
                return InitResult("unchanged", topo, local if shared else old.local_node)
            if not replace:
                raise ConfigError(
                    f"{reg.where} already holds topology {old.name!r} from {old.source};"
                    " pass --replace to replace it (allowed while nothing is held)"
                )
            busy = [f"{fdid:#x} by {h.holder}" for fdid, h in sorted(tx.holds().items())]
            busy += [f"mdev {m.uuid} on {m.node}" for m in tx.mdevs()]
            if busy:
                raise StateError(
                    "cannot replace the topology while devices are in use: "
                    + ", ".join(busy)
                    + "; stop those VMs first"
                )
            fill(tx)
            return InitResult("replaced", topo, local)

        return reg.transact(update)
