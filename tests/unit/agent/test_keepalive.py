"""The lease's keepalive (``vmlend.agent.keepalive``): each answer moves the lease's end to
its request's send time plus the TTL etcd granted; its failures are said once."""

from __future__ import annotations

import logging

from tests.support.clocks import FakeClock
from vmlend.agent.clock import LeaseClock, LeaseState
from vmlend.agent.keepalive import Keepalive
from vmlend.errors import RegistryUnreachableError
from vmlend.registry.session import LeaseLost


class Etcd:
    """A session whose keepalive takes ``latency`` seconds on the fake clock."""

    def __init__(self, now: FakeClock, latency: float = 0.0) -> None:
        self.now = now
        self.latency = latency
        self.answer: Exception | int = 10

    def keepalive(self, lease: int) -> int:
        self.now.advance(self.latency)
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def test_a_slow_answer_counts_from_when_the_keepalive_was_sent():
    now = FakeClock()
    clock = LeaseClock(now)
    clock.start(7, 10, now(), followed=True)
    etcd = Etcd(now, latency=0.3)
    renewed: list[int] = []
    ka = Keepalive(clock, lambda: etcd, now=now, renewed=lambda: renewed.append(1))
    now.advance(4)
    sent = now()
    assert ka.renew_once()
    assert abs(clock.view().left - (sent + 10 - now())) < 1e-9  # 9.7 s left, not 10
    assert renewed == [1]


def test_etcd_saying_the_lease_is_gone_makes_it_lost_and_no_more_keepalives_are_sent():
    now = FakeClock()
    clock = LeaseClock(now)
    clock.start(7, 10, now(), followed=True)
    etcd = Etcd(now)
    etcd.answer = LeaseLost("lease 7 expired")
    ka = Keepalive(clock, lambda: etcd, now=now)
    assert not ka.renew_once()
    assert clock.view().state is LeaseState.LOST
    etcd.answer = 10
    assert not ka.renew_once()  # gone stays gone: the agent takes the next lease
    assert clock.view().state is LeaseState.LOST


def test_failures_while_etcd_is_away_are_said_once_and_the_return_once(caplog):
    now = FakeClock()
    clock = LeaseClock(now)
    clock.start(7, 10, now(), followed=True)
    etcd = Etcd(now)
    etcd.answer = RegistryUnreachableError("e:1", "cannot reach etcd at e:1")
    failed: list[int] = []
    ka = Keepalive(clock, lambda: etcd, now=now, failed=lambda: failed.append(1))
    with caplog.at_level(logging.INFO, logger="vmlend.agent.keepalive"):
        for _ in range(5):
            assert not ka.renew_once()
        etcd.answer = 10
        assert ka.renew_once()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "renewing the lease: cannot reach etcd at e:1",
        "renewing the lease: works again (after 5 failure(s))",
    ]
    assert failed == [1] * 5
