"""A shared NVMe drive across a link fault (issue 23 part 3): when a cable of its crossing into
a VM's node goes down, the drive's manager moves that crossing to another route from the
lender's adapter (the node's other adapter), so the VM's queues and commands go on as they are:
no command is lost, none resubmitted, no controller reset. Without another route the commands
are lost (the guest's driver times out); a two-path share's backup queue pairs are
``test_nvme_multipath.py``'s."""

from __future__ import annotations

import pytest

from tests.support.nvme_guest import guest_driver
from vmlend.sim.hardware import SimHardware
from vmlend.sim.invariants import check_hardware
from vmlend.sim.nvme.driver import NvmeTimeoutError
from vmlend.sim.nvmeshare import SharedNvmeDrive
from vmlend.topology.model import GuestRange, MiB
from vmlend.topology.parse import load_topology

DRIVE = 0x12
PRIMARY = "mxs824/gamma:0"
BACKUP = "mxs824b/gamma:1"
LENDER = "mxs824/alpha:0"


@pytest.fixture
def hw():
    return SimHardware.from_topology(load_topology(), seed=5)


@pytest.fixture
def drive(hw, tmp_path):
    d = SharedNvmeDrive(hw, DRIVE, tmp_path, blocks=1 << 16)
    yield d
    d.close()


def clean(hw, drive) -> None:
    found = check_hardware(hw, shares=drive.grants())
    assert not found, "\n".join(map(str, found))


@pytest.fixture
def guest(hw, drive):
    hw.create_guest("gamma", "web", [GuestRange(0, 64 * MiB)])
    share = drive.open_share("gamma", "web", 1, 4096)
    share.set_master()
    drv = guest_driver(share.bar0, hw.guest("gamma", "web"))
    (queue,) = drv.start(queues=1, entries=16)
    return share, drv, queue


def io(drv, queue, first: int, count: int) -> int:
    """Write then read back ``count`` blocks; how many commands completed as they should."""
    ok = 0
    for lba in range(first, first + count):
        data = bytes([lba % 251 + 1]) * 512
        ok += drv.write(queue, lba, data).ok
        cqe, back = drv.read(queue, lba, 1)
        ok += cqe.ok and back == data
    return ok


def test_a_link_down_moves_the_drives_crossing_and_loses_no_command(hw, drive, guest):
    share, drv, queue = guest
    assert io(drv, queue, 0, 8) == 16
    assert hw.crossing(DRIVE, "gamma").dst.ref == "gamma:0"
    hw.link_down(PRIMARY)
    assert drive.reroutes == [
        ("gamma", "alpha:0 -> gamma:0 via mxs824", "alpha:0 -> gamma:1 via mxs824, mxs824b")
    ]
    assert hw.crossing(DRIVE, "gamma").dst.ref == "gamma:1"
    assert io(drv, queue, 8, 8) == 16  # zero lost: every command completed
    for lba in range(16):  # what was written before the fault is still there
        assert drv.read(queue, lba, 1)[1] == bytes([lba % 251 + 1]) * 512
    assert share.interrupts  # completions still interrupt the VM
    clean(hw, drive)
    hw.link_up(PRIMARY)  # back with its mappings: the crossing goes back to its cheapest route
    assert hw.crossing(DRIVE, "gamma").dst.ref == "gamma:0"
    assert io(drv, queue, 16, 4) == 8
    clean(hw, drive)


def test_a_link_back_without_its_mappings_and_the_other_way_down(hw, drive, guest):
    _, drv, queue = guest
    hw.link_down(PRIMARY)
    hw.link_up(PRIMARY, keep_mappings=False)  # gamma:0 reset: the drive no longer uses it
    assert io(drv, queue, 0, 4) == 8
    hw.link_down(BACKUP)  # now the crossing moves back to gamma:0
    assert hw.crossing(DRIVE, "gamma").dst.ref == "gamma:0"
    assert io(drv, queue, 4, 4) == 8
    clean(hw, drive)


def test_without_another_route_the_commands_are_lost(hw, drive, guest):
    _, drv, queue = guest
    hw.link_down(LENDER)  # the lender's only cable: no other route from alpha:0
    assert drive.reroutes == []
    with pytest.raises(NvmeTimeoutError):
        drv.write(queue, 0, b"\x01" * 512)


def test_the_managers_claims_follow_the_moved_crossing_through_later_reserves(state_path):
    """After a failover the drive's crossing into gamma is on gamma:1; a later share reserve
    (which recomputes the manager's claims from the share records) must keep claiming it
    there, or the claims and the hardware disagree."""
    from tests.support.simcluster import Cluster, assert_matches_registry
    from vmlend.ledger import nvmeshares as shares
    from vmlend.sim.nvmedrive import drive_geometry
    from vmlend.topology.model import Holder

    c = Cluster.create(state_path)
    try:
        geometry = drive_geometry(c.hw.device(DRIVE).spec, 1 << 16)
        shares.lend_shared(c.registry, DRIVE, geometry)
        drive = SharedNvmeDrive(c.hw, DRIVE, state_path.parent, blocks=1 << 16)
        ram = 64 * MiB
        share = shares.reserve_share(
            c.registry, DRIVE, Holder("gamma", "web"), 1, 4096, guest_ram=ram
        )
        c.hw.create_guest("gamma", "web", [GuestRange(0, ram)])
        drive.open_share("gamma", "web", share=share).set_master()

        assert_matches_registry(c)
        c.fabric().set_link_up(PRIMARY, False)
        assert c.hw.crossing(DRIVE, "gamma").dst.ref == "gamma:1"
        assert_matches_registry(c)
        shares.reserve_share(c.registry, DRIVE, Holder("beta", "other"), 1, 4096, guest_ram=ram)
        assert_matches_registry(c)
        drive.close()
    finally:
        c.close()


def test_a_share_reserved_after_the_link_is_back_is_claimed_where_the_crossing_is(state_path):
    """Admission claims the cheapest route for a new share; the drive's crossing goes back to
    it when the link returns, so a share reserved then (and the old one released) leaves the
    claims and the hardware agreeing. Found by the state machine: the crossing used to stay on
    gamma:1 while the new share claimed gamma:0."""
    from tests.support.simcluster import Cluster, assert_matches_registry
    from vmlend.ledger import nvmeshares as shares
    from vmlend.sim.nvmedrive import drive_geometry
    from vmlend.topology.model import Holder

    c = Cluster.create(state_path)
    try:
        shares.lend_shared(c.registry, DRIVE, drive_geometry(c.hw.device(DRIVE).spec, 1 << 16))
        drive = SharedNvmeDrive(c.hw, DRIVE, state_path.parent, blocks=1 << 16)
        ram = 64 * MiB

        def open_(vm: str):
            share = shares.reserve_share(
                c.registry, DRIVE, Holder("gamma", vm), 1, 1024, guest_ram=ram
            )
            c.hw.create_guest("gamma", vm, [GuestRange(0, ram)])
            s = drive.open_share("gamma", vm, share=share)
            s.set_master()
            return s

        first = open_("one")
        c.fabric().set_link_up(PRIMARY, False)
        c.fabric().set_link_up(PRIMARY, True, keep_mappings=False)
        assert c.hw.crossing(DRIVE, "gamma").dst.ref == "gamma:0"
        open_("two")
        shares.release_share(c.registry, DRIVE, Holder("gamma", "one"))
        first.close()
        assert_matches_registry(c)
        drive.close()
    finally:
        c.close()
