"""Open the fabric a process works with, and initialise the shared state with a topology.

The CLI and the hook call ``open_fabric``; ``vmlend fabric init`` calls ``init_fabric``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vmlend.errors import ConfigError, StateError
from vmlend.fabric.base import Fabric
from vmlend.fabric.model import Topology
from vmlend.fabric.topology import DEFAULT_TOPOLOGY, parse_topology
from vmlend.registry import DeviceRecord, Registry, StateTxn, TopologyRecord

BACKENDS = ("sim", "smartio")
#: Chooses the backend when the caller does not (the hook runs with libvirtd's environment,
#: so ``vmlend hook install`` pins it like the state path).
BACKEND_ENV = "VMLEND_BACKEND"


def open_fabric(
    state_path: str | Path, node: str | None = None, backend: str | None = None
) -> Fabric:
    """The fabric described by the state at ``state_path``, seen from ``node`` (default: the
    state's local node). ``backend``: "sim" (default) or "smartio" (the kernel: Linux mdev
    sysfs and the SmartIO driver), else $VMLEND_BACKEND. ``StateError`` when there is no
    usable state."""
    backend = backend or os.environ.get(BACKEND_ENV) or "sim"
    if backend not in BACKENDS:
        raise ConfigError(f"unknown fabric backend {backend!r} (available: {', '.join(BACKENDS)})")
    if backend == "smartio":
        from vmlend.fabric.smartio.backend import open_smartio_fabric

        return open_smartio_fabric(state_path, node)
    from vmlend.fabric.sim.backend import SimFabric

    registry = Registry.open(state_path)
    try:
        return SimFabric(registry, local_node=node)
    except BaseException:
        registry.close()
        raise


def default_topology_text() -> tuple[str, str]:
    """The shipped default cluster: its TOML text and a source name for messages."""
    from importlib import resources  # init only: the hook and most commands never need it

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


@dataclass(frozen=True)
class InitResult:
    action: str  # "created", "unchanged", "local node set", "replaced"
    topology: Topology
    local_node: str


def _same(a: Topology, b: Topology) -> bool:
    """Equal in meaning: where the text came from and how it was written do not matter."""
    return dataclasses.replace(a, source="", name="") == dataclasses.replace(b, source="", name="")


def init_fabric(
    state_path: str | Path,
    text: str,
    source: str,
    node: str | None = None,
    replace: bool = False,
    hostname: str | None = None,
    clock: Callable[[], float] = time.time,
) -> InitResult:
    """Put a topology into the state at ``state_path``, creating the file if needed.

    The same topology again changes nothing (except the local node when ``node`` is given);
    a different one is refused unless ``replace`` and nothing is held or has an mdev.
    """
    import hashlib
    import socket

    topo = parse_topology(text, source)
    if node is not None:
        topo.node(node)
    local = node or choose_local_node(topo, hostname or socket.gethostname())
    rec = TopologyRecord(
        name=topo.name,
        source=source,
        text=text,
        digest=hashlib.sha256(text.encode()).hexdigest(),
        local_node=local,
        created=clock(),
    )

    def fill(tx: StateTxn) -> None:
        tx.replace_topology(
            rec,
            [n.name for n in topo.nodes],
            [DeviceRecord(d.fdid, d.lender, d.lent) for d in topo.devices],
        )

    try:
        Registry.create(state_path, fill).close()
        return InitResult("created", topo, local)
    except FileExistsError:
        pass  # an existing state: same topology is a no-op, another needs --replace
    with Registry.open(state_path) as reg, reg.write() as tx:
        if not tx.has_topology():
            fill(tx)
            return InitResult("created", topo, local)
        old = tx.topology()
        if _same(parse_topology(old.text, old.source), topo):
            if node is not None and node != old.local_node:
                tx.set_local_node(node)
                return InitResult("local node set", topo, node)
            return InitResult("unchanged", topo, old.local_node)
        if not replace:
            raise ConfigError(
                f"{state_path} already holds topology {old.name!r} from {old.source};"
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
