"""The agent's recovery of paused VMs after a lost lease, in-process on an SQLite fabric and a
simulated hypervisor: the paths the process tests in test_agent.py do not reach."""

from __future__ import annotations

from pathlib import Path

from tests.support.simcluster import domain_of as _domain
from tests.support.simfabric import make_fabric
from vmlend.agent.recover import LostLeaseRecovery
from vmlend.agent.watch import LeaseWatch
from vmlend.domain import read_domain
from vmlend.errors import LeaseExpiredError, LibvirtError
from vmlend.hypervisor.base import DomainState
from vmlend.sim.hypervisor.node import SimHypervisor
from vmlend.topology.model import Holder

GPU, NIC = 0x10, 0x20
APP = Holder("gamma", "app", "33333333-3333-3333-3333-333333333333")
DB = Holder("beta", "db", "22222222-2222-2222-2222-222222222222")


class NoUnplug(SimHypervisor):
    """A hypervisor that refuses hot-unplug (e.g. QEMU without a hotplug-capable slot)."""

    def detach_device(self, name: str, device_xml: bytes, live: bool, config: bool) -> None:
        raise LibvirtError("detach device from", name, "no hot-unplug on this slot")


def _setup(tmp_path: Path, hv_class: type[SimHypervisor]):
    fabric = make_fabric(tmp_path / "state.db")  # opened as gamma
    hv = hv_class("gamma", tmp_path / "hv", None)  # no hook: the test decides the holds
    hv.define(_domain("app", APP.vm_uuid, (GPU, NIC)))
    hv.start("app")
    hv.suspend("app")  # as the guard left it
    fabric.reserve(NIC, DB)  # another host was faster
    return fabric, hv, _recovery_for(hv, fabric)


def _recovery_for(hv, fabric, fence_wait: float = 0, **kw) -> LostLeaseRecovery:  # type: ignore[no-untyped-def]
    """A recovery on a clock that ticks a second per look, sleeping not at all."""
    ticks = iter(range(1000))
    return LostLeaseRecovery(
        hv,
        fabric,
        fence_wait=fence_wait,
        interval=0.01,
        clock=lambda: next(ticks),
        sleep=lambda s: None,
        **kw,
    )


def test_a_vm_whose_lost_device_cannot_be_unplugged_stays_paused_and_says_why(tmp_path):
    fabric, hv, recovery = _setup(tmp_path, NoUnplug)
    [result] = recovery.recover(["app"])
    assert hv.lookup("app").state is DomainState.PAUSED
    assert result.outcome == "paused" and result.regained == [GPU] and list(result.lost) == [NIC]
    text = result.describe()
    assert "VM app: re-reserved 0x10; lost 0x20 (device 0x20 is held by beta/db)" in text
    assert "stays paused: could not hot-unplug its lost devices:" in text
    assert "no hot-unplug on this slot" in text
    assert fabric.device(NIC).holder == DB  # nobody else's device was touched


def test_a_vm_that_lost_a_device_resumes_without_it(tmp_path):
    fabric, hv, recovery = _setup(tmp_path, SimHypervisor)
    [result] = recovery.recover(["app"])
    assert result.outcome == "unplugged"
    assert hv.lookup("app").state is DomainState.RUNNING
    assert fabric.device(GPU).holder is not None and fabric.device(GPU).holder.vm == "app"
    assert fabric.device(NIC).holder == DB


def test_an_unknown_vm_is_reported_not_fatal(tmp_path):
    _fabric, _hv, recovery = _setup(tmp_path, SimHypervisor)
    [result] = recovery.recover(["gone"])
    assert result.outcome == "stopped" and "gone" in result.describe()


def test_a_vm_won_back_stays_paused_while_the_new_lease_is_in_doubt(tmp_path):
    """By the time the VM's devices are re-reserved, the new lease may have gone unrenewed for
    half its TTL (etcd away again) and be about to end with those holds. Resuming then would
    undo the watch's pause and run the VM on devices the lenders will take back (seen in
    tests/scenarios/test_nemesis.py). The watch decides."""
    fabric, hv, _recovery = _setup(tmp_path, SimHypervisor)
    clock = iter(range(1000))
    watch = LeaseWatch(10, list, clock=lambda: next(clock) * 6.0)  # each look: 6 s later
    recovery = LostLeaseRecovery(
        hv,
        fabric,
        fence_wait=0,
        interval=0.01,
        clock=lambda: 0.0,
        sleep=lambda s: None,
        resume_gate=watch.resume_if_fresh,
    )
    [result] = recovery.recover(["app"])
    assert result.regained == [GPU] and list(result.lost) == [NIC]
    assert result.outcome == "paused", result.describe()
    assert "resumed after the next renewal" in result.describe()
    assert hv.lookup("app").state is DomainState.PAUSED
    assert watch.renewed() == ["app"]  # the agent resumes what this hands back


def test_the_watch_resumes_a_vm_only_while_the_lease_is_fresh():
    now = [0.0]
    watch = LeaseWatch(10, list, clock=lambda: now[0])
    resumed: list[str] = []
    assert watch.resume_if_fresh("a", lambda: resumed.append("a"))
    now[0] = 5.1  # past half the TTL since the lease was taken
    assert not watch.resume_if_fresh("b", lambda: resumed.append("b"))
    assert resumed == ["a"]
    assert watch.take_paused() == ["b"]  # a lost lease hands it to the recovery again


def test_a_vm_stopped_while_its_devices_are_re_reserved_keeps_none_of_them(tmp_path):
    """Found by the nemesis test: a paused VM destroyed while the agent waits to re-reserve
    its device (fenced under the old lease) left a hold with no VM behind it, for good, since
    its release had run before. The recovery now checks the VM is still there and returns
    what it took."""
    fabric = make_fabric(tmp_path / "state.db")
    hv = SimHypervisor("gamma", tmp_path / "hv", None)
    hv.define(_domain("app", APP.vm_uuid, (GPU,)))
    hv.start("app")
    hv.suspend("app")

    class DestroyedMeanwhile(LostLeaseRecovery):
        def _acquire(self, holder, fdid, mdev, guest_ram):  # the wait for the fence, then
            hv.destroy("app")  # an operator's destroy (its release found nothing held)
            super()._acquire(holder, fdid, mdev, guest_ram)

    recovery = DestroyedMeanwhile(hv, fabric, fence_wait=0, interval=0.01)
    [result] = recovery.recover(["app"])
    assert result.outcome == "stopped" and "stopped meanwhile" in result.describe()
    assert fabric.device(GPU).holder is None  # nothing kept for a VM that is gone
    assert [m for m in fabric.mdevs() if m.fdid == GPU] == []


def test_a_lease_that_ends_during_the_recovery_loses_no_device(tmp_path):
    """Seen in CI: an agent frozen again while it re-reserved (here at start-up, for VMs that
    ran without their holds) took etcd's "lease not found" for a device held elsewhere,
    hot-unplugged the device from the guest and never won it back. The lease is what was lost:
    the VM stays paused with its devices, parked for the recovery under the next lease, and
    no renewal resumes it meanwhile."""
    fabric, hv, _recovery = _setup(tmp_path, SimHypervisor)
    fabric.release(NIC, DB)  # nobody else holds anything: only the lease ends

    class LeaseEnds(LostLeaseRecovery):
        def _acquire(self, holder, fdid, mdev, guest_ram):
            if fdid == NIC:  # the GPU was re-reserved, then the lease ended
                raise LeaseExpiredError()
            super()._acquire(holder, fdid, mdev, guest_ram)

    watch = LeaseWatch(10, list, clock=lambda: 0.0)
    recovery = LeaseEnds(hv, fabric, fence_wait=0, interval=0.01, park=watch.park)
    [result] = recovery.recover(["app"])
    assert result.outcome == "paused" and result.lost == {} and result.regained == []
    assert "lease ended while its devices were re-reserved" in result.describe()
    assert hv.lookup("app").state is DomainState.PAUSED
    live = read_domain(hv.xml("app"))
    assert [d.fdid for d in live.devices] == [GPU, NIC]  # nothing unplugged
    assert watch.renewed() == []  # its holds are gone: a renewal must not resume it
    assert watch.take_paused() == ["app"]  # the recovery under the next lease takes it
    assert watch.take_paused() == []


def test_a_vm_whose_devices_cannot_be_re_reserved_for_want_of_etcd_is_tried_again(
    tmp_path, monkeypatch
):
    """etcd away for longer than the recovery waits: the device may still be the VM's, so
    nothing is unplugged and the VM stays paused, handed back for another try on the agent's
    next turn (it used to stay paused for good)."""
    from vmlend.agent import recover as recover_module
    from vmlend.errors import RegistryUnreachableError

    def unreachable(*_args, **_kw):  # type: ignore[no-untyped-def]
        raise RegistryUnreachableError("127.0.0.1:2379", "etcd does not answer")

    monkeypatch.setattr(recover_module, "acquire_device", unreachable)
    fabric, hv, _recovery = _setup(tmp_path, SimHypervisor)
    again: list[str] = []
    recovery = _recovery_for(hv, fabric, retry=again.append)
    [result] = recovery.recover(["app"])
    assert result.outcome == "paused" and "tried again" in result.why
    assert again == ["app"]
    assert hv.lookup("app").state is DomainState.PAUSED
    assert {d.fdid for d in read_domain(hv.xml("app"), strict=False).devices} == {GPU, NIC}


def test_after_a_lost_lease_a_vm_the_pause_missed_is_paused_for_the_recovery(tmp_path):
    """The pause at a lost lease misses a VM (its suspend failed, or it began to run after the
    pause looked): it runs on devices it no longer holds. The agent looks for such VMs once
    it has its new lease, as at start-up, and pauses them for the recovery."""
    from vmlend.agent.guard import RemoteVmGuard
    from vmlend.agent.service import Agent

    fabric = make_fabric(tmp_path / "state.db")
    hv = SimHypervisor("gamma", tmp_path / "hv", None)
    hv.define(_domain("app", APP.vm_uuid, (GPU,)))
    hv.start("app")  # no hold: it went with the lost lease
    watch = LeaseWatch(10, list)
    names, operators = Agent._without_holds(hv, fabric, RemoteVmGuard(hv, fabric, "gamma"), watch)
    assert (names, operators) == (["app"], [])
    assert hv.lookup("app").state is DomainState.PAUSED


def test_a_renewal_does_not_resume_a_vm_that_lacks_a_hold(tmp_path):
    """Whatever the watch's bookkeeping hands back (its races were found by review, one by
    one), a renewal's resume first asks the registry: a VM that uses a device it does not
    hold (the lender gave it to beta's db) is not resumed but given to the recovery."""
    import threading
    import time

    from vmlend.agent.guard import RemoteVmGuard
    from vmlend.agent.recover import lacks_holds
    from vmlend.wiring.fabric import open_fabric

    fabric, hv, _recovery = _setup(tmp_path, SimHypervisor)
    fabric.reserve(GPU, APP)  # app holds 0x10; 0x20 went to beta's db
    watch = LeaseWatch(10, list)

    def lacks(name: str) -> bool:  # on the resume's thread, as the agent does: its own fabric
        with open_fabric(tmp_path / "state.db", "gamma") as f:
            return lacks_holds(hv, f, name)

    recovered: list[str] = []
    done = threading.Event()

    def recover(name: str) -> None:
        recovered.append(name)
        done.set()

    RemoteVmGuard(hv, fabric, "gamma").resume(
        ["app"],
        watch.resume_if_fresh,
        watch.generation,
        lacks_holds=lacks,
        recover=recover,
    )
    assert done.wait(20)
    time.sleep(0.1)
    assert recovered == ["app"]
    assert hv.lookup("app").state is DomainState.PAUSED
    fabric.release(NIC, DB)
    fabric.reserve(NIC, APP)  # now it holds both: resumed
    RemoteVmGuard(hv, fabric, "gamma").resume(
        ["app"],
        watch.resume_if_fresh,
        watch.generation,
        lacks_holds=lacks,
        recover=recovered.append,
    )
    deadline = time.monotonic() + 20
    while hv.lookup("app").state is not DomainState.RUNNING:
        assert time.monotonic() < deadline, "app was never resumed"
        time.sleep(0.02)


class JobTimeout(SimHypervisor):
    """A hypervisor that does not answer for the VM's XML once (a job timeout)."""

    failed = False

    def xml(self, name: str) -> bytes:
        if not JobTimeout.failed:
            JobTimeout.failed = True
            raise LibvirtError("get XML of", name, "cannot acquire state change lock")
        return super().xml(name)


def test_a_vm_the_hypervisor_failed_for_is_tried_again_not_left_paused(tmp_path):
    fabric, hv, _recovery = _setup(tmp_path, JobTimeout)
    again: list[str] = []
    recovery = _recovery_for(hv, fabric, retry=again.append)
    [first] = recovery.recover(["app"])
    assert first.outcome == "paused" and "tried again" in first.why and again == ["app"]
    [second] = recovery.recover(again)
    assert second.outcome == "unplugged"  # 0x20 went to beta's db meanwhile
    assert hv.lookup("app").state is DomainState.RUNNING


def test_a_resume_whose_holds_cannot_be_read_waits_for_the_next_renewal(tmp_path):
    """The holds check itself fails (any error): the VM is neither resumed nor lost, but
    held back for the next renewal to try again."""
    import threading

    from vmlend.agent.guard import RemoteVmGuard

    fabric, hv, _recovery = _setup(tmp_path, SimHypervisor)
    held: list[str] = []
    done = threading.Event()

    def broken(_name: str) -> bool:
        raise RuntimeError("connection reset")

    def hold_back(name: str) -> None:
        held.append(name)
        done.set()

    RemoteVmGuard(hv, fabric, "gamma").resume(
        ["app"],
        LeaseWatch(10, list).resume_if_fresh,
        0,
        lacks_holds=broken,
        recover=lambda n: None,
        hold_back=hold_back,
    )
    assert done.wait(20) and held == ["app"]
    assert hv.lookup("app").state is DomainState.PAUSED


def test_the_recovery_takes_back_this_hosts_own_fenced_device_while_it_waits(tmp_path, monkeypatch):
    """A device this host lends to its own VM is fenced under the lost lease; only this
    host's agent takes it back, and its loop is busy with the recovery: the recovery does
    it while it waits, instead of waiting a TTL and unplugging the VM's own device."""
    from vmlend.agent import recover as recover_module
    from vmlend.errors import DeviceFencedError

    taken: list[bool] = []
    real = recover_module.acquire_device

    def fenced_until_taken_back(*args, **kw):  # type: ignore[no-untyped-def]
        if not taken:
            raise DeviceFencedError(GPU, "gamma", "gamma/app")
        return real(*args, **kw)

    monkeypatch.setattr(recover_module, "acquire_device", fenced_until_taken_back)
    fabric, hv, _recovery = _setup(tmp_path, SimHypervisor)
    recovery = _recovery_for(hv, fabric, fence_wait=5, take_back=lambda: taken.append(True))
    [result] = recovery.recover(["app"])
    assert taken and GPU in result.regained


def test_an_unreadable_vm_is_suspect_and_does_not_hide_the_others(tmp_path):
    """One VM whose XML the hypervisor does not give (a job timeout) is counted as one
    without its holds (paused and recovered, which retries), and the others are still
    looked at."""
    from vmlend.agent.recover import vms_without_their_holds

    class Unreadable(SimHypervisor):
        def xml(self, name: str) -> bytes:
            if name == "broken":
                raise LibvirtError("get XML of", name, "cannot acquire state change lock")
            return super().xml(name)

    fabric, hv, _recovery = _setup(tmp_path, Unreadable)
    hv.define(_domain("broken", "44444444-4444-4444-4444-444444444444", (GPU,)))
    hv.start("broken")
    assert sorted(vms_without_their_holds(hv, fabric)) == ["app", "broken"]


def test_a_failed_take_back_of_another_device_does_not_lose_this_one(tmp_path, monkeypatch):
    from vmlend.agent import recover as recover_module
    from vmlend.errors import DeviceFencedError, FabricError

    tries: list[int] = []
    real = recover_module.acquire_device

    def fenced_twice(*args, **kw):  # type: ignore[no-untyped-def]
        if len(tries) < 2:
            tries.append(1)
            raise DeviceFencedError(GPU, "alpha", "gamma/app")
        return real(*args, **kw)

    def take_back() -> None:
        raise FabricError("take-back of 0x99 failed: the driver refused")

    monkeypatch.setattr(recover_module, "acquire_device", fenced_twice)
    fabric, hv, _recovery = _setup(tmp_path, SimHypervisor)
    recovery = _recovery_for(hv, fabric, fence_wait=50, take_back=take_back)
    [result] = recovery.recover(["app"])
    assert GPU in result.regained and GPU not in result.lost


class LookupTimeout(SimHypervisor):
    """A hypervisor that cannot say once how the VM is (a job timeout on its state)."""

    failed = False

    def lookup(self, name: str):  # type: ignore[no-untyped-def]
        if not LookupTimeout.failed:
            LookupTimeout.failed = True
            raise LibvirtError("look up", name, "cannot acquire state change lock")
        return super().lookup(name)


def test_a_vm_the_hypervisor_cannot_say_is_there_keeps_its_holds_and_is_tried_again(tmp_path):
    """After re-reserving, the recovery asks whether the VM still runs. A hypervisor error
    there used to count as "it stopped": the devices just re-reserved were returned and the VM,
    still there, stayed paused without them."""
    fabric, hv, _recovery = _setup(tmp_path, LookupTimeout)
    again: list[str] = []
    [first] = _recovery_for(hv, fabric, retry=again.append).recover(["app"])
    assert first.outcome == "paused" and "tried again" in first.why and again == ["app"]
    assert fabric.device(GPU).holder == APP, "the device re-reserved for app was returned"
    [second] = _recovery_for(hv, fabric).recover(again)
    assert second.outcome == "unplugged"
    assert hv.lookup("app").state is DomainState.RUNNING


class PausedGuestKeepsIt(SimHypervisor):
    """libvirt's live detach only asks the guest to let go (QEMU's ``device_del``), and a
    paused guest cannot answer: the hostdev stays."""

    def detach_device(self, name: str, device_xml: bytes, live: bool, config: bool) -> None:
        if self.lookup(name).state is not DomainState.PAUSED:
            super().detach_device(name, device_xml, live, config)


def test_a_vm_an_operator_paused_is_left_paused_with_its_lost_devices_unplugged(tmp_path):
    fabric, hv, recovery = _setup(tmp_path, SimHypervisor)
    [result] = recovery.recover(["app"], leave_paused=True)
    assert result.outcome == "kept-paused"
    assert hv.lookup("app").state is DomainState.PAUSED
    assert {d.fdid for d in read_domain(hv.xml("app"), strict=False).devices} == {GPU}
    assert fabric.device(GPU).holder is not None and fabric.device(GPU).holder.vm == "app"
    assert result.describe().endswith(
        "stays paused: an operator paused it (its lost devices hot-unplugged)"
    )


def test_a_paused_guest_that_keeps_a_lost_hostdev_is_not_called_unplugged(tmp_path):
    """Left paused, the VM cannot finish the unplug: the recovery must not say it did, nor
    drop the device from the metadata (the agent, and reconcile, would no longer see that the
    VM uses a device beta holds); the operator is told not to resume it yet."""
    fabric, hv, recovery = _setup(tmp_path, PausedGuestKeepsIt)
    [result] = recovery.recover(["app"], leave_paused=True)
    assert result.outcome == "paused"
    assert hv.lookup("app").state is DomainState.PAUSED
    assert {d.fdid for d in read_domain(hv.xml("app"), strict=False).devices} == {GPU, NIC}
    assert "device 0x20 is still plugged: a paused guest cannot release it" in result.why
    assert "do not resume it before 'vmlend reconcile' shows it clean" in result.why
    assert fabric.device(NIC).holder == DB


def test_an_operators_pause_is_told_from_the_agents_by_its_mark(tmp_path):
    from vmlend.agent.guard import RemoteVmGuard
    from vmlend.agent.pause_marks import PauseMarks

    fabric = make_fabric(tmp_path / "state.db")
    hv = SimHypervisor("gamma", tmp_path / "hv", None)
    for n, vm in enumerate(("ours", "theirs", "running"), 1):
        hv.define(_domain(vm, f"00000000-0000-4000-8000-{n:012x}", ()))
        hv.start(vm)
    marks_dir = tmp_path / "marks"
    marks_dir.mkdir(mode=0o700)
    guard = RemoteVmGuard(hv, fabric, "gamma", PauseMarks(marks_dir))
    assert guard.suspend_if_running("ours")  # the agent's pause: marked
    hv.suspend("theirs")  # an operator's
    assert not guard.paused_by_operator("ours")
    assert guard.paused_by_operator("theirs")
    assert not guard.paused_by_operator("running")
    assert not guard.paused_by_operator("nothing-of-that-name")
    assert not RemoteVmGuard(hv, fabric, "gamma").paused_by_operator("theirs")  # no marks


def test_an_operators_vm_not_recovered_yet_is_tried_again_once_a_ttl(tmp_path):
    """VMs whose recovery as an operator's failed earlier (etcd away, say): ops is still
    paused (its devices are recovered now, left paused); app was resumed by its operator
    meanwhile and runs without its holds (the agent's now, handed to the loop's recovery);
    fine was resumed too and holds its device (left alone); gone is gone (forgotten). Not
    before a TTL since the last try."""
    from tests.support.clocks import FakeClock
    from vmlend.agent.guard import RemoteVmGuard
    from vmlend.agent.pause_marks import PauseMarks
    from vmlend.agent.recover import lacks_holds
    from vmlend.agent.service import Agent, AgentConfig

    fabric, hv, recovery = _setup(tmp_path, SimHypervisor)  # app, paused, lost NIC to db
    hv.define(_domain("ops", "00000000-0000-4000-8000-000000000001", (GPU, NIC)))
    hv.start("ops")
    hv.suspend("ops")  # an operator's pause
    hv.resume("app")  # the operator's resume of app
    marks_dir = tmp_path / "marks"
    marks_dir.mkdir(mode=0o700)
    guard = RemoteVmGuard(hv, fabric, "gamma", PauseMarks(marks_dir))
    watch = LeaseWatch(10, list)
    clock = FakeClock()
    agent = Agent(AgentConfig("etcd://127.0.0.1:1/x", "gamma", tmp_path / "lease", ttl=2), clock)
    agent._holds_checker = lambda hv: lambda name: lacks_holds(hv, fabric, name)  # type: ignore[method-assign]
    hv.define(_domain("fine", "00000000-0000-4000-8000-000000000002", (0x11,)))
    hv.start("fine")  # its operator resumed it, and its hold is there: left alone
    fabric.reserve(0x11, Holder("gamma", "fine", "00000000-0000-4000-8000-000000000002"))
    agent._operators_pending = {"ops", "app", "gone", "fine"}
    agent._operators_next = clock() + 1  # the last try was under a TTL ago
    agent._retry_operators(hv, recovery, guard, watch)
    assert hv.lookup("ops").state is DomainState.PAUSED
    assert {d.fdid for d in read_domain(hv.xml("ops"), strict=False).devices} == {GPU, NIC}

    clock.advance(1)
    agent._retry_operators(hv, recovery, guard, watch)
    assert hv.lookup("ops").state is DomainState.PAUSED
    assert {d.fdid for d in read_domain(hv.xml("ops"), strict=False).devices} == {GPU}
    assert fabric.device(GPU).holder is not None and fabric.device(GPU).holder.vm == "ops"
    assert watch.take_orphans() == ["app"]
    assert agent._operators_pending == set()
    assert hv.lookup("fine").state is DomainState.RUNNING


def test_a_pause_is_not_taken_for_an_operators_when_the_marks_cannot_be_read(tmp_path):
    """The marks directory is writable by others (unsafe: no mark is written or read). The
    guard's own pause of "ours" is still its own; for a VM it did not pause, nobody can tell
    whose the pause is, so it is not taken for an operator's either (which would leave an
    agent's VM paused for good)."""
    from vmlend.agent.guard import RemoteVmGuard
    from vmlend.agent.pause_marks import PauseMarks

    fabric = make_fabric(tmp_path / "state.db")
    hv = SimHypervisor("gamma", tmp_path / "hv", None)
    for n, vm in enumerate(("ours", "theirs"), 1):
        hv.define(_domain(vm, f"00000000-0000-4000-8000-{n:012x}", ()))
        hv.start(vm)
    marks_dir = tmp_path / "marks"
    marks_dir.mkdir()
    marks_dir.chmod(0o777)
    guard = RemoteVmGuard(hv, fabric, "gamma", PauseMarks(marks_dir))
    assert guard.suspend_if_running("ours")  # its mark cannot be written: logged
    hv.suspend("theirs")
    assert not guard.paused_by_operator("ours")
    assert not guard.paused_by_operator("theirs")
    successor = RemoteVmGuard(hv, fabric, "gamma", PauseMarks(marks_dir))
    assert not successor.paused_by_operator("ours")
