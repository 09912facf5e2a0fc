"""On q35 libvirt hot-plugs a PCIe device (an mdev's vfio-pci) only into a free
pcie-root-port (or a switch's downstream port) and adds no port to a running guest: a live
attach to a guest with none free must fail ("No more available PCI slots", after vmlend borrowed
the device). ``attach --dry-run`` predicts that refusal, and the live attach makes the same
check before borrowing anything. A real libvirt URI here is libvirt's test driver."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest

from tests.support.cli_cluster import one_line
from vmlend.domain import DomainSpec, TemplateSet, new_domain
from vmlend.topology.model import MiB

NONE_FREE = "the running q35 guest has no free hot-pluggable PCIe port"


def driver_uri(tmp_path: Path, hotplug_slots: int, machine: str = "q35") -> str:
    """A libvirt test-driver host running ``vmq``, made by ``vmlend xml new``'s builder."""
    spec = DomainSpec(
        name="vmq",
        memory_bytes=512 * MiB,
        virt_type="qemu",
        machine=machine,
        uuid=uuid.UUID("6f1c5a2e-0000-4000-8000-0000000000a7"),
        hotplug_slots=hotplug_slots,
    )
    xml = new_domain(spec, templates=TemplateSet()).to_bytes().decode()
    xml = re.sub(r"<\?xml[^>]*\?>", "", xml)
    xml = re.sub(r"<domain type=['\"]\w+['\"]", "<domain type='test'", xml, count=1)
    node = tmp_path / f"host-{hotplug_slots}-{machine}.xml"
    node.write_text(
        "<node>"
        "<cpu><mhz>2000</mhz><model>x86_64</model><active>2</active><nodes>1</nodes>"
        "<sockets>1</sockets><cores>2</cores><threads>1</threads></cpu>"
        f"<memory>4194304</memory>{xml}</node>"
    )
    return f"test://{node}"


# --backend sim: the simulated devices handed to libvirt anyway (else refused before, for
# another reason: tests/unit/cli/test_simulated_on_real.py)
def test_dry_run_predicts_that_a_guest_without_a_free_port_refuses_the_hot_add(cluster, tmp_path):
    uri = driver_uri(tmp_path, hotplug_slots=0)
    before = cluster.snapshot()
    r = cluster.cli("--backend", "sim", "attach", "vmq", "0x12", "--live", "--dry-run", "-c", uri)
    assert r.exit_code == 1, r.output
    fails = [ln for ln in r.stdout.splitlines() if ln.startswith("FAIL")]
    assert len(fails) == 1 and fails[0].startswith(f"FAIL  hotplug      {NONE_FREE}"), fails
    assert "--hotplug-slots N" in fails[0] and "--config" in fails[0]
    assert "would be refused; nothing was changed" in r.stdout
    # the live attach makes the same check, before anything is borrowed
    line = one_line(cluster.cli("--backend", "sim", "attach", "vmq", "0x12", "--live", "-c", uri))
    assert line.startswith(f"Error: cannot attach device 0x12 to VM 'vmq': {NONE_FREE}"), line
    assert cluster.snapshot() == before


def test_a_free_port_passes_and_is_shown(cluster, tmp_path):
    uri = driver_uri(tmp_path, hotplug_slots=2)
    r = cluster.cli("--backend", "sim", "attach", "vmq", "0x12", "--live", "--dry-run", "-c", uri)
    assert r.exit_code == 0, r.output
    assert "ok    hotplug      2 free hot-pluggable PCIe ports" in r.stdout
    assert "dry run: device 0x12 would attach" in r.stdout


@pytest.mark.parametrize("target", ["--config", None])
def test_no_port_is_needed_on_pc_or_for_the_definition(cluster, tmp_path, target):
    uri = driver_uri(tmp_path, hotplug_slots=0, machine="pc" if target is None else "q35")
    how = ["--live"] if target is None else [target]
    r = cluster.cli("--backend", "sim", "attach", "vmq", "0x12", *how, "--dry-run", "-c", uri)
    assert r.exit_code == 0, r.output
    assert "hotplug" not in r.stdout


def test_a_simulated_node_plugs_without_ports(cluster):
    """The simulated hypervisor hot-plugs like a working VFIO host with no PCIe topology to
    run out of: its q35 guests need no port, and no check is shown."""
    cluster.define("gamma", "vm1", running=True)  # q35, no hot-plug slots
    r = cluster.cli("attach", "vm1", "0x12", "--live", "--dry-run", "-c", "sim:///gamma")
    assert r.exit_code == 0, r.output
    assert "hotplug" not in r.stdout
