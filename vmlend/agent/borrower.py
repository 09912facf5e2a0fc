"""The borrower side of the agent: the table of this host's VMs with remote devices, one worker
each (``vmlend.agent.guest``), and how VMs come into it.

A VM comes into the table three ways, none of which waits for another VM:
- its prepare hook, served by this agent, announces it (``announce``) before QEMU starts: the
  guard knows a VM started while a listing of the domains would hang behind another domain's
  hook (libvirt lists a domain under its lock, and a hook holds it);
- the census, a thread of its own, lists the domains every ``period`` (a listing held up by one
  domain holds up only the census);
- at start-up, the census's first listing and the pause marks a previous agent left.

``NoBorrower`` is the side of a host without a hypervisor (``vmlend agent`` without
``--connect``: a lender only): it guards nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from vmlend.agent.clock import LeaseClock
from vmlend.agent.guest import Changed, Guest, GuestSettings, VmState
from vmlend.agent.pause_marks import PauseMarks
from vmlend.agent.recover import VmRecovery
from vmlend.errors import VmlendError
from vmlend.fabric.base import Fabric
from vmlend.hook.domainview import read_hook_domain
from vmlend.hypervisor.base import DomainState, Hypervisor

log = logging.getLogger(__name__)


class Borrower(Protocol):
    def start(self) -> None: ...

    def guards(self, xml: bytes) -> bool: ...

    def announce(self, name: str) -> None: ...

    def submit(self, name: str, job: Callable[[Hypervisor, Fabric], Any]) -> Future[Any]: ...

    def paused_count(self) -> int: ...

    def report(self, stuck_after: float) -> list[str]: ...

    def settle(self, timeout: float) -> bool: ...

    def stop(self) -> None: ...


class NoBorrower:
    """A host that guards no VM."""

    def start(self) -> None:
        pass

    def guards(self, xml: bytes) -> bool:
        return False

    def announce(self, name: str) -> None:
        pass

    def submit(self, name: str, job: Callable[[Hypervisor, Fabric], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        future.set_exception(VmlendError(f"this agent guards no VM (no --connect): {name}"))
        return future

    def paused_count(self) -> int:
        return 0

    def report(self, stuck_after: float) -> list[str]:
        return []

    def settle(self, timeout: float) -> bool:
        return True

    def stop(self) -> None:
        pass


class GuestTable:
    """This host's VMs with remote devices, each with its worker."""

    def __init__(
        self,
        hv: Hypervisor,
        clock: LeaseClock,
        open_fabric: Callable[[], Fabric],
        *,
        node: str,
        lenders: dict[int, str],
        marks: PauseMarks | None,
        settings: GuestSettings,
        changed: Changed | None = None,
        recovered: Callable[[VmRecovery], None] = lambda _r: None,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self._hv = hv
        self._clock = clock
        self._open_fabric = open_fabric
        self._node = node
        #: Which node lends each device: read once, since when the guard acts the registry
        #: is exactly what may not answer.
        self._lenders = lenders
        self._marks = marks
        self._settings = settings
        self._changed = changed or _say_change
        self._recovered = recovered
        self._now = now
        self._lock = threading.Lock()
        self._guests: dict[str, Guest] = {}
        self._stop = threading.Event()
        self._census_thread: threading.Thread | None = None
        self._censused = threading.Event()
        #: Stuck calls already reported (vm, what, since): each is said once.
        self._said: set[tuple[str, str, float]] = set()

    # --- the table ----------------------------------------------------------------------------
    def guests(self) -> list[Guest]:
        with self._lock:
            return list(self._guests.values())

    def guest(self, name: str) -> Guest | None:
        with self._lock:
            return self._guests.get(name)

    def _ensure(self, name: str, state: VmState) -> Guest:
        """The worker of ``name``, started in ``state`` if it has none (or one that ended)."""
        with self._lock:
            g = self._guests.get(name)
            if g is not None and g.state is not VmState.GONE:
                return g
            g = Guest(
                name,
                state,
                hv=self._hv,
                clock=self._clock,
                open_fabric=self._open_fabric,
                marks=self._marks,
                settings=self._settings,
                changed=self._changed,
                recovered=self._recovered,
                now=self._now,
            )
            self._guests[name] = g
        log.info("VM %s: guarded (%s)", name, state.value)
        g.start()
        return g

    def announce(self, name: str) -> None:
        """``name``'s prepare hook ran here: guard it from its start on."""
        self._ensure(name, VmState.STARTING).poke()

    def submit(self, name: str, job: Callable[[Hypervisor, Fabric], Any]) -> Future[Any]:
        g = self.guest(name)
        if g is None or g.state is VmState.GONE:
            g = self._ensure(name, VmState.STARTING)
        return g.submit(job)

    def paused_count(self) -> int:
        return sum(g.state is VmState.PAUSED for g in self.guests())

    # --- the census ---------------------------------------------------------------------------
    def census(self) -> list[str]:
        """List the domains; guard each running or paused one that uses a remote device (its
        state on entry: running, paused by an agent if marked, else by somebody else). The
        names guarded."""
        marked = set(self._marks.names()) if self._marks is not None else set()
        found = []
        for info in self._hv.list_domains():
            if info.state not in (DomainState.RUNNING, DomainState.PAUSED):
                continue
            try:
                if not self._uses_remote_devices(info.name):
                    continue
            except VmlendError:  # stopped meanwhile, or its XML unreadable: not known
                continue
            found.append(info.name)
            if info.state is DomainState.RUNNING:
                state = VmState.RUNNING
            else:
                state = VmState.PAUSED if info.name in marked else VmState.KEPT
            self._ensure(info.name, state).poke()
        self._censused.set()
        return found

    def _uses_remote_devices(self, name: str) -> bool:
        return self.guards(self._hv.xml(name))

    def guards(self, xml: bytes) -> bool:
        """Whether a VM with this domain XML is one to guard: it uses a device another node
        lends (a VM using only this node's own devices keeps running whatever the lease)."""
        try:
            dom = read_hook_domain(xml, strict=False)
        except VmlendError:
            return False
        if dom is None:
            return False
        return any(self._lenders.get(d.fdid, "") != self._node for d in dom.devices)

    def start(self) -> None:
        """The first census at once, then one every period on a thread of its own."""

        def run() -> None:
            while True:
                try:
                    self.census()
                except Exception as e:  # the next census may do better; the workers go on
                    log.warning("census of the VMs with remote devices failed: %s", e)
                if self._stop.wait(self._settings.period):
                    return

        self._census_thread = threading.Thread(target=run, name="vm-census", daemon=True)
        self._census_thread.start()

    def settle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the first census and for every worker to be quiet (its
        VM running or paused with its devices its own, or trouble said): whether they were
        (the start-up reconcile runs after)."""
        deadline = time.monotonic() + timeout
        if not self._censused.wait(timeout):
            return False
        while time.monotonic() < deadline:
            view = self._clock.view()
            if all(g.turns > 0 and g.quiet(view) for g in self.guests()):
                return True
            time.sleep(0.05)
        return False

    def report(self, stuck_after: float) -> list[str]:
        """The VMs whose hypervisor call has not come back for ``stuck_after`` seconds, each
        said once in the log (the other VMs are not held up by it)."""
        now = self._now()
        out = []
        for g in self.guests():
            busy = g.busy
            if busy is None or now - busy[1] < stuck_after:
                continue
            what, since = busy
            out.append(f"{g.name}: '{what}' has not come back for {now - since:.1f} s")
            key = (g.name, what, since)
            if key not in self._said:
                self._said.add(key)
                log.warning(
                    "VM %s: the hypervisor has not answered '%s' for %.1f s; it is tried again"
                    " once it does, and no other VM waits for it",
                    g.name,
                    what,
                    now - since,
                    extra={"vm": g.name},
                )
        return out

    def stop(self) -> None:
        self._stop.set()
        for g in self.guests():
            g.stop(timeout=1.0)


def _say_change(vm: str, before: VmState, after: VmState, why: str) -> None:
    level = logging.WARNING if after is VmState.PAUSED else logging.INFO
    log.log(level, "VM %s: %s -> %s: %s", vm, before.value, after.value, why, extra={"vm": vm})
