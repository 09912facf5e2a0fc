"""``vmlend attach`` / ``detach`` when things go wrong half-way: libvirt's asynchronous live
detach (the guest lets go late, or never), a detach interrupted after libvirt unplugged the
hostdev, and Ctrl-C during an attach."""

from __future__ import annotations

import pytest

from vmlend.cli.cmd_attach import apply_attach, hostdev_xml, plan_attach
from vmlend.domain import DomainDocument, find_device

from .test_cli_attach_support import SimCluster, hostdev_uuids, make_cluster, metadata_fdids

GAMMA = ("-c", "sim:///gamma")


@pytest.fixture
def cluster(state_path, monkeypatch) -> SimCluster:
    monkeypatch.delenv("VMLEND_NODE", raising=False)
    monkeypatch.delenv("LIBVIRT_DEFAULT_URI", raising=False)
    return make_cluster(state_path)


def attached(cluster: SimCluster, fdid: int = 0x10) -> str:
    """Attach ``fdid`` live to a running vm1; its mdev UUID."""
    cluster.define("gamma", "vm1", running=True)
    r = cluster.cli("attach", "vm1", hex(fdid), *GAMMA)
    assert r.exit_code == 0, r.output
    return hostdev_uuids(cluster.hv("gamma").xml("vm1"))[0]


# --- interrupted detach ----------------------------------------------------------------------


def test_detach_interrupted_before_the_metadata_update_can_be_finished(cluster):
    mdev = attached(cluster)
    hv = cluster.hv("gamma")
    doc = DomainDocument.parse(hv.xml("vm1"))
    device = find_device(doc, 0x10)
    assert device is not None
    # libvirt unplugged the hostdev, then the CLI died: the metadata still names the device.
    hv.detach_device("vm1", hostdev_xml(doc, device), live=True, config=False)
    assert metadata_fdids(hv.xml("vm1")) == ["0x10"] and cluster.mdevs() == {(mdev, 0x10)}
    r = cluster.cli("detach", "vm1", "0x10", *GAMMA)
    assert r.exit_code == 0, r.output
    assert "returned to the fabric" in r.stdout
    assert cluster.holds() == {} and cluster.mdevs() == set()
    assert metadata_fdids(hv.xml("vm1")) == []


# --- Ctrl-C ----------------------------------------------------------------------------------


class InterruptedHotplug:
    """The user presses Ctrl-C while libvirt plugs the hostdev."""

    def __init__(self, hv) -> None:
        self._hv = hv

    def __getattr__(self, name):
        return getattr(self._hv, name)

    def attach_device(self, name, device_xml, live, config):
        raise KeyboardInterrupt


def test_ctrl_c_during_attach_undoes_reserve_and_mdev(cluster):
    cluster.define("gamma", "vm1", running=True)
    before = cluster.snapshot()
    hv = InterruptedHotplug(cluster.hv("gamma"))
    steps: list[str] = []
    with cluster.fabric() as f:
        plan = plan_attach(hv, f, "vm1", 0x10, live=True, config=False)
        with pytest.raises(KeyboardInterrupt):
            apply_attach(hv, f, plan, steps.append)
    assert cluster.snapshot() == before
    assert any(s.startswith("undo reserve 0x10") for s in steps)
