"""vmlend.kernel.mdev against a fake sysfs with the kernel's semantics
(tests/support/fake_sysfs.py)."""

from __future__ import annotations

import errno

import pytest

from tests.support.fake_sysfs import FakeSysfs, FakeType, RacingWriter
from vmlend.errors import (
    MdevBadNameError,
    MdevBadUuidError,
    MdevBusyError,
    MdevKernelError,
    MdevNoInstancesError,
    MdevParentGoneError,
    MdevParentNotFoundError,
    MdevTypeNotFoundError,
    MdevUuidInUseError,
)
from vmlend.hostenv import HostEnv
from vmlend.kernel.mdev import KernelWriter, MdevBus, normalize_uuid

U1 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001"
U2 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1002"
U3 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1003"


@pytest.fixture
def fake(tmp_path) -> FakeSysfs:
    f = FakeSysfs(tmp_path)
    f.add_parent(
        "fdid-00000010",
        [FakeType("smartio-lend", "SmartIO lent device", "NVMe at alpha", available=1)],
        device_dir="devices/virtual/smartio",
    )
    return f


@pytest.fixture
def bus(fake) -> MdevBus:
    return MdevBus(fake.env, fake)


def test_empty_host_has_no_parents_or_devices(tmp_path):
    bus = MdevBus(HostEnv(tmp_path))
    assert bus.parents() == []
    assert bus.devices() == []


def test_lists_parent_with_type_attributes(bus):
    (parent,) = bus.parents()
    assert parent.name == "fdid-00000010"
    t = parent.type("smartio-lend")
    assert (t.name, t.description, t.device_api) == (
        "SmartIO lent device",
        "NVMe at alpha",
        "vfio-pci",
    )
    assert t.available_instances == 1
    assert t.devices == ()


def test_type_without_name_file_is_named_by_its_id(fake, bus):
    fake.add_parent("0000:00:02.0", [FakeType("i915-GVTg_V5_4", available=2)])
    t = bus.parent("0000:00:02.0").type("i915-GVTg_V5_4")
    assert t.name == "i915-GVTg_V5_4" and t.description == ""


def test_create_makes_device_with_type_link_and_iommu_group(bus):
    dev = bus.create("fdid-00000010", "smartio-lend", U1)
    assert dev.uuid == U1
    assert (dev.parent, dev.type_id) == ("fdid-00000010", "smartio-lend")
    assert isinstance(dev.iommu_group, int)
    assert bus.device(U1) == dev
    t = bus.parent("fdid-00000010").type("smartio-lend")
    assert t.available_instances == 0
    assert t.devices == (U1,)
    assert [d.uuid for d in bus.devices()] == [U1]


def test_create_is_idempotent_for_same_parent_and_type(bus):
    first = bus.create("fdid-00000010", "smartio-lend", U1)
    # Even with no instances left, asking again for the same child succeeds.
    assert bus.create("fdid-00000010", "smartio-lend", U1.upper()) == first
    assert len(bus.devices()) == 1


def test_create_same_uuid_on_other_parent_is_refused_naming_both(fake, bus):
    fake.add_mtty()
    bus.create("fdid-00000010", "smartio-lend", U1)
    with pytest.raises(MdevUuidInUseError) as e:
        bus.create("mtty", "mtty-1", U1)
    assert "mtty/mtty-1" in str(e.value) and "fdid-00000010/smartio-lend" in str(e.value)


def test_exhausted_instances_name_parent_and_type(bus):
    bus.create("fdid-00000010", "smartio-lend", U1)
    with pytest.raises(MdevNoInstancesError) as e:
        bus.create("fdid-00000010", "smartio-lend", U2)
    assert "fdid-00000010" in str(e.value) and "smartio-lend" in str(e.value)
    assert bus.device(U2) is None


def test_mtty_shares_its_port_pool_between_types(fake, bus):
    fake.add_mtty(ports=3)
    bus.create("mtty", "mtty-2", U1)  # takes 2 of 3 ports
    p = bus.parent("mtty")
    assert p.type("mtty-1").available_instances == 1
    assert p.type("mtty-2").available_instances == 0
    with pytest.raises(MdevNoInstancesError):
        bus.create("mtty", "mtty-2", U2)
    bus.create("mtty", "mtty-1", U3)
    assert bus.remove(U1) is True
    assert bus.parent("mtty").type("mtty-2").available_instances == 1


@pytest.mark.parametrize(
    "bad", ["", "not-a-uuid", U1[:-1], U1 + "0", "../../../../etc/passwd", U1.replace("-", "")]
)
def test_bad_uuid_is_refused_before_touching_sysfs(bus, bad):
    with pytest.raises(MdevBadUuidError):
        bus.create("fdid-00000010", "smartio-lend", bad)
    assert bus.devices() == []


def test_kernel_einval_becomes_bad_uuid_naming_parent(fake, bus):
    # A vendor driver may reject a UUID the generic syntax check accepts.
    fake.add_parent("picky", [FakeType("picky-1", probe_errno=errno.EINVAL)])
    with pytest.raises(MdevBadUuidError) as e:
        bus.create("picky", "picky-1", U1)
    assert "picky/picky-1" in str(e.value)


def test_other_kernel_errors_carry_errno_and_names(fake, bus):
    fake.add_parent("flaky", [FakeType("flaky-1", probe_errno=errno.EIO)])
    with pytest.raises(MdevKernelError) as e:
        bus.create("flaky", "flaky-1", U1)
    assert e.value.errno == errno.EIO
    assert "flaky/flaky-1" in str(e.value) and "EIO" in str(e.value)


def test_unknown_parent_and_type(bus):
    with pytest.raises(MdevParentNotFoundError):
        bus.create("nope", "smartio-lend", U1)
    with pytest.raises(MdevParentNotFoundError):
        bus.parent("../../kernel")
    with pytest.raises(MdevTypeNotFoundError) as e:
        bus.create("fdid-00000010", "smartio-other", U1)
    assert "smartio-lend" in str(e.value)  # says what it does offer


def test_parent_vanishing_between_listing_and_creating(fake):
    bus = MdevBus(fake.env, fake)
    assert [p.name for p in bus.parents()] == ["fdid-00000010"]
    bus.writer = RacingWriter(fake, lambda: fake.remove_parent("fdid-00000010"))
    with pytest.raises(MdevParentGoneError) as e:
        bus.create("fdid-00000010", "smartio-lend", U1)
    assert "fdid-00000010/smartio-lend" in str(e.value)
    assert bus.parents() == []


def test_parent_removed_before_create_is_not_found(fake, bus):
    bus.parents()
    fake.remove_parent("fdid-00000010")
    with pytest.raises(MdevParentNotFoundError):
        bus.create("fdid-00000010", "smartio-lend", U1)


def test_losing_a_create_race_for_the_same_uuid_is_success(fake, bus):
    # Another process creates the same child between our check and our write: EEXIST.
    bus.writer = RacingWriter(
        fake, lambda: MdevBus(fake.env, fake).create("fdid-00000010", "smartio-lend", U1)
    )
    dev = bus.create("fdid-00000010", "smartio-lend", U1)
    assert dev.uuid == U1 and len(bus.devices()) == 1


def test_remove_and_remove_missing(bus):
    bus.create("fdid-00000010", "smartio-lend", U1)
    assert bus.remove(U1) is True
    assert bus.device(U1) is None
    assert bus.parent("fdid-00000010").type("smartio-lend").available_instances == 1
    assert bus.remove(U1) is False
    assert bus.remove(U2) is False


def test_remove_of_busy_device_says_so(fake, bus):
    bus.create("fdid-00000010", "smartio-lend", U1)
    fake.busy.add(U1)
    with pytest.raises(MdevBusyError) as e:
        bus.remove(U1)
    assert U1 in str(e.value)
    assert bus.device(U1) is not None


def test_removing_parent_removes_its_children(fake, bus):
    bus.create("fdid-00000010", "smartio-lend", U1)
    fake.remove_parent("fdid-00000010")
    assert bus.device(U1) is None
    assert bus.remove(U1) is False


def test_find_type_across_parents(fake, bus):
    fake.add_parent("fdid-00000011", [FakeType("smartio-lend")])
    fake.add_mtty()
    assert [t.parent for t in bus.find_type("smartio-lend")] == ["fdid-00000010", "fdid-00000011"]


def test_normalize_uuid_lowercases():
    assert normalize_uuid(" " + U1.upper() + "\n") == U1


def test_kernel_writer_does_one_write_and_reports_errno(tmp_path):
    attr = tmp_path / "attr"
    attr.write_text("")
    KernelWriter().write(attr, "1")
    assert attr.read_text() == "1"
    with pytest.raises(OSError) as e:
        KernelWriter().write(tmp_path / "missing", "1")
    assert e.value.errno == errno.ENOENT


def test_fake_refuses_writes_to_read_only_attributes(fake):
    # Keeps the fake honest: vmlend may only write where the kernel has a store handler.
    attr = fake.env.mdev_bus / "fdid-00000010" / "mdev_supported_types" / "smartio-lend"
    with pytest.raises(OSError) as e:
        fake.write(attr / "available_instances", "5")
    assert e.value.errno == errno.EIO


@pytest.mark.parametrize(
    "parent, type_id",
    [
        ("fdid-00000010", "../../x"),
        ("fdid-00000010", "t\nx"),
        ("fdid-00000010", "a" * 256),
        ("fdid-00000010", "type x"),
        ("..", "t"),
        ("fdid-00000010", ""),
    ],
)
def test_names_the_kernel_never_gives_are_refused_before_any_path(fake, bus, parent, type_id):
    with pytest.raises(MdevBadNameError):
        bus.create(parent, type_id, U1)
    assert bus.devices() == []


def test_a_parent_link_leading_outside_sysfs_is_refused(tmp_path, fake, bus):
    outside = tmp_path / "outside" / "mdev_supported_types" / "t"
    outside.mkdir(parents=True)
    (outside / "create").write_text("untouched")
    (fake.env.mdev_bus / "evil").symlink_to(tmp_path / "outside")
    with pytest.raises(MdevBadNameError, match="leads outside"):
        bus.create("evil", "t", U1)
    assert (outside / "create").read_text() == "untouched"
