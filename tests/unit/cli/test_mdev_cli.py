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


def test_types_json(fake):
    r = run(fake, "types", "--json")
    assert r.exit_code == 0, r.output
    rows = {(t["parent"], t["type"]): t for t in json.loads(r.output)["types"]}
    assert rows["mtty", "mtty-1"]["available"] == 2
    assert rows["mtty", "mtty-2"]["devices"] == [U1]
    assert rows["smartio-12", "smartio-lend"]["name"] == "SmartIO lent device"


def test_types_table(fake):
    r = run(fake, "types")
    assert r.exit_code == 0
    assert r.output.splitlines()[0].split() == ["PARENT", "TYPE", "NAME", "API", "AVAILABLE",
                                                "DEVICES"]  # fmt: skip
    assert len(r.output.splitlines()) == 4


def test_list_json_and_env_root(fake):
    r = CliRunner().invoke(main, ["mdev", "list", "--json"], env={"VMLEND_ROOT": str(fake.root)})
    assert r.exit_code == 0
    (dev,) = json.loads(r.output)["mdevs"]
    assert (dev["uuid"], dev["parent"], dev["type"]) == (U1, "mtty", "mtty-2")
    assert isinstance(dev["iommu_group"], int)


def test_remove_missing_is_quiet_success(fake):
    r = run(fake, "remove", "83b8f4f2-509f-382f-3c1e-e6bfe0fa1002")
    assert r.exit_code == 0
    assert "does not exist" in r.output


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
