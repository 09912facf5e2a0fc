"""The guard's own clock: a borrower pauses its VMs with remote devices once half the TTL has
passed since the last successful renewal, even while the renewal itself hangs (a silent
partition). Time is an injected monotonic clock the test moves; the agent runs in-process
against a real etcd, and its keepalive is made to hang."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.clocks import FakeClock
from tests.support.cluster_hosts import DB, GPU, NIC, WEB, domain_xml
from tests.support.etcd_daemon import host_lease
from tests.support.simfabric import make_fabric
from vmlend.agent.lease import SessionLease
from vmlend.agent.pause_marks import PauseMarks
from vmlend.agent.service import Agent, AgentConfig
from vmlend.agent.watch import LeaseWatch
from vmlend.domain import read_domain
from vmlend.errors import LibvirtError, VmlendError
from vmlend.hostenv import HostEnv
from vmlend.hypervisor.base import DomainState
from vmlend.registry import hostlease
from vmlend.sim.hypervisor.node import SimHypervisor
from vmlend.topology.model import Holder
from vmlend.wiring.fabric import open_fabric

TTL = 10  # in fake seconds; etcd's own clock never gets near it during the test
WAIT = 20.0  # bounded real-time waits for another thread to act


class HangingAgent(Agent):
    """An agent whose keepalive hangs once ``hang`` is set, as over a blackholed etcd."""

    def __init__(self, config: AgentConfig, clock: FakeClock) -> None:
        super().__init__(config, clock=clock)
        self.hang = threading.Event()
        self.hanging = threading.Event()
        self.answer = threading.Event()

    def _renew(self, lease: SessionLease) -> None:
        if self.hang.is_set():
            self.hanging.set()
            self.answer.wait(WAIT)
        super()._renew(lease)


def _until(what: str, check) -> None:
    deadline = time.monotonic() + WAIT
    while not check():
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.02)


#: The name of the thread ``_agent_running`` runs the agent on.
AGENT_THREAD = "agent-under-test"


@contextlib.contextmanager
def _agent_running(
    agent_class: type[HangingAgent],
    hv: SimHypervisor,
    etcd_url: str,
    root: Path,
    clock: FakeClock,
    release: tuple[threading.Event, ...] = (),
) -> Iterator[HangingAgent]:
    """The agent of gamma (rooted at ``root``, guarding ``hv``) on a thread of its own; on
    the way out ``release`` and its hanging keepalive are let go, the agent is stopped, and it
    must have stopped cleanly."""
    config = AgentConfig(
        etcd_url,
        "gamma",
        hostlease.lease_path(HostEnv(root)),
        ttl=TTL,
        interval=0.05,
        hypervisor=lambda: hv,
    )
    agent = agent_class(config, clock)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(agent.run()), name=AGENT_THREAD)
    thread.start()
    try:
        yield agent
    finally:
        for event in (*release, agent.answer):
            event.set()
        agent.stop_event.set()
        thread.join(WAIT)
    assert result == [0]


def test_the_guard_pauses_at_half_the_ttl_while_the_renewal_hangs(
    etcd_url, tmp_path, monkeypatch, caplog
):
    caplog.set_level(logging.WARNING)
    make_fabric(etcd_url).close()
    root = tmp_path / "gamma"
    monkeypatch.setenv("VMLEND_ROOT", str(root))
    hv = SimHypervisor("gamma", tmp_path / "hv", None)
    clock = FakeClock()
    with _agent_running(HangingAgent, hv, etcd_url, root, clock) as agent:
        _until("the agent's start-up", lambda: "reconcile of gamma done" in caplog.text)
        with open_fabric(etcd_url, "gamma") as f:
            f.reserve(GPU, WEB)  # under the agent's lease
        hv.define(domain_xml("web", WEB.vm_uuid, (GPU,)))
        hv.start("web")

        agent.hang.set()
        clock.advance(TTL / 3 + 0.1)  # the next keepalive is due, and hangs
        _until("the keepalive hanging", agent.hanging.is_set)
        assert hv.lookup("web").state is DomainState.RUNNING  # not yet half the TTL
        clock.advance(TTL / 2 - TTL / 3)  # now past TTL/2 since the last good renewal
        _until("web paused", lambda: hv.lookup("web").state is DomainState.PAUSED)

        agent.hang.clear()
        agent.answer.set()  # the keepalive answers after all: the lease lived
        _until("web resumed", lambda: hv.lookup("web").state is DomainState.RUNNING)
        with open_fabric(etcd_url, "gamma") as f:
            assert f.device(GPU).holder == WEB


def test_the_watch_counts_from_the_last_good_renewal_on_its_own_clock():
    clock = FakeClock()
    paused: list[list[str]] = []
    watch = LeaseWatch(4, lambda: paused.append(["web"]) or ["web"], clock=clock)
    clock.advance(2)
    assert watch.check() is False  # exactly TTL/2: not yet
    clock.advance(0.01)
    assert watch.check() is True and paused == [["web"]]
    assert watch.check() is False  # once per doubt
    assert watch.renewed() == ["web"]  # the caller resumes what the watch paused
    clock.advance(2)
    assert watch.check() is False  # the clock started again at the renewal


def _pause_the_hypervisor_is_slow_to_do() -> tuple[LeaseWatch, threading.Event, threading.Thread]:
    """A watch in doubt whose pause (of "web") waits until the event is set, on its thread."""
    clock = FakeClock()
    hypervisor_answers = threading.Event()
    watch = LeaseWatch(4, lambda: hypervisor_answers.wait(WAIT) and ["web"], clock=clock)
    clock.advance(2.01)
    pausing = threading.Thread(target=watch.check, daemon=True)
    pausing.start()
    _until("the watch in doubt", lambda: watch.in_doubt)
    return watch, hypervisor_answers, pausing


def test_a_renewal_is_not_held_up_by_a_pause_the_hypervisor_is_slow_to_do():
    """The watch pauses while the hypervisor hangs (the nemesis test: a hook frozen mid-start
    holds the simulated hypervisor's lock). A renewal that lands meanwhile must go through at
    once: were it to wait for the pause, the agent's loop would renew nothing more and the
    lease, with every hold of the host, would end while etcd answers. What the slow pause
    paused is handed back by the next renewal."""
    watch, hypervisor_answers, pausing = _pause_the_hypervisor_is_slow_to_do()
    renewal = threading.Thread(target=watch.renewed, daemon=True)
    renewal.start()
    renewal.join(2.0)
    stuck = renewal.is_alive()
    hypervisor_answers.set()
    pausing.join(WAIT)
    assert not stuck, "the renewal waited for the hypervisor"
    assert watch.renewed() == ["web"]  # the next renewal resumes what the slow pause paused


def test_a_lost_lease_takes_over_what_a_slow_pause_paused():
    """The lost-lease path takes the paused VMs over for the recovery (``take_paused``): a
    pause still in progress is waited for, so none of its VMs stays paused unrecovered."""
    watch, hypervisor_answers, pausing = _pause_the_hypervisor_is_slow_to_do()
    taken: list[list[str]] = []
    taking = threading.Thread(target=lambda: taken.append(watch.take_paused()), daemon=True)
    taking.start()
    time.sleep(0.2)
    assert taken == []  # waits for the pause in progress
    hypervisor_answers.set()
    taking.join(WAIT)
    pausing.join(WAIT)
    assert taken == [["web"]]


class _SlowResume:
    """A resume of "web" the hypervisor answers only when ``answers`` is set, on a thread."""

    def __init__(self, watch: LeaseWatch) -> None:
        self.answers = threading.Event()
        self.started = threading.Event()
        self.result: list[bool] = []

        def resume() -> None:
            self.started.set()
            self.answers.wait(WAIT)

        self.thread = threading.Thread(
            target=lambda: self.result.append(watch.resume_if_fresh("web", resume)), daemon=True
        )
        self.thread.start()
        _until("the resume under way", self.started.is_set)

    def finish(self) -> bool:
        self.answers.set()
        self.thread.join(WAIT)
        return self.result[0]


def test_a_resume_the_hypervisor_is_slow_to_do_holds_up_no_pause():
    """A resume after a renewal waits for the hypervisor, which may not answer for that
    domain. Meanwhile the lease comes in doubt: the watch must still pause the other VMs
    (it used to wait for the resume, holding its lock across it). When the resume lands
    late, the VM is paused again and handed back by the next renewal."""
    clock = FakeClock()
    paused: list[str] = []
    suspended: list[str] = []
    watch = LeaseWatch(
        4, lambda: paused.append("db") or ["db"], clock=clock, suspend=suspended.append
    )
    slow = _SlowResume(watch)
    clock.advance(2.01)
    checking = threading.Thread(target=watch.check, daemon=True)
    checking.start()
    checking.join(2.0)
    held_up = checking.is_alive()
    resumed = slow.finish()
    checking.join(WAIT)
    assert not held_up, "the pause waited for a resume of another VM"
    assert paused == ["db"]
    assert resumed is False and suspended == ["web"]  # resumed in doubt: paused again
    assert watch.renewed() == ["db", "web"]


def test_a_resume_that_lands_after_the_lease_was_lost_goes_to_the_recovery():
    """The lease is lost while a resume is under way: the VM's holds may be gone with it, so
    once the resume lands the VM is paused again, and it is the recovery's (``take_orphans``),
    never resumed by a renewal of the next lease."""
    clock = FakeClock()
    suspended: list[str] = []
    watch = LeaseWatch(4, list, clock=clock, suspend=suspended.append)
    slow = _SlowResume(watch)
    assert watch.take_paused() == []  # the lost-lease path, while the resume hangs
    assert watch.renewed() == []  # the next lease's first renewal
    assert slow.finish() is False
    assert suspended == ["web"]
    assert watch.renewed() == []
    assert watch.take_orphans() == ["web"]
    assert watch.take_orphans() == []


def test_a_resume_that_lands_in_time_runs_the_vm():
    clock = FakeClock()
    suspended: list[str] = []
    watch = LeaseWatch(4, list, clock=clock, suspend=suspended.append)
    slow = _SlowResume(watch)
    clock.advance(1.0)  # still fresh when it lands
    assert slow.finish() is True
    assert suspended == [] and watch.take_orphans() == [] and watch.renewed() == []


class _StuckResumes(SimHypervisor):
    """A hypervisor that does not answer a resume while ``stuck`` is set (a domain whose
    QEMU monitor hangs, or whose object another caller holds)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.stuck = threading.Event()
        self.answer = threading.Event()
        self.resuming = threading.Event()

    def resume(self, name: str) -> None:
        if self.stuck.is_set():
            self.resuming.set()
            self.answer.wait(WAIT)
        super().resume(name)


class _CountingAgent(HangingAgent):
    def __init__(self, config: AgentConfig, clock: FakeClock) -> None:
        super().__init__(config, clock)
        self.renewals = 0

    def _renew(self, lease: SessionLease) -> None:
        super()._renew(lease)
        self.renewals += 1


def test_the_agent_renews_on_while_the_hypervisor_does_not_answer_a_resume(
    etcd_url, tmp_path, monkeypatch, caplog
):
    """A renewal after a doubt resumes what the watch paused. If the hypervisor does not
    answer that resume, the agent must renew on: it used to resume on its loop, so the lease,
    with every hold of the host, would have ended while etcd answered."""
    caplog.set_level(logging.WARNING)
    make_fabric(etcd_url).close()
    root = tmp_path / "gamma"
    monkeypatch.setenv("VMLEND_ROOT", str(root))
    hv = _StuckResumes("gamma", tmp_path / "hv", None)
    clock = FakeClock()
    with _agent_running(_CountingAgent, hv, etcd_url, root, clock, (hv.answer,)) as agent:
        assert isinstance(agent, _CountingAgent)
        _until("the agent's start-up", lambda: "reconcile of gamma done" in caplog.text)
        with open_fabric(etcd_url, "gamma") as f:
            f.reserve(GPU, WEB)
        hv.define(domain_xml("web", WEB.vm_uuid, (GPU,)))
        hv.start("web")

        agent.hang.set()
        clock.advance(TTL / 2 + 0.1)  # a keepalive hangs, and the doubt begins
        _until("web paused", lambda: hv.lookup("web").state is DomainState.PAUSED)
        hv.stuck.set()
        agent.hang.clear()
        agent.answer.set()  # the keepalive answers: resume web, which the hypervisor hangs
        _until("the resume under way", hv.resuming.is_set)
        before = agent.renewals
        for _ in range(3):  # three renewal periods pass while the resume hangs
            clock.advance(TTL / 3 + 0.1)
            _until("a renewal", lambda n=agent.renewals: agent.renewals > n)
        assert agent.renewals >= before + 3
        assert "lost its lease" not in caplog.text
        hv.answer.set()
        _until("web resumed", lambda: hv.lookup("web").state is DomainState.RUNNING)
        with open_fabric(etcd_url, "gamma") as f:
            assert f.device(GPU).holder == WEB


def test_a_name_handed_out_before_the_lease_was_lost_is_the_recoverys_not_resumed():
    """``renewed`` hands "web" out for resuming; before the resume thread gets to the gate the
    lease is lost (``take_paused``: "web" is not among the paused any more) and a new one is
    renewed. The gate knows the lease "web" was paused under, so it does not resume it under
    the new one: it goes to the recovery."""
    clock = FakeClock()
    watch = LeaseWatch(4, lambda: ["web"], clock=clock)
    clock.advance(2.01)
    watch.check()
    assert watch.renewed() == ["web"]
    generation = watch.generation
    assert watch.take_paused() == []  # the lost-lease path
    watch.renewed()  # the new lease's first renewal: fresh again
    resumed: list[str] = []
    assert watch.resume_if_fresh("web", lambda: resumed.append("web"), generation) is False
    assert resumed == [] and watch.take_orphans() == ["web"]


def test_a_resume_that_fails_after_it_took_effect_is_looked_at_again():
    """The hypervisor resumed "web" but the call failed on its way back; a doubt began
    meanwhile: "web" is paused again and held back, and the failure still reaches the
    caller."""
    clock = FakeClock()
    suspended: list[str] = []
    watch = LeaseWatch(4, list, clock=clock, suspend=suspended.append)

    def resume() -> None:
        clock.advance(2.01)  # the doubt begins while the hypervisor answers
        raise VmlendError("connection reset")

    try:
        watch.resume_if_fresh("web", resume)
    except VmlendError:
        pass
    else:
        raise AssertionError("the resume's failure was swallowed")
    assert suspended == ["web"]
    assert watch.renewed() == ["web"]


def test_a_vm_whose_second_pause_fails_is_still_handed_to_the_recovery():
    clock = FakeClock()

    def suspend(name: str) -> None:
        raise RuntimeError("hypervisor gone")

    watch = LeaseWatch(4, list, clock=clock, suspend=suspend)
    generation = watch.generation
    watch.take_paused()  # lost while "web" was hot-plugged under the old lease
    assert watch.recheck("web", generation) is False
    assert watch.take_orphans() == ["web"]


def _beta_holds(fdid: int, etcd, etcd_url: str, tmp_path: Path, monkeypatch) -> Path:
    """The default fabric with ``fdid`` held by beta's db; gamma's root (returned) is
    ``$VMLEND_ROOT`` from now on."""
    make_fabric(etcd_url).close()
    monkeypatch.setenv("VMLEND_ROOT", str(tmp_path / "beta"))
    host_lease(etcd, tmp_path / "beta", node="beta")
    with open_fabric(etcd_url, "beta") as f:
        f.reserve(fdid, DB)
    root = tmp_path / "gamma"
    monkeypatch.setenv("VMLEND_ROOT", str(root))
    return root


class _SlowStartUp(SimHypervisor):
    """A listing of the domains, asked by the agent's own thread, waits until ``go`` is set:
    its start-up looks for VMs without their holds while the watch acts."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.reached = threading.Event()
        self.go = threading.Event()

    def list_domains(self):  # type: ignore[no-untyped-def]
        if threading.current_thread().name == AGENT_THREAD and not self.go.is_set():
            self.reached.set()
            self.go.wait(WAIT)
        return super().list_domains()


def test_a_vm_the_watch_paused_during_start_up_is_recovered_not_resumed_without_its_holds(
    etcd, etcd_url, tmp_path, monkeypatch, caplog
):
    """The agent starts after its host's lease ended: web runs without its hold on 0x10, which
    beta's db holds by now. While the start-up looks for such VMs, the watch (in doubt: the
    start-up renews nothing) pauses web. The start-up must still take web: hot-unplug the
    device it lost, and resume it. It used to look at running VMs only, and the first renewal
    resumed web with a device another VM holds."""
    caplog.set_level(logging.WARNING)
    root = _beta_holds(GPU, etcd, etcd_url, tmp_path, monkeypatch)
    hv = _SlowStartUp("gamma", tmp_path / "hv", None)
    hv.define(domain_xml("web", WEB.vm_uuid, (GPU,)))
    hv.start("web")  # no hook here: it runs without a hold, as after a lease ended
    clock = FakeClock()
    with _agent_running(HangingAgent, hv, etcd_url, root, clock, (hv.go,)):
        assert hv.reached.wait(WAIT), "the start-up never listed the domains"
        clock.advance(TTL / 2 + 0.1)
        _until("web paused by the watch", lambda: hv.lookup("web").state is DomainState.PAUSED)
        hv.go.set()
        _until("the agent's start-up", lambda: "reconcile of gamma done" in caplog.text)
        clock.advance(TTL / 3 + 0.1)  # the first renewal
        _until("web running", lambda: hv.lookup("web").state is DomainState.RUNNING)
        devices = {d.fdid for d in read_domain(hv.xml("web"), strict=False).devices}
        assert GPU not in devices, "web runs on with 0x10, which beta's db holds"
        with open_fabric(etcd_url, "gamma") as f:
            assert f.device(GPU).holder == DB


def test_a_vm_handed_back_counts_as_paused_until_its_resume_is_done():
    """``vmlend_paused_vms`` (``paused_count``): a VM handed back by a renewal is resumed on
    a thread of its own, and counts as paused until that resume is done."""
    clock = FakeClock()
    watch = LeaseWatch(4, lambda: ["web"], clock=clock)
    clock.advance(2.01)
    watch.check()
    assert watch.paused_count() == 1
    assert watch.renewed() == ["web"]
    assert watch.paused_count() == 1  # handed back, not resumed yet
    slow = _SlowResume(watch)
    assert watch.paused_count() == 1
    assert slow.finish() is True
    assert watch.paused_count() == 0


def test_no_gate_resumes_a_vm_a_plug_request_is_plugging_into():
    """The recovery (or a renewal) would resume "web" with the devices it knows of while a
    plug request's hot-plug into it is still under way; the hot-plug would then land in a
    running VM on a device whose hold is gone. The gate leaves it paused, and once the plug
    is done it is the recovery's."""
    clock = FakeClock()
    watch = LeaseWatch(4, list, clock=clock)
    resumed: list[str] = []
    with watch.plugging("web") as plugged:
        assert watch.resume_if_fresh("web", lambda: resumed.append("web")) is False
        plugged()  # a device plugged, the lease fresh: nothing to do
        assert watch.take_orphans() == []
    assert resumed == []
    assert watch.take_orphans() == ["web"]


def test_a_hot_plug_that_lands_after_the_lease_was_lost_pauses_the_vm_for_the_recovery():
    clock = FakeClock()
    suspended: list[str] = []
    watch = LeaseWatch(4, list, clock=clock, suspend=suspended.append)
    with watch.plugging("web") as plugged:
        watch.take_paused()  # the lease is lost while the hot-plug hangs
        plugged()  # it lands
        assert suspended == ["web"]
    assert watch.take_orphans() == ["web"]
    assert watch.renewed() == []


def test_a_vm_given_to_the_recovery_is_not_handed_back_by_a_renewal():
    """Paused by the watch (a doubt under the new lease) and, at the same time, found to have
    been resumed under the lost one: it is the recovery's only. A renewal handing it back
    would resume it while the recovery still waits to win its devices back."""
    clock = FakeClock()
    watch = LeaseWatch(4, lambda: ["web"], clock=clock, suspend=lambda _n: None)
    generation = watch.generation
    watch.take_paused()  # lost
    clock.advance(2.01)
    watch.check()  # the new lease in doubt: the watch pauses web
    assert watch.recheck("web", generation) is False  # the old resume landed
    assert watch.renewed() == []
    assert watch.take_orphans() == ["web"]


def test_what_the_watch_paused_while_the_new_lease_was_taken_is_taken_after_its_pause():
    """``take_late`` waits for a pause in progress, like ``take_paused``: what it pauses is
    the recovery's, not left for the next renewal to resume."""
    watch, hypervisor_answers, pausing = _pause_the_hypervisor_is_slow_to_do()
    taken: list[list[str]] = []
    taking = threading.Thread(target=lambda: taken.append(watch.take_late()), daemon=True)
    taking.start()
    time.sleep(0.2)
    assert taken == []
    hypervisor_answers.set()
    taking.join(WAIT)
    pausing.join(WAIT)
    assert taken == [["web"]] and watch.renewed() == []


def test_a_lease_found_gone_outside_the_loop_stops_every_resume_and_pauses():
    clock = FakeClock()
    paused: list[str] = []
    watch = LeaseWatch(4, lambda: paused.append("db") or ["db"], clock=clock)
    watch.expire()
    assert watch.resume_if_fresh("web", lambda: None) is False
    assert watch.check() is True and paused == ["db"]


def test_a_lease_gone_during_the_recovery_is_acted_on_at_once():
    """The recovery renews through ``Renewals.keep_alive``; etcd says the lease is gone. No
    gate resumes anything from then on, and the loop's next renewal is due at once (not a
    third of the TTL later), so it takes the lost-lease path right after the recovery."""
    from vmlend.agent.lease import LeaseLost
    from vmlend.agent.metrics import AgentMetrics
    from vmlend.agent.service import Renewals

    clock = FakeClock()
    watch = LeaseWatch(TTL, list, clock=clock)

    def gone(_lease) -> None:  # type: ignore[no-untyped-def]
        raise LeaseLost("lease 1 expired")

    class _Lease:
        id, ttl = 1, TTL

    renewals = Renewals(
        _Lease(),  # type: ignore[arg-type]
        renew=gone,
        clock=clock,
        interval=0.05,
        metrics=AgentMetrics(),
        watch=watch,
        guard=None,
    )
    renewals.keep_alive()
    assert watch.resume_if_fresh("web", lambda: None) is False
    renewals.schedule(clock())
    assert renewals.next <= clock()


def test_a_pause_that_ends_after_its_vm_went_to_the_recovery_does_not_hand_it_back():
    """The watch's pause (a doubt under the new lease) finds "web" running because a resume
    from the lost lease just landed, and is slow to finish; meanwhile that resume's re-check
    gives "web" to the recovery. When the pause ends it must not put "web" back among those a
    renewal resumes: the recovery may leave it paused (a device it lost could not be
    unplugged), and the renewal would run it on a device it does not hold."""
    clock = FakeClock()
    answers = threading.Event()
    watch = LeaseWatch(
        4, lambda: answers.wait(WAIT) and ["web"], clock=clock, suspend=lambda _n: None
    )
    old = watch.generation
    watch.take_paused()  # the old lease is lost
    clock.advance(2.01)
    pausing = threading.Thread(target=watch.check, daemon=True)
    pausing.start()
    _until("the watch in doubt", lambda: watch.in_doubt)
    assert watch.recheck("web", old) is False  # the old resume landed: the recovery's
    answers.set()
    pausing.join(WAIT)
    assert watch.take_orphans() == ["web"]
    assert watch.renewed() == []


def test_a_resume_that_failed_is_tried_again_by_the_next_renewal():
    """The hypervisor did not resume "web" (a job timeout): it stays among the paused, and
    the next renewal hands it back again rather than leaving it paused for good."""
    clock = FakeClock()
    watch = LeaseWatch(4, list, clock=clock)

    def fails() -> None:
        raise VmlendError("cannot acquire state change lock")

    with pytest.raises(VmlendError):
        watch.resume_if_fresh("web", fails)
    assert watch.paused_count() == 1
    assert watch.renewed() == ["web"]


def test_vms_an_agent_paused_and_did_not_resume_are_recovered_by_the_next_one(
    etcd, etcd_url, tmp_path, monkeypatch, caplog
):
    """gamma's agent paused web and app (its lease was in doubt) and was killed before it
    resumed them. web's hold outlived it; app's device went to beta's db meanwhile. The next
    agent resumes web, and unplugs 0x20 from app before it resumes it. ops, which an operator
    paused, stays paused. Before, all three stayed paused for good: a hypervisor cannot tell
    the agent's pause from an operator's, so the agent now marks its own (``pause_marks``).
    A mark of a VM that runs (an operator resumed it) or is gone is dropped."""
    caplog.set_level(logging.WARNING)
    root = _beta_holds(NIC, etcd, etcd_url, tmp_path, monkeypatch)
    host_lease(etcd, root, node="gamma")  # the killed agent's lease: the next one takes over
    ops = Holder("gamma", "ops", "33333333-3333-3333-3333-333333333333")
    app = Holder("gamma", "app", "44444444-4444-4444-4444-444444444444")
    with open_fabric(etcd_url, "gamma") as f:
        f.reserve(GPU, WEB)
        f.reserve(0x11, ops)
    hv = SimHypervisor("gamma", tmp_path / "hv", None)
    for holder, fdid in ((WEB, GPU), (app, NIC), (ops, 0x11)):
        hv.define(domain_xml(holder.vm, holder.vm_uuid, (fdid,)))
        hv.start(holder.vm)  # no hook here: the holds are made above, app has none
        hv.suspend(holder.vm)
    marks = PauseMarks(hostlease.lease_path(HostEnv(root)).parent / "paused")
    marks.mark("web")
    marks.mark("app")
    marks.mark("ops-resumed-by-hand")
    marks.mark("gone")
    hv.define(domain_xml("ops-resumed-by-hand", "55555555-5555-5555-5555-555555555555", ()))
    hv.start("ops-resumed-by-hand")
    with _agent_running(HangingAgent, hv, etcd_url, root, FakeClock()):
        _until("the agent's start-up", lambda: "reconcile of gamma done" in caplog.text)
        assert hv.lookup("web").state is DomainState.RUNNING, "web stays paused"
        assert hv.lookup("app").state is DomainState.RUNNING, "app stays paused"
        assert hv.lookup("ops").state is DomainState.PAUSED, "an operator's pause was undone"
        assert hv.lookup("ops-resumed-by-hand").state is DomainState.RUNNING
        assert NIC not in {d.fdid for d in read_domain(hv.xml("app"), strict=False).devices}
        assert marks.names() == []
        with open_fabric(etcd_url, "gamma") as f:
            assert f.device(GPU).holder == WEB
            assert f.device(NIC).holder == DB


def test_a_vm_an_operator_paused_is_left_paused_without_the_devices_it_lost(
    etcd, etcd_url, tmp_path, monkeypatch, caplog
):
    """An operator paused ops; then gamma's lease ended while no agent ran, and beta's db took
    0x20. ops is not the agent's to resume, but the operator's resume (which no hook or agent
    sees) must not run it on beta's device: the next agent unplugs 0x20 from it, re-reserves
    0x10, which is free, and leaves it paused. Before, the start-up reconcile re-reserved
    0x10 and left 0x20 in the VM "to the operator"."""
    caplog.set_level(logging.WARNING)
    root = _beta_holds(NIC, etcd, etcd_url, tmp_path, monkeypatch)
    host_lease(etcd, root, node="gamma")
    ops = Holder("gamma", "ops", "33333333-3333-3333-3333-333333333333")
    hv = SimHypervisor("gamma", tmp_path / "hv", None)
    hv.define(domain_xml(ops.vm, ops.vm_uuid, (GPU, NIC)))
    hv.start(ops.vm)  # no hook here: no holds, as after the lease ended
    hv.suspend(ops.vm)  # an operator's: no pause mark
    with _agent_running(HangingAgent, hv, etcd_url, root, FakeClock()):
        _until("the agent's start-up", lambda: "reconcile of gamma done" in caplog.text)
        assert hv.lookup("ops").state is DomainState.PAUSED, "an operator's pause was undone"
        assert {d.fdid for d in read_domain(hv.xml("ops"), strict=False).devices} == {GPU}
        with open_fabric(etcd_url, "gamma") as f:
            assert f.device(GPU).holder == ops
            assert f.device(NIC).holder == DB
    assert "VM ops: re-reserved 0x10; lost 0x20" in caplog.text
    assert "stays paused: an operator paused it (its lost devices hot-unplugged)" in caplog.text


class _FailsToShow(SimHypervisor):
    """The live XML of ``vm`` cannot be had the first ``times`` times (a job holds it)."""

    def __init__(self, *args, vm: str, times: int, **kw) -> None:
        super().__init__(*args, **kw)
        self.failing, self.left = vm, times

    def xml(self, name: str, inactive: bool = False) -> bytes:
        if name == self.failing and not inactive and self.left > 0:
            self.left -= 1
            raise LibvirtError("get XML of", name, "cannot acquire state change lock")
        return super().xml(name, inactive)


def test_an_operators_vm_whose_recovery_failed_is_recovered_by_the_loop_later(
    etcd, etcd_url, tmp_path, monkeypatch, caplog
):
    """As above, but the hypervisor cannot show ops's XML to the start-up (twice: its look
    for VMs without their holds, then the recovery): ops stays paused with beta's device. The
    agent's loop tries it again (a TTL later: brought forward here) and unplugs 0x20, ops
    still paused."""
    caplog.set_level(logging.WARNING)
    root = _beta_holds(NIC, etcd, etcd_url, tmp_path, monkeypatch)
    host_lease(etcd, root, node="gamma")
    ops = Holder("gamma", "ops", "33333333-3333-3333-3333-333333333333")
    hv = _FailsToShow("gamma", tmp_path / "hv", None, vm="ops", times=2)
    hv.define(domain_xml(ops.vm, ops.vm_uuid, (GPU, NIC)))
    hv.start(ops.vm)
    hv.suspend(ops.vm)  # an operator's
    with _agent_running(HangingAgent, hv, etcd_url, root, FakeClock()) as agent:
        _until("the agent's start-up", lambda: "reconcile of gamma done" in caplog.text)
        assert "cannot acquire state change lock" in caplog.text
        assert NIC in {d.fdid for d in read_domain(hv.xml("ops"), strict=False).devices}
        agent._operators_next = 0.0  # a TTL has passed
        _until("the loop's try again", lambda: "stays paused: an operator paused it" in caplog.text)
        assert hv.lookup("ops").state is DomainState.PAUSED
        assert NIC not in {d.fdid for d in read_domain(hv.xml("ops"), strict=False).devices}
