"""``vmlend fabric discover`` against a fake SmartIO driver under a private host root, with a
private SQLite state: what it found, what it merged, and what it refuses."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from tests.support.fake_sysfs import FakeSmartio, FakeSysfs, populate_smartio
from vmlend.cli import main
from vmlend.registry import SqliteRegistry
from vmlend.topology.model import Holder
from vmlend.topology.parse import parse_topology
from vmlend.wiring.fabric import default_topology_text, open_fabric


@pytest.fixture
def run(state_path, monkeypatch):
    monkeypatch.delenv("VMLEND_NODE", raising=False)

    def invoke(*args: str):
        return CliRunner().invoke(main, list(args))

    return invoke


@pytest.fixture
def fake(tmp_path):
    """The host root every command sees ($VMLEND_ROOT is the test's directory)."""
    return FakeSysfs(tmp_path)


def one_line_error(r) -> str:
    assert r.exit_code == 1, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.output, r.output
    return lines[0]


def topology(state_path):
    with open_fabric(state_path, backend="sim") as f:
        return f.topology()


def new_host(fake) -> FakeSmartio:
    """Node 7: an NVMe drive and an unlent GPU, one adapter cabled to node 4's adapter 0."""
    s = FakeSmartio(fake, node_id=7)
    s.add_adapter(0, peer=(4, 0))
    s.add_device(0x70, 7, bdf="0000:05:00.0")
    s.add_device(0x71, 7, bdf="0000:06:00.0", class_code=0x030200, availability="unlent")
    s.add_device(0x10, 4)  # another node's
    return s


def test_a_first_host_creates_the_state_and_a_second_run_merges_nothing(run, fake, state_path):
    new_host(fake)
    r = run("--node", "delta", "fabric", "discover")
    assert r.exit_code == 0, r.output
    out = r.output.splitlines()
    assert out[0].startswith("found: node id 7 (delta), hostname ")
    assert "1 adapter, 2 devices installed here, 1 of other nodes" in out[0]
    assert out[1] == (
        "  adapter 0: PXH830, window 128GiB in 32 segments, 32 LUT entries;"
        " cable to node id 4 adapter 0"
    )
    assert "  device 0x71: gpu 0000:06:00.0 8086:0a54 on adapter 0, unlent" in out
    assert "added adapter delta:0: PXH830, window 128GiB in 32 segments, 32 LUT entries" in out
    assert "added device 0x70: nvme 0000:05:00.0 8086:0a54" in out
    assert any(line.startswith("note: not merged: adapter delta:0's cable leads to node id 4")
               for line in out)  # fmt: skip
    assert out[-1] == f"created: 4 changes in {state_path} (this host is node delta)"
    topo = topology(state_path)
    assert [n.name for n in topo.nodes] == ["delta"]
    assert [(d.fdid, d.kind, d.lent) for d in topo.devices] == [
        (0x70, "nvme", True), (0x71, "gpu", False),
    ]  # fmt: skip
    with SqliteRegistry.open(state_path) as reg, reg.read() as tx:
        rec = tx.topology()
    assert rec.local_node == "delta" and rec.source == "<fabric discover on delta>"
    assert parse_topology(rec.text, rec.source) == topo  # the stored text is the topology

    again = run("--node", "delta", "fabric", "discover", "--json")
    assert again.exit_code == 0, again.output
    data = json.loads(again.stdout)
    assert (data["action"], data["changes"], data["node"]) == ("unchanged", [], "delta")
    assert data["found"]["devices"][1] == {
        "fdid": "0x71", "adapter": 0, "bdf": "0000:06:00.0", "kind": "gpu", "vendor": "0x8086",
        "device": "0x0a54", "class": "0x030200", "dma_bits": 64, "physfn": None, "lent": False,
    }  # fmt: skip


def test_dry_run_creates_no_state(run, fake, state_path):
    new_host(fake)
    r = run("--node", "delta", "fabric", "discover", "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["action"] == "would create" and len(data["changes"]) == 4
    assert not state_path.exists()
    text = run("--node", "delta", "fabric", "discover", "--dry-run").output
    assert "would be added device 0x70: nvme 0000:05:00.0 8086:0a54" in text
    assert not state_path.exists()


@pytest.fixture
def gamma(run, fake, state_path):
    """The shipped cluster in the state; this host is gamma (node 12), whose driver lists
    the fabric's devices, gamma's two adapters on their switches and a drive of its own."""
    assert run("fabric", "init", "--node", "gamma").exit_code == 0
    s = FakeSmartio(fake, node_id=12)
    populate_smartio(s, parse_topology(*default_topology_text()))
    s.add_adapter(0, switch_port=2)
    s.add_adapter(1, switch_port=0)
    s.add_device(0x40, 12, bdf="0000:05:00.0")
    return s


def test_a_known_host_gets_its_new_device_and_keeps_the_states_records(run, gamma, state_path):
    with SqliteRegistry.open(state_path) as reg:
        reg.transact(lambda tx: (tx.set_lent(0x20, False), tx.set_node_up("beta", False, "fan")))
    r = run("fabric", "discover", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["action"] == "merged" and data["node"] == "gamma" and not data["new_node"]
    assert data["changes"] == [
        {"what": "device", "subject": "0x40", "action": "added",
         "detail": "nvme 0000:05:00.0 8086:0a54"},
    ]  # fmt: skip
    assert data["found"]["remote_devices"] == 9 and data["notes"] == []
    topo = topology(state_path)
    assert topo.device(0x40).lender == "gamma" and len(topo.devices) == 10
    assert topo.switch_links == (("mxs824", "mxs824b"),)  # the file's switches stay
    with SqliteRegistry.open(state_path) as reg, reg.read() as tx:
        assert not tx.device(0x20).lent and tx.device(0x40).lent
        assert not tx.node("beta").up and tx.node("beta").why == "fan"
        assert tx.topology().local_node == "gamma"
    r = run("fabric", "discover")
    assert r.exit_code == 0 and r.output.splitlines()[-1].startswith("unchanged: ")


def test_a_device_id_another_node_has_is_a_conflict(run, gamma):
    gamma.add_device(0x99, 12, bdf="0000:07:00.0")
    # the fabric's 0x10 is alpha's in the topology; say it is installed here
    (gamma.base / "smartio-10" / "lender_node_id").write_text("12\n")
    line = one_line_error(run("fabric", "discover"))
    assert "1 conflict between the SmartIO driver and the topology, nothing merged:" in line
    assert "device 0x10: the driver says it is installed here (gamma 0000:41:00.0)" in line


def test_new_devices_merge_beside_holds_which_stay(run, gamma, state_path):
    with open_fabric(state_path, backend="sim") as f:
        f.reserve(0x10, Holder("gamma", "vm1"))
    r = run("fabric", "discover")
    assert r.exit_code == 0, r.output
    assert "added device 0x40: nvme 0000:05:00.0 8086:0a54" in r.output
    with open_fabric(state_path, backend="sim") as f:
        assert f.topology().has_device(0x40)
        held = {st.fdid: st.holder for st in f.devices() if st.holder is not None}
    assert held == {0x10: Holder("gamma", "vm1")}


def test_what_is_in_use_is_not_described_anew(run, gamma, state_path):
    assert run("fabric", "discover").exit_code == 0
    with open_fabric(state_path, backend="sim") as f:
        f.reserve(0x40, Holder("gamma", "vm1"))
        f.reserve(0x10, Holder("gamma", "vm1"))
    (gamma.base / "smartio-40" / "dma_bits").write_text("40\n")
    for index in (0, 1):
        (gamma.base / f"adapter{index}" / "lut_entries").write_text("64\n")
    dry = json.loads(run("fabric", "discover", "--dry-run", "--json").stdout)
    assert dry["action"] == "would merge" and len(dry["changes"]) == 3
    line = one_line_error(run("fabric", "discover"))
    assert (
        "cannot describe anew what is in use: device 0x40 is held by gamma/vm1, adapter gamma:"
        in line
    )
    assert "has claims; stop those VMs first, nothing merged" in line
    assert topology(state_path).device(0x40).dma_bits == 64
    with open_fabric(state_path, backend="sim") as f:
        f.release(0x40, Holder("gamma", "vm1"))
        f.release(0x10, Holder("gamma", "vm1"))
    r = run("fabric", "discover")
    assert r.exit_code == 0 and "updated device 0x40: dma_bits 64 -> 40" in r.output


def test_without_the_driver_it_says_what_to_load(run, fake):
    line = one_line_error(run("fabric", "discover"))
    assert "the SmartIO driver is not loaded" in line and "'modprobe smartio'" in line


def test_a_damaged_adapter_is_named(run, gamma, fake):
    (gamma.base / "adapter1" / "segments").write_text("3\n")
    line = one_line_error(run("fabric", "discover"))
    assert "adapter1/segments" in line and "power of two" in line


def test_a_node_name_that_is_not_the_drivers_node_is_a_conflict(run, gamma):
    line = one_line_error(run("--node", "alpha", "fabric", "discover"))
    assert "this host is node alpha" in line and "node id 12 is gamma's" in line
