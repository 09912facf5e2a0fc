"""A shared NVMe drive's I/O across a link-down on its primary path (issue 23), cases side by
side in one run on the default topology (gamma has two NTB adapters):

- failover: the cable of gamma's primary adapter (``mxs824/gamma:0``) goes down while a batch
  of commands sits in the VM's submission queue, not yet rung; the drive's manager moves its
  crossing into gamma to gamma:1 on the link event, and the batch is rung after that;
- no other route: the lender's only cable (``mxs824/alpha:0``) goes down the same way;
- two paths (``--paths 2``), link event: the guest rings its batch just as the cable dies,
  before the link event arrives, so the relay's doorbell on the dead primary pair is dropped
  at gamma:0 (MMIO crosses the adapters, ``vmlend.sim.mmio``); the event switches the
  virtual controller to the backup pair, which gets the batch again;
- two paths, command timeout: the same, but the link event never arrives; the virtual
  controller's command timer (on the drive's clock, moved here past ``COMMAND_TIMEOUT``)
  finds the batch overdue and switches.

The default cluster's drive has one doorbell page, so its two-path shares are relayed (every
doorbell trapped). The same cases run again on drive 0x40 of ``sharing_topology(1,
paths=2)`` (doorbell pages to spare; b1 has an adapter on each of two switches): a one-path
share in page mode (b1:0's cable going leaves it no route), and a two-path share in page mode
(the guest uses shadow doorbells), which the virtual controller takes over at the fault.

Prints I/O commands per second (4 KiB writes, DEPTH per doorbell) before and after the link
went down and their ratio, the commands lost (submitted but never completed: the goal is 0),
the time the switch took (one path: the link event, ``hw.link_down``, including the
re-route; two paths: the link event's handling after the guest's ring, or the timeout's,
including the resubmission), and the software steps per guest doorbell write before and
after the fault (traps: 0 in page mode; a relayed share traps every I/O doorbell), then the
commands/s of each two-path share before the fault over a one-path share's on the same drive.
Times are this process's CPU time (the simulated path is all CPU, and the machine is shared).
Asserts nothing.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from vmlend.nvme import spec
from vmlend.sim.hardware import SimHardware
from vmlend.sim.nvme.driver import BumpAllocator, NvmeDriver, QueuePair
from vmlend.sim.nvme.timer import COMMAND_TIMEOUT
from vmlend.sim.nvmeshare import SharedNvmeDrive, VmNvmeShare
from vmlend.sim.nvmetopology import SHARED_NVME, sharing_topology
from vmlend.topology.model import GuestRange, MiB
from vmlend.topology.parse import load_topology, parse_topology

RAM = 64 * MiB
BLOCKS = 1 << 16
DEPTH = 16
ROUNDS = 40
DATA = b"\xab" * 4096


class ManualClock:
    """The drive's clock: it moves only when told (the timeout case)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


CLOCK = ManualClock()


class Fabric:
    """Where a case runs: a topology, its drive, the borrower and its primary adapter's
    cable."""

    def __init__(self, name: str, topology: str | None, fdid: int, node: str, link: str):
        self.name, self.topology, self.fdid, self.node, self.link = (
            name,
            topology,
            fdid,
            node,
            link,
        )

    def hardware(self) -> SimHardware:
        topo = load_topology() if self.topology is None else parse_topology(self.topology)
        return SimHardware.from_topology(topo, seed=7)


DEFAULT = Fabric("default", None, 0x12, "gamma", "mxs824/gamma:0")
PAGED = Fabric("paged", sharing_topology(1, paths=2), SHARED_NVME, "b1", "sw/b1:0")


def steps(share: VmNvmeShare, when: str) -> float:
    """Software steps per guest I/O doorbell write, ``before_fault`` or ``after_fault``."""
    return share.steps[when].per_doorbell()


def setup(
    tmp: Path, paths: int = 1, link_events: bool = True, fabric: Fabric = DEFAULT
) -> tuple[
    SimHardware, SharedNvmeDrive, VmNvmeShare, NvmeDriver, QueuePair, list[Callable[[], object]]
]:
    tmp.mkdir(parents=True, exist_ok=True)
    hw = fabric.hardware()
    racing: list[Callable[[], object]] = []  # the ring racing the link event (two paths)

    def race(link: str, up: bool) -> None:
        if not up and racing:
            racing.pop()()

    hw.on_link_change(race)
    drive = SharedNvmeDrive(
        hw, fabric.fdid, tmp, blocks=BLOCKS, link_events=link_events, clock=CLOCK
    )
    guest = hw.create_guest(fabric.node, "web", [GuestRange(0, RAM)])
    share = drive.open_share(fabric.node, "web", 1, BLOCKS // 2, paths=paths)
    share.set_master()
    drv = NvmeDriver(share.bar0, guest, BumpAllocator(16 * MiB, 48 * MiB))
    (qp,) = drv.start(queues=1, entries=64)
    return hw, drive, share, drv, qp, racing


def batch(drv: NvmeDriver, qp: QueuePair, r: int) -> None:
    for i in range(DEPTH):
        drv.submit_io(qp, spec.IO_WRITE, 8 * ((r * DEPTH + i) % 1024), 8, DATA)


def rate(drv: NvmeDriver, qp: QueuePair, first: int) -> tuple[float, int, int]:
    """Commands per second over ROUNDS batches; (rate, submitted, completed ok)."""
    t0 = time.process_time()
    done = 0
    for r in range(first, first + ROUNDS):
        batch(drv, qp, r)
        drv.ring(qp)
        done += sum(c.ok for c in drv.reap(qp))
    return done / (time.process_time() - t0), ROUNDS * DEPTH, done


def across(link: str, tmp: Path, fabric: Fabric = DEFAULT) -> dict[str, float]:
    hw, drive, share, drv, qp, _ = setup(tmp, fabric=fabric)
    before, sent_b, done_b = rate(drv, qp, 0)
    batch(drv, qp, ROUNDS)  # in the VM's submission queue when the link goes down
    t0 = time.process_time()
    hw.link_down(link)
    switch = time.process_time() - t0
    drv.ring(qp)
    in_flight = sum(c.ok for c in drv.reap(qp))
    out = {
        "before": before,
        "switch_us": switch * 1e6,
        "rerouted": float(len(drive.reroutes)),
    }
    if drive.reroutes:
        after, sent_a, done_a = rate(drv, qp, ROUNDS + 1)
        out |= {
            "after": after,
            "lost": float(sent_b + DEPTH + sent_a - done_b - in_flight - done_a),
        }
    else:  # nothing completes any more: the batch in flight is lost, and so is all after it
        out |= {"after": 0.0, "lost": float(sent_b + DEPTH - done_b - in_flight)}
    out["steps"] = steps(share, "before_fault")
    out["steps_after"] = steps(share, "after_fault")
    drive.close()
    return out


def two_paths(tmp: Path, link_events: bool, fabric: Fabric = DEFAULT) -> dict[str, float]:
    """A two-path share across its primary adapter's cable going down with a batch rung on
    the dead primary path: switched by the link event, or (``link_events`` False) by the
    timeout."""
    hw, drive, share, drv, qp, racing = setup(tmp, paths=2, link_events=link_events, fabric=fabric)
    assert share.relay is not None
    before, sent_b, done_b = rate(drv, qp, 0)
    batch(drv, qp, ROUNDS)
    rung: list[float] = []

    def ring() -> None:  # the guest rings as the cable dies, before the event is handled
        drv.ring(qp)
        rung.append(time.process_time())

    racing.append(ring)
    hw.link_down(fabric.link)
    if link_events:
        switch = time.process_time() - rung[0]
    else:
        share.timeout()  # the timer check: a page-mode queue's deadline starts here
        CLOCK.now += COMMAND_TIMEOUT  # the deadline passes on the drive's clock
        t0 = time.process_time()
        share.timeout()
        switch = time.process_time() - t0
    in_flight = sum(c.ok for c in drv.reap(qp))
    after, sent_a, done_a = rate(drv, qp, ROUNDS + 1)
    out = {
        "before": before,
        "after": after,
        "switch_us": switch * 1e6,
        "lost": float(sent_b + DEPTH + sent_a - done_b - in_flight - done_a),
        "resubmitted": float(share.relay.stats.resubmitted + share.relay.stats.taken_over),
        "steps": steps(share, "before_fault"),
        "steps_after": steps(share, "after_fault"),
    }
    drive.close()
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        fail = across(DEFAULT.link, Path(tmp) / "a")
        none = across("mxs824/alpha:0", Path(tmp) / "b")
        event = two_paths(Path(tmp) / "c", True)
        timeout = two_paths(Path(tmp) / "d", False)
        one_paged = across(PAGED.link, Path(tmp) / "e", PAGED)
        event_paged = two_paths(Path(tmp) / "f", True, PAGED)
        timeout_paged = two_paths(Path(tmp) / "g", False, PAGED)
    print(f"I/O across a link-down, {DEPTH} x 4 KiB writes per doorbell, {ROUNDS} rounds each side")
    print(f"{'case':<44}{'before cmd/s':>13}{'after cmd/s':>13}{'after/before':>13}"
          f"{'lost':>6}{'switch':>10}{'sw steps/doorbell before, after':>33}")  # fmt: skip
    rows = (
        ("default drive, 1 path: failover (gamma:0)", fail),
        ("default drive, 1 path: no other route", none),
        ("default drive, 2 paths relayed: link event", event),
        ("default drive, 2 paths relayed: timeout", timeout),
        ("paged drive, 1 path: no other route (b1:0)", one_paged),
        ("paged drive, 2 paths page mode: link event", event_paged),
        ("paged drive, 2 paths page mode: timeout", timeout_paged),
    )
    for name, r in rows:
        ratio = r["after"] / r["before"] if r["before"] else 0.0
        print(
            f"{name:<44}{r['before']:>13,.0f}{r['after']:>13,.0f}{ratio:>12.2f}x"
            f"{int(r['lost']):>6}{r['switch_us']:>8.0f}us{r['steps']:>20.2f}, "
            f"{r['steps_after']:.2f}"
        )
    print("two paths over one, commands/s before any fault (same drive, same guest):")
    for name, two, one in (
        ("default drive (relayed)", event, fail),
        ("paged drive (page mode)", event_paged, one_paged),
    ):
        print(f"  {name:<26}{two['before'] / one['before']:.2f}x")


if __name__ == "__main__":
    main()
