"""The lease clock (``vmlend.agent.clock``): the lease's real end from each keepalive's send
time, and the three states every VM's worker reads."""

from __future__ import annotations

import threading

from tests.support.clocks import FakeClock
from vmlend.agent.clock import LeaseClock, LeaseState


def test_a_renewal_keeps_the_lease_until_its_send_time_plus_the_ttl_granted():
    now = FakeClock()
    clock = LeaseClock(now)
    clock.start(7, 10, now(), followed=True)
    sent = now()
    now.advance(0.3)  # 300 ms on the way: the answer comes late, the bound is the send time
    clock.renewed(7, sent, 10)
    view = clock.view()
    assert view.state is LeaseState.HELD and abs(view.left - 9.7) < 1e-9
    now.advance(4.6)  # 4.9 s after the send: more than half the TTL is left
    assert clock.view().state is LeaseState.HELD
    now.advance(0.2)  # 5.1 s: less than half left
    assert clock.view().state is LeaseState.DOUBT
    now.advance(6.0)  # past the end, etcd silent: still only in doubt (it may have lived on)
    assert clock.view().state is LeaseState.DOUBT and clock.view().left < 0


def test_an_answer_never_moves_the_end_backwards_nor_counts_for_another_lease():
    now = FakeClock()
    clock = LeaseClock(now)
    clock.start(7, 10, now(), followed=True)
    early = now()
    now.advance(3)
    clock.renewed(7, now(), 10)  # a later keepalive's answer came first
    clock.renewed(7, early, 10)  # the earlier one's answer after it
    assert clock.view().left == 10
    clock.renewed(8, now() + 100, 10)  # another lease's: not this one's
    assert clock.view().left == 10


def test_etcd_saying_gone_is_lost_until_a_new_lease_and_a_new_one_is_the_next_generation():
    now = FakeClock()
    clock = LeaseClock(now)
    clock.start(7, 10, now(), followed=True)
    assert clock.view().generation == 0 and clock.view().settled
    clock.gone(7)
    clock.renewed(7, now(), 10)  # a late answer cannot bring it back
    assert clock.view().state is LeaseState.LOST and not clock.view().settled
    clock.start(9, 10, now(), followed=False)
    view = clock.view()
    assert (view.state, view.lease, view.generation) == (LeaseState.HELD, 9, 1)
    assert not view.settled  # held, but this host's records are not on it yet
    clock.followed(9)
    assert clock.view().settled
    clock.start(9, 10, now(), followed=True)  # the same lease again (adopted): same generation
    assert clock.view().generation == 1


def test_until_doubt_is_when_half_the_ttl_is_left_and_a_listener_is_woken_by_every_write():
    now = FakeClock()
    clock = LeaseClock(now)
    clock.start(7, 4, now(), followed=True)
    assert clock.view().until_doubt == 2.0
    woken = threading.Event()
    clock.listen(woken)
    clock.renewed(7, now(), 4)
    assert woken.is_set()
    woken.clear()
    clock.unlisten(woken)
    clock.gone(7)
    assert not woken.is_set()
    assert clock.view().until_doubt == float("inf")


def test_the_age_counts_from_the_last_answered_keepalives_send_time():
    now = FakeClock()
    clock = LeaseClock(now)
    assert clock.age() == float("inf")
    clock.start(7, 10, now(), followed=True)
    sent = now()
    now.advance(2)
    clock.renewed(7, sent, 10)
    assert clock.age() == 2


def test_a_follow_is_noted_with_when_its_records_moved(tmp_path):
    """The history places a follow when etcd took its move, not when the agent says so: an
    agent stopped in between (seed 20, 2026-11-30) says so after its lease ended."""
    import time

    from tests.support.replay import read_events
    from vmlend.events import EVENTS_FILE, EventLog

    clock = LeaseClock(time.monotonic, EventLog(tmp_path, "beta"))
    clock.start(9, 2, time.monotonic(), followed=False)
    clock.followed(9, time.monotonic() - 3.0)  # moved 3 s ago, stopped past the TTL since
    follow = [e for e in read_events(tmp_path / EVENTS_FILE) if e.kind == "lease-followed"]
    assert len(follow) == 1
    assert abs(follow[0].fields["done"] - (follow[0].t - 3.0)) < 0.5
