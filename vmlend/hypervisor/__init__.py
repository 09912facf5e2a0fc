"""The hypervisor vmlend drives: the ``Hypervisor`` protocol and libvirt, production's.

The simulated node (``vmlend.sim.hypervisor``) implements the same protocol; which one a URI
opens is decided in ``vmlend.wiring.hypervisor``.
"""

from vmlend.hypervisor.base import (
    DomainInfo,
    DomainState,
    Hypervisor,
    LiveMigration,
    MigrationStats,
    SwitchOver,
)
from vmlend.hypervisor.libvirt_hv import LibvirtHypervisor

__all__ = [
    "DomainInfo",
    "DomainState",
    "Hypervisor",
    "LibvirtHypervisor",
    "LiveMigration",
    "MigrationStats",
    "SwitchOver",
]
