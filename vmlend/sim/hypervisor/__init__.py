"""The simulated hypervisor node (``sim:///NODE``): domains kept in files, libvirt's observed
behaviour, and the qemu hook run as libvirtd runs it (docs/hypervisor.md)."""
