"""etcd without quorum: a member runs and accepts requests but cannot answer them. The error
says so ("no quorum"), not "start etcd", names where etcdctl comes from, and comes after about
one request timeout rather than a round of retries."""

from __future__ import annotations

import pytest

from tests.support.etcd_daemon import EtcdServer, start_members
from vmlend.errors import RegistryUnreachableError
from vmlend.registry.etcd_gateway import Endpoint, EtcdGateway, b64


def _ep(member: EtcdServer) -> Endpoint:
    return Endpoint("127.0.0.1", member.client_port)


@pytest.fixture
def two_members(tmp_path):
    members = start_members(tmp_path, 2)
    yield members
    for m in members:
        m.stop()


@pytest.mark.slow
@pytest.mark.daemon
def test_a_cluster_that_lost_its_quorum_is_reported_as_such(two_members):
    alive, dead = two_members
    gw = EtcdGateway([_ep(alive)])
    assert gw.range("/quorum")[0] > 0  # healthy: a leader answers
    gw.close()
    dead.stop()  # one member of two left: no quorum

    gw = EtcdGateway([_ep(dead), _ep(alive)], timeout=1.0)
    try:
        put = {"request_put": {"key": b64("/quorum"), "value": b64(b"1")}}
        for call in (lambda: gw.range("/quorum"), lambda: gw.txn([], [put])):
            with pytest.raises(RegistryUnreachableError) as e:
                call()
            message = str(e.value)
            assert "no quorum" in message and "start etcd" not in message, message
            assert "etcdctl endpoint health" in message and "etcd-client" in message
            assert "\n" not in message
    finally:
        gw.close()
