"""vmlend: lend remote PCIe devices across an NTB fabric to libvirt/QEMU guests."""

__version__ = "0.1.0"
