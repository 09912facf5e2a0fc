"""The reactor's lifecycle across threads: stop() from one thread while the loop thread closes.

The relay daemon runs its reactor in ``serve`` (loop, then close, in one thread) and is stopped
from another thread or a signal handler. That stop must never touch a descriptor the loop
thread has already closed: its number may by then belong to someone else.
"""

from __future__ import annotations

import os
import select
import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from vmlend.irq.eventfd import EventFd
from vmlend.irq.relay import Reactor


class Served:
    """A reactor run and then closed by its own thread, as ``RelayDaemon.serve`` does."""

    def __init__(self, reactor: Reactor) -> None:
        self.reactor = reactor
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="served-reactor", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.reactor.run()
        finally:
            self.reactor.close()
            self.closed.set()

    def join(self) -> None:
        self.thread.join(5)
        assert not self.thread.is_alive()


@pytest.fixture
def poke() -> Iterator[EventFd]:
    efd = EventFd()
    yield efd
    efd.close()


def test_stop_after_the_loop_thread_closed_the_reactor_is_harmless():
    served = Served(Reactor())
    served.reactor.stop()
    served.join()
    # A second SIGTERM, a supervisor's late stop, a late deferred call: nothing to wake.
    served.reactor.stop()
    served.reactor.defer(lambda: None)


def test_stop_racing_the_loop_threads_close_never_signals_a_closed_descriptor(monkeypatch, poke):
    reactor = Reactor()
    reactor.register(poke.fileno(), select.EPOLLIN, lambda _ev: poke.drain())
    served = Served(reactor)
    stopper = threading.get_ident()
    real_write = os.eventfd_write

    def write_after_the_loop_closed(fd: int, value: int) -> None:
        # The interleaving seen under load: the stopping thread is about to wake the loop when
        # the loop wakes for another event (here: poke), sees the stop and closes the reactor.
        # Give that close the chance to finish first (bounded: a correct reactor holds it back).
        if threading.get_ident() == stopper and fd != poke.fileno():
            real_write(poke.fileno(), 1)
            served.closed.wait(0.5)
        real_write(fd, value)

    monkeypatch.setattr(os, "eventfd_write", write_after_the_loop_closed)
    reactor.stop()
    served.join()


def test_an_event_for_a_closed_descriptor_never_reaches_the_one_that_reuses_its_number():
    # Two peers hung up in the same round. Whichever handler runs first closes the other's
    # socket and puts a fresh, healthy connection at the same number (what an attach after a
    # lender's hang-up does). The hang-up already polled for the closed one must not be handed
    # to the fresh one: to a transport channel it would mean "peer gone" and drop its devices.
    reactor = Reactor()
    dead = [socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET) for _ in range(2)]
    for _mine, theirs in dead:
        theirs.close()
    fresh: list[socket.socket] = []
    seen_by_fresh: list[int] = []

    def hung_up(me: int) -> Callable[[int], None]:
        def handle(_events: int) -> None:
            if fresh:
                return
            other = dead[1 - me][0]
            number = other.fileno()
            reactor.unregister(number)
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # both != number
            other.close()
            os.dup2(a.fileno(), number)  # the fresh one gets the closed one's number
            a.close()
            fresh.extend((socket.socket(fileno=number), b))
            reactor.register(number, select.EPOLLIN, seen_by_fresh.append)
            reactor.stop()  # after this round

        return handle

    for me, (mine, _theirs) in enumerate(dead):
        reactor.register(mine.fileno(), select.EPOLLIN, hung_up(me))
    reactor.run()
    reactor.close()
    try:
        assert fresh and seen_by_fresh == []
    finally:
        for s in fresh + [mine for mine, _ in dead]:
            s.close()
