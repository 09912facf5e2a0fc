"""The promise across etcd outages and agent restarts: a device is never used by two running
VMs. Real etcd (restarted by PID), hosts as separate processes with their own agents and a
simulated hypervisor whose hooks run as processes of the host."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support.cluster_hosts import (
    DB,
    GPU,
    NIC,
    VMLEND,
    WEB,
    Host,
    check_never_two_holders,
    domain_xml,
    history,
    reserve_code,
    stopped_children,
)
from tests.support.simfabric import make_fabric
from vmlend.hypervisor.base import DomainState
from vmlend.registry import parse_location
from vmlend.registry.etcd_gateway import EtcdGateway
from vmlend.registry.etcd_keys import Keys, is_extent, lent_share
from vmlend.topology.model import Holder

#: Bounded waits for what an agent does after an event (process start-ups included).
WAIT = 30.0
#: A lease that outlives a set-up on a loaded machine (load 20-30 on 2 cores).
SETUP_TTL = 6


def _wait_for(what: str, check, host: Host | None = None, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        detail = host.log() if host is not None else ""
        assert time.monotonic() < deadline, f"{what} never happened\n{detail}"
        time.sleep(0.1)


def _lease_alive(gw: EtcdGateway, lease: int) -> bool:
    answer = gw.call("kv/lease/timetolive", {"ID": lease})
    return int(answer.get("TTL", -1)) > 0


def _hold_lease(gw: EtcdGateway, keys: Keys, fdid: int) -> int | None:
    _rev, kvs = gw.range(keys.hold(fdid))
    return kvs[0].lease if kvs else None


def _hv(host: Host, url: str):
    from vmlend.wiring.hypervisor import open_hypervisor

    hook = [sys.executable, "-m", "vmlend.hook", "--registry", url, "--node", host.node]
    return open_hypervisor(f"sim:///{host.node}", state_dir=host.root, hook_command=hook)


@pytest.fixture
def outage(private_etcd, tmp_path: Path, monkeypatch):
    url = private_etcd.url("outage")
    make_fabric(url).close()
    hosts = {n: Host(url, n, tmp_path / n) for n in ("alpha", "beta", "gamma")}
    monkeypatch.setenv("VMLEND_ROOT", str(hosts["gamma"].root))
    yield url, hosts
    for h in hosts.values():
        h.stop_agent()


@pytest.mark.slow
def test_after_an_etcd_outage_longer_than_the_ttl_the_vm_runs_on_holds_of_a_live_lease(
    private_etcd, outage
):
    """etcd is away for longer than the TTL: gamma's guard pauses web (its lease is in doubt
    and then past its end). The returning etcd extended every lease by its TTL, so gamma's is
    alive: the agent renews it and resumes web once its devices read as its own. Every record
    of web's hold must be on the lease the agent renews (DESIGN, rule 1: holds follow the
    lease), or it would vanish later while web runs."""
    url, hosts = outage
    alpha, gamma = hosts["alpha"], hosts["gamma"]
    alpha.start_agent()
    gamma.start_agent("--connect", f"sim:///{gamma.node}")
    hv = _hv(gamma, url)
    hv.define(domain_xml("web", WEB.vm_uuid, (GPU,)))
    hv.start("web")  # the prepare hook reserves 0x10 under gamma's lease
    paused_at = len(gamma.log())

    private_etcd.stop()
    _wait_for("web paused", lambda: "VM web: running -> paused" in gamma.log(), gamma)
    time.sleep(3.0)  # past the lease's end (TTL 2 s) with etcd away
    private_etcd.start()
    _wait_for("web resumed", lambda: "VM web: paused -> running" in gamma.log(), gamma)
    lease = json.loads(gamma.lease_file.read_text())["lease"]
    loc = parse_location(url)
    gw, keys = EtcdGateway(loc.endpoints), Keys(loc.cluster)
    try:
        assert _lease_alive(gw, lease)
        time.sleep(3.0)  # longer than a TTL: a lease nobody renews would have ended by now
        assert _lease_alive(gw, lease)
        assert _hold_lease(gw, keys, GPU) == lease, gamma.log()
        _rev, kvs = gw.range(keys.base, keys.base[:-1] + "0")
        # the claims, on the unit blocks of the VM; its marker, the node's index of holds
        # (gamma's extents, on no lease, are its node's: etcd layout 6; the lender's lent
        # entries its: layout 7)
        units = [
            kv
            for kv in kvs
            if kv.key.startswith(keys.units)
            and not is_extent(kv.value)
            and lent_share(kv.value) is None
        ]
        mdevs = [kv for kv in kvs if kv.key.startswith(keys.mdevs_on("gamma"))]
        index = [kv for kv in kvs if kv.key == keys.vm_holds("gamma", "web")]
        assert units and mdevs and index
        assert {kv.lease for kv in units + mdevs + index} == {lease}
    finally:
        gw.close()
    assert hv.lookup("web").state is DomainState.RUNNING
    # The agent's lines say when: the order of events around an outage is read from them.
    [doubt] = [ln for ln in gamma.log()[paused_at:].splitlines() if " in doubt: not renewed" in ln]
    assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z vmlend: lease ", doubt), doubt


@pytest.mark.slow
def test_a_vm_stopped_while_etcd_is_away_gets_its_devices_returned_when_etcd_returns(
    private_etcd, outage
):
    """The release hook cannot reach etcd: the host keeps the release, the user reads one line
    saying so, and the agent lands it once etcd is back (no 'reconcile --fix')."""
    from vmlend.topology.model import DeviceState
    from vmlend.wiring.fabric import open_fabric

    url, hosts = outage
    gamma = hosts["gamma"]
    # A TTL well past the outage: the lease lives, so only the journal can free the device.
    # With its hypervisor: only a VM it sees stopped gets a pending release landed.
    gamma.start_agent("--ttl", "30", "--connect", "sim:///gamma")
    hv = _hv(gamma, url)
    hv.define(domain_xml("web", WEB.vm_uuid, (GPU,)))
    hv.start("web")
    pending = gamma.root / "var" / "lib" / "vmlend" / "pending-releases"

    private_etcd.stop()
    r = gamma.vmlend("vm", "destroy", "web", "--connect", "sim:///gamma")
    assert r.returncode == 0, r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr
    [line] = r.stderr.splitlines()
    assert "release of VM 'web' is pending (0x10)" in line and "retries it" in line, line
    assert [p.name for p in pending.glob("*.json")] == [f"{WEB.vm_uuid}.json"]

    private_etcd.start()
    with open_fabric(url, "alpha") as f:
        _wait_for("0x10 returned", lambda: f.device(GPU).state is DeviceState.AVAILABLE, gamma)
        assert f.fenced() == []  # returned, not lost with a lease
    assert list(pending.glob("*.json")) == []
    assert "pending release of VM 'web'" in gamma.log() and "landed: 0x10" in gamma.log()


def _plant_entry(host: Host, name: str, entry: dict[str, object]) -> Path:
    """An entry in ``host``'s pending-release journal, in the format every vmlend reads (an
    older vmlend's: devices as ``[fdid, mdev]`` pairs)."""
    journal = host.root / "var" / "lib" / "vmlend" / "pending-releases"
    journal.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = journal / name
    path.write_text(json.dumps(entry))
    return path


@pytest.mark.slow
def test_a_pending_release_naming_a_running_vm_returns_none_of_its_devices(outage):
    """Issue 35: an entry naming a running VM and a device it does not hold (0x99) made the
    agent release every device that VM held; another VM then started on one of them. The
    agent must leave a running VM's holds alone, and land nothing of it while it runs."""
    from vmlend.domain import mdev_uuid
    from vmlend.wiring.fabric import open_fabric

    url, hosts = outage
    beta, gamma = hosts["beta"], hosts["gamma"]
    beta.start_agent()
    gamma.start_agent("--connect", "sim:///gamma")
    hv = _hv(gamma, url)
    hv.define(domain_xml("web", WEB.vm_uuid, (GPU, NIC)))
    hv.start("web")
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 3600))
    entry = _plant_entry(
        gamma,
        f"{WEB.vm_uuid}.json",
        {
            "node": "gamma",
            "vm": "web",
            "vm_uuid": WEB.vm_uuid,
            "devices": [[0x99, str(mdev_uuid(WEB.vm_uuid, 0x99))]],
            "shares": [],
            "since": since,
            "why": "planted",
        },
    )

    def handled() -> bool:  # landed (the entry gone) or judged (the agent says it waits)
        return not entry.exists() or "pending release of VM 'web' (0x99) waits" in gamma.log()

    _wait_for("the agent judging the entry", handled, gamma)
    with open_fabric(url, "alpha") as f:
        assert f.device(GPU).holder == WEB, gamma.log()
        assert f.device(NIC).holder == WEB, gamma.log()
    assert beta.run(reserve_code(NIC, DB)).returncode != 0  # db cannot take web's NIC
    assert entry.exists()  # kept until web stops
    assert hv.lookup("web").state is DomainState.RUNNING
    check_never_two_holders(history(url))


@pytest.mark.slow
def test_a_fifo_in_the_pending_release_journal_does_not_stop_the_agent(outage):
    """Issue 35: a FIFO in the journal froze the agent's loop on its open (its VMs paused, its
    lease lost). The agent must start, keep renewing its lease and keep the VM running."""
    url, hosts = outage
    gamma = hosts["gamma"]
    hv = _hv(gamma, url)
    hv.define(domain_xml("web", WEB.vm_uuid, (GPU,)))
    journal = gamma.root / "var" / "lib" / "vmlend" / "pending-releases"
    journal.mkdir(parents=True, mode=0o700)
    fifo = journal / "planted.json"
    os.mkfifo(fifo)
    try:
        gamma.start_agent("--ttl", "2", "--connect", "sim:///gamma")
        hv.start("web")
        time.sleep(3 * 2)  # three TTLs: a frozen loop would have lost the lease by now
        assert gamma.agent is not None and gamma.agent.poll() is None, gamma.log()
        assert "lost its lease" not in gamma.log(), gamma.log()
        assert hv.lookup("web").state is DomainState.RUNNING, gamma.log()
        assert "not a pending release, left alone" in gamma.log()
    finally:
        with contextlib.suppress(OSError):  # a reader blocked on it (today's code) goes on
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.slow
def test_a_release_that_cannot_be_recorded_is_one_line_and_the_vm_keeps_its_hold(
    private_etcd, outage
):
    """Issue 35: with the journal unusable (here its directory is a file) a release during an
    outage printed 'internal error: FileExistsError' and recorded nothing. Now: one line that
    says what happened and what to do, and the VM keeps its hold (safe: nobody else takes the
    device while it is unsure); the destroy itself still succeeds."""
    from vmlend.wiring.fabric import open_fabric

    url, hosts = outage
    gamma = hosts["gamma"]
    gamma.start_agent("--ttl", "30", "--connect", "sim:///gamma")
    hv = _hv(gamma, url)
    hv.define(domain_xml("web", WEB.vm_uuid, (GPU,)))
    hv.start("web")
    lib = gamma.root / "var" / "lib" / "vmlend"
    lib.mkdir(parents=True, exist_ok=True)
    (lib / "pending-releases").write_text("not a directory\n")

    private_etcd.stop()
    r = gamma.vmlend("vm", "destroy", "web", "--connect", "sim:///gamma")
    assert r.returncode == 0, r.stderr
    [line] = r.stderr.splitlines()
    assert "internal error" not in line, line
    assert "release of VM 'web' (0x10) could not reach the registry, nor be recorded" in line
    assert "its devices stay held" in line and "reconcile --fix" in line, line
    private_etcd.start()
    with open_fabric(url, "alpha") as f:
        assert f.device(GPU).holder == WEB


@pytest.mark.slow
def test_an_agent_restarted_after_its_lease_ended_pauses_re_reserves_or_unplugs_and_resumes(
    outage,
):
    """gamma's agent is killed with two VMs running and stays down past its TTL: the holds go
    with the lease and the lenders take the devices back; beta's VM takes the GPU. The
    restarted agent must not leave web running with a device beta's VM now uses: it pauses
    both VMs, re-reserves app's NIC, hot-unplugs web's GPU, and resumes them."""
    from vmlend.domain import read_domain
    from vmlend.wiring.fabric import open_fabric

    url, hosts = outage
    alpha, beta, gamma = hosts["alpha"], hosts["beta"], hosts["gamma"]
    app = Holder("gamma", "app", "33333333-3333-3333-3333-333333333333")
    alpha.start_agent()
    beta.start_agent()
    gamma.start_agent("--connect", "sim:///gamma")
    hv = _hv(gamma, url)
    hv.define(domain_xml("web", WEB.vm_uuid, (GPU,)))
    hv.define(domain_xml("app", app.vm_uuid, (NIC,)))
    hv.start("web")
    hv.start("app")

    gamma.stop_agent(signal.SIGKILL)

    def beta_took_the_gpu() -> bool:
        return beta.run(reserve_code(GPU, DB)).returncode == 0  # fenced, then taken back

    _wait_for("beta taking 0x10", beta_took_the_gpu, alpha)
    with open_fabric(url, "beta") as f:
        _wait_for("0x20 taken back", lambda: f.fenced() == [], beta)
    assert hv.lookup("web").state is DomainState.RUNNING  # nobody paused it: no agent ran

    gamma.start_agent("--connect", "sim:///gamma")
    _wait_for(
        "the start-up reconcile",
        lambda: "start-up reconcile of gamma done" in gamma.log().rsplit("agent for gamma:", 1)[-1],
        gamma,
    )
    log = gamma.log().rsplit("agent for gamma:", 1)[-1]
    assert "VM app: paused -> running: re-reserved 0x20; resumed" in log
    assert "VM web: paused -> running: re-reserved none; lost 0x10 (" in log
    assert "hot-unplugged the lost devices and resumed" in log
    assert hv.lookup("web").state is DomainState.RUNNING
    assert hv.lookup("app").state is DomainState.RUNNING
    assert read_domain(hv.xml("web"), strict=False).devices == ()
    assert b"<hostdev" not in hv.xml("web")
    with open_fabric(url, "alpha") as f:
        assert f.device(GPU).holder == DB
        assert f.device(NIC).holder == app
    check_never_two_holders(history(url))


@pytest.mark.slow
def test_a_borrower_cut_off_from_etcd_pauses_its_vm_and_runs_it_again_after_the_heal(
    private_etcd, tmp_path
):
    """A silent partition (a blackhole, not a refusal) between gamma and etcd: gamma's agent
    pauses the VM that uses alpha's device; after the heal the VM runs again with its device
    (the lease lived, or the agent re-reserved under a new one), and no revision ever shows
    two holders."""
    from tests.support.partition import cut_off_borrower, cut_to_pause
    from vmlend.wiring.fabric import open_fabric

    with cut_off_borrower(private_etcd, tmp_path, "cut", ttl=4) as c:
        cut_to_pause(c)
        assert "VM web: running -> paused: the lease is in doubt" in c.gamma.log()
        c.proxy.heal()
        _wait_for("web running again", lambda: c.state() is DomainState.RUNNING, c.gamma)
        with open_fabric(c.direct_url, "alpha") as f:
            _wait_for("0x10 held by web", lambda: f.device(GPU).holder == WEB, c.gamma)
        check_never_two_holders(history(c.direct_url))


@pytest.mark.slow
def test_a_hook_frozen_mid_prepare_past_its_lease_does_not_start_the_vm_on_a_lost_device(
    outage,
):
    """gamma's prepare hook reserves the GPU for web and freezes (SIGSTOP) before web runs;
    gamma's agent dies, the lease ends with the hold, alpha takes the GPU back and beta's VM
    takes it. When the hook goes on, web must not start: it would run with a device that is
    beta's (issue 20's frozen hook). The start fails with one line naming the holder, and the
    failed start leaves beta's hold alone."""
    from vmlend.faults import FAULT_ENV
    from vmlend.wiring.fabric import open_fabric

    url, hosts = outage
    alpha, beta, gamma = hosts["alpha"], hosts["beta"], hosts["gamma"]
    alpha.start_agent()
    beta.start_agent()
    gamma.start_agent("--connect", "sim:///gamma")
    _hv(gamma, url).define(domain_xml("web", WEB.vm_uuid, (GPU,)))
    env = {
        **gamma.env,
        FAULT_ENV: "prepare:after-device=STOP",
        # the fault is part of the hook's identity, so the agent answers "not mine" and the
        # hook runs its prepare in its own process: it is what freezes
    }
    start = subprocess.Popen(
        [VMLEND, "-c", "sim:///gamma", "vm", "start", "web"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for("the hook freezing", lambda: bool(stopped_children(start.pid)), gamma)
        with open_fabric(url, "alpha") as f:
            assert f.device(GPU).holder == WEB
        gamma.stop_agent(signal.SIGKILL)
        _wait_for("beta taking 0x10", lambda: beta.run(reserve_code(GPU, DB)).returncode == 0)
        for pid in stopped_children(start.pid):
            os.kill(pid, signal.SIGCONT)
        _out, err = start.communicate(timeout=WAIT)
    finally:
        if start.poll() is None:
            for pid in stopped_children(start.pid):
                os.kill(pid, signal.SIGCONT)
            start.kill()
            start.wait()
    assert _hv(gamma, url).lookup("web").state is DomainState.SHUTOFF
    assert start.returncode != 0
    assert len(err.splitlines()) == 1, err
    assert "device 0x10" in err and "beta/db" in err, err
    with open_fabric(url, "alpha") as f:
        assert f.device(GPU).holder == DB
    check_never_two_holders(history(url))


@pytest.mark.slow
def test_an_attach_frozen_past_its_lease_does_not_hot_plug_a_lost_device(outage):
    """The hot-add's twin of the frozen hook: ``vmlend attach`` reserves the GPU for web and
    freezes before the hot-plug; gamma's agent dies, the lease ends with the hold, alpha takes
    the GPU back and beta's VM takes it. When the attach goes on it must not plug the device
    into web: it fails with one line naming the holder, web runs without it, and beta's hold
    is left alone."""
    from vmlend.domain import mdev_uuid, read_domain
    from vmlend.faults import FAULT_ENV
    from vmlend.wiring.fabric import open_fabric

    url, hosts = outage
    alpha, beta, gamma = hosts["alpha"], hosts["beta"], hosts["gamma"]
    alpha.start_agent()
    beta.start_agent()
    # The set-up needs gamma's lease to live until the attach froze: on a loaded machine a
    # 2 s lease may not (issue 34); the fault, the kill and the lease's end, stays as it was.
    gamma.start_agent("--connect", "sim:///gamma", "--ttl", str(SETUP_TTL))
    hv = _hv(gamma, url)
    hv.define(domain_xml("web", WEB.vm_uuid, (NIC,)))
    hv.start("web")
    env = {**gamma.env, FAULT_ENV: "attach:after-acquire=STOP"}
    attach = subprocess.Popen(
        [VMLEND, "-c", "sim:///gamma", "attach", "web", "0x10", "--live"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for("the attach freezing", lambda: _state(attach.pid) == "T", gamma)
        with open_fabric(url, "alpha") as f:
            assert f.device(GPU).holder == WEB
        gamma.stop_agent(signal.SIGKILL)
        _wait_for("beta taking 0x10", lambda: beta.run(reserve_code(GPU, DB)).returncode == 0)
        attach.send_signal(signal.SIGCONT)
        _out, err = attach.communicate(timeout=WAIT)
    finally:
        if attach.poll() is None:
            attach.send_signal(signal.SIGCONT)
            attach.kill()
            attach.wait()
    assert attach.returncode != 0
    assert len(err.splitlines()) == 1, err
    assert "device 0x10" in err and "beta/db" in err, err
    assert GPU not in {d.fdid for d in read_domain(hv.xml("web"), strict=False).devices}
    assert str(mdev_uuid(WEB.vm_uuid, GPU)).encode() not in hv.xml("web")  # never plugged
    with open_fabric(url, "alpha") as f:
        assert f.device(GPU).holder == DB
    check_never_two_holders(history(url))


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


class PausedSeen:
    """Samples a VM's state every 0.1 s on a thread of its own: how often it was seen paused
    (the hypervisor's word, whatever the agent logs)."""

    def __init__(self, hv, name: str) -> None:  # type: ignore[no-untyped-def]
        self._hv, self._name = hv, name
        self.paused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            if self._hv.lookup(self._name).state is DomainState.PAUSED:
                self.paused += 1

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(10)
        return self.paused


@pytest.mark.slow
def test_latency_and_a_busy_cpu_pause_nothing_and_a_real_cut_still_pauses_in_time(
    private_etcd, tmp_path
):
    """Issue 35, point 2: at the documented TTL (10 s), 300 ms added each way between gamma and
    etcd pauses no VM, nor does a CPU kept busy by three loops beside it; a real cut still
    pauses the VM within TTL/2 + 1 s. Renewals run on their own thread, and the pause counts
    from the lease's real end (a keepalive's send time plus the TTL granted)."""
    from tests.support.partition import cut_off_borrower, cut_to_pause

    ttl = 10
    with cut_off_borrower(private_etcd, tmp_path, "latency", ttl=ttl) as c:
        since = len(c.gamma.log())
        seen = PausedSeen(c.hv, "web")
        c.proxy.latency = 0.3
        time.sleep(3 * ttl)
        busy = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(3)]
        try:
            time.sleep(3 * ttl)
        finally:
            for p in busy:
                p.kill()
                p.wait(10)
        assert seen.stop() == 0, c.gamma.log()[since:]
        c.proxy.latency = 0.0
        took = cut_to_pause(c)
        # Paused while the lease still lived (its own clock says how much was left), which
        # the cut-to-pause time (printed; bench/bench_cluster.py measures it) only estimates.
        paused = r"VM web: running -> paused: .*\((\d+\.\d) s of 10 s left\)"
        [left] = re.findall(paused, c.gamma.log())
        print(f"cut to paused: {took:.2f} s; {left} s of the lease left")
        assert float(left) > 0, c.gamma.log()[since:]
