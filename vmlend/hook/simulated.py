"""Whether libvirtd is asked to start a VM on devices that exist only in vmlend's simulator.

Without the SmartIO driver the backend defaults to the simulated fabric, whose devices are on
no PCIe bus: only a simulated node (``sim:///<node>``) can run a VM that borrows them. libvirtd
itself fails such a start after the prepare hook, with "Mediated host device assignment
requires VFIO support" (or "mediated device ... not found"), which says nothing of why. The
CLI refuses first (``vmlend.cli.connect.refuse_simulated_devices``); for ``virsh start`` the
prepare hook does, and libvirt ends its error with the hook's line. As on the CLI, a backend
somebody chose ($VMLEND_BACKEND, the configuration file's ``backend``) lets libvirt try.
"""

from __future__ import annotations

from collections.abc import Mapping

from vmlend.hook.entry import CALLER_ENV, LIBVIRTD

#: ``vmlend.wiring.fabric.BACKEND_ENV``, not imported: most calls never need that module.
BACKEND_ENV = "VMLEND_BACKEND"


def simulated_only_by_default(env: Mapping[str, str]) -> bool:
    """Whether a call with ``env`` comes from libvirtd (``entry.CALLER_ENV``) with no backend
    chosen on a host whose default backend is "sim" (no SmartIO driver under its root)."""
    if env.get(CALLER_ENV) != LIBVIRTD or env.get(BACKEND_ENV):
        return False
    from vmlend.hostenv import HostEnv
    from vmlend.wiring.fabric import default_backend

    return default_backend(HostEnv.from_env(environ=env)) == "sim"
