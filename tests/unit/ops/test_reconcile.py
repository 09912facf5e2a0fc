"""``vmlend reconcile``: each drift an interruption leaves between the hypervisor, the state and
the host's mdevs is reported with its cause, and ``--fix`` returns what no running VM uses and
re-creates what a running VM needs. ``vmlend status`` flags drift."""

# ruff: noqa: F811 (the kernel tests take the imported fixtures as parameters)

from __future__ import annotations

import json
import uuid

import pytest

from tests.support.cli_cluster import GAMMA, SimCluster, hostdev_uuids, metadata_fdids
from tests.support.fake_sysfs import Crash, CrashOnCreate, FakeType
from tests.support.smartio_host import NVME, PARENT, U1, U2, WEB, fake, start_vm, state  # noqa: F401
from vmlend.domain import (
    DeviceRequest,
    DomainDocument,
    DomainSpec,
    TemplateSet,
    find_device,
    mdev_uuid,
    new_domain,
    read_domain,
)
from vmlend.kernel.backend import SmartioFabric
from vmlend.kernel.driver import MDEV_TYPE
from vmlend.ledger.shareops import SHARE_MDEV_TYPE
from vmlend.lending.devices import UndoJournal, acquire_device, return_all, return_device
from vmlend.ops.attach import plan_attach
from vmlend.ops.definitions import hostdev_xml
from vmlend.ops.reconcile import DriftKind, find_drift, fix, look
from vmlend.registry import SqliteRegistry
from vmlend.sim.hypervisor.node import SimHypervisor
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


# --- the kernel backend: children vmlend did not make are never drift ------------------------


def test_on_the_kernel_backend_only_what_vmlend_recorded_is_removed(tmp_path, state, fake):
    """web stopped without its release (a stale hold and its recorded mdev U1); beside U1,
    under the same SmartIO parent, 22 children of another type and one of vmlend's type that
    vmlend did not make. --fix returns web's device and removes U1 only, and the children
    vmlend did not record are no drift, then or later."""
    fake.smartio.lend_instances = 2
    fake.smartio.extra_types = [FakeType(SHARE_MDEV_TYPE, available=22)]
    hv = SimHypervisor("gamma", tmp_path / "hv", None)  # web is not running (nor defined)
    with SmartioFabric(SqliteRegistry.open(state), fake.env, writer=fake) as fabric:
        start_vm(fabric)
        others = {str(uuid.uuid4()) for _ in range(22)}
        for u in others:
            fabric.bus.create(PARENT, SHARE_MDEV_TYPE, u)
        fabric.bus.create(PARENT, MDEV_TYPE, U2)
        others.add(U2)

        drift = find_drift(look(hv, fabric))
        assert [(d.kind, d.vm, d.fdid, d.mdev) for d in drift] == [
            (DriftKind.HOLD_OF_STOPPED_VM, "web", NVME, U1)
        ]
        result = fix(hv, fabric, drift)
        assert (len(result.fixed), result.failed) == (1, [])
        assert {d.uuid for d in fabric.bus.devices()} == others
        assert fabric.device(NVME).holder is None
        assert find_drift(look(hv, fabric)) == []  # and the others stay no drift


def test_on_the_kernel_backend_a_running_vms_unrecorded_mdev_is_recorded(tmp_path, state, fake):
    """web runs with its mdev, but the registry has no record of it (restored, or gone with
    the host's lease): its release would leave the child, so it is drift, and --fix records
    it as web's, after which web's release removes it."""
    vid = uuid.UUID(WEB.vm_uuid)
    hv = SimHypervisor("gamma", tmp_path / "hv", None)
    spec = DomainSpec(name="web", memory_bytes=512 << 20, uuid=vid, devices=[DeviceRequest(NVME)])
    hv.define(new_domain(spec, templates=TemplateSet()).to_bytes())
    hv.start("web")
    mdev = str(mdev_uuid(vid, NVME))
    with SmartioFabric(SqliteRegistry.open(state), fake.env, writer=fake) as fabric:
        fabric.reserve(NVME, WEB)
        fabric.ensure_mdev_parent(NVME)
        fabric.bus.create(PARENT, MDEV_TYPE, mdev)  # the child, without its record
        # nor its DMA windows (section 8): made by hand, not by vmlend's prepare
        d, windows = find_drift(look(hv, fabric))
        assert (d.kind, d.vm, d.mdev) == (DriftKind.MISSING_MDEV, "web", mdev)
        assert "no record of its mdev" in d.cause and d.fix == f"record mdev {mdev} for VM 'web'"
        assert (windows.kind, windows.mdev) == (DriftKind.DMA_WINDOWS, mdev)
        assert fix(hv, fabric, [d]).failed == []
        assert [m.uuid for m in fabric.mdev_records()] == [mdev]
        assert find_drift(look(hv, fabric)) == []
        hv.destroy("web")
        assert return_all(fabric, WEB, [(NVME, mdev)]) == []
        assert fabric.bus.devices() == [] and fabric.device(NVME).holder is None


def test_on_the_kernel_backend_a_record_never_made_is_dropped(tmp_path, state, fake):
    """web's prepare was killed between the record of U1 and its creation, and its hold was
    returned without the record (a foreign child kept the parent): the record is drift, and
    --fix drops it without touching the foreign child."""
    fake.smartio.extra_types = [FakeType(SHARE_MDEV_TYPE, available=1)]
    hv = SimHypervisor("gamma", tmp_path / "hv", None)
    with SmartioFabric(SqliteRegistry.open(state), fake.env, writer=CrashOnCreate(fake)) as fab:
        fab.reserve(NVME, WEB)
        fab.ensure_mdev_parent(NVME)
        with pytest.raises(Crash):
            fab.create_mdev(NVME, U1, WEB)
    with SmartioFabric(SqliteRegistry.open(state), fake.env, writer=fake) as fabric:
        other = str(uuid.uuid4())
        fabric.bus.create(PARENT, SHARE_MDEV_TYPE, other)
        fabric.release(NVME, WEB)
        (d,) = find_drift(look(hv, fabric))
        assert (d.kind, d.vm, d.mdev) == (DriftKind.MDEV_WITHOUT_HOLD, "web", U1)
        assert "which this host does not have" in d.cause
        assert d.fix == f"drop the record of mdev {U1}"
        assert fix(hv, fabric, [d]).failed == []
        assert fabric.mdev_records() == [] and find_drift(look(hv, fabric)) == []
        assert [m.uuid for m in fabric.bus.devices()] == [other]
