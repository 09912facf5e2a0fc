"""One suite for every Fabric backend: the simulated cluster and the kernel backend (SmartIO
driver + mdev ABI, here over a fake sysfs). Both must behave the same through the protocol."""

from __future__ import annotations

import pytest

from tests.support.fake_sysfs import FakeSmartio, FakeSysfs, populate_smartio
from vmlend.errors import (
    DeviceHeldError,
    DeviceNotLentError,
    DeviceNotReservedError,
    UnknownDeviceError,
    VmlendError,
)
from vmlend.fabric.base import Fabric
from vmlend.kernel.backend import SmartioFabric
from vmlend.registry import open_registry
from vmlend.sim.backend import SimFabric
from vmlend.topology.model import DeviceState, Holder
from vmlend.wiring.fabric import default_topology_text, init_fabric

WEB = Holder("gamma", "web", "11111111-1111-1111-1111-111111111111")
DB = Holder("gamma", "db", "22222222-2222-2222-2222-222222222222")
U1 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001"
U2 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1002"
NVME = 0x12
GPU = 0x10

BACKENDS = ["sim", "smartio"]
REGISTRIES = ["sqlite", "etcd"]
ON = [
    pytest.param((b, r), marks=[pytest.mark.daemon] if r == "etcd" else [], id=f"{b}-{r}")
    for b in BACKENDS
    for r in REGISTRIES
]


@pytest.fixture(params=ON)
def make(request, tmp_path):
    """``make(node)``: a fabric seen from ``node``, all over one shared state."""
    backend, registry = request.param
    state = request.getfixturevalue("etcd_url") if registry == "etcd" else tmp_path / "state.db"
    text, source = default_topology_text()
    init_fabric(state, text, source, node="gamma")
    opened: list = []
    fakes: dict[str, FakeSysfs] = {}

    def make(node: str = "gamma") -> Fabric:
        if backend == "sim":
            fab = SimFabric(open_registry(state), local_node=node)
        else:
            if node not in fakes:
                fake = FakeSysfs(tmp_path / node)
                topo = SimFabric(open_registry(state), local_node=node).topology()
                populate_smartio(FakeSmartio(fake, topo.node(node).node_id), topo)
                fakes[node] = fake
            fake = fakes[node]
            fab = SmartioFabric(open_registry(state), fake.env, local_node=node, writer=fake)
        opened.append(fab)
        return fab

    yield make
    for fab in opened:
        fab.close()


@pytest.fixture
def fabric(make):
    return make()


def test_is_a_fabric(fabric):
    assert isinstance(fabric, Fabric)
    assert fabric.local_node == "gamma"


def test_lists_every_device_available(fabric):
    devices = {d.fdid: d for d in fabric.devices()}
    assert {GPU, NVME, 0x20, 0x21} <= set(devices)
    assert devices[NVME].state is DeviceState.AVAILABLE and devices[NVME].holder is None
    assert fabric.device(NVME).spec.lender == "alpha"


def test_unknown_device(fabric):
    with pytest.raises(UnknownDeviceError):
        fabric.device(0x999)
    with pytest.raises(UnknownDeviceError):
        fabric.reserve(0x999, WEB)


def test_reserve_is_exclusive_and_idempotent(fabric):
    assert fabric.reserve(NVME, WEB).state is DeviceState.RESERVED
    assert fabric.reserve(NVME, WEB).holder == WEB
    with pytest.raises(DeviceHeldError) as e:
        fabric.reserve(NVME, DB)
    assert "gamma/web" in str(e.value)


def test_another_process_sees_the_hold(make):
    first, second = make(), make()
    first.reserve(NVME, WEB)
    with pytest.raises(DeviceHeldError):
        second.reserve(NVME, DB)
    assert second.device(NVME).holder == WEB


def test_release_only_by_the_holder(fabric):
    fabric.reserve(NVME, WEB)
    assert fabric.release(NVME, DB) is False
    assert fabric.device(NVME).state is DeviceState.RESERVED
    assert fabric.release(NVME, WEB) is True
    assert fabric.release(NVME, WEB) is False
    assert fabric.device(NVME).state is DeviceState.AVAILABLE


def test_mdev_lifecycle(fabric):
    fabric.reserve(NVME, WEB)
    parent = fabric.ensure_mdev_parent(NVME)
    assert parent == "smartio-12"  # one naming across backends (docs/smartio-contract.md)
    assert fabric.ensure_mdev_parent(NVME) == parent
    info = fabric.create_mdev(NVME, U1, WEB)
    assert (info.uuid, info.parent, info.fdid, info.vm) == (U1, parent, NVME, "web")
    assert fabric.create_mdev(NVME, U1, WEB).uuid == U1  # idempotent
    assert [(m.uuid, m.fdid, m.vm) for m in fabric.mdevs()] == [(U1, NVME, "web")]
    assert fabric.remove_mdev(U1) is True
    assert fabric.remove_mdev(U1) is False
    assert fabric.mdevs() == []
    assert fabric.release(NVME, WEB) is True


def test_create_mdev_needs_the_reservation(fabric):
    fabric.ensure_mdev_parent(NVME)
    with pytest.raises(DeviceNotReservedError):
        fabric.create_mdev(NVME, U1, WEB)
    fabric.reserve(NVME, DB)
    with pytest.raises(DeviceHeldError):
        fabric.create_mdev(NVME, U1, WEB)
    assert fabric.mdevs() == []


def test_second_mdev_for_one_device_is_refused(fabric):
    fabric.reserve(NVME, WEB)
    fabric.ensure_mdev_parent(NVME)
    fabric.create_mdev(NVME, U1, WEB)
    with pytest.raises(VmlendError):
        fabric.create_mdev(NVME, U2, WEB)
    assert [m.uuid for m in fabric.mdevs()] == [U1]


def test_bad_uuid_is_refused(fabric):
    fabric.reserve(NVME, WEB)
    fabric.ensure_mdev_parent(NVME)
    with pytest.raises(VmlendError):
        fabric.create_mdev(NVME, "not-a-uuid", WEB)
    assert fabric.mdevs() == []


def test_borrow_and_give_back(fabric):
    with pytest.raises(DeviceNotReservedError):
        fabric.borrow(NVME, WEB)
    fabric.reserve(NVME, WEB)
    assert fabric.borrow(NVME, WEB).state is DeviceState.BORROWED
    assert fabric.give_back(NVME, WEB).state is DeviceState.RESERVED


def test_unlend_on_the_lender(make):
    alpha = make("alpha")
    alpha.reserve(NVME, WEB)
    with pytest.raises(DeviceHeldError):
        alpha.unlend(NVME)
    alpha.release(NVME, WEB)
    assert alpha.unlend(NVME).state is DeviceState.UNLENT
    with pytest.raises(DeviceNotLentError):
        alpha.reserve(NVME, WEB)
    assert alpha.lend(NVME).state is DeviceState.AVAILABLE
    assert alpha.lend(NVME).state is DeviceState.AVAILABLE  # idempotent


def test_lend_many_lends_a_lenders_devices_in_batches(make, monkeypatch):
    """``vmlend lend --all``: every device of one lender, ``LEND_BATCH`` to a transaction
    (here 2); lent ones stay lent, a held one stays held, and a lender may lend only its own."""
    from vmlend.ledger import ledger

    monkeypatch.setattr(ledger, "LEND_BATCH", 2)
    alpha = make("alpha")
    mine = sorted(d.spec.fdid for d in alpha.devices() if d.spec.lender == "alpha")
    assert len(mine) >= 3
    alpha.unlend(mine[0])
    alpha.unlend(mine[-1])
    alpha.reserve(mine[1], WEB)
    seen: list[int] = []
    done = alpha.lend_many(mine, seen.append)
    assert [st.spec.fdid for st in done] == mine
    assert seen == [min(n, len(mine)) for n in range(2, len(mine) + 2, 2)]  # one per batch
    states = {d.spec.fdid: d.state for d in alpha.devices()}
    assert states[mine[1]] is DeviceState.RESERVED
    assert all(states[f] is DeviceState.AVAILABLE for f in mine if f != mine[1])
    assert alpha.lend_many(mine) == done  # idempotent
    assert alpha.lend_many([]) == []
    with pytest.raises(UnknownDeviceError):
        alpha.lend_many([0x99])


@pytest.mark.parametrize(
    "registry",
    [pytest.param(r, marks=[pytest.mark.daemon] if r == "etcd" else [], id=r) for r in REGISTRIES],
)
def test_lend_many_batches_fit_a_default_etcd_request(registry, tmp_path, request):
    """Full batches of one lender (and two lenders' devices interleaved) within etcd's
    default 128 operations per request; the statuses in the order asked."""
    from tests.support.simfabric import fabric_topology
    from vmlend.ledger.ledger import LEND_BATCH

    state = request.getfixturevalue("etcd_url") if registry == "etcd" else tmp_path / "s.db"
    init_fabric(state, fabric_topology(2, LEND_BATCH + 8), "generated", node="n0")
    with SimFabric(open_registry(state), local_node="n0") as fab:
        mine = [d.spec.fdid for d in fab.devices()]
        for fdid in mine:
            fab.unlend(fdid)
        half = len(mine) // 2
        order = [f for pair in zip(mine[:half], mine[half:], strict=True) for f in pair]
        seen: list[int] = []
        done = fab.lend_many(order, seen.append)
        assert [st.spec.fdid for st in done] == order
        assert {st.state for st in fab.devices()} == {DeviceState.AVAILABLE}
        assert len(seen) == 4 and seen[-1] == len(order)  # 2 lenders x (one full batch + 8)


def test_admission_reports_checks_without_changing_anything(fabric):
    checks = fabric.admission(NVME, "gamma", guest_ram=4 << 30)
    assert checks and all(c.ok for c in checks)
    assert fabric.device(NVME).state is DeviceState.AVAILABLE
