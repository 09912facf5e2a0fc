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

Prints I/O commands per second (4 KiB writes, DEPTH per doorbell) before and after the link
went down and their ratio, the commands lost (submitted but never completed: the goal is 0),
the time the switch took (one path: the link event, ``hw.link_down``, including the
re-route; two paths: the link event's handling after the guest's ring, or the timeout's,
including the resubmission), and the software steps per guest doorbell write (traps: 0 in
page mode on one path; a two-path share traps every I/O doorbell). Times are this process's
CPU time (the simulated path is all CPU, and the machine is shared). Asserts nothing.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from vmlend.nvme import spec
from vmlend.sim.hardware import SimHardware
from vmlend.sim.nvme.driver import BumpAllocator, NvmeDriver, QueuePair
from vmlend.sim.nvme.timer import COMMAND_TIMEOUT
from vmlend.sim.nvmeshare import SharedNvmeDrive, VmNvmeShare
from vmlend.topology.model import GuestRange, MiB
from vmlend.topology.parse import load_topology

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


class CountingBar:
    """The guest's BAR0, counting its doorbell writes."""

    def __init__(self, share: VmNvmeShare) -> None:
        self.bar = share.bar0
        self.doorbells = 0

    def read(self, offset: int, size: int) -> int:
        return self.bar.read(offset, size)

    def write(self, offset: int, size: int, value: int) -> None:
        self.doorbells += offset >= spec.DOORBELL_BASE
        self.bar.write(offset, size, value)


CLOCK = ManualClock()
BARS: dict[int, CountingBar] = {}  # id(share) -> its counting BAR


def steps(share: VmNvmeShare) -> float:
    """Software steps per guest doorbell write."""
    bar = BARS[id(share)]
    return share.traps / bar.doorbells if bar.doorbells else 0.0


def setup(
    tmp: Path, paths: int = 1, link_events: bool = True
) -> tuple[SimHardware, SharedNvmeDrive, VmNvmeShare, NvmeDriver, QueuePair, list[object]]:
    tmp.mkdir(parents=True, exist_ok=True)
    hw = SimHardware.from_topology(load_topology(), seed=7)
    racing: list[object] = []  # the guest's ring that races the link event (two-path cases)
    hw.on_link_change(lambda link, up: None if up or not racing else racing.pop()())
    drive = SharedNvmeDrive(hw, 0x12, tmp, blocks=BLOCKS, link_events=link_events, clock=CLOCK)
    guest = hw.create_guest("gamma", "web", [GuestRange(0, RAM)])
    share = drive.open_share("gamma", "web", 1, BLOCKS // 2, paths=paths)
    share.set_master()
    bar = BARS[id(share)] = CountingBar(share)
    drv = NvmeDriver(bar, guest, BumpAllocator(16 * MiB, 48 * MiB))
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


def across(link: str, tmp: Path) -> dict[str, float]:
    hw, drive, share, drv, qp, _ = setup(tmp)
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
    out["steps"] = steps(share)
    drive.close()
    return out


def two_paths(tmp: Path, link_events: bool) -> dict[str, float]:
    """A two-path share across ``mxs824/gamma:0`` going down with a batch rung on the dead
    primary pair: switched by the link event, or (``link_events`` False) by the timeout."""
    hw, drive, share, drv, qp, racing = setup(tmp, paths=2, link_events=link_events)
    assert share.relay is not None
    before, sent_b, done_b = rate(drv, qp, 0)
    batch(drv, qp, ROUNDS)
    rung: list[float] = []

    def ring() -> None:  # the guest rings as the cable dies, before the event is handled
        drv.ring(qp)
        rung.append(time.process_time())

    racing.append(ring)
    hw.link_down("mxs824/gamma:0")
    if link_events:
        switch = time.process_time() - rung[0]
    else:
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
        "resubmitted": float(share.relay.stats.resubmitted),
        "steps": steps(share),
    }
    drive.close()
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        fail = across("mxs824/gamma:0", Path(tmp) / "a")
        none = across("mxs824/alpha:0", Path(tmp) / "b")
        event = two_paths(Path(tmp) / "c", True)
        timeout = two_paths(Path(tmp) / "d", False)
    print(f"I/O across a link-down, {DEPTH} x 4 KiB writes per doorbell, {ROUNDS} rounds each side")
    print(f"{'case':<34}{'before cmd/s':>14}{'after cmd/s':>14}{'after/before':>14}"
          f"{'lost':>7}{'switch':>12}{'sw steps/doorbell':>19}")  # fmt: skip
    for name, r in (
        ("failover (gamma:0 down)", fail),
        ("no other route (alpha:0)", none),
        ("2 paths, link event (in flight)", event),
        ("2 paths, command timeout", timeout),
    ):
        ratio = r["after"] / r["before"] if r["before"] else 0.0
        print(
            f"{name:<34}{r['before']:>14,.0f}{r['after']:>14,.0f}{ratio:>13.2f}x"
            f"{int(r['lost']):>7}{r['switch_us']:>10.0f}us{r['steps']:>19.2f}"
        )


if __name__ == "__main__":
    main()
