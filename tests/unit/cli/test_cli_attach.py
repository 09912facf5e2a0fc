"""``vmlend attach`` / ``detach`` on simulated hypervisor nodes that run the real vmlend hook as
a subprocess, over a real state file: what changes, what is undone, and bad input."""

from __future__ import annotations

import json

import pytest
from lxml import etree

from tests.support.cli_cluster import (
    GAMMA,
    MetadataFails,
    SimCluster,
    hostdev_uuids,
    make_cluster,
    metadata_fdids,
    one_line,
)
from tests.support.simfabric import small_topology
from vmlend.domain import mdev_uuid, read_domain
from vmlend.errors import FabricError, UnsupportedOperationError
from vmlend.ops.attach import apply_attach, plan_attach
from vmlend.sim.hypervisor.node import IdleGuest
from vmlend.topology.model import GiB, MiB


def vm_uuid(cluster: SimCluster, name: str = "vm1", node: str = "gamma") -> str:
    return cluster.hv(node).lookup(name).uuid


# --- live ------------------------------------------------------------------------------------


def test_live_attach_borrows_creates_the_mdev_and_plugs_the_hostdev(cluster):
    cluster.define("gamma", "vm1", running=True)
    r = cluster.cli("attach", "vm1", "0x10", *GAMMA)
    assert r.exit_code == 0, r.output
    mdev = str(mdev_uuid(vm_uuid(cluster), 0x10))
    assert r.stdout.strip() == f"attached device 0x10 to VM 'vm1' (live), mdev {mdev}"
    assert cluster.holds() == {0x10: "gamma/vm1"}
    assert cluster.states()[0x10] == "reserved"
    assert cluster.mdevs() == {(mdev, 0x10)}
    hv = cluster.hv("gamma")
    live = hv.xml("vm1")
    assert hostdev_uuids(live) == [mdev] and metadata_fdids(live) == ["0x10"]
    # virsh's default: live only; the definition is untouched.
    config = hv.xml("vm1", inactive=True)
    assert hostdev_uuids(config) == [] and metadata_fdids(config) == []
    # The live XML is still consistent for the release hook.
    assert [d.fdid for d in read_domain(live).devices] == [0x10]


def test_live_and_config_attach_changes_both(cluster):
    cluster.define("gamma", "vm1", running=True)
    r = cluster.cli("attach", "vm1", "0x12", "--live", "--config", *GAMMA)
    assert r.exit_code == 0, r.output
    hv = cluster.hv("gamma")
    for xml in (hv.xml("vm1"), hv.xml("vm1", inactive=True)):
        assert metadata_fdids(xml) == ["0x12"]
    assert cluster.holds() == {0x12: "gamma/vm1"}


def test_a_stopped_vm_returns_the_hot_added_device(cluster):
    cluster.define("gamma", "vm1", running=True)
    assert cluster.cli("attach", "vm1", "0x10", *GAMMA).exit_code == 0
    cluster.hv("gamma").shutdown("vm1", 5)  # the release hook returns what the live XML names
    assert cluster.holds() == {} and cluster.mdevs() == set()


def test_attach_at_a_guest_address(cluster):
    cluster.define("gamma", "vm1", running=True)
    r = cluster.cli("attach", "vm1", "0x12", "--address", "0000:00:0a.0", *GAMMA)
    assert r.exit_code == 0, r.output
    dev = read_domain(cluster.hv("gamma").xml("vm1")).devices[0]
    assert str(dev.address) == "0000:00:0a.0"


def test_attaching_an_attached_device_again_changes_nothing(cluster):
    cluster.define("gamma", "vm1", running=True)
    assert cluster.cli("attach", "vm1", "0x10", *GAMMA).exit_code == 0
    before = cluster.snapshot()
    r = cluster.cli("attach", "vm1", "0x10", *GAMMA)
    assert r.exit_code == 0, r.output
    assert "already attached" in r.stdout
    assert cluster.snapshot() == before


# --- config ----------------------------------------------------------------------------------


def test_config_attach_on_a_running_vm_borrows_at_the_next_start(cluster):
    cluster.define("gamma", "vm1", running=True)
    r = cluster.cli("attach", "vm1", "0x20", "--config", *GAMMA)
    assert r.exit_code == 0, r.output
    hv = cluster.hv("gamma")
    assert metadata_fdids(hv.xml("vm1", inactive=True)) == ["0x20"]
    assert metadata_fdids(hv.xml("vm1")) == []
    assert cluster.holds() == {}  # nothing borrowed for a definition change
    hv.shutdown("vm1", 5)
    hv.start("vm1")  # the hook's prepare borrows it
    assert cluster.holds() == {0x20: "gamma/vm1"}


def test_a_stopped_vm_defaults_to_config(cluster):
    cluster.define("gamma", "vm1")
    r = cluster.cli("attach", "vm1", "0x21", *GAMMA)
    assert r.exit_code == 0, r.output
    assert "(config)" in r.stdout
    assert cluster.holds() == {} and cluster.mdevs() == set()
    cluster.hv("gamma").start("vm1")
    assert cluster.holds() == {0x21: "gamma/vm1"}


def test_live_on_a_stopped_vm_is_one_line(cluster):
    cluster.define("gamma", "vm1")
    before = cluster.snapshot()
    line = one_line(cluster.cli("attach", "vm1", "0x10", "--live", *GAMMA))
    assert "not running" in line and "--config" in line
    assert cluster.snapshot() == before


# --- dry run ---------------------------------------------------------------------------------


def test_dry_run_prints_checks_and_diff_and_changes_nothing(cluster):
    cluster.define("gamma", "vm1", running=True)
    before = cluster.snapshot()
    r = cluster.cli("attach", "vm1", "0x10", "--dry-run", *GAMMA)
    assert r.exit_code == 0, r.output
    assert cluster.snapshot() == before
    out = r.stdout
    for check in ("exists", "not-held", "path", "lut", "window-dma", "window-bars", "dma-limit"):
        assert f"ok    {check}" in out
    assert "--- live XML (before)" in out and "+++ live XML (after)" in out
    mdev = str(mdev_uuid(vm_uuid(cluster), 0x10))
    assert f'+        <address uuid="{mdev}"/>' in out
    assert "nothing was changed" in out


def test_dry_run_lists_the_interrupt_window_the_attach_would_claim(cluster):
    # The attach itself maps MSI/MSI-X over the NTB when the window has room: the dry run
    # shows that check too, and says which path the interrupts would take.
    cluster.define("gamma", "vm1", running=True)
    before = cluster.snapshot()
    r = cluster.cli("attach", "vm1", "0x10", "--dry-run", "--json", *GAMMA)
    assert r.exit_code == 0, r.output
    msi = [c for c in json.loads(r.stdout)["checks"] if c["name"] == "msi-ntb"]
    assert len(msi) == 1 and msi[0]["ok"], msi
    r = cluster.cli("attach", "vm1", "0x10", "--dry-run", "--interrupts", "relay", *GAMMA)
    assert r.exit_code == 0 and "msi-ntb" not in r.stdout
    assert cluster.snapshot() == before


def test_dry_run_json_and_a_failing_check_exits_1(cluster):
    cluster.define("gamma", "vm1", running=True)
    cluster.define("gamma", "vm2", running=True)
    assert cluster.cli("attach", "vm2", "0x10", *GAMMA).exit_code == 0
    before = cluster.snapshot()
    r = cluster.cli("attach", "vm1", "0x10", "--dry-run", "--json", *GAMMA)
    assert r.exit_code == 1
    data = json.loads(r.stdout)
    assert data["ok"] is False
    bad = [c for c in data["checks"] if not c["ok"]]
    assert [c["name"] for c in bad] == ["not-held"] and "gamma/vm2" in bad[0]["detail"]
    assert "+++ live XML (after)" in data["diff"]["live"]
    assert cluster.snapshot() == before


# --- refusals and rollback -------------------------------------------------------------------


def test_device_held_elsewhere_is_one_line_and_nothing_changes(cluster):
    cluster.define("gamma", "vm1", running=True)
    cluster.define("gamma", "vm2", [0x10], running=True)
    before = cluster.snapshot()
    line = one_line(cluster.cli("attach", "vm1", "0x10", *GAMMA))
    assert line == "Error: cannot attach device 0x10 to VM 'vm1': device 0x10 is held by gamma/vm2"
    assert cluster.snapshot() == before


def test_a_lender_with_its_iommu_off_lends_to_no_vm_one_line_nothing_changes(
    state_path, monkeypatch
):
    from vmlend.wiring.fabric import default_topology_text

    monkeypatch.delenv("VMLEND_NODE", raising=False)
    text = default_topology_text()[0].replace('name = "alpha"\n', 'name = "alpha"\niommu = false\n')
    cluster = make_cluster(state_path, text)
    cluster.define("gamma", "vm1", running=True)
    before = cluster.snapshot()
    line = one_line(cluster.cli("attach", "vm1", "0x10", *GAMMA))
    assert line == (
        "Error: cannot attach device 0x10 to VM 'vm1': device 0x10 cannot go to a VM: its lender"
        " alpha has its IOMMU off, and a VM's device needs it; set iommu = true for alpha in the"
        " topology and run 'vmlend fabric init --topology FILE', or borrow a device of another"
        " lender"
    )
    assert cluster.snapshot() == before
    assert cluster.cli("attach", "vm1", "0x20", *GAMMA).exit_code == 0  # beta's IOMMU is on


def test_vm_that_does_not_exist(cluster):
    before = cluster.snapshot()
    line = one_line(cluster.cli("attach", "ghost", "0x10", *GAMMA))
    assert "no domain 'ghost' on sim:///gamma" in line
    assert cluster.snapshot() == before


def test_unknown_device(cluster):
    cluster.define("gamma", "vm1", running=True)
    before = cluster.snapshot()
    line = one_line(cluster.cli("attach", "vm1", "0x99", *GAMMA))
    assert "unknown device fdid 0x99" in line
    assert cluster.snapshot() == before


@pytest.mark.parametrize(
    "args",
    [("vm1", "0xZZ"), ("vm1", "gpu:2"), ("vm1", "0x10", "--address", "nonsense"), ("vm1",)],
)
def test_usage_errors_exit_2(cluster, args):
    cluster.define("gamma", "vm1", running=True)
    before = cluster.snapshot()
    r = cluster.cli("attach", *args, *GAMMA)
    assert r.exit_code == 2, r.output
    assert cluster.snapshot() == before


def test_full_lut_is_one_line(state_path, monkeypatch):
    monkeypatch.delenv("VMLEND_NODE", raising=False)
    # 3 entries, 2 reserved for the CPU: one device can cross to the borrower.
    cluster = make_cluster(state_path, small_topology(borrower_lut_entries=3), node="b")
    cluster.define("b", "vm1", [0x100], running=True)
    cluster.define("b", "vm2", running=True)
    before = cluster.snapshot()
    line = one_line(cluster.cli("attach", "vm2", "0x101", "-c", "sim:///b"))
    assert "requester LUT on b:0 is short by 1 entry (need 1 entry, have 0" in line
    assert cluster.snapshot() == before


def test_too_small_ntb_window_is_one_line(state_path, monkeypatch):
    monkeypatch.delenv("VMLEND_NODE", raising=False)
    cluster = make_cluster(
        state_path, small_topology(lender_window="1GiB", lender_segments=4), node="b"
    )
    cluster.define("b", "vm1", memory=2 * GiB, running=True)
    before = cluster.snapshot()
    line = one_line(cluster.cli("attach", "vm1", "0x100", "-c", "sim:///b"))
    assert "NTB window l:0 short by 1 GiB: need 2 GiB, have 1 GiB" in line
    assert cluster.snapshot() == before


def test_admission_refuses_ram_beyond_the_device_reach(cluster):
    from vmlend.domain import DomainSpec, TemplateSet, new_domain, read_domain

    doc = new_domain(DomainSpec(name="big", memory_bytes=2048 * GiB), templates=TemplateSet())
    cpu = etree.SubElement(doc.root, "cpu")  # an Intel vCPU: no AMD 1 TiB hole question
    model = etree.SubElement(cpu, "model", vendor_id="GenuineIntel")  # what QEMU is told
    model.text = "Skylake-Client"
    big = read_domain(doc.to_bytes()).guest_ram
    small = new_domain(DomainSpec(name="s", memory_bytes=512 * MiB), templates=TemplateSet())

    def dma_limit(f, fdid, ram):
        return next(c for c in f.admission(fdid, "gamma", ram) if c.name == "dma-limit")

    with cluster.fabric() as f:
        bad = dma_limit(f, 0x10, big)  # a 40-bit GPU
        assert not bad.ok and "40 bits" in bad.detail
        assert dma_limit(f, 0x12, big).ok  # a 64-bit NVMe
        assert dma_limit(f, 0x10, read_domain(small.to_bytes()).guest_ram).ok


class RefusingGuest(IdleGuest):
    """The guest (QEMU's device_add) refuses the hot-plug."""

    def on_device_added(self, name: str, device_xml: bytes) -> None:
        raise UnsupportedOperationError("attach device to", name, "device_add failed in QEMU")


def test_hypervisor_refusing_the_hotplug_undoes_borrow_and_mdev(cluster):
    cluster.define("gamma", "vm1", running=True)
    hv = cluster.hv("gamma", guest=RefusingGuest())
    before = cluster.snapshot()
    with cluster.fabric() as f:
        plan = plan_attach(hv, f, "vm1", 0x10, live=False, config=False)
        assert plan.ok
        steps: list[str] = []
        with pytest.raises(FabricError) as e:
            apply_attach(hv, f, plan, steps.append)
    assert str(e.value) == (
        "cannot attach device 0x10 to VM 'vm1': attach device to vm1 refused:"
        " device_add failed in QEMU; nothing was changed"
    )
    assert "\n" not in str(e.value)
    assert cluster.snapshot() == before
    assert any(s.startswith("undo mdev") for s in steps)
    assert any(s.startswith("undo reserve 0x10") for s in steps)


def test_a_late_failure_unplugs_the_hostdev_and_returns_the_device(cluster):
    cluster.define("gamma", "vm1", [0x12], running=True)
    hv = MetadataFails(cluster.hv("gamma"))
    before = cluster.snapshot()
    with cluster.fabric() as f:
        plan = plan_attach(hv, f, "vm1", 0x10, live=True, config=True)
        with pytest.raises(FabricError, match="metadata refused; nothing was changed"):
            apply_attach(hv, f, plan, lambda _m: None)
    assert cluster.snapshot() == before
    assert cluster.holds() == {0x12: "gamma/vm1"}  # the VM's other device is untouched


# --- detach ----------------------------------------------------------------------------------


def test_live_detach_unplugs_and_returns_the_device(cluster):
    cluster.define("gamma", "vm1", [0x12], running=True)
    assert cluster.cli("attach", "vm1", "0x10", *GAMMA).exit_code == 0
    r = cluster.cli("detach", "vm1", "0x10", *GAMMA)
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == (
        "detached device 0x10 from VM 'vm1' (live); device returned to the fabric"
    )
    assert cluster.holds() == {0x12: "gamma/vm1"}
    assert {f for _u, f in cluster.mdevs()} == {0x12}
    live = cluster.hv("gamma").xml("vm1")
    assert metadata_fdids(live) == ["0x12"] and len(hostdev_uuids(live)) == 1


def test_detach_of_the_last_device_removes_the_metadata(cluster):
    cluster.define("gamma", "vm1", running=True)
    assert cluster.cli("attach", "vm1", "0x10", *GAMMA).exit_code == 0
    r = cluster.cli("detach", "vm1", "0x10", "--json", *GAMMA)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {
        "format": "vmlend/1",
        "vm": "vm1",
        "fdid": "0x10",
        "targets": ["live"],
        "returned": True,
    }
    assert b"vmlend" not in cluster.hv("gamma").xml("vm1")
    assert cluster.holds() == {}


def test_config_detach_keeps_the_running_vm_holding_it(cluster):
    cluster.define("gamma", "vm1", [0x10], running=True)
    r = cluster.cli("detach", "vm1", "0x10", "--config", *GAMMA)
    assert r.exit_code == 0, r.output
    hv = cluster.hv("gamma")
    assert metadata_fdids(hv.xml("vm1", inactive=True)) == []
    assert metadata_fdids(hv.xml("vm1")) == ["0x10"]
    assert cluster.holds() == {0x10: "gamma/vm1"}  # still in use by the running guest
    hv.shutdown("vm1", 5)
    hv.start("vm1")
    assert cluster.holds() == {}


def test_detach_of_a_device_not_attached_is_one_line(cluster):
    cluster.define("gamma", "vm1", [0x12], running=True)
    before = cluster.snapshot()
    line = one_line(cluster.cli("detach", "vm1", "0x10", *GAMMA))
    assert line == (
        "Error: device 0x10 is not attached to VM 'vm1' (live); 'vmlend status' lists its devices"
    )
    assert cluster.snapshot() == before
    line = one_line(cluster.cli("detach", "ghost", "0x10", *GAMMA))
    assert "no domain 'ghost'" in line


def test_sim_hook_command_passes_state_and_node_before_libvirts_argv(tmp_path):
    from vmlend.hook.__main__ import split_options
    from vmlend.wiring.hypervisor import hook_command

    cmd = hook_command(tmp_path / "s.db", "beta")
    assert cmd[1:3] == ["-m", "vmlend.hook"]
    env: dict[str, str] = {"VMLEND_NODE": "gamma"}
    argv = split_options([*cmd[3:], "vm1", "prepare", "begin", "-"], env)
    assert argv == ["vm1", "prepare", "begin", "-"]
    assert env == {"VMLEND_STATE": str(tmp_path / "s.db"), "VMLEND_NODE": "beta"}
    assert split_options(["vm1", "--state", "x"], {}) == ["vm1", "--state", "x"]
    # the backend the CLI chose reaches the simulated node's hook too
    env = {}
    split_options([*hook_command(tmp_path / "s.db", "beta", "sim")[3:], "vm1"], env)
    assert env["VMLEND_BACKEND"] == "sim"


def test_detach_finishes_returning_a_device_an_interrupted_detach_left_held(cluster):
    cluster.define("gamma", "vm1", running=True)
    assert cluster.cli("attach", "vm1", "0x10", *GAMMA).exit_code == 0
    hv = cluster.hv("gamma")
    live = hv.xml("vm1")
    mdev = hostdev_uuids(live)[0]
    # libvirt unplugged it and the metadata went, but the CLI died before returning it.
    from vmlend.domain import DomainDocument, find_device
    from vmlend.ops.definitions import hostdev_xml

    doc = DomainDocument.parse(live)
    device = find_device(doc, 0x10)
    assert device is not None
    hv.detach_device("vm1", hostdev_xml(doc, device), live=True, config=False)
    hv.set_metadata("vm1", "http://vmlend.org/xmlns/domain/1.0", "vmlend", None, True, False)
    assert cluster.holds() == {0x10: "gamma/vm1"} and cluster.mdevs() == {(mdev, 0x10)}
    r = cluster.cli("detach", "vm1", "0x10", *GAMMA)
    assert r.exit_code == 0, r.output
    assert "no longer attached" in r.stdout
    assert cluster.holds() == {} and cluster.mdevs() == set()
    assert "not attached" in one_line(cluster.cli("detach", "vm1", "0x10", *GAMMA))
