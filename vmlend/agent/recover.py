"""Borrower side, after the host's lease was lost and a new one taken: win back the paused VMs.

Every hold of the old lease is gone. For each VM the guard paused, the agent re-reserves its
devices under the new lease (waiting a bounded time for a lender to take a fenced device back
first). A device that another host took meanwhile, or that cannot be had, is lost: its hostdev
is hot-unplugged from the running VM (live only: the persistent definition is the operator's)
and the VM resumes without it. When even that fails the VM stays paused, and the log says why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from uuid import UUID

import msgspec
from lxml import etree

from vmlend.agent.guard import resume_if_paused
from vmlend.domain import (
    METADATA_KEY,
    NAMESPACE_URI,
    DomainDocument,
    find_device,
    read_domain,
    remove_device,
)
from vmlend.domain.info import DomainXMLInfo
from vmlend.domain.model import DomainXML
from vmlend.errors import (
    DeviceFencedError,
    DomainOperationError,
    LeaseExpiredError,
    LibvirtError,
    RegistryUnreachableError,
    UnknownDomainError,
    VmlendError,
)
from vmlend.fabric.base import Fabric
from vmlend.hook.domainview import read_hook_domain
from vmlend.hypervisor.base import DomainState, Hypervisor
from vmlend.lending.devices import UndoJournal, acquire_device, holder_for, return_device
from vmlend.ops.definitions import plain_metadata
from vmlend.ops.unplug import live_has_hostdev
from vmlend.registry.records import same_holder
from vmlend.topology.model import Holder, format_fdid

log = logging.getLogger(__name__)


class VmRecovery(msgspec.Struct):
    """What became of one paused VM: ``outcome`` is "resumed", "unplugged" (lost devices
    removed, then resumed), "kept-paused" (an operator's pause: its devices re-reserved or
    unplugged, the VM left paused), "stopped" (it stopped while being recovered: nothing kept
    for it) or "paused" (not done: ``why`` says why it stays so)."""

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
            return text + f"; stays paused: an operator paused it{done}"
        return text + f"; stays paused: {self.why}"


#: What the operator of a VM left paused with a device it lost should know.
_OPERATORS = (
    "an operator paused it: it stays paused and the agent tries again later; do not resume it"
    " before 'vmlend reconcile' shows it clean (or stop it)"
)


class LostLeaseRecovery:
    def __init__(
        self,
        hv: Hypervisor,
        fabric: Fabric,
        *,
        fence_wait: float,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        resume_gate: Callable[[str, Callable[[], None]], bool] | None = None,
        park: Callable[[str], None] | None = None,
        keep_alive: Callable[[], None] = lambda: None,
        retry: Callable[[str], None] | None = None,
        take_back: Callable[[], None] = lambda: None,
        resume: Callable[[str], None] | None = None,
        unmark: Callable[[str], None] = lambda _name: None,
    ) -> None:
        #: Resumes a paused VM (``UnknownDomainError``: gone); by default straight on the
        #: hypervisor, in the agent with its pause mark dropped (``RemoteVmGuard``).
        self._resume_vm = resume or (lambda name: resume_if_paused(hv, name))
        #: The VM is gone: it needs no pause mark any more (in the agent, its mark is dropped
        #: unless it is paused again by then: ``RemoteVmGuard.unmark_unless_paused``).
        self._unmark = unmark
        #: Takes back this host's own fenced devices (lent to its own VMs): nobody else will
        #: while the recovery holds up the agent's loop.
        self._take_back = take_back
        self._hv = hv
        #: Hands a VM back for another recovery soon (``LeaseWatch.orphan``).
        self._retry = retry
        #: Renews the lease if due: the recovery runs on the agent's loop and may wait for
        #: lenders for longer than the lease lives.
        self._keep_alive = keep_alive
        #: Keeps a VM paused for the recovery under the next lease (``LeaseWatch.park``): the
        #: lease this recovery writes under ended before the VM was won back.
        self._park = park
        #: Resumes a VM only while the lease is not in doubt (``LeaseWatch.resume_if_fresh``):
        #: the recovery runs on the agent's loop, which renews nothing meanwhile, so by the time
        #: a VM is won back the new lease may be about to end with the holds just taken.
        self._resume_gate = resume_gate
        self._fabric = fabric
        #: How long to wait for a lender to take back a device fenced under the old lease.
        self._fence_wait = fence_wait
        self._interval = interval
        self._clock = clock
        self._sleep = sleep

    def recover(self, names: list[str], *, leave_paused: bool = False) -> list[VmRecovery]:
        """Win back each of ``names``. ``leave_paused``: VMs an operator paused (no agent's
        pause mark): their devices are re-reserved or unplugged all the same, so that the
        operator's resume, which no hook or agent sees, cannot run a guest on a device another
        host holds; they stay paused ("kept-paused"). One that cannot be done now stays
        "paused", not handed to ``retry`` or ``park`` (those end in a resume): the agent
        tries it again as an operator's (``Agent._recover_operators``)."""
        out = []
        for name in names:
            self._keep_alive()
            try:
                result = self._recover_one(name, leave_paused)
            except UnknownDomainError:
                result = VmRecovery(name, outcome="stopped", why="it is gone")
                self._unmark(name)
            except LibvirtError as e:  # the hypervisor failed (a job timeout): try again
                result = VmRecovery(name, why=f"{e}; tried again")
                if leave_paused:
                    result.why = f"{e}; {_OPERATORS}"
                elif self._retry is not None:
                    self._retry(name)
            except VmlendError as e:  # its XML unreadable, say: nothing more to try
                result = VmRecovery(name, why=f"{e}; {_OPERATORS}" if leave_paused else str(e))
            log.warning("after a new lease: %s", result.describe())
            out.append(result)
        return out

    def _recover_one(self, name: str, leave_paused: bool = False) -> VmRecovery:
        result = VmRecovery(name)
        live = self._hv.xml(name)
        dom = read_hook_domain(live, strict=False)
        if dom is not None:
            holder = holder_for(self._fabric, name, dom.uuid or self._hv.lookup(name).uuid)
            for dev in dom.devices:
                try:
                    self._acquire(holder, dev.fdid, str(dev.mdev), dom.memory_bytes or 0)
                    result.regained.append(dev.fdid)
                except RegistryUnreachableError as e:
                    # Not lost, unknown: the device may still be ours. Stay paused, and try
                    # again on the agent's next turn.
                    result.why = (
                        f"the registry cannot be reached to re-reserve it ({e}); tried again"
                    )
                    if leave_paused:
                        result.why = f"the registry cannot be reached ({e}); {_OPERATORS}"
                    elif self._retry is not None:
                        self._retry(name)
                    return result
                except LeaseExpiredError:
                    # The lease ended under us (the agent froze again): not this device is
                    # lost but the lease, and what was re-reserved went with it. Unplugging
                    # now would take a device from a guest that may win it back.
                    result.regained.clear()
                    result.why = (
                        "this host's lease ended while its devices were re-reserved; the"
                        " recovery under the next lease tries again"
                    )
                    if leave_paused:
                        result.why = f"this host's lease ended meanwhile; {_OPERATORS}"
                    elif self._park is not None:
                        self._park(name)
                    return result
                except VmlendError as e:
                    result.lost[dev.fdid] = str(e)
            if not self._still_there(name):
                # Stopped while we re-reserved (an admin's destroy, a crash): its release ran
                # before our reserves, or will not run again. Give back what we took for it.
                for dev in dom.devices:
                    if dev.fdid in result.regained:
                        return_device(self._fabric, holder, dev.fdid, str(dev.mdev))
                result.regained.clear()
                result.outcome = "stopped"
                result.why = "it stopped meanwhile; the devices re-reserved for it are returned"
                self._unmark(name)
                return result
        if result.lost:
            try:
                # a paused guest cannot let go of a hostdev: for one left paused, the unplug
                # counts only once the hostdev is gone (the agent's own resume at once)
                self._unplug(name, list(result.lost), require_gone=leave_paused)
            except UnknownDomainError:
                raise  # gone meanwhile: "stopped", as ``recover`` says
            except VmlendError as e:
                result.why = f"could not hot-unplug its lost devices: {e}"
                if leave_paused:
                    result.why += f"; {_OPERATORS}"
                return result
        if leave_paused:
            result.outcome = "kept-paused"
            return result
        if not self._resume(name):
            result.why = (
                "the new lease was not renewed for half its TTL meanwhile, or a plug request"
                " is plugging devices into it; resumed after the next renewal, or recovered"
                " again once the plug is done"
            )
            return result
        result.outcome = "unplugged" if result.lost else "resumed"
        return result

    def _still_there(self, name: str) -> bool:
        """Whether the VM still runs here (paused by us or not): its holds are wanted. A
        hypervisor that cannot say raises (the recovery is tried again): returning the holds
        of a VM that runs would leave it paused without them."""
        try:
            return self._hv.lookup(name).active
        except UnknownDomainError:
            return False

    def _resume(self, name: str) -> bool:
        # a VM a late resume ran (``LeaseWatch.take_orphans``) may run already
        if self._resume_gate is None:
            self._resume_vm(name)
            return True
        return self._resume_gate(name, lambda: self._resume_vm(name))

    def _acquire(self, holder: Holder, fdid: int, mdev: str, guest_ram: int) -> None:
        deadline = self._clock() + self._fence_wait
        while True:
            try:
                acquire_device(self._fabric, holder, fdid, mdev, UndoJournal(), guest_ram=guest_ram)
                return
            except (DeviceFencedError, RegistryUnreachableError):
                # Fenced under our old lease: the lender's agent takes it back within its
                # scan interval; after that it is ours again unless someone else is faster.
                # etcd away again: wait for it as long.
                if self._clock() >= deadline:
                    raise
                self._sleep(self._interval)
                self._keep_alive()
                try:
                    self._take_back()
                except Exception as e:  # another device's take-back: not this one's failure
                    log.warning("taking back this host's fenced devices failed: %s", e)

    def _unplug(self, name: str, fdids: list[int], *, require_gone: bool = False) -> None:
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
            log.warning("VM %s: hot-unplugged lost device %s", name, format_fdid(fdid))
        read_domain(self._hv.xml(name), strict=False)  # what is left still parses


def vms_without_their_holds(hv: Hypervisor, fabric: Fabric) -> list[str]:
    """The running or paused VMs here that use a device the registry does not say is
    theirs: this host's lease ended while its agent was down, so the holds went with it (and
    another host may hold the device by now). They take the lost-lease path at start-up.
    Paused ones too: this agent's watch may have paused one while it started up."""
    # The domains first, then the holds: a VM listed as running had its prepare hook (which
    # reserves) done before, so its holds are in any later read.
    active = (DomainState.RUNNING, DomainState.PAUSED)
    running = [i for i in hv.list_domains() if i.state in active]
    holders = {st.fdid: st.holder for st in fabric.devices()}
    out = []
    for info in running:
        try:
            dom = read_hook_domain(hv.xml(info.name), strict=False)
        except UnknownDomainError:  # gone meanwhile
            continue
        except VmlendError as e:  # unknown: suspect (paused and recovered, which retries)
            log.warning("could not read VM %s to check its holds: %s", info.name, e)
            out.append(info.name)
            continue
        if dom is not None and _uses_unheld(fabric, info.name, dom, info.uuid, holders.get):
            out.append(info.name)
    return out


def lacks_holds(hv: Hypervisor, fabric: Fabric, name: str) -> bool:
    """Whether VM ``name`` uses a device the registry does not say is its own (checked right
    before a renewal resumes it: whatever the bookkeeping says, a VM must not run on a device
    whose hold went with a lost lease)."""
    dom = read_hook_domain(hv.xml(name), strict=False)
    if dom is None:
        return False
    uuid = dom.uuid or hv.lookup(name).uuid
    return _uses_unheld(fabric, name, dom, uuid, lambda f: fabric.device(f).holder)


def _uses_unheld(
    fabric: Fabric,
    name: str,
    dom: DomainXMLInfo,
    uuid: UUID | str,
    held_by: Callable[[int], Holder | None],
) -> bool:
    """Whether VM ``name`` (``dom``) uses a device that ``held_by`` says is not its own."""
    holder = holder_for(fabric, name, dom.uuid or uuid)
    for dev in dom.devices:
        if dev.share is not None:  # a queue-level share: the lender's manager holds it
            continue
        held = held_by(dev.fdid)
        if held is None or not same_holder(held, holder):
            return True
    return False
