"""``vmlend fabric link-down/link-up`` with holds across the cable (issue 23 part 3): each
affected device is said on the command's output, written to the action log beside the state,
and shown by ``vmlend status`` until the link is back. The CLI has no hardware of its own, so
it reports; re-routing is the hardware's (tests/unit/sim/test_link_failover.py)."""

from __future__ import annotations

import json

from tests.support.cli_cluster import GAMMA, cluster  # noqa: F401  (the fixture)

LINK = "mxs824/beta:0"


def test_a_link_fault_is_reported_in_status_and_the_action_log(cluster):  # noqa: F811
    cluster.define("gamma", "vm1", [0x21], running=True)
    r = cluster.cli("fabric", "link-down", LINK)
    assert r.exit_code == 0, r.output
    assert f"device 0x21 of gamma/vm1: link {LINK} down" in r.output
    log = (cluster.state_path.parent / "hook.log").read_text()
    assert f"vm=vm1 link-down: device 0x21 of gamma/vm1: link {LINK} down" in log
    data = json.loads(cluster.cli("status", "--json", *GAMMA).stdout)
    (dev,) = data["vms"][0]["devices"]
    assert [(f["key"], f["state"]) for f in dev["link_faults"]] == [(LINK, "down")]
    text = cluster.cli("status", *GAMMA).stdout
    assert "LINK FAULT" in text and LINK in text
    up = json.loads(cluster.cli("fabric", "link-up", LINK, "--json").stdout)
    assert [(d["fdid"], d["state"]) for d in up["devices"]] == [("0x21", "recovered")]
    data = json.loads(cluster.cli("status", "--json", *GAMMA).stdout)
    assert data["vms"][0]["devices"][0]["link_faults"] == []
    assert "LINK FAULT" not in cluster.cli("status", *GAMMA).stdout


def test_a_cable_off_every_path_affects_nobody(cluster):  # noqa: F811
    cluster.define("gamma", "vm1", [0x21], running=True)
    r = cluster.cli("fabric", "link-down", "mxs824b/gamma:1", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["devices"] == []
