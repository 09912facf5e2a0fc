"""What the hook does for each libvirt operation, over an injected ``Fabric``.

prepare is all or nothing: every change is pushed on an undo journal, and any failure undoes
them in reverse before the error propagates. release and reconnect are idempotent, so running
them twice, or after a crash half-way, converges on the same clean state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from vmlend.domain import DomainInfo
from vmlend.errors import HookError, VmlendError
from vmlend.fabric.base import Fabric
from vmlend.fabric.model import Holder, format_fdid
from vmlend.hook.actionlog import ActionLog

log = logging.getLogger(__name__)


@dataclass
class _Journal:
    """Undo steps of a prepare in progress, run in reverse on failure."""

    steps: list[tuple[str, Callable[[], object]]] = field(default_factory=list)

    def push(self, what: str, undo: Callable[[], object]) -> None:
        self.steps.append((what, undo))

    def rollback(self, record: Callable[[str], None]) -> None:
        for what, undo in reversed(self.steps):
            try:
                undo()
                record(f"undo {what}: ok")
            except VmlendError as e:  # keep undoing the rest; say what could not be undone
                record(f"undo {what}: FAILED: {e}")
        self.steps.clear()


class HookOps:
    def __init__(self, fabric: Fabric, actions: ActionLog) -> None:
        self.fabric = fabric
        self.actions = actions

    def holder(self, dom: DomainInfo) -> Holder:
        return Holder(node=self.fabric.local_node, vm=dom.name, vm_uuid=str(dom.uuid or ""))

    def prepare(self, dom: DomainInfo) -> None:
        """Reserve every device and create its mdev, or change nothing."""
        holder = self.holder(dom)

        def record(msg: str) -> None:
            self.actions.record(dom.name, "prepare", msg)

        journal = _Journal()
        existing = {m.uuid for m in self.fabric.mdevs()}
        for dev in dom.devices:
            fd = format_fdid(dev.fdid)
            try:
                before = self.fabric.device(dev.fdid).holder
                self.fabric.reserve(dev.fdid, holder, guest_ram=dom.memory_bytes or 0)
                if before != holder:
                    journal.push(f"reserve {fd}", lambda d=dev: self.fabric.release(d.fdid, holder))
                record(f"reserve {fd}: ok")
                parent = self.fabric.ensure_mdev_parent(dev.fdid)
                self.fabric.create_mdev(dev.fdid, str(dev.mdev), holder)
                if str(dev.mdev) not in existing:
                    journal.push(
                        f"mdev {dev.mdev}", lambda d=dev: self.fabric.remove_mdev(str(d.mdev))
                    )
                record(f"mdev {dev.mdev} for {fd} under {parent}: ok")
            except VmlendError as e:
                record(f"device {fd}: FAILED: {e}")
                journal.rollback(record)
                raise HookError(f"cannot start VM {dom.name!r}: device {fd}: {e}") from e
        record(f"{len(dom.devices)} device(s) ready")

    def release(self, dom: DomainInfo) -> None:
        """Remove this VM's mdevs and return its devices. Idempotent; also cleans up what a
        crashed earlier run or a stale XML left behind (matched by VM UUID on this node)."""
        holder = self.holder(dom)
        failures: list[str] = []

        def record(msg: str) -> None:
            self.actions.record(dom.name, "release", msg)

        ours = {str(d.mdev) for d in dom.devices}
        for m in self.fabric.mdevs():
            if m.uuid in ours or (m.vm == dom.name and m.node in ("", holder.node)):
                try:
                    if self.fabric.remove_mdev(m.uuid):
                        record(f"mdev {m.uuid}: removed")
                except VmlendError as e:
                    failures.append(f"mdev {m.uuid}: {e}")
        fdids = {d.fdid for d in dom.devices}
        for st in self.fabric.devices():
            h = st.holder
            if h and h.node == holder.node and (h.vm_uuid == holder.vm_uuid or h.vm == dom.name):
                fdids.add(st.fdid)
        for fdid in sorted(fdids):
            try:
                if self.fabric.release(fdid, holder):
                    record(f"device {format_fdid(fdid)}: returned")
            except VmlendError as e:
                failures.append(f"device {format_fdid(fdid)}: {e}")
        for f in failures:
            record(f"FAILED: {f}")
        if failures:
            raise HookError(f"release of VM {dom.name!r} incomplete: " + "; ".join(failures))

    def reconnect(self, dom: DomainInfo) -> list[str]:
        """libvirtd restarted while the VM runs: make the state match the running VM.

        Returns the problems found. They are logged, not fatal: a failing reconnect hook makes
        libvirt kill the guest, which is worse than a state that needs an operator's look.
        """
        holder = self.holder(dom)
        problems: list[str] = []
        have = {m.uuid for m in self.fabric.mdevs()}
        for dev in dom.devices:
            fd = format_fdid(dev.fdid)
            try:
                st = self.fabric.device(dev.fdid)
                if st.holder != holder:
                    self.fabric.reserve(dev.fdid, holder, guest_ram=dom.memory_bytes or 0)
                    self.actions.record(dom.name, "reconnect", f"re-reserved {fd}")
                if str(dev.mdev) not in have:
                    self.fabric.ensure_mdev_parent(dev.fdid)
                    self.fabric.create_mdev(dev.fdid, str(dev.mdev), holder)
                    self.actions.record(dom.name, "reconnect", f"re-created mdev {dev.mdev}")
            except VmlendError as e:
                problems.append(f"device {fd}: {e}")
                self.actions.record(dom.name, "reconnect", f"device {fd}: PROBLEM: {e}")
        if not problems:
            self.actions.record(dom.name, "reconnect", f"{len(dom.devices)} device(s) consistent")
        return problems
