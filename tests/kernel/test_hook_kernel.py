"""libvirt's hook (prepare, release) on the kernel backend, with a real mdev: the SmartIO
driver's class attributes come from a fixture tree (FakeSmartio), the mdev parent is the real
kernel's mtty standing for ``smartio-12`` (tests.support.kernel_guest.MttyAsSmartio)."""

# ruff: noqa: F811 (the imported fixtures are parameters of the tests)
from __future__ import annotations

import io
import subprocess
import uuid

import pytest

from tests.support.kernel_guest import (
    MTTY,
    MTTY1,
    MTTY2,
    MTTY_DIR,
    REAL,
    MttyAsSmartio,
    MttyEventsAsSmartio,
    available,
)
from tests.support.smartio_host import NVME, PARENT, fake, state  # noqa: F401 (fixtures)
from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, mdev_uuid, new_domain
from vmlend.hook.main import run
from vmlend.kernel.backend import SmartioFabric
from vmlend.kernel.mdev import MdevBus
from vmlend.kernel.udev import Outcome, PyudevSource
from vmlend.registry import SqliteRegistry
from vmlend.topology.model import DeviceState, MiB

VM_UUID = uuid.UUID("6f1c5a2e-0000-4000-8000-000000000012")


@pytest.fixture
def open_kernel_fabric(state, fake):
    """The hook's fabric factory: the kernel backend over the fixture's SmartIO attributes,
    its mdev bus the real kernel's (mtty as smartio-12)."""
    opened = []

    def factory(state_path, node):
        fab = SmartioFabric(SqliteRegistry.open(state_path), fake.env, node, writer=fake)
        fab.bus = MttyAsSmartio(NVME)  # type: ignore[assignment]
        opened.append(fab)
        return fab

    yield factory
    for fab in opened:
        fab.close()


def hook(state_path, factory, *argv, xml):
    err = io.StringIO()
    code = run(
        list(argv),
        stdin=io.BytesIO(xml),
        stdout=io.BytesIO(),
        stderr=err,
        environ={"VMLEND_STATE": str(state_path), "VMLEND_NODE": "gamma"},
        open_fabric=factory,
    )
    return code, err.getvalue()


def domain_xml() -> bytes:
    spec = DomainSpec(
        name="web", memory_bytes=512 * MiB, uuid=VM_UUID, devices=[DeviceRequest(NVME)]
    )
    return new_domain(spec, templates=TemplateSet()).to_bytes()


def test_prepare_creates_a_real_mdev_and_release_removes_it(state, fake, open_kernel_fabric):
    xml = domain_xml()
    u = str(mdev_uuid(VM_UUID, NVME))
    code, err = hook(state, open_kernel_fabric, "web", "prepare", "begin", "-", xml=xml)
    assert (code, err) == (0, "")
    # The kernel made it: on mtty's type, with an IOMMU group and its VFIO group device.
    dev = MdevBus(REAL).device(u)
    assert dev is not None and (dev.parent, dev.type_id) == (MTTY, MTTY2)
    assert (REAL.dev / "vfio" / str(dev.iommu_group)).exists()
    assert (MTTY_DIR / u).is_dir() and available(MTTY2) == 11
    # The backend sees it under the SmartIO names, and the registry holds it.
    fab = open_kernel_fabric(state, "gamma")
    assert [(m.uuid, m.fdid, m.parent) for m in fab.mdevs()] == [(u, NVME, PARENT)]
    assert fab.device(NVME).state in (DeviceState.RESERVED, DeviceState.BORROWED)
    assert fake.smartio.devs[NVME].wants_parent  # the driver was asked to register it

    # prepare again (libvirt retrying): nothing new
    assert hook(state, open_kernel_fabric, "web", "prepare", "begin", "-", xml=xml) == (0, "")
    assert [d.uuid for d in MdevBus(REAL).devices()] == [u]

    code, err = hook(state, open_kernel_fabric, "web", "release", "end", "-", xml=xml)
    assert (code, err) == (0, "")
    assert MdevBus(REAL).devices() == [] and available(MTTY2) == 12
    fab = open_kernel_fabric(state, "gamma")
    assert fab.mdevs() == [] and fab.device(NVME).holder is None
    assert not fake.smartio.devs[NVME].wants_parent  # unborrow written

    # release again: idempotent
    assert hook(state, open_kernel_fabric, "web", "release", "end", "-", xml=xml) == (0, "")


def test_prepare_that_the_kernel_refuses_changes_nothing(state, fake, open_kernel_fabric):
    """mtty has no ports left: the kernel's ENOSPC fails the start and the hold is undone.
    (The ports go to mtty-1 children, which do not stand for any SmartIO parent.)"""
    bus = MdevBus(REAL)
    for i in range(24):
        bus.create(MTTY, MTTY1, f"83b8f4f2-509f-382f-3c1e-e6bfe0fa3{i:03d}")
    assert available(MTTY2) == 0
    code, err = hook(state, open_kernel_fabric, "web", "prepare", "begin", "-", xml=domain_xml())
    assert code == 1 and "no" in err and "instances left" in err, err
    fab = open_kernel_fabric(state, "gamma")
    assert fab.mdevs() == [] and fab.device(NVME).holder is None
    assert len(bus.devices()) == 24


def test_the_watcher_brings_back_a_running_vms_mdev_when_its_parent_returns(
    state,
    fake,
    open_kernel_fabric,
):
    """What 'vmlend mdev watch' runs (SmartioFabric.watcher over the live source): the parent
    leaves (its driver unloaded, as when a lender reboots), the registry marks the device
    unavailable; it returns, the running VM's child is created again from the registry."""
    xml = domain_xml()
    u = str(mdev_uuid(VM_UUID, NVME))
    assert hook(state, open_kernel_fabric, "web", "prepare", "begin", "-", xml=xml) == (0, "")
    fab = open_kernel_fabric(state, "gamma")
    source = MttyEventsAsSmartio(PyudevSource.for_host(REAL), NVME)
    watcher = fab.watcher()
    assert watcher.discover() == [PARENT]

    # The parent's driver goes, taking the child with it (the mdev core removes children of
    # a parent that unregisters).
    subprocess.run(["rmmod", "mtty"], check=True)
    assert MdevBus(REAL).device(u) is None
    watcher.run(source, timeout=3)
    assert PARENT in watcher.unavailable, source.events
    assert fab.device(NVME).state is DeviceState.UNAVAILABLE

    subprocess.run(["insmod", "/lib/modules/vmlend/mtty.ko"], check=True)
    before = len(watcher.reactions)
    watcher.run(source, timeout=3)
    after = [(r.outcome, r.uuid) for r in watcher.reactions[before:]]
    assert after and after[0] == (Outcome.RECREATED, u), (after, source.events)
    dev = MdevBus(REAL).device(u)
    assert dev is not None and (dev.parent, dev.type_id) == (MTTY, MTTY2)
    assert fab.device(NVME).state is not DeviceState.UNAVAILABLE

    assert hook(state, open_kernel_fabric, "web", "release", "end", "-", xml=xml) == (0, "")
    assert MdevBus(REAL).devices() == []
