"""The SmartIO sysfs contract (docs/smartio-contract.md) as vmlend.kernel.driver reads
and writes it, against the fake driver in tests/support/fake_sysfs.py."""

from __future__ import annotations

import errno

import pytest

from tests.support.fake_sysfs import FakeSmartio, FakeSysfs
from vmlend.errors import (
    DeviceNotLentError,
    FabricError,
    HostError,
    LenderUnavailableError,
    UnknownDeviceError,
)
from vmlend.hostenv import HostEnv
from vmlend.kernel.driver import (
    MDEV_TYPE,
    Availability,
    SmartioDriver,
    device_name,
    fdid_of,
    parse_bars,
)
from vmlend.kernel.mdev import MdevBus
from vmlend.topology.model import BarKind, BarSpec

GPU_BARS = "0 0x1000000 mem32\n1 0x800000000 mem64 prefetch\n3 0x2000000 mem64 prefetch\n"


@pytest.fixture
def fake(tmp_path):
    return FakeSysfs(tmp_path)


@pytest.fixture
def smartio(fake):
    s = FakeSmartio(fake, node_id=12)
    s.add_device(
        0x10, 4, bdf="0000:41:00.0", vendor=0x10DE, device=0x1DB4, class_code=0x030200,
        dma_bits=40, bars=GPU_BARS,
    )  # fmt: skip
    s.add_device(0x12, 4, bdf="0000:43:00.0", availability="unlent")
    s.add_device(0x21, 8, bdf="0000:81:00.1", class_code=0x020000, physfn=0x20)
    return s


@pytest.fixture
def driver(fake, smartio):
    return SmartioDriver(fake.env, fake)


def test_names_round_trip():
    assert device_name(0x10) == "smartio-10"
    assert fdid_of("smartio-10") == 0x10
    assert fdid_of("smartio-ffffffff") == 0xFFFFFFFF
    for other in ("mtty", "smartio-", "smartio-xyz", "0000:00:02.0", "smartio-1-2"):
        assert fdid_of(other) is None


def test_reads_every_attribute(driver):
    assert driver.loaded() and driver.node_id() == 12
    assert driver.fdids() == [0x10, 0x12, 0x21]
    gpu = driver.device(0x10)
    assert (gpu.lender_node_id, gpu.lender_adapter, gpu.lender_bdf) == (4, 0, "0000:41:00.0")
    assert (gpu.vendor_id, gpu.device_id, gpu.class_code) == (0x10DE, 0x1DB4, 0x030200)
    assert gpu.dma_bits == 40 and gpu.kind == "gpu"
    assert gpu.bars == (
        BarSpec(0, 16 << 20, BarKind.MEM32),
        BarSpec(1, 32 << 30, BarKind.MEM64, prefetch=True),
        BarSpec(3, 32 << 20, BarKind.MEM64, prefetch=True),
    )
    assert gpu.availability is Availability.AVAILABLE
    assert gpu.borrower_node_id is None and gpu.physfn is None
    assert not gpu.parent_registered
    assert driver.device(0x12).availability is Availability.UNLENT
    assert driver.device(0x12).kind == "nvme"
    vf = driver.device(0x21)
    assert vf.physfn == 0x20 and vf.kind == "vf"


def test_unknown_device(driver):
    with pytest.raises(UnknownDeviceError):
        driver.device(0x99)
    with pytest.raises(UnknownDeviceError):
        driver.register_parent(0x99)


def test_register_parent_makes_an_mdev_parent_with_the_smartio_type(fake, driver):
    name = driver.register_parent(0x10)
    assert name == "smartio-10"
    parent = MdevBus(fake.env, fake).parent(name)
    assert [t.type_id for t in parent.types] == [MDEV_TYPE]
    assert parent.type(MDEV_TYPE).available_instances == 1
    assert driver.device(0x10).parent_registered
    assert driver.register_parent(0x10) == name  # idempotent


def test_register_refusals_become_fabric_errors(driver, smartio):
    with pytest.raises(DeviceNotLentError) as e:
        driver.register_parent(0x12)
    assert "node 4" in str(e.value)
    smartio.set_availability(0x10, "unreachable")
    with pytest.raises(LenderUnavailableError):
        driver.register_parent(0x10)


def test_unregister_refused_while_children_exist(fake, driver):
    bus = MdevBus(fake.env, fake)
    driver.register_parent(0x10)
    bus.create("smartio-10", MDEV_TYPE, "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001")
    with pytest.raises(FabricError) as e:
        driver.unregister_parent(0x10)
    assert "mdev children" in str(e.value)
    bus.remove("83b8f4f2-509f-382f-3c1e-e6bfe0fa1001")
    driver.unregister_parent(0x10)
    assert bus.parents() == []
    driver.unregister_parent(0x10)  # idempotent


def test_lend_and_unlend_local_devices_only(fake):
    lender = FakeSmartio(fake, node_id=4)
    lender.add_device(0x12, 4, availability="unlent")
    lender.add_device(0x21, 8)
    drv = SmartioDriver(fake.env, fake)
    drv.lend(0x12)
    assert drv.device(0x12).availability is Availability.AVAILABLE
    lender.guest_enable(0x12)
    assert drv.device(0x12).borrower_node_id == 4
    with pytest.raises(FabricError, match="borrowed"):
        drv.unlend(0x12)
    lender.guest_release(0x12)
    drv.unlend(0x12)
    assert drv.device(0x12).availability is Availability.UNLENT
    with pytest.raises(FabricError, match="installed in node 8"):
        drv.lend(0x21)


def test_unreachable_lender_takes_parent_away_and_brings_it_back(fake, driver, smartio):
    bus = MdevBus(fake.env, fake)
    driver.register_parent(0x10)
    smartio.set_availability(0x10, "unreachable")
    assert bus.parent_names() == []
    smartio.set_availability(0x10, "available")
    assert bus.parent_names() == ["smartio-10"]


def test_driver_missing(tmp_path):
    drv = SmartioDriver(HostEnv(tmp_path))
    assert not drv.loaded() and drv.devices() == []
    with pytest.raises(HostError, match="modprobe smartio"):
        drv.node_id()
    with pytest.raises(HostError):
        drv.register_parent(0x10)


@pytest.mark.parametrize(
    "text",
    ["0 0x1000", "0 0x1000 mem16", "x 0x1000 mem32", "0 0x1000 mem32 cached", "0 big mem32"],
)
def test_bad_bars_are_reported(text):
    with pytest.raises(HostError, match="line 1"):
        parse_bars(text, "bars")


def test_bad_attributes_are_reported(fake, driver):
    d = fake.env.smartio / "smartio-10"
    (d / "availability").write_text("maybe\n")
    with pytest.raises(HostError, match="availability"):
        driver.device(0x10)
    (d / "availability").write_text("available\n")
    (d / "dma_bits").write_text("forty\n")
    with pytest.raises(HostError, match="dma_bits"):
        driver.device(0x10)
    (d / "dma_bits").unlink()
    with pytest.raises(HostError, match="lacks attribute dma_bits"):
        driver.device(0x10)


def test_unexpected_errno_names_it(fake, driver):
    def refuse(text: str) -> None:
        raise OSError(errno.EIO, "I/O error")

    fake.handlers[(fake.env.smartio / "borrow").resolve()] = refuse
    with pytest.raises(FabricError, match="EIO"):
        driver.register_parent(0x10)
