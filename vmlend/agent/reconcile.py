"""At start-up the agent makes the registry match this host's VMs.

What a running VM uses is (re-)acquired, with the repair the hook's ``reconnect`` (a libvirtd
restart) runs too; what a VM that is not running still holds — a release hook that failed,
a VM undefined while its holds stayed — is returned. The agent takes this as a ``Reconciler``;
the default is ``vmlend reconcile --fix``'s own code.
"""

from __future__ import annotations

import logging
from typing import Protocol

from vmlend.fabric.base import Fabric
from vmlend.hypervisor.base import Hypervisor
from vmlend.ops.reconcile import find_drift, fix, look

log = logging.getLogger(__name__)


class Reconciler(Protocol):
    def __call__(self, hv: Hypervisor, fabric: Fabric) -> list[str]:
        """Repair this host's drift; one line per thing done or found wrong."""
        ...


def reconcile_host(hv: Hypervisor, fabric: Fabric) -> list[str]:
    """``vmlend reconcile --fix`` for this host (``vmlend.ops.reconcile``, the repair the hook's
    ``reconnect`` shares): what a running VM uses is re-acquired, what no running VM uses is
    returned; drift vmlend must not fix is reported for the operator."""
    lines: list[str] = []
    found = find_drift(look(hv, fabric))
    result = fix(hv, fabric, found, lines.append)
    for d in result.fixed:
        lines.append(f"{d.kind.value} {d.vm}: {d.fix}")
    for d in result.left:
        lines.append(f"{d.kind.value} {d.vm}: left to the operator: {d.fix}")
    for d in result.started:
        lines.append(f"{d.kind.value} {d.vm}: kept, the VM started meanwhile")
    return lines
