"""The lease watch's bookkeeping explored as the agent drives it (hypothesis' rule-based state
machine): what ``test_agent_watch.py`` pins with examples, over the interleavings of the agent's
threads at the hypervisor calls the watch makes outside its lock.

The agent's threads, each run for real on a thread of its own and stepped by the machine:

- the watch's thread (``check``, whose ``pause`` may be slow to answer);
- a resume thread per name a renewal hands back (``RemoteVmGuard.resume``: the holds check,
  then ``resume_if_fresh`` with the generation read at the renewal);
- the plug server (``plugging`` around hot-plugs, ``recheck`` after each);
- the agent's loop: renewals, the lost-lease path (``take_paused``, the guard's pause, a new
  lease, ``take_late``, ``keep_alive``, ``_without_holds``), the recovery of one VM at a time
  (re-reserve and resume through the gate, ``park``, ``orphan``, or found stopped), and
  ``take_orphans``.

A thread whose call is slow stops in that hypervisor call (its effect done as it stops, or as
it lands) until a ``land`` step lets it go on; a step ends once every thread stopped in a call,
waits in the watch for a pause in progress, or is done. Time is an injected clock: nothing
sleeps, nothing is timed.

A model hypervisor runs three VMs with remote devices and remembers under which lease (the
watch's generation) each of their devices is held: a VM started or recovered under generation
``g`` holds under ``g``; ``take_paused`` (the lease lost) starts the next generation, and the
holds of the one before are gone until a recovery re-reserves them.

After every step:

1. no VM runs on holds of an older generation than the current one, except while a call that
   may let it run (a resume, a hot-plug) begun under an older generation is in flight (up to
   the watch's ``recheck``), or between ``take_paused`` and the lost-lease path's own pause;
2. every paused VM no thread is in a call for is in a renewal's hands (the watch's paused,
   resuming) or in the recovery's (orphans, parked, taken by the loop), never in both, never
   in none;
3. what the next renewal hands back holds its devices under the current lease (the watch's
   own guard, without the agent's ``lacks_holds``);
4. where no call is under way, ``paused_count()`` counts the names a renewal hands back (or
   handed back, their resume to come), none the recovery holds;

and no gate resumes a VM a plug request is plugging into. The watch's private fields are read
for 2-4 only: nothing public says in whose hands a name is.

CI runs a few derandomized sequences (the same every run) and replays what the machine found
in the watch (the tests at the end); ``VMLEND_WATCH_STATEFUL_EXAMPLES`` and
``VMLEND_WATCH_STATEFUL_STEPS`` explore more (as ``VMLEND_STATEFUL_*`` do for the fabric's).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

from hypothesis import currently_in_test_context, event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.support.clocks import FakeClock
from tests.support.stateful import derandomized, replay
from vmlend.agent.watch import LeaseWatch
from vmlend.errors import VmlendError

T = TypeVar("T")

EXAMPLES = int(os.environ.get("VMLEND_WATCH_STATEFUL_EXAMPLES", "60"))
STEPS = int(os.environ.get("VMLEND_WATCH_STATEFUL_STEPS", "40"))

TTL = 4.0
VMS = ("a", "b", "c")
#: A bounded real-time wait for a thread to reach its next stop (it is a failure to exceed).
WAIT = 10.0

RUNNING, PAUSED, STOPPED = "running", "paused", "stopped"

_here = threading.local()


class _Actor:
    """One thread of the agent, stepped: with ``slow``, each hypervisor call it makes stops
    until ``land`` (``early``: its effect is done as it stops, only the answer waits)."""

    def __init__(
        self,
        changed: threading.Condition,
        label: str,
        body: Callable[[], object],
        *,
        slow: bool = False,
        early: bool = False,
        subject: str | None = None,
    ) -> None:
        self.label = label
        self.slow = slow
        self.early = early
        #: The machine's: notified whenever a thread stops, waits or ends.
        self._changed = changed
        self._body = body
        #: The call it stopped in, if it did.
        self.at: str | None = None
        #: In the watch's wait for a pause in progress (``LeaseWatch._take``).
        self.waits = False
        self.done = False
        self.failure: BaseException | None = None
        self._go = False
        #: VMs whose state it changed (or that it acts for): not at a quiet point meanwhile.
        self.touched: set[str] = set() if subject is None else {subject}
        #: Per VM, the generation under which a call of it that may let the VM run began.
        self.run_gens: dict[str, int] = {}
        self.thread = threading.Thread(target=self._run, name=f"actor-{label}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        _here.actor = self
        try:
            self._body()
        except BaseException as e:  # reported by the machine
            self.failure = e
        finally:
            with self._changed:
                self.done = True
                self._changed.notify_all()

    def call(self, what: str, effect: Callable[[], T], *vms: str) -> T:
        """A hypervisor call from this thread, for ``vms``: not at a quiet point until the
        thread is done."""
        self.touched.update(vms)
        if self.slow and not self.early:
            self._stop(what)
        result = effect()
        if self.slow and self.early:
            self._stop(what)
        return result

    def _stop(self, what: str) -> None:
        with self._changed:
            self.at = what
            self._changed.notify_all()
            if not self._changed.wait_for(lambda: self._go, WAIT):
                raise AssertionError(f"{self.label}: never let go on in {what}")
            self._go = False
            self.at = None

    def set_waits(self, waits: bool) -> None:
        with self._changed:
            self.waits = waits
            self._changed.notify_all()

    def land(self) -> None:
        with self._changed:
            assert self.at is not None
            self._go = True
            self._changed.notify_all()

    def settled(self, pausing: bool) -> bool:
        return self.done or (self.at is not None and not self._go) or (self.waits and pausing)

    def __repr__(self) -> str:
        where = "done" if self.done else self.at or ("waits" if self.waits else "running")
        return f"<{self.label}: {where}>"


def _event(text: str) -> None:
    """Counted in hypothesis' statistics (``--hypothesis-show-statistics``): what was reached."""
    if currently_in_test_context():
        event(text)


def _current() -> _Actor:
    actor = getattr(_here, "actor", None)
    assert isinstance(actor, _Actor), "a hypervisor call off the machine's threads"
    return actor


class _WaitsSeen(threading.Condition):
    """The watch's condition for a pause in progress, telling the machine who waits on it."""

    def wait(self, timeout: float | None = None) -> bool:
        actor = getattr(_here, "actor", None)
        if isinstance(actor, _Actor):
            actor.set_waits(True)
        try:
            return super().wait(timeout)
        finally:
            if isinstance(actor, _Actor):
                actor.set_waits(False)


class WatchMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.changed = threading.Condition()
        self.mlock = threading.Lock()  # the model's, never held across a stop
        self.state = dict.fromkeys(VMS, RUNNING)
        self.holds: dict[str, list[int]] = {v: [0] for v in VMS}
        self.gen = 0
        #: etcd let the lease go (the loop's next renewal is told so).
        self.gone = False
        self.last_renew = self.clock()
        #: The lost-lease path withdrew the host's lease file: no reserve under it.
        self.withdrawn = False
        #: From ``take_paused`` until the lost-lease path's own pause is done.
        self.acting_on_loss = False
        #: From the lost-lease path's start until ``take_late``: what the watch pauses
        #: meanwhile is for the recovery, taken late.
        self.taking_late = False
        #: "serving", "lost" (a new lease to take), "recovering" (``queue`` to recover).
        self.phase = "serving"
        self.queue: list[str] = []
        self.after_loss: list[str] = []
        #: The recovery's: what the watch gave it (or the loop paused for it), not yet done.
        self.hands: set[str] = set()
        #: Names a renewal handed back, with the generation read then: resume threads to run.
        self.handed: list[tuple[str, int]] = []
        self.plugs_held = False
        self.plugging: set[str] = set()
        self.violations: list[str] = []
        self.actors: list[_Actor] = []
        self.checker: _Actor | None = None
        self.loop: _Actor | None = None
        self.plug: _Actor | None = None
        self.watch = LeaseWatch(TTL, self._pause, clock=self.clock, suspend=self._suspend)
        # Instrumentation (a private field): the machine must see a thread that waits in
        # ``_take`` for a pause in progress, to end its step there.
        self.watch._paused_done = _WaitsSeen(self.watch._lock)

    # -- the model hypervisor, called on the agent's threads --------------------------------

    def _valid(self, name: str) -> bool:
        return bool(self.holds[name]) and min(self.holds[name]) >= self.gen

    def _lease_gone(self) -> bool:
        return self.gone or self.clock() - self.last_renew > TTL

    def _pause_running(self, *, ends_loss: bool = False) -> list[str]:
        """``RemoteVmGuard.pause``: every running VM (all use remote devices), paused."""
        actor = _current()

        def effect() -> list[str]:
            with self.mlock:
                names = [v for v in VMS if self.state[v] == RUNNING]
                for v in names:
                    self.state[v] = PAUSED
                actor.touched.update(names)
                if ends_loss:
                    self.acting_on_loss = False
                return names

        with self.mlock:
            running = [v for v in VMS if self.state[v] == RUNNING]
        return actor.call("pause", effect, *running)

    def _pause(self) -> list[str]:
        return self._pause_running()

    def _suspend(self, name: str) -> bool:
        """``RemoteVmGuard.suspend_if_running``."""
        actor = _current()

        def effect() -> bool:
            with self.mlock:
                actor.touched.add(name)
                if self.state[name] != RUNNING:
                    return False
                self.state[name] = PAUSED
                return True

        return actor.call(f"suspend {name}", effect, name)

    def _resumer(self, name: str, outcome: str) -> Callable[[], None]:
        """``RemoteVmGuard.resume_if_paused`` of ``name``: "ok", or its answer lost after it
        took effect ("lost") or before ("fails")."""

        def resume() -> None:
            actor = _current()
            with self.mlock:
                actor.touched.add(name)
                actor.run_gens[name] = min(actor.run_gens.get(name, self.gen), self.gen)
                if name in self.plugging:
                    self.violations.append(f"a gate resumed {name} while a plug plugs into it")

            def effect() -> None:
                with self.mlock:
                    if outcome != "fails" and self.state[name] == PAUSED:
                        self.state[name] = RUNNING

            actor.call(f"resume {name}", effect, name)
            if outcome != "ok":
                raise VmlendError(f"resuming {name}: no answer")

        return resume

    # -- stepping ---------------------------------------------------------------------------

    def _spawn(self, actor: _Actor) -> _Actor:
        self.actors.append(actor)
        actor.start()
        self._settle()
        return actor

    def _settle(self) -> None:
        """Until every thread stopped in a call, waits for a pause in progress, or is done."""
        changed = self.changed
        with changed:

            def settled() -> bool:
                pausing = self.checker is not None and not self.checker.done
                return all(a.settled(pausing) for a in self.actors)

            if not changed.wait_for(settled, WAIT):
                raise AssertionError(f"the threads never settled: {self.actors}")
        for a in self.actors:
            if a.failure is not None:
                raise AssertionError(f"{a.label} failed") from a.failure
            if a.waits:
                _event(f"{a.label} waits for a pause in progress")
        if self.watch._deferred:  # a private field, read for the statistics only
            _event("a gate left a VM to the plug into it")
        self.actors = [a for a in self.actors if not a.done]
        assert not self.violations, self.violations

    def _idle(self, actor: _Actor | None) -> bool:
        return actor is None or actor.done

    def teardown(self) -> None:
        """Let every thread go on to its end (bounded), so none outlives its example."""
        deadline = time.monotonic() + WAIT
        while self.actors and time.monotonic() < deadline:
            for a in self.actors:
                if a.at is not None:
                    a.land()
            try:
                self._settle()
            except AssertionError:
                self.actors = [a for a in self.actors if not a.done]

    # -- time, etcd, the watch's thread --------------------------------------------------------

    @rule(dt=st.sampled_from([0.5, 0.5, TTL / 3 + 0.01, TTL / 2 + 0.01]))
    def time_passes(self, dt: float) -> None:
        self.clock.advance(dt)

    @precondition(lambda self: not self.gone)
    @rule()
    def etcd_lets_the_lease_go(self) -> None:
        self.gone = True

    @precondition(lambda self: self._idle(self.checker))
    @rule(slow=st.booleans(), early=st.booleans())
    def the_watch_looks(self, slow: bool, early: bool) -> None:
        self.checker = self._spawn(
            _Actor(self.changed, "watch", self.watch.check, slow=slow, early=early)
        )

    @precondition(lambda self: any(a.at is not None for a in self.actors))
    @rule(i=st.integers(0, 7))
    def land(self, i: int) -> None:
        stopped = [a for a in self.actors if a.at is not None]
        stopped[i % len(stopped)].land()
        self._settle()

    # -- the renewals' resume threads and the plug server --------------------------------------

    @precondition(lambda self: bool(self.handed))
    @rule(
        i=st.integers(0, 7),
        holds=st.sampled_from(["read", "read", "error"]),
        outcome=st.sampled_from(["ok", "ok", "lost", "fails"]),
        slow=st.booleans(),
        early=st.booleans(),
    )
    def a_resume_thread_runs(
        self, i: int, holds: str, outcome: str, slow: bool, early: bool
    ) -> None:
        name, generation = self.handed.pop(i % len(self.handed))
        watch = self.watch

        def lacks_holds() -> bool:
            with self.mlock:
                if holds == "error" or self.state[name] == STOPPED:
                    raise VmlendError(f"cannot read the holds of {name}")
                return not self._valid(name)

        def one() -> None:  # RemoteVmGuard.resume's, with the agent's lacks_holds
            actor = _current()
            try:
                try:
                    missing = actor.call(f"holds of {name}", lacks_holds)
                except VmlendError:
                    watch.hold_back(name)
                    return
                if missing:
                    watch.orphan(name)
                    return
                watch.resume_if_fresh(name, self._resumer(name, outcome), generation)
            except VmlendError:
                pass

        self._spawn(
            _Actor(self.changed, f"resume-{name}", one, slow=slow, early=early, subject=name)
        )

    @precondition(
        lambda self: self._idle(self.plug) and not self.plugs_held and not self.watch.in_doubt
    )
    @rule(name=st.sampled_from(VMS), devices=st.integers(1, 2), slow=st.booleans())
    def a_plug_request_is_served(self, name: str, devices: int, slow: bool) -> None:
        if self.state[name] == STOPPED:
            return

        def serve() -> None:
            actor = _current()
            with self.watch.plugging(name) as plugged:
                with self.mlock:
                    self.plugging.add(name)
                    actor.run_gens[name] = self.gen
                try:
                    for _ in range(devices):
                        with self.mlock:
                            if self.withdrawn or self._lease_gone():
                                continue  # reserving fails: not plugged
                            held = self.gen

                        def hot_plug(held: int = held) -> None:
                            with self.mlock:
                                if self.state[name] != STOPPED:
                                    self.holds[name].append(held)

                        actor.call(f"hot-plug {name}", hot_plug, name)
                        plugged()
                finally:
                    with self.mlock:
                        self.plugging.discard(name)

        self.plug = self._spawn(
            _Actor(self.changed, f"plug-{name}", serve, slow=slow, subject=name)
        )

    # -- the agent's loop -------------------------------------------------------------------------

    def _loop_idle(self) -> bool:
        return self._idle(self.loop)

    def _run_loop(
        self, label: str, body: Callable[[], None], slow: bool = False, early: bool = False
    ) -> None:
        self.loop = self._spawn(_Actor(self.changed, label, body, slow=slow, early=early))

    @precondition(
        lambda self: self._loop_idle() and self.phase == "serving" and not self._lease_gone()
    )
    @rule()
    def a_renewal_answers(self) -> None:
        self.last_renew = self.clock()
        names = self.watch.renewed()
        generation = self.watch.generation
        self.handed += [(n, generation) for n in names]

    @precondition(lambda self: self._loop_idle() and self.phase == "serving" and self._lease_gone())
    @rule(slow=st.booleans(), early=st.booleans())
    def the_lease_is_lost(self, slow: bool, early: bool) -> None:
        _event(f"the lease lost in generation {self.gen}")

        def lost() -> None:
            with self.mlock:
                self.plugs_held = True
                self.withdrawn = True
                self.taking_late = True
            paused = self.watch.take_paused()
            with self.mlock:
                self.gen += 1
                self.acting_on_loss = True
                self.hands.update(paused)
            assert self.watch.generation == self.gen
            newly = self._pause_running(ends_loss=True)  # Agent._after_lost_lease
            with self.mlock:
                self.hands.update(newly)
                self.after_loss = sorted(set(paused) | set(newly))
                self.phase = "lost"

        self._run_loop("lost-lease", lost, slow, early)

    def _keep_alive(self, answered: bool) -> None:
        """``Renewals.keep_alive``: renew without handing back; etcd may say it is gone."""
        if not answered:
            return
        if self._lease_gone():
            self.watch.expire()
            self.gone = True
            return
        self.last_renew = self.clock()
        assert self.watch.renewed(hand_back=False) == []

    @precondition(lambda self: self._loop_idle() and self.phase == "lost")
    @rule(answered=st.booleans(), slow=st.booleans(), early=st.booleans())
    def a_new_lease(self, answered: bool, slow: bool, early: bool) -> None:
        watch = self.watch

        def new_lease() -> None:
            late = watch.take_late()
            with self.mlock:
                self.hands.update(late)
                self.taking_late = False
                self.withdrawn = self.gone = False
                self.last_renew = self.clock()
            self._keep_alive(answered)
            with self.mlock:  # vms_without_their_holds
                lost = [v for v in VMS if self.state[v] != STOPPED and not self._valid(v)]
            paused = {v for v in lost if self._suspend(v)}  # guard.pause_these
            with self.mlock:
                self.hands.update(paused)
            withdrawn = watch.withdraw(lost)
            with self.mlock:
                self.hands.update(withdrawn)
            paused |= set(withdrawn)
            for v in lost:
                if v not in paused and self.state[v] == RUNNING:
                    watch.orphan(v)
            names = sorted(set(self.after_loss) | set(late) | paused)
            with self.mlock:
                self.hands.update(names)
                self._recover(names)

        self._run_loop("new-lease", new_lease, slow, early)

    def _recover(self, names: list[str]) -> None:
        self.queue = list(names)
        self.phase = "recovering" if names else "serving"
        self.plugs_held = bool(names)

    @precondition(lambda self: self._loop_idle() and self.phase == "recovering")
    @rule(answered=st.booleans())
    def the_recovery_keeps_the_lease_alive(self, answered: bool) -> None:
        self._keep_alive(answered)

    @precondition(lambda self: self._loop_idle() and self.phase == "recovering")
    @rule(
        outcome=st.sampled_from(["won", "won", "won", "retry", "stopped"]),
        resumed=st.sampled_from(["ok", "ok", "lost", "fails"]),
        slow=st.booleans(),
        early=st.booleans(),
    )
    def the_recovery_takes_one(self, outcome: str, resumed: str, slow: bool, early: bool) -> None:
        name = self.queue.pop(0)
        watch = self.watch
        gone = self.state[name] == STOPPED or outcome == "stopped"
        parks = outcome == "won" and self._lease_gone()
        _event(f"the recovery: {'stopped' if gone else 'parked' if parks else outcome}")

        def recover_one() -> None:  # LostLeaseRecovery.recover, for one VM
            try:
                if outcome == "stopped" or self.state[name] == STOPPED:  # gone: holds returned
                    with self.mlock:
                        self.state[name] = STOPPED
                        self.holds[name] = []
                elif outcome == "retry":  # the registry away: tried again
                    watch.orphan(name)
                elif self._lease_gone():  # LeaseExpiredError: for the next lease's recovery
                    watch.park(name)
                else:
                    with self.mlock:  # re-reserved under this lease
                        self.holds[name] = [self.gen] * max(1, len(self.holds[name]))
                    try:
                        watch.resume_if_fresh(name, self._resumer(name, resumed))
                    except VmlendError:  # a LibvirtError: tried again
                        watch.orphan(name)
            finally:
                with self.mlock:
                    self.hands.discard(name)
                    if not self.queue:
                        self._recover([])

        self._run_loop(f"recover-{name}", recover_one, slow, early)

    @precondition(lambda self: self._loop_idle() and self.phase == "serving")
    @rule(slow=st.booleans(), early=st.booleans())
    def the_loop_takes_the_orphans(self, slow: bool, early: bool) -> None:
        def orphans() -> None:
            names = self.watch.take_orphans()
            with self.mlock:
                self.hands.update(names)
                self.plugs_held = bool(names)  # plugs.hold(), before the pauses
            for name in names:
                self._suspend(name)
            with self.mlock:
                self._recover(names)

        self._run_loop("orphans", orphans, slow, early)

    @precondition(lambda self: not self.withdrawn and not self._lease_gone())
    @rule(name=st.sampled_from(VMS))
    def a_stopped_vm_starts(self, name: str) -> None:
        """Under the current lease (its prepare hook reserves), if nothing knows it any more."""
        known = set().union(*self._watch_hands().values(), self.hands, self._busy())
        known |= {n for n, _ in self.handed}
        if self.state[name] != STOPPED or name in known:
            return
        self.state[name] = RUNNING
        self.holds[name] = [self.gen]

    # -- invariants ------------------------------------------------------------------------------

    def _watch_hands(self) -> dict[str, set[str]]:
        # The watch's private fields, read for the invariants only: nothing public shows
        # where a name is. A renewal hands back its paused but the parked and the orphans; a
        # name handed back under a lost lease only is its gate's to give to the recovery.
        w = self.watch
        lost = {n for n, g in self.handed if g < self.gen}
        lost -= {n for n, g in self.handed if g == self.gen}
        return {
            "paused": set(w._paused) - w._parked - set(w._orphans),
            "resuming": set(w._resuming) - lost,
            "resuming under a lost lease": set(w._resuming) & lost,
            "orphans": set(w._orphans),
            "parked": set(w._parked),
        }

    def _busy(self) -> set[str]:
        """The VMs a thread is in a call for (or acts for): not at a quiet point."""
        return set().union(*(a.touched for a in self.actors if not a.done))

    @invariant()
    def no_vm_runs_on_holds_of_a_lost_lease(self) -> None:
        if self.acting_on_loss:
            return
        for v in VMS:
            if self.state[v] != RUNNING or self._valid(v):
                continue
            in_flight = any(
                a.run_gens.get(v, math.inf) < self.gen for a in self.actors if not a.done
            )
            assert in_flight, (
                f"VM {v} runs on holds of generation {min(self.holds[v])} under {self.gen}"
            )

    @invariant()
    def every_paused_vm_is_in_one_hand(self) -> None:
        """A renewal's (paused, resuming) or the recovery's (orphans, parked, in its hands),
        never both. Twice on one side is allowed: two renewals resume it under one lease; a
        gate leaves an orphan to ``take_orphans`` (``resume_if_fresh``), the recovery wins it
        back once."""
        if any(a.waits for a in self.actors):
            return  # a take is under way: its names are in the watch's hands only
        busy = self._busy()
        w = self._watch_hands()
        renewal = {k: w[k] for k in ("paused", "resuming")}
        recovery = {k: w[k] for k in w if k not in renewal} | {"recovery": self.hands}
        for v in VMS:
            if self.state[v] != PAUSED or v in busy:
                continue
            ours = sorted(k for k, names in renewal.items() if v in names)
            theirs = sorted(k for k, names in recovery.items() if v in names)
            assert ours or theirs, f"paused VM {v} is in no hand: left paused for good"
            assert not (ours and theirs), f"paused VM {v} is both in {ours} and in {theirs}"
            if len(ours) + len(theirs) > 1:
                _event(f"a paused VM in {' and '.join(ours + theirs)}")

    @invariant()
    def a_renewal_hands_back_only_vms_that_hold_their_devices(self) -> None:
        """What the next renewal would resume holds its devices under the current lease (the
        watch's bookkeeping alone, ``lacks_holds`` aside), but a name handed back under a
        lost lease: its gate gives it to the recovery. Between ``take_paused`` and
        ``take_late`` what the watch pauses is the recovery's, taken late."""
        if self.taking_late or any(a.waits for a in self.actors):
            return
        w = self._watch_hands()
        for v in (w["paused"] | w["resuming"]) - self._busy():
            if self.state[v] == STOPPED or self._valid(v):
                continue
            where = sorted(k for k in ("paused", "resuming") if v in w[k])
            raise AssertionError(
                f"VM {v} is for a renewal to resume ({where}) on holds of generation"
                f" {min(self.holds[v])} under {self.gen}"
            )

    @invariant()
    def the_paused_count_counts_what_a_renewal_resumes(self) -> None:
        """Where no call is under way: the names a renewal hands back (or handed back, their
        resume to come), not one the recovery holds (parked, orphaned, in its hands); every
        VM that is paused for a renewal among them. By design a VM that runs may be among
        them until the next renewal resumes it again: the watch cannot tell that a resume
        whose answer was lost ran, nor that a re-check that found the lease in doubt before
        a renewal and paused it again landed after a resume the renewal let run."""
        if self.actors:
            return
        w = self._watch_hands()
        names = w["paused"] | w["resuming"] | w["resuming under a lost lease"]
        assert self.watch.paused_count() == len(names), (
            f"paused_count() is {self.watch.paused_count()} for {sorted(names)}:"
            f" {dict(w, recovery=self.hands)}"
        )


WatchMachine.TestCase.settings = derandomized(EXAMPLES, STEPS)
test_lease_watch_state_machine = WatchMachine.TestCase


# -- the sequences the machine found in main's watch.py, replayed step by step ---------------------

_QUICK: dict[str, object] = {"slow": False, "early": False}


_INVARIANTS = (
    WatchMachine.no_vm_runs_on_holds_of_a_lost_lease,
    WatchMachine.every_paused_vm_is_in_one_hand,
    WatchMachine.a_renewal_hands_back_only_vms_that_hold_their_devices,
    WatchMachine.the_paused_count_counts_what_a_renewal_resumes,
)


def _replay(*steps: tuple[str, Mapping[str, object]]) -> None:
    """A sequence the machine ran, replayed on a new one (``stateful.replay``)."""
    replay(WatchMachine(), _INVARIANTS, steps)


def test_a_name_whose_holds_check_fails_after_the_lease_was_lost_is_the_recoverys() -> None:
    """A renewal hands "a" back; the lease is lost before its resume thread reads its holds,
    and that read fails: ``hold_back`` must not keep "a" for the next lease's renewal (its
    holds went with the lost lease), but give it to the recovery, as the gate would."""
    _replay(
        ("time_passes", {"dt": TTL / 2 + 0.01}),
        ("the_watch_looks", _QUICK),  # pauses a, b, c
        ("a_renewal_answers", {}),  # hands them back under generation 0
        ("etcd_lets_the_lease_go", {}),
        ("the_lease_is_lost", _QUICK),  # generation 1: nothing paused to take
        ("a_new_lease", {"answered": False, **_QUICK}),
        ("a_resume_thread_runs", {"i": 0, "holds": "error", "outcome": "ok", **_QUICK}),
    )


def test_a_vm_parked_for_the_next_recovery_is_not_held_back_nor_counted() -> None:
    """The recovery parks a, b and c (the new lease ended while it re-reserved); a plug
    into "a" then finds the lease in doubt: "a" stays parked, not also held back for a
    renewal and counted as paused."""
    won: dict[str, object] = {"outcome": "won", "resumed": "ok", **_QUICK}
    _replay(
        ("etcd_lets_the_lease_go", {}),
        ("the_lease_is_lost", _QUICK),
        ("a_new_lease", {"answered": False, **_QUICK}),
        ("etcd_lets_the_lease_go", {}),
        ("the_recovery_takes_one", won),  # parked: the lease is gone
        ("the_recovery_takes_one", won),
        ("the_recovery_takes_one", won),
        ("time_passes", {"dt": TTL / 2 + 0.01}),
        ("a_plug_request_is_served", {"name": "a", "devices": 1, "slow": False}),
    )


def test_a_pause_after_the_orphans_were_taken_leaves_them_to_the_recovery() -> None:
    """The recovery's resume of "a" ran but its answer was lost: "a" runs, orphaned. The loop
    takes the orphans and, while its pause of "a" hangs, the lease comes in doubt and the
    watch pauses "a": it must stay the recovery's, not also be kept for the next renewal
    (which would resume it whatever the recovery decides)."""
    won: dict[str, object] = {"outcome": "won", "resumed": "ok", **_QUICK}
    _replay(
        ("etcd_lets_the_lease_go", {}),
        ("the_lease_is_lost", _QUICK),
        ("a_new_lease", {"answered": True, **_QUICK}),
        ("the_recovery_takes_one", {**won, "resumed": "lost"}),  # "a" runs, orphaned
        ("the_recovery_takes_one", won),
        ("the_recovery_takes_one", won),
        ("the_loop_takes_the_orphans", {"slow": True, "early": False}),  # its pause hangs
        ("time_passes", {"dt": TTL / 2 + 0.01}),
        ("the_watch_looks", _QUICK),  # pauses "a"
        ("land", {"i": 0}),  # the loop's pause of "a" is back
    )
