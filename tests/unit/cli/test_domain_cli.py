"""``vmlend xml``: new, add-device, remove-device, show."""

from __future__ import annotations

import json
import shutil
import sys
import types

import pytest
from click.testing import CliRunner

from tests.support.domain_support import DATA, define_in_test_driver, validate_with_libvirt_schema
from vmlend.cli import main
from vmlend.domain import mdev_uuid, read_domain
from vmlend.errors import UnknownDeviceError

U = "c7a5fdbd-edaf-9455-926a-d65c16db1809"


@pytest.fixture
def run(state_path):
    def invoke(*args: str):
        return CliRunner().invoke(main, list(args))

    return invoke


@pytest.fixture
def domain_file(tmp_path):
    path = tmp_path / "gpu1.xml"
    shutil.copy(DATA / "remove-in.xml", path)
    return path


def test_new_writes_a_valid_domain_to_stdout(run, tmp_path):
    r = run(
        "xml",
        "new",
        "vm1",
        "--memory",
        "4G",
        "--vcpus",
        "2",
        "--machine",
        "pc",
        "--device",
        "0x10",
        "--device",
        "0x11@0000:00:06.0",
        "--uuid",
        U,
    )
    assert r.exit_code == 0, r.stderr
    info = read_domain(r.stdout.encode())
    assert (info.name, str(info.uuid), info.memory_bytes, info.machine, info.virt_type) == (
        "vm1",
        U,
        4 << 30,
        "pc",
        "kvm",
    )
    assert [(d.fdid, str(d.address) if d.address else None) for d in info.devices] == [
        (0x10, None),
        (0x11, "0000:00:06.0"),
    ]
    validate_with_libvirt_schema(r.stdout.encode(), tmp_path)
    define_in_test_driver(r.stdout.encode())


def test_new_tcg_with_disk_to_a_file(run, tmp_path):
    out = tmp_path / "vm.xml"
    r = run(
        "xml",
        "new",
        "vm2",
        "--memory",
        "64M",
        "--virt-type",
        "qemu",
        "--disk",
        "/images/vm2.qcow2",
        "-o",
        str(out),
    )
    assert r.exit_code == 0, r.stderr
    assert r.stdout == ""
    info = read_domain(out.read_bytes())
    assert (info.virt_type, info.memory_bytes, info.devices) == ("qemu", 64 << 20, ())
    assert b"vm2.qcow2" in out.read_bytes()
    r = run("xml", "new", "vm2", "-o", str(out))
    assert r.exit_code == 2 and "--force" in r.stderr
    assert run("xml", "new", "vm3", "-o", str(out), "--force").exit_code == 0
    assert read_domain(out.read_bytes()).name == "vm3"


def test_output_dash_is_stdout_not_a_file_named_dash(run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = run("xml", "new", "vm4", "--memory", "64M", "--virt-type", "qemu", "-o", "-")
    assert r.exit_code == 0, r.stderr
    assert read_domain(r.stdout.encode()).name == "vm4" and not (tmp_path / "-").exists()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--memory", "lots"), "bad size"),
        (("--device", "0xzz"), "bad fabric device id"),
        (("--device", "0x10@00:40.0"), "guest PCI address"),
        (("--machine", "isapc"), "isapc"),
        (("--uuid", "nope"), "bad UUID"),
        (("--vcpus", "0"), "vcpus"),
    ],
)
def test_new_usage_errors_exit_2(run, args, needle):
    r = run("xml", "new", "vm", *args)
    assert r.exit_code == 2
    assert needle in r.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("vm", "--memory", "512K"), "at least 1M"),
        (("vm", "--device", "0x10", "--device", "16"), "given twice"),
        (("vm", "--device", "0x10@00:05.0", "--device", "0x11@00:05.0"), "already used"),
        (("vm/x",), "bad domain name"),
    ],
)
def test_new_bad_requests_exit_1_with_one_line(run, args, needle):
    r = run("xml", "new", *args)
    assert r.exit_code == 1
    assert needle in r.stderr and r.stderr.count("\n") == 1


def test_add_device_in_place(run, domain_file):
    r = run("xml", "add-device", str(domain_file), "0x12", "--address", "0000:00:08.0")
    assert r.exit_code == 0, r.stderr
    info = read_domain(domain_file.read_bytes())
    assert [d.fdid for d in info.devices] == [0x10, 0x11, 0x12]
    assert info.devices[2].mdev == mdev_uuid(U, 0x12)


def test_adding_a_present_device_is_a_noop_with_a_note(run, domain_file):
    before = domain_file.read_bytes()
    mtime = domain_file.stat().st_mtime_ns
    r = run("xml", "add-device", str(domain_file), "16")
    assert r.exit_code == 0
    assert "already in" in r.stderr
    assert domain_file.read_bytes() == before
    assert domain_file.stat().st_mtime_ns == mtime


def test_remove_device_in_place_keeps_the_file_mode(run, domain_file):
    domain_file.chmod(0o600)
    assert run("xml", "remove-device", str(domain_file), "0x11").exit_code == 0
    assert [d.fdid for d in read_domain(domain_file.read_bytes()).devices] == [0x10]
    assert domain_file.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in domain_file.parent.iterdir()] == ["gpu1.xml"]  # no temp left


def test_removing_an_absent_device(run, domain_file):
    before = domain_file.read_bytes()
    r = run("xml", "remove-device", str(domain_file), "0x42")
    assert r.exit_code == 1
    assert "has no vmlend device 0x42" in r.stderr and r.stderr.count("\n") == 1
    r = run("xml", "remove-device", str(domain_file), "0x42", "--missing-ok")
    assert r.exit_code == 0 and "nothing was changed" in r.stderr
    assert domain_file.read_bytes() == before


def test_show_table_and_json(run, domain_file):
    r = run("xml", "show", str(domain_file))
    assert r.exit_code == 0
    assert "0x11" in r.stdout and "0000:00:06.0" in r.stdout and "gpu1" in r.stdout
    r = run("xml", "show", str(domain_file), "--json")
    data = json.loads(r.stdout)
    assert data["devices"][0] == {"fdid": "0x10", "mdev": str(mdev_uuid(U, 0x10)), "address": None}
    assert data["problems"] == []


def test_show_reports_disagreement_and_fails(run, tmp_path):
    path = tmp_path / "bad.xml"
    path.write_bytes((DATA / "remove-in.xml").read_bytes().replace(b"slot='0x06'", b"slot='0x07'"))
    r = run("xml", "show", str(path), "--json")
    assert r.exit_code == 1
    assert "guest address" in json.loads(r.stdout)["problems"][0]
    assert "warning" in r.stderr


@pytest.mark.parametrize("command", ["show", "add-device", "remove-device"])
def test_malformed_or_missing_files_are_one_line(run, tmp_path, command):
    bad = tmp_path / "bad.xml"
    bad.write_bytes(b"<domain><name>x</name>")
    extra = [] if command == "show" else ["0x10"]
    r = run("xml", command, str(bad), *extra)
    assert r.exit_code == 1
    assert "not well-formed" in r.stderr and r.stderr.count("\n") == 1
    assert bad.read_bytes() == b"<domain><name>x</name>"
    r = run("xml", command, str(tmp_path / "absent.xml"), *extra)
    assert r.exit_code == 1 and "cannot read" in r.stderr


def test_fabric_check_when_a_state_exists(run, domain_file, state_path, monkeypatch):
    """With a state and a fabric backend, unknown fdids are refused before any change."""
    state_path.write_bytes(b"")

    class FakeFabric:
        def device(self, fdid: int) -> object:
            if fdid != 0x12:
                raise UnknownDeviceError(fdid)
            return object()

    opened = []
    module = types.ModuleType("vmlend.wiring.fabric")
    module.open_fabric = lambda path, node, **_: opened.append((path, node)) or FakeFabric()
    monkeypatch.setitem(sys.modules, "vmlend.wiring.fabric", module)
    before = domain_file.read_bytes()
    r = run("--node", "gamma", "xml", "add-device", str(domain_file), "0x13")
    assert r.exit_code == 1 and "unknown device fdid 0x13" in r.stderr
    assert domain_file.read_bytes() == before
    assert opened == [(state_path, "gamma")]
    assert run("xml", "add-device", str(domain_file), "0x12").exit_code == 0
    r = run("xml", "add-device", str(domain_file), "0x13", "--no-fabric-check")
    assert r.exit_code == 0
    r = run("xml", "new", "vm", "--device", "0x14")
    assert r.exit_code == 1 and "unknown device fdid 0x14" in r.stderr


def test_without_a_state_fdids_are_checked_for_syntax_only(run, domain_file, state_path):
    assert not state_path.exists()
    assert run("xml", "add-device", str(domain_file), "0x99").exit_code == 0


def test_new_q35_with_free_root_ports_for_hot_plug(run, tmp_path):
    import subprocess

    from lxml import etree

    out = tmp_path / "hp.xml"
    r = run("xml", "new", "hp", "--hotplug-slots", "3", "--no-fabric-check", "-o", str(out))
    assert r.exit_code == 0, r.output
    root = etree.fromstring(out.read_bytes())
    ports = root.findall("devices/controller[@model='pcie-root-port']")
    assert [p.get("index") for p in ports] == ["1", "2", "3"]
    assert not root.findall("devices/controller/address")  # libvirt places them
    v = subprocess.run(["virt-xml-validate", str(out), "domain"], capture_output=True, text=True)
    assert v.returncode == 0, v.stderr
    # A device hot-added later leaves the file's ports alone.
    assert run("xml", "add-device", str(out), "0x10", "--no-fabric-check").exit_code == 0
    again = etree.fromstring(out.read_bytes())
    assert len(again.findall("devices/controller[@model='pcie-root-port']")) == 3


def test_hotplug_slots_are_for_q35(run):
    r = run("xml", "new", "p", "--machine", "pc", "--hotplug-slots", "1", "--no-fabric-check")
    assert r.exit_code == 1 and "for q35" in r.stderr


def test_add_and_remove_device_json_say_what_they_did(run, domain_file):
    file = str(domain_file)
    r = run("xml", "add-device", file, "0x12", "--no-fabric-check", "--json")
    assert json.loads(r.stdout) == {
        "format": "vmlend/1",
        "action": "added",
        "fdid": "0x12",
        "file": file,
    }
    r = run("xml", "add-device", file, "0x12", "--json")
    assert json.loads(r.stdout)["action"] == "unchanged"
    r = run("xml", "remove-device", file, "0x12", "--json")
    assert json.loads(r.stdout)["action"] == "removed"
    r = run("xml", "remove-device", file, "0x12", "--missing-ok", "--json")
    assert json.loads(r.stdout)["action"] == "unchanged"
