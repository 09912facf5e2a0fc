"""A two-path NVMe share in page mode (issue 40, point 1): 0 software steps per doorbell until
a fault, and no command lost across it.

The drive (0x40 of ``sharing_topology(paths=2)``) has doorbell pages to spare, and b1 two
adapters on two switches. A guest that uses shadow doorbells (Doorbell Buffer Config, which
its virtual controller advertises) gets its own rings as the primary pair's real queues and
its doorbell page mapped onto the share's real page through b1:0: no software per doorbell,
no command copied. When b1:0's cable goes (the link event, or a command timeout on the
injected clock when the event is missed), the virtual controller takes the queues over once
(the guest's tails from its shadow doorbells, the drive's position from the guest's
completion queue) and relays them onto the backup pair through b1:1, every doorbell trapped
from then on. A guest that never configures shadow doorbells is relayed from the start."""

from __future__ import annotations

import pytest

from tests.support.clocks import FakeClock
from tests.support.nvme_guest import guest_driver
from vmlend.nvme import spec
from vmlend.nvme.identify import parse_identify_controller
from vmlend.sim.hardware import SimHardware
from vmlend.sim.invariants import check_hardware
from vmlend.sim.nvmeshare import SharedNvmeDrive
from vmlend.sim.nvmetopology import SHARED_NVME, sharing_topology
from vmlend.topology.model import GuestRange, MiB
from vmlend.topology.parse import parse_topology

PRIMARY = "sw/b1:0"  # the borrower's adapter of the primary path
TIMEOUT = 30.0
ENTRIES = 32


@pytest.fixture
def hw():
    return SimHardware.from_topology(parse_topology(sharing_topology(1, paths=2)), seed=5)


@pytest.fixture
def clock():
    return FakeClock()


def clean(hw, drive) -> None:
    found = check_hardware(hw, shares=drive.grants())
    assert not found, "\n".join(map(str, found))


def make_drive(hw, tmp_path, clock, **kw) -> SharedNvmeDrive:
    return SharedNvmeDrive(hw, SHARED_NVME, tmp_path, blocks=1 << 16, clock=clock, **kw)


def start(hw, drive, clock, paths: int = 2, shadow: bool = True):
    hw.create_guest("b1", "web", [GuestRange(0, 64 * MiB)])
    share = drive.open_share("b1", "web", 1, 4096, paths=paths)
    share.set_master()
    drv = guest_driver(
        share.bar0, hw.guest("b1", "web"), clock=clock, timeout=TIMEOUT, shadow_doorbells=shadow
    )
    (queue,) = drv.start(queues=1, entries=ENTRIES)
    return share, drv, queue


def data(lba: int) -> bytes:
    return bytes([lba % 251 + 1]) * 512


def io(drv, queue, first: int, count: int) -> int:
    ok = 0
    for lba in range(first, first + count):
        ok += drv.write(queue, lba, data(lba)).ok
        cqe, back = drv.read(queue, lba, 1)
        ok += cqe.ok and back == data(lba)
    return ok


def submit(drv, queue, first: int, count: int) -> list[int]:
    """Commands written into the guest's submission queue (no doorbell yet)."""
    return [
        drv.submit_io(queue, spec.IO_WRITE, lba, 1, data(lba)).cid
        for lba in range(first, first + count)
    ]


def test_the_virtual_controller_advertises_shadow_doorbells_only_where_page_mode_can_be(
    hw, tmp_path, clock
):
    drive = make_drive(hw, tmp_path, clock)
    try:
        share, drv, _queue = start(hw, drive, clock)
        assert parse_identify_controller(drv.identify(spec.CNS_CONTROLLER))["oacs"] & (
            spec.OACS_DBBUF
        )
        assert drv.shadow is not None and share.relay.mode == "page"
        hw.create_guest("b1", "one", [GuestRange(0, 64 * MiB)])
        one = drive.open_share("b1", "one", 1, 4096)  # one path: nothing to take over
        one.set_master()
        d1 = guest_driver(one.bar0, hw.guest("b1", "one"))
        d1.start(queues=1, entries=ENTRIES)
        assert d1.oacs & spec.OACS_DBBUF == 0 and d1.shadow is None
    finally:
        drive.close()


def test_page_mode_takes_no_software_step_per_doorbell_and_copies_no_command(hw, tmp_path, clock):
    drive = make_drive(hw, tmp_path, clock)
    try:
        share, drv, queue = start(hw, drive, clock)
        assert io(drv, queue, 0, 40) == 80  # wraps the guest's rings
        before = share.steps["before_fault"]
        assert before.doorbells == 160 and before.traps == 0 and share.traps == 0
        assert share.relay.stats.relayed == 0  # no command copied
        assert "doorbell-page" in {w.kind for w in drive.wiring()}  # the page is mapped
        # the backup pair exists already: a failover creates nothing
        s = share.share
        assert drive.controller.queue_ids() == [s.real_qid(1), s.backup_qid(1)]
        clean(hw, drive)
    finally:
        drive.close()


@pytest.mark.parametrize("paths", [1, 2])
def test_the_borrowers_adapter_pulled_between_the_sq_tail_and_the_fetch(hw, tmp_path, clock, paths):
    """The issue's test, both ways. The guest writes its SQ tail while b1:0's cable is
    going (the hook runs the write at the link-down, before the drive's link handling), so
    the doorbell dies at b1:0 and the drive fetches nothing. One path: the guest's command
    timeout fires on the injected clock. Two paths: the link event takes the share's queues
    over and the command completes through b1:1; 0 lost, run once."""
    rings = []
    hw.on_link_change(lambda link, up: None if up or not rings else rings.pop()())
    drive = make_drive(hw, tmp_path, clock)
    try:
        share, drv, queue = start(hw, drive, clock, paths=paths)
        assert io(drv, queue, 0, 20) == 40  # the CQ wrapped once: its phase flipped
        real = share.share.real_qid(queue.qid)
        tail = drive.controller.sq_tail(real)
        cids = submit(drv, queue, 100, 4)
        commands = drive.controller.stats.commands
        rings.append(lambda: drv.ring(queue))
        hw.link_down(PRIMARY)
        assert hw.mmio.stats.dropped["b1:0"] >= 1
        assert drive.controller.sq_tail(real) == tail  # the tail never reached the drive
        if paths == 1:
            assert drv.reap(queue) == []
            clock.advance(TIMEOUT - 0.5)
            assert drv.overdue(queue) == []
            clock.advance(0.5)
            assert drv.overdue(queue) == cids
            return
        assert share.steps["before_fault"].doorbells == 81
        assert share.steps["before_fault"].traps == 0
        done = drv.reap(queue)
        assert sorted(c.cid for c in done) == sorted(cids) and all(c.ok for c in done)
        assert drv.overdue(queue) == []
        assert share.relay.stats.taken_over == 4 and share.relay.stats.resubmitted == 0
        assert drive.controller.stats.commands == commands + 4  # each ran once
        assert drive.controller.sq_tail(share.share.backup_qid(queue.qid)) == 4
        for lba in range(100, 104):
            assert drv.read(queue, lba, 1)[1] == data(lba)
        after = share.steps["after_fault"]
        assert after.doorbells > 0 and after.traps == after.doorbells  # relayed now
        assert "doorbell-page" not in {w.kind for w in drive.wiring()}  # unmapped, trapped
        clean(hw, drive)
    finally:
        drive.close()


@pytest.mark.parametrize("before", [0, 5, 31, 32, 45])
def test_a_missed_link_event_is_a_timeout_on_the_injected_clock(hw, tmp_path, clock, before):
    """The VM's host misses the event: the guest's doorbell dies at b1:0; the virtual
    controller's timer check sees the guest's shadow tail ahead of what its completion queue
    shows done and starts a deadline, and fails over when it passes, whatever the rings'
    positions (``before`` commands completed first: none, a wrap, exactly a lap, more)."""
    drive = make_drive(hw, tmp_path, clock, link_events=False)
    try:
        share, drv, queue = start(hw, drive, clock)
        for lba in range(before):
            assert drv.write(queue, lba, data(lba)).ok
        assert share.relay.mode == "page" and share.traps == 0
        assert share.timeout() is False  # nothing outstanding
        hw.link_down(PRIMARY)
        cids = submit(drv, queue, 200, 3)
        drv.ring(queue)
        assert drv.reap(queue) == []
        assert share.timeout() is False  # the deadline starts now, on the clock
        clock.advance(TIMEOUT - 0.1)
        assert share.timeout() is False
        clock.advance(0.1)
        assert share.timeout() is True
        assert share.relay.stats.switches == [("backup", "command timeout")]
        done = drv.reap(queue)
        assert [c.cid for c in done] == cids and all(c.ok for c in done)
        assert io(drv, queue, 300, 20) == 40
        for lba in range(200, 203):
            assert drv.read(queue, lba, 1)[1] == data(lba)
        clean(hw, drive)
    finally:
        drive.close()


@pytest.mark.parametrize("rung", [True, False])
def test_completions_the_guest_has_not_reaped_are_kept_and_not_run_again(hw, tmp_path, clock, rung):
    """At the fault the guest's completion queue holds completions it has not consumed, and
    its submission queue commands the drive has not fetched (``rung``: their doorbell died
    at the cable; else the guest rings them after the fault): the first stay where they are
    (not run again, not written over), the second complete after them, each run once."""
    rings = []
    hw.on_link_change(lambda link, up: None if up or not rings else rings.pop()())
    drive = make_drive(hw, tmp_path, clock)
    try:
        share, drv, queue = start(hw, drive, clock)
        assert io(drv, queue, 0, 3) == 6
        done_first = submit(drv, queue, 10, 5)
        drv.ring(queue)  # completed by the drive, not reaped by the guest
        waiting = submit(drv, queue, 20, 5)
        commands = drive.controller.stats.commands
        if rung:
            rings.append(lambda: drv.ring(queue))
        hw.link_down(PRIMARY)
        assert share.relay.stats.taken_over == (5 if rung else 0)
        if not rung:
            drv.ring(queue)
        done = drv.reap(queue)
        assert [c.cid for c in done] == done_first + waiting and all(c.ok for c in done)
        assert drive.controller.stats.commands == commands + 5
        for lba in [*range(10, 15), *range(20, 25)]:
            assert drv.read(queue, lba, 1)[1] == data(lba)
        clean(hw, drive)
    finally:
        drive.close()


def test_a_guest_without_shadow_doorbells_is_relayed_from_the_start(hw, tmp_path, clock):
    """Without the guest's tails in its memory nothing could take page-mode queues over:
    every doorbell is trapped (one software step each), and failover loses nothing."""
    drive = make_drive(hw, tmp_path, clock)
    try:
        share, drv, queue = start(hw, drive, clock, shadow=False)
        assert drv.shadow is None and share.relay.mode == "relay"
        assert io(drv, queue, 0, 10) == 20
        steps = share.steps["before_fault"]
        assert steps.doorbells == 40 and steps.traps == 40
        submit(drv, queue, 50, 4)
        hw.link_down(PRIMARY)
        drv.ring(queue)
        assert len([c for c in drv.reap(queue) if c.ok]) == 4
        assert share.relay.stats.taken_over == 0
        clean(hw, drive)
    finally:
        drive.close()


def test_switching_back_stays_relayed_until_the_guest_creates_its_queues_again(hw, tmp_path, clock):
    drive = make_drive(hw, tmp_path, clock)
    try:
        share, drv, queue = start(hw, drive, clock)
        assert io(drv, queue, 0, 5) == 10
        hw.link_down(PRIMARY)
        assert io(drv, queue, 5, 5) == 10
        hw.link_up(PRIMARY)
        # a new real queue starts at 0; the guest's rings are elsewhere: relayed on the primary
        assert share.relay.status()["active"] == "primary"
        assert share.relay.mode == "relay"
        traps = share.traps
        assert io(drv, queue, 10, 40) == 80
        assert share.traps == traps + 160
        # the guest resets its controller and creates its queues again: page mode
        (queue,) = drv.start(queues=1, entries=ENTRIES)
        assert share.relay.mode == "page"
        assert io(drv, queue, 60, 10) == 20
        assert share.traps == traps + 160
        for lba in [*range(0, 50, 7), 60, 69]:
            assert drv.read(queue, lba, 1)[1] == data(lba)
        clean(hw, drive)
        hw.link_down(PRIMARY)  # and it fails over again, nothing lost
        assert io(drv, queue, 80, 4) == 8
    finally:
        drive.close()


def test_the_shadow_buffer_before_the_queues_and_bad_buffers(hw, tmp_path, clock):
    """A guest may configure its buffer before creating its queues (they are created in page
    mode); a buffer not page-aligned or outside its RAM is refused (Invalid Field), and so is
    a second one while page-mode queues use the first (Command Sequence Error)."""
    drive = make_drive(hw, tmp_path, clock)
    try:
        hw.create_guest("b1", "web", [GuestRange(0, 64 * MiB)])
        share = drive.open_share("b1", "web", 1, 4096, paths=2)
        share.set_master()
        drv = guest_driver(share.bar0, hw.guest("b1", "web"), clock=clock)
        drv.reset()
        drv.enable()
        drv.identify_controller()
        drv.identify_namespace(1)
        drv.set_queue_count(1)

        def dbbc(buffer: int, eventidx: int) -> int:
            cmd = spec.Command(spec.ADMIN_DBBUF_CONFIG, prp1=buffer, prp2=eventidx)
            return drv.admin_command(cmd, "dbbc", check=False).status

        assert dbbc(0x100_0800, 0x100_1000) == spec.SC_INVALID_FIELD  # not page-aligned
        assert dbbc(0, 0x100_1000) == spec.SC_INVALID_FIELD
        assert dbbc(1 << 40, 0x100_1000) == spec.SC_INVALID_FIELD  # no RAM there
        assert not share.relay.shadow.configured
        assert drv.configure_doorbell_buffer()
        queue = drv.create_queue_pair(1, ENTRIES, vector=1)
        assert share.relay.mode == "page"
        assert dbbc(0x200_0000, 0x200_1000) == spec.SC_COMMAND_SEQUENCE_ERROR
        assert io(drv, queue, 0, 4) == 8 and share.traps == 0
        submit(drv, queue, 30, 2)
        hw.link_down(PRIMARY)
        drv.ring(queue)
        assert len(drv.reap(queue)) == 2
        clean(hw, drive)
    finally:
        drive.close()


def test_the_registry_claims_match_what_page_mode_maps_across_a_failover(state_path):
    """Reserved with --paths 2 on the paged drive, in page mode: the checker with the
    registry's claims finds every segment and LUT entry of both paths claimed, exactly as
    mapped, before the fault, on the backup and back (page mode maps what relay mode maps)."""
    from tests.support.simcluster import Cluster, assert_matches_registry
    from vmlend.ledger import nvmeshares as shares
    from vmlend.sim.nvmedrive import drive_geometry
    from vmlend.topology.model import Holder

    c = Cluster.create(state_path, sharing_topology(1, paths=2), node="b1")
    try:
        geometry = drive_geometry(c.hw.device(SHARED_NVME).spec, 1 << 16)
        shares.lend_shared(c.registry, SHARED_NVME, geometry)
        drive = SharedNvmeDrive(c.hw, SHARED_NVME, state_path.parent, blocks=1 << 16)
        ram = 64 * MiB
        share = shares.reserve_share(
            c.registry, SHARED_NVME, Holder("b1", "web"), 1, 4096, guest_ram=ram, paths=2
        )
        c.hw.create_guest("b1", "web", [GuestRange(0, ram)])
        vms = drive.open_share("b1", "web", share=share)
        vms.set_master()
        drv = guest_driver(vms.bar0, c.hw.guest("b1", "web"))
        (queue,) = drv.start(queues=1, entries=ENTRIES)

        assert vms.relay.mode == "page"
        assert_matches_registry(c)
        assert io(drv, queue, 0, 4) == 8 and vms.traps == 0
        c.fabric("b1").set_link_up(PRIMARY, False)
        assert vms.relay.status()["active"] == "backup"
        assert io(drv, queue, 4, 4) == 8
        assert_matches_registry(c)
        c.fabric("b1").set_link_up(PRIMARY, True)
        assert vms.relay.status()["active"] == "primary"
        assert io(drv, queue, 8, 4) == 8
        assert_matches_registry(c)
        drive.close()
        assert_matches_registry(c)
    finally:
        c.close()
