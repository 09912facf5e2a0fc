"""``each_call_within``: a path that may give up early (the release: the agent lands what it
cannot) bounds each registry call, every endpoint and retry in it, by its own deadline; other
threads, and calls outside the block, keep the gateway's timeouts."""

from __future__ import annotations

import threading
import time

import pytest

from tests.support.hung_endpoint import HungEndpoint
from vmlend.errors import RegistryUnreachableError
from vmlend.registry.deadline import call_bound, each_call_within
from vmlend.registry.etcd_gateway import Endpoint, EtcdGateway


def _ep(text: str) -> Endpoint:
    host, port = text.split(":")
    return Endpoint(host, int(port))


@pytest.fixture
def two_hung():
    hung = [HungEndpoint(), HungEndpoint()]
    yield hung
    for h in hung:
        h.close()


def test_a_call_over_hung_endpoints_ends_at_the_deadline_not_after_each_timeout(two_hung):
    gw = EtcdGateway([_ep(h.endpoint) for h in two_hung], timeout=5.0)
    try:
        start = time.monotonic()
        with each_call_within(0.5), pytest.raises(RegistryUnreachableError) as e:
            gw.range("/anything")
        took = time.monotonic() - start
    finally:
        gw.close()
    assert took < 2.0, took  # without the deadline: 5 s per hung endpoint
    assert two_hung[0].connections == 1
    assert two_hung[1].connections == 0  # out of time before the second: not tried
    assert "not tried (out of time)" in str(e.value)
    assert "\n" not in str(e.value)


def test_a_healthy_etcd_answers_inside_the_block(etcd):
    gw = EtcdGateway([_ep(etcd.endpoint)])
    try:
        with each_call_within(0.5):
            assert gw.range("/nothing")[0] > 0
    finally:
        gw.close()


def test_the_deadline_is_the_blocks_and_this_threads_alone():
    seen: list[float | None] = []
    with each_call_within(0.5):
        assert call_bound() == 0.5
        other = threading.Thread(target=lambda: seen.append(call_bound()))
        other.start()
        other.join()
    assert seen == [None]
    assert call_bound() is None
