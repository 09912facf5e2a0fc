"""A shared NVMe drive's I/O across a link-down on its primary path (issue 23), cases side by
side in one run on the default topology (gamma has two NTB adapters):

- failover: the cable of gamma's primary adapter (``mxs824/gamma:0``) goes down while a batch
  of commands sits in the VM's submission queue, not yet rung; the drive's manager moves its
  crossing into gamma to gamma:1 on the link event, and the batch is rung after that;
- no other route: the lender's only cable (``mxs824/alpha:0``) goes down the same way;
- two paths (``--paths 2``), link event: the guest rings its batch just as the cable dies,
  before the link event arrives, so the drive fetches it from the dead primary pair (all ones)
  and its completions are dropped; the event switches the virtual controller to the backup
  pair, which gets the batch again;
- two paths, command timeout: the same, but the link event never arrives; the virtual
  controller's command timer finds the batch outstanding and switches.

Prints I/O commands per second (4 KiB writes, DEPTH per doorbell) before and after the link
went down and their ratio, the commands lost (submitted but never completed: the goal is 0),
and the time the switch took (one path: the link event, ``hw.link_down``, including the
re-route; two paths: the link event's handling after the guest's ring, or the timeout's,
including the resubmission). Times are this process's CPU time (the simulated path is all
CPU, and the machine is shared). Asserts nothing.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from vmlend.nvme import spec
from vmlend.sim.hardware import SimHardware
from vmlend.sim.nvme.driver import BumpAllocator, NvmeDriver, QueuePair
from vmlend.sim.nvmeshare import SharedNvmeDrive, VmNvmeShare
from vmlend.topology.model import GuestRange, MiB
from vmlend.topology.parse import load_topology

RAM = 64 * MiB
BLOCKS = 1 << 16
DEPTH = 16
ROUNDS = 40
DATA = b"\xab" * 4096


def setup(
    tmp: Path, paths: int = 1, link_events: bool = True
) -> tuple[SimHardware, SharedNvmeDrive, VmNvmeShare, NvmeDriver, QueuePair, list[object]]:
    tmp.mkdir(parents=True, exist_ok=True)
    hw = SimHardware.from_topology(load_topology(), seed=7)
    racing: list[object] = []  # the guest's ring that races the link event (two-path cases)
    hw.on_link_change(lambda link, up: None if up or not racing else racing.pop()())
    drive = SharedNvmeDrive(hw, 0x12, tmp, blocks=BLOCKS, link_events=link_events)
    guest = hw.create_guest("gamma", "web", [GuestRange(0, RAM)])
    share = drive.open_share("gamma", "web", 1, BLOCKS // 2, paths=paths)
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


def across(link: str, tmp: Path) -> dict[str, float]:
    hw, drive, _share, drv, qp, _ = setup(tmp)
    before, sent_b, done_b = rate(drv, qp, 0)
    batch(drv, qp, ROUNDS)  # in the VM's submission queue when the link goes down
    t0 = time.process_time()
    hw.link_down(link)
    switch = time.process_time() - t0
    drv.ring(qp)
    in_flight = sum(c.ok for c in drv.reap(qp))
    out = {"before": before, "switch_us": switch * 1e6, "rerouted": float(len(drive.reroutes))}
    if drive.reroutes:
        after, sent_a, done_a = rate(drv, qp, ROUNDS + 1)
        out |= {
            "after": after,
            "lost": float(sent_b + DEPTH + sent_a - done_b - in_flight - done_a),
        }
    else:  # nothing completes any more: the batch in flight is lost, and so is all after it
        out |= {"after": 0.0, "lost": float(sent_b + DEPTH - done_b - in_flight)}
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
          f"{'lost':>7}{'switch':>12}")  # fmt: skip
    for name, r in (
        ("failover (gamma:0 down)", fail),
        ("no other route (alpha:0)", none),
        ("2 paths, link event (in flight)", event),
        ("2 paths, command timeout", timeout),
    ):
        ratio = r["after"] / r["before"] if r["before"] else 0.0
        print(
            f"{name:<34}{r['before']:>14,.0f}{r['after']:>14,.0f}{ratio:>13.2f}x"
            f"{int(r['lost']):>7}{r['switch_us']:>10.0f}us"
        )


if __name__ == "__main__":
    main()
