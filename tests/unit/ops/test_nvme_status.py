"""``vmlend status`` shows each VM's NVMe shares (queue pairs, LBA window, real queue ids,
doorbell mode, guard rejections), in text and ``--json``, beside its borrowed devices."""

from __future__ import annotations

import json

from tests.support.cli_cluster import GAMMA, SimCluster
from tests.support.nvme_guest import share_xml
from vmlend.ledger import nvmeshares as ledger
from vmlend.registry import SqliteRegistry
from vmlend.topology.model import MiB

NVME = 0x12


def test_status_shows_each_vms_nvme_shares(cluster: SimCluster):
    assert cluster.cli("nvme", "share", "0x12", "--size", "1G").exit_code == 0
    hv = cluster.hv("gamma")
    hv.define(share_xml("web", 2, 64 * MiB, also=(0x10,), virt_type="qemu"))
    hv.start("web")  # the hook claims the share and borrows the GPU
    r = cluster.cli("nvme", "reserve", "0x12", "db", "--node", "beta", "--size", "32M")
    assert r.exit_code == 0, r.output
    with SqliteRegistry.open(cluster.state_path) as reg:
        ((_, _, entries),) = ledger.shared_drives(reg).values()
        web = next(e for e in entries if e.holder.vm == "web")
        ledger.record_usage(reg, NVME, web.share.name, [web.share.real_qid(1)], 3)

    data = json.loads(cluster.cli("status", "--json", *GAMMA).stdout)
    vms = {v["name"]: v for v in data["vms"]}
    (share,) = vms["web"]["nvme_shares"]
    assert share["fdid"] == "0x12" and share["queue_pairs"] == 2
    assert (share["lba_offset"], share["blocks"]) == (0, 64 * MiB // 512)
    assert share["real_queues"] == [web.share.real_qid(1)] and share["doorbells"] == "trap"
    assert share["guard_rejections"] == 3
    # the drive is the manager's, not web's: only the GPU is among web's devices
    assert [d["fdid"] for d in vms["web"]["devices"]] == ["0x10"]
    # a VM known only from its share (another node's) is shown too
    assert vms["db"]["state"] == "on beta" and vms["db"]["devices"] == []
    assert vms["db"]["nvme_shares"][0]["lba_offset"] == 64 * MiB // 512

    text = cluster.cli("status", *GAMMA).stdout
    line = next(ln.split() for ln in text.splitlines() if ln.startswith("web") and "0x12" in ln)
    assert line == [
        "web",
        "gamma",
        "0x12",
        "2",
        "0+131072",
        "(64M)",
        str(web.share.real_qid(1)),
        "trap",
        "3",
    ]
    assert "REJECTED" in text and "db" in cluster.cli("status", "db", *GAMMA).stdout


def test_status_without_shares_has_no_share_table(cluster: SimCluster):
    cluster.define("gamma", "plain", [0x10], running=True)
    r = cluster.cli("status", *GAMMA)
    assert r.exit_code == 0 and "REJECTED" not in r.stdout
    (vm,) = json.loads(cluster.cli("status", "--json", *GAMMA).stdout)["vms"]
    assert vm["nvme_shares"] == []
