"""At start-up the agent makes the registry match this host's VMs.

What a running VM uses is (re-)acquired, with the hook's own ``reconnect`` (the same code a
libvirtd restart runs); what a VM that is not running still holds — a release hook that failed,
a VM undefined while its holds stayed — is returned. The agent takes this as a ``Reconciler``:
``vmlend reconcile`` (issue 12) is the fuller version and should be passed in once it exists.
"""

from __future__ import annotations

import logging
from typing import Protocol

from vmlend.errors import VmlendError
from vmlend.fabric.base import Fabric
from vmlend.fabric.model import Holder
from vmlend.hook.actionlog import NullLog
from vmlend.hook.domainview import read_hook_domain
from vmlend.hook.ops import HookOps
from vmlend.hypervisor.base import Hypervisor
from vmlend.lending import return_all
from vmlend.registry.records import same_holder

log = logging.getLogger(__name__)


class Reconciler(Protocol):
    def __call__(self, hv: Hypervisor, fabric: Fabric) -> list[str]:
        """Repair this host's drift; one line per thing done or found wrong."""
        ...


class _Lines(NullLog):
    """The hook's action records, kept as lines (the agent logs them)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def record(self, domain: str, operation: str, message: str) -> None:
        self.lines.append(f"{domain} {operation}: {message}")


def reconcile_host(hv: Hypervisor, fabric: Fabric) -> list[str]:
    """The agent's own reconciler: running VMs re-acquire, everything else held here returns."""
    actions = _Lines()
    ops = HookOps(fabric, actions)
    running: list[Holder] = []
    for info in hv.list_domains():
        try:
            xml = hv.xml(info.name, inactive=not info.active)
            dom = read_hook_domain(xml, strict=False)
            if dom is None:
                continue
            holder = ops.holder(dom)
            if info.active:
                running.append(holder)
                for problem in ops.reconnect(dom):
                    actions.lines.append(f"{info.name} reconnect: PROBLEM: {problem}")
            else:
                ops.release(dom)
        except VmlendError as e:
            actions.lines.append(f"{info.name}: {e}")
    # Holds of VMs this hypervisor does not know at all (undefined while holding).
    for st in fabric.devices():
        h = st.holder
        if h is None or h.node != fabric.local_node:
            continue
        if any(same_holder(h, r) for r in running):
            continue

        def record(msg: str, vm: str = h.vm) -> None:
            actions.record(vm, "return (no such VM here)", msg)

        for failure in return_all(fabric, h, [], record):
            record(f"FAILED: {failure}")
    return actions.lines
