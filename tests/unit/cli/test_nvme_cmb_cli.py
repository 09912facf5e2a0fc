"""``vmlend nvme share --cmb`` and ``vmlend nvme path``: each share's submission queues in an
extent of the drive's controller memory buffer, claimed at reserve and returned at release, and
the route of a command fetch with and without it."""

from __future__ import annotations

import json

from tests.support.cli_cluster import make_cluster


def test_extents_are_claimed_refused_when_full_and_returned(state_path):
    c = make_cluster(state_path)
    r = c.cli("nvme", "share", "0x12", "--size", "2G", "--cmb", "128K")
    assert r.exit_code == 0 and "128K CMB for queues" in r.output, r.output
    assert c.cli("nvme", "reserve", "0x12", "web", "--size", "64M").exit_code == 0
    assert c.cli("nvme", "reserve", "0x12", "db", "--node", "beta", "--size", "64M").exit_code == 0
    # 64 KiB per queue pair: the CMB is full
    r = c.cli("nvme", "reserve", "0x12", "cache", "--size", "64M")
    assert r.exit_code == 1, r.output
    (line,) = r.output.strip().splitlines()
    assert "controller memory buffer has no room" in line and "release a share" in line
    table = c.cli("nvme", "status").output
    assert "CMB" in table and "0x0+64K" in table and "0x10000+64K" in table
    data = json.loads(c.cli("nvme", "status", "--json").output)
    assert data["drives"][0]["cmb_bytes"] == 131072
    shares = {s["vm"]: s for s in data["drives"][0]["shares"]}
    assert sorted(shares) == ["db", "web"]  # the refused share left nothing
    assert shares["web"]["cmb"] == {"offset": 0, "bytes": 65536}
    assert shares["db"]["cmb"] == {"offset": 65536, "bytes": 65536}
    assert "share returned" in c.cli("nvme", "release", "0x12", "web").output
    assert c.cli("nvme", "reserve", "0x12", "cache", "--size", "64M").exit_code == 0
    data = json.loads(c.cli("nvme", "status", "--json").output)
    shares = {s["vm"]: s for s in data["drives"][0]["shares"]}
    assert shares["cache"]["cmb"] == {"offset": 0, "bytes": 65536}  # web's, free again


def test_path_shows_a_cmb_fetch_crossing_no_ntb(state_path):
    c = make_cluster(state_path)
    assert c.cli("nvme", "share", "0x12", "--cmb", "1M").exit_code == 0
    assert c.cli("nvme", "reserve", "0x12", "web", "--size", "64M").exit_code == 0
    r = c.cli("nvme", "path", "web")
    assert r.exit_code == 0, r.output
    assert "submission queues in the drive's CMB on alpha" in r.output
    assert "fetch:      4 hops, 0 NTB crossing(s), 414 ns one way, 828 ns per fetch" in r.output
    assert "completion: 11 hops, 1 NTB crossing(s)" in r.output
    data = json.loads(c.cli("nvme", "path", "web", "--json").output)
    (share,) = data["shares"]
    assert share["sq"] == "cmb" and share["cmb"] == {"offset": 0, "bytes": 65536}
    assert share["fetch"]["ntb_crossings"] == 0 and share["fetch"]["round_trip_ns"] == 828
    assert share["completion"]["ntb_crossings"] == 1


def test_path_of_a_share_without_cmb_crosses_the_ntb(state_path):
    c = make_cluster(state_path)
    assert c.cli("nvme", "share", "0x12").exit_code == 0
    assert c.cli("nvme", "reserve", "0x12", "web", "--size", "64M").exit_code == 0
    data = json.loads(c.cli("nvme", "path", "web", "--json").output)
    (share,) = data["shares"]
    assert share["sq"] == "guest-ram" and share["cmb"] is None
    assert (share["fetch"]["hops"], share["fetch"]["ntb_crossings"]) == (11, 1)
    assert share["fetch"]["round_trip_ns"] == 2 * share["fetch"]["latency_ns"]
    assert "in guest RAM on gamma" in c.cli("nvme", "path", "web").output


def test_refusals(state_path):
    c = make_cluster(state_path)
    r = c.cli("nvme", "share", "0x12", "--cmb", "1000B")
    assert r.exit_code == 1 and "--cmb" in r.output and len(r.output.strip().splitlines()) == 1
    assert c.cli("nvme", "share", "0x12").exit_code == 0
    r = c.cli("nvme", "path", "nobody")
    assert r.exit_code == 1 and "has no share" in r.output, r.output
