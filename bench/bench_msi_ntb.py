"""Device interrupt to VM eventfd: the software relay vs MSI/MSI-X mapped over the NTB.

One run, side by side, 8 MSI-X vectors round-robin, each interrupt timed alone from "the
device raises it" to "the VM's eventfd is readable":

- floor: the VM's eventfd signalled directly (what any path ends with);
- ntb (borrower software): what software does on the NTB-mapped path in a real cluster: the
  borrower's interrupt target turns the posted write into a signal of the VM's eventfd
  (``MsiTarget.write``). The write's trip through the fabric is hardware there;
- ntb (simulated fabric): the whole simulated path: the device's posted write resolved hop by
  hop in Python (lender IOMMU, NTB segment, LUT, borrower IOMMU, target). Its extra time is
  the simulator's, standing in for ~0.35 us of one NTB crossing (docs/design.md numbers);
- relay: the lender's trigger eventfd -> lender relay process -> SOCK_SEQPACKET -> `vmlend
  relay` daemon -> VM eventfd (bench_irq.py's set-up).

Throughput: one thread raises interrupts as fast as it can for --seconds while another drains
the VM's eventfds; every interrupt is checked to have arrived.

Usage: bench/bench_msi_ntb.py [--latency N] [--seconds S]
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from tempfile import TemporaryDirectory

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_irq import fork_lender, percentiles, start_relay

from vmlend.irq import vectors as r
from vmlend.irq.client import RelayClient
from vmlend.irq.control import recv_message
from vmlend.irq.eventfd import EventFd
from vmlend.irq.vectors import IrqIndex
from vmlend.sim.hardware import SimHardware
from vmlend.sim.msitarget import MsiTargets
from vmlend.sim.ntbmsi import NtbMsiRoute
from vmlend.sim.pci import regs
from vmlend.topology.model import GuestRange, MiB
from vmlend.topology.parse import load_topology

VECTORS = 8
FDID = 0x12  # the default cluster's NVMe on alpha, borrowed by a VM on gamma
RELAY_FDID = 0x1

# Software steps between the device's interrupt and the VM's eventfd, per path.
STEPS = {
    "floor": "1: signal the eventfd",
    "ntb (borrower software)": "1: borrower target handler signals the eventfd; lender: none",
    "ntb (simulated fabric)": "same 1 step; the fabric's hops are hardware, simulated here",
    "relay": "3 + 2 wake-ups: lender kernel -> lender relay process -> borrower daemon -> VM",
}

Signal = Callable[[int], None]


def latency(raise_irq: Signal, wait: list[EventFd], n: int) -> list[int]:
    """ns from ``raise_irq(v)`` to ``wait[v]`` readable, one interrupt at a time."""
    polls = []
    for efd in wait:
        p = select.poll()
        p.register(efd.fileno(), select.POLLIN)
        polls.append(p)
    out = [0] * n
    clock = time.perf_counter_ns
    for i in range(n):
        v = i % len(wait)
        t0 = clock()
        raise_irq(v)
        if not polls[v].poll(2000):
            raise SystemExit(f"interrupt {i} on vector {v} was not delivered within 2 s")
        out[i] = clock() - t0
        wait[v].drain()
    return out


def throughput(raise_irq: Signal, wait: list[EventFd], seconds: float) -> float:
    """Interrupts/s raised by one thread and all seen by another (checked)."""
    ep = select.epoll()
    for efd in wait:
        ep.register(efd.fileno(), select.EPOLLIN)
    by_fd = {efd.fileno(): efd for efd in wait}
    seen = [0]
    done = threading.Event()

    def drain() -> None:
        while True:
            for fd, _ev in ep.poll(0.05):
                seen[0] += by_fd[fd].drain()
            if done.is_set():
                for efd in wait:
                    seen[0] += efd.drain()
                return

    reader = threading.Thread(target=drain, name="vm")
    reader.start()
    raised = 0
    end = time.perf_counter() + seconds
    t0 = time.perf_counter()
    while time.perf_counter() < end:
        for v in range(VECTORS):
            raise_irq(v)
        raised += VECTORS
    elapsed = time.perf_counter() - t0
    deadline = time.monotonic() + 10
    while seen[0] < raised and time.monotonic() < deadline:
        time.sleep(0.01)
    done.set()
    reader.join()
    ep.close()
    if seen[0] != raised:
        raise SystemExit(f"raised {raised} interrupts but the VM saw {seen[0]}")
    return raised / elapsed


def ntb_setup() -> tuple[SimHardware, NtbMsiRoute, list[EventFd]]:
    """The default cluster; a VM on gamma borrows alpha's NVMe and enables 8 MSI-X vectors."""
    hw = SimHardware.from_topology(load_topology(), seed=1)
    hw.create_guest("gamma", "bench", [GuestRange(0, 8 * MiB)])
    hw.borrow(FDID, "gamma", "bench")
    route = NtbMsiRoute(hw, MsiTargets(hw), FDID)
    dev = hw.device(FDID)
    dev.config.write(regs.COMMAND, 2, regs.COMMAND_MEMORY | regs.COMMAND_MASTER)
    msix = dev.spec.msix
    assert msix is not None
    for v in range(VECTORS):
        base = msix.table_offset + v * r.MSIX_ENTRY_SIZE
        dev.bars.write(msix.table_bar, base + r.MSIX_ENTRY_ADDR_LO, 4, 0xFEE0_0000)
        dev.bars.write(msix.table_bar, base + r.MSIX_ENTRY_DATA, 4, 0x4000 + v)
        dev.bars.write(msix.table_bar, base + r.MSIX_ENTRY_CTRL, 4, 0)
    cap = dev.config.find_capability(r.CAP_ID_MSIX)
    assert cap is not None
    dev.config.write(cap + r.MSIX_FLAGS, 2, r.MSIX_FLAGS_ENABLE)
    vm = [EventFd() for _ in range(VECTORS)]
    route.set_triggers(IrqIndex.MSIX, [e.fileno() for e in vm])
    return hw, route, vm


def measure_relay(n: int, seconds: float) -> tuple[list[int], float]:
    pid, t_daemon, e_parent = fork_lender()  # before any thread exists
    with TemporaryDirectory(prefix="bench-msi-") as tmp:
        daemon, sock = start_relay(Path(tmp))
        try:
            with RelayClient(sock) as vmm:
                vmm.attach([RELAY_FDID], t_daemon)
                t_daemon.close()
                vm = [EventFd() for _ in range(VECTORS)]
                vmm.set_triggers(RELAY_FDID, IrqIndex.MSIX, [e.fileno() for e in vm])
                _msg, lender_fds = recv_message(e_parent)

                def raise_irq(v: int) -> None:
                    os.eventfd_write(lender_fds[v], 1)

                latency(raise_irq, vm, 2000)  # warm-up
                lat = latency(raise_irq, vm, n)
                rate = throughput(raise_irq, vm, seconds)
        finally:
            os.kill(pid, signal.SIGTERM)
            os.waitpid(pid, 0)
            os.kill(daemon.pid, signal.SIGTERM)
            daemon.wait(10)
    return lat, rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--latency", type=int, default=20_000, help="interrupts timed one by one")
    ap.add_argument("--seconds", type=float, default=2.0, help="length of each throughput run")
    args = ap.parse_args()

    relay_lat, relay_rate = measure_relay(args.latency, args.seconds)

    hw, route, vm = ntb_setup()
    device = hw.device(FDID)
    target = route.target
    messages = [route.message(v) for v in range(VECTORS)]
    target_offsets = [addr & 0xFFF for addr, _ in messages]  # the message's offset in the page

    def floor_irq(v: int) -> None:
        os.eventfd_write(vm[v].fileno(), 1)

    def ntb_software(v: int) -> None:
        target.write(target_offsets[v], messages[v][1])

    rows: dict[str, tuple[list[int], float]] = {}
    for name, fn in (
        ("floor", floor_irq),
        ("ntb (borrower software)", ntb_software),
        ("ntb (simulated fabric)", device.raise_interrupt),
    ):
        latency(fn, vm, 2000)  # warm-up
        rows[name] = (latency(fn, vm, args.latency), throughput(fn, vm, args.seconds))
    rows["relay"] = (relay_lat, relay_rate)
    if route.faults:
        raise SystemExit(f"the NTB path faulted: {route.faults[0]}")
    route.close()

    floor50 = percentiles(rows["floor"][0])[0]
    print(f"device interrupt -> VM eventfd, {args.latency} interrupts timed over {VECTORS} vectors")
    header = f"{'path':26}{'p50 us':>9}{'p99 us':>9}{'p99.9 us':>10}{'irq/s':>11}{'p50/floor':>11}"
    print(header)
    for name, (lat, rate) in rows.items():
        p50, p99, p999 = percentiles(lat)
        print(f"{name:26}{p50:9.2f}{p99:9.2f}{p999:10.2f}{rate:11.0f}{p50 / floor50:10.2f}x")
    print("software steps on each path:")
    for name, steps in STEPS.items():
        print(f"  {name:26}{steps}")
    print(f"hops of one simulated MSI: {' | '.join(str(h) for h in route.last_hops)}")
    for e in vm:
        e.close()


if __name__ == "__main__":
    main()
