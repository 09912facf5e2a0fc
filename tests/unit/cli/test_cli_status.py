"""``vmlend status``: per VM its devices and data-path records, per adapter LUT/window use."""

from __future__ import annotations

import json

from tests.support.cli_cluster import GAMMA, SimCluster, one_line
from vmlend.domain import mdev_uuid
from vmlend.registry import SqliteRegistry
from vmlend.topology.model import Holder


def rows(text: str) -> list[list[str]]:
    return [ln.split() for ln in text.splitlines()]


def test_text_lists_devices_state_mdev_and_adapters(cluster):
    cluster.define("gamma", "vm1", [0x10, 0x12], running=True)
    cluster.define("gamma", "idle", [0x20])
    uuid = cluster.hv("gamma").lookup("vm1").uuid
    with cluster.fabric() as f:
        f.borrow(0x10, Holder("gamma", "vm1", uuid))  # the guest enabled it
    r = cluster.cli("status", *GAMMA)
    assert r.exit_code == 0, r.output
    table = rows(r.stdout)
    assert table[0] == [
        "VM",
        "NODE",
        "VM",
        "STATE",
        "FDID",
        "STATE",
        "MDEV",
        "INTERRUPTS",
        "DMA",
        "VECTORS",
        "P2P",
        "PATH",
    ]
    m10, m12 = (str(mdev_uuid(uuid, f)) for f in (0x10, 0x12))
    # alpha's GPU and NVMe, in its expansion chassis: chassis switch, its link adapter, the host
    # link adapter, alpha's root complex, back down those three, alpha's NTB adapter, the
    # cluster switch, gamma's adapter, gamma's root complex (the count of `vmlend path`); the
    # latency its elements add one way: 2 x (150 + 132 + 132) + 350 (NTB) + 170 (PM8536)
    path = "11h/2rc/1348ns"
    # MSI/MSI-X over alpha's NTB: both have MSI-X and the window had room (the default)
    ntb = "ntb(alpha:0)"
    assert ["vm1", "gamma", "running", "0x10", "borrowed", m10, ntb, "-", "-", "-", path] in table
    assert ["vm1", "gamma", "running", "0x12", "reserved", m12, ntb, "-", "-", "-", path] in table
    idle = [row for row in table if row and row[0] == "idle"]
    assert idle and idle[0][2:6] == ["shut", "off", "0x20", "not"]  # virsh's words; "not held"
    assert ["ADAPTER", "LUT", "USED", "WINDOW", "USED", "SEGMENTS"] in table
    gamma = next(row for row in table if row and row[0] == "gamma:0")
    assert gamma[1] == "2/30"  # one LUT entry per borrowed device
    alpha = next(row for row in table if row and row[0] == "alpha:0")
    # vm1's DMA window and its interrupt window, each one 4G segment counted once
    assert alpha[1] == "2/30" and alpha[2] == "8G/128G"


def test_runtime_records_are_shown(cluster):
    cluster.define("gamma", "vm1", [0x10], running=True)
    with SqliteRegistry.open(cluster.state_path) as reg, reg.write() as tx:
        tx.put_runtime(0x10, "dma-window", "low", {"start": 0, "end": 0x20000000})
        tx.put_runtime(0x10, "irq-vector", "msix.0", {"eventfd": 7})
        tx.put_runtime(0x10, "irq-vector", "msix.1", {"eventfd": 8})
        tx.put_runtime(0x10, "p2p-map", "0x12", {"gpa": 0xC0000000})
    r = cluster.cli("status", "vm1", *GAMMA)
    assert r.exit_code == 0, r.output
    row = next(row for row in rows(r.stdout) if row and row[0] == "vm1")
    assert row[-4:] == ["low:0x0-0x20000000", "msix.0,msix.1", "0x12", "11h/2rc/1348ns"]
    data = json.loads(cluster.cli("status", "vm1", "--json", *GAMMA).stdout)
    dev = data["vms"][0]["devices"][0]
    assert dev["dma_windows"] == [{"key": "low", "start": 0, "end": 0x20000000}]
    assert [v["key"] for v in dev["irq_vectors"]] == ["msix.0", "msix.1"]
    assert dev["p2p_maps"] == [{"key": "0x12", "gpa": 0xC0000000}]
    assert dev["dma_path"] == {
        "hops": 11,
        "roots": 2,
        "ntb_crossings": 1,
        "latency_ns": 1348,
        "added_ns": 350,
    }
    shown = json.loads(cluster.cli("path", "0x10", "gamma", "--json").stdout)
    assert {k: shown[k] for k in dev["dma_path"]} == dev["dma_path"]


def test_json(cluster):
    cluster.define("gamma", "vm1", [0x21], running=True)
    r = cluster.cli("status", "--json", *GAMMA)
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["node"] == "gamma"
    (vm,) = data["vms"]
    assert (vm["name"], vm["node"], vm["state"]) == ("vm1", "gamma", "running")
    (dev,) = vm["devices"]
    assert dev["fdid"] == "0x21" and dev["state"] == "reserved"
    assert dev["holder"] == "gamma/vm1" and dev["mdev_present"] is True
    assert dev["dma_windows"] == dev["irq_vectors"] == dev["p2p_maps"] == []
    by_ref = {a["adapter"]: a for a in data["adapters"]}
    assert set(by_ref) == {"alpha:0", "beta:0", "gamma:0", "gamma:1"}
    assert by_ref["beta:0"]["lut_used"] == 1 and by_ref["beta:0"]["lut_usable"] == 30
    assert by_ref["gamma:0"]["window_used"] > 0


def test_a_vms_state_is_said_in_virshs_words_by_every_command(cluster):
    cluster.define("gamma", "idle", [0x20])
    cluster.define("gamma", "busy", [0x21], running=True)
    status = json.loads(cluster.cli("status", "--json", *GAMMA).stdout)
    listed = json.loads(cluster.cli("vm", "list", "--all", "--json", *GAMMA).stdout)
    by_status = {vm["name"]: vm["state"] for vm in status["vms"]}
    by_list = {vm["name"]: vm["state"] for vm in listed["vms"]}
    assert by_status == by_list == {"idle": "shut off", "busy": "running"}
    assert cluster.cli("vm", "domstate", "idle", *GAMMA).stdout.strip() == "shut off"


def test_vms_known_only_from_the_fabric(cluster):
    cluster.define("beta", "far", [0x10], running=True)
    r = cluster.cli("status", "--json", *GAMMA)
    data = json.loads(r.stdout)
    (vm,) = data["vms"]
    assert (vm["name"], vm["node"], vm["state"]) == ("far", "beta", "on beta")
    assert vm["devices"][0]["state"] == "reserved"
    r = cluster.cli("status", "far", *GAMMA)  # by name, though gamma's hypervisor lacks it
    assert r.exit_code == 0 and "far" in r.stdout


def test_no_vms(cluster):
    r = cluster.cli("status", *GAMMA)
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("no VMs with remote devices")


def test_unknown_vm_is_one_line(cluster):
    line = one_line(cluster.cli("status", "ghost", *GAMMA))
    assert line == "Error: no domain 'ghost' on sim:///gamma; 'vmlend status' lists the VMs"


def test_without_state_says_init(tmp_path, monkeypatch):
    monkeypatch.delenv("LIBVIRT_DEFAULT_URI", raising=False)
    cluster = SimCluster(tmp_path / "none.db")
    line = one_line(cluster.cli("status", *GAMMA))
    assert "vmlend fabric init" in line


def test_devices_of_the_definition_show_as_at_next_start(cluster):
    cluster.define("gamma", "vm1", [0x10], running=True)
    assert cluster.cli("attach", "vm1", "0x12", "--config", *GAMMA).exit_code == 0
    data = json.loads(cluster.cli("status", "vm1", "--json", *GAMMA).stdout)
    states = [(d["fdid"], d["state"]) for d in data["vms"][0]["devices"]]
    assert states == [("0x10", "reserved"), ("0x12", "at next start")]


def test_switch_ports_in_use_are_shown_with_their_tables_size(cluster):
    # two VMs of gamma borrow across the cluster switch: alpha's and beta's devices each hold
    # an entry on their lender's port, and both on gamma's
    cluster.define("gamma", "vm1", [0x10], running=True)
    cluster.define("gamma", "vm2", [0x21], running=True)
    r = cluster.cli("status", *GAMMA)
    assert r.exit_code == 0, r.output
    table = rows(r.stdout)
    assert ["SWITCH", "PORT", "REQUESTERS", "USED"] in table
    ports = [row for row in table if row and row[0].startswith("mxs824/")]
    # fullest first; a port nobody crosses (mxs824/mxs824b) is not shown
    assert ports == [
        ["mxs824/gamma:0", "2/256"],
        ["mxs824/alpha:0", "1/256"],
        ["mxs824/beta:0", "1/256"],
    ]
    data = json.loads(cluster.cli("status", "--json", *GAMMA).stdout)
    assert data["ports"] == [
        {"switch": "mxs824", "port": "mxs824/alpha:0", "used": 1, "capacity": 256},
        {"switch": "mxs824", "port": "mxs824/beta:0", "used": 1, "capacity": 256},
        {"switch": "mxs824", "port": "mxs824/gamma:0", "used": 2, "capacity": 256},
    ]


def test_no_switch_port_in_use_shows_no_port_table(cluster):
    r = cluster.cli("status", *GAMMA)
    assert r.exit_code == 0, r.output
    assert "SWITCH PORT" not in r.stdout
    assert json.loads(cluster.cli("status", "--json", *GAMMA).stdout)["ports"] == []
