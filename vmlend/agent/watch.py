"""The borrower's watch over its own lease, on its own thread and its own clock.

The lease is renewed by the agent's loop, and any registry call there may block (a silent
partition: TCP connections that never answer). Were the pause decided in that loop, a VM with
remote devices would run on while the loop waits, long after etcd let the lease go and a lender
gave the device to another host. So the watch measures, on a monotonic clock of its own, the
time since the last *successful* renewal, and pauses the VMs with remote devices once half the
TTL has passed, whatever the loop is doing. A later good renewal resumes what it paused.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)


class LeaseWatch:
    """``pause()`` once ``ttl / 2`` has passed on ``clock`` since the last ``renewed()``;
    ``renewed()`` hands back the names paused, for the caller to resume."""

    def __init__(
        self,
        ttl: float,
        pause: Callable[[], list[str]],
        *,
        clock: Callable[[], float] = time.monotonic,
        tick: float = 0.1,
        suspend: Callable[[str], object] | None = None,
    ) -> None:
        self._ttl = ttl
        self._pause = pause
        #: Pauses one VM again whose resume landed late (a doubt began meanwhile).
        self._suspend = suspend
        self._clock = clock
        self._tick = tick
        # Never held across a hypervisor call of ``pause``: a renewal must not wait for one.
        self._lock = threading.Lock()
        #: Notified when a pause in progress (``_pausing``) is done.
        self._paused_done = threading.Condition(self._lock)
        self._pausing = False
        self._last_ok = clock()
        self._paused: list[str] = []
        #: Handed back by ``renewed`` and not yet resumed (or held back) by ``resume_if_fresh``:
        #: with the lease (generation) each was handed back under.
        self._resuming: dict[str, int] = {}
        #: Given to the recovery (``take_*``, ``withdraw``) and not given back (its gate,
        #: ``park``, ``orphan``): one a pause or a re-check pauses meanwhile goes back to it
        #: (``_hold_back``), never to a renewal. The first renewal that hands back forgets the
        #: rest: the recovery runs on the loop, so it is done by then.
        self._recovering: set[str] = set()
        #: VMs a plug request is plugging devices into, with the lease it began under: no
        #: gate resumes them meanwhile (``_deferred``: one asked; the recovery takes them).
        self._plugging: dict[str, int] = {}
        self._deferred: set[str] = set()
        #: Paused VMs whose holds went with a lease: only a recovery may resume them.
        self._parked: set[str] = set()
        #: One per lease: ``take_paused`` (the lease is lost) starts the next.
        self._generation = 0
        #: VMs whose resume began under an earlier lease and landed after it was lost: paused
        #: again, for the recovery (``take_orphans``).
        self._orphans: list[str] = []
        self.in_doubt = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def renewed(self, *, hand_back: bool = True) -> list[str]:
        """A renewal succeeded: the clock starts again. The VMs the watch paused (with
        ``hand_back`` false, none: they stay paused for the next renewal to hand back)."""
        with self._lock:
            self._last_ok = self._clock()
            self.in_doubt = False
            if not hand_back:
                return []
            self._recovering.clear()
            names, self._paused = self._paused, []
            out = [
                n for n in dict.fromkeys(names) if n not in self._parked and n not in self._orphans
            ]
            self._resuming.update(dict.fromkeys(out, self._generation))
            return out

    def park(self, name: str) -> None:
        """Keep the paused VM ``name`` for the recovery under the next lease: the lease its
        devices were re-reserved under ended. No renewal resumes it (``renewed``)."""
        with self._lock:
            self._recovering.discard(name)
            self._parked.add(name)

    def age(self) -> float:
        """Seconds since the last successful renewal (or since the watch began)."""
        with self._lock:
            return self._clock() - self._last_ok

    def paused_count(self) -> int:
        """How many VMs the watch paused and are not resumed yet (a resume under way
        included)."""
        with self._lock:
            return len(set(self._paused) | self._resuming.keys())

    def check(self) -> bool:
        """One look: pause when in doubt for the first time. Whether it paused now.

        The pause runs outside the lock: a hypervisor slow to answer (a start whose hook hangs
        holds it) must not hold up ``renewed``, or the agent's loop would renew nothing more and
        the lease would end while etcd answers. ``in_doubt`` is set first, under the lock, so
        ``resume_if_fresh`` resumes nothing from then on; what this pause paused after a renewal
        landed is handed back by the next one (within TTL/3), or taken by ``take_paused``."""
        with self._lock:
            if self.in_doubt or self._clock() - self._last_ok <= self._ttl / 2:
                return False
            self.in_doubt = True
            self._pausing = True
            if math.isinf(self._last_ok):
                log.warning("lease gone: pausing VMs with remote devices")
            else:
                log.warning(
                    "lease not renewed for %.1f s (half the TTL of %g s): pausing VMs with"
                    " remote devices",
                    self._clock() - self._last_ok,
                    self._ttl,
                )
        paused: list[str] = []
        try:
            paused = self._pause()
        finally:
            with self._lock:
                # with any VM ``resume_if_fresh`` held back; not one given to the recovery
                for n in paused:
                    self._hold_back(n)
                self._pausing = False
                self._paused_done.notify_all()
        return True

    def _fresh(self) -> bool:
        return not self.in_doubt and self._clock() - self._last_ok <= self._ttl / 2

    def _hold_back(self, name: str) -> None:
        """For the next renewal to hand back; not one given to the recovery: one it holds
        goes back to it (``take_orphans``), and its gate resumes nothing meanwhile."""
        if name in self._recovering:
            self._orphan(name)
        elif name not in self._paused and name not in self._orphans and name not in self._parked:
            self._paused.append(name)

    @property
    def generation(self) -> int:
        """Which lease this is, counted by the watch: ``take_paused`` (the lease was lost)
        starts the next. Read it with ``renewed`` to know which lease a name was for."""
        with self._lock:
            return self._generation

    def resume_if_fresh(
        self, name: str, resume: Callable[[], None], generation: int | None = None
    ) -> bool:
        """``resume()`` the paused VM ``name`` only while the lease is not in doubt; whether it
        runs now. Otherwise it stays paused as one the watch paused: the next good renewal
        resumes it (``renewed``), a lost lease hands it to the recovery (``take_paused``).
        ``generation``: the lease it was paused under (``generation`` read with ``renewed``);
        if that lease was lost since, it is the recovery's (``take_orphans``), not resumed.

        ``resume()`` runs outside the lock, so a doubt may begin while the hypervisor resumes
        it, and the pause may pass it by as paused: once the resume is back, or failed, the
        watch looks again (``recheck``)."""
        try:
            with self._lock:
                if generation is None:  # the recovery's gate: the watch's to decide again
                    generation = self._generation
                    self._recovering.discard(name)
                elif name in self._recovering:  # the recovery took it since: it resumes it
                    return False
                if name in self._plugging:  # devices on their way in: the recovery's after
                    self._deferred.add(name)
                    return False
                if name in self._orphans:  # the recovery's already
                    return False
                if self._generation != generation:
                    self._orphan(name)
                    return False
                if not self._fresh():
                    self._hold_back(name)
                    return False
            try:
                resume()
            except BaseException:
                # It may have run or not: looked at again; still paused, the next renewal
                # tries again (or the recovery, if the lease was lost meanwhile).
                if self.recheck(name, generation):
                    with self._lock:
                        self._hold_back(name)
                raise
            return self.recheck(name, generation)
        finally:
            with self._lock:
                self._resuming.pop(name, None)

    def recheck(self, name: str, generation: int) -> bool:
        """After a hypervisor call that may have let ``name`` run (a resume, a hot-plug that
        began under lease ``generation``): whether it may run now. If the lease came in doubt
        meanwhile, it is paused again and held back for the next renewal; if the lease was
        lost meanwhile, its holds may be gone with it: paused again, for the recovery
        (``take_orphans``). Recorded even if the pause fails (the recovery pauses first)."""
        with self._lock:
            lost = self._generation != generation
            if not lost and self._fresh():
                return True
        log.warning(
            "VM %s may run as the lease %s: pausing it again",
            name,
            "was lost" if lost else "came in doubt",
        )
        try:
            if self._suspend is not None:
                self._suspend(name)
        except Exception:  # recorded below all the same
            log.exception("could not pause %s again", name)
        finally:
            with self._lock:
                if lost or self._generation != generation:
                    self._orphan(name)
                else:
                    self._hold_back(name)
        return False

    def _orphan(self, name: str) -> None:
        """The recovery's (under the lock): no renewal may hand it back meanwhile."""
        self._paused = [n for n in self._paused if n != name]
        self._recovering.discard(name)
        self._orphans.append(name)

    def orphan(self, name: str) -> None:
        """Give the paused VM ``name`` to the recovery on the loop's next turn (one the
        recovery could not finish: the registry was away)."""
        with self._lock:
            self._resuming.pop(name, None)
            self._orphan(name)

    def hold_back(self, name: str) -> None:
        """Keep the paused VM ``name`` for the next renewal to hand back (its resume could
        not be decided now)."""
        with self._lock:
            if self._resuming.pop(name, self._generation) != self._generation:
                self._orphan(name)  # handed back under a lease lost since: the recovery's
            else:
                self._hold_back(name)

    @contextlib.contextmanager
    def plugging(self, name: str) -> Iterator[Callable[[], None]]:
        """Around a plug request's hot-plugs into ``name``: yields the check to call after
        each device plugged (``recheck`` under the lease the request began under). Meanwhile
        no gate resumes ``name``: the recovery would resume it with the devices it knows of,
        and a hot-plug landing after would run on a device whose hold is gone. One that was
        asked to goes to the recovery at the end."""
        with self._lock:
            generation = self._plugging[name] = self._generation

        def checkpoint() -> None:
            self.recheck(name, generation)

        try:
            yield checkpoint
        finally:
            with self._lock:
                self._plugging.pop(name, None)
                deferred = name in self._deferred
                self._deferred.discard(name)
                if deferred:
                    self._orphan(name)
            if not deferred:  # a hot-plug that failed may have landed all the same
                self.recheck(name, generation)

    def expire(self) -> None:
        """The lease is gone (etcd said so outside the loop): in doubt at once, so no gate
        resumes anything, and the next look pauses what runs."""
        with self._lock:
            self._last_ok = -math.inf

    def take_orphans(self) -> list[str]:
        """The VMs a late resume ran after the lease was lost, paused again: for the
        recovery, like those of ``take_paused``."""
        with self._lock:
            names, self._orphans = list(dict.fromkeys(self._orphans)), []
            self._take(names)  # what a pause in progress paused must not land after this
            self._recovering.update(names)
            return names

    def take_late(self) -> list[str]:
        """The VMs paused since ``take_paused`` (a pause in progress included: it waits for
        it), for the recovery under the new lease; the watch's clock is left as it is."""
        with self._lock:
            names = [n for n in self._take() if n not in self._parked]
            self._recovering.update(names)
            return names

    def withdraw(self, names: list[str]) -> list[str]:
        """Those of ``names`` the watch paused (a pause in progress included), taken out of
        its hands: no renewal resumes them (the caller recovers them)."""
        with self._lock:
            taken = self._take(names)
            self._recovering.update(taken)
            return taken

    def take_paused(self) -> list[str]:
        """The VMs paused so far and those parked (the lost-lease path takes them over), a
        pause in progress included: it waits for that one, since the recovery needs the
        hypervisor anyway."""
        with self._lock:
            names = self._take()
            names += sorted(self._parked - set(names))
            self._parked.clear()
            self._recovering.update(names)
            self._generation += 1
            return names

    def _take(self, names: list[str] | None = None) -> list[str]:
        """Under the lock, once a pause in progress is done: take ``names`` (None: all) out of
        the paused; those that were there."""
        while self._pausing:
            self._paused_done.wait()
        taken = [n for n in dict.fromkeys(self._paused) if names is None or n in names]
        self._paused = [n for n in self._paused if n not in taken]
        return taken

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lease-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            try:
                self.check()
            except Exception:  # the watch must outlive one bad look (it is all that guards)
                log.exception("lease watch: a check failed")
