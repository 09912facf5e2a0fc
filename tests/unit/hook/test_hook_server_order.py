"""The agent's hook server runs calls in the order their connections were accepted, whatever
order their readers finish in (``vmlend.hook.server.AcceptOrder``): a release whose hook timed
out must not run after the next prepare of its VM. The end-to-end case is in
``test_hook_agent.py``; here every finishing order is explored."""

from __future__ import annotations

import random
import threading

from hypothesis import given
from hypothesis import strategies as st

from vmlend.hook.server import AcceptOrder


@st.composite
def finishing(draw: st.DrawFn) -> tuple[int, list[int], set[int]]:
    """How many connections, the order their readers finish in, and which were dropped."""
    n = draw(st.integers(min_value=0, max_value=12))
    order = draw(st.permutations(range(n)))
    dropped = draw(st.sets(st.sampled_from(range(n))) if n else st.just(set()))
    return n, list(order), dropped


@given(finishing())
def test_calls_are_handed_on_in_accept_order_once_every_earlier_reader_is_done(case):
    n, order, dropped = case
    finished: set[int] = set()
    handed: list[int] = []

    def hand_on(ticket: int) -> None:
        assert finished >= set(range(ticket + 1)), "handed on before an earlier reader was done"
        handed.append(ticket)

    in_order: AcceptOrder[int] = AcceptOrder(hand_on)
    tickets = [in_order.ticket() for _ in range(n)]
    assert tickets == list(range(n))
    for ticket in order:
        finished.add(ticket)
        in_order.finish(ticket, None if ticket in dropped else ticket)
    assert handed == [t for t in range(n) if t not in dropped]


def test_readers_finishing_on_many_threads_still_hand_on_in_accept_order():
    handed: list[int] = []
    in_order: AcceptOrder[int] = AcceptOrder(handed.append)
    tickets = [in_order.ticket() for _ in range(400)]
    shuffled = random.Random(7).sample(tickets, len(tickets))
    workers = [
        threading.Thread(target=lambda part=shuffled[i::8]: [in_order.finish(t, t) for t in part])
        for i in range(8)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert handed == tickets
