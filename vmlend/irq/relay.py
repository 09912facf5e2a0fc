"""The event loop both relay sides run on: one epoll, handlers per descriptor, a wake eventfd.

Handlers run with ``lock`` held, and so must every change made from another thread (a guest's
config-space write, a control request), which keeps each side single-threaded in effect.
Work deferred with ``defer`` runs once after each round of events, which lets a side batch all
interrupts it read in one round into one transport message.
"""

from __future__ import annotations

import logging
import select
import threading
from collections.abc import Callable

from vmlend.irq.eventfd import EventFd

log = logging.getLogger(__name__)

Handler = Callable[[int], None]


class Reactor:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._epoll = select.epoll()
        self._handlers: dict[int, Handler] = {}
        self._deferred: dict[Callable[[], None], None] = {}
        # Descriptors unregistered since the last round ended: an event for one may already
        # be in hand from this round's poll, and must not reach a later registration of the
        # same number (a stale hang-up would kill a fresh channel).
        self._retired: set[int] = set()
        self._wake = EventFd()
        # Guards the wake eventfd alone: ``stop`` and ``defer`` signal it from other threads
        # while the loop thread may be closing it; a signal landing after the close would hit
        # a dead descriptor or, worse, whatever reused its number. Reentrant, because a signal
        # handler calling ``stop`` may interrupt the thread that holds it.
        self._wake_lock = threading.RLock()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop_ident: int | None = None
        self._epoll.register(self._wake.fileno(), select.EPOLLIN)

    def register(self, fd: int, events: int, handler: Handler) -> None:
        with self.lock:
            self._handlers[fd] = handler
            self._epoll.register(fd, events)

    def modify(self, fd: int, events: int) -> None:
        with self.lock:
            self._epoll.modify(fd, events)

    def unregister(self, fd: int) -> None:
        """Forget ``fd``; call before closing it (a stale event for it is then ignored)."""
        with self.lock:
            if self._handlers.pop(fd, None) is not None:
                self._epoll.unregister(fd)
                self._retired.add(fd)

    def defer(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once on the loop thread after the current round of events."""
        with self.lock:
            self._deferred[fn] = None
        if threading.get_ident() != self._loop_ident:
            # Another thread: the loop may be asleep in epoll. From the loop itself the round's
            # end comes anyway, and a wake-up per round would cost two syscalls per interrupt.
            self._wake_up()

    def _wake_up(self) -> None:
        """Interrupt the loop's epoll wait; nothing to do once the reactor is closed."""
        with self._wake_lock:
            if not self._wake.closed:
                self._wake.signal()

    def run_deferred(self) -> None:
        with self.lock:
            while self._deferred:
                batch = list(self._deferred)
                self._deferred.clear()
                for fn in batch:
                    fn()

    def run(self) -> None:
        """Dispatch until ``stop``; in the calling thread."""
        self._loop_ident = threading.get_ident()
        wake = self._wake.fileno()
        while not self._stopping:
            events = self._epoll.poll()
            with self.lock:
                for fd, mask in events:
                    if fd == wake:
                        self._wake.drain()
                        continue
                    handler = self._handlers.get(fd)
                    if handler is not None and fd not in self._retired:
                        self._call(handler, mask)
                self._call(self.run_deferred)
                # Level-triggered: a live descriptor skipped here is reported again.
                self._retired.clear()
        self._loop_ident = None

    @staticmethod
    def _call(fn: Callable[..., None], *args: int) -> None:
        # One failing handler must not stop the relay of every other device.
        try:
            fn(*args)
        except Exception:
            log.exception("irq relay handler failed")

    def start(self, name: str = "irq-relay") -> None:
        """Run the loop in a daemon thread (tests, and a lender living inside another process)."""
        self._thread = threading.Thread(target=self.run, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Safe from signal handlers and other threads. A stopped reactor stays stopped."""
        self._stopping = True
        self._wake_up()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        self.stop()
        with self.lock:
            if self._handlers:
                log.debug("reactor closed with %d handlers still registered", len(self._handlers))
            self._handlers.clear()
            self._retired.clear()
            self._epoll.close()
            with self._wake_lock:
                self._wake.close()
