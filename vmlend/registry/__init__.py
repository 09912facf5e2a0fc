"""The shared state: who lends, who holds what, which mdevs exist, which adapter resources are
claimed. One SQLite database (WAL, transactions) that the hook, the CLI and the daemon share
across processes.
"""

from vmlend.registry.records import (
    Claim,
    ClaimKind,
    DeviceRecord,
    HoldRecord,
    MdevRecord,
    NodeRecord,
    ParentRecord,
    Phase,
    RuntimeRecord,
    TopologyRecord,
    same_holder,
)
from vmlend.registry.store import DEFAULT_BUSY_TIMEOUT, Registry
from vmlend.registry.txn import StateTxn

__all__ = [
    "DEFAULT_BUSY_TIMEOUT",
    "Claim",
    "ClaimKind",
    "DeviceRecord",
    "HoldRecord",
    "MdevRecord",
    "NodeRecord",
    "ParentRecord",
    "Phase",
    "Registry",
    "RuntimeRecord",
    "StateTxn",
    "TopologyRecord",
    "same_holder",
]
