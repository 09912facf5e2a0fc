"""``xml new --device gpu:2`` and ``attach VM gpu``: devices chosen by kind, said on stderr
with their path's cost, written into the XML like named ones."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.cli_cluster import GAMMA, SimCluster, make_cluster, one_line
from vmlend.domain import read_domain
from vmlend.wiring.fabric import default_topology_text


def test_xml_new_chooses_a_pair_under_one_lender_and_says_so(cluster, tmp_path):
    out = tmp_path / "web.xml"
    r = cluster.cli("xml", "new", "web", "--device", "gpu:2", "--device", "0x21", "-o", str(out))
    assert r.exit_code == 0, r.output
    assert [d.fdid for d in read_domain(out.read_bytes()).devices] == [0x21, 0x10, 0x11]
    said = [ln for ln in r.stderr.splitlines() if ln.startswith("chose ")]
    assert said == [
        "chose 0x10 (gpu on alpha): 1348 ns, 11 hops, 2 root complex(es)",
        "chose 0x11 (gpu on alpha): 1348 ns, 11 hops, 2 root complex(es)",
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


def configure(text: str) -> None:
    """The test's own configuration file (tests/conftest.py: $VMLEND_CONFIG) says ``text``."""
    Path(os.environ["VMLEND_CONFIG"]).write_text(text)


ALIASES = """
[alias]
v100 = { vendor = "10de", product = "1db4" }
i350-vf = { vendor = "0x8086", product = 0x1520 }
"""


def test_xml_new_chooses_by_vendor_and_product_and_by_alias(cluster):
    configure(ALIASES)
    r = cluster.cli(
        "xml", "new", "web", "--device", "vendor=10de,product=1db4,count=2",
        "--device", "i350-vf:2",
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert [d.fdid for d in read_domain(r.stdout.encode()).devices] == [0x10, 0x11, 0x22, 0x23]
    assert "chose 0x22 (vf on beta)" in r.stderr


def test_attach_by_alias_picks_the_neighbour_of_the_vms_devices(cluster):
    configure(ALIASES)
    cluster.define("gamma", "web", [0x21], running=True)
    r = cluster.cli("attach", "web", "v100", *GAMMA)
    assert r.exit_code == 0, r.output
    assert "chose 0x20 (gpu on beta)" in r.stderr and "attached device 0x20" in r.stdout


@pytest.mark.parametrize(
    ("text", "device", "says"),
    [
        ("", "vendor=10de", "give vendor= and product= together"),
        ("", "vendor=10dex,product=1db4", "bad vendor id '10dex'"),
        ("", "a100", "no device kind or alias 'a100' in the fabric (its kinds: gpu, nic"),
        ('[alias]\ngpu = { vendor = "10de", product = "1db4" }\n', "gpu", "rename the alias"),
        (ALIASES, "v100,vendor=10de,product=1db4", "alias 'v100' already names"),
        (ALIASES, "vendor=10de,product=20b0", "no device in the fabric is 10de:20b0"),
    ],
)
def test_a_selector_that_cannot_choose_is_one_line_and_writes_nothing(
    cluster, tmp_path, text, device, says
):
    configure(text)
    out = tmp_path / "web.xml"
    r = cluster.cli("xml", "new", "web", "--device", device, "-o", str(out))
    code = 2 if says.startswith(("give", "bad")) else 1  # the option's own parse: usage error
    line = r.stderr.strip().splitlines()[-1] if code == 2 else one_line(r)
    assert r.exit_code == code and says in line, r.output
    assert not out.exists()


def test_an_alias_that_shadows_a_kind_leaves_the_other_names_working(cluster):
    configure('[alias]\ngpu = { vendor = "10de", product = "20b0" }\n')
    r = cluster.cli("xml", "new", "web", "--device", "nic")
    assert r.exit_code == 0, r.output
    r = cluster.cli("attach", "web", "gpu", *GAMMA)
    assert "alias 'gpu' ([alias] in the configuration file)" in one_line(r)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('[alias]\na100 = { vendor = "10de" }\n', "alias.a100 has no product"),
        ('[alias]\na100 = { vendor = "10de", product = "xyz" }\n', "bad product id 'xyz'"),
        ('alias = "a100"\n', "alias must be a table"),
        ('[alias]\nA100 = { vendor = "10de", product = "20b0" }\n', "alias 'A100' is no name"),
    ],
)
def test_a_bad_alias_table_stops_every_command_naming_the_file(cluster, text, says):
    configure(text)
    r = cluster.cli("devices")
    assert r.exit_code == 1, r.output
    (line,) = r.stderr.strip().splitlines()
    assert os.environ["VMLEND_CONFIG"] in line and says in line


#: The default fabric with a second NVMe drive, on beta.
SECOND_DRIVE = """
  [[node.device]]
  fdid = 0x30
  bdf = "0000:84:00.0"
  slot = "chassis1"
  kind = "nvme"
  vendor = 0x8086
  device = 0x0a54
  class = 0x010802
  bars = [ { index = 0, size = "16KiB", kind = "mem64" } ]
  msix = { vectors = 32, table_bar = 0, table_offset = 0x2000, pba_bar = 0, pba_offset = 0x3000 }
"""


def two_drives(state_path: Path) -> SimCluster:
    text, _ = default_topology_text()
    gamma = text.index('[[node]]\nname = "gamma"')
    return make_cluster(state_path, text[:gamma] + SECOND_DRIVE + "\n" + text[gamma:])


def test_nvme_reserve_chooses_a_shared_drive_with_room_and_finds_its_share_again(state_path):
    c = two_drives(state_path)
    configure('[alias]\np4500 = { vendor = "8086", product = "0a54" }\n')
    assert c.cli("nvme", "share", "0x12", "--size", "1M").exit_code == 0
    # only 0x12 is shared: chosen by kind, ids or alias alike
    for device in ("nvme", "vendor=8086,product=a54", "p4500"):
        r = c.cli("nvme", "reserve", device, f"vm-{device[:4]}", "--size", "64K")
        assert r.exit_code == 0, r.output
        assert "of 0x12" in r.stdout and "chose 0x12 (nvme on alpha)" in r.stderr
    # 0x12 has 1M: a 2M share goes to the next drive, saying why not the first
    assert c.cli("nvme", "share", "0x30", "--size", "1G").exit_code == 0
    r = c.cli("nvme", "reserve", "nvme", "web", "--size", "2M")
    assert r.exit_code == 0, r.output
    assert "not 0x12:" in r.stderr and "LBA space" in r.stderr
    assert "chose 0x30 (nvme on beta)" in r.stderr and "of 0x30, LBAs 0..4095" in r.stdout
    # a re-run finds the VM's own share first, and asks nothing of 0x12
    r = c.cli("nvme", "reserve", "p4500", "web", "--size", "2M")
    assert r.exit_code == 0 and "not 0x12" not in r.stderr and "of 0x30, LBAs 0..4095" in r.stdout
    # no drive with room: the closest one's refusal
    r = c.cli("nvme", "reserve", "nvme", "db", "--size", "2G")
    assert r.exit_code == 1 and r.stderr.strip().splitlines()[-1].startswith("Error:")


def test_nvme_reserve_by_a_selector_no_shared_drive_meets_is_one_line(cluster):
    line = one_line(cluster.cli("nvme", "reserve", "nvme", "web", "--size", "64K"))
    assert "no drive lent for sharing is 'nvme:1' (shared: none)" in line
    assert cluster.cli("nvme", "share", "0x12", "--size", "1M").exit_code == 0
    line = one_line(cluster.cli("nvme", "reserve", "gpu", "web", "--size", "64K"))
    assert "no drive lent for sharing is 'gpu:1' (shared: 0x12)" in line
    r = cluster.cli("nvme", "reserve", "nvme:2", "web", "--size", "64K")
    assert r.exit_code == 2 and "one device at a time" in r.output
