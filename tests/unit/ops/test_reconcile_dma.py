"""``vmlend reconcile`` on the kernel backend compares each running VM's child's DMA windows
(docs/smartio-contract.md section 8) with what vmlend computes from the VM's layout, says
what differs in one line, and writes them again where a write repairs it."""

# ruff: noqa: F811 (the tests take the imported fixtures as parameters)

from __future__ import annotations

import uuid

import pytest

from tests.support.smartio_host import NVME, WEB, fake, state  # noqa: F401
from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, mdev_uuid, new_domain, read_domain
from vmlend.kernel.backend import SmartioFabric
from vmlend.lending.devices import UndoJournal, acquire_device
from vmlend.ops.reconcile import DriftKind, find_drift, fix, look
from vmlend.registry import SqliteRegistry
from vmlend.sim.hypervisor.node import SimHypervisor

VID = uuid.UUID(WEB.vm_uuid)
MDEV = str(mdev_uuid(VID, NVME))


@pytest.fixture
def running(tmp_path, state, fake):
    """web (q35, 6 GiB: low and high RAM) runs here with 0x12, prepared as the hook does."""
    hv = SimHypervisor("gamma", tmp_path / "hv", None)
    spec = DomainSpec(name="web", memory_bytes=6 << 30, uuid=VID, devices=[DeviceRequest(NVME)])
    hv.define(new_domain(spec, templates=TemplateSet()).to_bytes())
    hv.start("web")
    ram = read_domain(hv.xml("web"), strict=False).guest_ram
    with SmartioFabric(SqliteRegistry.open(state), fake.env, writer=fake) as fabric:
        acquire_device(fabric, WEB, NVME, MDEV, UndoJournal(), guest_ram=ram)
        yield hv, fabric


def _dma(hv, fabric):
    return [d for d in find_drift(look(hv, fabric)) if d.kind is DriftKind.DMA_WINDOWS]


def _token(fabric) -> int:
    return fabric._state.holds()[NVME].token


def test_windows_the_prepare_wrote_are_no_drift(running, fake):
    hv, fabric = running
    assert find_drift(look(hv, fabric)) == []
    fake.smartio.bus_master(MDEV)  # mapped as written (the legacy window aside)
    fabric.record_dma(MDEV)  # what 'vmlend mdev watch' does at the driver's SMARTIO_DMA
    assert find_drift(look(hv, fabric)) == []


def test_a_mapping_vmlend_did_not_record_is_recorded_again(running, fake):
    """The SMARTIO_DMA event was lost (no watcher ran): the driver maps windows the
    registry has no record of; ``--fix`` reads dma_state and keeps it."""
    hv, fabric = running
    fake.smartio.bus_master(MDEV)
    (d,) = _dma(hv, fabric)
    assert d.fixable and d.fix == "record the driver's DMA state again"
    assert "vmlend records DMA windows none, the driver's dma_state says mapped low" in d.cause
    assert "is 'vmlend mdev watch' running?" in d.cause and "\n" not in d.cause
    lines: list[str] = []
    assert fix(hv, fabric, [d], lines.append).failed == []
    assert lines == [f"mdev {MDEV}: DMA state of 0x12 recorded again"]
    assert sorted(r.key for r in fabric.dma_records(NVME)) == ["high", "low"]
    assert find_drift(look(hv, fabric)) == []


def test_records_of_windows_no_longer_mapped_are_drift(running, fake):
    """The other way: the guest cleared Bus Master (or reset) and the event was lost."""
    hv, fabric = running
    fake.smartio.bus_master(MDEV)
    fabric.record_dma(MDEV)
    fake.smartio.set_dma_state(MDEV, "none\n")
    (d,) = _dma(hv, fabric)
    assert "records DMA windows high " in d.cause and "dma_state says none (" in d.cause
    fix(hv, fabric, [d])
    assert fabric.dma_records(NVME) == [] and _dma(hv, fabric) == []
    # a partial unmap the watcher did not hear of: the ranges differ, not the names
    fake.smartio.bus_master(MDEV)
    fabric.record_dma(MDEV)
    fake.smartio.set_dma_state(
        MDEV, "partial\nlow 0 0 0x0 0x40000000\nhigh 0 1 0x100000000 0x80000000\n"
    )
    drift = [x for x in _dma(hv, fabric) if x.fix == "record the driver's DMA state again"]
    assert len(drift) == 1 and "says partial low 0x0-0x40000000" in drift[0].cause


def test_windows_never_written_are_written_again(running, fake):
    hv, fabric = running
    fake.smartio.windows[MDEV] = None
    (fake.env.mdev_devices / MDEV / "smartio" / "dma_windows").write_text("")
    (d,) = _dma(hv, fabric)
    assert d.fixable and d.fix == "write the DMA windows again"
    assert d.cause.startswith(f"mdev {MDEV} of device 0x12 (running VM 'web'): no DMA windows")
    assert "\n" not in d.cause
    assert fix(hv, fabric, [d]).failed == []
    assert find_drift(look(hv, fabric)) == []


def test_other_windows_or_an_older_token_are_written_again(running, fake):
    hv, fabric = running
    token = _token(fabric)
    fabric.driver.write_dma_windows(NVME, MDEV, token, f"token {token}\nlow 0x0 0x40000000\n")
    (d,) = _dma(hv, fabric)
    assert "the driver has DMA windows low 0x0-0x40000000" in d.cause and d.fixable
    assert "high 0x100000000-" in d.cause  # what vmlend computed
    fix(hv, fabric, [d])
    assert _dma(hv, fabric) == []
    # a driver that kept an older token (a bug, or a file edited by hand)
    path = fake.env.mdev_devices / MDEV / "smartio" / "dma_windows"
    path.write_text(path.read_text().replace(f"token {token}", f"token {token - 1}"))
    (d,) = _dma(hv, fabric)
    assert f"token {token - 1}, the hold's is {token}" in d.cause
    fix(hv, fabric, [d])
    assert _dma(hv, fabric) == []


def test_a_mapping_that_differs_is_left_to_the_operator(running, fake):
    hv, fabric = running
    fake.smartio.set_dma_state(MDEV, "mapped\nlow 0 0 0x0 0x40000000\n")
    fabric.record_dma(MDEV)  # recorded as mapped: only the mapping itself differs
    (d,) = _dma(hv, fabric)
    assert not d.fixable and "stop the VM and start it again" in d.cause
    assert fix(hv, fabric, [d]).left == [d]


def test_a_refused_bus_master_enable_is_reported(running, fake):
    hv, fabric = running
    fake.smartio.set_dma_state(MDEV, "refused EFAULT page 0x7ff40000 does not pin\n")
    (d,) = _dma(hv, fabric)
    assert "EFAULT page 0x7ff40000 does not pin" in d.cause and not d.fixable


def test_a_damaged_state_file_is_one_drift_not_a_traceback(running, fake):
    hv, fabric = running
    fake.smartio.set_dma_state(MDEV, "mapping\n")
    (d,) = _dma(hv, fabric)
    assert "damaged" in d.cause and "unknown state" in d.cause and not d.fixable


def test_a_damaged_copy_of_the_topology_is_raised_not_taken_for_a_device_gone(
    running, fake, monkeypatch
):
    # the check skips a device whose windows cannot be computed (it left the fabric: other
    # drift says so), but a topology that cannot be read is every check's problem
    from vmlend.errors import DamagedCopyError, UnknownDeviceError

    hv, fabric = running

    def damaged(*_a, **_k):
        raise DamagedCopyError("this host's copy of the topology is damaged")

    def gone(*_a, **_k):
        raise UnknownDeviceError(NVME)

    monkeypatch.setattr(type(fabric), "expected_windows", gone)
    assert _dma(hv, fabric) == []
    monkeypatch.setattr(type(fabric), "expected_windows", damaged)
    with pytest.raises(DamagedCopyError):
        _dma(hv, fabric)


def test_a_driver_without_the_group_is_no_drift(tmp_path, state, fake):
    fake.smartio.data_path = False
    hv = SimHypervisor("gamma", tmp_path / "hv", None)
    spec = DomainSpec(name="web", memory_bytes=1 << 30, uuid=VID, devices=[DeviceRequest(NVME)])
    hv.define(new_domain(spec, templates=TemplateSet()).to_bytes())
    hv.start("web")
    ram = read_domain(hv.xml("web"), strict=False).guest_ram
    with SmartioFabric(SqliteRegistry.open(state), fake.env, writer=fake) as fabric:
        acquire_device(fabric, WEB, NVME, MDEV, UndoJournal(), guest_ram=ram)
        assert find_drift(look(hv, fabric)) == []


def test_windows_mapped_with_more_segments_than_admission_claimed_are_drift(running, fake):
    """The ranges are the written ones, but the driver spent four segments of alpha:0 on
    them where admission claimed (and counted room for) two: the claims no longer equal what
    is mapped. Not fixable by a write: the VM's admission must be made again."""
    hv, fabric = running
    assert fabric.dma_claimed(WEB) == {"alpha:0": 2}
    fake.smartio.set_dma_state(
        MDEV, "mapped\nlow 0 0 0x0 0x80000000\nhigh 0 1,2,3 0x100000000 0x100000000\n"
    )
    fabric.record_dma(MDEV)
    (d,) = _dma(hv, fabric)
    assert d.cause == (
        "running VM 'web': the driver maps the VM's DMA windows on alpha:0 with 4 segment(s),"
        " admission claimed 2"
    )
    assert not d.fixable and fix(hv, fabric, [d]).left == [d]


def test_a_vm_whose_children_map_nothing_yet_is_not_compared_with_its_claims(running, fake):
    hv, fabric = running
    assert fabric.dma_claimed(WEB)  # claimed at the prepare, before the guest's enable
    assert _dma(hv, fabric) == []
