"""``vmlend agent`` as a service (``vmlend.agent.service``), as separate processes on a real
etcd: one host per node name, one agent per host, and restarts that touch no VM (issue 35,
points 4 and 5)."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.support.cluster_hosts import GPU, NIC, TTL, VMLEND, WEB, Host, domain_xml
from tests.support.hostroot import identify
from tests.support.libvirt_daemon import socket_accepts
from tests.support.simfabric import make_fabric
from vmlend.registry import parse_location
from vmlend.registry.etcd_gateway import EtcdGateway
from vmlend.registry.etcd_keys import Keys
from vmlend.wiring.fabric import open_fabric


@pytest.fixture
def url(etcd_url):
    make_fabric(etcd_url).close()  # the default cluster: alpha, beta lend; gamma borrows
    return etcd_url


@pytest.fixture
def started(url, tmp_path):
    """Hosts made by the test, stopped by PID at the end."""
    made: list[Host] = []

    def host(node: str, name: str | None = None) -> Host:
        h = Host(url, node, tmp_path / (name or node))
        made.append(h)
        return h

    yield host
    for h in made:
        if h.agent is not None and h.agent.poll() is None:
            h.agent.send_signal(signal.SIGCONT)
            h.stop_agent(signal.SIGKILL)


def _keys(url: str) -> tuple[EtcdGateway, Keys]:
    loc = parse_location(url)
    return EtcdGateway(loc.endpoints), Keys(loc.cluster)


def _value(url: str, key_of) -> tuple[bytes, int] | None:  # type: ignore[no-untyped-def]
    gw, keys = _keys(url)
    try:
        _rev, kvs = gw.range(key_of(keys))
        return (kvs[0].value, kvs[0].lease) if kvs else None
    finally:
        gw.close()


def _refused(h: Host, *extra: str) -> str:
    """Run ``h``'s agent, which must refuse to start: its one line."""
    run = subprocess.run(
        [VMLEND, "agent", "--ttl", str(TTL), *extra],
        env=h.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), run.stderr
    return lines[0]


def test_a_second_host_with_the_same_node_name_is_refused_and_changes_nothing(started, url):
    first = started("gamma")
    first.start_agent()
    before = (_value(url, lambda k: k.host("gamma")), _value(url, lambda k: k.agent("gamma")))
    second = started("gamma", "gamma-2")  # another machine-id, the same node name
    line = _refused(second)
    assert f"node gamma is served by an agent on machine-id {first.machine_id}" in line
    # and a clone of the first (its machine-id) that does not have its lease: the same
    identify(second.root, machine_id=first.machine_id)
    assert "is served by an agent" in _refused(second)
    after = (_value(url, lambda k: k.host("gamma")), _value(url, lambda k: k.agent("gamma")))
    assert after == before
    assert first.agent is not None and first.agent.poll() is None  # untouched


def test_another_hosts_node_is_taken_over_only_on_request_and_after_its_lease_ended(
    started, url
):
    old = started("gamma")
    old.start_agent()
    old.stop_agent(signal.SIGKILL)  # the host is gone: its lease lives on for a while
    new = started("gamma", "reinstalled")
    assert "is served by an agent" in _refused(new, "--take-over")
    time.sleep(TTL + 1)  # the old lease has ended
    assert f"belongs to the host with machine-id {old.machine_id}" in _refused(new)
    new.start_agent("--take-over")
    bound = _value(url, lambda k: k.agent("gamma"))
    assert bound is not None and json.loads(bound[0])["machine_id"] == new.machine_id
    assert "node gamma is now bound to this host" in new.log()


def test_a_host_without_a_machine_id_is_refused_before_it_takes_a_lease(started, url):
    h = started("gamma")
    (h.root / "etc" / "machine-id").unlink()
    assert "cannot read this host's identity" in _refused(h)
    assert _value(url, lambda k: k.host("gamma")) is None
    assert _value(url, lambda k: k.agent("gamma")) is None


def test_a_second_agent_on_a_host_is_refused_whatever_its_socket_and_removes_nothing(
    started, url
):
    h = started("gamma")
    h.start_agent()
    before = _value(url, lambda k: k.host("gamma"))
    line = _refused(h, "--hook-socket", str(h.root / "other.sock"))
    assert "another vmlend agent runs on this host" in line and str(h.agent.pid) in line  # type: ignore[union-attr]
    assert _value(url, lambda k: k.host("gamma")) == before
    assert h.agent is not None and h.agent.poll() is None


def _hv(host: Host, url: str):  # type: ignore[no-untyped-def]
    from vmlend.wiring.hypervisor import open_hypervisor

    hook = [sys.executable, "-m", "vmlend.hook", "--registry", url, "--node", host.node]
    return open_hypervisor(f"sim:///{host.node}", state_dir=host.root, hook_command=hook)


def test_a_restart_keeps_the_lease_and_touches_no_vm(started, url, monkeypatch):
    """Issue 35, point 5: SIGTERM and a new agent (an upgrade, a restart) keep the lease and
    every hold: the next agent adopts the lease, no VM is paused, no lender takes a device
    back, the hold keeps its fencing token."""
    alpha, gamma = started("alpha"), started("gamma")
    monkeypatch.setenv("VMLEND_ROOT", str(gamma.root))
    alpha.start_agent()
    gamma.start_agent("--connect", "sim:///gamma")
    hv = _hv(gamma, url)
    hv.define(domain_xml("web", WEB.vm_uuid, (GPU,)))
    hv.start("web")
    with open_fabric(url, "alpha") as f:
        token = f.holds()[GPU].token
    lease = json.loads(gamma.lease_file.read_text())["lease"]
    assert gamma.stop_agent() == 0
    assert json.loads(gamma.lease_file.read_text())["lease"] == lease  # kept for the next
    gamma.start_agent("--connect", "sim:///gamma")
    assert json.loads(gamma.lease_file.read_text())["lease"] == lease
    time.sleep(TTL + 1)  # had the lease ended, the lender would have taken 0x10 back by now
    log = gamma.log()
    assert f"lease {lease:x} (TTL {TTL} s) adopted" in log
    assert "-> paused" not in log
    assert "took back" not in alpha.log()
    with open_fabric(url, "alpha") as f:
        assert f.holds()[GPU].token == token and f.device(GPU).holder == WEB
        assert f.fenced() == []
    assert hv.lookup("web").state.value == "running"


def test_a_restart_after_the_lease_ended_wins_the_vms_back(started, url, monkeypatch):
    """A stop that outlasts the lease is a kill -9: the lender takes the device back (the
    device serves no stale borrow), and the next agent pauses the VM, re-reserves its device
    and resumes it."""
    alpha, gamma = started("alpha"), started("gamma")
    monkeypatch.setenv("VMLEND_ROOT", str(gamma.root))
    alpha.start_agent()
    gamma.start_agent("--connect", "sim:///gamma")
    hv = _hv(gamma, url)
    hv.define(domain_xml("web", WEB.vm_uuid, (GPU,)))
    hv.start("web")
    assert gamma.stop_agent() == 0
    deadline = time.monotonic() + 30
    while "took back 0x10 from gamma/web" not in alpha.log():
        assert time.monotonic() < deadline, alpha.log()
        time.sleep(0.1)
    offset = len(gamma.log())
    gamma.start_agent("--connect", "sim:///gamma")
    log = gamma.log()[offset:]
    assert "has ended: taking a new one" in log
    assert "VM web: running -> paused" in log
    assert "VM web: paused -> running: re-reserved 0x10; resumed" in log
    with open_fabric(url, "alpha") as f:
        assert f.device(GPU).holder == WEB


class Configured(Host):
    """A host whose registry is named by its configuration file (``root/vmlend.toml``)."""

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in super().env.items() if k != "VMLEND_REGISTRY"}
        env["VMLEND_CONFIG"] = str(self.root / "vmlend.toml")
        return env


def test_sighup_takes_new_endpoints_from_the_configuration_without_a_pause(
    started, url, etcd, monkeypatch
):
    """Issue 35, point 5: an operator changes the endpoint list in the configuration file and
    reloads the agent (SIGHUP). The agent renews the same lease through the new endpoint: the
    old one can go away without the lease coming in doubt, and no VM is paused."""
    from tests.support.tcp_proxy import TcpProxy

    cluster = url.rsplit("/", 1)[1]
    old, new = TcpProxy(etcd.client_port), TcpProxy(etcd.client_port)
    alpha, gamma = started("alpha"), started("gamma")
    config = gamma.root / "vmlend.toml"
    config.write_text(f'registry = "etcd://{old.endpoint}/{cluster}"\n')
    gamma.__class__ = Configured  # its registry from the file, not from VMLEND_REGISTRY
    monkeypatch.setenv("VMLEND_ROOT", str(gamma.root))
    try:
        alpha.start_agent()
        gamma.start_agent("--ttl", "4", "--connect", "sim:///gamma")
        hv = _hv(gamma, url)
        hv.define(domain_xml("web", WEB.vm_uuid, (GPU,)))
        hv.start("web")
        lease = json.loads(gamma.lease_file.read_text())["lease"]
        config.write_text(f'registry = "etcd://{new.endpoint}/{cluster}"\n')
        assert gamma.agent is not None
        gamma.agent.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while f"reload: serving on {new.endpoint}" not in gamma.log():
            assert time.monotonic() < deadline, gamma.log()
            time.sleep(0.05)
        old.cut()  # the old endpoint goes away: a silent one, the worst kind
        time.sleep(3 * 4)  # three TTLs
        log = gamma.log()
        assert "-> paused" not in log and " in doubt" not in log, log
        assert json.loads(gamma.lease_file.read_text())["lease"] == lease
        assert hv.lookup("web").state.value == "running"
    finally:
        old.close()
        new.close()


class HungDomain:
    """The sim hypervisor of a host, whose calls for one domain (``stuck``) hang until
    ``go`` is set."""

    def __init__(self, hv) -> None:  # type: ignore[no-untyped-def]
        self.hv = hv
        self.stuck = ""
        self.go = threading.Event()
        real = hv.lookup

        def lookup(name: str):  # type: ignore[no-untyped-def]
            if name == self.stuck:
                self.go.wait(60)
            return real(name)

        hv.lookup = lookup


def test_a_domain_that_hangs_after_a_lost_lease_holds_up_neither_the_lease_nor_other_vms(
    started, url, monkeypatch, caplog
):
    """Issue 35, point 3: after a lost lease one domain's hypervisor calls hang. The host takes
    a new lease at once and the other VM wins its device back and runs; the hung one is
    reported, and recovered once its hypervisor answers."""
    import os

    from vmlend.agent.service import Agent, AgentConfig
    from vmlend.hook.server import HookServer, identity_of
    from vmlend.hostenv import HostEnv
    from vmlend.registry import hostlease

    app_uuid = "33333333-3333-3333-3333-333333333333"
    alpha, beta, gamma = started("alpha"), started("beta"), started("gamma")
    monkeypatch.setenv("VMLEND_ROOT", str(gamma.root))
    monkeypatch.setenv("VMLEND_NODE", "gamma")
    caplog.set_level(logging.INFO, logger="vmlend")
    alpha.start_agent()
    beta.start_agent()
    hung = HungDomain(_hv(gamma, url))
    agent = Agent(
        AgentConfig(
            location=url,
            node="gamma",
            lease_file=hostlease.lease_path(HostEnv(gamma.root)),
            ttl=TTL,
            interval=0.1,
            hypervisor=lambda: hung.hv,
            host=HostEnv(gamma.root),
            # the hook of every start finds this agent alive, so it must be served here
            hook_server=HookServer(
                hostlease.hook_socket_path(HostEnv(gamma.root)), identity_of(os.environ)
            ),
        )
    )
    thread = threading.Thread(target=agent.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        # start-up done: the hook is served (a start before it would be refused, after 5 s)
        while not (agent.clock.view().settled and socket_accepts(agent.config.hook_server.path)):
            assert thread.is_alive() and time.monotonic() < deadline
            time.sleep(0.05)
        for name, vm_uuid, fdid in (("web", WEB.vm_uuid, GPU), ("app", app_uuid, NIC)):
            hung.hv.define(domain_xml(name, vm_uuid, (fdid,)))
            hung.hv.start(name)
        while {g.name for g in agent.borrower.guests()} != {"web", "app"}:  # type: ignore[attr-defined]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        lost = agent.clock.view().lease
        hung.stuck = "web"
        gw, _k = _keys(url)
        gw.call("kv/lease/revoke", {"ID": lost})  # the lease ends, as etcd ends it
        gw.close()
        deadline = time.monotonic() + 30
        while True:
            view = agent.clock.view()
            app = agent.borrower.guest("app")  # type: ignore[attr-defined]
            with open_fabric(url, "alpha") as f:
                held = f.device(NIC).holder
            running = hung.hv.lookup("app").state.value == "running"
            mine = held is not None and held.vm == "app" and app.verified == view.generation
            if view.settled and view.lease != lost and running and mine:
                break
            assert time.monotonic() < deadline, (view, held)
            time.sleep(0.1)
        web = agent.borrower.guest("web")  # type: ignore[attr-defined]
        assert web.busy is not None  # still inside its hung call
        while "VM web: the hypervisor has not answered" not in caplog.text:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        hung.go.set()
        while not (web.state.value == "running" and web.verified == agent.clock.view().generation):
            assert time.monotonic() < deadline, web.trouble
            time.sleep(0.1)
    finally:
        hung.go.set()
        agent.stop_event.set()
        thread.join(30)
