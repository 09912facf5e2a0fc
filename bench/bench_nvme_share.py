"""NVMe through the simulated queue path: one drive shared by 1, 2, 4 and 8 VMs (each on its
own borrower) against one VM owning it exclusively, side by side in one run.

Prints I/O commands per second (4 KiB writes, 16 per doorbell, every VM in turn), the latency
of one 4 KiB read at queue depth 1, and the software steps between a guest's SQ tail doorbell
write and the drive fetching its command (vmlend code run on that path: zero when the guest's
doorbell page maps onto the drive's, one per write when it is trapped). Ratios are shared over
exclusive. Times are this process's CPU time (the simulated path is all CPU, and the machine
is shared: wall time would measure the neighbours). Asserts nothing about time.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from vmlend.nvme import spec
from vmlend.sim.hardware import SimHardware
from vmlend.sim.nvme.driver import BumpAllocator, NvmeDriver, QueuePair
from vmlend.sim.nvmedrive import attach_nvme
from vmlend.sim.nvmeshare import SharedNvmeDrive
from vmlend.sim.nvmetopology import SHARED_NVME, sharing_topology
from vmlend.sim.pci import regs
from vmlend.topology.model import GuestRange, MiB
from vmlend.topology.parse import load_topology, parse_topology

RAM = 64 * MiB
BLOCKS = 1 << 20
DEPTH = 16
ROUNDS = 20
LAT_SAMPLES = 200


class _Bar0:
    def __init__(self, hw: SimHardware, fdid: int) -> None:
        self.bars = hw.device(fdid).bars

    def read(self, offset: int, size: int) -> int:
        return self.bars.read(0, offset, size)

    def write(self, offset: int, size: int, value: int) -> None:
        self.bars.write(0, offset, size, value)


def _driver(mmio, guest) -> NvmeDriver:  # type: ignore[no-untyped-def]
    return NvmeDriver(mmio, guest, BumpAllocator(16 * MiB, 48 * MiB))


def exclusive(
    hw: SimHardware, fdid: int, node: str, tmp: Path
) -> list[tuple[NvmeDriver, QueuePair]]:
    """One VM owning the drive: borrowed, its RAM mapped IOVA = GPA through the NTB."""
    attach_nvme(hw, fdid, tmp, blocks=BLOCKS)
    guest = hw.create_guest(node, "solo", [GuestRange(0, RAM)])
    hw.borrow(fdid, node, "solo")
    dev = hw.device(fdid)
    dev.config.write(regs.COMMAND, 2, regs.COMMAND_MEMORY | regs.COMMAND_MASTER)
    window = hw.adapter(hw.route(dev.lender, node).src.ref)  # type: ignore[union-attr]
    index = window.free_segments(1)
    window.map_segment(index, node, 0)
    for f in guest.pin(0, RAM):
        hw.vm_domain(node, "solo").map(f.gpa, f.phys, f.size)
    hw.lender_domain(fdid).map(0, window.segment_base(index), RAM)
    drv = _driver(_Bar0(hw, fdid), guest)
    (qp,) = drv.start(queues=1, entries=64)
    return [(drv, qp)]


def shared(hw: SimHardware, fdid: int, nodes: list[str], tmp: Path):  # type: ignore[no-untyped-def]
    drive = SharedNvmeDrive(hw, fdid, tmp, blocks=BLOCKS)
    vms = []
    for i, node in enumerate(nodes):
        guest = hw.create_guest(node, f"vm{i}", [GuestRange(0, RAM)])
        share = drive.open_share(node, f"vm{i}", 1, BLOCKS // 16)
        share.set_master()
        drv = _driver(share.bar0, guest)
        (qp,) = drv.start(queues=1, entries=64)
        vms.append((drv, qp, share))
    return drive, vms


def best(fn, *args):  # type: ignore[no-untyped-def]
    """Best of three runs: the machine is shared, the slower runs measure the neighbours."""
    return max(fn(*args) for _ in range(3))


def throughput(vms: list[tuple[NvmeDriver, QueuePair]]) -> float:
    data = b"\xab" * 4096
    t0 = time.process_time()
    done = 0
    for r in range(ROUNDS):
        for drv, qp in vms:
            for i in range(DEPTH):
                drv.submit_io(qp, spec.IO_WRITE, 8 * (r * DEPTH + i) % 8192, 8, data)
            drv.ring(qp)
        for drv, qp in vms:
            got = drv.reap(qp)
            assert len(got) == DEPTH and all(c.ok for c in got)
            done += len(got)
    return done / (time.process_time() - t0)


def latency(drv: NvmeDriver, qp: QueuePair) -> tuple[float, float]:
    samples = []
    for i in range(LAT_SAMPLES):
        t0 = time.process_time()
        done, _ = drv.read(qp, 8 * (i % 512), 8)
        samples.append(time.process_time() - t0)
        assert done.ok
    samples.sort()
    return statistics.mean(samples) * 1e6, samples[int(0.99 * len(samples))] * 1e6


def main() -> None:
    topo = parse_topology(sharing_topology(8))
    borrowers = [f"b{i}" for i in range(1, 9)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hw = SimHardware.from_topology(topo, seed=1)
        vm = exclusive(hw, SHARED_NVME, "b1", Path(tmp))
        ex_iops = best(throughput, vm)
        ex_lat = latency(*vm[0])
        rows.append(("exclusive, 1 VM", 1, ex_iops, ex_lat, 0))
    for n in (1, 2, 4, 8):
        with tempfile.TemporaryDirectory() as tmp:
            hw = SimHardware.from_topology(topo, seed=1)
            drive, vms = shared(hw, SHARED_NVME, borrowers[:n], Path(tmp))
            before = sum(s.traps for _, _, s in vms)
            iops = best(throughput, [(d, q) for d, q, _ in vms])
            lat = latency(vms[0][0], vms[0][1])
            doorbells = ROUNDS * n  # SQ tail writes per throughput run (and as many CQ heads)
            steps = (sum(s.traps for _, _, s in vms) - before) / (3 * 2 * doorbells)
            rows.append((f"shared, {n} VM(s)", n, iops, lat, steps))
            drive.close()
    print(
        f"{'path':20} {'cmds/s':>10} {'ratio':>7} {'lat mean us':>12} {'p99 us':>8} "
        f"{'sw steps/doorbell':>18}"
    )
    for name, _, iops, (mean, p99), steps in rows:
        print(
            f"{name:20} {iops:10.0f} {iops / ex_iops:6.2f}x {mean:12.1f} {p99:8.1f} {steps:18.2f}"
        )
    print(f"latency ratio shared(1)/exclusive: {rows[1][3][0] / ex_lat[0]:.2f}x")
    # the default cluster's drive has one doorbell page: its shares trap the doorbells
    with tempfile.TemporaryDirectory() as tmp:
        hw = SimHardware.from_topology(load_topology(), seed=1)
        drive, vms = shared(hw, 0x12, ["gamma"], Path(tmp))
        drv, qp, share = vms[0]
        before = share.traps
        iops = throughput([(drv, qp)])
        steps = (share.traps - before) / (2 * ROUNDS)
        print(
            f"default drive 0x12 (one doorbell page, {drive.mode} mode): {iops:.0f} cmds/s, "
            f"{steps:.2f} software steps per doorbell write"
        )
        drive.close()


if __name__ == "__main__":
    main()
