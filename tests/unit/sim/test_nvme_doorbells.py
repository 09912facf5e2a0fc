"""A shared drive's doorbells across a pulled adapter (issue 40, point 1).

The guest's SQ tail write is MMIO from its node: it leaves by the node's adapter and enters
the lender by the lender's (``vmlend.sim.mmio``), so a cable pulled while it is on its way
takes it along. (A posted write still in the borrower's adapter when the cable goes is lost
with it; the simulator delivers a write at once, so these tests pull the cable between the
guest's submission entry and its tail write, which the drive sees the same way: no tail, no
fetch.) One path: the doorbell is lost and the guest's command timeout fires, on the clock the
test injects. Two paths: the command completes through the node's other adapter."""

from __future__ import annotations

import pytest

from tests.support.clocks import FakeClock
from tests.support.nvme_guest import guest_driver
from vmlend.nvme import spec
from vmlend.sim.hardware import SimHardware
from vmlend.sim.invariants import check_hardware
from vmlend.sim.nvmeshare import SharedNvmeDrive
from vmlend.topology.model import GuestRange, MiB
from vmlend.topology.parse import load_topology

DRIVE = 0x12  # on alpha
BETA = "mxs824/beta:0"  # beta's only adapter
PRIMARY = "mxs824/gamma:0"  # gamma's first adapter: a two-path share's primary path
TIMEOUT = 30.0


@pytest.fixture
def hw():
    return SimHardware.from_topology(load_topology(), seed=5)


@pytest.fixture
def clock():
    return FakeClock()


def clean(hw, drive) -> None:
    found = check_hardware(hw, shares=drive.grants())
    assert not found, "\n".join(map(str, found))


def start(hw, drive, node: str, paths: int, clock):
    hw.create_guest(node, "web", [GuestRange(0, 64 * MiB)])
    share = drive.open_share(node, "web", 1, 4096, paths=paths)
    share.set_master()
    drv = guest_driver(share.bar0, hw.guest(node, "web"), clock=clock, timeout=TIMEOUT)
    (queue,) = drv.start(queues=1, entries=16)
    return share, drv, queue


def submit(drv, queue, lba: int) -> int:
    """The guest writes one command into its submission queue (no doorbell yet)."""
    req = drv.submit_io(queue, spec.IO_WRITE, lba, 1, bytes([lba + 1]) * 512)
    return req.cid


def test_one_path_the_doorbell_is_lost_and_the_timeout_fires(hw, tmp_path, clock):
    drive = SharedNvmeDrive(hw, DRIVE, tmp_path, blocks=1 << 16, clock=clock)
    try:
        share, drv, queue = start(hw, drive, "beta", 1, clock)
        real = share.share.real_qid(queue.qid)
        assert drv.write(queue, 0, b"\x01" * 512).ok  # the path works
        tail = drive.controller.sq_tail(real)
        cid = submit(drv, queue, 1)
        hw.link_down(BETA)
        drv.ring(queue)
        # the tail never reached the drive: nothing fetched, nothing completes
        assert drive.controller.sq_tail(real) == tail
        assert hw.mmio.stats.dropped["beta:0"] == 1
        assert drv.reap(queue) == []
        assert drv.overdue(queue) == []  # not yet: the timeout is the clock's
        clock.advance(TIMEOUT - 0.5)
        assert drv.overdue(queue) == []
        clock.advance(0.5)
        assert drv.overdue(queue) == [cid]
        clean(hw, drive)
    finally:
        drive.close()


def test_one_path_the_doorbell_follows_a_moved_crossing(hw, tmp_path, clock):
    """A node with a second adapter: the link event moves the drive's crossing, and the
    doorbell goes by the crossing's adapter, so nothing is lost."""
    drive = SharedNvmeDrive(hw, DRIVE, tmp_path, blocks=1 << 16, clock=clock)
    try:
        _share, drv, queue = start(hw, drive, "gamma", 1, clock)
        submit(drv, queue, 1)
        hw.link_down(PRIMARY)
        before = hw.mmio.stats.delivered["gamma:1"]
        drv.ring(queue)
        (done,) = drv.reap(queue)
        assert done.ok and drv.overdue(queue) == []
        assert hw.mmio.stats.delivered["gamma:1"] == before + 2  # SQ tail, CQ head
        assert hw.mmio.stats.dropped["gamma:0"] == 0
    finally:
        drive.close()


def test_two_paths_the_command_completes_through_the_other_adapter(hw, tmp_path, clock):
    """The VM's host missed the link event: the relay's doorbell on the primary pair dies at
    the cable, its command timer fires on the clock, and the command is sent again on the
    backup pair, whose doorbell goes by gamma:1."""
    drive = SharedNvmeDrive(hw, DRIVE, tmp_path, blocks=1 << 16, link_events=False, clock=clock)
    try:
        share, drv, queue = start(hw, drive, "gamma", 2, clock)
        s = share.share
        primary, backup = s.real_qid(queue.qid), s.backup_qid(queue.qid)
        assert drv.write(queue, 0, b"\x01" * 512).ok
        tail = drive.controller.sq_tail(primary)
        cid = submit(drv, queue, 1)
        hw.link_down(PRIMARY)
        drv.ring(queue)
        assert drive.controller.sq_tail(primary) == tail  # the relay's doorbell was lost
        assert hw.mmio.stats.dropped["gamma:0"] == 1
        assert drv.reap(queue) == []
        assert share.timeout() is False  # its deadline has not passed on the clock
        clock.advance(TIMEOUT)
        assert share.timeout() is True
        assert drive.controller.sq_tail(backup) == 1  # sent again on the backup pair
        (done,) = drv.reap(queue)
        assert (done.cid, done.ok) == (cid, True)
        assert drv.overdue(queue) == []  # completed: the guest's own timer stopped
        assert hw.mmio.stats.delivered["gamma:1"] >= 1
        assert drv.read(queue, 1, 1)[1] == b"\x02" * 512
        clean(hw, drive)
    finally:
        drive.close()


def test_two_paths_with_the_link_event_the_doorbell_takes_the_backup(hw, tmp_path, clock):
    drive = SharedNvmeDrive(hw, DRIVE, tmp_path, blocks=1 << 16, clock=clock)
    try:
        share, drv, queue = start(hw, drive, "gamma", 2, clock)
        cid = submit(drv, queue, 3)
        hw.link_down(PRIMARY)  # the event: the relay is on its backup pair at once
        dropped = hw.mmio.stats.dropped["gamma:0"]
        drv.ring(queue)
        (done,) = drv.reap(queue)
        assert (done.cid, done.ok) == (cid, True)
        assert hw.mmio.stats.dropped["gamma:0"] == dropped  # nothing rang the dead path
        assert drive.controller.sq_tail(share.share.backup_qid(queue.qid)) == 1
        clean(hw, drive)
    finally:
        drive.close()
