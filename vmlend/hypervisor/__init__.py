"""The hypervisor vmlend drives: libvirt in production, a simulated one for the demo's nodes."""

from vmlend.hypervisor.base import DomainInfo, DomainState, Hypervisor
from vmlend.hypervisor.libvirt_hv import LibvirtHypervisor
from vmlend.hypervisor.open import open_hypervisor
from vmlend.hypervisor.sim_hv import GuestDriver, IdleGuest, SimHypervisor

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
