"""One VM's worker (``vmlend.agent.guest``), turn by turn: each row of its table, on an SQLite
fabric and a simulated hypervisor (``tests/support/guests.py``)."""

from __future__ import annotations

import threading

from tests.support.guests import GPU, NIC, Bench
from vmlend.agent.guest import VmState
from vmlend.errors import LibvirtError
from vmlend.hypervisor.base import DomainState
from vmlend.sim.hypervisor.node import SimHypervisor
from vmlend.topology.model import Holder

APP = "33333333-3333-3333-3333-333333333333"
DB = Holder("beta", "db", "22222222-2222-2222-2222-222222222222")


def test_a_running_vm_is_paused_and_marked_when_the_lease_comes_in_doubt(tmp_path):
    b = Bench(tmp_path)
    b.vm("app", APP, (GPU,))
    g = b.guest("app")
    b.turn(g)
    assert g.state is VmState.RUNNING and g.verified == 0  # its devices read as its own
    b.doubt()
    b.turn(g)
    assert g.state is VmState.PAUSED and b.hv.lookup("app").state is DomainState.PAUSED
    assert b.marks.names() == ["app"]
    assert b.changes[-1][:2] == ("app", "paused") and "in doubt" in b.changes[-1][2]
    b.turn(g)  # still in doubt: nothing more
    assert g.state is VmState.PAUSED


def test_a_renewal_resumes_it_once_its_devices_read_as_its_own_and_clears_its_mark(tmp_path):
    b = Bench(tmp_path)
    b.vm("app", APP, (GPU,))
    g = b.guest("app")
    b.doubt()
    b.turn(g)
    b.renew()
    b.turn(g)
    assert g.state is VmState.RUNNING and b.hv.lookup("app").state is DomainState.RUNNING
    assert b.marks.names() == [] and g.verified == 0
    assert b.recovered[-1].outcome == "resumed"


def test_after_a_lost_lease_it_is_won_back_under_the_next_only_once_that_one_is_followed(tmp_path):
    """The lease is gone with its holds (here: released by hand, as etcd does). Under the new
    lease the worker re-reserves the GPU, finds the NIC another host's and unplugs it, then
    resumes the VM; not before the host's records are on the new lease."""
    b = Bench(tmp_path)
    b.vm("app", APP, (GPU, NIC))
    g = b.guest("app")
    b.turn(g)
    b.doubt()
    b.turn(g)
    for fdid in (GPU, NIC):  # gone with the lease
        holder = b.fabric.device(fdid).holder
        assert holder is not None
        b.fabric.release(fdid, holder)
    b.fabric.reserve(NIC, DB)  # another host was faster
    b.lose()
    b.turn(g)
    assert g.state is VmState.PAUSED and b.fabric.device(GPU).holder is None  # not followed
    b.follow()
    b.turn(g)
    assert g.state is VmState.RUNNING and g.verified == 1
    result = b.recovered[-1]
    assert result.regained == [GPU] and list(result.lost) == [NIC]
    assert "VM app: re-reserved 0x10; lost 0x20 (device 0x20 is held by beta/db)" in (
        result.describe()
    )
    assert b.fabric.device(GPU).holder is not None and b.fabric.device(NIC).holder == DB


def test_a_vm_that_ran_through_a_lease_change_is_paused_to_win_its_devices_back(tmp_path):
    """A VM running unverified under the current lease (its pause failed, a late resume, an
    operator's resume, a hot-plug that landed late) is looked at: a device it does not hold
    makes the worker pause it, win the device back and resume it."""
    b = Bench(tmp_path)
    b.vm("app", APP, (GPU,))
    g = b.guest("app")
    b.turn(g)
    holder = b.fabric.device(GPU).holder
    assert holder is not None
    b.fabric.release(GPU, holder)  # its hold went with a lease it ran through
    b.lose()
    b.follow()
    b.turn(g)
    assert g.state is VmState.PAUSED and "without holding it" in b.changes[-1][2]
    b.turn(g)
    assert g.state is VmState.RUNNING and b.fabric.device(GPU).holder is not None


def test_somebody_elses_pause_is_kept_and_its_devices_won_back_without_a_resume(tmp_path):
    b = Bench(tmp_path)
    b.vm("ops", APP, (GPU, NIC))
    g = b.guest("ops")
    b.turn(g)
    b.hv.suspend("ops")  # an operator's pause
    b.turn(g)
    assert g.state is VmState.KEPT and b.marks.names() == []
    b.fabric.release(NIC, b.fabric.device(NIC).holder)  # type: ignore[arg-type]
    b.fabric.reserve(NIC, DB)
    b.doubt()
    b.turn(g)  # in doubt: a paused VM needs nothing
    b.lose()
    b.follow()
    b.turn(g)
    assert g.state is VmState.KEPT and b.hv.lookup("ops").state is DomainState.PAUSED
    assert b.recovered[-1].outcome == "kept-paused" and list(b.recovered[-1].lost) == [NIC]
    assert g.verified == 1
    b.turn(g)  # nothing more to do for it under this lease
    assert len(b.recovered) == 1
    b.hv.resume("ops")  # the operator's resume: the VM is the worker's to guard again
    b.turn(g)
    assert g.state is VmState.RUNNING


def test_somebody_resuming_the_agents_pause_makes_it_running_and_unmarked(tmp_path):
    b = Bench(tmp_path)
    b.vm("app", APP, (GPU,))
    g = b.guest("app")
    b.doubt()
    b.turn(g)
    b.hv.resume("app")  # an operator resumed it while in doubt...
    b.turn(g)
    # ...so it was seen running (mark cleared) and, still in doubt, paused again at once
    assert g.state is VmState.PAUSED and b.hv.lookup("app").state is DomainState.PAUSED
    assert [c[1] for c in b.changes] == ["paused", "running", "paused"]
    assert b.marks.names() == ["app"]


def test_a_vm_that_is_gone_loses_its_mark_and_its_worker_ends(tmp_path):
    b = Bench(tmp_path)
    b.vm("app", APP, (GPU,))
    g = b.guest("app")
    b.doubt()
    b.turn(g)
    b.hv.destroy("app")
    b.turn(g)
    assert g.state is VmState.GONE and b.marks.names() == []


class SuspendFails(SimHypervisor):
    """A suspend that fails: before it took effect, or (``lost_answer``) after."""

    lost_answer = False

    def suspend(self, name: str) -> None:
        if self.lost_answer:
            super().suspend(name)
        raise LibvirtError("suspend", name, "job timed out")


def test_a_suspend_that_failed_leaves_no_mark_and_is_tried_again(tmp_path):
    """A stale mark of a VM that ran on would make the next agent resume an operator's later
    pause of it."""
    b = Bench(tmp_path, SuspendFails("gamma", tmp_path / "hv", None))
    b.vm("app", APP, (GPU,))
    g = b.guest("app")
    b.doubt()
    b.turn(g)
    assert g.state is VmState.RUNNING and b.marks.names() == []
    assert "could not pause it" in g.trouble and "job timed out" in g.trouble


def test_a_suspend_whose_answer_was_lost_counts_as_the_agents_pause(tmp_path):
    hv = SuspendFails("gamma", tmp_path / "hv", None)
    hv.lost_answer = True
    b = Bench(tmp_path, hv)
    b.vm("app", APP, (GPU,))
    g = b.guest("app")
    b.doubt()
    b.turn(g)
    assert g.state is VmState.PAUSED and b.marks.names() == ["app"]
    b.renew()
    b.turn(g)
    assert g.state is VmState.RUNNING and b.marks.names() == []


def test_a_vm_a_previous_agent_paused_is_the_agents_and_is_resumed(tmp_path):
    b = Bench(tmp_path)
    b.vm("app", APP, (GPU,))
    b.hv.suspend("app")
    b.marks.mark("app")  # left by an agent killed before it resumed app
    g = b.guest("app", VmState.PAUSED)
    b.turn(g)
    assert g.state is VmState.RUNNING and b.marks.names() == []


class SlowResume(SimHypervisor):
    """A resume that hangs until ``go`` is set."""

    def __init__(self, *a, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*a, **kw)
        self.resuming, self.go = threading.Event(), threading.Event()

    def resume(self, name: str) -> None:
        self.resuming.set()
        assert self.go.wait(20)
        super().resume(name)


def test_a_hung_resume_is_reported_as_busy_and_holds_up_only_its_own_vm(tmp_path):
    hv = SlowResume("gamma", tmp_path / "hv", None)
    b = Bench(tmp_path, hv)
    b.vm("app", APP, (GPU,))
    b.vm("web", "44444444-4444-4444-4444-444444444444", (NIC,))
    app, web = b.guest("app"), b.guest("web")
    b.turn(web)
    b.doubt()
    b.turn(app)
    b.renew()
    t = threading.Thread(target=b.turn, args=(app,))
    t.start()
    assert hv.resuming.wait(20)
    assert app.busy is not None and app.busy[0] == "resume"
    b.doubt()
    b.turn(web)  # web's worker is not held up by app's
    assert web.state is VmState.PAUSED
    hv.go.set()
    t.join(20)
    assert app.busy is None


def test_a_prepare_is_announced_to_the_guard_and_refused_while_the_lease_is_unsettled(tmp_path):
    """The agent's hook gate (``Agent._before_hook_call``): a prepare of a VM with remote
    devices brings it into the table; while the lease is not settled it is refused in one
    line (its VM would be paused at once); a VM using only this node's devices is neither."""
    from tests.support.simcluster import domain_of
    from vmlend.agent.borrower import GuestTable
    from vmlend.agent.guest import GuestSettings
    from vmlend.agent.service import Agent, AgentConfig

    b = Bench(tmp_path, node="alpha")
    agent = Agent(
        AgentConfig(b.state, "alpha", tmp_path / "run" / "agent.lease", hypervisor=lambda: b.hv),
        clock=b.now,
    )
    agent.clock = b.clock
    table = GuestTable(
        b.hv,
        b.clock,
        b.open_fabric,
        node="alpha",
        lenders={d.fdid: d.lender for d in b.fabric.topology().devices},
        marks=b.marks,
        settings=GuestSettings(period=1.0, fence_wait=0.0, interval=0.01),
        now=b.now,
    )
    agent.borrower = table
    remote, local = domain_of("web", APP, (NIC,)), domain_of("own", APP, (GPU,))
    try:
        assert agent._before_hook_call("prepare", "own", local) is None
        assert agent._before_hook_call("prepare", "web", remote) is None
        assert table.guest("web") is not None and table.guest("own") is None
        b.doubt()
        refusal = agent._before_hook_call("prepare", "web", remote)
        assert refusal is not None and "this host's lease is in doubt" in refusal
        assert agent._before_hook_call("prepare", "own", local) is None
        assert agent._before_hook_call("release", "web", remote) is None
    finally:
        table.stop()
