"""Reading this host's description from the SmartIO driver (``read_host``, ``read_adapters``):
its node id, adapters and cables, its own devices, its RAM; damaged values refused by name."""

from __future__ import annotations

import pytest

from tests.support.fake_sysfs import FakeSmartio, FakeSysfs
from tests.support.sysfs_damage import plant_directory
from vmlend.errors import HostError, SysfsAttributeError
from vmlend.kernel.adapters import read_adapters
from vmlend.kernel.discover import host_ram, read_host
from vmlend.topology.discovered import FoundAdapter
from vmlend.topology.model import BarKind, BarSpec


@pytest.fixture
def fake(tmp_path):
    return FakeSysfs(tmp_path / "root")


@pytest.fixture
def smartio(fake):
    s = FakeSmartio(fake, node_id=12)
    s.add_device(0x40, 12, bdf="0000:05:00.0", bars="0 0x4000 mem64\n", availability="unlent")
    s.add_device(0x41, 12, bdf="0000:05:00.1", physfn=0x40, adapter=1)
    s.add_device(0x10, 4)  # a remote device: alpha's
    s.add_adapter(0, peer=(4, 0))
    s.add_adapter(1, model="MXH932", window_size=1 << 40, segments=256, switch_port=7)
    s.add_adapter(2, link="down")
    return s


def test_the_host_as_the_driver_describes_it(fake, smartio):
    (fake.env.proc).mkdir()
    (fake.env.proc / "meminfo").write_text("MemTotal:       16318436 kB\nMemFree: 1 kB\n")
    h = read_host(fake.env, "gamma.example")
    assert (h.node_id, h.hostname, h.remote_devices, h.damaged) == (12, "gamma.example", 1, ())
    assert h.ram == 15935 << 20  # 16318436 kB, rounded down to MiB
    assert h.adapters == (
        FoundAdapter(0, "PXH830", 128 << 30, 32, 32, True, (4, 0), None),
        FoundAdapter(1, "MXH932", 1 << 40, 256, 32, True, None, 7),
        FoundAdapter(2, "PXH830", 128 << 30, 32, 32, False, None, None),
    )
    nvme, vf = h.devices
    assert (nvme.fdid, nvme.kind, nvme.lent, nvme.adapter) == (0x40, "nvme", False, 0)
    assert nvme.bars == (BarSpec(0, 0x4000, BarKind.MEM64),)
    assert (vf.fdid, vf.kind, vf.physfn, vf.lent, vf.adapter) == (0x41, "vf", 0x40, True, 1)


def test_without_meminfo_the_ram_is_not_known(fake):
    assert host_ram(fake.env) is None
    fake.env.proc.mkdir()
    (fake.env.proc / "meminfo").write_text("nothing here\n")
    assert host_ram(fake.env) is None


def test_without_the_driver_it_says_what_to_load(fake):
    with pytest.raises(HostError, match=r"not loaded .*'modprobe smartio'.*fabric init --topology"):
        read_host(fake.env, "h")


def test_a_damaged_device_is_left_out_and_named(fake, smartio):
    (fake.env.smartio / "smartio-41" / "dma_bits").write_text("300\n")
    h = read_host(fake.env, "h")
    assert [d.fdid for d in h.devices] == [0x40]
    assert len(h.damaged) == 1 and "smartio-41/dma_bits" in h.damaged[0]


@pytest.mark.parametrize(
    ("attr", "value", "problem"),
    [
        ("index", "3", "says 3, but its directory is adapter0"),
        ("model", "PXH 830", "expected a product name"),
        ("model", "", "expected a product name"),
        ("window_size", "0x3000000000", "the window size must be a power of two"),
        ("window_size", "0x800", "a window size in bytes must be between"),
        ("window_size", "huge", "expected a window size in bytes"),
        ("segments", "24", "the segment count must be a power of two"),
        ("segments", "0", "a segment count must be between 1"),
        ("segments", "4096", "smaller than a page"),  # 128 GiB / 4096 is fine: see below
        ("lut_entries", "0", "a LUT entry count must be between 1"),
        ("link", "sideways", "expected up or down"),
        ("peer", "4", "expected '<node id> <adapter index>' or nothing"),
        ("peer", "0 0", "a node id must be between 1"),
        ("peer", "4 16", "an adapter index must be between 0 and 15"),
        ("switch_port", "256", "a switch port must be between 0 and 255"),
        ("switch_port", "3", "a peer adapter or to a switch port, not both"),
    ],
)
def test_a_damaged_adapter_value_is_refused_by_name(fake, smartio, attr, value, problem):
    d = fake.env.smartio / "adapter0"
    if attr == "segments" and value == "4096":
        (d / "window_size").write_text("0x800000\n")  # 8 MiB in 4096 segments: 2 KiB each
    (d / attr).write_text(value + "\n")
    with pytest.raises(SysfsAttributeError) as e:
        read_adapters(fake.env)
    assert problem in e.value.problem and str(d / attr) in str(e.value)


def test_a_down_link_naming_its_peer_is_refused(fake, smartio):
    (fake.env.smartio / "adapter2" / "peer").write_text("4 0\n")
    with pytest.raises(SysfsAttributeError, match="down, yet the adapter names"):
        read_adapters(fake.env)


def test_a_missing_attribute_or_a_directory_in_its_place_is_refused(fake, smartio):
    (fake.env.smartio / "adapter1" / "lut_entries").unlink()
    with pytest.raises(SysfsAttributeError, match="adapter 1 lacks attribute lut_entries"):
        read_adapters(fake.env)
    (fake.env.smartio / "adapter1" / "lut_entries").write_text("32\n")
    plant_directory(fake.env.smartio / "adapter1" / "model")
    with pytest.raises(SysfsAttributeError, match="a directory where the kernel puts a file"):
        read_adapters(fake.env)


def test_an_adapter_index_past_the_contracts_is_refused(fake, smartio):
    (fake.env.smartio / "adapter16").mkdir()
    with pytest.raises(SysfsAttributeError, match="an adapter index is at most 15"):
        read_adapters(fake.env)


def test_other_names_in_the_class_are_not_adapters(fake, smartio):
    (fake.env.smartio / "adapter01").mkdir()  # not the contract's spelling of an index
    (fake.env.smartio / "adapters").mkdir()
    assert [a.index for a in read_adapters(fake.env)] == [0, 1, 2]
