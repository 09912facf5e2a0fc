"""A mixed live migration (``vmlend.ops.live_mode``, ``vmlend.ops.live_migrate``): of a VM's
devices, the ones whose driver can quiesce stay plugged and move hot, only the others (a NIC)
are unplugged and plugged back, one line per device saying which; ``--json`` and ``status``
show each device's way and blackout; a failure before the hand-over puts the unplugged device
back on the source with the others untouched."""

from __future__ import annotations

import json

import pytest

from tests.support.cli_cluster import GAMMA
from tests.support.handover_checks import assert_consistent
from tests.support.live_moves import Watching, holds, running_with
from vmlend.domain import read_domain
from vmlend.errors import MigrationError, QuiesceError
from vmlend.hypervisor import LiveMigration
from vmlend.ops.live_migrate import live_migrate
from vmlend.ops.live_mode import MIXED, choose_mode
from vmlend.ops.live_state import history, load_journal
from vmlend.sim.hypervisor.node import SimHypervisor

GPU, NVME, NIC = 0x10, 0x12, 0x21
ADDRS = {GPU: "0000:00:0a.0", NIC: "0000:00:0c.0"}
LIVE = ("migrate", "vm1", "--to", "beta", "--live", *GAMMA)


def test_the_mode_names_each_device_and_mixes_only_when_some_can_quiesce():
    mode = choose_mode("vm1", {GPU: "gpu", NIC: "nic"}, hypervisor=None, backend=None)
    assert mode.mode == MIXED and mode.unplugged == (NIC,) and mode.hot
    assert mode.lines == (
        "device 0x10 (gpu): stays plugged; its mappings follow the VM",
        "device 0x21 (nic) cannot quiesce: unplugged, plugged back on arrival",
    )
    assert mode.device_mode(GPU) == "hot" and mode.device_mode(NIC) == "unplug"
    only = choose_mode("vm1", {NIC: "nic"}, hypervisor=None, backend=None)
    assert only.mode == "unplug" and only.lines == ()
    asked = choose_mode("vm1", {GPU: "gpu", NIC: "nic"}, hypervisor=None, backend=None,
                        unplug=True)
    assert asked.mode == "unplug"


def test_a_device_unplugged_for_a_reason_of_its_own_is_named_with_it():
    two = "is an NVMe share of two paths"
    mode = choose_mode(
        "vm1", {GPU: "gpu", NVME: "nvme"}, hypervisor=None, backend=None, unplugged={NVME: two}
    )
    assert mode.mode == MIXED and mode.unplugged == (NVME,)
    assert mode.lines[1] == f"device 0x12 (nvme) {two}: unplugged, plugged back on arrival"
    only = choose_mode("vm1", {NVME: "nvme"}, hypervisor=None, backend=None, unplugged={NVME: two})
    assert only.mode == "unplug"
    assert only.line == f"device 0x12 (nvme) {two}: VM 'vm1' moves with its devices unplugged"
    both = choose_mode(
        "vm1", {NVME: "nvme", NIC: "nic"}, hypervisor=None, backend=None, unplugged={NVME: two}
    )
    assert both.line == (
        f"devices 0x12 (nvme) {two}; 0x21 (nic) cannot quiesce: VM 'vm1' moves with its"
        " devices unplugged"
    )


def test_the_devices_that_can_quiesce_stay_plugged_and_only_the_nic_is_replugged(cluster):
    running_with(cluster, ADDRS)
    before = holds(cluster)
    src_guest, dst_guest = Watching(), Watching()
    steps: list[str] = []
    with cluster.fabric("gamma") as f, cluster.fabric("beta") as g:

        def check(line: str) -> None:
            steps.append(line)
            journal = load_journal(cluster.state_path.parent, "vm1")
            assert_consistent(f.registry, line, None, {"vm1"} if journal else ())

        res = live_migrate(
            cluster.hv("gamma", guest=src_guest),
            cluster.hv("beta", guest=dst_guest),
            f,
            g,
            "vm1",
            "beta",
            how=LiveMigration(),
            state_dir=cluster.state_path.parent,
            progress=check,
        )
    assert res.mode == "mixed" and res.modes == {GPU: "hot", NIC: "unplug"}
    # one unplug on the source and one plug on the destination: the NIC's, never the GPU's
    assert src_guest.events == ["removed"] and dst_guest.events == ["added"]
    assert "device 0x10 (gpu): stays plugged; its mappings follow the VM" in steps
    assert "device 0x21 (nic) cannot quiesce: unplugged, plugged back on arrival" in steps
    assert any(s.startswith("claimed room for 1 device of vm1 on beta") for s in steps)
    assert "1 device stayed plugged in vm1 on beta, 1 device plugged back" in steps
    after = holds(cluster)
    assert {f: h for f, (h, _t) in after.items()} == {GPU: "beta/vm1", NIC: "beta/vm1"}
    assert after[GPU][1] > before[GPU][1]  # handed over: a newer token
    assert set(res.blackout) == {GPU, NIC} and all(b is not None for b in res.blackout.values())
    (rec,) = history(cluster.state_path.parent, "vm1")
    assert rec.mode == "mixed" and rec.modes == {GPU: "hot", NIC: "unplug"}


def test_json_and_status_show_each_devices_way_and_blackout(cluster):
    running_with(cluster, ADDRS)
    r = cluster.cli(*LIVE, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["mode"] == "mixed" and data["modes"] == {"0x10": "hot", "0x21": "unplug"}
    assert set(data["blackout"]) == {"0x10", "0x21"}
    said = [ln for ln in r.stderr.splitlines() if "device 0x" in ln and "(" in ln]
    assert "vmlend: device 0x21 (nic) cannot quiesce: unplugged, plugged back on arrival" in said
    s = cluster.cli("status", "-c", "sim:///beta")
    assert s.exit_code == 0, s.output
    line = next(ln for ln in s.output.splitlines() if "gamma -> beta" in ln)
    assert " mixed " in line and "0x10 (hot) blackout" in line and "0x21 (unplug) blackout" in line
    back = cluster.cli("migrate", "vm1", "--to", "gamma", "--live", "-c", "sim:///beta")
    assert back.exit_code == 0, back.output
    assert back.stdout.startswith("migrated VM 'vm1' mixed from beta to gamma (running),")
    assert "device 0x21: blackout" in back.stdout and "(unplug)" in back.stdout


class RefusesQuiesce(SimHypervisor):
    """A source whose GPU cannot quiesce after all at the switch-over (``QuiesceError``)."""

    def migrate_live(self, name, dst, how, switch_over=None):
        class Refusing:
            def switch(self) -> None:
                raise QuiesceError(GPU, "gpu", "injected: a kernel did not finish")

            def resumed(self) -> None:
                raise AssertionError("never resumed there")

        assert switch_over is not None
        return super().migrate_live(name, dst, how, switch_over=Refusing())


def test_a_failure_before_the_hand_over_puts_the_unplugged_device_back(cluster):
    running_with(cluster, ADDRS)
    before = holds(cluster)
    src = cluster.hv("gamma")
    src.__class__ = RefusesQuiesce
    with cluster.fabric("gamma") as f, cluster.fabric("beta") as g, pytest.raises(
        MigrationError
    ) as e:
        live_migrate(src, cluster.hv("beta"), f, g, "vm1", "beta", how=LiveMigration(),
                     state_dir=cluster.state_path.parent)
    assert "it runs on gamma with all its devices, as before" in str(e.value)
    assert "(the unplugged devices are back in it)" in str(e.value)
    after = holds(cluster)
    assert after[GPU] == before[GPU]  # never moved: the same hold, the same token
    assert after[NIC][0] == "gamma/vm1"  # plugged back on the source
    assert load_journal(cluster.state_path.parent, "vm1") is None
    dom = read_domain(cluster.hv("gamma").xml("vm1"))
    assert {d.fdid: str(d.address) for d in dom.devices} == ADDRS
