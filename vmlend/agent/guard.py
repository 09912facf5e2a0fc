"""Borrower side: pause the VMs that use remote devices while the host's lease is in doubt.

A borrower that cannot renew its lease may lose its holds at any moment, and the lenders will
then take the devices back; a guest that keeps running would do DMA through mappings that are
about to vanish or belong to somebody else. So the agent pauses those VMs once renewing has
failed for half the TTL, and resumes them when it renews again. When the lease is gone the
agent pauses them all (a frozen agent could not in time) and, under a new lease, hands them
to ``recover.LostLeaseRecovery``.
"""

from __future__ import annotations

import logging

from vmlend.errors import VmlendError
from vmlend.fabric.base import Fabric
from vmlend.hook.domainview import read_hook_domain
from vmlend.hypervisor.base import DomainState, Hypervisor

log = logging.getLogger(__name__)


class RemoteVmGuard:
    def __init__(self, hv: Hypervisor, fabric: Fabric, node: str) -> None:
        self._hv = hv
        # Read now: when the guard acts, the registry is exactly what cannot be reached.
        self._lenders = {d.fdid: d.lender for d in fabric.topology().devices}
        self._node = node
        #: The VMs paused when the lease was lost, for the recovery under the next lease.
        self.paused_after_loss: list[str] = []

    def _uses_remote_devices(self, name: str) -> bool:
        dom = read_hook_domain(self._hv.xml(name), strict=False)
        if dom is None:
            return False
        return any(self._lenders.get(d.fdid, "") != self._node for d in dom.devices)

    def pause(self) -> list[str]:
        """Pause every running VM here with a remote device; the names paused."""
        paused = []
        for info in self._hv.list_domains():
            if info.state is not DomainState.RUNNING:
                continue
            try:
                if self._uses_remote_devices(info.name):
                    self._hv.suspend(info.name)
                    paused.append(info.name)
            except VmlendError as e:
                log.error("could not pause %s: %s", info.name, e, extra={"vm": info.name})
        if paused:
            log.warning("lease in doubt: paused %s (they use remote devices)", ", ".join(paused))
        return paused

    def pause_these(self, names: list[str]) -> list[str]:
        """Pause ``names`` (whatever devices they use); the names paused."""
        paused = []
        for name in names:
            try:
                self._hv.suspend(name)
                paused.append(name)
            except VmlendError as e:
                log.error("could not pause %s: %s", name, e, extra={"vm": name})
        if paused:
            log.warning("paused %s (their holds are gone)", ", ".join(paused))
        return paused

    def resume(self, names: list[str]) -> None:
        for name in names:
            try:
                self._hv.resume(name)
            except VmlendError as e:
                log.error("could not resume %s: %s", name, e, extra={"vm": name})
        if names:
            log.warning("lease renewed: resumed %s", ", ".join(names))
