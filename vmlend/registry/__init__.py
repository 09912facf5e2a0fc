"""The shared state: who lends, who holds what, which mdevs exist, which adapter resources are
claimed. One interface (``api``: ``Registry``, ``StateTxn``), two backends: an SQLite file
(WAL, transactions) that the processes of one host share, and etcd for a cluster of hosts.
``open_registry`` / ``create_registry`` pick one from a location (``location``).

``EtcdRegistry`` is loaded on first use: an SQLite host (and its libvirt hook) never imports
the etcd client modules.
"""

from typing import TYPE_CHECKING, Any

from vmlend.registry.api import Registry, StateTxn
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
from vmlend.registry.store import DEFAULT_BUSY_TIMEOUT, SqliteRegistry

if TYPE_CHECKING:
    from vmlend.registry.etcd_store import EtcdRegistry


def __getattr__(name: str) -> Any:
    if name == "EtcdRegistry":
        from vmlend.registry.etcd_store import EtcdRegistry

        return EtcdRegistry
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
