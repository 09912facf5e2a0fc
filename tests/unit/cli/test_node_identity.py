"""``vmlend fabric init --node X`` on a live state: this host's identity changes only when its
old identity holds nothing (or with ``--force``), and the output says what changed."""

from __future__ import annotations

import json

from tests.support.cli_cluster import GAMMA, SimCluster, one_line


def test_changing_the_node_while_it_holds_devices_is_refused(cluster: SimCluster):
    cluster.define("gamma", "vm1", [0x10], running=True)
    before = cluster.snapshot()
    line = one_line(cluster.cli("fabric", "init", "--node", "beta"))
    assert line.startswith(
        "Error: this host is node gamma in the state, which still has 2 hold(s) or mdev(s)"
        " there (0x10 by gamma/vm1, mdev "
    )
    assert line.endswith(
        "--node beta would make it beta and its hook would no longer return them: stop those"
        " VMs first (or 'vmlend reconcile --fix'), or pass --force"
    )
    assert cluster.snapshot() == before
    shown = json.loads(cluster.cli("fabric", "show", "--json").stdout)
    assert shown["local_node"] == "gamma"


def test_the_env_node_is_checked_too(cluster: SimCluster, monkeypatch):
    cluster.define("gamma", "vm1", [0x10], running=True)
    monkeypatch.setenv("VMLEND_NODE", "beta")
    assert "still has 2 hold(s)" in one_line(cluster.cli("fabric", "init"))


def test_force_changes_it_and_says_what_it_left(cluster: SimCluster):
    cluster.define("gamma", "vm1", [0x10], running=True)
    res = cluster.cli("fabric", "init", "--node", "beta", "--force")
    assert res.exit_code == 0, res.output
    assert res.stdout.rstrip().endswith("this host is node beta (was gamma)")
    assert "2 hold(s) or mdev(s) of gamma are no longer this host's" in res.stderr
    assert json.loads(cluster.cli("fabric", "show", "--json").stdout)["local_node"] == "beta"


def test_changing_the_node_of_a_state_with_nothing_held_says_what_it_was(cluster: SimCluster):
    cluster.define("gamma", "vm1", [0x10])  # defined, not running: nothing held
    res = cluster.cli("fabric", "init", "--node", "beta", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert (data["action"], data["local_node"], data["previous_node"]) == (
        "local node set",
        "beta",
        "gamma",
    )
    assert cluster.cli("status", *GAMMA).exit_code == 0
