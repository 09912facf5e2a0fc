"""``xml new --device gpu:2`` and ``attach VM gpu``: devices chosen by kind, said on stderr
with their path's cost, written into the XML like named ones."""

from __future__ import annotations

from tests.support.cli_cluster import GAMMA, one_line
from vmlend.domain import read_domain


def test_xml_new_chooses_a_pair_under_one_lender_and_says_so(cluster, tmp_path):
    out = tmp_path / "web.xml"
    r = cluster.cli("xml", "new", "web", "--device", "gpu:2", "--device", "0x21", "-o", str(out))
    assert r.exit_code == 0, r.output
    assert [d.fdid for d in read_domain(out.read_bytes()).devices] == [0x21, 0x10, 0x11]
    said = [ln for ln in r.stderr.splitlines() if ln.startswith("chose ")]
    assert said == [
        "chose 0x10 (gpu on alpha): 11 hops, 2 root complex(es), +360 ns",
        "chose 0x11 (gpu on alpha): 11 hops, 2 root complex(es), +360 ns",
    ]


def test_a_held_device_is_not_chosen(cluster):
    cluster.define("gamma", "busy", [0x10], running=True)
    r = cluster.cli("xml", "new", "web", "--device", "gpu")
    assert r.exit_code == 0, r.output
    assert [d.fdid for d in read_domain(r.stdout.encode()).devices] == [0x11]


def test_too_few_or_unchecked_is_one_line_and_writes_nothing(cluster, tmp_path):
    out = tmp_path / "web.xml"
    line = one_line(cluster.cli("xml", "new", "web", "--device", "gpu:4", "-o", str(out)))
    assert "cannot choose gpu:4 for a VM on gamma: 3 available" in line
    r = cluster.cli("xml", "new", "web", "--device", "gpu", "--no-fabric-check")
    assert r.exit_code == 2 and "drop --no-fabric-check" in r.output
    assert not out.exists()


def test_attach_by_kind_picks_the_neighbour_of_the_vms_devices(cluster):
    cluster.define("gamma", "web", [0x21], running=True)  # beta's NIC
    r = cluster.cli("attach", "web", "gpu", *GAMMA)
    assert r.exit_code == 0, r.output
    assert "chose 0x20 (gpu on beta)" in r.stderr
    assert "attached device 0x20" in r.stdout
    live = read_domain(cluster.hv("gamma").xml("web"))
    assert sorted(d.fdid for d in live.devices) == [0x20, 0x21]
