"""The hypervisor vmlend drives: libvirt in production, a simulated one for the demo's nodes."""

from vmlend.hypervisor.base import DomainInfo, DomainState, Hypervisor
from vmlend.hypervisor.libvirt_hv import LibvirtHypervisor
from vmlend.hypervisor.open import open_hypervisor

__all__ = [
    "DomainInfo",
    "DomainState",
    "GuestDriver",
    "Hypervisor",
    "IdleGuest",
    "LibvirtHypervisor",
    "SimHypervisor",
    "open_hypervisor",
]


def __getattr__(name: str) -> object:
    # The simulated node lives in vmlend.sim and imports this package: loaded on first use.
    if name in ("GuestDriver", "IdleGuest", "SimHypervisor"):
        from vmlend.sim.hypervisor import node

        return getattr(node, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
