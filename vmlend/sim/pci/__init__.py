"""PCI building blocks shared by the simulator and the mdev emulation: config space, BAR MMIO.

``vmlend.sim.pci.regs`` holds the register offsets and bits (pci_regs.h names), ``config`` the
type-0 configuration space with its write semantics, ``bar`` the memory behind BARs (with the
MSI-X table and PBA where the capability puts them).
"""

from vmlend.sim.pci.bar import BarMemory, MsixEntry
from vmlend.sim.pci.config import ConfigSpace, parse_bdf

__all__ = ["BarMemory", "ConfigSpace", "MsixEntry", "parse_bdf"]
