"""Hosts as separate processes sharing one real etcd: each host is its own VMLEND_ROOT and
VMLEND_NODE, with its own ``vmlend agent``. Leases, fencing and what survives a dead, frozen
or cut-off host. Every process is started here and stopped by its PID."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from tests.support.cluster_hosts import (
    DB,
    GPU,
    INTERVAL,
    NIC,
    REUSE_BOUND,
    TTL,
    VMLEND,
    WEB,
    Host,
    check_never_two_holders,
    history,
    reserve_code,
)
from tests.support.etcd_daemon import host_lease
from tests.support.simfabric import make_fabric
from vmlend.errors import (
    AgentNotRunningError,
    DeviceFencedError,
    DeviceHeldError,
    LeaseExpiredError,
)
from vmlend.registry import parse_location
from vmlend.registry.etcd_gateway import EtcdGateway
from vmlend.topology.model import DeviceState, Holder
from vmlend.wiring.fabric import open_fabric


@pytest.fixture
def hosts(etcd_url, tmp_path):
    make_fabric(etcd_url).close()  # the default cluster: alpha, beta lend; gamma borrows
    made = {n: Host(etcd_url, n, tmp_path / n) for n in ("alpha", "beta", "gamma")}
    yield made
    for h in made.values():
        if h.agent is not None and h.agent.poll() is None:
            h.agent.send_signal(signal.SIGCONT)
            h.stop_agent(signal.SIGKILL)


# --- in-process: the rules ---------------------------------------------------------------------
def test_a_reserve_without_an_agent_is_refused_in_one_line(etcd_url, tmp_path, monkeypatch):
    make_fabric(etcd_url).close()
    monkeypatch.setenv("VMLEND_ROOT", str(tmp_path / "no-agent-here"))
    with open_fabric(etcd_url, "gamma") as f:
        with pytest.raises(AgentNotRunningError, match=r"start 'vmlend agent'") as e:
            f.reserve(GPU, WEB)
        assert "\n" not in str(e.value)
        assert f.device(GPU).state is DeviceState.AVAILABLE


def test_a_hold_whose_lease_ended_is_fenced_until_the_lender_takes_it_back(
    etcd, etcd_url, tmp_path, monkeypatch
):
    make_fabric(etcd_url).close()
    gamma_lease = host_lease(etcd, tmp_path / "gamma", ttl=TTL)
    monkeypatch.setenv("VMLEND_ROOT", str(tmp_path / "gamma"))
    gamma = open_fabric(etcd_url, "gamma")
    gamma.reserve(GPU, WEB)
    gamma.reserve(NIC, WEB)
    assert gamma.release(NIC, WEB) is True  # a normal release leaves no fence
    EtcdGateway(parse_location(etcd_url).endpoints).call("kv/lease/revoke", {"ID": gamma_lease})
    host_lease(etcd, tmp_path / "beta")
    monkeypatch.setenv("VMLEND_ROOT", str(tmp_path / "beta"))
    beta = open_fabric(etcd_url, "beta")
    assert beta.device(GPU).holder is None  # the hold went with the lease...
    with pytest.raises(DeviceFencedError, match=r"0x10 is fenced.*gamma/web.*alpha"):
        beta.reserve(GPU, DB)  # ...but the device is not borrowable yet
    beta.reserve(NIC, DB)  # a released device is
    alpha = open_fabric(etcd_url, "alpha")
    assert [f.fdid for f in alpha.fenced()] == [GPU]
    assert beta.fenced() == []  # not beta's to take back
    assert alpha.take_back(alpha.fenced()[0]) is True
    assert beta.reserve(GPU, DB).holder == DB
    # The stale holder's late writes are refused: its hold is gone, and another holds it now.
    with pytest.raises(DeviceHeldError):
        gamma.borrow(GPU, WEB)
    # (a class of its own: the lost-lease recovery must not take it for a lost device)
    with pytest.raises(LeaseExpiredError, match="lease has expired"):
        gamma.reserve(0x11, WEB)  # a new record under the ended lease fails the whole Txn
    assert beta.device(0x11).state is DeviceState.AVAILABLE


# --- real processes ------------------------------------------------------------------------
@pytest.mark.slow
def test_hosts_share_one_truth_and_a_killed_borrower_frees_its_devices(hosts, etcd_url):
    alpha, beta, gamma = hosts["alpha"], hosts["beta"], hosts["gamma"]
    for h in (alpha, beta, gamma):
        h.start_agent()
    # A VM on gamma borrows from alpha and from beta.
    for fdid in (GPU, NIC):
        r = gamma.run(reserve_code(fdid, WEB))
        assert r.returncode == 0 and "reserved" in r.stdout, r.stderr
    views = []
    for h in (alpha, beta, gamma):  # every host sees the same holders
        r = h.vmlend("devices", "--json")
        assert r.returncode == 0, r.stderr
        views.append({d["fdid"]: d.get("holder") for d in json.loads(r.stdout)["devices"]})
    assert views[0] == views[1] == views[2]
    # gamma dies hard: no release, no revoke.
    gamma.stop_agent(signal.SIGKILL)
    died = time.monotonic()
    deadline = died + TTL + REUSE_BOUND + 5
    while True:
        r = beta.run(reserve_code(GPU, DB))
        if r.returncode == 0:
            break
        assert "held by gamma/web" in r.stderr or "fenced" in r.stderr, r.stderr
        assert time.monotonic() < deadline, "the dead host's device never came back"
        time.sleep(0.1)
    reused_after = time.monotonic() - died
    assert reused_after < TTL + REUSE_BOUND + 5  # includes ~1 s of process start per try
    assert "took back 0x10" in alpha.log()
    check_never_two_holders(history(etcd_url))
    assert alpha.stop_agent() == 0 and beta.stop_agent() == 0


@pytest.mark.slow
def test_a_frozen_agent_loses_its_lease_and_its_late_writes_are_refused(hosts):
    alpha, gamma = hosts["alpha"], hosts["gamma"]
    alpha.start_agent()
    gamma.start_agent()
    old_lease = json.loads(gamma.lease_file.read_text())["lease"]
    r = gamma.run(reserve_code(GPU, WEB))
    assert r.returncode == 0, r.stderr
    gamma.stop_agent(signal.SIGSTOP)  # frozen: its lease is not renewed
    time.sleep(TTL + 2 * INTERVAL + 1)
    # The lease ended: a write from gamma under it is refused as a whole.
    r = gamma.run(reserve_code(NIC, WEB))
    assert r.returncode != 0 and "lease has expired" in r.stderr, r.stderr
    assert gamma.agent is not None
    gamma.agent.send_signal(signal.SIGCONT)
    # It notices, says so and carries on under a new lease.
    deadline = time.monotonic() + 20
    while gamma.published_lease() in (old_lease, None):
        assert gamma.agent.poll() is None and time.monotonic() < deadline, gamma.log()
        time.sleep(0.05)
    assert "lost: this host's holds are gone" in gamma.log()
    r = gamma.run(reserve_code(NIC, WEB))  # the host may write again
    assert r.returncode == 0, r.stderr
    assert gamma.stop_agent() == 0 and alpha.stop_agent() == 0


@pytest.mark.slow
def test_after_a_lost_lease_the_borrower_re_reserves_its_vms_devices_or_unplugs_them(
    hosts, etcd_url, monkeypatch
):
    """gamma's agent freezes past its TTL with two VMs running: web (GPU, lent by alpha) and
    app (NIC, lent by beta), and ops (0x11, lent by alpha), which an operator paused.
    Meanwhile beta's own VM takes the NIC. Thawed, the agent pauses web and app, takes a new
    lease, wins the GPU back for web and resumes it, and hot-unplugs the NIC from app before
    resuming it. It re-reserves 0x11 for ops too (before, ops kept the device without a hold,
    for the operator's resume) and leaves ops paused."""
    from tests.support.simcluster import domain_of as _domain
    from vmlend.domain import read_domain
    from vmlend.hypervisor.base import DomainState
    from vmlend.wiring.hypervisor import open_hypervisor

    alpha, beta, gamma = hosts["alpha"], hosts["beta"], hosts["gamma"]
    app = Holder("gamma", "app", "33333333-3333-3333-3333-333333333333")
    ops = Holder("gamma", "ops", "44444444-4444-4444-4444-444444444444")
    monkeypatch.setenv("VMLEND_ROOT", str(gamma.root))
    alpha.start_agent()
    beta.start_agent()
    gamma.start_agent("--connect", "sim:///gamma")
    hook = [sys.executable, "-m", "vmlend.hook", "--registry", etcd_url, "--node", "gamma"]
    hv = open_hypervisor("sim:///gamma", state_dir=gamma.root, hook_command=hook)
    hv.define(_domain("web", WEB.vm_uuid, (GPU,)))
    hv.define(_domain("app", app.vm_uuid, (NIC,)))
    hv.define(_domain("ops", ops.vm_uuid, (0x11,)))
    hv.start("web")  # the prepare hooks reserve under gamma's lease
    hv.start("app")
    hv.start("ops")
    hv.suspend("ops")  # an operator's pause

    gamma.stop_agent(signal.SIGSTOP)
    deadline = time.monotonic() + TTL + REUSE_BOUND + 10
    while (r := beta.run(reserve_code(NIC, DB))).returncode != 0:  # fenced, then taken back
        assert "held by gamma/app" in r.stderr or "fenced" in r.stderr, r.stderr
        assert time.monotonic() < deadline, beta.log()
        time.sleep(0.1)
    assert gamma.agent is not None
    # Only what the agent logs from the thaw on: on a loaded machine a renewal may have come
    # late before the freeze, with a recovery of its own (nothing to re-reserve then).
    thawed_at = len(gamma.log())
    gamma.agent.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 30
    done = ("VM web: paused -> running", "VM app: paused -> running", "lease change: VM ops")
    while not all(d in gamma.log()[thawed_at:] for d in done):
        assert gamma.agent.poll() is None and time.monotonic() < deadline, gamma.log()
        time.sleep(0.1)

    log = gamma.log()[thawed_at:]
    assert "VM app: running -> paused" in log and "VM web: running -> paused" in log
    assert "VM web: paused -> running: re-reserved 0x10; resumed" in log
    assert "VM app: paused -> running: re-reserved none; lost 0x20 (" in log
    assert "hot-unplugged the lost devices and resumed" in log
    assert "VM ops: re-reserved 0x11; stays paused: somebody else paused it" in log
    assert hv.lookup("ops").state is DomainState.PAUSED
    assert hv.lookup("web").state is DomainState.RUNNING
    assert hv.lookup("app").state is DomainState.RUNNING
    assert read_domain(hv.xml("app"), strict=False).devices == ()  # live: NIC gone...
    assert b"<hostdev" not in hv.xml("app")
    # ...the persistent definition is the operator's to change
    assert [d.fdid for d in read_domain(hv.xml("app", inactive=True)).devices] == [NIC]
    with open_fabric(etcd_url, "alpha") as f:
        assert f.device(GPU).holder == WEB  # under gamma's new lease
        assert f.device(NIC).holder == DB
        assert f.device(0x11).holder == ops
    check_never_two_holders(history(etcd_url))
    assert gamma.stop_agent() == 0 and alpha.stop_agent() == 0 and beta.stop_agent() == 0


@pytest.mark.slow
def test_a_borrower_pauses_its_remote_vms_while_etcd_is_away_and_resumes_them(
    private_etcd, tmp_path, monkeypatch
):
    from tests.support.simcluster import domain_of as _domain
    from vmlend.hypervisor.base import DomainState
    from vmlend.wiring.hypervisor import open_hypervisor

    url = private_etcd.url("pause")
    make_fabric(url).close()
    gamma = Host(url, "gamma", tmp_path / "gamma")
    monkeypatch.setenv("VMLEND_ROOT", str(gamma.root))
    ttl = 6  # long enough to pause at TTL/2 and come back before the lease ends
    log = (gamma.root / "agent.log").open("ab")
    gamma.agent = subprocess.Popen(
        [VMLEND, "agent", "--ttl", str(ttl), "--interval", "0.2", "--connect", "sim:///gamma"],
        env=gamma.env,
        stdout=log,
        stderr=log,
        stdin=subprocess.DEVNULL,
    )
    log.close()
    try:
        deadline = time.monotonic() + 20
        # Up once its start-up (holds onto its lease, reconcile) is done and it guards the VMs.
        while "reconcile of gamma done" not in gamma.log():
            assert gamma.agent.poll() is None and time.monotonic() < deadline, gamma.log()
            time.sleep(0.05)
        hook = [sys.executable, "-m", "vmlend.hook", "--registry", url, "--node", "gamma"]
        hv = open_hypervisor("sim:///gamma", state_dir=gamma.root, hook_command=hook)
        hv.define(_domain("web", WEB.vm_uuid, (GPU,)))
        hv.start("web")  # its prepare hook reserves 0x10 from alpha under gamma's lease
        assert hv.lookup("web").state is DomainState.RUNNING

        private_etcd.stop()
        deadline = time.monotonic() + ttl
        while hv.lookup("web").state is not DomainState.PAUSED:
            assert time.monotonic() < deadline, gamma.log()
            time.sleep(0.1)
        private_etcd.start()
        deadline = time.monotonic() + ttl
        # the resume thread says so once its resume is back (its pause mark cleared, the
        # watch's re-check done): a moment after the VM runs
        while hv.lookup("web").state is not DomainState.RUNNING or "resumed web" not in gamma.log():
            assert time.monotonic() < deadline, gamma.log()
            time.sleep(0.1)
        assert "paused web" in gamma.log()
        with open_fabric(url, "gamma") as f:
            assert f.device(GPU).holder == WEB  # the lease lived: the hold is still there
    finally:
        assert gamma.stop_agent() == 0


@pytest.mark.slow
def test_a_lender_whose_agent_died_has_its_devices_unavailable_until_it_returns(hosts, etcd_url):
    alpha, gamma = hosts["alpha"], hosts["gamma"]
    alpha.start_agent()
    gamma.start_agent()
    alpha.stop_agent(signal.SIGKILL)
    time.sleep(TTL + 1)  # its lease, and with it hosts/alpha, ends
    r = gamma.run(reserve_code(GPU, WEB))
    assert r.returncode != 0 and "alpha" in r.stderr and "agent is not running" in r.stderr
    r = gamma.vmlend("devices", "--json")
    states = {d["fdid"]: d["state"] for d in json.loads(r.stdout)["devices"]}
    assert states["0x10"] == "unavailable" and states["0x20"] == "available"  # beta's are fine
    alpha.start_agent()  # back: its devices are offered again
    r = gamma.run(reserve_code(GPU, WEB))
    assert r.returncode == 0, r.stderr
    assert alpha.stop_agent() == 0  # a stop keeps the lease for the next agent...
    r = alpha.vmlend("drain")  # ...a drain gives it up: not unavailable, decommissioned
    assert r.returncode == 0, r.stderr
    assert "revoked" in r.stdout and "no longer bound to this host" in r.stdout
    with open_fabric(etcd_url, "beta") as f:
        assert f.device(NIC).state is DeviceState.AVAILABLE
        assert f.device(0x11).state is DeviceState.AVAILABLE


@pytest.mark.slow
def test_a_restarted_agent_keeps_running_vms_devices_and_returns_the_rest(
    hosts, etcd_url, monkeypatch
):
    """gamma's agent is killed and restarted within its TTL. Its successor takes over the
    running VM's hold (which would otherwise vanish with the dead agent's lease) and returns
    the holds of a stopped VM (its release hook 'failed') and of a VM gamma no longer has."""
    from tests.support.simcluster import domain_of as _domain
    from vmlend.wiring.hypervisor import open_hypervisor

    alpha, gamma = hosts["alpha"], hosts["gamma"]
    old = Holder("gamma", "old", "44444444-4444-4444-4444-444444444444")
    ghost = Holder("gamma", "ghost", "55555555-5555-5555-5555-555555555555")
    monkeypatch.setenv("VMLEND_ROOT", str(gamma.root))
    alpha.start_agent()
    ttl = 6  # the restarted agent must start (~1 s on a loaded machine) before it runs out
    gamma.start_agent("--ttl", str(ttl), "--connect", "sim:///gamma")  # the last --ttl counts
    hook = [sys.executable, "-m", "vmlend.hook", "--registry", etcd_url, "--node", "gamma"]
    hv = open_hypervisor("sim:///gamma", state_dir=gamma.root, hook_command=hook)
    hv.define(_domain("web", WEB.vm_uuid, (GPU,)))
    hv.define(_domain("old", old.vm_uuid, (0x11,)))
    hv.start("web")
    for fdid, holder in ((0x11, old), (0x12, ghost)):  # held, though nothing here runs them
        r = gamma.run(reserve_code(fdid, holder))
        assert r.returncode == 0, r.stderr

    gamma.stop_agent(signal.SIGKILL)
    gamma.start_agent("--connect", "sim:///gamma")  # at once: the old lease still lives
    deadline = time.monotonic() + 20
    restarted = "agent for gamma: lease"
    while "start-up reconcile of gamma done" not in gamma.log().rsplit(restarted, 1)[-1]:
        assert time.monotonic() < deadline, gamma.log()
        time.sleep(0.05)
    log = gamma.log()
    first = log.split("agent for gamma: lease ", 2)[1].split()[0]
    assert f"agent for gamma: lease {first} (TTL {ttl} s) adopted" in log  # the same lease
    # the start-up reconcile is `vmlend reconcile --fix`'s: one line per drift it repaired
    assert "start-up reconcile: hold-of-stopped-vm old: return 0x11" in log
    assert "start-up reconcile: hold-of-stopped-vm ghost: return 0x12" in log
    with open_fabric(etcd_url, "alpha") as f:
        assert f.device(0x11).state is DeviceState.AVAILABLE  # returned, not fenced
        assert f.device(0x12).state is DeviceState.AVAILABLE
        assert f.fenced() == []
    time.sleep(ttl + 1)  # the dead agent's lease has ended by now
    with open_fabric(etcd_url, "alpha") as f:
        assert f.device(GPU).holder == WEB  # the running VM kept its device
        assert f.fenced() == []
    assert gamma.stop_agent() == 0 and alpha.stop_agent() == 0
