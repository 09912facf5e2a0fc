"""``restore_running`` (the hook's reconnect, reconcile's repair of a running VM) on the
kernel backend: it re-creates or re-records the VM's own mdev and touches no other child."""

# ruff: noqa: F811 (the imported fixtures are parameters of the tests)

from __future__ import annotations

import uuid

from tests.support.fake_sysfs import FakeType
from tests.support.smartio_host import NVME, PARENT, U1, WEB, fabric, fake, state  # noqa: F401
from vmlend.domain import VmlendDevice
from vmlend.kernel.driver import MDEV_TYPE
from vmlend.ledger.shareops import SHARE_MDEV_TYPE
from vmlend.lending.devices import return_all
from vmlend.ops.restore import restore_running


def test_reconnect_records_the_vms_unrecorded_mdev_and_leaves_the_others(fabric, fake):
    """libvirtd restarted while web runs with U1, whose record is gone, beside 22 children of
    another type: reconnect records U1 as web's and touches nothing else; web's release then
    removes U1 only."""
    fake.smartio.extra_types = [FakeType(SHARE_MDEV_TYPE, available=22)]
    fabric.reserve(NVME, WEB)
    fabric.ensure_mdev_parent(NVME)
    fabric.bus.create(PARENT, MDEV_TYPE, U1)  # web's child, without its record
    others = {str(uuid.uuid4()) for _ in range(22)}
    for u in others:
        fabric.bus.create(PARENT, SHARE_MDEV_TYPE, u)
    lines: list[str] = []
    device = VmlendDevice(fdid=NVME, mdev=uuid.UUID(U1))
    assert restore_running(fabric, WEB, [device], 0, lines.append) == []
    assert [(m.uuid, m.vm) for m in fabric.mdev_records()] == [(U1, "web")]
    assert {d.uuid for d in fabric.bus.devices()} == others | {U1}
    assert return_all(fabric, WEB, [(NVME, U1)]) == []
    assert {d.uuid for d in fabric.bus.devices()} == others
