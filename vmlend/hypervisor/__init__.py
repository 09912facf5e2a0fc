"""The hypervisor vmlend drives: libvirt in production, a simulated one for the demo's nodes."""

from vmlend.hypervisor.base import DomainInfo, DomainState, Hypervisor
from vmlend.hypervisor.open import open_hypervisor

__all__ = ["DomainInfo", "DomainState", "Hypervisor", "open_hypervisor"]
