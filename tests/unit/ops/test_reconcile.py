"""``vmlend reconcile``: each drift an interruption leaves between the hypervisor, the state and
the host's mdevs is reported with its cause, and ``--fix`` returns what no running VM uses and
re-creates what a running VM needs. ``vmlend status`` flags drift."""

from __future__ import annotations

import json
import uuid

from tests.support.cli_cluster import GAMMA, SimCluster, hostdev_uuids, metadata_fdids
from vmlend.domain import DomainDocument, find_device, mdev_uuid, read_domain
from vmlend.lending.devices import UndoJournal, acquire_device, return_device
from vmlend.ops.attach import plan_attach
from vmlend.ops.definitions import hostdev_xml
from vmlend.topology.model import Holder


def _reconcile(cluster: SimCluster, *args: str) -> dict:
    res = cluster.cli("reconcile", *GAMMA, "--json", *args)
    assert res.exit_code in (0, 1), res.output
    return json.loads(res.stdout)


def _kinds(report: dict) -> list[tuple[str, str, str | None]]:
    return sorted((d["kind"], d["vm"], d["fdid"]) for d in report["drift"])


def _reserve(cluster: SimCluster, vm: str, vm_uuid: uuid.UUID, fdid: int) -> str:
    """What a killed attach or a failed release leaves: a hold and an mdev for ``vm``."""
    mdev = str(mdev_uuid(vm_uuid, fdid))
    with cluster.fabric() as f:
        acquire_device(f, Holder("gamma", vm, str(vm_uuid)), fdid, mdev, UndoJournal())
    return mdev


def test_a_consistent_cluster_has_no_drift(cluster):
    cluster.define("gamma", "vm1", [0x10], running=True)
    cluster.define("gamma", "vm2", [0x11])
    assert _reconcile(cluster)["drift"] == []
    res = cluster.cli("reconcile", *GAMMA)
    assert res.exit_code == 0
    assert res.stdout == "no drift on gamma: hypervisor, state and mdevs agree\n"
    assert "DRIFT" not in cluster.cli("status", *GAMMA).stdout


def test_hold_of_a_stopped_vm_is_returned(cluster):
    # The release hook failed (say on a full disk): vm1 is shut off, its device still held.
    vid = uuid.uuid4()
    cluster.define("gamma", "vm1", [0x10], vm_uuid=vid)
    mdev = _reserve(cluster, "vm1", vid, 0x10)
    report = _reconcile(cluster)
    assert _kinds(report) == [("hold-of-stopped-vm", "vm1", "0x10")]
    (d,) = report["drift"]
    assert "defined but not running" in d["cause"] and "release hook" in d["cause"]
    assert d["fix"] == f"return 0x10 and remove mdev {mdev}"

    status = cluster.cli("status", *GAMMA)
    assert "DRIFT: 1 disagreement(s)" in status.stdout and "vmlend reconcile" in status.stdout
    assert json.loads(cluster.cli("status", *GAMMA, "--json").stdout)["drift"] == report["drift"]

    before = cluster.snapshot()
    dry = cluster.cli("reconcile", *GAMMA, "--fix", "--dry-run")
    assert dry.exit_code == 1 and f"would return 0x10 and remove mdev {mdev}" in dry.stdout
    assert cluster.snapshot() == before

    fixed = _reconcile(cluster, "--fix")
    assert [d["kind"] for d in fixed["fixed"]] == ["hold-of-stopped-vm"]
    assert cluster.holds() == {} and cluster.mdevs() == set()
    assert _reconcile(cluster)["drift"] == []
    # The VM starts again normally: its hook reserves the device afresh.
    cluster.hv("gamma").start("vm1")
    assert cluster.holds() == {0x10: "gamma/vm1"}


def test_hold_the_running_vm_does_not_name_is_returned_and_the_rest_kept(cluster):
    # An attach of 0x11 killed after the reserve: vm1 runs with 0x10 only.
    vid = uuid.uuid4()
    cluster.define("gamma", "vm1", [0x10], running=True, vm_uuid=vid)
    _reserve(cluster, "vm1", vid, 0x11)
    report = _reconcile(cluster)
    assert _kinds(report) == [("hold-not-in-xml", "vm1", "0x11")]
    assert "attach killed after the reserve" in report["drift"][0]["cause"]
    _reconcile(cluster, "--fix")
    assert cluster.holds() == {0x10: "gamma/vm1"}
    assert cluster.mdevs() == {(str(mdev_uuid(vid, 0x10)), 0x10)}


def test_mdev_without_hold_is_removed(cluster):
    vid = uuid.uuid4()
    mdev = _reserve(cluster, "gone", vid, 0x12)
    with cluster.fabric() as f:  # the hold ended but the mdev stayed
        f.release(0x12, Holder("gamma", "gone", str(vid)))
    report = _reconcile(cluster)
    assert _kinds(report) == [("mdev-without-hold", "gone", "0x12")]
    assert report["drift"][0]["fix"] == f"remove mdev {mdev}"
    _reconcile(cluster, "--fix")
    assert cluster.mdevs() == set() and cluster.holds() == {}


def test_metadata_without_hostdev_is_dropped_and_the_device_returned(cluster):
    # A detach killed after libvirt unplugged the hostdev, before the metadata write.
    cluster.define("gamma", "vm1", [0x10, 0x11], running=True)
    hv = cluster.hv("gamma")
    doc = DomainDocument.parse(hv.xml("vm1"))
    device = find_device(doc, 0x10)
    assert device is not None
    hv.detach_device("vm1", hostdev_xml(doc, device), live=True, config=False)
    report = _reconcile(cluster)
    assert _kinds(report) == [("metadata-without-hostdev", "vm1", "0x10")]
    _reconcile(cluster, "--fix")
    live = hv.xml("vm1")
    assert metadata_fdids(live) == ["0x11"] and len(hostdev_uuids(live)) == 1
    assert cluster.holds() == {0x11: "gamma/vm1"}
    assert _reconcile(cluster)["drift"] == []


def test_running_vm_gets_back_a_lost_hold_and_mdev(cluster):
    vid = uuid.uuid4()
    cluster.define("gamma", "vm1", [0x10, 0x11], running=True, vm_uuid=vid)
    holder = Holder("gamma", "vm1", str(vid))
    with cluster.fabric() as f:
        return_device(f, holder, 0x10, str(mdev_uuid(vid, 0x10)))  # hold and mdev gone
        f.remove_mdev(str(mdev_uuid(vid, 0x11)))  # only the mdev gone
    report = _reconcile(cluster)
    assert _kinds(report) == [("missing-hold", "vm1", "0x10"), ("missing-mdev", "vm1", "0x11")]
    res = cluster.cli("reconcile", *GAMMA, "--fix")
    assert res.exit_code == 0, res.output
    assert res.stdout.count("fixed ") == 2
    assert cluster.holds() == {0x10: "gamma/vm1", 0x11: "gamma/vm1"}
    assert {m for m, _f in cluster.mdevs()} == {str(mdev_uuid(vid, f)) for f in (0x10, 0x11)}


def test_a_device_held_by_another_vm_is_left_to_the_operator(cluster):
    vid = uuid.uuid4()
    cluster.define("gamma", "vm1", [0x10], running=True, vm_uuid=vid)
    with cluster.fabric() as f:
        return_device(f, Holder("gamma", "vm1", str(vid)), 0x10, str(mdev_uuid(vid, 0x10)))
        other = Holder("gamma", "vm9", str(uuid.uuid4()))
        f.reserve(0x10, other)
    report = _reconcile(cluster)
    kinds = _kinds(report)
    assert ("held-by-another", "vm1", "0x10") in kinds
    before = cluster.snapshot()
    res = cluster.cli("reconcile", *GAMMA, "--fix")
    assert res.exit_code == 1
    assert "left held-by-another: vm1 device 0x10" in res.stdout
    assert "to do by hand: stop one of the two VMs" in res.stdout
    # The stale hold of vm9 (not running) is returned; vm1 then simply needs a re-run.
    assert cluster.snapshot() != before
    assert _kinds(_reconcile(cluster)) == [("missing-hold", "vm1", "0x10")]


def test_a_device_another_hosts_vm_holds_is_held_by_another_not_missing(cluster):
    # gamma lost its hold (its lease ended) and a VM on beta took the device meanwhile.
    vid = uuid.uuid4()
    cluster.define("gamma", "vm1", [0x10], running=True, vm_uuid=vid)
    with cluster.fabric() as f:
        return_device(f, Holder("gamma", "vm1", str(vid)), 0x10, str(mdev_uuid(vid, 0x10)))
    with cluster.fabric("beta") as f:
        f.reserve(0x10, Holder("beta", "db", str(uuid.uuid4())))
    report = _reconcile(cluster)
    assert _kinds(report) == [("held-by-another", "vm1", "0x10")]
    (d,) = report["drift"]
    assert "VM 'db' on host beta holds" in d["cause"] and not d["fixable"]
    assert "vmlend detach vm1 0x10 --live" in d["fix"]
    before = cluster.snapshot()
    res = cluster.cli("reconcile", *GAMMA, "--fix")
    assert res.exit_code == 1
    assert cluster.snapshot() == before  # nothing taken from beta, nothing re-reserved


def test_hostdev_without_metadata_is_finished(cluster):
    vid = uuid.uuid4()
    cluster.define("gamma", "vm1", [0x11], running=True, vm_uuid=vid)
    hv = cluster.hv("gamma")
    # An attach killed between libvirt's hot-plug and the metadata write.
    with cluster.fabric() as f:
        plan = plan_attach(hv, f, "vm1", 0x10, live=True, config=False)
    _reserve(cluster, "vm1", vid, 0x10)
    hv.attach_device("vm1", hostdev_xml(plan.after["live"], plan.device), live=True, config=False)
    report = _reconcile(cluster)
    assert _kinds(report) == [("hostdev-without-metadata", "vm1", "0x10")]
    (d,) = report["drift"]
    assert "interrupted between libvirt's hot-plug and the metadata write" in d["cause"]
    assert d["fix"].startswith("finish the attach: write 0x10 into the live metadata")
    _reconcile(cluster, "--fix")
    assert [x.fdid for x in read_domain(hv.xml("vm1")).devices] == [0x11, 0x10]
    assert cluster.holds() == {0x10: "gamma/vm1", 0x11: "gamma/vm1"}
    assert _reconcile(cluster)["drift"] == []
