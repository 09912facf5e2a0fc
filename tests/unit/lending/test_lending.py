"""The shared return step on the kernel backend, where an mdev can really refuse to go, and
where a parent can have children vmlend did not make."""

from __future__ import annotations

import uuid

import pytest

from tests.support.fake_sysfs import Crash, CrashOnCreate, FakeType
from tests.support.smartio_host import (  # noqa: F401
    NVME,
    PARENT,
    U1,
    U2,
    WEB,
    fabric,
    fake,
    start_vm,
    state,
)
from vmlend.errors import DeviceHeldError
from vmlend.kernel.backend import SmartioFabric
from vmlend.kernel.driver import MDEV_TYPE
from vmlend.lending.devices import return_all, return_device
from vmlend.registry import SqliteRegistry
from vmlend.topology.model import Holder

#: Another mdev type under the same parent: a shared drive's (docs/smartio-contract.md).
SHARE_TYPE = "smartio-nvme_share"


def test_a_device_whose_mdev_cannot_be_removed_keeps_its_hold(fabric, fake):  # noqa: F811
    start_vm(fabric)
    fake.busy.add(U1)  # the kernel refuses: QEMU still has the device open
    failures = return_all(fabric, WEB, [(NVME, U1)])
    assert any("stays reserved while its mdev exists" in f for f in failures)
    assert fabric.device(NVME).holder == WEB
    with pytest.raises(DeviceHeldError):  # nobody else can take it while the mdev lives
        fabric.reserve(NVME, Holder("gamma", "intruder", "22222222-2222-2222-2222-222222222222"))
    fake.busy.discard(U1)
    assert return_all(fabric, WEB, [(NVME, U1)]) == []  # the re-run finishes the job
    assert fabric.device(NVME).holder is None
    assert fabric.bus.device(U1) is None


def with_children_vmlend_did_not_make(fabric, fake) -> set[str]:  # noqa: F811
    """web runs with its mdev U1 (recorded), and beside it under the same parent: 22 children
    of another type (another share's, or made by hand as mdevctl would) and one more of
    vmlend's own type that vmlend did not record (U2). Returns the UUIDs of those 23."""
    fake.smartio.lend_instances = 2
    fake.smartio.extra_types = [FakeType(SHARE_TYPE, available=22)]
    start_vm(fabric)
    foreign = {str(uuid.uuid4()) for _ in range(22)}
    for u in foreign:
        fabric.bus.create(PARENT, SHARE_TYPE, u)
    fabric.bus.create(PARENT, MDEV_TYPE, U2)
    return foreign | {U2}


def children(fabric) -> set[str]:  # noqa: F811
    return {d.uuid for d in fabric.bus.devices()}


def test_release_removes_only_the_mdev_vmlend_recorded_for_the_vm(fabric, fake):  # noqa: F811
    """Issue 36: 'vm destroy' removed every child under the parent of a device the VM held."""
    others = with_children_vmlend_did_not_make(fabric, fake)
    lines: list[str] = []
    assert return_all(fabric, WEB, [(NVME, U1)], lines.append) == []
    assert lines == [f"mdev {U1}: removed", "device 0x12: returned"]
    assert children(fabric) == others
    assert fabric.device(NVME).holder is None
    assert PARENT in fabric.bus.parent_names()  # the driver keeps it for the others' children
    assert return_all(fabric, WEB, [(NVME, U1)]) == []  # libvirt's re-run: nothing more goes
    assert children(fabric) == others


def test_an_mdev_the_domain_names_that_vmlend_did_not_record_stays(fabric, fake):  # noqa: F811
    """detach and reconcile return one device with the mdev the XML names: a child vmlend
    has no record of stays (and the action log says so), as in a release."""
    others = with_children_vmlend_did_not_make(fabric, fake)
    lines: list[str] = []
    assert return_device(fabric, WEB, NVME, U2, lines.append)  # the hold went
    assert children(fabric) == others | {U1}  # U1 is not the one named; U2 is not vmlend's
    assert lines == [
        f"mdev {U2}: named by this domain but vmlend has no record of it; left alone"
        f" ('vmlend mdev remove {U2}' removes it)",
        "device 0x12: returned",
    ]
    assert return_all(fabric, WEB, [(NVME, U2)], lines.append) == []  # U2 named: stays
    assert children(fabric) == others  # web's own U1 goes by its record


def test_a_crash_between_the_record_and_the_create_converges(state, fake):  # noqa: F811
    """The record of web's mdev comes before the child: a prepare killed between the two
    leaves a record of a child that does not exist. The release that follows finds the record
    and drops it (nothing to remove), returns the device, and touches nothing else."""
    fake.smartio.extra_types = [FakeType(SHARE_TYPE, available=1)]
    with SmartioFabric(SqliteRegistry.open(state), fake.env, writer=CrashOnCreate(fake)) as fab:
        fab.reserve(NVME, WEB)
        fab.ensure_mdev_parent(NVME)
        with pytest.raises(Crash):
            fab.create_mdev(NVME, U1, WEB)
        # meanwhile, someone else's child under the same parent
        fab.bus.writer = fake
        other = str(uuid.uuid4())
        fab.bus.create(PARENT, SHARE_TYPE, other)
    with SmartioFabric(SqliteRegistry.open(state), fake.env, writer=fake) as fab:
        assert [w.uuid for w in fab.wanted_mdevs()] == [U1]  # recorded ...
        assert fab.bus.device(U1) is None  # ... and never made
        assert return_all(fab, WEB, [(NVME, U1)]) == []
        assert fab.wanted_mdevs() == []
        assert fab.device(NVME).holder is None
        assert children(fab) == {other}
        assert return_all(fab, WEB, [(NVME, U1)]) == []  # and a re-run finds nothing to do
