"""End to end in the simulator: domains asking for NVMe shares start through the hook's
prepare (share + share mdev), their SimVms get virtual controllers served by the drive's
manager, their guests' drivers do I/O; one VM stops and is released while the other goes on."""

from __future__ import annotations

import pytest

from tests.support.nvme_guest import guest_driver, share_xml, shared_drive
from vmlend.errors import FabricError
from vmlend.ledger import nvmeshares as ledger
from vmlend.nvme import spec
from vmlend.sim.simvm import SimVm

NVME = 0x12
BLOCKS = 1 << 20


@pytest.fixture
def setup(state_path, tmp_path):
    with shared_drive(state_path, tmp_path, fdid=NVME, blocks=BLOCKS) as both:
        yield both


def start(c, drive, xml, node):
    c.prepare(xml, node)
    return SimVm(xml, hardware=c.hw, fabric=c.fabric(node), nvme={NVME: drive})


def test_two_vms_started_by_the_hook_share_the_drive(setup):
    c, drive = setup
    xa, xb = share_xml("sa", queues=2), share_xml("sb")
    va, vb = start(c, drive, xa, "gamma"), start(c, drive, xb, "beta")
    assert va.shares() == [NVME] and va.devices() == []  # no exclusive borrow of the drive
    va.nvme_share(NVME).set_master()
    vb.nvme_share(NVME).set_master()
    da = guest_driver(va.nvme_share(NVME).bar0, va.guest)
    db = guest_driver(vb.nvme_share(NVME).bar0, vb.guest)
    qa, qb = da.start(queues=2)[0], db.start(queues=1)[0]
    assert da.identify_namespace(1) == (65536, 512)
    assert da.write(qa, 0, b"a" * 4096).ok and db.write(qb, 0, b"b" * 4096).ok
    assert da.write(qa, 65536, b"a" * 512).status == spec.SC_LBA_OUT_OF_RANGE
    # A stops and the hook releases it: its queues and its share go, B goes on
    va.stop()
    c.release(xa, "gamma")
    assert [str(e.holder) for e in ledger.shared_drives(c.registry)[NVME][2]] == ["beta/sb"]
    assert c.fabric("gamma").mdevs() == []
    assert db.read(qb, 0, 8)[1] == b"b" * 4096
    for i in range(8):
        assert db.write(qb, i, bytes([i]) * 512).ok
    assert db.read(qb, 0, 8)[1] == b"".join(bytes([i]) * 512 for i in range(8))
    vb.stop()
    c.release(xb, "beta")
    assert ledger.shared_drives(c.registry)[NVME][2] == []
    assert drive.manager.real_queues("vm:beta/sb") == []


def test_a_vm_whose_share_has_no_manager_here_fails_to_start_cleanly(setup):
    c, _drive = setup
    xml = share_xml("lonely")
    c.prepare(xml)
    with pytest.raises(FabricError, match="no manager serves"):
        SimVm(xml, hardware=c.hw, fabric=c.fabric())
    with pytest.raises(FabricError):
        c.hw.guest("gamma", "lonely")  # its RAM is gone again
