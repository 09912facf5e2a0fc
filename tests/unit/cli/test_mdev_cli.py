"""``vmlend mdev`` over a fake root (--root / VMLEND_ROOT)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tests.support.fake_sysfs import FakeSysfs, FakeType
from vmlend.cli import main
from vmlend.kernel.mdev import MdevBus

U1 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001"


@pytest.fixture
def fake(tmp_path):
    f = FakeSysfs(tmp_path)
    f.add_mtty(ports=4)
    f.add_parent("smartio-12", [FakeType("smartio-lend", "SmartIO lent device")])
    MdevBus(f.env, f).create("mtty", "mtty-2", U1)
    return f


def run(fake, *args):
    return CliRunner().invoke(main, ["--root", str(fake.root), "mdev", *args])


def _by_parent(doc):
    """mdevctl's per-parent list of one-key objects, flattened: (parent, key) -> fields."""
    assert doc["format"] == "vmlend/1"
    return {
        (parent, key): fields
        for parent, entries in doc["parents"].items()
        for entry in entries
        for key, fields in entry.items()
    }


def test_types_json_has_mdevctls_shape_and_keys(fake):
    r = run(fake, "types", "--json")
    assert r.exit_code == 0, r.output
    rows = _by_parent(json.loads(r.output))
    assert rows["mtty", "mtty-1"]["available_instances"] == 2
    assert rows["mtty", "mtty-2"]["devices"] == [U1]
    assert rows["smartio-12", "smartio-lend"]["name"] == "SmartIO lent device"
    assert set(rows["mtty", "mtty-1"]) >= {"available_instances", "device_api", "name",
                                           "description"}  # fmt: skip
    assert rows["mtty", "mtty-1"]["device_api"] == "vfio-pci"


def test_types_and_list_filter_by_parent(fake):
    r = run(fake, "types", "-p", "smartio-12", "--json")
    assert set(json.loads(r.output)["parents"]) == {"smartio-12"}
    r = run(fake, "list", "--parent", "smartio-12", "--json")
    assert json.loads(r.output)["parents"] == {}
    r = run(fake, "list", "-p", "mtty")
    assert U1 in r.output


def test_list_filters_by_uuid(fake):
    r = run(fake, "list", "-u", U1.upper(), "--json")
    assert list(_by_parent(json.loads(r.output))) == [("mtty", U1)]
    r = run(fake, "list", "--uuid", "83b8f4f2-509f-382f-3c1e-e6bfe0fa1002")
    assert r.exit_code == 0 and U1 not in r.output


def test_types_table(fake):
    r = run(fake, "types")
    assert r.exit_code == 0
    assert r.output.splitlines()[0].split() == ["PARENT", "TYPE", "NAME", "API", "AVAILABLE",
                                                "DEVICES"]  # fmt: skip
    assert len(r.output.splitlines()) == 4


def test_list_json_and_env_root(fake):
    r = CliRunner().invoke(main, ["mdev", "list", "--json"], env={"VMLEND_ROOT": str(fake.root)})
    assert r.exit_code == 0
    ((key, dev),) = _by_parent(json.loads(r.output)).items()
    assert (key, dev["mdev_type"], dev["start"]) == (("mtty", U1), "mtty-2", "manual")
    assert isinstance(dev["iommu_group"], int)


def test_remove_missing_is_quiet_success(fake):
    r = run(fake, "remove", "83b8f4f2-509f-382f-3c1e-e6bfe0fa1002")
    assert r.exit_code == 0
    assert "does not exist" in r.output
    r = run(fake, "remove", "-u", "83b8f4f2-509f-382f-3c1e-e6bfe0fa1002", "--json")
    assert json.loads(r.stdout) == {
        "format": "vmlend/1",
        "action": "unchanged",
        "uuid": "83b8f4f2-509f-382f-3c1e-e6bfe0fa1002",
    }


@pytest.fixture
def kernel(fake, monkeypatch):
    """The CLI's bus writes through the fake tree's kernel emulation."""
    import vmlend.cli.cmd_mdev as cmd_mdev

    monkeypatch.setattr(cmd_mdev, "_bus", lambda obj: MdevBus(fake.env, fake))
    return fake


U3 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1003"


@pytest.mark.parametrize(
    "args",
    [
        ("-p", "mtty", "-t", "mtty-1", "-u", U3),
        ("mtty", "mtty-1", U3),
        ("mtty", "mtty-1", "--uuid", U3),
        ("--type", "mtty-1", "--parent", "mtty", "-u", U3.upper()),
    ],
)
def test_create_takes_mdevctls_options_or_positions_and_says_what_it_did(kernel, args):
    r = run(kernel, "create", *args, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["format"] == "vmlend/1"
    assert (doc["action"], doc["uuid"], doc["parent"], doc["mdev_type"]) == (
        "created",
        U3,
        "mtty",
        "mtty-1",
    )
    again = json.loads(
        run(kernel, "create", "-p", "mtty", "-t", "mtty-1", "-u", U3, "--json").stdout
    )
    assert again["action"] == "unchanged"
    r = run(kernel, "remove", "-u", U3, "--json")
    assert json.loads(r.stdout)["action"] == "removed"
    assert MdevBus(kernel.env, kernel).device(U3) is None


def test_create_refuses_two_different_values_for_one_thing(kernel):
    r = run(kernel, "create", "mtty", "mtty-1", "-p", "smartio-12")
    assert r.exit_code == 2 and "PARENT given twice" in r.output
    r = run(kernel, "create", "-p", "mtty")
    assert r.exit_code == 2 and "give PARENT and TYPE" in r.output
    r = run(kernel, "remove")
    assert r.exit_code == 2 and "give the UUID" in r.output


def test_errors_are_one_line_exit_1(fake):
    for args, words in (
        (("create", "mtty", "mtty-1", "nope"), "invalid mdev UUID"),
        (("create", "nope", "mtty-1"), "no mdev parent 'nope'"),
        (("create", "mtty", "mtty-9"), "offers: mtty-1, mtty-2"),
        (("create", "mtty", "mtty-1", U1), "already exists on mtty/mtty-2"),
    ):
        r = run(fake, *args)
        assert r.exit_code == 1, args
        assert words in r.output
        assert len(r.output.strip().splitlines()) == 1


def test_create_on_a_plain_file_tree_notices_nothing_happened(fake):
    # The CLI writes with the real writer; under a fake root nothing emulates the kernel,
    # and vmlend must say so instead of claiming success.
    r = run(fake, "create", "mtty", "mtty-1", "83b8f4f2-509f-382f-3c1e-e6bfe0fa1003")
    assert r.exit_code == 1
    assert "no device appeared" in r.output


def test_watch_refuses_a_fake_root(fake):
    r = run(fake, "watch", "--timeout", "0.1")
    assert r.exit_code == 1
    assert "live uevents exist only for the running host" in r.output


def test_watch_on_this_host_returns_when_idle(state_path):
    # The real root, read-only: a live netlink monitor, no parents here, nothing to do.
    from vmlend.wiring.fabric import default_topology_text, init_fabric

    init_fabric(state_path, *default_topology_text(), node="gamma")
    r = CliRunner().invoke(main, ["mdev", "watch", "--timeout", "0.05"], env={"VMLEND_ROOT": ""})
    assert r.exit_code == 0, r.output
