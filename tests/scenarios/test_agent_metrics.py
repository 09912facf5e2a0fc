"""``vmlend agent --metrics``, scraped over HTTP while the agent serves the hook: a real etcd,
the agent as a process of a simulated host (``tests/support/cluster_hosts.py``), a hook call
forwarded to it as the installed hook does, and ``urllib.request`` as the scraper. The agent
is stopped by its PID; every address is loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.cluster_hosts import GPU, TTL, VMLEND, WEB, Host, domain_xml
from tests.support.etcd_daemon import free_port
from tests.support.simfabric import make_fabric
from vmlend.hook.forward import forward, socket_path

WAIT = 30.0


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=WAIT) as answer:
        assert answer.status == 200
        text = answer.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def wait_for_socket(host: Host) -> None:
    """The agent serves the hook once its start-up is done: until then there is no socket."""
    path = socket_path(host.env)
    deadline = time.monotonic() + WAIT
    while not os.path.exists(path):
        assert host.agent is not None and host.agent.poll() is None, host.log()
        assert time.monotonic() < deadline, f"the agent never served the hook\n{host.log()}"
        time.sleep(0.05)


@pytest.fixture
def gamma(etcd_url, tmp_path):
    make_fabric(etcd_url).close()
    host = Host(etcd_url, "gamma", tmp_path / "gamma")
    yield host
    host.stop_agent()


def test_a_scrape_while_the_agent_serves_hooks_counts_them_and_matches_status(gamma):
    port = free_port()
    gamma.start_agent("--metrics", f"127.0.0.1:{port}")
    wait_for_socket(gamma)
    xml = domain_xml("web", WEB.vm_uuid, (GPU,))
    assert forward(["web", "prepare", "begin", "-"], xml, gamma.env) == 0  # the agent ran it

    got = scrape(port)
    op = frozenset({("op", "prepare")})
    assert got[("vmlend_hook_calls_total", op)] == 1
    assert got[("vmlend_hook_call_duration_seconds_count", op)] == 1
    assert 0 <= got[("vmlend_lease_age_seconds", frozenset())] < TTL
    assert got[("vmlend_lease_ttl_seconds", frozenset())] == TTL
    assert got[("vmlend_paused_vms", frozenset())] == 0
    assert got[("vmlend_registry_up", frozenset())] == 1
    assert got[("vmlend_holds", frozenset({("node", "gamma")}))] == 1
    assert got[("vmlend_fences_pending", frozenset())] == 0
    assert ("vmlend_registry_txn_retries_total", frozenset()) in got

    status = gamma.vmlend("status", "-c", "sim:///gamma", "--json")
    assert status.returncode == 0, status.stderr
    rows = json.loads(status.stdout)["adapters"]
    assert rows and any(r["lut_used"] for r in rows)  # the prepare's hold shows
    for r in rows:
        adapter = frozenset({("adapter", r["adapter"])})
        assert got[("vmlend_adapter_lut_entries_used", adapter)] == r["lut_used"]
        assert got[("vmlend_adapter_lut_entries", adapter)] == r["lut_usable"]
        assert got[("vmlend_adapter_window_bytes_used", adapter)] == r["window_used"]
        assert got[("vmlend_adapter_window_bytes", adapter)] == r["window_size"]
        assert got[("vmlend_adapter_segments_used", adapter)] == r["segments_used"]
        assert got[("vmlend_adapter_segments", adapter)] == r["segments"]

    assert forward(["web", "release", "end", "-"], xml, gamma.env) == 0
    again = scrape(port)
    assert again[("vmlend_hook_calls_total", frozenset({("op", "release")}))] == 1
    assert again[("vmlend_hook_calls_total", op)] == 1

    assert gamma.stop_agent() == 0  # a clean stop, by its PID, takes the endpoint with it
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=WAIT).close()


def test_a_port_in_use_stops_the_agent_before_it_takes_a_lease(gamma):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        run = gamma.vmlend("agent", "--metrics", f"127.0.0.1:{port}")
    assert run.returncode != 0
    [line] = run.stderr.strip().splitlines()
    assert f"127.0.0.1:{port}" in line and "cannot listen" in line
    assert not gamma.lease_file.exists()


def scrape_until(port: int, what: str, check, host: Host):
    """Scrape until ``check(samples)`` holds (bounded); the samples that satisfied it."""
    deadline = time.monotonic() + WAIT
    while not check(got := scrape(port)):
        assert time.monotonic() < deadline, f"{what} never showed\n{host.log()}"
        time.sleep(0.1)
    return got


@pytest.mark.slow
def test_an_etcd_outage_shows_as_renew_failures_paused_vms_and_registry_down(
    private_etcd, tmp_path, monkeypatch
):
    """What an operator alerts on when a host's lease flaps: etcd goes away, the agent fails
    its renewals and pauses its VM with a remote device; etcd returns, the VM runs again and
    the failures stay counted."""
    from vmlend.hypervisor.base import DomainState
    from vmlend.wiring.hypervisor import open_hypervisor

    url = private_etcd.url("metrics")
    make_fabric(url).close()
    gamma = Host(url, "gamma", tmp_path / "gamma")
    monkeypatch.setenv("VMLEND_ROOT", str(gamma.root))
    port = free_port()
    ttl = 6  # long enough to pause at TTL/2 and come back before the lease ends
    gamma.agent = subprocess.Popen(
        [
            VMLEND,
            "agent",
            "--ttl",
            str(ttl),
            "--interval",
            "0.2",
            "--connect",
            "sim:///gamma",
            "--metrics",
            f"127.0.0.1:{port}",
        ],
        env=gamma.env,
        stdout=(log := (gamma.root / "agent.log").open("ab")),
        stderr=log,
        stdin=subprocess.DEVNULL,
    )
    log.close()
    try:
        wait_for_socket(gamma)  # its start-up is done: it guards the VMs
        hook = [sys.executable, "-m", "vmlend.hook", "--registry", url, "--node", "gamma"]
        hv = open_hypervisor("sim:///gamma", state_dir=gamma.root, hook_command=hook)
        hv.define(domain_xml("web", WEB.vm_uuid, (GPU,)))
        hv.start("web")
        before = scrape(port)
        assert before[("vmlend_paused_vms", frozenset())] == 0
        assert before[("vmlend_lease_renew_failures_total", frozenset())] == 0

        private_etcd.stop()
        away = scrape_until(  # the ledger's read is cached for a while: both, eventually
            port,
            "the paused VM and the registry down",
            lambda s: s[("vmlend_paused_vms", frozenset())] == 1
            and s[("vmlend_registry_up", frozenset())] == 0,
            gamma,
        )
        assert hv.lookup("web").state is DomainState.PAUSED
        assert away[("vmlend_lease_renew_failures_total", frozenset())] >= 1
        assert away[("vmlend_lease_age_seconds", frozenset())] > ttl / 2
        assert away[("vmlend_registry_up", frozenset())] == 0
        assert not any(name.startswith("vmlend_adapter_") for name, _ in away)

        private_etcd.start()
        back = scrape_until(
            port,
            "the resumed VM",
            lambda s: s[("vmlend_paused_vms", frozenset())] == 0,
            gamma,
        )
        assert hv.lookup("web").state is DomainState.RUNNING
        assert back[("vmlend_lease_renew_failures_total", frozenset())] >= 1
        assert back[("vmlend_leases_lost_total", frozenset())] == 0  # the lease lived
        assert back[("vmlend_lease_age_seconds", frozenset())] < ttl / 2
    finally:
        assert gamma.stop_agent() == 0
