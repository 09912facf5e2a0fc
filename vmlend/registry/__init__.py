"""The shared state: who lends, who holds what, which mdevs exist, which adapter resources are
claimed. One interface (``api``: ``Registry``, ``StateTxn``), two backends: an SQLite file
(WAL, transactions) that the processes of one host share, and etcd for a cluster of hosts.
``open_registry`` / ``create_registry`` pick one from a location (``location``).
"""

from vmlend.registry.api import Registry, StateTxn
from vmlend.registry.etcd_store import EtcdRegistry
from vmlend.registry.location import (
    REGISTRY_ENV,
    RegistryLocation,
    create_registry,
    open_registry,
    parse_location,
)
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
from vmlend.registry.store import DEFAULT_BUSY_TIMEOUT
from vmlend.registry.store import Registry as SqliteRegistry

__all__ = [
    "DEFAULT_BUSY_TIMEOUT",
    "REGISTRY_ENV",
    "Claim",
    "ClaimKind",
    "DeviceRecord",
    "EtcdRegistry",
    "FenceRecord",
    "HoldRecord",
    "MdevRecord",
    "NodeRecord",
    "ParentRecord",
    "Phase",
    "Registry",
    "RegistryLocation",
    "RuntimeRecord",
    "SqliteRegistry",
    "StateTxn",
    "TopologyRecord",
    "create_registry",
    "open_registry",
    "parse_location",
    "same_holder",
]
