"""On a cluster registry a host that has not said which node it is (no --node, VMLEND_NODE or
etc/vmlend/node) can still read: status, reconcile without --fix, devices, fabric show and
xml new work; ``reconcile`` exits like diff (1 while drift remains, 0 once all agree)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from tests.support.cli_cluster import GAMMA
from vmlend.cli import main


@pytest.fixture
def etcd_cli(etcd_url, monkeypatch, tmp_path):
    for name in ("VMLEND_NODE", "VMLEND_STATE", "LIBVIRT_DEFAULT_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VMLEND_STATE", str(tmp_path / "state.db"))  # never created here

    def run(*args: str):
        return CliRunner().invoke(main, ["--registry", etcd_url, *args])

    r = run("fabric", "init")
    assert r.exit_code == 0, r.output
    return run


@pytest.mark.parametrize(
    "args",
    [
        ("devices",),
        ("fabric", "show"),
        ("status", "-c", "test:///default"),
        ("xml", "new", "vm9", "--device", "0x10"),
    ],
)
def test_read_only_commands_need_no_node_identity(etcd_cli, args):
    r = etcd_cli(*args)
    assert r.exit_code == 0, r.output


def test_reconcile_without_fix_needs_no_node_identity(etcd_cli):
    # a libvirt host (the test driver's) that nothing says is a fabric node
    r = etcd_cli("reconcile", "-c", "test:///default")
    assert r.exit_code == 0, r.output
    assert r.output.startswith("no drift")


def test_writing_still_needs_it(etcd_cli):
    r = etcd_cli("reconcile", "--fix", "-c", "test:///default")
    assert r.exit_code == 1
    assert "say which fabric node this host is" in r.output


def test_reconcile_exits_1_while_drift_remains_and_0_after_fix(cluster):
    cluster.define("gamma", "vm1", [0x10], running=True)
    with cluster.fabric("gamma") as f:
        (holder,) = {d.holder for d in f.devices() if d.fdid == 0x10}
        f.release(0x10, holder)  # the running VM's device is no longer held: drift
    r = cluster.cli("reconcile", *GAMMA)
    assert r.exit_code == 1, r.output
    assert "'vmlend reconcile --fix' repairs them" in r.output
    assert cluster.cli("reconcile", "--fix", "--dry-run", *GAMMA).exit_code == 1
    fixed = cluster.cli("reconcile", "--fix", *GAMMA)
    assert fixed.exit_code == 0, fixed.output
    again = cluster.cli("reconcile", *GAMMA)
    assert again.exit_code == 0 and "no drift on gamma" in again.output
