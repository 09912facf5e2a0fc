"""The interrupt path from the command line: ``vmlend xml new|add-device --interrupts``,
``vmlend attach --interrupts``, and ``vmlend status`` saying which path each device's
interrupts take."""

from __future__ import annotations

import json

from lxml import etree

from tests.support.cli_cluster import GAMMA, one_line
from vmlend.domain import read_domain
from vmlend.topology.model import InterruptPath

NS = {"v": "http://vmlend.org/xmlns/domain/1.0"}


def interrupts_attrs(xml: bytes) -> tuple[list[str], list[str]]:
    """(the VM's default, each device's own) as written in the metadata."""
    root = etree.fromstring(xml)
    vm = root.xpath("metadata/v:vmlend/@interrupts", namespaces=NS)
    devices = root.xpath("metadata/v:vmlend/v:device/@interrupts", namespaces=NS)
    assert isinstance(vm, list) and isinstance(devices, list)
    return [str(a) for a in vm], [str(a) for a in devices]


def test_xml_new_sets_the_vms_default_and_add_device_a_devices_own(cluster, tmp_path):
    path = tmp_path / "web.xml"
    r = cluster.cli(
        "xml", "new", "web", "--device", "0x12", "--interrupts", "relay", "-o", str(path)
    )
    assert r.exit_code == 0, r.output
    assert interrupts_attrs(path.read_bytes()) == (["relay"], [])
    before = path.read_bytes()
    r = cluster.cli("xml", "add-device", str(path), "0x10", "--interrupts", "ntb")
    assert r.exit_code == 0, r.output
    assert interrupts_attrs(path.read_bytes()) == (["relay"], ["ntb"])
    info = read_domain(path.read_bytes())
    assert [(d.fdid, info.interrupts_of(d)) for d in info.devices] == [
        (0x12, InterruptPath.RELAY),
        (0x10, InterruptPath.NTB),
    ]
    shown = cluster.cli("xml", "show", str(path))
    assert shown.exit_code == 0, shown.output
    assert [ln.split()[-1] for ln in shown.stdout.splitlines()[1:]] == [
        "INTERRUPTS",
        "relay",
        "ntb",
    ]
    # Removing the device again gives back the file byte for byte.
    assert cluster.cli("xml", "remove-device", str(path), "0x10").exit_code == 0
    assert path.read_bytes() == before


def test_add_device_refuses_to_change_a_present_devices_path(cluster, tmp_path):
    path = tmp_path / "web.xml"
    r = cluster.cli("xml", "new", "web", "--device", "0x12", "-o", str(path))
    assert r.exit_code == 0, r.output
    before = path.read_bytes()
    line = one_line(cluster.cli("xml", "add-device", str(path), "0x12", "--interrupts", "relay"))
    assert "already in the domain with interrupts the VM's default" in line
    assert path.read_bytes() == before


def test_bad_or_pointless_interrupts_options_are_refused(cluster):
    r = cluster.cli("xml", "new", "web", "--device", "0x12", "--interrupts", "msi")
    assert r.exit_code == 2 and "'msi' is not one of 'ntb', 'relay'" in r.output
    line = one_line(cluster.cli("xml", "new", "web", "--interrupts", "relay"))
    assert "give a --device" in line


def test_attach_with_the_relay_and_status_shows_each_devices_path(cluster):
    cluster.define("gamma", "vm1", running=True)
    r = cluster.cli("attach", "vm1", "0x12", "--interrupts", "relay", *GAMMA)
    assert r.exit_code == 0, r.output
    assert cluster.cli("attach", "vm1", "0x10", *GAMMA).exit_code == 0
    live = cluster.hv("gamma").xml("vm1")
    assert interrupts_attrs(live) == ([], ["relay"])
    with cluster.fabric() as f:
        assert f.interrupt_window(0x12) is None
        assert f.interrupt_window(0x10) is not None
    r = cluster.cli("status", "vm1", *GAMMA)
    assert r.exit_code == 0, r.output
    rows = {ln.split()[3]: ln.split() for ln in r.stdout.splitlines() if "vm1" in ln}
    assert "relay" in rows["0x12"] and "ntb(alpha:0)" in rows["0x10"]
    r = cluster.cli("status", "vm1", "--json", *GAMMA)
    devices = {d["fdid"]: d["interrupts"] for d in json.loads(r.stdout)["vms"][0]["devices"]}
    assert devices["0x12"] == {"path": "relay", "via": None, "asked": "relay"}
    assert devices["0x10"] == {"path": "ntb(alpha:0)", "via": "alpha:0", "asked": "ntb"}


def test_a_stopped_vms_devices_show_the_path_they_ask_for(cluster):
    cluster.define("gamma", "idle", [0x12])
    r = cluster.cli("status", "idle", "--json", *GAMMA)
    assert r.exit_code == 0, r.output
    [device] = json.loads(r.stdout)["vms"][0]["devices"]
    assert device["interrupts"] == {"path": "asks ntb", "via": None, "asked": "ntb"}
