"""Winning a paused VM's devices back (``vmlend.agent.recover``), in-process on an SQLite
fabric and a simulated hypervisor: each device re-reserved, or hot-unplugged when lost; the
VM's worker resumes it afterwards (``test_guest.py``)."""

from __future__ import annotations

from pathlib import Path

from tests.support.simcluster import domain_of as _domain
from tests.support.simfabric import make_fabric
from vmlend.agent.recover import WinBack, unheld
from vmlend.domain import read_domain
from vmlend.errors import LeaseExpiredError, LibvirtError, RegistryUnreachableError
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


class AskOnly(SimHypervisor):
    """libvirt's live detach only asks the guest (QEMU's ``device_del``): a paused guest never
    answers, so the hostdev stays in the live XML."""

    def detach_device(self, name: str, device_xml: bytes, live: bool, config: bool) -> None:
        pass


def _setup(tmp_path: Path, hv_class: type[SimHypervisor] = SimHypervisor):
    fabric = make_fabric(tmp_path / "state.db")  # opened as gamma
    hv = hv_class("gamma", tmp_path / "hv", None)  # no hook: the test decides the holds
    hv.define(_domain("app", APP.vm_uuid, (GPU, NIC)))
    hv.start("app")
    hv.suspend("app")  # as its worker left it
    fabric.reserve(NIC, DB)  # another host was faster
    return fabric, hv


def _win(hv, fabric, *, fence_wait: float = 0, in_time=lambda: True) -> WinBack:  # type: ignore[no-untyped-def]
    """On a clock that ticks a second per look, sleeping not at all."""
    ticks = iter(range(1000))
    return WinBack(
        hv,
        fabric,
        fence_wait=fence_wait,
        interval=0.01,
        in_time=in_time,
        clock=lambda: next(ticks),
        sleep=lambda s: None,
    )


def test_a_device_another_host_took_is_unplugged_and_one_still_free_is_re_reserved(tmp_path):
    fabric, hv = _setup(tmp_path)
    assert unheld(hv, fabric, "app") == [GPU, NIC]
    result = _win(hv, fabric).run("app", leave_paused=False)
    assert result.outcome == "unplugged" and result.regained == [GPU] and list(result.lost) == [NIC]
    assert fabric.device(GPU).holder is not None and fabric.device(GPU).holder.vm == "app"
    assert fabric.device(NIC).holder == DB  # nobody else's device was touched
    assert [d.fdid for d in read_domain(hv.xml("app")).devices] == [GPU]  # live: NIC gone
    assert [d.fdid for d in read_domain(hv.xml("app", inactive=True)).devices] == [GPU, NIC]
    assert hv.lookup("app").state is DomainState.PAUSED  # resuming is its worker's
    assert unheld(hv, fabric, "app") == []


def test_a_vm_whose_lost_device_cannot_be_unplugged_stays_paused_and_says_why(tmp_path):
    fabric, hv = _setup(tmp_path, NoUnplug)
    result = _win(hv, fabric).run("app", leave_paused=False)
    assert result.outcome == "paused" and result.regained == [GPU] and list(result.lost) == [NIC]
    text = result.describe()
    assert "VM app: re-reserved 0x10; lost 0x20 (device 0x20 is held by beta/db)" in text
    assert "stays paused: could not hot-unplug its lost devices:" in text
    assert "no hot-unplug on this slot" in text
    assert fabric.device(NIC).holder == DB


def test_an_unknown_vm_is_stopped_not_fatal(tmp_path):
    fabric, hv = _setup(tmp_path)
    result = _win(hv, fabric).run("gone", leave_paused=False)
    assert result.outcome == "stopped" and "gone" in result.describe()


def test_a_vm_stopped_while_its_devices_are_re_reserved_keeps_none_of_them(tmp_path):
    """Found by the nemesis test: a paused VM destroyed while its devices are re-reserved
    must not keep them: its release ran before the reserve, or will not run again."""
    fabric, hv = _setup(tmp_path)
    real_reserve = fabric.reserve

    def reserve_then_destroy(*a, **kw):  # type: ignore[no-untyped-def]
        out = real_reserve(*a, **kw)
        hv.destroy("app")
        return out

    fabric.reserve = reserve_then_destroy  # type: ignore[method-assign]
    result = _win(hv, fabric).run("app", leave_paused=False)
    assert result.outcome == "stopped" and "returned" in result.why
    assert fabric.device(GPU).holder is None


class LeaseEndsOnReserve:
    """A fabric whose reserve fails because the lease it writes under has ended."""

    def __init__(self, fabric) -> None:  # type: ignore[no-untyped-def]
        self._fabric = fabric

    def reserve(self, *a, **kw):  # type: ignore[no-untyped-def]
        raise LeaseExpiredError()

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._fabric, name)


def test_a_lease_that_ends_during_the_win_back_loses_no_device(tmp_path):
    """Unplugging then would take a device from a guest that may win it back under the next
    lease: the VM stays paused, its devices where they are."""
    fabric, hv = _setup(tmp_path)
    result = _win(hv, LeaseEndsOnReserve(fabric)).run("app", leave_paused=False)  # type: ignore[arg-type]
    assert result.outcome == "paused" and result.lost == {} and result.regained == []
    assert "lease ended meanwhile" in result.why
    assert [d.fdid for d in read_domain(hv.xml("app")).devices] == [GPU, NIC]


def test_a_lease_changed_since_the_win_back_began_unplugs_nothing(tmp_path):
    fabric, hv = _setup(tmp_path)
    looks = iter([True, False, False, False])
    result = _win(hv, fabric, in_time=lambda: next(looks)).run("app", leave_paused=False)
    assert result.outcome == "paused" and "lease changed meanwhile" in result.why
    assert [d.fdid for d in read_domain(hv.xml("app")).devices] == [GPU, NIC]


class Unreachable:
    def __init__(self, fabric) -> None:  # type: ignore[no-untyped-def]
        self._fabric = fabric

    def reserve(self, *a, **kw):  # type: ignore[no-untyped-def]
        raise RegistryUnreachableError("127.0.0.1:2379", "cannot reach etcd")

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._fabric, name)


def test_a_device_that_cannot_be_re_reserved_for_want_of_etcd_is_not_taken_for_lost(tmp_path):
    """etcd away for longer than the win-back waits: the device may still be the VM's, so
    nothing is unplugged on a guess; the VM stays paused and its worker tries again."""
    fabric, hv = _setup(tmp_path)
    result = _win(hv, Unreachable(fabric), fence_wait=3).run("app", leave_paused=False)  # type: ignore[arg-type]
    assert result.outcome == "paused" and result.lost == {}
    assert "registry cannot be reached" in result.why and "tried again" in result.why
    assert [d.fdid for d in read_domain(hv.xml("app")).devices] == [GPU, NIC]


def test_somebody_elses_pause_keeps_a_hostdev_the_guest_could_not_let_go(tmp_path):
    """Left paused (an operator's pause), the guest cannot finish a live unplug: the device
    must not be called unplugged, nor dropped from the metadata, while its hostdev is in."""
    fabric, hv = _setup(tmp_path, AskOnly)
    result = _win(hv, fabric).run("app", leave_paused=True)
    assert result.outcome == "paused" and "still plugged" in result.why
    assert [d.fdid for d in read_domain(hv.xml("app")).devices] == [GPU, NIC]


def test_somebody_elses_pause_is_left_paused_with_its_lost_devices_unplugged(tmp_path):
    fabric, hv = _setup(tmp_path)
    result = _win(hv, fabric).run("app", leave_paused=True)
    assert result.outcome == "kept-paused" and list(result.lost) == [NIC]
    assert "stays paused: somebody else paused it (its lost devices hot-unplugged)" in (
        result.describe()
    )
    assert [d.fdid for d in read_domain(hv.xml("app")).devices] == [GPU]
    assert hv.lookup("app").state is DomainState.PAUSED


def test_a_device_won_back_is_claimed_by_the_vms_exact_layout_not_by_its_size(tmp_path):
    """A 3 GiB i440fx guest has all its RAM below 4 GiB: one DMA window, one segment. Its
    prepare claimed that; re-reserved after a lease loss the claim must be the same (the
    windows its guest maps), not what a guess from the size alone would claim (two)."""
    import uuid

    from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, new_domain
    from vmlend.registry import ClaimKind
    from vmlend.topology.model import GiB

    fabric = make_fabric(tmp_path / "state.db")
    hv = SimHypervisor("gamma", tmp_path / "hv", None)
    spec = DomainSpec(
        name="app",
        memory_bytes=3 * GiB,
        machine="pc",
        uuid=uuid.UUID(APP.vm_uuid),
        devices=[DeviceRequest(GPU)],
    )
    xml = new_domain(spec, templates=TemplateSet()).to_bytes()
    hv.define(xml)
    hv.start("app")
    hv.suspend("app")

    def dma_claims():  # the RAM windows' (the interrupt window, MSI over the NTB, aside)
        with fabric.registry.read() as tx:
            return sorted(
                (c.adapter, c.share, c.segments)
                for _f, c in tx.claims()
                if c.kind is ClaimKind.DMA and c.share.startswith("vm:")
            )

    fabric.reserve(GPU, APP, guest_ram=read_domain(xml).ram)  # what its prepare claimed
    admitted = dma_claims()
    assert [(a, n) for a, _share, n in admitted] == [("alpha:0", 1)]
    fabric.release(GPU, APP)  # the hold went with the lease

    result = _win(hv, fabric).run("app", leave_paused=False)
    assert result.outcome == "resumed" and result.regained == [GPU]
    assert dma_claims() == admitted
