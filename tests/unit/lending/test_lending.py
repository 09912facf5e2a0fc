"""The shared return step on the kernel backend, where an mdev can really refuse to go."""

from __future__ import annotations

import pytest

from tests.support.smartio_host import NVME, U1, WEB, fabric, fake, start_vm, state  # noqa: F401
from vmlend.errors import DeviceHeldError
from vmlend.lending.devices import return_all
from vmlend.topology.model import Holder


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
