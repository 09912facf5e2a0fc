"""The libvirt qemu hook: libvirt's contract (``contract``), what vmlend does for each
operation (``ops``), the process entry point (``main``), its action log (``actionlog``) and
installation into a libvirt config dir (``install``).

The hook never calls back into libvirt: libvirtd is waiting for it, so any libvirt call
would deadlock the daemon.
"""
