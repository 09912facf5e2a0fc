"""A two-path NVMe share (``--paths 2``, issue 23's multipath failover) in relay mode (the
default cluster's drive has one doorbell page; page mode is in test_nvme_two_path_page.py):
its virtual controller relays the guest's queues onto a primary and a backup queue pair
created in advance, each reached through a different adapter of gamma. A link-down of the
primary path (the link event, or a command timeout) switches to the backup with no controller
reset and no command lost (commands in flight on the dead pair are sent again); when the link
comes back the primary pair is deleted and created again (after programming the adapters
again if the link lost its mappings), then used; with no path left the commands are lost as
for a one-path share."""

from __future__ import annotations

import pytest

from tests.support.clocks import FakeClock
from tests.support.nvme_guest import guest_driver
from tests.support.simfabric import two_cable_topology
from vmlend.errors import ConfigError, FabricError
from vmlend.nvme import spec
from vmlend.sim.hardware import SimHardware
from vmlend.sim.invariants import check_hardware
from vmlend.sim.nvme.driver import NvmeTimeoutError
from vmlend.sim.nvmeshare import SharedNvmeDrive
from vmlend.topology.model import GuestRange, MiB
from vmlend.topology.parse import load_topology, parse_topology

DRIVE = 0x12
PRIMARY = "mxs824/gamma:0"
BACKUP = "mxs824b/gamma:1"
LENDER = "mxs824/alpha:0"
DEPTH = 8


@pytest.fixture
def hw():
    return SimHardware.from_topology(load_topology(), seed=5)


def clean(hw, drive) -> None:
    found = check_hardware(hw, shares=drive.grants())
    assert not found, "\n".join(map(str, found))


def open_guest(hw, drive, paths: int = 2):
    hw.create_guest("gamma", "web", [GuestRange(0, 64 * MiB)])
    share = drive.open_share("gamma", "web", 1, 4096, paths=paths)
    share.set_master()
    drv = guest_driver(share.bar0, hw.guest("gamma", "web"))
    (queue,) = drv.start(queues=1, entries=32)
    return share, drv, queue


@pytest.fixture
def setup(hw, tmp_path):
    drive = SharedNvmeDrive(hw, DRIVE, tmp_path, blocks=1 << 16)
    share, drv, queue = open_guest(hw, drive)
    yield drive, share, drv, queue
    drive.close()


def data(lba: int) -> bytes:
    return bytes([lba % 251 + 1]) * 512


def io(drv, queue, first: int, count: int) -> int:
    """Write then read back ``count`` blocks; how many commands completed as they should."""
    ok = 0
    for lba in range(first, first + count):
        ok += drv.write(queue, lba, data(lba)).ok
        cqe, back = drv.read(queue, lba, 1)
        ok += cqe.ok and back == data(lba)
    return ok


def batch(drv, queue, first: int) -> None:
    for lba in range(first, first + DEPTH):
        drv.submit_io(queue, spec.IO_WRITE, lba, 1, data(lba))


def reap_all(drv, queue) -> list:
    done = []
    for _ in range(4):
        done += drv.reap(queue)
    return done


def test_both_pairs_are_created_in_advance_through_different_adapters(hw, setup):
    drive, share, drv, queue = setup
    s = share.share
    assert (s.paths, s.asids) == (2, (s.asid, s.backup_asid))
    # the primary and the backup pair exist before anything fails; the guest sees one queue
    assert drive.controller.queue_ids() == [s.real_qid(1), s.backup_qid(1)]
    assert share.relay.status()["active"] == "primary"
    assert share.backup.dst.ref == "gamma:1" and hw.crossing(DRIVE, "gamma").dst.ref == "gamma:0"
    assert io(drv, queue, 0, 8) == 16
    assert share.traps > 0  # every doorbell is relayed: one software step each
    clean(hw, drive)


def test_a_link_down_switches_to_the_backup_pair_with_nothing_lost(hw, setup):
    drive, share, drv, queue = setup
    assert io(drv, queue, 0, 4) == 8
    queues_before = drive.controller.queue_ids()
    batch(drv, queue, 100)  # in the guest's submission queue, not rung yet
    hw.link_down(PRIMARY)
    assert share.relay.status()["active"] == "backup"
    assert share.relay.stats.switches == [("backup", f"link {PRIMARY} down")]
    drv.ring(queue)
    done = reap_all(drv, queue)
    assert len(done) == DEPTH and all(c.ok for c in done)
    assert io(drv, queue, 200, 8) == 16
    for lba in range(100, 100 + DEPTH):  # the batch reached the drive once, intact
        assert drv.read(queue, lba, 1)[1] == data(lba)
    # no controller reset: the same real queues, the admin queues still the manager's
    assert drive.controller.queue_ids() == queues_before and drive.controller.ready
    clean(hw, drive)


def test_commands_in_flight_on_the_dead_pair_are_sent_again_on_the_backup(hw, tmp_path):
    """The guest rings while the cable is already dead and before the link event arrives:
    the relay's doorbell for the primary pair is dropped at the dead cable, so the drive
    fetches nothing. The event then switches, and the relay sends those commands again on
    the backup pair."""
    pending = {}
    hw.on_link_change(lambda link, up: None if up else pending.pop("ring", lambda: None)())
    drive = SharedNvmeDrive(hw, DRIVE, tmp_path, blocks=1 << 16)
    try:
        share, drv, queue = open_guest(hw, drive)
        batch(drv, queue, 0)
        pending["ring"] = lambda: drv.ring(queue)
        hw.link_down(PRIMARY)
        assert share.relay.stats.resubmitted == DEPTH
        done = reap_all(drv, queue)
        assert sorted(c.cid for c in done if c.ok) == sorted(c.cid for c in done)
        assert len(done) == DEPTH
        for lba in range(DEPTH):
            assert drv.read(queue, lba, 1)[1] == data(lba)
        clean(hw, drive)
        # back with its mappings: the primary pair is created again (the drive's position on
        # it is unknown), then used
        hw.link_up(PRIMARY)
        assert share.relay.status()["active"] == "primary"
        assert io(drv, queue, 50, 40) == 80  # wraps the relay rings: positions agree
        clean(hw, drive)
    finally:
        drive.close()


def test_a_command_timeout_switches_when_the_link_event_is_missed(hw, tmp_path):
    clock = FakeClock()
    drive = SharedNvmeDrive(
        hw, DRIVE, tmp_path, blocks=1 << 16, link_events=False, clock=clock, command_timeout=5
    )
    try:
        share, drv, queue = open_guest(hw, drive)
        assert share.timeout() is False  # nothing outstanding: nothing to do
        hw.link_down(PRIMARY)
        assert share.relay.status()["active"] == "primary"  # nobody told it
        batch(drv, queue, 0)
        drv.ring(queue)
        assert drv.reap(queue) == []  # the relay's doorbell died at the cable
        assert share.relay.outstanding() == DEPTH
        clock.advance(4.9)
        assert share.timeout() is False  # not yet, on the injected clock
        clock.advance(0.1)
        assert share.timeout() is True
        assert share.relay.stats.switches == [("backup", "command timeout")]
        done = reap_all(drv, queue)
        assert len(done) == DEPTH and all(c.ok for c in done)
        assert io(drv, queue, 100, 4) == 8
        clean(hw, drive)
    finally:
        drive.close()


def test_a_link_back_without_its_mappings_recreates_the_old_pair(hw, setup):
    drive, share, drv, queue = setup
    s = share.share
    hw.link_down(PRIMARY)
    assert io(drv, queue, 0, 4) == 8
    hw.link_up(PRIMARY, keep_mappings=False)
    assert share.relay.status() == {
        "active": "primary",
        "mode": "relay",
        "switches": [
            ["backup", f"link {PRIMARY} down"],
            ["primary", f"link {PRIMARY} up without its mappings"],
        ],
        "resubmitted": 0,
        "taken_over": 0,
        "recreated": 1,
    }
    assert drive.controller.queue_ids() == [s.real_qid(1), s.backup_qid(1)]
    # the crossing is back on gamma:0: the primary and the backup use different adapters again
    assert hw.crossing(DRIVE, "gamma").dst.ref == "gamma:0"
    assert io(drv, queue, 4, 40) == 80
    for lba in range(4):
        assert drv.read(queue, lba, 1)[1] == data(lba)
    clean(hw, drive)
    # and it can fail over again afterwards
    hw.link_down(PRIMARY)
    assert share.relay.status()["active"] == "backup"
    assert io(drv, queue, 60, 4) == 8
    clean(hw, drive)


def test_with_no_path_left_the_commands_are_lost_as_for_one_path(hw, setup):
    drive, share, drv, queue = setup
    hw.link_down(PRIMARY)
    assert io(drv, queue, 0, 2) == 4
    hw.link_down(BACKUP)  # the second link-down: no backup for the backup
    with pytest.raises(NvmeTimeoutError):
        drv.write(queue, 10, data(10))
    assert share.relay.status()["active"] == "backup"
    clean(hw, drive)


def test_the_lenders_own_cable_leaves_no_path_to_switch_to(hw, setup):
    _drive, share, drv, queue = setup
    hw.link_down(LENDER)  # both paths leave alpha:0 by this cable
    assert share.relay.status()["active"] == "primary" and share.relay.stats.switches == []
    with pytest.raises(NvmeTimeoutError):
        drv.write(queue, 0, data(0))


def test_the_guard_and_the_prp_rules_hold_on_the_backup_pair(hw, setup):
    drive, share, drv, queue = setup
    hw.link_down(PRIMARY)
    cqe = drv.submit_raw(
        queue, spec.io_command(spec.IO_READ, 0x77, 1, 4096, 1, prp1=0x100_0000)
    )  # one past the share's 4096 blocks
    assert cqe.status == spec.SC_LBA_OUT_OF_RANGE
    assert drive.manager.rejections(share.name) == 1
    # a buffer where the guest has no RAM reaches nothing through the backup's windows
    cqe = drv.submit_raw(queue, spec.io_command(spec.IO_READ, 0x78, 1, 0, 1, prp1=1 << 40))
    assert cqe.status == spec.SC_DATA_TRANSFER_ERROR
    assert io(drv, queue, 0, 2) == 4
    clean(hw, drive)


def test_a_link_back_never_switches_onto_a_primary_path_still_down(tmp_path):
    """A lender with two adapters: the primary path (l:0-b:0) has no detour, so while its
    cable is down only the backup works. The backup's own cable going down and coming back
    must leave the share on its backup pair."""
    hw = SimHardware.from_topology(parse_topology(two_cable_topology()), seed=5)
    drive = SharedNvmeDrive(hw, DRIVE, tmp_path, blocks=1 << 16)
    try:
        hw.create_guest("b", "web", [GuestRange(0, 64 * MiB)])
        share = drive.open_share("b", "web", 1, 4096, paths=2)
        share.set_master()
        drv = guest_driver(share.bar0, hw.guest("b", "web"))
        (queue,) = drv.start(queues=1, entries=32)
        assert hw.crossing(DRIVE, "b").dst.ref == "b:0" and share.backup.dst.ref == "b:1"
        hw.link_down("l:0-b:0")
        assert share.relay.status()["active"] == "backup"
        assert io(drv, queue, 0, 4) == 8
        hw.link_down("l:1-b:1")  # no path left
        hw.link_up("l:1-b:1")
        assert io(drv, queue, 4, 4) == 8  # on the backup: nothing lost
        assert share.relay.status()["active"] == "backup"
        assert share.relay.stats.switches == [("backup", "link l:0-b:0 down")]
        clean(hw, drive)
        hw.link_up("l:0-b:0")  # the primary is back: now it switches
        assert share.relay.status()["active"] == "primary"
        assert io(drv, queue, 8, 4) == 8
        clean(hw, drive)
    finally:
        drive.close()


def test_the_relay_refuses_bad_queue_commands(hw, setup):
    _drive, share, drv, queue = setup
    relay = share.relay
    assert relay.create_sq(share.share, 1, 0x100_0000, 16, 1) == spec.SC_INVALID_QID  # exists
    assert relay.create_cq(share.share, 1, 0x200_0000, 16, 1, True) == spec.SC_INVALID_QID
    assert relay.delete_cq(share.share, 1) == spec.SC_INVALID_QUEUE_DELETION  # SQ 1 uses it
    relay.sq_doorbell(1, 1000)  # beyond the queue: ignored
    relay.sq_doorbell(7, 1)  # no such queue: ignored
    assert io(drv, queue, 0, 2) == 4


def test_closing_a_two_path_share_leaves_nothing(hw, setup):
    drive, share, _drv, _queue = setup
    gamma = hw.node("gamma").memory
    rings = list(share.rings.frames)
    assert all(gamma.owner_of(f) == "web" for f in rings)
    hw.link_down(PRIMARY)
    share.close()
    assert drive.controller.queue_ids() == [] and share.rings is None
    assert all(gamma.owner_of(f) is None for f in rings)
    assert drive.grants() == []
    clean(hw, drive)


def test_a_vm_on_the_lender_cannot_have_two_paths(hw, tmp_path):
    drive = SharedNvmeDrive(hw, DRIVE, tmp_path, blocks=1 << 16)
    try:
        hw.create_guest("alpha", "local", [GuestRange(0, 64 * MiB)])
        with pytest.raises(FabricError, match="crosses no NTB: one path only"):
            drive.open_share("alpha", "local", 1, 16, paths=2)
        assert drive.shares == {} and drive.manager.shares() == []
    finally:
        drive.close()


def test_the_registry_claims_match_what_both_paths_map_across_link_events(state_path):
    """Reserved with --paths 2, opened and mapped: the checker with the registry's claims
    finds every segment of both paths claimed (windows and rings), through a link-down and
    back, with the fabric's link handling (claims following moved crossings)."""
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
            c.registry, DRIVE, Holder("gamma", "web"), 1, 4096, guest_ram=ram, paths=2
        )
        c.hw.create_guest("gamma", "web", [GuestRange(0, ram)])
        vms = drive.open_share("gamma", "web", share=share)
        vms.set_master()
        drv = guest_driver(vms.bar0, c.hw.guest("gamma", "web"))
        (queue,) = drv.start(queues=1, entries=32)

        assert_matches_registry(c)
        assert io(drv, queue, 0, 2) == 4
        c.fabric().set_link_up(PRIMARY, False)
        assert vms.relay.status()["active"] == "backup"
        assert io(drv, queue, 2, 2) == 4
        assert_matches_registry(c)
        c.fabric().set_link_up(PRIMARY, True)
        assert vms.relay.status()["active"] == "primary"
        assert io(drv, queue, 4, 2) == 4
        assert_matches_registry(c)
        drive.close()
        assert_matches_registry(c)
    finally:
        c.close()


def test_a_two_path_share_started_while_the_cheapest_route_is_down_leaves_the_crossing(
    hw, tmp_path
):
    """gamma:0's cable is down when a two-path share maps: the node's crossing takes the live
    route through gamma:1 and there is no other live adapter for a backup. The share is
    refused (its Bus Master stays clear) rather than given a backup over the dead cable,
    whose LUT entry would make the node's doorbells guess that dead route; a one-path share
    on the node keeps working throughout."""
    drive = SharedNvmeDrive(hw, DRIVE, tmp_path, blocks=1 << 16)
    try:
        hw.link_down(PRIMARY)
        _one, drv1, q1 = open_guest(hw, drive, paths=1)
        assert hw.crossing(DRIVE, "gamma").dst.ref == "gamma:1"
        hw.create_guest("gamma", "db", [GuestRange(0, 64 * MiB)])
        two = drive.open_share("gamma", "db", 1, 4096, paths=2)
        with pytest.raises(FabricError, match="no second adapter"):
            two.set_master()
        assert two.backup is None and "gamma:0" not in hw.entry_adapters(DRIVE, "gamma")
        assert hw.crossing(DRIVE, "gamma").dst.ref == "gamma:1"
        assert io(drv1, q1, 0, 4) == 8
        clean(hw, drive)
    finally:
        drive.close()


def test_a_lender_with_two_adapters_gives_no_backup_over_a_dead_cable(tmp_path):
    """A lender with two adapters, l:0-b:0 down when the share maps: the crossing takes
    l:1-b:1, and the backup (cheapest live route into another adapter of b) is none, so the
    share is refused; with the cable back the share maps with its primary on l:0-b:0."""
    hw = SimHardware.from_topology(parse_topology(two_cable_topology()), seed=5)
    drive = SharedNvmeDrive(hw, DRIVE, tmp_path, blocks=1 << 16)
    try:
        hw.link_down("l:0-b:0")
        hw.create_guest("b", "web", [GuestRange(0, 64 * MiB)])
        share = drive.open_share("b", "web", 1, 4096, paths=2)
        with pytest.raises(FabricError, match="no second adapter"):
            share.set_master()
        assert share.backup is None and hw.share_crossings(DRIVE) == []
        hw.link_up("l:0-b:0")
        share.set_master()
        assert hw.crossing(DRIVE, "b").dst.ref == "b:0" and share.backup.dst.ref == "b:1"
        drv = guest_driver(share.bar0, hw.guest("b", "web"))
        (queue,) = drv.start(queues=1, entries=32)
        assert io(drv, queue, 0, 4) == 8
        clean(hw, drive)
    finally:
        drive.close()


def test_a_backup_path_unmapped_with_bus_master_is_not_switched_to(hw, setup):
    """Bus Master cleared: the backup crossing's ports, LUT entries and segments go, and so
    does the share's record of it; a link-down of the primary then finds no backup to switch
    onto (a one-path share keeps the node's crossing on the dead cable)."""
    drive, share, _drv, _queue = setup
    hw.create_guest("gamma", "db", [GuestRange(0, 64 * MiB)])
    other = drive.open_share("gamma", "db", 1, 4096)
    other.set_master()
    share.set_master(False)
    hw.link_down(PRIMARY)
    assert share.relay.status()["active"] == "primary" and share.relay.stats.switches == []
    assert share.backup is None and all(not c.backup_of for c in hw.share_crossings(DRIVE))
    clean(hw, drive)
    hw.link_up(PRIMARY)
    share.set_master()  # mapped again: a backup again, and it fails over
    assert share.backup is not None and share.backup.dst.ref == "gamma:1"
    hw.link_down(PRIMARY)
    assert share.relay.status()["active"] == "backup"
    clean(hw, drive)


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf")])
def test_a_bad_command_timeout_is_refused_before_the_drive_is_taken(hw, tmp_path, timeout):
    with pytest.raises(ConfigError, match="command timeout must be a positive, finite"):
        SharedNvmeDrive(hw, DRIVE, tmp_path, blocks=1 << 16, command_timeout=timeout)
    assert hw.borrowed(DRIVE) is None  # nothing taken: the drive can be shared again
    SharedNvmeDrive(hw, DRIVE, tmp_path, blocks=1 << 16).close()
