"""SimFabric: the Fabric interface over the shared state (reserve/release, claims, mdevs)."""

from __future__ import annotations

import io

import pytest

from tests.support.daemon_marks import REGISTRIES
from tests.support.etcd_units import set_aside_lut
from tests.support.simcluster import domain_of
from tests.support.simfabric import make_fabric, small_topology
from vmlend.errors import (
    ConfigError,
    DeviceHeldError,
    DeviceNotLentError,
    DeviceNotReservedError,
    LenderIommuOffError,
    LenderUnavailableError,
    MdevError,
    MdevOwnedError,
    NoPathError,
    ResourceExhaustedError,
    UnknownDeviceError,
    UnknownNodeError,
    WindowExhaustedError,
)
from vmlend.fabric.base import Fabric
from vmlend.hook.main import run as run_hook
from vmlend.ledger.admission import vm_share
from vmlend.ledger.ledger import MDEV_TYPE
from vmlend.registry import open_registry
from vmlend.registry.etcd_store import EtcdRegistry
from vmlend.topology.model import DeviceState, GiB, Holder
from vmlend.topology.parse import parse_topology
from vmlend.wiring.fabric import open_fabric

VM1 = Holder("gamma", "vm1", "11111111-1111-1111-1111-111111111111")
VM2 = Holder("gamma", "vm2", "22222222-2222-2222-2222-222222222222")
U1 = "aaaaaaaa-0000-0000-0000-000000000001"
U2 = "aaaaaaaa-0000-0000-0000-000000000002"


@pytest.fixture(params=REGISTRIES)
def location(request, tmp_path):
    """The shared state of one test: an SQLite file, or a cluster prefix on a real etcd."""
    if request.param == "etcd":
        return request.getfixturevalue("etcd_url")
    return tmp_path / "state.db"


@pytest.fixture
def fab(location):
    f = make_fabric(location)
    yield f
    f.close()


def _used(f, ref):
    u = f.usage()[ref]
    return u.lut_used, u.segments_used


def _aside(f, ref) -> int:
    """The LUT entries of ``ref`` its lender sets aside for its lent devices (etcd)."""
    return set_aside_lut(f).get(ref, 0)


def test_is_a_fabric_and_lists_the_default_cluster(fab):
    assert isinstance(fab, Fabric)
    assert fab.local_node == "gamma"
    assert [n.name for n in fab.nodes()] == ["alpha", "beta", "gamma"]
    states = {st.fdid: st.state for st in fab.devices()}
    assert len(states) == 9 and set(states.values()) == {DeviceState.AVAILABLE}


def test_reserve_is_exclusive_and_idempotent(fab):
    st = fab.reserve(0x10, VM1, guest_ram=8 * GiB)
    assert st.state is DeviceState.RESERVED and st.holder == VM1
    before = fab.usage()
    assert fab.reserve(0x10, VM1, guest_ram=8 * GiB).holder == VM1
    assert fab.usage() == before  # no second set of claims
    with pytest.raises(DeviceHeldError, match=r"^device 0x10 is held by gamma/vm1$"):
        fab.reserve(0x10, VM2)
    assert fab.device(0x10).holder == VM1


def test_a_reserve_whose_commit_reply_was_lost_still_says_it_made_the_hold(fab):
    """The gateway sends a request again to another etcd member when the first times out,
    and the first may have committed: the re-run finds the hold. It is this call's (the
    nemesis's event log saw it), so it must say created, or a failed prepare's undo would not
    return it. A second call for a hold the VM already had still says not created."""
    transact = fab._reg.transact

    def reply_lost(body):
        transact(body)  # committed; its reply never came back
        return transact(body)  # the re-run, as after the gateway's retry

    fab._reg.transact = reply_lost  # type: ignore[method-assign]
    try:
        assert fab.reserve(0x10, VM1).created
    finally:
        fab._reg.transact = transact  # type: ignore[method-assign]
    again = fab.reserve(0x10, VM1)
    assert not again.created and again.holder == VM1


def test_the_vm_uuid_identifies_the_holder(fab):
    fab.reserve(0x10, VM1)
    renamed = Holder("gamma", "vm1-renamed", VM1.vm_uuid)
    assert fab.reserve(0x10, renamed).holder == VM1  # same VM under a new name
    redefined = Holder("gamma", "vm1", "33333333-3333-3333-3333-333333333333")
    with pytest.raises(DeviceHeldError):
        fab.reserve(0x10, redefined)
    assert fab.release(0x10, redefined) is False
    assert fab.device(0x10).holder == VM1


def test_release_only_releases_the_holders_own_device(fab):
    fab.reserve(0x10, VM1, guest_ram=8 * GiB)
    assert fab.release(0x10, VM2) is False
    assert fab.device(0x10).state is DeviceState.RESERVED
    assert fab.release(0x10, VM1) is True
    assert fab.release(0x10, VM1) is False
    assert fab.device(0x10).state is DeviceState.AVAILABLE
    # on etcd alpha keeps 0x10's requester entry aside while it lends it (layout 7)
    assert _used(fab, "alpha:0") == (_aside(fab, "alpha:0"), 0) and _used(fab, "gamma:0") == (0, 0)
    assert _aside(fab, "alpha:0") == (1 if isinstance(fab.registry, EtcdRegistry) else 0)
    assert fab.release(0x999, VM1) is False  # unknown device: nothing was held


def test_reserve_refusals(fab):
    with pytest.raises(UnknownDeviceError, match="unknown device fdid 0x99"):
        fab.reserve(0x99, VM1)
    with pytest.raises(UnknownNodeError, match="'delta'"):
        fab.reserve(0x10, Holder("delta", "vm1"))
    with pytest.raises(ConfigError, match="VM name"):
        fab.reserve(0x10, Holder("gamma", ""))
    with pytest.raises(ConfigError, match="negative"):
        fab.reserve(0x10, VM1, guest_ram=-1)
    fab.unlend(0x12)
    with pytest.raises(DeviceNotLentError, match="vmlend lend 0x12"):
        fab.reserve(0x12, VM1)
    assert all(st.holder is None for st in fab.devices())


def test_a_lender_with_its_iommu_off_lends_to_no_vm(location):
    from vmlend.wiring.fabric import default_topology_text

    text = default_topology_text()[0].replace('name = "beta"\n', 'name = "beta"\niommu = false\n')
    with make_fabric(location, text) as f:
        before = (f.usage(), f.devices())
        with pytest.raises(LenderIommuOffError) as e:
            f.reserve(0x20, VM1, guest_ram=8 * GiB)
        assert "\n" not in str(e.value) and "its lender beta has its IOMMU off" in str(e.value)
        assert "set iommu = true for beta" in str(e.value)
        assert (f.usage(), f.devices()) == before
        check = {c.name: c for c in f.admission(0x20, "gamma", 8 * GiB, holder=VM1)}["iommu"]
        assert not check.ok and "IOMMU off" in check.detail
        assert f.reserve(0x10, VM1).state is DeviceState.RESERVED  # alpha's IOMMU is on


def test_borrow_and_give_back_need_the_reservation(fab):
    with pytest.raises(DeviceNotReservedError, match="not reserved by gamma/vm1"):
        fab.borrow(0x10, VM1)
    fab.reserve(0x10, VM1)
    with pytest.raises(DeviceHeldError):
        fab.borrow(0x10, VM2)
    with pytest.raises(DeviceHeldError):
        fab.give_back(0x10, VM2)
    assert fab.borrow(0x10, VM1).state is DeviceState.BORROWED
    assert fab.borrow(0x10, VM1).state is DeviceState.BORROWED
    assert fab.give_back(0x10, VM1).state is DeviceState.RESERVED
    assert fab.give_back(0x10, VM1).state is DeviceState.RESERVED
    fab.borrow(0x10, VM1)
    assert fab.release(0x10, VM1) is True  # release ends the hardware borrow too
    assert fab.device(0x10).state is DeviceState.AVAILABLE
    assert fab.give_back(0x10, VM1).state is DeviceState.AVAILABLE


def test_unlend_is_refused_while_held(fab):
    fab.reserve(0x20, VM1)
    with pytest.raises(DeviceHeldError, match="device 0x20 is held by gamma/vm1"):
        fab.unlend(0x20)
    assert fab.device(0x20).state is DeviceState.RESERVED
    fab.release(0x20, VM1)
    assert fab.unlend(0x20).state is DeviceState.UNLENT
    assert fab.unlend(0x20).state is DeviceState.UNLENT
    assert fab.lend(0x20).state is DeviceState.AVAILABLE
    assert fab.lend(0x20).state is DeviceState.AVAILABLE


def test_lender_down_makes_devices_unavailable(fab):
    fab.reserve(0x11, VM1)
    fab.set_node_up("alpha", False, "cable pulled")
    assert fab.device(0x10).state is DeviceState.UNAVAILABLE
    assert fab.device(0x11).state is DeviceState.UNAVAILABLE
    assert fab.device(0x11).holder == VM1  # who held it is still known
    assert fab.device(0x20).state is DeviceState.AVAILABLE
    with pytest.raises(LenderUnavailableError, match=r"lender alpha of device 0x10 is down"):
        fab.reserve(0x10, VM2)
    with pytest.raises(LenderUnavailableError):
        fab.borrow(0x11, VM1)
    with pytest.raises(LenderUnavailableError):
        fab.ensure_mdev_parent(0x10)
    lender = {c.name: c for c in fab.admission(0x10, "gamma")}["lender"]
    assert not lender.ok and "cable pulled" in lender.detail
    assert fab.release(0x11, VM1) is True  # cleaning up still works
    fab.set_node_up("alpha", True)
    assert fab.reserve(0x10, VM2).state is DeviceState.RESERVED
    with pytest.raises(UnknownNodeError):
        fab.set_node_up("delta", False)


def test_a_vanished_device_is_unavailable(fab):
    fab.set_device_available(0x12, False)
    assert fab.device(0x12).state is DeviceState.UNAVAILABLE
    with pytest.raises(LenderUnavailableError, match="no longer offers it"):
        fab.reserve(0x12, VM1)


def test_reserve_claims_lut_dma_and_bar_room(fab):
    fab.reserve(0x10, VM1, guest_ram=64 * GiB)
    # alpha:0: 1 LUT entry; a 64 GiB q35 guest's DMA windows in 4 GiB segments, as the
    # planner maps them: low RAM 0-2 GiB in 1, high RAM 4-66 GiB rounded out to 4-68 GiB in 16.
    assert _used(fab, "alpha:0") == (1, 17)
    # gamma:0: 1 LUT entry; the GPU's BARs 16M + 32G + 32M, each in whole 4 GiB segments.
    assert _used(fab, "gamma:0") == (1, 1 + 8 + 1)
    assert fab.usage()["gamma:0"].window_used == 40 * GiB


def test_dma_windows_count_once_per_lender_adapter_and_vm(fab):
    # 16 GiB q35: low 0-2 GiB in 1 segment, high 4-18 GiB rounded out to 4-20 GiB in 4.
    fab.reserve(0x10, VM1, guest_ram=16 * GiB)
    fab.reserve(0x11, VM1, guest_ram=16 * GiB)
    assert _used(fab, "alpha:0") == (2, 5)  # two LUT entries, one set of DMA windows
    fab.reserve(0x20, VM1, guest_ram=16 * GiB)
    # another lender: its own windows (5), plus room for 0x20 to reach the BARs of 0x10 and
    # 0x11 (16M + 32G + 32M each: 1 + 8 + 1 segments); alpha:0 gets room to reach 0x20's.
    # Each adapter also names the other lender's sources in its LUT (peer-to-peer ingress).
    assert _used(fab, "beta:0") == (1 + 2, 5 + 20)
    assert _used(fab, "alpha:0") == (2 + 1, 5 + 10)
    fab.reserve(0x12, VM2, guest_ram=64 * GiB)  # 17 segments: the window is full
    assert fab.usage()["alpha:0"].window_free == 0
    fab.release(0x11, VM1)
    assert _used(fab, "beta:0") == (1 + 1, 5 + 10)  # 0x11 is no longer a P2P target or source
    fab.reserve(0x11, VM1, guest_ram=16 * GiB)  # a full window still admits vm1's own windows
    fab.release(0x12, VM2)
    fab.release(0x10, VM1)
    # 0x11 still needs the windows and P2P; on etcd alpha keeps the requester entries of
    # 0x10 and 0x12 aside while it lends them (layout 7), 0x11's among them
    idle = 2 if isinstance(fab.registry, EtcdRegistry) else 0
    assert _aside(fab, "alpha:0") == (3 if idle else 0)
    assert _used(fab, "alpha:0") == (1 + 1 + idle, 5 + 10)
    fab.release(0x11, VM1)
    assert _used(fab, "alpha:0") == (_aside(fab, "alpha:0"), 0)  # 3 set aside on etcd
    assert _used(fab, "beta:0") == (1, 5)  # 0x20 alone: no peer to reach


def test_dma_windows_count_once_for_one_vm_with_and_without_its_uuid(tmp_path):
    # 16 one-GiB segments: one VM's 10 GiB fit once, not twice.
    topo = small_topology(lender_window="16GiB", lender_segments=16)
    f = make_fabric(tmp_path / "s.db", topo, node="b")
    by_name = Holder("b", "vm", "")  # e.g. a hold recorded before the VM's UUID was known
    by_uuid = Holder("b", "vm", "11111111-1111-1111-1111-111111111111")
    f.reserve(0x100, by_name, guest_ram=10 * GiB)
    f.reserve(0x101, by_uuid, guest_ram=10 * GiB)  # the same VM (same_holder): no new window
    assert _used(f, "l:0") == (2, 10)
    f.release(0x100, by_name)
    assert _used(f, "l:0") == (1, 10)  # 0x101 still needs them
    # Another VM on the node has windows of its own.
    with pytest.raises(WindowExhaustedError):
        f.reserve(0x102, Holder("b", "other", ""), guest_ram=10 * GiB)
    f.close()
    assert vm_share(by_name) == vm_share(by_uuid)
    assert vm_share(Holder("a", "vm", by_uuid.vm_uuid)) != vm_share(by_uuid)  # another node


def test_a_vm_of_the_same_name_and_uuid_on_another_node_is_another_holder(tmp_path):
    # what a live migration's destination is until the source has given the device back
    f = make_fabric(tmp_path / "s.db", node="gamma")
    uuid = "11111111-1111-1111-1111-111111111111"
    f.reserve(0x10, Holder("gamma", "vm1", uuid), guest_ram=1 * GiB)
    with pytest.raises(DeviceHeldError):
        f.reserve(0x10, Holder("beta", "vm1", uuid), guest_ram=1 * GiB)
    assert str(f.device(0x10).holder) == "gamma/vm1"
    f.close()


def test_window_shortage_is_refused_with_exact_numbers(fab):
    fab.reserve(0x10, VM1, guest_ram=64 * GiB)
    before = fab.usage()
    with pytest.raises(WindowExhaustedError) as e:
        fab.reserve(0x12, VM2, guest_ram=72 * GiB)
    # 72 GiB: low 1 segment + high 4-76 GiB 18 segments = 76 GiB of window; 15 segments free
    assert str(e.value).startswith("NTB window alpha:0 short by 16 GiB: need 76 GiB, have 60 GiB")
    assert "gamma/vm2" in str(e.value)
    assert (e.value.need, e.value.have) == (76 * GiB, 60 * GiB)
    assert fab.usage() == before
    assert fab.device(0x12).state is DeviceState.AVAILABLE
    assert fab.reserve(0x12, VM2, guest_ram=56 * GiB).state is DeviceState.RESERVED


def test_admission_reports_every_check_and_changes_nothing(fab):
    checks = fab.admission(0x10, "gamma", 72 * GiB, holder=VM1)
    assert [c.name for c in checks] == [
        "exists", "lender", "iommu", "lent", "not-held", "dma-limit", "path", "lut", "ports",
        "window-dma", "window-bars", "segments", "p2p",
    ]  # fmt: skip
    assert all(c.ok for c in checks)
    by = {c.name: c for c in checks}
    assert by["path"].detail == "alpha:0 -> gamma:0 via mxs824"
    # the count `vmlend path 0x10 gamma` and `vmlend status` give for the same DMA
    assert (by["path"].data["hops"], by["path"].data["roots"]) == (11, 2)
    assert "30 of 30 usable free" in by["lut"].detail
    assert "72 GiB of RAM" in by["window-dma"].detail and "128 GiB free" in by["window-dma"].detail
    assert "alpha:0 needs 19 of 32 free segments" in by["segments"].detail
    assert "gamma:0 needs 10 of 32" in by["segments"].detail
    assert fab.device(0x10).state is DeviceState.AVAILABLE
    assert _used(fab, "alpha:0") == (0, 0)


def test_admission_lists_several_failures(fab):
    fab.reserve(0x10, VM1, guest_ram=64 * GiB)
    fab.unlend(0x11)
    checks = {c.name: c for c in fab.admission(0x11, "gamma", 100 * GiB, holder=VM2)}
    assert not checks["lent"].ok and not checks["window-dma"].ok and not checks["segments"].ok
    assert checks["lut"].ok and checks["not-held"].ok
    held = {c.name: c for c in fab.admission(0x10, "gamma")}["not-held"]
    assert not held.ok and held.detail == "device 0x10 is held by gamma/vm1"
    mine = {c.name: c for c in fab.admission(0x10, "gamma", holder=VM1)}
    assert all(c.ok for c in mine.values())
    unknown = fab.admission(0x99, "gamma")
    assert [(c.name, c.ok) for c in unknown] == [("exists", False)]


def test_same_node_needs_no_ntb(tmp_path):
    f = make_fabric(tmp_path / "s.db", node="alpha")
    local = Holder("alpha", "vm1")
    checks = {c.name: c for c in f.admission(0x10, "alpha", 64 * GiB, holder=local)}
    assert all(c.ok for c in checks.values())
    assert "no NTB" in checks["path"].detail
    f.reserve(0x10, local, guest_ram=500 * GiB)  # more than any window: no window is used
    assert all(u.lut_used == 0 and u.segments_used == 0 for u in f.usage().values())
    f.close()


def test_lut_exhaustion(tmp_path):
    # 4 entries, 2 reserved for the one CPU: 2 usable on the lender's adapter.
    f = make_fabric(tmp_path / "s.db", small_topology(lut_entries=4), node="b")
    f.reserve(0x100, Holder("b", "vm1"))
    f.reserve(0x101, Holder("b", "vm2"))
    with pytest.raises(ResourceExhaustedError) as e:
        f.reserve(0x102, Holder("b", "vm3"))
    assert str(e.value) == (
        "requester LUT on l:0 is short by 1 entry (need 1 entry, have 0 entries)"
    )
    assert f.device(0x102).state is DeviceState.AVAILABLE
    f.release(0x100, Holder("b", "vm1"))
    assert f.reserve(0x102, Holder("b", "vm3")).state is DeviceState.RESERVED
    f.close()


def test_lut_exhaustion_on_the_borrower_side(tmp_path):
    f = make_fabric(tmp_path / "s.db", small_topology(borrower_lut_entries=3), node="b")
    f.reserve(0x100, Holder("b", "vm1"))  # 3 entries, 2 reserved for the CPU: 1 usable
    checks = {c.name: c for c in f.admission(0x101, "b")}
    assert not checks["lut"].ok
    assert checks["lut"].detail.startswith("requester LUT on b:0 is short by 1")
    with pytest.raises(ResourceExhaustedError, match="requester LUT on b:0"):
        f.reserve(0x101, Holder("b", "vm2"))
    f.close()


def test_bars_take_whole_segments(tmp_path):
    # Borrower window 16 GiB in 4 segments of 4 GiB; each device has three BARs (2 GiB+32 MiB),
    # which fit the free bytes but take three whole segments.
    topo = small_topology(
        borrower_window="16GiB",
        borrower_segments=4,
        bars='[ { index = 0, size = "16MiB" }, { index = 1, size = "2GiB" },'
        ' { index = 2, size = "16MiB" } ]',
    )
    f = make_fabric(tmp_path / "s.db", topo, node="b")
    f.reserve(0x100, Holder("b", "vm1"))
    checks = {c.name: c for c in f.admission(0x101, "b", holder=Holder("b", "vm2"))}
    assert checks["window-bars"].ok
    assert not checks["segments"].ok
    with pytest.raises(ResourceExhaustedError, match=r"segments on b:0 is short by 2 segments"):
        f.reserve(0x101, Holder("b", "vm2"))
    f.close()


def test_no_path_is_refused(tmp_path):
    f = make_fabric(tmp_path / "s.db", small_topology(isolated=True), node="x")
    with pytest.raises(NoPathError, match="no NTB path from l to x"):
        f.reserve(0x100, Holder("x", "vm1"))
    with pytest.raises(NoPathError):
        f.ensure_mdev_parent(0x100)  # the driver offers no unreachable device
    f.close()


def test_mdev_lifecycle(fab):
    with pytest.raises(MdevError, match="no mdev parent smartio-10 on gamma"):
        fab.create_mdev(0x10, U1, VM1)
    assert fab.ensure_mdev_parent(0x10) == "smartio-10"
    assert fab.ensure_mdev_parent(0x10) == "smartio-10"
    with pytest.raises(DeviceNotReservedError):
        fab.create_mdev(0x10, U1, VM1)
    fab.reserve(0x10, VM1)
    with pytest.raises(DeviceHeldError):
        fab.create_mdev(0x10, U1, VM2)
    m = fab.create_mdev(0x10, U1.upper(), VM1)
    assert (m.uuid, m.parent, m.type_id, m.fdid, m.node, m.vm) == (
        U1, "smartio-10", MDEV_TYPE, 0x10, "gamma", "vm1",
    )  # fmt: skip
    assert fab.create_mdev(0x10, U1, VM1) == m  # idempotent
    assert fab.mdevs() == [m]
    with pytest.raises(MdevError, match="already has mdev"):
        fab.create_mdev(0x10, U2, VM1)
    fab.ensure_mdev_parent(0x11)
    fab.reserve(0x11, VM1)
    with pytest.raises(MdevError, match=f"mdev {U1} already exists for device 0x10"):
        fab.create_mdev(0x11, U1, VM1)
    assert fab.remove_mdev(U1) is True
    assert fab.remove_mdev(U1) is False
    assert fab.mdevs() == []


def test_an_mdev_left_behind_is_never_handed_to_the_next_holder(fab):
    """vm1's hold ended but its mdev stayed (a release interrupted half-way); vm2 reserves the
    device and names vm1's mdev (a copied XML): it gets a refusal, not vm1's mdev."""
    fab.ensure_mdev_parent(0x10)
    fab.reserve(0x10, VM1)
    fab.create_mdev(0x10, U1, VM1)
    assert fab.release(0x10, VM1)
    fab.reserve(0x10, VM2)
    with pytest.raises(MdevOwnedError, match=f"mdev {U1} serves VM gamma/vm1, not gamma/vm2"):
        fab.create_mdev(0x10, U1, VM2)
    assert [(m.uuid, m.vm) for m in fab.mdevs()] == [(U1, "vm1")]


def test_mdev_bad_input(fab):
    fab.ensure_mdev_parent(0x10)
    fab.reserve(0x10, VM1)
    with pytest.raises(ConfigError, match="bad mdev UUID 'nope'"):
        fab.create_mdev(0x10, "nope", VM1)
    with pytest.raises(ConfigError):
        fab.remove_mdev("nope")
    with pytest.raises(MdevError, match="created on the borrower"):
        fab.create_mdev(0x10, U1, Holder("beta", "vm1"))
    fab.unlend(0x12)
    with pytest.raises(DeviceNotLentError):
        fab.ensure_mdev_parent(0x12)


def test_mdevs_are_per_node(fab, location):
    fab.ensure_mdev_parent(0x10)
    fab.reserve(0x10, VM1)
    fab.create_mdev(0x10, U1, VM1)
    beta = open_fabric(location, node="beta")
    assert beta.local_node == "beta"
    assert beta.mdevs() == []
    assert beta.remove_mdev(U1) is False  # not on this node
    assert fab.mdevs()[0].uuid == U1
    beta.close()


def test_another_process_replacing_the_topology_is_seen(fab, location):
    from vmlend.wiring.fabric import init_fabric

    init_fabric(location, small_topology(), "new.toml", node="b", replace=True)
    assert [n.name for n in fab.nodes()] == ["l", "b"]
    assert {st.fdid for st in fab.devices()} == {0x100, 0x101, 0x102}


def test_local_node_choice():
    from vmlend.topology.parse import parse_topology
    from vmlend.wiring.fabric import choose_local_node, default_topology_text

    topo = parse_topology(default_topology_text()[0])
    assert choose_local_node(topo, "beta.fabric.local") == "beta"
    assert choose_local_node(topo, "alpha") == "alpha"  # short hostname
    assert choose_local_node(topo, "elsewhere") == "gamma"  # the first that lends nothing
    assert choose_local_node(parse_topology(small_topology()), "elsewhere") == "b"
    everyone_lends = parse_topology(
        'name = "x"\n[[node]]\nname = "p"\nid = 1\n  [[node.device]]\n  fdid = 1\n'
        '  bdf = "0000:01:00.0"\n  kind = "nic"\n  vendor = 1\n  device = 1\n  class = 1\n'
    )
    assert choose_local_node(everyone_lends, "elsewhere") == "p"


def test_init_same_meaning_is_unchanged(tmp_path):
    from vmlend.wiring.fabric import init_fabric

    text = small_topology()
    path = tmp_path / "s.db"
    assert init_fabric(path, text, "a.toml", node="b").action == "created"
    reformatted = "# the same cluster, commented\n" + text.replace("  ", "    ")
    assert init_fabric(path, reformatted, "copy.toml").action == "unchanged"
    with pytest.raises(ConfigError, match="--replace"):
        init_fabric(path, small_topology(devices=2), "a.toml")


class FakeHardware:
    """Records the hardware half of borrowing; refuses when told to."""

    def __init__(self):
        self.borrowed: dict[int, tuple[str, str]] = {}
        self.revoked: list[tuple[int, str | None, str | None]] = []
        self.refuse: Exception | None = None

    def borrow(self, fdid, node, vm, *, token=0):
        if self.refuse:
            raise self.refuse
        self.borrowed[fdid] = (node, vm)

    def give_back(self, fdid, node=None, vm=None, *, token=0, revoke=True):
        return self.borrowed.pop(fdid, None) is not None

    def revoke(self, fdid, node=None, vm=None):
        self.revoked.append((fdid, node, vm))
        return 0

    def retire(self, fdid, token):
        pass

    def spent(self, fdid):
        return 0


def test_borrow_drives_the_hardware(tmp_path):
    from vmlend.registry import SqliteRegistry
    from vmlend.sim.backend import SimFabric

    make_fabric(tmp_path / "s.db").close()
    hw = FakeHardware()
    f = SimFabric(SqliteRegistry.open(tmp_path / "s.db"), hardware=hw)
    f.reserve(0x10, VM1)
    assert hw.borrowed == {}  # reserving alone touches no hardware (deferred borrow)
    hw.refuse = ResourceExhaustedError("requester LUT", "alpha:0", 1, 0, "entries")
    with pytest.raises(ResourceExhaustedError):
        f.borrow(0x10, VM1)
    assert f.device(0x10).state is DeviceState.RESERVED  # the refusal changed nothing
    hw.refuse = None
    f.borrow(0x10, VM1)
    assert hw.borrowed == {0x10: ("gamma", "vm1")}
    f.give_back(0x10, VM1)
    assert hw.borrowed == {}
    f.borrow(0x10, VM1)
    assert f.release(0x10, VM1) is True
    assert hw.borrowed == {}  # release returns the hardware too
    assert hw.revoked == [(0x10, None, None)]  # and cuts every open mdev of the device
    f.close()


class RerunningRegistry:
    """A registry whose every write body runs twice, the first run rolled back: what an
    optimistic backend (etcd) does after a conflict."""

    class _Rollback(Exception):
        pass

    def __init__(self, inner):
        self._inner = inner
        self.where = inner.where
        self.shares_host_identity = inner.shares_host_identity
        self.runs = 0

    def read(self):
        return self._inner.read()

    def transact(self, body):
        try:
            with self._inner.write() as tx:
                self.runs += 1
                body(tx)
                raise self._Rollback
        except self._Rollback:
            pass
        return self._inner.transact(body)

    def close(self):
        self._inner.close()


class CountingHardware(FakeHardware):
    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def borrow(self, fdid, node, vm, *, token=0):
        self.calls.append("borrow")
        super().borrow(fdid, node, vm)

    def give_back(self, fdid, node=None, vm=None, *, token=0, revoke=True):
        self.calls.append("give_back")
        return super().give_back(fdid, node, vm)


def test_hardware_steps_run_once_even_when_transaction_bodies_rerun(tmp_path):
    from vmlend.registry import SqliteRegistry
    from vmlend.sim.backend import SimFabric

    make_fabric(tmp_path / "s.db").close()
    hw = CountingHardware()
    reg = RerunningRegistry(SqliteRegistry.open(tmp_path / "s.db"))
    f = SimFabric(reg, local_node="gamma", hardware=hw)
    f.reserve(0x10, VM1)
    f.borrow(0x10, VM1)
    f.give_back(0x10, VM1)
    f.borrow(0x10, VM1)
    assert f.release(0x10, VM1) is True
    assert reg.runs >= 5  # every write body did run twice
    assert hw.calls == ["borrow", "give_back", "borrow", "give_back"]
    assert hw.borrowed == {} and f.device(0x10).state is DeviceState.AVAILABLE


def test_a_borrow_that_cannot_be_recorded_gives_the_hardware_back(tmp_path):
    from vmlend.registry import SqliteRegistry
    from vmlend.sim.backend import SimFabric

    make_fabric(tmp_path / "s.db").close()
    other = SimFabric(SqliteRegistry.open(tmp_path / "s.db"))

    class ReleasedMeanwhile(FakeHardware):
        def borrow(self, fdid, node, vm, *, token=0):
            super().borrow(fdid, node, vm)
            other.release(fdid, VM1)  # the hold ends between the intent and the record

    hw = ReleasedMeanwhile()
    f = SimFabric(SqliteRegistry.open(tmp_path / "s.db"), hardware=hw)
    f.reserve(0x10, VM1)
    with pytest.raises(DeviceNotReservedError):
        f.borrow(0x10, VM1)
    assert hw.borrowed == {}  # undone: no hardware borrow without a recorded hold


def test_backend_is_chosen_by_argument_or_environment(tmp_path, monkeypatch):
    from tests.support.simfabric import make_fabric
    from vmlend.errors import ConfigError
    from vmlend.kernel.backend import SmartioFabric
    from vmlend.wiring.fabric import open_fabric

    path = tmp_path / "s.db"
    make_fabric(path)
    monkeypatch.setenv("VMLEND_ROOT", str(tmp_path / "root"))
    assert isinstance(open_fabric(path, backend="smartio"), SmartioFabric)
    monkeypatch.setenv("VMLEND_BACKEND", "smartio")
    assert isinstance(open_fabric(path), SmartioFabric)
    monkeypatch.setenv("VMLEND_BACKEND", "nope")
    with pytest.raises(ConfigError, match="unknown fabric backend 'nope'"):
        open_fabric(path)


# --- mdev parents end with the last use of the device on the node ---------------------------


def _parents(path) -> set[tuple[str, int]]:
    """Every (node, fdid) mdev parent the shared state records."""
    with open_registry(path) as reg, reg.read() as tx:
        topo = parse_topology(tx.topology().text)
        return {
            (n.name, d.fdid)
            for n in topo.nodes
            for d in topo.devices
            if tx.parent(n.name, d.fdid) is not None
        }


def full_snapshot(path) -> tuple[object, ...]:
    """All the shared state a refused operation must leave as it was: holds, adapter usage,
    mdevs and mdev parents of every node, runtime records."""
    with open_fabric(path, "gamma") as f:
        devices = sorted((d.fdid, d.state.value, str(d.holder)) for d in f.devices())
        usage = sorted((ref, u.lut_used, u.segments_used) for ref, u in f.usage().items())
        nodes = [n.name for n in f.nodes()]
    mdevs = []
    for n in nodes:
        with open_fabric(path, n) as fn:
            mdevs += sorted((m.uuid, m.node, m.fdid) for m in fn.mdevs())
    with open_registry(path) as reg, reg.read() as tx:
        runtime = sorted((r.fdid, r.kind, r.key) for r in tx.runtime())
    return devices, usage, mdevs, sorted(_parents(path)), runtime


def test_release_drops_the_parent_once_nothing_uses_it(fab, location):
    path = location
    fab.reserve(0x10, VM1)
    fab.ensure_mdev_parent(0x10)
    fab.create_mdev(0x10, U1, VM1)
    assert fab.release(0x10, VM2) is False  # not VM2's: nothing changes
    assert ("gamma", 0x10) in _parents(path)
    fab.remove_mdev(U1)
    assert fab.release(0x10, VM1) is True
    assert _parents(path) == set()


def test_the_parent_stays_while_a_child_or_a_local_hold_remains(fab, location):
    path = location
    fab.reserve(0x10, VM1)
    fab.ensure_mdev_parent(0x10)
    fab.create_mdev(0x10, U1, VM1)
    assert fab.release(0x10, VM1) is True  # the child is still there (e.g. busy)
    assert _parents(path) == {("gamma", 0x10)}
    fab.remove_mdev(U1)
    fab.reserve(0x10, VM2)
    assert fab.release(0x10, VM1) is False  # VM2 on this node holds it now
    assert _parents(path) == {("gamma", 0x10)}
    # A release re-run after the hold is gone still drops an unused parent.
    fab.release(0x10, VM2)
    fab.ensure_mdev_parent(0x10)
    assert fab.release(0x10, VM1) is False
    assert _parents(path) == set()


def test_a_rolled_back_prepare_leaves_the_state_exactly_as_before(fab, location, tmp_path):
    path = location
    fab.reserve(0x12, VM2)  # the VM's second device is taken: its prepare must fail
    before = full_snapshot(path)
    err = io.StringIO()
    code = run_hook(
        ["vm1", "prepare", "begin", "-"],
        stdin=io.BytesIO(domain_of("vm1", VM1.vm_uuid, (0x10, 0x12))),
        stdout=io.BytesIO(),
        stderr=err,
        # VMLEND_STATE places the hook's action log (beside the default state otherwise)
        environ={
            "VMLEND_REGISTRY": str(path),
            "VMLEND_STATE": str(tmp_path / "state.db"),
            "VMLEND_NODE": "gamma",
        },
    )
    assert code == 1 and "held by gamma/vm2" in err.getvalue()
    after = full_snapshot(path)
    if isinstance(fab.registry, EtcdRegistry):
        # 0x10, borrowed and given back, keeps its requester entry aside on alpha while
        # alpha lends it (layout 7): the lender's, no hold's; all else is as it was
        assert _aside(fab, "alpha:0") == 2  # and 0x12's, which vm2 holds
        usage = [(ref, lut + (ref == "alpha:0"), seg) for ref, lut, seg in before[1]]
        before = (before[0], usage, *before[2:])
    assert after == before


def test_admission_counts_the_dma_path_of_the_topology_as_it_is_now(fab):
    """The hops and roots admission reports follow the route a reserve would take now: a
    cable going down (another route) and coming back, each answered afresh."""
    from vmlend.topology.paths import without_links
    from vmlend.topology.pcie import device_to_ram

    def path() -> tuple[str, tuple[int, int]]:
        checks = {c.name: c for c in fab.admission(0x10, "gamma", 8 * GiB, holder=VM1)}
        return checks["path"].detail, (checks["path"].data["hops"], checks["path"].data["roots"])

    first = ("alpha:0 -> gamma:0 via mxs824", (11, 2))
    assert path() == first
    assert path() == first  # asked again: the same
    fab.set_link_up("mxs824/gamma:0", False)
    live = device_to_ram(without_links(fab.topology(), ["mxs824/gamma:0"]), 0x10, "gamma")
    detail, counts = path()
    assert "gamma:1" in detail
    assert counts == (live.hops, live.roots) != first[1]
    fab.set_link_up("mxs824/gamma:0", True)
    assert path() == first
