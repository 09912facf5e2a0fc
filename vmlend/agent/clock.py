"""The lease's real end, on the agent's own monotonic clock: the guard's only input.

A keepalive sent at ``t`` and answered with a TTL of ``T`` keeps the lease until at least
``t + T`` (etcd restarts the TTL when it receives the request, which is after ``t``). So the
clock keeps ``end``, the latest such bound, and from it every thread reads one of three states:

- ``HELD``: more than half the TTL is left. VMs may run.
- ``DOUBT``: less than half the TTL is left, or the end has passed with etcd silent. A
  borrower pauses its VMs with remote devices now, before the lease can end and a lender hand
  their devices to another host (DESIGN, rule 2: the guard has its own clock). A keepalive
  that is answered makes it ``HELD`` again: the lease lived, so every hold on it did.
- ``LOST``: etcd said the lease is gone. Every hold on it is gone; the agent takes a new lease
  (the next ``generation``), moves what is left onto it, and only then (``followed``) may a VM
  win its devices back.

Nothing here blocks: the keepalive thread and the agent write; every VM's worker reads, and
waits on an event of its own that every write sets (``listen``) or until the moment ``HELD``
turns into ``DOUBT`` by the passing of time alone (``LeaseView.until_doubt``).
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from vmlend.events import EventLog, wall


class LeaseState(enum.StrEnum):
    HELD = "held"
    DOUBT = "doubt"
    LOST = "lost"


class LeaseView(NamedTuple):
    """The clock at one instant, for one decision."""

    state: LeaseState
    #: The lease (0: none yet).
    lease: int
    #: Which lease, counted by this agent: a new lease after a lost one is the next.
    generation: int
    #: This host's records are on this lease (moved from earlier ones): holds may be won back
    #: and VMs resumed under it.
    followed: bool
    #: Seconds to the lease's end (<= 0: passed).
    left: float
    ttl: float

    @property
    def until_doubt(self) -> float:
        """Seconds until this view turns ``DOUBT`` by time alone (inf: it is not ``HELD``)."""
        return self.left - self.ttl / 2 if self.state is LeaseState.HELD else math.inf

    @property
    def settled(self) -> bool:
        """VMs may run: the lease is held and this host's records are on it."""
        return self.state is LeaseState.HELD and self.followed


class LeaseClock:
    def __init__(
        self, clock: Callable[[], float] = time.monotonic, events: EventLog | None = None
    ) -> None:
        self._clock = clock
        #: The protocol's event log (``vmlend.events``; None: none, as in production).
        self.events = events
        self._cond = threading.Condition()
        #: Set on every write: each VM's worker waits on one of its own.
        self._listeners: set[threading.Event] = set()
        self._lease = 0
        self._ttl = 0.0
        self._end = -math.inf
        self._generation = 0
        self._gone = False
        self._followed = False
        #: When the last keepalive that was answered was sent (the lease's age counts from it).
        self.last_renewed = -math.inf

    def listen(self, event: threading.Event) -> None:
        with self._cond:
            self._listeners.add(event)

    def unlisten(self, event: threading.Event) -> None:
        with self._cond:
            self._listeners.discard(event)

    def _notify(self) -> None:
        self._cond.notify_all()
        for event in self._listeners:
            event.set()

    # --- writers ------------------------------------------------------------------------------
    def start(self, lease: int, ttl: float, sent: float, *, followed: bool) -> None:
        """A lease granted or adopted, its TTL counted from ``sent``; a new one (not the same
        lease adopted again) begins the next generation."""
        with self._cond:
            if lease != self._lease:
                self._generation += 1 if self._lease else 0
                self._lease = lease
                self._end = -math.inf
            self._ttl = float(ttl)
            self._end = max(self._end, sent + ttl)
            self._gone = False
            self._followed = followed
            self.last_renewed = max(self.last_renewed, sent)
            if self.events is not None:  # in the lock: a reader's later event comes after
                kind = "lease-adopted" if followed else "lease-granted"
                self.events.note(kind, lease=lease, ttl=float(ttl), sent=wall(sent))
            self._notify()

    def followed(self, lease: int, done: float | None = None) -> None:
        """This host's records are on ``lease`` now (moved there at ``done``, this clock's
        time, when known)."""
        with self._cond:
            if lease == self._lease:
                self._followed = True
                if self.events is not None:
                    at = {"done": wall(done)} if done is not None else {}
                    self.events.note("lease-followed", lease=lease, **at)
                self._notify()

    def renewed(self, lease: int, sent: float, ttl: float) -> None:
        """A keepalive of ``lease`` sent at ``sent`` was answered with ``ttl``."""
        with self._cond:
            if lease != self._lease or self._gone:
                return  # a late answer for a lease replaced since, or one etcd said is gone
            self._ttl = float(ttl)
            self._end = max(self._end, sent + ttl)
            self.last_renewed = max(self.last_renewed, sent)
            if self.events is not None:
                self.events.note("lease-renewed", lease=lease, ttl=float(ttl), sent=wall(sent))
            self._notify()

    def gone(self, lease: int) -> None:
        """etcd said ``lease`` is gone."""
        with self._cond:
            if lease == self._lease:
                if self.events is not None and not self._gone:
                    self.events.note("lease-lost", lease=lease)
                self._gone = True
                self._notify()

    def poke(self) -> None:
        """Wake every waiter (every VM's worker looks again)."""
        with self._cond:
            self._notify()

    # --- readers ------------------------------------------------------------------------------
    def view(self) -> LeaseView:
        with self._cond:
            return self._view()

    def _view(self) -> LeaseView:
        left = self._end - self._clock()
        if self._gone:
            state = LeaseState.LOST
        elif left > self._ttl / 2:
            state = LeaseState.HELD
        else:
            state = LeaseState.DOUBT
        return LeaseView(
            state, self._lease, self._generation, self._followed, left, self._ttl
        )

    def wait(self, seen: LeaseView, timeout: float) -> LeaseView:
        """Wait up to ``timeout`` for the state to differ from ``seen`` (a write, or ``HELD``
        turning ``DOUBT`` as time passes); the view then."""
        deadline = self._clock() + timeout
        with self._cond:
            while True:
                now = self._view()
                if now[:4] != seen[:4]:
                    return now
                wait = deadline - self._clock()
                if now.state is LeaseState.HELD:
                    wait = min(wait, now.left - now.ttl / 2)  # until half the TTL is left
                if wait <= 0:
                    return now
                self._cond.wait(wait)

    def age(self) -> float:
        """Seconds since the last answered keepalive was sent (inf: none yet)."""
        return self._clock() - self.last_renewed
