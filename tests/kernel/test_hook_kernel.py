"""libvirt's hook (prepare, release) run in-process on the production kernel backend: the
SmartIO driver is the tier's stand-in, the mdev parent and children the kernel's. No adapter
and no fixture tree: the fabric is opened as the installed hook opens it (the backend is
smartio because the driver's ``node_id`` is there). tests/kernel/test_vm_kernel.py runs the
same hook as libvirtd runs it."""

from __future__ import annotations

import io
import os
import uuid

import pytest

from tests.support.kernel_guest import FOREIGN, LEND, PORTS, REAL, STUB, available, parent_dir
from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, mdev_uuid, new_domain
from vmlend.hook.main import run
from vmlend.kernel.backend import SmartioFabric
from vmlend.kernel.mdev import MdevBus
from vmlend.kernel.udev import Outcome, PyudevSource
from vmlend.topology.model import DeviceState, MiB
from vmlend.wiring.fabric import default_topology_text, init_fabric, open_fabric

VM_UUID = uuid.UUID("6f1c5a2e-0000-4000-8000-000000000012")
NVME = 0x12
PARENT = "smartio-12"


@pytest.fixture
def state(tmp_path, fabric_devices):
    path = tmp_path / "state.db"
    text, source = default_topology_text()
    init_fabric(path, text, source, node="gamma")
    return path


def fabric(state) -> SmartioFabric:
    fab = open_fabric(state, "gamma")
    assert isinstance(fab, SmartioFabric)  # the host's default backend: the driver is loaded
    return fab


def hook(state, *argv, xml):
    err = io.StringIO()
    code = run(
        list(argv),
        stdin=io.BytesIO(xml),
        stdout=io.BytesIO(),
        stderr=err,
        environ={
            "VMLEND_STATE": str(state),
            "VMLEND_NODE": "gamma",
            "VMLEND_ROOT": os.environ["VMLEND_ROOT"],  # the test's, with the real sysfs
        },
    )
    return code, err.getvalue()


def domain_xml() -> bytes:
    spec = DomainSpec(
        name="web", memory_bytes=512 * MiB, uuid=VM_UUID, devices=[DeviceRequest(NVME)]
    )
    return new_domain(spec, templates=TemplateSet()).to_bytes()


def test_prepare_creates_a_real_mdev_and_release_removes_it(state):
    xml = domain_xml()
    u = str(mdev_uuid(VM_UUID, NVME))
    code, err = hook(state, "web", "prepare", "begin", "-", xml=xml)
    assert (code, err) == (0, "")
    # The driver registered the parent on the device's directory; the kernel made the child
    # there, with an IOMMU group and its VFIO group device.
    dev = MdevBus(REAL).device(u)
    assert dev is not None and (dev.parent, dev.type_id) == (PARENT, LEND)
    assert (REAL.dev / "vfio" / str(dev.iommu_group)).exists()
    assert (parent_dir(NVME) / u).is_dir() and available(NVME) == 0
    with fabric(state) as fab:
        assert [(m.uuid, m.fdid, m.parent, m.vm) for m in fab.mdevs()] == [(u, NVME, PARENT, "web")]
        assert fab.device(NVME).state in (DeviceState.RESERVED, DeviceState.BORROWED)
        token = fab.holds_of(fab.device(NVME).holder)[NVME].token
    assert STUB.read(NVME, "token") == f"{token}\n"  # the hold's fencing token, given first

    # prepare again (libvirt retrying): nothing new
    assert hook(state, "web", "prepare", "begin", "-", xml=xml) == (0, "")
    assert [d.uuid for d in MdevBus(REAL).devices()] == [u]

    code, err = hook(state, "web", "release", "end", "-", xml=xml)
    assert (code, err) == (0, "")
    assert MdevBus(REAL).devices() == []
    assert STUB.registered() == []  # nothing left under it: unborrow written
    with fabric(state) as fab:
        assert fab.mdevs() == [] and fab.mdev_records() == []
        assert fab.device(NVME).holder is None

    # release again: idempotent
    assert hook(state, "web", "release", "end", "-", xml=xml) == (0, "")


def test_prepare_that_the_kernel_refuses_changes_nothing(state):
    """Children of the parent's other type (made by hand) took its ports: the kernel's ENOSPC
    fails the start, the hold is undone, and the children stay."""
    STUB.command("borrow", "0x12")
    bus = MdevBus(REAL)
    foreign = [f"83b8f4f2-509f-382f-3c1e-e6bfe0fa3{i:03d}" for i in range(PORTS)]
    for u in foreign:
        bus.create(PARENT, FOREIGN, u)
    assert available(NVME) == 0
    code, err = hook(state, "web", "prepare", "begin", "-", xml=domain_xml())
    assert code == 1 and f"{PARENT} has no {LEND} instances left" in err, err
    with fabric(state) as fab:
        assert fab.mdev_records() == [] and fab.device(NVME).holder is None
    assert sorted(d.uuid for d in bus.devices()) == foreign
    assert STUB.registered() == [PARENT]  # the borrow was not vmlend's to end


def test_the_watcher_brings_back_a_running_vms_mdev_when_its_lender_returns(state):
    """What 'vmlend mdev watch' runs (SmartioFabric.watcher over the live source): the lender
    goes away (the driver unregisters the parent, the mdev core takes the child with it), the
    registry marks the device unavailable; it comes back, the driver registers the parent
    again by itself, and the running VM's child is created again from the registry."""
    xml = domain_xml()
    u = str(mdev_uuid(VM_UUID, NVME))
    assert hook(state, "web", "prepare", "begin", "-", xml=xml) == (0, "")
    source = PyudevSource.for_host(REAL)
    with fabric(state) as fab:
        watcher = fab.watcher()
        assert watcher.discover() == [PARENT]

        STUB.set_availability(NVME, "unreachable")
        assert MdevBus(REAL).device(u) is None
        watcher.run(source, timeout=3)
        assert PARENT in watcher.unavailable
        assert fab.device(NVME).state is DeviceState.UNAVAILABLE

        STUB.set_availability(NVME, "available")
        before = len(watcher.reactions)
        watcher.run(source, timeout=3)
        after = [(r.outcome, r.uuid) for r in watcher.reactions[before:]]
        assert after and after[0] == (Outcome.RECREATED, u), after
        dev = MdevBus(REAL).device(u)
        assert dev is not None and (dev.parent, dev.type_id) == (PARENT, LEND)
        assert fab.device(NVME).state is not DeviceState.UNAVAILABLE

    assert hook(state, "web", "release", "end", "-", xml=xml) == (0, "")
    assert MdevBus(REAL).devices() == [] and STUB.registered() == []
