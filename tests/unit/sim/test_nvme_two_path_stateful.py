"""A two-path NVMe share's modes, explored: page mode and relay mode, faults on either path
at any point of the guest's submissions, with and without the link events, switch-backs,
and guest restarts with and without shadow doorbells.

The drive is 0x40 of ``sharing_topology(1, paths=2)`` (doorbell pages to spare), the guest
on b1 (adapters b1:0 on ``sw``, b1:1 on ``sw2``). Rules: the guest writes commands into its
submission queue, rings, reaps; a path's cable goes down or comes back (its mappings kept);
the virtual controller's timer check runs after the drive's clock passes the command timeout;
the guest resets its controller and starts again (shadow doorbells or not); ``settle`` rings
again, lets the timeout pass and reaps.

Checked: each completion is of a command the guest has outstanding (none completes twice),
and succeeds; a doorbell written in page mode takes no software step; a guest that starts
with shadow doorbells on the primary path runs in page mode, one without in relay mode;
after ``settle`` with the share's active path alive, every command rung while a path to
take it was alive has completed, and the blocks read back as written; the fabric's
invariant checker finds nothing after every step.
"""

from __future__ import annotations

import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.support.clocks import FakeClock
from tests.support.nvme_guest import guest_driver
from tests.support.stateful import derandomized
from vmlend.nvme import spec
from vmlend.sim.hardware import SimHardware
from vmlend.sim.invariants import check_hardware
from vmlend.sim.nvme.relay import BACKUP
from vmlend.sim.nvmeshare import SharedNvmeDrive
from vmlend.sim.nvmetopology import SHARED_NVME, sharing_topology
from vmlend.topology.model import GuestRange, MiB
from vmlend.topology.parse import parse_topology

LINKS = {"primary": "sw/b1:0", "backup": "sw2/b1:1"}
TIMEOUT = 30.0
ENTRIES = 16


class TwoPathMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = None
        self.drive: SharedNvmeDrive | None = None

    @initialize(link_events=st.booleans(), shadow=st.booleans())
    def boot(self, link_events: bool, shadow: bool) -> None:
        import tempfile
        from pathlib import Path

        self.link_events = link_events
        self.tmp = tempfile.TemporaryDirectory(prefix="twopath-")
        self.clock = FakeClock()
        self.hw = SimHardware.from_topology(parse_topology(sharing_topology(1, paths=2)), seed=5)
        self.racing: list = []  # a ring run at the next link-down, before anyone hears of it
        self.hw.on_link_change(  # first: before the drive's handler
            lambda link, up: None if up or not self.racing else self.racing.pop()()
        )
        self.drive = SharedNvmeDrive(
            self.hw,
            SHARED_NVME,
            Path(self.tmp.name),
            blocks=1 << 12,
            clock=self.clock,
            command_timeout=TIMEOUT,
            link_events=link_events,
        )
        self.hw.create_guest("b1", "web", [GuestRange(0, 64 * MiB)])
        self.share = self.drive.open_share("b1", "web", 1, 1024, paths=2)
        self.share.set_master()
        self.drv = guest_driver(
            self.share.bar0, self.hw.guest("b1", "web"), size=40 * MiB, shadow_doorbells=shadow
        )
        self._start(shadow)

    def _start(self, shadow: bool) -> None:
        self.drv.shadow_doorbells = shadow
        (self.queue,) = self.drv.start(queues=1, entries=ENTRIES)
        self.pending: dict[int, int] = {}  # cid -> lba, submitted and not completed
        self.at_risk: set[int] = set()  # rung with no live path to take them: may be lost
        self.written: dict[int, int] = {}  # lba -> the value written there last
        self.next = 0
        relay = self.share.relay
        assert relay is not None
        if relay.active == BACKUP:
            return  # on the backup the queues are relayed whatever the guest does
        assert relay.mode == ("page" if shadow else "relay")

    def teardown(self) -> None:
        if self.drive is not None:
            self.drive.close()
        if self.tmp is not None:
            self.tmp.cleanup()

    # --- the paths ------------------------------------------------------------------------------
    def _route_alive(self, backup: bool) -> bool:
        path = self.share.backup if backup else self.hw.crossing(SHARED_NVME, "b1")
        return path is not None and not self.hw.dead_links(path)

    def _takeable(self) -> bool:
        """A command rung now reaches the drive, now or at a failover: the active path works,
        or the primary is active and the backup works (the event or the timeout switches)."""
        relay = self.share.relay
        assert relay is not None
        if relay.active == BACKUP:
            return self._route_alive(True)
        return self._route_alive(False) or self._route_alive(True)

    # --- the guest ------------------------------------------------------------------------------
    @precondition(lambda self: len(self.pending) < ENTRIES - 5)
    @rule(count=st.integers(min_value=1, max_value=4))
    def submit(self, count: int) -> None:
        for _ in range(count):
            lba = self.next % 512
            self.next += 1
            value = self.next % 251 + 1
            req = self.drv.submit_io(self.queue, spec.IO_WRITE, lba, 1, bytes([value]) * 512)
            self.pending[req.cid] = lba
            self.written[lba] = value

    @rule()
    def ring(self) -> None:
        relay = self.share.relay
        assert relay is not None
        page, traps = relay.page_mode, self.share.traps
        if not self._takeable():
            self.at_risk |= set(self.pending)
        self.drv.ring(self.queue)
        if page:
            assert self.share.traps == traps, "a doorbell in page mode took a software step"
        event(f"ring: {relay.mode} mode before" if not page else "ring: page mode")

    @rule()
    def reap(self) -> None:
        for c in self.drv.reap(self.queue):
            assert c.cid in self.pending, f"command {c.cid} completed twice or never sent"
            assert c.ok, f"command {c.cid}: {spec.status_name(c.status)}"
            del self.pending[c.cid]
            self.at_risk.discard(c.cid)

    @rule(shadow=st.booleans())
    def restart(self, shadow: bool) -> None:
        """The guest resets its controller (aborting what it had outstanding) and starts."""
        self._start(shadow)

    # --- faults -----------------------------------------------------------------------------------
    @rule(which=st.sampled_from(sorted(LINKS)))
    def link_down(self, which: str) -> None:
        self.hw.link_down(LINKS[which])

    @precondition(lambda self: self.hw.link_up_now(LINKS["primary"]))
    @rule()
    def ring_as_the_primary_dies(self) -> None:
        """The issue's race: the guest's doorbell write is on its way when b1:0's cable
        goes, before the drive and the virtual controller hear of it."""
        self.racing.append(self.ring)
        self.hw.link_down(LINKS["primary"])

    @rule(which=st.sampled_from(sorted(LINKS)))
    def link_up(self, which: str) -> None:
        # with its mappings: programming lost ones again is the fabric's control plane's
        # (tests/scenarios/test_sim_stateful.py explores it), not the drive's
        self.hw.link_up(LINKS[which])

    @rule()
    def timeout(self) -> None:
        self.clock.advance(TIMEOUT)
        self.share.timeout()

    @rule()
    def settle(self) -> None:
        """Ring again, let the timer check run past the deadline, reap: with the active
        path alive every command not at risk has completed."""
        relay = self.share.relay
        assert relay is not None
        event(f"settle: {'some' if self.pending else 'none'} pending, {relay.mode} mode")
        if relay.stats.taken_over:
            event("settle: page-mode commands were taken over")
        self.ring()
        self.share.timeout()  # a page-mode queue's deadline starts at the check
        self.clock.advance(TIMEOUT)
        self.share.timeout()
        for _ in range(3):
            self.reap()
        if not self._route_alive(relay.active == BACKUP):
            return
        event(f"settle: alive, {relay.mode} mode, {len(self.pending)} pending")
        left = set(self.pending) - self.at_risk
        assert not left, f"commands {sorted(left)} lost with a path alive ({relay.status()})"
        if not self.pending:
            for lba in sorted(self.written)[-3:]:
                done, back = self.drv.read(self.queue, lba, 1)
                assert done.ok and back == bytes([self.written[lba]]) * 512

    @invariant()
    def the_fabric_holds(self) -> None:
        if self.drive is None:
            return
        found = check_hardware(self.hw, shares=self.drive.grants())
        assert not found, "\n".join(map(str, found))


TwoPathMachine.TestCase.settings = derandomized(100, 30)
test_two_path_share_modes = pytest.mark.filterwarnings("ignore")(TwoPathMachine.TestCase)
