"""Borrower side: pause the VMs that use remote devices while the host's lease is in doubt.

A borrower that cannot renew its lease may lose its holds at any moment, and the lenders will
then take the devices back; a guest that keeps running would do DMA through mappings that are
about to vanish or belong to somebody else. So the agent pauses those VMs once renewing has
failed for half the TTL, and resumes them when it renews again. When the lease is gone the
agent pauses them all (a frozen agent could not in time) and, under a new lease, hands them
to ``recover.LostLeaseRecovery``.

A pause must not wait for the hypervisor's slowest domain. Listing the domains waits for every
domain object, and one whose hook hangs (a start whose prepare waits for an etcd without
quorum) would hold up the pause of all the others while their lease runs out. So a census
thread remembers which running VMs use remote devices, and a pause suspends those first, each
by name on a thread of its own, and only then lists the domains for any started since.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

from vmlend.agent.pause_marks import PauseMarks
from vmlend.errors import UnknownDomainError, VmlendError
from vmlend.fabric.base import Fabric
from vmlend.hook.domainview import read_hook_domain
from vmlend.hypervisor.base import DomainState, Hypervisor

log = logging.getLogger(__name__)

#: ``RemoteVmGuard.whose_pause``'s answers.
RUNNING_VM, GONE, AGENT, OPERATOR, OTHER, UNKNOWN = (
    "running",
    "gone",
    "agent",
    "operator",
    "other",
    "unknown",
)


class RemoteVmGuard:
    def __init__(
        self, hv: Hypervisor, fabric: Fabric, node: str, marks: PauseMarks | None = None
    ) -> None:
        self._hv = hv
        #: Each VM this guard pauses is marked there until it is resumed (``pause_marks``).
        self.marks = marks
        #: One per VM: its mark and its suspend, or its resume and the clear of its mark, as
        #: one step (a pause between a resume and its clear would lose its mark).
        self._vm_locks: dict[str, threading.Lock] = {}
        self._vm_locks_lock = threading.Lock()
        # Read now: when the guard acts, the registry is exactly what cannot be reached.
        self._lenders = {d.fdid: d.lender for d in fabric.topology().devices}
        self._node = node
        #: The VMs paused when the lease was lost, for the recovery under the next lease.
        self.paused_after_loss: list[str] = []
        #: The VMs this guard paused and has not resumed: its own whatever the marks say (a
        #: mark may have failed to be written, or the marks cannot be read).
        self._suspended: set[str] = set()
        #: The running VMs with remote devices the last census found (replaced whole).
        self.known: frozenset[str] = frozenset()
        self._stop = threading.Event()
        self._census_thread: threading.Thread | None = None

    def _uses_remote_devices(self, name: str) -> bool:
        dom = read_hook_domain(self._hv.xml(name), strict=False)
        if dom is None:
            return False
        return any(self._lenders.get(d.fdid, "") != self._node for d in dom.devices)

    def census(self) -> list[str]:
        """The running VMs here with a remote device, remembered for the next pause."""
        found = []
        for info in self._hv.list_domains():
            if info.state is not DomainState.RUNNING:
                continue
            try:
                if self._uses_remote_devices(info.name):
                    found.append(info.name)
            except VmlendError:  # stopped meanwhile, or its XML unreadable: not known
                continue
        self.known = frozenset(found)
        return found

    def start_census(self, period: float) -> None:
        """Take a census every ``period`` seconds on a thread of its own (a census blocked
        by a domain's hook leaves the last one in place)."""

        def run() -> None:
            while not self._stop.wait(period):
                try:
                    self.census()
                except Exception as e:  # the next census may do better; pauses go on
                    log.debug("census of VMs with remote devices failed: %s", e)

        self._census_thread = threading.Thread(target=run, name="vm-census", daemon=True)
        self._census_thread.start()

    def stop_census(self) -> None:
        self._stop.set()

    def pause(self) -> list[str]:
        """Pause every running VM here with a remote device; the names paused. Those the
        last census found first, each on its own thread; then any the domains list now."""
        paused = self._pause_each(sorted(self.known))
        try:
            rest = [n for n in self.census() if n not in paused]
        except VmlendError as e:
            log.error("could not list the VMs to pause: %s", e)
            rest = []
        paused = sorted(paused + self._pause_each(rest))
        if paused:
            log.warning("lease in doubt: paused %s (they use remote devices)", ", ".join(paused))
        return paused

    def _pause_each(self, names: list[str]) -> list[str]:
        """Suspend the running ones of ``names`` at once, each on a thread of its own, so one
        domain the hypervisor is slow to answer for holds up only itself."""
        done: list[str] = []

        def one(name: str) -> None:
            if self.suspend_if_running(name):
                done.append(name)

        threads = [threading.Thread(target=one, args=(n,), name=f"pause-{n}") for n in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sorted(done)

    def pause_these(self, names: list[str]) -> list[str]:
        """Pause those of ``names`` that run (whatever devices they use); the names paused."""
        paused = [name for name in names if self.suspend_if_running(name)]
        if paused:
            log.warning("paused %s (their holds are gone)", ", ".join(paused))
        return paused

    def _vm_lock(self, name: str) -> threading.Lock:
        with self._vm_locks_lock:
            return self._vm_locks.setdefault(name, threading.Lock())

    def suspend_if_running(self, name: str) -> bool:
        """Pause ``name`` if it runs; whether this paused it (a failure is logged: the caller
        has nothing better; a VM that is gone runs nothing). A suspend that failed but left
        it paused (its answer was lost), or the hypervisor cannot say, counts as this one's:
        it stays marked, so this agent must resume it too, not only the next one."""
        with self._vm_lock(name):
            try:
                if self._hv.lookup(name).state is not DomainState.RUNNING:
                    return False
                if self.marks is not None:  # first: an agent killed after the pause knows
                    self.marks.mark(name)
                try:
                    self._hv.suspend(name)
                    self._suspended.add(name)
                except VmlendError as e:
                    if not self._unmark_unless_paused(name):
                        raise
                    self._suspended.add(name)
                    log.warning(
                        "suspending %s failed (%s), but it is paused or cannot be told: kept"
                        " as paused by the agent",
                        name,
                        e,
                        extra={"vm": name},
                    )
                    return True
                except BaseException:
                    self._unmark_unless_paused(name)
                    raise
                return True
            except UnknownDomainError:
                pass
            except VmlendError as e:
                log.error("could not pause %s: %s", name, e, extra={"vm": name})
            return False

    def _unmark_unless_paused(self, name: str) -> bool:
        """Under ``name``'s lock: drop its mark unless it is paused (it runs, or is gone);
        whether it is paused. Kept when the hypervisor cannot say."""
        try:
            paused = self._hv.lookup(name).state is DomainState.PAUSED
        except UnknownDomainError:
            paused = False
        except VmlendError:
            return True  # unknown: the mark stays, the next start-up looks again
        if not paused:
            self._suspended.discard(name)
            if self.marks is not None:
                self.marks.clear(name)
        return paused

    def unmark_unless_paused(self, name: str) -> None:
        """``name`` was found stopped or gone (the recovery's ``unmark``): drop its mark unless
        it is paused by now. Under its lock: started again meanwhile, it may have been paused
        and marked by this agent's watch, and that mark must stay."""
        with self._vm_lock(name):
            self._unmark_unless_paused(name)

    def left_paused(self) -> list[str]:
        """The VMs marked as paused by an agent (this one or one before it) that are still
        paused; the marks of the others (resumed by an operator, or gone) go."""
        if self.marks is None:
            return []
        out = []
        for name in self.marks.names():
            with self._vm_lock(name):
                if self._unmark_unless_paused(name):
                    out.append(name)
        return out

    def paused_by_operator(self, name: str) -> bool:
        """Whether ``name`` is paused by somebody else than an agent: an operator (or libvirt
        itself, e.g. on an I/O error). False where that cannot be told: no marks, marks that
        cannot be read, or a hypervisor that cannot say."""
        return self.whose_pause(name) == OPERATOR

    def whose_pause(self, name: str) -> str:
        """``name``'s state for the agent, from one look at it: ``RUNNING_VM``, ``GONE``,
        ``AGENT`` (paused by this guard, or marked by an agent), ``OPERATOR`` (paused,
        unmarked), ``OTHER`` (shut off, starting) or ``UNKNOWN`` (the hypervisor or the
        marks cannot say)."""
        with self._vm_lock(name):  # a pause of ours marks first, under this lock
            try:
                state = self._hv.lookup(name).state
            except UnknownDomainError:
                return GONE
            except VmlendError:
                return UNKNOWN
            if state is DomainState.RUNNING:
                return RUNNING_VM
            if state is not DomainState.PAUSED:
                return OTHER
            if name in self._suspended:
                return AGENT
            marked = self.marks.read() if self.marks is not None else None
            if marked is None:
                return UNKNOWN
            return AGENT if name in marked else OPERATOR

    def running(self, name: str) -> bool:
        try:
            return self._hv.lookup(name).state is DomainState.RUNNING
        except VmlendError:
            return False

    def resume_if_paused(self, name: str) -> None:
        """Resume ``name`` if it is paused (it may have stopped, been undefined or been
        resumed meanwhile)."""
        with contextlib.suppress(UnknownDomainError):
            self.resume_and_unmark(name)

    def resume_and_unmark(self, name: str) -> None:
        """Resume ``name`` if it is paused and drop its mark, as one step against a pause of
        it (``UnknownDomainError``: it is gone; its mark goes too)."""
        with self._vm_lock(name):
            try:
                resume_if_paused(self._hv, name)
            except UnknownDomainError:
                self._suspended.discard(name)
                if self.marks is not None:
                    self.marks.clear(name)
                raise
            self._suspended.discard(name)
            if self.marks is not None:
                self.marks.clear(name)

    def resume(
        self,
        names: list[str],
        gate: Callable[[str, Callable[[], None], int], bool],
        generation: int,
        *,
        lacks_holds: Callable[[str], bool] | None = None,
        recover: Callable[[str], None] | None = None,
        hold_back: Callable[[str], None] | None = None,
    ) -> None:
        """Resume ``names`` through ``gate`` (``LeaseWatch.resume_if_fresh``, with the lease
        ``generation`` they were paused under), each on a thread of its own, without waiting:
        the agent's loop calls this after a renewal, and a domain the hypervisor does not
        answer for must not hold up the next renewal. One that ``lacks_holds`` is not
        resumed but handed to ``recover``; one whose holds cannot be read now stays paused,
        handed to ``hold_back`` for the next renewal."""

        def one(name: str) -> None:
            try:
                if lacks_holds is not None and recover is not None:
                    try:
                        missing = lacks_holds(name)
                    except Exception as e:  # unknown: not resumed now, asked again later
                        log.warning("cannot check the holds of %s before resuming it: %s", name, e)
                        if hold_back is not None:
                            hold_back(name)
                        else:
                            recover(name)
                        return
                    if missing:
                        log.error(
                            "VM %s uses devices it does not hold: not resumed, recovered",
                            name,
                            extra={"vm": name},
                        )
                        recover(name)
                        return
                if gate(name, lambda: self.resume_if_paused(name), generation):
                    log.warning("lease renewed: resumed %s", name, extra={"vm": name})
            except VmlendError as e:
                log.error("could not resume %s: %s", name, e, extra={"vm": name})
            except Exception:  # a thread of its own: nobody else would see it
                log.exception("resuming %s failed", name)

        for name in names:
            threading.Thread(target=one, args=(name,), name=f"resume-{name}", daemon=True).start()


def resume_if_paused(hv: Hypervisor, name: str) -> None:
    """Resume ``name`` if it is paused (``UnknownDomainError``: it is gone)."""
    if hv.lookup(name).state is DomainState.PAUSED:
        hv.resume(name)
