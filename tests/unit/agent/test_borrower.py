"""The table of a host's VMs with remote devices (``vmlend.agent.borrower``): how VMs come
into it (census, prepare hook, marks), and that none waits for another."""

from __future__ import annotations

import threading
import time

from tests.support.guests import GPU, NIC, Bench
from vmlend.agent.borrower import GuestTable
from vmlend.agent.guest import GuestSettings, VmState
from vmlend.hypervisor.base import DomainInfo
from vmlend.sim.hypervisor.node import SimHypervisor

APP = "33333333-3333-3333-3333-333333333333"
WEB = "44444444-4444-4444-4444-444444444444"


def _table(b: Bench, **kw) -> GuestTable:  # type: ignore[no-untyped-def]
    return GuestTable(
        b.hv,
        b.clock,
        b.open_fabric,
        node=b.node,
        lenders={d.fdid: d.lender for d in b.fabric.topology().devices},
        marks=b.marks,
        settings=GuestSettings(period=0.05, fence_wait=0.0, interval=0.01),
        now=b.now,
        **kw,
    )


def _until(check, what: str, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_the_census_guards_the_vms_that_use_a_device_another_node_lends(tmp_path):
    """On alpha, a VM using alpha's own 0x10 and beta's 0x20 uses a remote device and is
    guarded (issue 35, point 8: it is paused when the lease is in doubt); one using only
    alpha's own device is not: alpha lends it to itself."""
    b = Bench(tmp_path, node="alpha")
    b.vm("mixed", APP, (GPU, NIC))
    b.vm("local", WEB, (GPU + 1,))
    table = _table(b)
    try:
        assert table.census() == ["mixed"]
        b.doubt()
        b.clock.poke()
        _until(lambda: b.hv.lookup("mixed").state.value == "paused", "mixed never paused")
        assert b.hv.lookup("local").state.value == "running"
    finally:
        table.stop()


class HungListing(SimHypervisor):
    """A listing that hangs (libvirt lists a domain under its lock, and a domain whose hook
    hangs holds it), while lookups by name answer."""

    def __init__(self, *a, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*a, **kw)
        self.hang = threading.Event()
        self.go = threading.Event()

    def list_domains(self) -> list[DomainInfo]:
        if self.hang.is_set():
            self.go.wait(30)
        return super().list_domains()


def test_a_vm_announced_by_its_prepare_is_paused_while_the_listing_hangs(tmp_path):
    """Issue 35, defect B: a VM that started while the domain listing hung behind another
    domain's hook was unknown to the guard and ran on. Its prepare hook, served by the agent,
    announces it: its worker pauses it by name when the lease comes in doubt."""
    hv = HungListing("gamma", tmp_path / "hv", None)
    b = Bench(tmp_path, hv)
    table = _table(b)
    try:
        table.start()
        assert table.settle(10)
        hv.hang.set()  # from now on a listing hangs
        table.announce("g1")  # its prepare hook ran here
        b.vm("g1", APP, (GPU,))
        g1 = table.guest("g1")
        assert g1 is not None
        _until(lambda: g1.state is VmState.RUNNING, "g1 never seen running")
        b.doubt()
        b.clock.poke()
        _until(lambda: hv.lookup("g1").state.value == "paused", "g1 never paused")
    finally:
        hv.go.set()
        table.stop()


class HungVm(SimHypervisor):
    """One domain whose every call hangs until ``go`` is set."""

    def __init__(self, *a, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*a, **kw)
        self.stuck = ""
        self.go = threading.Event()

    def lookup(self, name_or_uuid: str) -> DomainInfo:
        if name_or_uuid == self.stuck:
            self.go.wait(30)
        return super().lookup(name_or_uuid)


def test_a_domain_that_does_not_answer_is_reported_and_holds_up_no_other_vm(tmp_path):
    """Issue 35, point 3: one domain whose hypervisor calls hang must not keep the others
    from being paused; it is reported once as stuck."""
    hv = HungVm("gamma", tmp_path / "hv", None)
    b = Bench(tmp_path, hv)
    b.vm("stuck", APP, (GPU,))
    b.vm("web", WEB, (NIC,))
    table = _table(b)
    try:
        table.start()
        assert table.settle(10)
        hv.stuck = "stuck"
        b.doubt()
        b.clock.poke()
        _until(lambda: hv.lookup("web").state.value == "paused", "web never paused")
        b.now.advance(3)
        _until(lambda: table.report(stuck_after=2.0) != [], "the stuck VM never reported")
        assert table.report(stuck_after=2.0)[0].startswith("stuck: 'look up' has not come back")
    finally:
        hv.go.set()
        table.stop()


def test_a_paused_vm_is_the_agents_when_marked_else_somebody_elses(tmp_path):
    b = Bench(tmp_path)
    b.vm("ours", APP, (GPU,))
    b.vm("theirs", WEB, (NIC,))
    b.hv.suspend("ours")
    b.hv.suspend("theirs")
    b.marks.mark("ours")
    table = _table(b)
    try:
        table.census()
        ours, theirs = table.guest("ours"), table.guest("theirs")
        assert ours is not None and theirs is not None
        _until(lambda: ours.state is VmState.RUNNING, "the agent's pause never resumed")
        time.sleep(0.2)
        assert theirs.state is VmState.KEPT and b.hv.lookup("theirs").state.value == "paused"
    finally:
        table.stop()


def test_without_a_marks_directory_somebody_elses_pause_is_still_won_back(tmp_path):
    """Issue 35, point 8: a host whose agent never marked anything (no marks directory) still
    re-reserves or unplugs the devices of a VM an operator paused after a lease change."""
    b = Bench(tmp_path)
    b.vm("ops", APP, (GPU, NIC))
    b.hv.suspend("ops")
    assert not b.marks.dir.exists()
    holder = b.fabric.device(NIC).holder
    assert holder is not None
    b.fabric.release(NIC, holder)
    table = _table(b)
    try:
        table.census()
        ops = table.guest("ops")
        assert ops is not None
        _until(lambda: ops.state is VmState.KEPT and ops.verified == 0, "ops never won back")
        assert b.fabric.device(NIC).holder is not None  # re-reserved, left paused
        assert b.hv.lookup("ops").state.value == "paused"
    finally:
        table.stop()
