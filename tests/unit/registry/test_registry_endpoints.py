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


@pytest.mark.parametrize("bypass", [False, True])
def test_a_gateway_goes_through_the_proxy_the_environment_names_unless_no_proxy_exempts_etcd(
    etcd, bypass, monkeypatch
):
    from tests.support.etcd_daemon import free_port
    from vmlend.errors import RegistryUnreachableError
    from vmlend.registry.etcd_gateway import Endpoint, EtcdGateway

    for name in ("http_proxy", "HTTP_PROXY", "no_proxy", "NO_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{free_port()}")  # nobody listens
    if bypass:
        monkeypatch.setenv("no_proxy", "127.0.0.1")
    host, port = etcd.endpoint.split(":")
    gw = EtcdGateway([Endpoint(host, int(port))], timeout=1.0)
    try:
        for _ in range(2):  # the first request and the ones after it alike
            if bypass:
                gw.range("/nothing")
            else:
                with pytest.raises(RegistryUnreachableError):
                    gw.range("/nothing")
    finally:
        gw.close()
