"""``vmlend demo`` end to end on a temporary state, through click's CliRunner.

Each run starts real hook subprocesses (about 2 s a run), hence ``slow``. One JSON run is shared
by the fact checks; the text run, the re-runs and the failures use their own states.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tests.support.simfabric import small_topology
from vmlend.cli import main
from vmlend.demo import STEPS, run_demo
from vmlend.topology.model import Holder
from vmlend.wiring.fabric import init_fabric, open_fabric

pytestmark = pytest.mark.slow

KEYS = ["fabric", "xml", "start", "enable", "traffic", "hotplug", "migrate", "stop", "nvme-share"]


def invoke(state: Path, *args: str) -> Any:
    return CliRunner().invoke(main, ["--state", str(state), "demo", *args])


def one_line_error(r: Any) -> str:
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output
    lines = r.output.strip().splitlines()
    return lines[-1]


@pytest.fixture(scope="module")
def story(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    state = tmp_path_factory.mktemp("demo") / "state.db"
    r = invoke(state, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    return state, doc


def step(doc: dict[str, Any], key: str) -> dict[str, Any]:
    (s,) = [s for s in doc["steps"] if s["key"] == key]
    return s["data"]


def test_every_step_succeeded_in_order(story):
    _state, doc = story
    assert doc["ok"] is True and doc["error"] is None
    assert [s["key"] for s in doc["steps"]] == KEYS
    assert all(s["ok"] for s in doc["steps"])
    assert [s["n"] for s in doc["steps"]] == list(range(1, 10))


def test_xml_is_accepted_by_libvirts_test_driver(story):
    xml = step(story[1], "xml")
    assert xml["libvirt"]["uri"].startswith("test:///")
    assert xml["libvirt"]["mdevs"] == [d["mdev"] for d in xml["devices"]]
    assert [d["fdid"] for d in xml["devices"]] == ["0x10", "0x20", "0x12"]
    assert xml["ram"] == [[0, 2 << 30], [4 << 30, 10 << 30]]  # q35 with 8 GiB


def test_the_hook_runs_in_libvirts_order_and_borrowing_is_deferred(story):
    start = step(story[1], "start")
    assert [h["argv"][1:] for h in start["hooks"]] == [
        ["prepare", "begin", "-"],
        ["start", "begin", "-"],
        ["started", "begin", "-"],
    ]
    assert all(h["exit"] == 0 and h["node"] == "gamma" for h in start["hooks"])
    assert {d["state"] for d in start["devices"]} == {"reserved"}
    assert all(d["mdev"] and d["mdev_node"] == "gamma" for d in start["devices"])
    assert all(a["lut_entries"] == 0 for a in start["adapters"])  # nothing borrowed yet
    enable = step(story[1], "enable")
    assert {d["state"] for d in enable["devices"]} == {"borrowed"}


def test_two_dma_windows_per_device_exactly_the_ram(story):
    enable = step(story[1], "enable")
    by_device: dict[str, dict[str, Any]] = {}
    for w in enable["windows"]:
        by_device.setdefault(w["fdid"], {})[w["key"]] = w
    assert set(by_device) == {"0x10", "0x12", "0x20"}
    for fdid, ws in by_device.items():
        assert ws["low"]["ranges"] == [[0, 2 << 30]], fdid
        assert ws["high"]["ranges"] == [[4 << 30, 10 << 30]], fdid
        assert ws["low"]["adapter"] == ("beta:0" if fdid == "0x20" else "alpha:0")
        assert ws["high"]["iommu_entries"] == {"1G": 6}


def test_vectors_and_peer_to_peer_maps_are_set_up(story):
    enable = step(story[1], "enable")
    vectors = {v["fdid"]: v for v in enable["vectors"]}
    assert vectors["0x12"]["mode"] == "MSIX" and vectors["0x12"]["vectors"] == 32
    # MSI/MSI-X over the NTB: the default interrupt path, and the windows had room
    assert vectors["0x10"]["mode"] == "MSI"
    assert vectors["0x20"]["path"] == "ntb beta->gamma (no lender software)"
    cases = {(m["source"], m["target"]): m["case"] for m in enable["p2p"]}
    assert cases[("0x10", "0x20")] == cases[("0x20", "0x10")] == "other-lender"
    assert cases[("0x10", "0x12")] == "same-lender"


def test_peer_to_peer_maps_count_hops_as_vmlend_path_does(story):
    state, doc = story
    maps = {(m["source"], m["target"]): m for m in step(doc, "enable")["p2p"]}
    # same lender: the papers' local VM P2P (Table 2); two lenders: one NTB crossing between
    want = {("0x10", "0x12"): (7, 1), ("0x10", "0x20"): (17, 2), ("0x20", "0x10"): (17, 2)}
    for (src, dst), counts in want.items():
        assert (maps[src, dst]["hops"], maps[src, dst]["roots"]) == counts
        r = CliRunner().invoke(main, ["--state", str(state), "path", src, dst, "--json"])
        assert (json.loads(r.output)["hops"], json.loads(r.output)["roots"]) == counts


def test_dma_reaches_the_guest_page_through_the_ntb(story):
    (dma,) = step(story[1], "traffic")["dma"]
    assert dma["match"] is True and dma["bytes"] == 8192
    stages = [h["stage"] for h in dma["target"]["hops"]]
    assert stages == ["device", "lender-iommu", "ntb-segment", "lut", "borrower-iommu", "ram"]
    assert dma["target"]["owner"] == "demo" and dma["target"]["address"] == dma["host_page"]


def test_a_link_down_on_the_drives_path_is_survived_over_gammas_other_adapter(story):
    f = step(story[1], "traffic")["failover"]
    assert (f["link"], f["device"]) == ("mxs824/gamma:0", "0x12")
    assert f["was"] == "alpha:0 -> gamma:0 via mxs824"
    assert f["now"] == "alpha:0 -> gamma:1 via mxs824, mxs824b"
    assert f["dma"]["match"] is True and f["after_up"] == ["recovered"]


def test_peer_writes_land_in_the_right_bar(story):
    writes = step(story[1], "traffic")["p2p"]
    gpu = next(w for w in writes if (w["source"], w["target"]) == ("0x10", "0x20"))
    assert gpu["landed"] is True and gpu["bar"] == 1
    t = gpu["target_hops"]
    assert (t["kind"], t["owner"], t["bar"], t["node"]) == ("bar", "0x20", 1, "beta")
    assert t["crossed_ntb"] is True


def test_pci_hole_faults_at_the_lender_iommu(story):
    fault = step(story[1], "traffic")["fault"]
    assert fault["faulted"] is True and fault["hop"] == "lender-iommu"
    assert 2 << 30 <= fault["gpa"] < 4 << 30


def test_every_interrupt_raised_arrives_once(story):
    for key in ("traffic", "migrate"):
        irqs = step(story[1], key)["interrupts"]
        assert len(irqs) == 3
        for i in irqs:
            assert i["raised"] == i["received"] == 1000, (key, i)
            assert sum(i["per_vector"]) == 1000


def test_hot_added_vf_works_and_its_resources_come_back(story):
    hp = step(story[1], "hotplug")
    assert hp["device"] == "0x22" and all(c["ok"] for c in hp["checks"])
    assert hp["attached"]["state"] == "borrowed" and hp["attached"]["holder"] == "gamma/demo"
    assert {w["key"] for w in hp["windows"]} == {"low", "high"}
    assert hp["dma"]["match"] is True
    assert hp["interrupts"][0]["received"] == 1000
    assert hp["returned"] is True and hp["state_after"] == "available"
    before, added, after = (
        {a["adapter"]: a for a in hp["adapters"][k]} for k in ("before", "attached", "after")
    )
    assert added["beta:0"]["lut_entries"] == before["beta:0"]["lut_entries"] + 1
    assert added["gamma:0"]["lut_claimed"] == before["gamma:0"]["lut_claimed"] + 1
    assert after == before


def test_migrated_vm_uses_local_and_remote_devices_on_alpha(story):
    mig = step(story[1], "migrate")
    assert (mig["from"], mig["to"]) == ("gamma", "alpha")
    ops = [(h["node"], h["argv"][1]) for h in mig["hooks"]]
    assert ops == [
        ("gamma", "stopped"),
        ("gamma", "release"),
        ("alpha", "prepare"),
        ("alpha", "start"),
        ("alpha", "started"),
    ]
    paths = {d["fdid"]: d["path"] for d in mig["devices"]}
    assert paths == {"0x10": "local", "0x12": "local", "0x20": "NTB beta->alpha"}
    assert all(d["holder"] == "alpha/demo" for d in mig["devices"])
    local, remote = mig["dma"]
    assert [h["stage"] for h in local["target"]["hops"]] == ["device", "lender-iommu", "ram"]
    assert remote["target"]["crossed_ntb"] is True and remote["match"] is True
    assert mig["p2p_write"][0]["landed"] is True
    vectors = {i["fdid"]: i["path"] for i in mig["interrupts"]}
    assert vectors == {
        "0x10": "vfio (local)",
        "0x12": "vfio (local)",
        "0x20": "ntb beta->alpha (no lender software)",
    }


def test_everything_is_returned_at_the_end(story):
    stop = step(story[1], "stop")
    assert stop["left"] and all(v == 0 for v in stop["left"].values()), stop["left"]
    assert {d["state"] for d in stop["devices"]} == {"available"}
    assert [h["argv"][1] for h in stop["hooks"]] == ["stopped", "release"]


def test_two_vms_on_two_hosts_share_the_nvme_and_the_guard_rejects_a_stray_command(story):
    share = step(story[1], "nvme-share")
    assert share["fdid"] == "0x12" and share["doorbells"] == "trap"
    assert share["namespace"] == [[1 << 16, 512], [1 << 16, 512]]
    assert [i["vm"] for i in share["io"]] == ["gamma/nvme-a", "beta/nvme-b"]
    assert share["stray"]["status"] == "LBA out of range"
    by_vm = {s["vm"]: s for s in share["shares"]}
    assert by_vm["nvme-a"]["guard_rejections"] == 1 and by_vm["nvme-b"]["guard_rejections"] == 0
    assert by_vm["nvme-a"]["lba_offset"] + (1 << 16) == by_vm["nvme-b"]["lba_offset"]
    assert by_vm["nvme-a"]["real_queues"] and by_vm["nvme-b"]["real_queues"]
    # checked mid-step, with both shares open: their mappings and claims are justified
    assert share["invariant_violations"] == 0


def test_text_report_and_a_second_run_on_the_same_state(story):
    state, _doc = story
    r = invoke(state)
    assert r.exit_code == 0, r.output
    for n in range(1, 10):
        assert f"== {n}. " in r.output
    assert "(outside its window): LBA out of range" in r.output
    assert "unchanged: state" in r.output
    assert "left by an earlier run, removed: undefined demo on alpha" in r.output
    assert "the guest read the same bytes" in r.output
    assert "fault at lender-iommu" in r.output
    assert "Traceback" not in r.output and "{" not in r.output.split("== 2.")[0]


def test_a_run_that_stopped_half_way_is_cleaned_up_by_the_next(tmp_path):
    state = tmp_path / "state.db"
    half = run_demo(state, steps=STEPS[:4])  # the VM is left running on gamma, holding devices
    assert half.ok
    fabric = open_fabric(state)
    assert {st.holder.vm for st in fabric.devices() if st.holder} == {"demo"}
    fabric.close()
    r = invoke(state, "--json")
    assert r.exit_code == 0, r.output
    cleaned = step(json.loads(r.output), "fabric")["cleaned_up"]
    assert "destroyed demo on gamma" in cleaned and "undefined demo on gamma" in cleaned


def test_a_state_with_another_topology_fails_in_one_line(tmp_path):
    state = tmp_path / "state.db"
    init_fabric(state, small_topology(), "small.toml", node="b")
    r = invoke(state)
    line = one_line_error(r)
    assert line.startswith("Error: demo failed at step 1 (fabric):")
    assert "already holds topology 'small'" in line


def test_a_device_held_elsewhere_fails_the_start_and_changes_nothing(tmp_path):
    state = tmp_path / "state.db"
    r = invoke(state, "--json")  # a first run creates the state
    assert r.exit_code == 0, r.output
    fabric = open_fabric(state, "gamma")
    other = Holder("gamma", "other", "00000000-0000-0000-0000-000000000001")
    fabric.reserve(0x20, other)
    try:
        r = invoke(state)
        line = one_line_error(r)
        assert "step 3 (start)" in line and "0x20" in line
        held = {st.fdid: st.holder for st in fabric.devices() if st.holder}
        assert held == {0x20: other}  # the prepare hook undid the others
        assert fabric.mdevs() == []
    finally:
        fabric.release(0x20, other)
        fabric.close()
    r = invoke(state, "--json")
    assert r.exit_code == 0, r.output
