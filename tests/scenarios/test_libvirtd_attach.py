"""``vmlend attach``/``detach``/``status`` against a real private libvirtd with a running TCG
guest. This machine has no VFIO, so libvirt refuses a live mdev hot-plug after vmlend borrowed
the device and created the mdev: the refusal must undo both and show libvirt's reason in one
line. ``--config`` changes on a running domain work here and must be shown to."""

from __future__ import annotations

import json

import pytest
from lxml import etree

from tests.support.cli_cluster import SimCluster, hostdev_uuids, metadata_fdids, one_line
from tests.support.libvirt_daemon import needs_no_vfio
from tests.support.simfabric import make_fabric
from vmlend.domain import mdev_uuid

pytestmark = pytest.mark.libvirtd


@pytest.fixture
def cluster(libvirtd, state_path, monkeypatch) -> SimCluster:
    monkeypatch.delenv("VMLEND_NODE", raising=False)
    monkeypatch.delenv("LIBVIRT_DEFAULT_URI", raising=False)
    make_fabric(state_path).close()
    return SimCluster(state_path)


@pytest.fixture
def running(libvirt_guests):
    dom = libvirt_guests.define(prefix="att")
    dom.create()
    libvirt_guests.note_running()
    return dom


def cli(cluster: SimCluster, libvirtd, *args: str):
    # Simulated devices on a real libvirtd: only an explicit --backend sim lets libvirt see
    # them (the default refuses before libvirt, tests/unit/cli/test_simulated_on_real.py).
    return cluster.cli("--node", "gamma", "--backend", "sim", *args, "-c", libvirtd.uri)


def xmls(dom) -> tuple[bytes, bytes]:
    import libvirt

    live = dom.XMLDesc(0).encode()
    config = dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE).encode()
    return live, config


@needs_no_vfio
def test_live_attach_refused_by_libvirt_undoes_borrow_and_mdev(cluster, libvirtd, running):
    before = (cluster.snapshot(), xmls(running))
    r = cli(cluster, libvirtd, "attach", running.name(), "0x10", "--live")
    line = one_line(r)
    assert line.startswith(f"Error: cannot attach device 0x10 to VM '{running.name()}': ")
    assert "Mediated host device assignment requires VFIO support" in line
    assert line.endswith("nothing was changed")
    assert (cluster.snapshot(), xmls(running)) == before
    assert cluster.holds() == {} and cluster.mdevs() == set()


def test_config_attach_and_detach_on_a_running_domain(cluster, libvirtd, running):
    name = running.name()
    live_before, _ = xmls(running)
    r = cli(cluster, libvirtd, "attach", name, "0x12", "--config")
    assert r.exit_code == 0, r.output
    mdev = str(mdev_uuid(running.UUIDString(), 0x12))
    assert r.stdout.strip() == f"attached device 0x12 to VM '{name}' (config), mdev {mdev}"
    live, config = xmls(running)
    assert hostdev_uuids(config) == [mdev] and metadata_fdids(config) == ["0x12"]
    assert live == live_before  # the running guest is untouched
    assert cluster.holds() == {}  # borrowed by the hook at the next start, not now

    data = json.loads(cli(cluster, libvirtd, "status", name, "--json").stdout)
    (vm,) = data["vms"]
    assert vm["name"] == name
    assert [(d["fdid"], d["state"]) for d in vm["devices"]] == [("0x12", "at next start")]

    r = cli(cluster, libvirtd, "detach", name, "0x12", "--config")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == f"detached device 0x12 from VM '{name}' (config)"
    _, config = xmls(running)
    assert hostdev_uuids(config) == []
    assert etree.fromstring(config).find("metadata") is None or metadata_fdids(config) == []


def test_dry_run_against_libvirt_changes_nothing(cluster, libvirtd, running):
    before = (cluster.snapshot(), xmls(running))
    r = cli(cluster, libvirtd, "attach", running.name(), "0x10", "--dry-run")
    assert r.exit_code == 0, r.output
    assert "+++ live XML (after)" in r.stdout
    assert (cluster.snapshot(), xmls(running)) == before


def test_attach_to_a_missing_domain_is_one_line(cluster, libvirtd):
    line = one_line(cli(cluster, libvirtd, "attach", "no-such-vm", "0x10"))
    assert "no domain 'no-such-vm'" in line
