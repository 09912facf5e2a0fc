"""A hung etcd member listed first costs one timeout per host, not one per process: the
host's short-lived processes (hook, CLI) share the endpoint that last answered in the host's
run dir, and the agent's one long-lived client keeps it."""

from __future__ import annotations

import pytest

from tests.support.hung_endpoint import HungEndpoint
from tests.support.simfabric import make_fabric
from vmlend.registry import open_registry


@pytest.fixture
def hung():
    endpoint = HungEndpoint()
    yield endpoint
    endpoint.close()


@pytest.mark.slow
def test_processes_of_a_host_skip_a_hung_first_endpoint_after_one_timeout(
    etcd, etcd_url, hung, tmp_path, monkeypatch
):
    make_fabric(etcd_url).close()
    cluster = etcd_url.rsplit("/", 1)[1]
    url = f"etcd://{hung.endpoint},{etcd.endpoint}/{cluster}"
    monkeypatch.setenv("VMLEND_ROOT", str(tmp_path / "host"))
    # The first process waits out the hung member once...
    with open_registry(url) as reg, reg.read() as tx:
        assert tx.has_topology()
    assert hung.connections == 1
    for _ in range(3):  # ...the next ones go straight to the member that answered
        with open_registry(url) as reg, reg.read() as tx:
            assert tx.has_topology()
    assert hung.connections == 1
    remembered = tmp_path / "host" / "run" / "vmlend" / "etcd-endpoint"
    assert etcd.endpoint in remembered.read_text()


def test_a_gateway_that_fails_over_keeps_the_endpoint_that_answered(etcd, hung, tmp_path):
    from vmlend.registry.etcd_gateway import Endpoint, EtcdGateway

    def ep(text: str) -> Endpoint:
        host, port = text.split(":")
        return Endpoint(host, int(port))

    gw = EtcdGateway([ep(hung.endpoint), ep(etcd.endpoint)], timeout=0.3)
    try:
        for _ in range(3):
            gw.range("/nothing")
        assert hung.connections == 1  # one client, one timeout: then it stays on etcd
    finally:
        gw.close()
