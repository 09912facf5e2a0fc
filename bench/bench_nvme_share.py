"""NVMe through the simulated queue path: one drive shared by 1, 2, 4 and 8 VMs (each on its
own borrower) against one VM owning it exclusively, side by side in one run.

Prints I/O commands per second (4 KiB writes, 16 per doorbell, every VM in turn), the latency
of one 4 KiB read at queue depth 1, and the software steps between a guest's SQ tail doorbell
write and the drive fetching its command (vmlend code run on that path: zero when the guest's
doorbell page maps onto the drive's, one per write when it is trapped). Ratios are shared over
exclusive. Then one VM's share on a drive with doorbell pages to spare, its node with two
adapters (``sharing_topology(1, paths=2)``): one path against two paths in page mode (the
guest uses shadow doorbells) and two paths relayed (it does not), commands/s side by side and
software steps per doorbell before and after its primary adapter's cable goes. Times are this
process's CPU time (the simulated path is all CPU, and the machine is shared: wall time would
measure the neighbours). Asserts nothing about time.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from vmlend.nvme import cmb, spec
from vmlend.nvme.fetchroute import fetch_route
from vmlend.nvme.guard import asid_base
from vmlend.sim.hardware import SimHardware
from vmlend.sim.nvme.cmb import GuestWithCmb
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


class _CountingDma:
    """The drive's DMA port, counting its queue-entry fetches (64-byte reads) and how many of
    them the resolver took across the NTB."""

    def __init__(self, hw: SimHardware, fdid: int, inner) -> None:  # type: ignore[no-untyped-def]
        self.hw, self.fdid, self.inner = hw, fdid, inner
        self.fetches = self.crossed = 0

    def read(self, iova: int, length: int) -> bytes:
        if length == spec.SQE_SIZE:
            self.fetches += 1
            self.crossed += self.hw.resolve_dma(self.fdid, iova).crossed_ntb
        return self.inner.read(iova, length)

    def write(self, iova: int, data: bytes) -> None:
        self.inner.write(iova, data)


def fetch_routes() -> None:
    """Drive 0x12 of the default fabric with a 1 MiB CMB; two VMs on gamma, one with its SQ in
    its RAM, one with its SQ in its CMB extent: routes, costs and fetches counted."""
    topo = load_topology()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hw = SimHardware.from_topology(topo, seed=1)
        drive = SharedNvmeDrive(hw, 0x12, Path(tmp), blocks=BLOCKS, cmb_bytes=1 * MiB)
        counter = _CountingDma(hw, 0x12, drive.controller.dma)
        drive.controller.dma = counter
        for name, in_cmb in (("guest RAM", False), ("CMB", True)):
            vm = "ram" if not in_cmb else "near"
            guest = hw.create_guest("gamma", vm, [GuestRange(0, RAM)])
            share = drive.open_share("gamma", vm, 1, BLOCKS // 16)
            share.set_master()
            drv = _driver(share.bar0, guest)
            if in_cmb:
                assert share.cmb is not None
                drv.memory = GuestWithCmb(guest, share.cmb)
                drv.reset()
                drv.enable()
                drv.identify_namespace(1)
                drv.set_queue_count(1)
                cq = drv.alloc(64 * spec.CQE_SIZE)
                qp = drv.create_queue_pair_at(1, cmb.GUEST_CMB_BASE, cq, 64, vector=1)
            else:
                (qp,) = drv.start(queues=1, entries=64)
            target = hw.resolve_dma(0x12, asid_base(share.share.asid) + qp.sq)
            before = (counter.fetches, counter.crossed)
            iops = best(throughput, [(drv, qp)])
            fetches, crossed = counter.fetches - before[0], counter.crossed - before[1]
            route = fetch_route(topo, 0x12, "gamma", in_cmb)
            rows.append((name, route, target.node, iops, fetches, crossed))
        drive.close()
    print("fetch route, drive 0x12 (lender alpha) to a VM on gamma, submission queue in:")
    print(
        f"{'sq in':10} {'lands on':>8} {'hops':>5} {'NTB':>4} {'one way ns':>11} "
        f"{'fetch ns':>9} {'compl hops':>11} {'cmds/s':>9} {'fetches over NTB':>17}"
    )
    for name, r, node, iops, fetches, crossed in rows:
        f = r.fetch
        print(
            f"{name:10} {node:>8} {f.hops:5d} {f.ntb_crossings:4d} {f.latency_ns:11d} "
            f"{r.fetch_ns:9d} {r.completion.hops:11d} {iops:9.0f} {crossed:>8d} of {fetches:<6d}"
        )
    ram, near = rows[0][1], rows[1][1]
    print(
        f"per fetch the CMB saves {ram.fetch_ns - near.fetch_ns} ns of fabric time "
        f"({ram.fetch.hops} -> {near.fetch.hops} hops, {ram.fetch.ntb_crossings} -> "
        f"{near.fetch.ntb_crossings} NTB crossings); the completion is {ram.completion.hops} "
        "hops either way"
    )


def two_paths() -> None:
    """One VM on b1 of the two-switch sharing cluster: a one-path share, a two-path share in
    page mode and one relayed, each measured before and after b1:0's cable goes."""
    rows = []
    for name, paths, shadow in (
        ("1 path", 1, True),
        ("2 paths, page mode", 2, True),
        ("2 paths, relayed", 2, False),
    ):
        with tempfile.TemporaryDirectory() as tmp:
            hw = SimHardware.from_topology(parse_topology(sharing_topology(1, paths=2)), seed=1)
            drive = SharedNvmeDrive(hw, SHARED_NVME, Path(tmp), blocks=BLOCKS)
            guest = hw.create_guest("b1", "vm", [GuestRange(0, RAM)])
            share = drive.open_share("b1", "vm", 1, BLOCKS // 16, paths=paths)
            share.set_master()
            drv = NvmeDriver(
                share.bar0, guest, BumpAllocator(16 * MiB, 48 * MiB), shadow_doorbells=shadow
            )
            (qp,) = drv.start(queues=1, entries=64)
            before = best(throughput, [(drv, qp)])
            after = 0.0
            if paths == 2:  # a one-path share has no route left: nothing to measure after
                hw.link_down("sw/b1:0")
                after = best(throughput, [(drv, qp)])
            steps = share.steps
            rows.append((name, before, after, steps["before_fault"], steps["after_fault"]))
            drive.close()
    one = rows[0][1]
    print("one VM's share, paged drive 0x40, b1 with two adapters; b1:0's cable then goes:")
    print(
        f"{'share':20} {'cmds/s':>9} {'vs 1 path':>10} {'after fault':>12} "
        f"{'sw steps/doorbell before':>25} {'after':>6}"
    )
    for name, before, after, b, a in rows:
        shown = f"{after:12.0f}" if after else f"{'-':>12}"
        print(
            f"{name:20} {before:9.0f} {before / one:9.2f}x {shown} "
            f"{b.per_doorbell():25.2f} {a.per_doorbell():6.2f}"
        )


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
    two_paths()
    fetch_routes()


if __name__ == "__main__":
    main()
