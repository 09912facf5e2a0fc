"""The lease's keepalive, on a thread and an etcd connection of its own.

Renewals never wait behind anything else the agent does (a fence scan, a hypervisor call, a
registry read, a recovery): each is one request with a deadline of TTL/4 (``call_deadline``),
sent TTL/5 after the previous one was sent, and TTL/10 after one failed (every moment counts
before the lease ends). Each answer moves the lease's end on the clock to the request's send
time plus the TTL etcd granted (``LeaseClock.renewed``); etcd saying the lease is gone is
``LeaseClock.gone``. So a renewal that takes its whole deadline still lands with more than half
the TTL left (1 - 1/5 - 1/4 > 1/2): latency alone never puts the lease in doubt.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from vmlend.agent.clock import LeaseClock, LeaseState
from vmlend.agent.trouble import Trouble
from vmlend.errors import StateError
from vmlend.registry.session import LeaseLost

log = logging.getLogger(__name__)


class Renews(Protocol):
    def keepalive(self, lease: int) -> int: ...


class Keepalive:
    def __init__(
        self,
        clock: LeaseClock,
        session: Callable[[], Renews],
        *,
        now: Callable[[], float] = time.monotonic,
        renewed: Callable[[], None] = lambda: None,
        failed: Callable[[], None] = lambda: None,
    ) -> None:
        self._clock = clock
        #: The session to renew through (a callable: a configuration reload replaces it).
        self._session = session
        self._now = now
        self._renewed = renewed
        self._failed = failed
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._trouble = Trouble(log, "renewing the lease")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="keepalive", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Renew now (the agent took or adopted a lease)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()

    def renew_once(self) -> bool:
        """One keepalive of the clock's lease; whether it was answered."""
        view = self._clock.view()
        if not view.lease or view.state is LeaseState.LOST:
            return False  # none yet, or gone: the agent takes the next one
        sent = self._now()
        try:
            ttl = self._session().keepalive(view.lease)
        except LeaseLost as e:
            log.warning("%s", e)
            self._clock.gone(view.lease)
            self._trouble.cleared()  # a new lease starts afresh
            self._failed()
            return False
        except StateError as e:
            # Routine while etcd is away: said once; the guard says what it does about it.
            self._trouble.failed(e)
            self._failed()
            return False
        self._trouble.cleared()
        self._clock.renewed(view.lease, sent, ttl)
        self._renewed()
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            sent = self._now()
            ok = self.renew_once()
            ttl = self._clock.view().ttl or 3.0
            pause = ttl / 5 if ok else ttl / 10
            self._wake.wait(max(0.05, sent + pause - self._now()))
            self._wake.clear()
