"""Issue 21 item 7: odd sysfs attributes. Every attribute the kernel backend reads is checked
as the kernel defines it; damage is one ``SysfsAttributeError`` naming the path (never a
traceback, never a silently accepted value), and one damaged device does not hide the others
in listings."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from tests.support.fake_sysfs import FakeSmartio, FakeSysfs, FakeType, populate_smartio
from tests.support.sysfs_damage import plant_bytes, plant_directory, plant_fifo, plant_loop
from vmlend.cli import main
from vmlend.errors import SysfsAttributeError, UnknownDeviceError
from vmlend.kernel.backend import open_smartio_fabric
from vmlend.kernel.driver import SmartioDriver, fdid_of
from vmlend.kernel.mdev import MdevBus
from vmlend.registry import SqliteRegistry
from vmlend.sim.backend import SimFabric
from vmlend.topology.model import DeviceState, Holder
from vmlend.wiring.fabric import default_topology_text, init_fabric

U1 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001"


@pytest.fixture
def fake(tmp_path):
    return FakeSysfs(tmp_path / "root")


@pytest.fixture
def smartio(fake):
    s = FakeSmartio(fake, node_id=12)
    s.add_device(0x10, 4, class_code=0x030200, dma_bits=40, bars="0 0x1000000 mem32\n")
    s.add_device(0x11, 4, bdf="0000:42:00.0")
    return s


@pytest.fixture
def driver(fake, smartio):
    return SmartioDriver(fake.env, fake)


def attr(fake, name, fdid=0x10):
    return fake.env.smartio / f"smartio-{fdid:x}" / name


def refused(driver, fdid=0x10) -> SysfsAttributeError:
    with pytest.raises(SysfsAttributeError) as e:
        driver.device(fdid)
    message = str(e.value)
    assert "\n" not in message and "docs/smartio-contract.md" in message
    return e.value


# --- what stands where a file belongs -------------------------------------------------------


def test_a_directory_where_an_attribute_belongs(fake, driver):
    plant_directory(attr(fake, "dma_bits"))
    e = refused(driver)
    assert e.path == str(attr(fake, "dma_bits")) and "a directory" in str(e)


def test_a_symbolic_link_loop_at_an_attribute(fake, driver):
    plant_loop(attr(fake, "vendor"))
    assert "symbolic link loop" in str(refused(driver))


def test_a_symbolic_link_loop_at_the_device_is_reported_not_taken_for_gone(fake, driver):
    link = fake.env.smartio / "smartio-11"
    link.unlink()
    plant_loop(link)
    found, damaged = driver.scan()
    assert [d.fdid for d in found] == [0x10]
    assert len(damaged) == 1 and "symbolic link loop" in str(damaged[0])


def test_a_fifo_where_an_attribute_belongs_does_not_block(fake, driver):
    plant_fifo(attr(fake, "class"))
    assert "not a regular file" in str(refused(driver))


def test_bytes_that_are_not_text(fake, driver):
    plant_bytes(attr(fake, "lender_bdf"), b"0000:41:00.\xff\n")
    assert "not ASCII" in str(refused(driver))
    plant_bytes(attr(fake, "lender_bdf"), b"0000:41:00.0\x00\n")
    assert "control characters" in str(refused(driver))
    plant_bytes(attr(fake, "lender_bdf"), b"0" * 5000)
    assert "longer than 4096 bytes" in str(refused(driver))


# --- values the attribute cannot hold --------------------------------------------------------


@pytest.mark.parametrize(
    "name, text, says",
    [
        ("physfn", "pf0", "a PF's fdid"),
        ("physfn", "0x10", "its own PF"),
        ("physfn", "0x100000000", "between 0 and 0xffffffff"),
        ("dma_bits", str(1 << 160), "between 32 and 64"),
        ("dma_bits", "16", "between 32 and 64"),
        ("dma_bits", "40 41", "a DMA address width"),
        ("vendor", "0x10000", "16-bit vendor"),
        ("device", "-1", "16-bit device"),
        ("class", "0x1000000", "24-bit class"),
        ("fdid", "0x11", "says 0x11"),
        ("lender_node_id", "0", "a node id"),
        ("lender_node_id", "70000", "a node id"),
        ("lender_node_id", "\u0664", "not ASCII"),  # int() would read the Arabic-Indic 4
        ("lender_node_id", "0b100", "a node id"),
        ("lender_node_id", "1_2", "a node id"),
        ("lender_adapter", "99", "an adapter index"),
        ("borrower_node_id", "-2", "a node id or -1"),
        ("borrower_node_id", "0", "no node id"),
        ("lender_bdf", "41:00.0", "a PCI address"),
        ("lender_bdf", "0000:41:20.0", "a PCI address"),
        ("lender_bdf", "0000:41:00.0\n0000:42:00.0", "one line"),
        ("availability", "maybe", "unknown value"),
    ],
)
def test_values_outside_the_attributes_range(fake, driver, name, text, says):
    plant_bytes(attr(fake, name), (text + "\n").encode())
    e = refused(driver)
    assert e.path == str(attr(fake, name)) and says in str(e)


@pytest.mark.parametrize(
    "bars, says",
    [
        ("0 0 mem32", "between 1 and"),
        ("0 -0x1000 mem32", "between 1 and"),
        ("0 0x3000 mem32", "power of two"),
        (f"0 {1 << 104:#x} mem64", "between 1 and 0x10000000000000"),
        (f"0 {1 << 53:#x} mem64", "between 1 and 0x10000000000000"),
        ("0 8 mem32", "at least 16"),
        ("0 2 io", "at least 4"),
        ("0 0x100000000 mem32", "32-bit BAR is at most 2 GiB"),
        ("5 0x4000 mem64", "index 5 has no second slot"),
        ("0 0x4000 mem64\n1 0x1000 mem32", "slot 1 is listed twice"),
        ("6 0x4000 mem32", "a BAR index"),
        ("0 0x4000 mem16", "mem32, mem64 or io"),
    ],
)
def test_bar_sizes_and_slots_the_pci_spec_forbids(fake, driver, bars, says):
    plant_bytes(attr(fake, "bars"), (bars + "\n").encode())
    e = refused(driver)
    assert e.path == str(attr(fake, "bars")) and says in str(e)


def test_the_largest_sizes_the_hardware_holds_are_accepted(fake, driver):
    plant_bytes(attr(fake, "bars"), f"0 {1 << 52:#x} mem64\n2 0x80000000 mem32\n4 4 io\n".encode())
    plant_bytes(attr(fake, "dma_bits"), b"64\n")
    dev = driver.device(0x10)
    assert [b.size for b in dev.bars] == [1 << 52, 1 << 31, 4] and dev.dma_bits == 64


def test_a_device_name_with_leading_zeros_is_not_a_second_name_for_it():
    assert fdid_of("smartio-010") is None and fdid_of("smartio-0") == 0


def test_a_missing_attribute_names_it(fake, driver):
    attr(fake, "physfn").unlink()
    assert "lacks attribute physfn" in str(refused(driver))
    with pytest.raises(UnknownDeviceError):
        driver.device(0x99)


def test_msi_capable_is_zero_or_one(fake, driver):
    msi = attr(fake, "msi")
    msi.mkdir()
    plant_bytes(msi / "capable", b"2\n")
    with pytest.raises(SysfsAttributeError, match="0 or 1"):
        driver.msi_capable(0x10)


def test_node_id(fake, driver):
    plant_bytes(fake.env.smartio / "node_id", b"\xfe\n")
    with pytest.raises(SysfsAttributeError, match="node_id"):
        driver.node_id()


# --- the mdev bus ----------------------------------------------------------------------------


@pytest.fixture
def bus(fake):
    fake.add_parent("mtty", [FakeType("mtty-1", available=2)])
    fake.add_parent("good", [FakeType("good-1", available=1)])
    return MdevBus(fake.env, fake)


def types_dir(fake, parent, type_id):
    return fake.env.mdev_bus / parent / "mdev_supported_types" / type_id


@pytest.mark.parametrize(
    "data, says",
    [
        (b"\xff\n", "not ASCII"),
        (b"-1\n", "between 0 and"),
        ("\u0661\n".encode(), "not ASCII"),
        (b"1_0\n", "a count"),
        (b" \n", "a count"),
    ],
)
def test_available_instances_is_a_count(fake, bus, data, says):
    plant_bytes(types_dir(fake, "mtty", "mtty-1") / "available_instances", data)
    with pytest.raises(SysfsAttributeError, match=says):
        bus.parent("mtty")


def test_a_missing_available_instances_is_damage_not_a_vanished_parent(fake, bus):
    # Found by tests/scenarios/test_fuzz_boundaries.py: a bare FileNotFoundError escaped parent().
    (types_dir(fake, "mtty", "mtty-1") / "available_instances").unlink()
    with pytest.raises(SysfsAttributeError, match="available_instances: missing"):
        bus.parent("mtty")
    assert [p.name for p in bus.parents()] == ["good"] and len(bus.unreadable) == 1


def test_a_damaged_parent_does_not_hide_the_others(fake, bus):
    plant_directory(types_dir(fake, "mtty", "mtty-1") / "device_api")
    assert [p.name for p in bus.parents()] == ["good"]
    (problem,) = bus.unreadable
    assert "device_api" in str(problem) and "a directory" in str(problem)


def test_vmlend_mdev_types_lists_the_others_and_reports_the_damaged_one_in_one_line(fake, bus):
    plant_loop(types_dir(fake, "mtty", "mtty-1") / "available_instances")
    r = CliRunner().invoke(main, ["--root", str(fake.root), "mdev", "types"])
    assert r.exit_code == 0, r.output
    assert [line.split()[0] for line in r.stdout.splitlines()[1:]] == ["good"]
    (line,) = r.stderr.splitlines()
    assert "mtty-1/available_instances" in line and "symbolic link loop" in line


def test_a_file_where_a_type_directory_belongs(fake, bus):
    plant_bytes(types_dir(fake, "mtty", "stray"), b"x\n")
    assert [p.name for p in bus.parents()] == ["good"]
    assert "its directory is a file" in str(bus.unreadable[0])


def test_a_loop_at_a_childs_type_link(fake, bus):
    bus.create("good", "good-1", U1)
    plant_loop(fake.env.mdev_devices / U1 / "mdev_type")
    with pytest.raises(SysfsAttributeError, match="symbolic link loop"):
        bus.device(U1)
    assert bus.devices() == [] and len(bus.unreadable) == 1


def test_a_stray_entry_among_the_children_does_not_hide_them(fake, bus):
    bus.create("good", "good-1", U1)
    (fake.env.mdev_devices / "not-a-uuid").mkdir()
    assert [d.uuid for d in bus.devices()] == [U1]
    assert "not-a-uuid" in str(bus.unreadable[0])


# --- listings: one damaged device, the others still there -------------------------------------


@pytest.fixture
def smartio_host(tmp_path):
    state = tmp_path / "state.db"
    text, source = default_topology_text()
    init_fabric(state, text, source, node="gamma")
    fake = FakeSysfs(tmp_path / "host")
    smartio = FakeSmartio(fake, node_id=12)
    populate_smartio(smartio, SimFabric(SqliteRegistry.open(state)).topology())
    env = {"VMLEND_STATE": str(state), "VMLEND_ROOT": str(fake.root), "VMLEND_BACKEND": "smartio"}
    return fake, env


def test_vmlend_devices_lists_the_others_and_reports_the_damaged_one_in_one_line(smartio_host):
    fake, env = smartio_host
    plant_bytes(attr(fake, "bars", 0x11), b"0 0x3000 mem32\n")
    r = CliRunner().invoke(main, ["devices"], env=env)
    assert r.exit_code == 0, r.output
    rows = {line.split()[0]: line.split()[-2] for line in r.stdout.splitlines()[1:]}
    assert rows["0x11"] == "unavailable" and rows["0x10"] == "available"
    (line,) = r.stderr.splitlines()
    assert "smartio-11/bars" in line and "power of two" in line


def test_the_root_option_reaches_the_kernel_backend(smartio_host):
    # --root used to be ignored by the SmartIO backend (only $VMLEND_ROOT counted).
    fake, env = smartio_host
    plant_bytes(attr(fake, "physfn", 0x12), b"pf\n")
    root = env.pop("VMLEND_ROOT")
    r = CliRunner().invoke(main, ["--root", root, "devices"], env={**env, "VMLEND_ROOT": ""})
    assert r.exit_code == 0, r.output
    assert "smartio-12/physfn" in r.stderr


def test_vmlend_doctor_fails_the_smartio_check_naming_the_attribute(smartio_host):
    fake, env = smartio_host
    plant_loop(attr(fake, "dma_bits", 0x12))
    r = CliRunner().invoke(main, ["doctor", "--smartio"], env={**env, "VMLEND_BACKEND": ""})
    (line,) = [x for x in r.output.splitlines() if "smartio driver" in x]
    assert "FAIL" in line and "smartio-12/dma_bits" in line and "loop" in line


def test_reserving_a_damaged_device_is_one_typed_error(smartio_host, tmp_path):
    fake, env = smartio_host
    plant_bytes(attr(fake, "dma_bits", 0x12), str(1 << 160).encode())
    with open_smartio_fabric(env["VMLEND_STATE"], env=fake.env, writer=fake) as fabric:
        with pytest.raises(SysfsAttributeError, match="between 32 and 64"):
            fabric.reserve(0x12, Holder("gamma", "web", U1))
        assert fabric.device(0x10).state is DeviceState.AVAILABLE
