"""Whole-system scenarios: fault matrix, races, real libvirtd and QEMU, the demo, the nemesis."""
