"""Win a paused VM's devices back under the host's current lease.

Used by a VM's worker (``vmlend.agent.guest``) before it resumes a VM it paused, and for a VM
somebody else paused after the lease changed. Each device the VM uses that the registry does
not say is its own (its hold went with a lost lease, or never was: a late hot-plug) is
re-reserved, waiting a bounded time for its lender to take it back first if it is fenced. A
device another host took meanwhile, or that cannot be had, is lost: its hostdev is hot-unplugged
from the running domain (live only: the persistent definition is the operator's). The worker
resumes the VM afterwards; when anything is left undone the VM stays paused and the result says
why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
from lxml import etree

from vmlend.domain import (
    METADATA_KEY,
    NAMESPACE_URI,
    DomainDocument,
    find_device,
    read_domain,
    remove_device,
)
from vmlend.domain.model import DomainXML
from vmlend.errors import (
    DeviceFencedError,
    DomainOperationError,
    LeaseExpiredError,
    RegistryUnreachableError,
    UnknownDomainError,
    VmlendError,
)
from vmlend.fabric.base import Fabric
from vmlend.hook.domainview import read_hook_domain
from vmlend.hypervisor.base import Hypervisor
from vmlend.lending.devices import UndoJournal, acquire_device, holder_for, return_device
from vmlend.ops.definitions import plain_metadata
from vmlend.ops.unplug import live_has_hostdev
from vmlend.registry.records import same_holder
from vmlend.topology.model import GuestRam, Holder, format_fdid

log = logging.getLogger(__name__)


class VmRecovery(msgspec.Struct):
    """What became of one VM's devices: ``outcome`` is "resumed" (all its own again),
    "unplugged" (lost devices removed), "kept-paused" (paused by somebody else: its devices
    re-reserved or unplugged, left paused), "stopped" (it stopped meanwhile: nothing kept for
    it) or "paused" (not done: ``why`` says why it stays so)."""

    vm: str
    regained: list[int] = msgspec.field(default_factory=list)
    lost: dict[int, str] = msgspec.field(default_factory=dict)
    outcome: str = "paused"
    why: str = ""

    def describe(self) -> str:
        got = ", ".join(format_fdid(f) for f in self.regained) or "none"
        lost = "; ".join(f"{format_fdid(f)} ({r})" for f, r in self.lost.items())
        text = f"VM {self.vm}: re-reserved {got}"
        if lost:
            text += f"; lost {lost}"
        if self.outcome == "resumed":
            return text + "; resumed"
        if self.outcome == "unplugged":
            return text + "; hot-unplugged the lost devices and resumed"
        if self.outcome == "stopped":
            return f"VM {self.vm}: {self.why}"
        if self.outcome == "kept-paused":
            done = " (its lost devices hot-unplugged)" if self.lost else ""
            return text + f"; stays paused: somebody else paused it{done}"
        return text + f"; stays paused: {self.why}"


def unheld(hv: Hypervisor, fabric: Fabric, name: str) -> list[int]:
    """The devices VM ``name`` uses that the registry does not say are its own (read now).
    A queue-level NVMe share is held by its lender's manager, not by the VM: not counted."""
    dom = read_hook_domain(hv.xml(name), strict=False)
    if dom is None:
        return []
    holder = holder_for(fabric, name, dom.uuid or hv.lookup(name).uuid)
    out = []
    for dev in dom.devices:
        if dev.share is not None:
            continue
        held = fabric.device(dev.fdid).holder
        if held is None or not same_holder(held, holder):
            out.append(dev.fdid)
    return out


class WinBack:
    """Re-reserves or unplugs a paused VM's devices (``run``). ``in_time`` says whether the
    lease this runs under is still the one to write under (checked between devices: a lease
    lost meanwhile takes what was re-reserved with it, and unplugging then would take a device
    from a guest that may win it back under the next)."""

    def __init__(
        self,
        hv: Hypervisor,
        fabric: Fabric,
        *,
        fence_wait: float,
        interval: float,
        in_time: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._hv = hv
        self._fabric = fabric
        self._fence_wait = fence_wait
        self._interval = interval
        self._in_time = in_time
        self._clock = clock
        self._sleep = sleep

    def run(self, name: str, *, leave_paused: bool) -> VmRecovery:
        """Win back ``name``'s devices; ``leave_paused``: it is somebody else's pause (its
        hostdevs must be gone for a lost device to count as unplugged: a paused guest cannot
        finish a live detach). ``UnknownDomainError`` is "stopped"."""
        result = VmRecovery(name)
        try:
            return self._run(name, result, leave_paused)
        except UnknownDomainError:
            result.outcome, result.why = "stopped", "it is gone"
        except VmlendError as e:  # the hypervisor or the registry failed: tried again
            result.outcome, result.why = "paused", f"{e}; tried again"
        return result

    def _run(self, name: str, result: VmRecovery, leave_paused: bool) -> VmRecovery:
        dom = read_hook_domain(self._hv.xml(name), strict=False)
        if dom is None:
            result.outcome = "kept-paused" if leave_paused else "resumed"
            return result
        holder = holder_for(self._fabric, name, dom.uuid or self._hv.lookup(name).uuid)
        missing = set(unheld(self._hv, self._fabric, name))
        for dev in dom.devices:
            if dev.fdid not in missing:
                continue
            if not self._in_time():
                result.why = "the lease changed meanwhile; tried again under the next"
                return result
            try:
                # The running VM's exact layout, as its prepare admitted it: the claims then
                # equal the windows its guest maps, and on the kernel backend the child's
                # dma_windows are written. The size alone is a guess (a 3 GiB i440fx guest
                # has no high window; the guess claims one).
                ram = dom.ram if dom.ram is not None else dom.memory_bytes or 0
                self._acquire(holder, dev.fdid, str(dev.mdev), ram)
                result.regained.append(dev.fdid)
            except RegistryUnreachableError as e:
                # Not lost, unknown: the device may still be ours. Stay paused, try again.
                result.why = f"the registry cannot be reached to re-reserve it ({e}); tried again"
                return result
            except LeaseExpiredError:
                result.regained.clear()
                result.why = "this host's lease ended meanwhile; tried again under the next"
                return result
            except VmlendError as e:
                result.lost[dev.fdid] = str(e)
        if not self._hv.lookup(name).active:
            # Stopped meanwhile (an admin's destroy, a crash): its release ran before our
            # reserves, or will not run again. Give back what was taken for it.
            for dev in dom.devices:
                if dev.fdid in result.regained:
                    return_device(self._fabric, holder, dev.fdid, str(dev.mdev))
            result.regained.clear()
            result.outcome = "stopped"
            result.why = "it stopped meanwhile; the devices re-reserved for it are returned"
            return result
        if result.lost:
            if not self._in_time():
                result.why = "the lease changed meanwhile; tried again under the next"
                return result
            try:
                self.unplug(name, list(result.lost), require_gone=leave_paused)
            except UnknownDomainError:
                raise
            except VmlendError as e:
                result.why = f"could not hot-unplug its lost devices: {e}"
                return result
        if leave_paused:
            result.outcome = "kept-paused"
        else:
            result.outcome = "unplugged" if result.lost else "resumed"
        return result

    def _acquire(
        self, holder: Holder, fdid: int, mdev: str, guest_ram: GuestRam | int
    ) -> None:
        deadline = self._clock() + self._fence_wait
        while True:
            try:
                acquire_device(
                    self._fabric, holder, fdid, mdev, UndoJournal(), guest_ram=guest_ram
                )
                return
            except (DeviceFencedError, RegistryUnreachableError):
                # Fenced under our old lease: its lender's agent takes it back within its scan
                # interval, and then it is ours again unless someone else is faster. etcd away
                # again: wait for it as long.
                if self._clock() >= deadline or not self._in_time():
                    raise
                self._sleep(self._interval)

    def unplug(self, name: str, fdids: list[int], *, require_gone: bool = False) -> None:
        """Remove the hostdevs and metadata entries of ``fdids`` from the running domain.
        ``require_gone``: a hostdev still there after its detach (libvirt's live detach only
        asks the guest, and a paused one cannot answer) is an error, with its metadata entry
        and mdev kept, so the VM still counts as using the device."""
        for fdid in fdids:
            doc = DomainDocument.parse(self._hv.xml(name), source=f"live XML of {name}")
            device = find_device(doc, fdid)
            if device is None:
                continue
            for h in DomainXML(doc.root).mdev_hostdevs():
                if str(h.uuid) == str(device.mdev):
                    xml = etree.tostring(h.element, with_tail=False)
                    self._hv.detach_device(name, xml, live=True, config=False)
            if require_gone and live_has_hostdev(self._hv, name, str(device.mdev)):
                raise DomainOperationError(
                    "detach device from",
                    name,
                    f"device {fdid:#x} is still plugged: a paused guest cannot release it,"
                    " and the unplug completes only once the guest runs again",
                )
            # As it is now: a CLI attach or detach on this VM may have written meanwhile.
            doc = DomainDocument.parse(self._hv.xml(name), source=f"live XML of {name}")
            if find_device(doc, fdid) is not None:
                after = remove_device(doc, fdid, unplugged=True)
                self._hv.set_metadata(
                    name,
                    NAMESPACE_URI,
                    METADATA_KEY,
                    plain_metadata(after),
                    live=True,
                    config=False,
                )
            try:  # this host's mdev of a device it no longer holds
                self._fabric.remove_mdev(str(device.mdev))
            except VmlendError as e:
                log.warning("could not remove mdev %s of %s: %s", device.mdev, name, e)
            log.info("VM %s: hot-unplugged lost device %s", name, format_fdid(fdid))
        read_domain(self._hv.xml(name), strict=False)  # what is left still parses
