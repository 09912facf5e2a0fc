"""``vmlend nvme``: share a drive, claim and return VM shares, status and --json."""

from __future__ import annotations

import json

import pytest

from tests.support.cli_cluster import make_cluster


def test_share_reserve_status_release_unshare(state_path):
    c = make_cluster(state_path)
    r = c.cli("nvme", "share", "0x12", "--size", "2G")
    assert r.exit_code == 0, r.output
    assert "511 queue pairs" in r.output and "trap doorbells" in r.output
    assert c.holds()[0x12] == "alpha/nvme-manager"
    r = c.cli("nvme", "reserve", "0x12", "web", "--queues", "2", "--size", "64M")
    assert r.exit_code == 0, r.output
    assert "gamma/web: 2 queue pair(s)" in r.output
    assert c.cli("nvme", "reserve", "0x12", "db", "--node", "beta", "--size", "1G").exit_code == 0
    r = c.cli("nvme", "status")
    assert r.exit_code == 0
    assert "gamma/web" in r.output and "0+131072 (64M)" in r.output and "beta/db" in r.output
    data = json.loads(c.cli("nvme", "status", "--json").output)
    assert data["format"] == "vmlend/1"
    (drive,) = data["drives"]
    assert drive["fdid"] == "0x12" and drive["doorbells"] == "trap"
    shares = {s["vm"]: s for s in drive["shares"]}
    assert shares["web"]["queue_pairs"] == 2 and shares["web"]["guard_rejections"] == 0
    assert shares["db"]["lba_offset"] == 131072
    # the fabric-wide status shows the manager holding the drive
    r = c.cli("status", "--connect", "sim:///gamma")
    assert r.exit_code == 0 and "nvme-manager" in r.output, r.output
    r = c.cli("nvme", "unshare", "0x12")
    assert r.exit_code == 1 and "still has 2 share(s)" in r.output
    assert "share returned" in c.cli("nvme", "release", "0x12", "web").output
    assert "share returned" in c.cli("nvme", "release", "0x12", "db", "--node", "beta").output
    assert "no longer shared" in c.cli("nvme", "unshare", "0x12").output
    assert 0x12 not in c.holds()


def test_refusals_are_one_line_errors(state_path):
    c = make_cluster(state_path)
    r = c.cli("nvme", "reserve", "0x12", "web", "--size", "64M")
    assert r.exit_code == 1 and "not lent for sharing" in r.output
    r = c.cli("nvme", "share", "0x10")
    assert r.exit_code == 1 and "not an NVMe controller" in r.output
    assert c.cli("nvme", "share", "0x12", "--size", "1M").exit_code == 0
    r = c.cli("nvme", "reserve", "0x12", "web", "--size", "2M")
    assert r.exit_code == 1 and "LBA space" in r.output
    r = c.cli("nvme", "reserve", "0x12", "web", "--size", "1000B")
    assert r.exit_code == 1 and "multiple of 512" in r.output
    r = c.cli("nvme", "reserve", "0x12", "web", "--queues", "40", "--size", "64K")
    assert r.exit_code == 1 and "vectors" in r.output
    assert (
        "no drive is shared"
        in make_cluster(state_path.parent / "other.db").cli("nvme", "status").output
    )


def test_reserve_by_hand_claims_the_share_windows_of_the_vms_ram(state_path):
    c = make_cluster(state_path)
    assert c.cli("nvme", "share", "0x12", "--size", "2G").exit_code == 0
    before = json.loads(c.cli("status", "--json", "--connect", "sim:///gamma").output)["adapters"]
    r = c.cli("nvme", "reserve", "0x12", "web", "--size", "64M", "--ram", "300G")
    assert r.exit_code == 1 and "NTB window" in r.output and "share of 0x12" in r.output
    r = c.cli("nvme", "reserve", "0x12", "web", "--size", "64M", "--ram", "8G")
    assert r.exit_code == 0, r.output
    after = json.loads(c.cli("status", "--json", "--connect", "sim:///gamma").output)["adapters"]
    used = {a["adapter"]: a["segments_used"] for a in after}
    assert sum(used.values()) > sum(a["segments_used"] for a in before)
    assert c.cli("nvme", "release", "0x12", "web").exit_code == 0
    back = json.loads(c.cli("status", "--json", "--connect", "sim:///gamma").output)["adapters"]
    assert back == before


def test_a_namespace_of_2_to_the_64_blocks_or_more_is_refused(state_path):
    """NVMe sizes and LBAs are 64-bit: a share (or a shared namespace) that large is refused
    in one line, at the CLI and in domain metadata, before anything is recorded."""
    from vmlend.domain.metadata import NvmeShareRequest
    from vmlend.errors import DomainXMLError

    c = make_cluster(state_path)
    huge = f"{(1 << 64) * 512 >> 40}T"  # exactly 2^64 blocks of 512 bytes
    r = c.cli("nvme", "share", "0x12", "--size", huge)
    assert r.exit_code == 1 and "2^64" in r.output and len(r.output.strip().splitlines()) == 1
    assert "no drive is shared" in c.cli("nvme", "status").output
    assert c.cli("nvme", "share", "0x12", "--size", "1G").exit_code == 0
    r = c.cli("nvme", "reserve", "0x12", "web", "--size", huge)
    assert r.exit_code == 1 and "2^64" in r.output
    with pytest.raises(DomainXMLError, match="2\\^64"):
        NvmeShareRequest(1, (1 << 64) * 512)
    assert NvmeShareRequest(1, ((1 << 64) - 1) * 512).size  # the largest that fits


def test_share_reserve_release_unshare_json_say_what_they_did(state_path):
    c = make_cluster(state_path)

    def doc(*args: str) -> dict[str, object]:
        r = c.cli("nvme", *args, "--json")
        assert r.exit_code == 0, r.output
        data = json.loads(r.stdout)
        assert data.pop("format") == "vmlend/1"
        return data

    shared = doc("share", "0x12", "--size", "2G")
    assert (shared["action"], shared["fdid"], shared["doorbells"]) == ("shared", "0x12", "trap")
    assert shared["queue_pairs"] == 511 and shared["blocks"] == 2 * 1024**3 // 512
    reserved = doc("reserve", "0x12", "web", "--queues", "2", "--size", "64M")
    assert reserved == {
        "action": "reserved",
        "fdid": "0x12",
        "vm": "web",
        "node": "gamma",
        "queue_pairs": 2,
        "lba_offset": 0,
        "blocks": 131072,
        "paths": 1,
        "cmb": None,  # the drive was shared without --cmb: its queues stay in guest RAM
    }
    released = {"fdid": "0x12", "vm": "web", "node": "gamma"}
    assert doc("release", "0x12", "web") == {"action": "released", **released}
    assert doc("release", "0x12", "web") == {"action": "unchanged", **released}
    assert doc("unshare", "0x12") == {"action": "unshared", "fdid": "0x12"}
    assert doc("unshare", "0x12") == {"action": "unchanged", "fdid": "0x12"}


def test_reserve_with_a_backup_path(state_path):
    c = make_cluster(state_path)
    assert c.cli("nvme", "share", "0x12", "--size", "2G").exit_code == 0
    r = c.cli("nvme", "reserve", "0x12", "web", "--paths", "2", "--size", "64M", "--ram", "1G")
    assert r.exit_code == 0, r.output
    assert "gamma/web: 1 queue pair(s)" in r.output and "2 paths (primary and backup)" in r.output
    data = json.loads(c.cli("nvme", "status", "--json").output)
    assert data["drives"][0]["shares"][0]["paths"] == 2
    r = c.cli("nvme", "reserve", "0x12", "db", "--node", "beta", "--paths", "2", "--size", "1G")
    assert r.exit_code == 1
    assert "no backup path for beta's share of 0x12: beta has one NTB adapter" in r.output
    assert len(r.output.strip().splitlines()) == 1
    r = c.cli("nvme", "reserve", "0x12", "db", "--node", "beta", "--paths", "3", "--size", "1G")
    assert r.exit_code == 2 and "--paths" in r.output
    r = c.cli(
        "nvme", "reserve", "0x12", "db", "--node", "beta", "--paths", "2", "--size", "1G", "--json"
    )
    assert r.exit_code == 1 and "no backup path" in r.output
    assert "beta/db" not in c.cli("nvme", "status").output
