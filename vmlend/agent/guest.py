"""One VM with remote devices, guarded by a worker of its own: the owner of the VM's state.

Every hypervisor call the agent makes for a VM is made here, on this VM's thread, one at a
time: a domain the hypervisor does not answer for holds up only its own worker (reported as
stuck by the borrower), never the renewals nor the other VMs. The worker is level-triggered:
each time it wakes (the lease clock changed, half the TTL passed, the census or a hook saw the
VM, a plug request came, or a period passed) it looks at the lease and at the VM and does the
one thing the table below says, then waits again.

=========  ==================  ====================  =========================================
state      lease settled?      the hypervisor says   the worker
=========  ==================  ====================  =========================================
any        -                   gone, shut off        clears its pause mark: GONE (the worker
                                                     ends)
RUNNING    no                  running               marks it, suspends it: PAUSED
RUNNING    yes, verified       running               nothing
RUNNING    yes, not verified   running               reads its holds: all its own: verified;
                                                     else marks and suspends it: PAUSED
RUNNING    -                   paused                somebody else paused it: KEPT
PAUSED     no                  paused                nothing
PAUSED     yes                 paused                wins its devices back (re-reserves them,
                                                     or unplugs those it lost), resumes it:
                                                     RUNNING (verified); when that cannot be
                                                     done yet it stays PAUSED and says why
PAUSED     -                   running               somebody resumed it: RUNNING (its
                                                     pause mark cleared)
KEPT       yes, not verified   paused                wins its devices back, leaves it paused
KEPT       -                   running               somebody resumed it: RUNNING
STARTING   -                   running / paused      as RUNNING / KEPT
STARTING   -                   shut off, unknown     waits for its start (announced by its
                                                     prepare hook), up to ``START_WAIT``
=========  ==================  ====================  =========================================

"Settled": the host's lease is held with more than half its TTL left and this host's records
are on it (``LeaseView.settled``), read after the look at the VM (a look that hung must not be
judged by the lease as it was before). "Verified": the VM's devices were read as its own under
the current lease (``generation``); holds end only with a lease, so a VM that ran through a
lease change (a late resume, a hot-plug landing after the lease was lost, an operator's
resume) is not, and is looked at before it may go on running.

PAUSED is the agent's pause and is marked on disk first (``PauseMarks``), so that the next
agent resumes it if this one dies. KEPT is anybody else's pause (an operator's, libvirt's own):
never resumed by the agent, but its devices are re-reserved or unplugged after a lease change,
since the operator's resume runs no hook and nobody would check them then.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, NamedTuple

from vmlend.agent.clock import LeaseClock, LeaseView
from vmlend.agent.pause_marks import PauseMarks
from vmlend.agent.recover import VmRecovery, WinBack, unheld
from vmlend.errors import StateError, UnknownDomainError, VmlendError
from vmlend.fabric.base import Fabric
from vmlend.hypervisor.base import DomainState, Hypervisor
from vmlend.registry.etcd_gateway import call_deadline
from vmlend.topology.model import format_fdid

log = logging.getLogger(__name__)

#: How long a VM announced by its prepare hook may take to start before it is forgotten.
START_WAIT = 120.0


class VmState(enum.StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    KEPT = "kept"
    GONE = "gone"


class Look(enum.Enum):
    """What the hypervisor says of the VM."""

    RUNNING = "running"
    PAUSED = "paused"
    OFF = "off"  # defined, not running
    GONE = "gone"  # unknown to the hypervisor


class GuestSettings(NamedTuple):
    #: The longest a worker sleeps without a reason to wake.
    period: float
    #: How long a win-back waits for a fenced device to be taken back by its lender.
    fence_wait: float
    #: Pause between tries while waiting for a fence.
    interval: float


#: Told of every state change: (vm, before, after, why).
Changed = Callable[[str, VmState, VmState, str], None]


class Guest:
    """The worker of VM ``name`` (``start``, ``stop``)."""

    def __init__(
        self,
        name: str,
        state: VmState,
        *,
        hv: Hypervisor,
        clock: LeaseClock,
        open_fabric: Callable[[], Fabric],
        marks: PauseMarks | None,
        settings: GuestSettings,
        changed: Changed = lambda *_a: None,
        recovered: Callable[[VmRecovery], None] = lambda _r: None,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.state = state
        #: The lease generation under which the VM's devices were last read as its own.
        self.verified = -1
        #: What went wrong last (cleared when things go right): why it stays as it is.
        self.trouble = ""
        #: The hypervisor call in flight and since when (for the stuck report).
        self.busy: tuple[str, float] | None = None
        #: Turns taken (the start-up waits for every worker's first).
        self.turns = 0
        self._hv = hv
        self._clock = clock
        self._open_fabric = open_fabric
        self._fabric: Fabric | None = None
        self._marks = marks
        self._settings = settings
        self._changed = changed
        self._recovered = recovered
        self._now = now
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._jobs: deque[tuple[Callable[[Hypervisor, Fabric], Any], Future[Any]]] = deque()
        self._jobs_lock = threading.Lock()
        self._closed = False  # no job is taken any more
        self._born = now()
        #: Reads of the registry for a running VM, which a pause must not wait for.
        self._reader: ThreadPoolExecutor | None = None
        self._read_fabric: Fabric | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._clock.listen(self._wake)
        self._thread = threading.Thread(target=self._run, name=f"vm-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def gone(self) -> bool:
        return self.state is VmState.GONE

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def quiet(self, view: LeaseView) -> bool:
        """Whether the worker has nothing left to do under ``view`` (or cannot do it now: its
        trouble says why): the start-up reconcile waits for every worker to be quiet."""
        if self.state is VmState.GONE or self.trouble or self.busy is not None:
            return self.busy is None
        if not view.settled:
            return self.state in (VmState.PAUSED, VmState.KEPT)
        return self.state in (VmState.RUNNING, VmState.KEPT) and self.verified == view.generation

    def poke(self) -> None:
        """Look again now."""
        self._wake.set()

    def submit(self, job: Callable[[Hypervisor, Fabric], Any]) -> Future[Any]:
        """Run ``job(hv, fabric)`` on this VM's thread at its next turn with the lease settled
        (a plug request's hot-plugs: nothing else acts on the VM meanwhile); what it plugged
        is verified like anything else the VM uses. Fails when the agent stops first."""
        future: Future[Any] = Future()
        with self._jobs_lock:
            if self._closed:
                future.set_exception(StateError(f"VM {self.name}: its worker has ended"))
                return future
            self._jobs.append((job, future))
        self._wake.set()
        return future

    # --- the loop -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.clear()
                try:
                    self.step()
                except Exception as e:  # the worker must outlive one bad turn: it is the guard
                    self.trouble = f"{type(e).__name__}: {e}"
                    log.exception("VM %s: a turn of its worker failed", self.name)
                self.turns += 1
                if self.gone:
                    break
                view = self._clock.view()
                self._wake.wait(max(0.0, min(self._settings.period, view.until_doubt)))
        finally:
            self._clock.unlisten(self._wake)
            self._fail_jobs("the VM is gone" if self.state is VmState.GONE else "the agent stops")
            if self._reader is not None:
                self._reader.submit(self._close_read_fabric)
                self._reader.shutdown(wait=False)
            if self._fabric is not None:
                with contextlib.suppress(Exception):
                    self._fabric.close()

    def step(self) -> None:
        """One turn: look at the VM, then at the lease (a look that took long must not be
        judged by the lease as it was before it), and do what the table says."""
        look = self._look()
        if look is None:
            return  # the hypervisor cannot say: nothing done, looked at again
        view = self._clock.view()
        if view.settled and self._jobs:
            self._run_jobs(view)  # a plug request (it refuses a VM that does not run here)
        if look in (Look.GONE, Look.OFF):
            if self.state is VmState.STARTING and self._now() - self._born < START_WAIT:
                return  # its start is under way
            self._forget(look)
            return
        if look is Look.RUNNING:
            if self.state is not VmState.RUNNING:
                if self.state is VmState.PAUSED and self._marks is not None:
                    self._marks.clear(self.name)  # it runs: no pause of ours to remember
                self._set(VmState.RUNNING, "it runs (resumed by somebody else, or started)")
            if not view.settled:
                self._pause(f"the lease is {self._lease_words(view)}")
            elif self.verified != view.generation:
                self._verify(view)
            return
        # paused
        if self.state in (VmState.RUNNING, VmState.STARTING):
            self._set(VmState.KEPT, "somebody else paused it")
        elif self.state is VmState.PAUSED and self._marks is not None:
            self._marks.mark(self.name)  # one a previous agent paused keeps its mark
        if not view.settled:
            return
        if self.state is VmState.PAUSED:
            self._win_back(view, leave_paused=False)
        elif self.state is VmState.KEPT and self.verified != view.generation:
            self._win_back(view, leave_paused=True)

    # --- what a turn does ---------------------------------------------------------------------
    def _look(self) -> Look | None:
        try:
            info = self._call("look up", lambda: self._hv.lookup(self.name))
        except UnknownDomainError:
            return Look.GONE
        except VmlendError as e:
            self._say_trouble(f"the hypervisor cannot say how it is: {e}")
            return None
        if info.state is DomainState.RUNNING:
            return Look.RUNNING
        if info.state is DomainState.PAUSED:
            return Look.PAUSED
        return Look.OFF

    def _pause(self, why: str) -> None:
        """Mark first (an agent killed after the suspend still knows it was its pause), then
        suspend. A suspend that failed but left the VM paused (its answer was lost) counts as
        done; one that did not is tried again on the next turn."""
        if self._marks is not None:
            self._marks.mark(self.name)
        try:
            self._call("suspend", lambda: self._hv.suspend(self.name))
        except UnknownDomainError:
            self._forget(Look.GONE)
            return
        except VmlendError as e:
            look = self._look()
            if look is not Look.PAUSED:
                if look is not None and self._marks is not None:
                    self._marks.clear(self.name)  # it runs (or is gone): no pause of ours
                self._say_trouble(f"could not pause it: {e}")
                return
        self.trouble = ""
        if self._clock.events is not None:
            self._clock.events.note("pause", vm=self.name)
        self._set(VmState.PAUSED, why)

    def _verify(self, view: LeaseView) -> None:
        """A running VM not verified under this lease: its devices must all be its own, or it
        is paused to win them back. The registry is read on a thread of its own, which this
        worker leaves behind the moment the lease comes in doubt: the pause must not wait for
        a registry that does not answer (opening a connection included)."""
        try:
            missing = self._read(lambda fabric: unheld(self._hv, fabric, self.name), view)
        except UnknownDomainError:
            self._forget(Look.GONE)
            return
        except VmlendError as e:
            self._say_trouble(f"cannot read its holds: {e}")
            return
        if missing is None:
            return  # the lease came in doubt meanwhile: the next turn pauses it
        if missing:
            names = ", ".join(format_fdid(f) for f in missing)
            self._pause(f"it uses {names} without holding it under lease {view.lease:x}")
            return
        if self._clock.view()[:3] == view[:3]:
            self.verified = view.generation
            self.trouble = ""

    def _win_back(self, view: LeaseView, *, leave_paused: bool) -> None:
        def in_time() -> bool:
            now = self._clock.view()
            return now.settled and now.generation == view.generation

        fabric = self._ensure_fabric()
        limit(fabric, call_deadline(view.ttl))
        win = WinBack(
            self._hv,
            fabric,
            fence_wait=self._settings.fence_wait,
            interval=self._settings.interval,
            in_time=in_time,
        )
        self.busy = ("win back its devices", self._now())
        try:
            result = win.run(self.name, leave_paused=leave_paused)
        finally:
            self.busy = None
        if result.outcome == "stopped":
            self._recovered(result)
            self._forget(Look.OFF)
            return
        if result.outcome == "paused":
            self._say_trouble(result.describe())
            return
        if leave_paused:
            self.verified = view.generation
            self.trouble = ""
            self._recovered(result)
            log.info("after a lease change: %s", result.describe())
            return
        decided = time.time()  # at the latest when the lease's freshness was read
        if not in_time():
            return  # the next turn, under the next lease
        self.verified = view.generation
        try:
            self._call("resume", lambda: self._hv.resume(self.name))
        except UnknownDomainError:
            self._forget(Look.GONE)
            return
        except VmlendError as e:
            self._say_trouble(f"could not resume it: {e}")
            return
        if self._marks is not None:
            self._marks.clear(self.name)
        if self._clock.events is not None:
            self._clock.events.note("resume", vm=self.name, decided=decided)
        self.trouble = ""
        self._recovered(result)
        self._set(VmState.RUNNING, result.describe().removeprefix(f"VM {self.name}: "))

    def _run_jobs(self, view: LeaseView) -> None:
        limit(self._ensure_fabric(), call_deadline(view.ttl))
        while self._jobs and self._clock.view()[:3] == view[:3]:
            with self._jobs_lock:
                job, future = self._jobs.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job(self._hv, self._ensure_fabric()))
            except BaseException as e:
                future.set_exception(e)
            # what it plugged is held under this lease; a lease lost meanwhile is the next
            # turn's (the VM is not verified under the next generation)

    def _fail_jobs(self, why: str) -> None:
        with self._jobs_lock:
            self._closed = True
            jobs, self._jobs = list(self._jobs), deque()
        for _job, future in jobs:
            if future.set_running_or_notify_cancel():
                future.set_exception(StateError(f"VM {self.name}: {why}"))

    def _forget(self, look: Look) -> None:
        if self._marks is not None:
            self._marks.clear(self.name)
        why = "it is gone" if look is Look.GONE else "it stopped"
        self._set(VmState.GONE, why)

    def _read(self, read: Callable[[Fabric], Any], view: LeaseView) -> Any:
        """``read(fabric)`` on this VM's reader thread; None when the lease stops being
        settled before it is done (it goes on there; the next read waits for it)."""
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix=f"vm-{self.name}-reads")

        def run() -> Any:  # on the reader thread, with a fabric of its own
            if self._read_fabric is None:
                self._read_fabric = self._open_fabric()
            limit(self._read_fabric, call_deadline(view.ttl))
            return read(self._read_fabric)

        future = self._reader.submit(run)
        while True:
            try:
                return future.result(timeout=max(0.01, min(0.2, self._clock.view().until_doubt)))
            except FutureTimeout:
                now = self._clock.view()
                if not now.settled or now[:3] != view[:3] or self._stop.is_set():
                    return None

    def _close_read_fabric(self) -> None:
        if self._read_fabric is not None:
            with contextlib.suppress(Exception):
                self._read_fabric.close()

    # --- helpers ------------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        self.busy = (what, self._now())
        try:
            return fn()
        finally:
            self.busy = None

    def _ensure_fabric(self) -> Fabric:
        if self._fabric is None:
            self._fabric = self._open_fabric()
        return self._fabric

    def _set(self, state: VmState, why: str) -> None:
        before, self.state = self.state, state
        if before is not state:
            self._changed(self.name, before, state, why)

    def _say_trouble(self, trouble: str) -> None:
        if trouble != self.trouble:
            log.warning("VM %s: %s", self.name, trouble, extra={"vm": self.name})
        self.trouble = trouble

    @staticmethod
    def _lease_words(view: LeaseView) -> str:
        if view.state.value == "lost":
            return "lost"
        if view.state.value == "held":
            return "new: this host's records are not on it yet"
        left = max(0.0, view.left)
        return f"in doubt ({left:.1f} s of {view.ttl:g} s left)"


def limit(fabric: Fabric, seconds: float) -> None:
    """Bound each registry request of ``fabric`` by ``seconds`` (at least 0.1 s), where its
    registry has a request timeout (etcd's gateway)."""
    gateway = getattr(getattr(fabric, "registry", None), "gateway", None)
    set_timeout = getattr(gateway, "set_timeout", None)
    if set_timeout is not None and seconds < float("inf"):
        set_timeout(max(0.1, seconds))
