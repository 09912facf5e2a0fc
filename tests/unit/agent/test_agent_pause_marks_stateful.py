"""The agent's pause marks (``pause_marks``) explored across agent deaths (hypothesis' rule-based
state machine): what ``test_pause_marks.py`` and the start-up example in ``test_agent_watch.py``
pin, over the interleavings of the agent's threads at its hypervisor calls, with hypervisor
calls that fail, operators who pause and resume, VMs that stop, start and go, and an agent
killed at any of those calls.

Real: ``RemoteVmGuard`` (``pause``, ``pause_these``, ``suspend_if_running``, ``resume``,
``resume_and_unmark``, ``left_paused``, ``running``), ``PauseMarks`` on a directory of the
test's own, and ``LostLeaseRecovery``, wired to the guard as ``Agent._run`` wires it, over a
fake fabric whose reserve wins the device, loses it (the recovery hot-unplugs it), finds the
registry away (tried again) or the lease ended (parked for the next lease).

Stand-ins, for the lease watch (``LeaseWatch``, explored by ``test_agent_watch_stateful.py``):
the agent's *hands*, the names it will resume itself. A pause by the watch (``guard.pause``)
hands what it paused to a renewal; a renewal resumes them through ``guard.resume`` with a gate
that stands in for ``resume_if_fresh`` (refused while the lease is in doubt; a resume that
failed, or whose VM the watch pauses again because a doubt began meanwhile, stays for the next
renewal). The loop's pause of the VMs without their holds (``Agent._without_holds``:
``pause_these``, then an orphan for one that still runs), the start-up (``left_paused``, as
``Agent._serve`` calls it) and the loop's orphans (paused again, then recovered) hand theirs
to the recovery; the recovery hands back what it retries or parks, gives to a renewal what its
gate refuses, and gives up on the rest (logged; the VM stays paused, its mark kept).

Each guard call runs on a thread of its own, and so do the threads the guard starts itself
(``guard.threading`` is replaced by ``_GuardThreading`` while a machine runs, which also makes
its per-VM locks the machine's). The threads run one at a time, in a set order (``_Scheduler``:
hypothesis must see the same run for the same steps). With ``slow``, every hypervisor call of
such a thread stops until a ``land`` step (``early``: its effect is done as it stops, only the
answer waits); a step ends once every thread is stopped in a call, waits for a VM's lock or a
thread it joins, or is done. The agent is killed at such a point: its stopped calls end there
(before or after their effect), its other threads at their next hypervisor call, and the marks
stay on disk for the next agent. Nothing sleeps, nothing is timed.

The model hypervisor has three VMs with one remote device each: running, paused, shut off or
gone (undefined), and a failure to inject per call and VM: a lookup, listing, XML read or
detach that raises ``LibvirtError``; a suspend or resume that raises before its effect, or
after it (its answer lost). Like libvirt's, a suspend of a paused VM and a resume of a running
one do nothing.

After every step:

1. once the current agent's start-up has looked, every VM some agent paused (and nobody
   resumed since) that no thread is in a call for is in the agent's hands, or given up by the
   recovery with a log line: never left paused for good, silently;
2. no agent resumes a VM an operator paused while the VM had no mark and no agent's pause of
   it was under way (with either, the hypervisor cannot tell that pause from the agent's, and
   an agent may resume it: a mark left by a VM the operator resumed, or that stopped, until
   the next start-up looks; not checked, counted as an event);
3. every VM an agent paused (and nobody resumed since) has its mark, whatever thread is where:
   an agent killed now leaves its successor what it needs;
4. a mark is of a paused VM, or of one a thread is in a call for, or of one whose mark went
   stale in a way the design allows until the next look (an operator's resume, the VM stopped
   or gone, a lookup that failed, a resume whose answer was lost, an agent killed mid-call);
   a suspend that failed on a VM the guard then saw running leaves no mark. A start-up with
   nothing under way and no failure drops every mark but those of paused VMs, and hands
   exactly those to the recovery.

Left out: the lease watch's own bookkeeping (see above), the holds themselves (a recovery's
fabric outcome is drawn, not derived from the leases), the census thread (``pause`` takes its
own census), and marks that cannot be written (an unsafe directory: logged, tested in
``test_pause_marks.py``).

A rule whose moment has not come (nothing to renew, no agent to kill) does nothing, rather
than wait for a precondition: hypothesis drew the rules with preconditions (the agent's) far
less often than the others here.

CI runs a few derandomized sequences (the same every run) and replays what the machine found
(the tests at the end); ``VMLEND_MARKS_STATEFUL_EXAMPLES`` and ``VMLEND_MARKS_STATEFUL_STEPS``
explore more.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar, cast
from unittest import mock

from hypothesis import currently_in_test_context, event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import vmlend.agent.guard as guard_module
from tests.support.clocks import FakeClock
from tests.support.simcluster import domain_of
from tests.support.stateful import derandomized, replay
from vmlend.agent.guard import RemoteVmGuard
from vmlend.agent.pause_marks import PauseMarks
from vmlend.agent.recover import LostLeaseRecovery
from vmlend.errors import (
    DeviceHeldError,
    DomainStateError,
    LeaseExpiredError,
    LibvirtError,
    RegistryUnreachableError,
    UnknownDomainError,
)
from vmlend.fabric.base import Fabric
from vmlend.hypervisor.base import DomainInfo, DomainState, Hypervisor
from vmlend.topology.model import Holder

T = TypeVar("T")

EXAMPLES = int(os.environ.get("VMLEND_MARKS_STATEFUL_EXAMPLES", "40"))
STEPS = int(os.environ.get("VMLEND_MARKS_STATEFUL_STEPS", "40"))

NODE = "gamma"
GPU = 0x10  # lent by another node (the fake topology knows no lender): remote here
VMS = ("a", "b", "c")
UUIDS = {v: f"00000000-0000-4000-8000-{n:012x}" for n, v in enumerate(VMS, 1)}
XMLS = {v: domain_of(v, UUIDS[v], (GPU,)) for v in VMS}
#: A bounded real-time wait for a thread to reach its next stop (it is a failure to exceed).
WAIT = 10.0

RUNNING, PAUSED, STOPPED, GONE = "running", "paused", "stopped", "gone"
#: The hypervisor calls a failure can be injected into ("list" is for no VM in particular).
CALLS = ("lookup", "suspend", "resume", "xml", "detach", "list")
#: The agent's hands: the watch's paused (for the next renewal), a renewal's resume
#: threads', the recovery's (to recover: orphans, parked, left paused) and its VM under way.
HANDS = PAUSED_BY_WATCH, RESUMING, RECOVERY, RECOVERING = (
    "paused by the watch",
    "resuming",
    "recovery",
    "recovering",
)

_here = threading.local()


class _Killed(BaseException):
    """The agent was killed: its thread ends here (no ``except Exception`` stops it)."""


_events: list[str] = []
_events_lock = threading.Lock()


def _event(text: str) -> None:
    """Counted in hypothesis' statistics (``--hypothesis-show-statistics``): what was reached.
    Hypothesis counts events on the test's thread only: the agent's threads' wait for the
    step's end (``_flush_events``)."""
    if threading.current_thread() is threading.main_thread():
        if currently_in_test_context():
            event(text)
    else:
        with _events_lock:
            _events.append(text)


def _flush_events() -> None:
    with _events_lock:
        texts = list(_events)
        _events.clear()
    for text in texts:
        _event(text)


class _Scheduler:
    """Runs the agent's threads one at a time, in a set order: hypothesis must see the same
    run for the same steps. A thread runs until it stops in a hypervisor call, waits for a
    lock or a thread, or is done; then the first thread (in the order they began) that can go
    on does. The guard's code between two such points runs as one piece, as it may for real;
    the interleavings that matter are at the hypervisor calls, where ``land`` picks which
    stopped call goes on."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.actors: list[_Actor] = []
        #: The thread whose turn it is, if any.
        self.turn: _Actor | None = None

    def _schedule(self) -> None:
        """Under ``cond``: the turn to the first thread that can go on, if nobody has it."""
        if self.turn is None or self.turn.done or self.turn.blocked():
            self.turn = next((a for a in self.actors if not a.done and not a.blocked()), None)
        self.cond.notify_all()

    def add(self, actor: _Actor) -> None:
        with self.cond:
            self.actors.append(actor)
            self._schedule()
        actor.thread.start()

    def wait_turn(self, actor: _Actor, what: str) -> None:
        """Under ``cond``, with ``actor`` blocked (or new): the turn to another, until
        ``actor`` can go on and its turn comes."""
        self._schedule()
        if not self.cond.wait_for(lambda: self.turn is actor, WAIT):
            raise AssertionError(f"{actor.label}: never went on from {what}")

    def changed(self) -> None:
        with self.cond:
            self._schedule()

    def settle(self) -> None:
        """Until no thread can go on."""
        with self.cond:
            self._schedule()
            if not self.cond.wait_for(lambda: self.turn is None, WAIT):
                raise AssertionError(f"the threads never settled: {self.actors}")


class _Actor:
    """One thread of the agent, stepped: with ``slow``, each hypervisor call it makes stops
    until ``land`` (``early``: its effect is done as it stops, only the answer waits)."""

    def __init__(
        self,
        scheduler: _Scheduler,
        label: str,
        body: Callable[[], object],
        *,
        slow: bool = False,
        early: bool = False,
        pauses: bool = False,
        killed: bool = False,
        parent: _Actor | None = None,
    ) -> None:
        self.label = label
        self.slow = slow
        self.early = early
        #: It may pause a VM: one it saw running is claimed (invariant 2).
        self.pauses = pauses
        self.killed = killed
        #: The thread that started this one (``_GuardThreading``): what this one did is part
        #: of what that one does, until that one is done too.
        self.parent = parent
        self._scheduler = scheduler
        self._body = body
        #: The call it stopped in, if it did, and whether it may go on.
        self.at: str | None = None
        self.go = False
        #: The lock it waits for, and the thread it joins, if it does.
        self.waiting: _SeenLock | None = None
        self.joining: _Actor | None = None
        self.done = False
        self.failure: BaseException | None = None
        #: The VMs it made a call for: not at a quiet point until it is done.
        self.touched: set[str] = set()
        #: The VMs it looked up and found running: a pause of them may be under way.
        self.saw_running: set[str] = set()
        #: The failures it ran into, (call, VM).
        self.consumed: list[tuple[str, str]] = []
        self.thread = threading.Thread(target=self._run, name=f"actor-{label}", daemon=True)

    def blocked(self) -> bool:
        """Under the scheduler's condition: it cannot go on now."""
        return (
            (self.at is not None and not self.go)
            or (self.waiting is not None and self.waiting.blocks(self))
            or (self.joining is not None and not self.joining.done)
        )

    def _run(self) -> None:
        _here.actor = self
        cond = self._scheduler.cond
        try:
            with cond:
                self._scheduler.wait_turn(self, "its start")
            self._body()
        except _Killed:
            pass
        except BaseException as e:  # reported by the machine
            self.failure = e
        finally:
            with cond:
                if self.parent is not None:
                    self.parent.touched |= self.touched
                self.done = True
                self._scheduler._schedule()

    def call(self, what: str, vm: str | None, effect: Callable[[], Callable[[], T]]) -> T:
        """A hypervisor call from this thread: ``effect()`` changes the model and gives the
        answer (which returns or raises)."""
        if self.killed:
            raise _Killed
        if vm is not None:
            self.touched.add(vm)
        if self.slow and not self.early:
            self._stop(what)
        answer = effect()
        if self.slow and self.early:
            self._stop(what)
        return answer()

    def _stop(self, what: str) -> None:
        with self._scheduler.cond:
            self.at = what
            self._scheduler.wait_turn(self, what)
            self.go = False
            self.at = None
            if self.killed:
                raise _Killed

    def land(self) -> None:
        """Under the scheduler's condition."""
        assert self.at is not None
        self.go = True

    def __repr__(self) -> str:
        where = "done" if self.done else self.at or "running"
        if self.waiting is not None:
            where = "waits for a lock"
        if self.joining is not None:
            where = f"joins {self.joining.label}"
        return f"<{self.label}: {where}>"


def _current() -> _Actor | None:
    actor = getattr(_here, "actor", None)
    return actor if isinstance(actor, _Actor) else None


class _SeenLock:
    """The guard's per-VM lock (and the lock of its locks) for the scheduler: handed over
    first come, first served."""

    def __init__(self, scheduler: _Scheduler) -> None:
        self._scheduler = scheduler
        self.holder: _Actor | None = None
        self._queue: list[_Actor] = []

    def blocks(self, who: _Actor) -> bool:
        """Under the scheduler's condition: whether ``who``, waiting, cannot take it now."""
        return self.holder is not None or self._queue[0] is not who

    def acquire(self) -> bool:
        me = _current()
        assert me is not None, "the guard's lock taken off the machine's threads"
        with self._scheduler.cond:
            if self.holder is not None or self._queue:
                self._queue.append(me)
                me.waiting = self
                try:
                    self._scheduler.wait_turn(me, "a lock")
                finally:
                    self._queue.remove(me)
                    me.waiting = None
            self.holder = me
            return True

    def release(self) -> None:
        with self._scheduler.cond:
            self.holder = None

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class _GuardThreading:
    """Stands in for ``threading`` in ``vmlend.agent.guard`` while a machine runs: the threads
    the guard starts (one per VM ``pause`` suspends, one per VM ``resume`` resumes) become the
    machine's, stepped like the one that started them; its locks are the scheduler's."""

    Event = threading.Event

    def __init__(self, scheduler: _Scheduler) -> None:
        self._scheduler = scheduler

    def Lock(self) -> _SeenLock:  # the names ``threading`` gives them
        return _SeenLock(self._scheduler)

    def Thread(
        self,
        target: Callable[..., object],
        args: tuple[object, ...] = (),
        name: str | None = None,
        daemon: bool | None = None,
    ) -> _Thread:
        return _Thread(self._scheduler, target, args, name or "guard-thread")


class _Thread:
    def __init__(
        self,
        scheduler: _Scheduler,
        target: Callable[..., object],
        args: tuple[object, ...],
        name: str,
    ) -> None:
        self._scheduler = scheduler
        parent = _current()
        assert parent is not None, "a guard's thread started off the machine's threads"
        self.actor = _Actor(
            scheduler,
            name,
            lambda: target(*args),
            slow=parent.slow,
            early=parent.early,
            pauses=parent.pauses,
            killed=parent.killed,
            parent=parent,
        )

    def start(self) -> None:
        self._scheduler.add(self.actor)

    def join(self, timeout: float | None = None) -> None:
        me = _current()
        assert me is not None
        with self._scheduler.cond:
            if self.actor.done:
                return
            me.joining = self.actor
            try:
                self._scheduler.wait_turn(me, f"joining {self.actor.label}")
            finally:
                me.joining = None


class _ModelHypervisor:
    """Three VMs with a remote device each; every call from the agent's threads goes through
    their actor (``_Actor.call``)."""

    uri = "model:///gamma"
    node = NODE

    def __init__(self, machine: PauseMarksMachine) -> None:
        self._m = machine

    def _call(self, what: str, vm: str | None, effect: Callable[[], Callable[[], T]]) -> T:
        actor = _current()
        if actor is None:  # the machine's own look: no stop, no failure
            return effect()()
        return actor.call(f"{what} {vm or ''}".strip(), vm, effect)

    def _failure(self, call: str, vm: str) -> str | None:
        """The failure injected into ``call`` of ``vm``, taken (under the model's lock)."""
        actor = _current()
        how = self._m.failures.pop((call, vm), None) if actor is not None else None
        if how is not None and actor is not None:
            _event(f"a {call} fails" + (" after its effect" if how == "lost" else ""))
            actor.consumed.append((call, vm))
            if call == "lookup" or (call == "resume" and how == "lost"):
                # the agent could not see, or did not hear: a mark may be left stale
                self._m.stale_ok.add(vm)
        return how

    @staticmethod
    def _raise(e: Exception) -> Callable[[], Any]:
        def answer() -> Any:
            raise e

        return answer

    def _gone(self, vm: str) -> bool:
        return self._m.state[vm] == GONE

    def lookup(self, name_or_uuid: str) -> DomainInfo:
        vm = name_or_uuid

        def effect() -> Callable[[], DomainInfo]:
            with self._m.mlock:
                if self._failure("lookup", vm):
                    return self._raise(LibvirtError(f"lookup of {vm}: no answer"))
                if self._gone(vm):
                    return self._raise(UnknownDomainError(vm, self.uri))
                state = self._m.state[vm]
                actor = _current()
                if actor is not None and actor.pauses and state == RUNNING:
                    actor.saw_running.add(vm)
                info = DomainInfo(vm, UUIDS[vm], _DOMAIN_STATE[state], True)
                return lambda: info

        return self._call("lookup", vm, effect)

    def list_domains(self) -> list[DomainInfo]:
        def effect() -> Callable[[], list[DomainInfo]]:
            with self._m.mlock:
                if self._failure("list", ""):
                    return self._raise(LibvirtError("listing the domains: no answer"))
                infos = [
                    DomainInfo(v, UUIDS[v], _DOMAIN_STATE[self._m.state[v]], True)
                    for v in VMS
                    if not self._gone(v)
                ]
                return lambda: infos

        return self._call("list", None, effect)

    def xml(self, name: str, inactive: bool = False) -> bytes:
        def effect() -> Callable[[], bytes]:
            with self._m.mlock:
                if self._failure("xml", name):
                    return self._raise(LibvirtError(f"XML of {name}: no answer"))
                if self._gone(name):
                    return self._raise(UnknownDomainError(name, self.uri))
                return lambda: XMLS[name]

        return self._call("xml", name, effect)

    def suspend(self, name: str) -> None:
        def effect() -> Callable[[], None]:
            with self._m.mlock:
                how = self._failure("suspend", name)
                if how == "fails":
                    return self._raise(LibvirtError(f"suspend {name}: job timed out"))
                if self._gone(name):
                    return self._raise(UnknownDomainError(name, self.uri))
                if self._m.state[name] == STOPPED:
                    return self._raise(DomainStateError("suspend", name, "domain is not running"))
                if self._m.state[name] == RUNNING:
                    self._m.state[name] = PAUSED
                    self._m.agent_paused.add(name)
                if how == "lost":
                    return self._raise(LibvirtError(f"suspend {name}: connection lost"))
                return lambda: None

        self._call("suspend", name, effect)

    def resume(self, name: str) -> None:
        def effect() -> Callable[[], None]:
            with self._m.mlock:
                how = self._failure("resume", name)
                if how == "fails":
                    return self._raise(LibvirtError(f"resume {name}: job timed out"))
                if self._gone(name):
                    return self._raise(UnknownDomainError(name, self.uri))
                if self._m.state[name] == STOPPED:
                    return self._raise(DomainStateError("resume", name, "domain is not running"))
                if self._m.state[name] == PAUSED:
                    if name in self._m.protected:
                        self._m.violations.append(f"an agent resumed {name}, an operator's pause")
                    self._m.resumed(name)
                if how == "lost":
                    return self._raise(LibvirtError(f"resume {name}: connection lost"))
                return lambda: None

        self._call("resume", name, effect)

    def detach_device(self, name: str, device_xml: bytes, live: bool, config: bool) -> None:
        def effect() -> Callable[[], None]:
            with self._m.mlock:
                if self._failure("detach", name):
                    return self._raise(LibvirtError(f"detach from {name}: job timed out"))
                if self._gone(name):
                    return self._raise(UnknownDomainError(name, self.uri))
                # the XML stays as it is: the recovery removes the device's metadata next
                return lambda: None

        self._call("detach", name, effect)

    def set_metadata(
        self, name: str, uri: str, key: str, xml: bytes | None, live: bool, config: bool
    ) -> None:
        def effect() -> Callable[[], None]:
            with self._m.mlock:
                if self._gone(name):
                    return self._raise(UnknownDomainError(name, self.uri))
                return lambda: None

        self._call("metadata", name, effect)


_DOMAIN_STATE = {
    RUNNING: DomainState.RUNNING,
    PAUSED: DomainState.PAUSED,
    STOPPED: DomainState.SHUTOFF,
}


class _Made:
    def __init__(self) -> None:
        self.created = True


class _ModelFabric:
    """What ``LostLeaseRecovery`` and the guard ask of the fabric; ``outcome`` is what the
    next re-reserve finds: "won", "lost" (someone else holds it), "away" (the registry),
    "ended" (this host's lease)."""

    local_node = NODE

    def __init__(self) -> None:
        self.outcome = "won"

    def topology(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(devices=[])  # no lender known: every device is remote

    def reserve(
        self, fdid: int, holder: Holder, *, guest_ram: int = 0, msi_over_ntb: bool = False
    ) -> _Made:
        if self.outcome == "away":
            raise RegistryUnreachableError("etcd://model", "no quorum")
        if self.outcome == "ended":
            raise LeaseExpiredError()
        if self.outcome == "lost":
            raise DeviceHeldError(fdid, "beta", "db")
        return _Made()

    def ensure_mdev_parent(self, fdid: int) -> str:
        return "parent"

    def create_mdev(self, fdid: int, uuid: str, holder: Holder) -> _Made:
        return _Made()

    def remove_mdev(self, uuid: str) -> bool:
        return True

    def release(self, fdid: int, holder: Holder) -> bool:
        return True

    def mdevs(self) -> list[object]:
        return []

    def mdev_records(self) -> list[object]:
        return []


class PauseMarksMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.scheduler = _Scheduler()
        #: The model's: its state is changed by the scheduler's thread or by the machine's.
        self.mlock = threading.RLock()
        self.clock = FakeClock()
        self._tmp = Path(tempfile.mkdtemp(prefix="vmlend-marks-"))
        self.marks_dir = self._tmp / "run" / "paused"
        self.hv = _ModelHypervisor(self)
        self.fabric = _ModelFabric()
        self.state = dict.fromkeys(VMS, RUNNING)
        #: VMs an agent's suspend paused, not resumed since (by anyone) nor stopped.
        self.agent_paused: set[str] = set()
        #: VMs an operator paused while they had no mark and no pause of them was under way.
        self.protected: set[str] = set()
        #: VMs whose mark may be stale (invariant 4), until a quiet start-up looked.
        self.stale_ok: set[str] = set()
        self.failures: dict[tuple[str, str], str] = {}
        self.violations: list[str] = []
        self.agents = 0
        self.guard: RemoteVmGuard | None = None
        self.recovery: LostLeaseRecovery | None = None
        #: The current agent's hands: in each, the names it will resume itself.
        self.hands: dict[str, set[str]] = {h: set() for h in HANDS}
        #: What the current agent's recovery gave up on (logged: stays paused, marked).
        self.given_up: set[str] = set()
        #: The current agent's start-up looked at the marks.
        self.started = False
        self.loop: _Actor | None = None
        self.watch: _Actor | None = None
        #: The recovery's gate lets a VM it won back run (the lease is not in doubt); and
        #: whether the recovery under way handed its VM on (retried, parked, a renewal's).
        self.gate_fresh = True
        self.handed_on = False
        self._threading = mock.patch.object(
            guard_module, "threading", _GuardThreading(self.scheduler)
        )
        self._threading.start()
        self._new_agent(slow=False, early=False)

    def teardown(self) -> None:
        try:
            self._kill_all()
        finally:
            self._threading.stop()
            shutil.rmtree(self._tmp, ignore_errors=True)

    # -- stepping ---------------------------------------------------------------------------

    @property
    def actors(self) -> list[_Actor]:
        return self.scheduler.actors

    def _spawn(self, label: str, body: Callable[[], object], **how: bool) -> _Actor:
        actor = _Actor(self.scheduler, label, body, **how)
        self.scheduler.add(actor)
        self._settle()
        return actor

    def _settle(self) -> None:
        """Until no thread can go on (each is stopped in a call, waits, or is done)."""
        self.scheduler.settle()
        with self.scheduler.cond:
            failed = [a for a in self.actors if a.failure is not None]
            self.actors[:] = [a for a in self.actors if not a.done]
        _flush_events()
        for a in failed:
            raise AssertionError(f"{a.label} failed") from a.failure

    def _idle(self, actor: _Actor | None) -> bool:
        return actor is None or actor.done

    def _busy(self) -> set[str]:
        """The VMs a thread is in a call for (or made one for): not at a quiet point."""
        return set().union(*(a.touched for a in self.actors if not a.done))

    def _marked(self) -> set[str]:
        return set(PauseMarks(self.marks_dir).names())

    def resumed(self, vm: str) -> None:
        """Under the model's lock: ``vm`` runs again; whoever paused it, nobody does now."""
        self.state[vm] = RUNNING
        self.agent_paused.discard(vm)
        self.protected.discard(vm)

    @rule(i=st.integers(0, 7))
    def land(self, i: int) -> None:
        if not any(a.at is not None for a in self.actors):
            return
        stopped = [a for a in self.actors if a.at is not None]
        with self.scheduler.cond:
            stopped[i % len(stopped)].land()
        self._settle()

    # -- the world: operators, VMs that stop, start and go, a hypervisor that fails -----------

    @rule(name=st.sampled_from(VMS), act=st.sampled_from(["pause", "pause", "power", "undefine"]))
    def an_operator_acts_on_a_vm(self, name: str, act: str) -> None:
        """ "pause": ``virsh suspend`` of a VM that runs, ``virsh resume`` of one that is
        paused. "power": one that runs or is paused stops (shut off, or crashed), one that is
        shut off or gone starts (defined again: the same name and UUID). "undefine": one that
        is shut off is gone, one that runs or is paused is destroyed and gone."""
        state = self.state[name]
        with self.mlock:
            if act == "pause" and state == RUNNING:
                pausing = any(name in a.saw_running for a in self.actors if a.pauses)
                claimed = name in self._marked() or pausing
                _event(
                    f"an operator pauses a VM {'an agent claims' if claimed else 'nobody claims'}"
                )
                self.state[name] = PAUSED
                if not claimed:
                    self.protected.add(name)
            elif act == "pause" and state == PAUSED:
                whose = " an agent paused" if name in self.agent_paused else ""
                _event(f"an operator resumes a VM{whose}")
                self.resumed(name)
            elif act == "pause":
                return
            elif state in (RUNNING, PAUSED):
                self.state[name] = GONE if act == "undefine" else STOPPED
                self.agent_paused.discard(name)
                self.protected.discard(name)
            else:
                self.state[name] = GONE if act == "undefine" else RUNNING
            self.stale_ok.add(name)  # its mark, if any, goes at the next look

    @rule(call=st.sampled_from(CALLS), name=st.sampled_from(VMS), lost=st.booleans())
    def a_hypervisor_call_will_fail(self, call: str, name: str, lost: bool) -> None:
        """The next such call from the agent raises; ``lost``: a suspend or resume takes
        effect first (its answer is lost)."""
        with self.mlock:
            self.failures[(call, "" if call == "list" else name)] = "lost" if lost else "fails"

    # -- the agent's threads ---------------------------------------------------------------------

    def _agent_alive(self) -> bool:
        return self.guard is not None

    def _move(self, names: list[str] | set[str], to: str, *froms: str) -> None:
        """``names`` into the hand ``to``, out of ``froms``."""
        with self.mlock:
            for hand in froms:
                self.hands[hand] -= set(names)
            self.hands[to] |= set(names)

    def _held(self) -> set[str]:
        return set().union(*self.hands.values())

    @rule(slow=st.booleans(), early=st.booleans())
    def the_watch_pauses(self, slow: bool, early: bool) -> None:
        """``LeaseWatch.check``: the guard's ``pause``; a renewal resumes what it paused.
        From the agent's first moment: the watch starts before the start-up."""
        if not (self._agent_alive() and self._idle(self.watch)):
            return
        guard = self.guard
        assert guard is not None

        def pause() -> None:
            self._move(guard.pause(), PAUSED_BY_WATCH)

        self.watch = self._spawn("watch", pause, slow=slow, early=early, pauses=True)

    def _loop_ready(self) -> bool:
        return self._agent_alive() and self.started and self._idle(self.loop)

    @rule(
        names=st.lists(st.sampled_from(VMS), min_size=1, max_size=3, unique=True),
        slow=st.booleans(),
        early=st.booleans(),
    )
    def the_loop_pauses_vms_without_their_holds(
        self, names: list[str], slow: bool, early: bool
    ) -> None:
        """``Agent._without_holds``: ``pause_these``, and those the watch paused withdrawn,
        for the recovery; one whose pause failed and that runs, orphaned (paused and
        recovered on the next turn); one an operator paused (no mark), recovered at once and
        left paused (``recover(..., leave_paused=True)``, as the loop does next)."""
        if not self._loop_ready():
            return
        guard, recovery = self.guard, self.recovery
        assert guard is not None and recovery is not None

        def pause() -> None:
            paused = set(guard.pause_these(names))
            with self.mlock:
                paused |= self.hands[PAUSED_BY_WATCH] & set(names)
            self._move(paused, RECOVERY, PAUSED_BY_WATCH)
            operators = []
            for n in names:
                if n in paused:
                    continue
                if guard.running(n):
                    self._move([n], RECOVERY)
                elif guard.paused_by_operator(n):
                    operators.append(n)
            for result in recovery.recover(operators, leave_paused=True):
                _event(f"an operator's VM recovered: {result.outcome}")

        self.loop = self._spawn("without-holds", pause, slow=slow, early=early, pauses=True)

    @rule(fresh=st.booleans(), doubt=st.booleans(), slow=st.booleans(), early=st.booleans())
    def a_renewal_resumes(self, fresh: bool, doubt: bool, slow: bool, early: bool) -> None:
        """``Renewals.renew`` handing back what the watch paused to ``guard.resume``, whose
        gate stands in for ``resume_if_fresh``: ``fresh`` false, the lease came in doubt
        before it (held back); ``doubt``, it came in doubt while the resume ran (``recheck``
        pauses it again, held back)."""
        if not (self._loop_ready() and bool(self.hands[PAUSED_BY_WATCH])):
            return
        guard = self.guard
        assert guard is not None
        names = sorted(self.hands[PAUSED_BY_WATCH])
        self._move(names, RESUMING, PAUSED_BY_WATCH)

        def gate(name: str, resume: Callable[[], None], generation: int) -> bool:
            if not fresh:
                self._move([name], PAUSED_BY_WATCH, RESUMING)
                return False
            try:
                resume()
            except BaseException:
                self._move([name], PAUSED_BY_WATCH, RESUMING)  # ran or not: the next renewal's
                raise
            if doubt:
                guard.suspend_if_running(name)
                self._move([name], PAUSED_BY_WATCH, RESUMING)
                return False
            with self.mlock:
                self.hands[RESUMING].discard(name)
            return True

        def renew() -> None:
            guard.resume(names, gate, 0)

        self.loop = self._spawn("renewal", renew, slow=slow, early=early, pauses=doubt)

    @rule(
        i=st.integers(0, 7),
        outcome=st.sampled_from(["won", "won", "lost", "away", "ended"]),
        orphan=st.booleans(),
        fresh=st.booleans(),
        slow=st.booleans(),
        early=st.booleans(),
    )
    def the_recovery_takes_one(
        self, i: int, outcome: str, orphan: bool, fresh: bool, slow: bool, early: bool
    ) -> None:
        """``LostLeaseRecovery.recover`` of one VM in the recovery's hands (``orphan``: taken
        by ``take_orphans``, which pauses it again first); its gate refuses while the lease
        is in doubt (``fresh`` false): for the next renewal."""
        if not (self._loop_ready() and bool(self.hands[RECOVERY])):
            return
        guard, recovery = self.guard, self.recovery
        assert guard is not None and recovery is not None
        names = sorted(self.hands[RECOVERY])
        name = names[i % len(names)]
        self._move([name], RECOVERING, RECOVERY)
        self.fabric.outcome = outcome
        self.gate_fresh = fresh
        self.handed_on = False

        def recover() -> None:
            # ``take_orphans``'s pause first; one paused since without a mark is an operator's
            # (``Agent._retry_operators`` recovers it, left paused)
            operators = orphan and not guard.suspend_if_running(name)
            operators = operators and guard.paused_by_operator(name)
            [result] = recovery.recover([name], leave_paused=operators)
            _event(f"the recovery: {result.outcome}")
            with self.mlock:
                self.hands[RECOVERING].discard(name)
                if result.outcome == "paused" and not self.handed_on:
                    _event(f"the recovery gives up: {result.why.split(':')[0]}")
                    self.given_up.add(name)

        self.loop = self._spawn(f"recover-{name}", recover, slow=slow, early=early, pauses=orphan)

    def _recovery_gate(self, name: str, resume: Callable[[], None]) -> bool:
        """``LeaseWatch.resume_if_fresh`` as the recovery's gate."""
        if not self.gate_fresh:
            self._hand_on(name, PAUSED_BY_WATCH)
            return False
        try:
            resume()
        except BaseException:
            self._hand_on(name, PAUSED_BY_WATCH)  # ``recheck``; the recovery's retry takes it
            raise
        return True

    def _hand_on(self, name: str, to: str) -> None:
        """The recovery hands ``name`` on (``retry`` and ``park`` to the recovery again)."""
        self._move([name], to, *(h for h in HANDS if h != to))
        self.handed_on = True

    # -- agents die and start ----------------------------------------------------------------------

    def _kill_all(self) -> None:
        """Every thread of the agent ends at its next hypervisor call (a stopped one there)."""
        cond = self.scheduler.cond
        with cond:
            for a in self.actors:
                a.killed = True
                if a.at is not None:
                    a.land()
            self.scheduler._schedule()
            if not cond.wait_for(lambda: all(a.done for a in self.actors), WAIT):
                raise AssertionError(f"the killed threads never ended: {self.actors}")
            killed = list(self.actors)
            self.actors.clear()
        for a in killed:
            if a.failure is not None:
                raise AssertionError(f"{a.label} failed") from a.failure
            self.stale_ok |= a.touched  # killed between its mark and its suspend, say

    @rule(restarts=st.sampled_from([True, True, False]), slow=st.booleans(), early=st.booleans())
    def the_agent_is_killed(self, restarts: bool, slow: bool, early: bool) -> None:
        """kill -9 (or the OOM killer); ``restarts``: systemd starts the next one at once,
        else it starts in a later step (``a_new_agent_starts``), the world going on
        meanwhile."""
        if not self._agent_alive():
            return
        _event(f"the agent is killed with {len(self.actors)} threads")
        self._kill_all()
        self.guard = self.recovery = None
        self.hands = {h: set() for h in HANDS}
        self.given_up = set()
        self.started = False
        self.loop = self.watch = None
        if restarts:
            self._new_agent(slow, early)

    @rule(slow=st.booleans(), early=st.booleans())
    def a_new_agent_starts(self, slow: bool, early: bool) -> None:
        if self._agent_alive():
            return
        self._new_agent(slow, early)

    def _new_agent(self, slow: bool, early: bool) -> None:
        """``Agent._run`` and the start-up of ``_serve``: a guard on the same marks, the
        recovery wired to it as ``_run`` wires it, ``left_paused`` handed to that recovery."""
        self.agents += 1
        hv = cast(Hypervisor, self.hv)
        fabric = cast(Fabric, self.fabric)
        guard = self.guard = RemoteVmGuard(hv, fabric, NODE, PauseMarks(self.marks_dir))
        self.recovery = LostLeaseRecovery(
            hv,
            fabric,
            fence_wait=0.0,
            interval=0.0,
            clock=self.clock,
            sleep=lambda _s: None,
            resume_gate=self._recovery_gate,
            park=lambda n: self._hand_on(n, RECOVERY),
            retry=lambda n: self._hand_on(n, RECOVERY),
            resume=guard.resume_and_unmark,
            unmark=guard.unmark_unless_paused,
        )
        left: list[str] = []

        def start_up() -> None:
            left.extend(guard.left_paused())
            self._move(left, RECOVERY, PAUSED_BY_WATCH)  # ``watch.withdraw(left)``
            self.started = True

        actor = self.loop = self._spawn(f"start-up-{self.agents}", start_up, slow=slow, early=early)
        if actor.done and not actor.consumed and not self.actors:
            # quiet: it looked at every mark, and nobody did anything meanwhile
            marked = self._marked()
            assert sorted(marked) == sorted(left), f"marks {sorted(marked)}, left {left}"
            unpaused = sorted(v for v in marked if self.state[v] != PAUSED)
            assert not unpaused, f"a start-up kept the marks of {unpaused}, not paused"
            self.stale_ok.clear()
            if left:
                _event(f"a start-up hands {len(left)} VMs to the recovery")

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def no_vm_an_agent_paused_is_left_paused_for_good(self) -> None:
        if not (self._agent_alive() and self.started):
            return
        held = self._held() | self.given_up
        for v in sorted(self.agent_paused - self._busy()):
            assert v in held, (
                f"VM {v}, paused by an agent, is in no hand of agent {self.agents}:"
                f" left paused for good ({self.hands})"
            )

    @invariant()
    def no_agent_resumes_an_operators_pause(self) -> None:
        assert not self.violations, self.violations

    @invariant()
    def a_vm_the_agent_paused_has_its_mark(self) -> None:
        unmarked = sorted(self.agent_paused - self._marked())
        assert not unmarked, f"VMs {unmarked} are paused by an agent without a mark"

    @invariant()
    def a_mark_is_of_a_paused_vm_or_excused(self) -> None:
        busy = self._busy()
        marked = self._marked()
        self.stale_ok -= {v for v in self.stale_ok if v not in marked and v not in busy}
        for v in sorted(marked - busy - self.stale_ok):
            assert self.state[v] == PAUSED, f"VM {v} is {self.state[v]} with a mark"


PauseMarksMachine.TestCase.settings = derandomized(EXAMPLES, STEPS)
test_pause_marks_state_machine = PauseMarksMachine.TestCase


# -- the sequences the machine found, replayed step by step ----------------------------------------

_QUICK: dict[str, object] = {"slow": False, "early": False}


_INVARIANTS = (
    PauseMarksMachine.no_vm_an_agent_paused_is_left_paused_for_good,
    PauseMarksMachine.no_agent_resumes_an_operators_pause,
    PauseMarksMachine.a_vm_the_agent_paused_has_its_mark,
    PauseMarksMachine.a_mark_is_of_a_paused_vm_or_excused,
)


def _replay(*steps: tuple[str, Mapping[str, object]]) -> None:
    """A sequence the machine ran, replayed on a new one (``stateful.replay``)."""
    replay(PauseMarksMachine(), _INVARIANTS, steps)


def test_a_vm_whose_suspend_answer_was_lost_is_resumed_by_the_agent_that_paused_it() -> None:
    """The watch's pause of "a" takes effect, but its answer is lost (the connection to
    libvirtd dropped). The guard kept the mark ("a" is paused) yet told the watch it had not
    paused "a": no renewal resumed it, no later pause looked at it (it does not run), and
    it stayed paused until the agent was restarted."""
    _replay(
        ("a_hypervisor_call_will_fail", {"call": "suspend", "name": "a", "lost": True}),
        ("the_watch_pauses", _QUICK),
    )


def test_a_vm_started_again_during_its_recovery_keeps_the_mark_of_its_next_pause() -> None:
    """The recovery finds "a" gone, and before it drops the mark, "a" is defined and started
    again and the watch pauses it (and marks it). The recovery's unmark, outside the guard's
    lock, dropped that new mark: an agent killed then left "a" paused for good."""
    _replay(
        ("the_watch_pauses", _QUICK),  # a, b and c paused, for a renewal
        ("the_loop_pauses_vms_without_their_holds", {"names": ["a"], **_QUICK}),
        ("an_operator_acts_on_a_vm", {"name": "a", "act": "undefine"}),
        (
            "the_recovery_takes_one",
            {"i": 0, "outcome": "won", "orphan": False, "fresh": True, "slow": True, "early": True},
        ),  # stops once its XML read found "a" gone
        ("an_operator_acts_on_a_vm", {"name": "a", "act": "power"}),  # defined, started
        ("the_watch_pauses", _QUICK),  # pauses and marks "a"
        ("land", {"i": 0}),
    )


def test_an_operators_vm_whose_recovery_failed_is_not_handed_to_the_agents_retry() -> None:
    """The loop finds "b", which an operator paused, without its holds; its recovery (left
    paused) finds the registry away. Handed to the recovery's ``retry`` like an agent's VM,
    "b" would be recovered again on the next turn, and that recovery resumes it: the
    operator's pause undone (the agent tries an operator's VM again as such instead)."""
    won = {"outcome": "won", "orphan": False, "fresh": True, **_QUICK}
    _replay(
        ("the_loop_pauses_vms_without_their_holds", {"names": ["a"], **_QUICK}),
        ("the_recovery_takes_one", {"i": 0, **won, "outcome": "away"}),  # sets the fabric's
        ("an_operator_acts_on_a_vm", {"name": "b", "act": "pause"}),
        ("the_loop_pauses_vms_without_their_holds", {"names": ["b"], **_QUICK}),
        ("the_recovery_takes_one", {"i": 1, **won}),
        ("the_recovery_takes_one", {"i": 0, **won}),
    )


def test_an_orphan_an_operator_paused_since_is_not_resumed() -> None:
    """The loop's pause of "a", which runs without its holds, fails: "a" is orphaned, to be
    paused again and recovered on the next turn (``take_orphans``). Meanwhile an operator
    pauses it. The orphans' pause finds nothing to pause, and the recovery used to resume
    "a" all the same; an unmarked pause is an operator's, recovered and left paused."""
    _replay(
        ("a_hypervisor_call_will_fail", {"call": "suspend", "name": "a", "lost": False}),
        ("the_loop_pauses_vms_without_their_holds", {"names": ["a"], **_QUICK}),
        ("an_operator_acts_on_a_vm", {"name": "a", "act": "pause"}),
        (
            "the_recovery_takes_one",
            {"i": 0, "outcome": "won", "orphan": True, "fresh": True, **_QUICK},
        ),
    )
