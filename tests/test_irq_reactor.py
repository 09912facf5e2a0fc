"""The reactor's lifecycle across threads: stop() from one thread while the loop thread closes.

The relay daemon runs its reactor in ``serve`` (loop, then close, in one thread) and is stopped
from another thread or a signal handler. That stop must never touch a descriptor the loop
thread has already closed: its number may by then belong to someone else.
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Iterator

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
