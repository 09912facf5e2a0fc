"""Interrupt relay benchmark: lender eventfd -> VM eventfd, beside eventfd-to-eventfd baselines.

One run, this machine. Roles:
- this process plays the host kernel (signals the lender's eventfds) and the VM (waits on its
  eventfds);
- a forked child is the lender side (``LenderRelay`` with 8 MSI-X vectors);
- a ``vmlend relay`` daemon subprocess is the borrower side; the two are joined by a
  SOCK_SEQPACKET transport handed to the daemon over its control socket.
Baselines, in this process: "forward" is a thread that reads eventfd A and writes eventfd B
(one eventfd-to-eventfd hop); "floor" signals B directly (no hop at all).
A third table times one 12-byte hop between two processes over candidate transports.

Usage: bench/bench_irq.py [--latency N] [--seconds S]
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from tempfile import TemporaryDirectory

from vmlend.irq.client import RelayClient
from vmlend.irq.control import recv_message, send_message
from vmlend.irq.eventfd import EventFd
from vmlend.irq.lender import LenderRelay
from vmlend.irq.relay import Reactor
from vmlend.irq.vectors import FixedIrqSetup, IrqIndex, IrqSetup
from vmlend.irq.vfio import TRIGGER_EVENTFDS

FDID = 0x1
VECTORS = 8


# --- the lender, in a child process ---------------------------------------------------------


class ExportingHost:
    """Stands in for the lender's kernel: sends each trigger eventfd to the parent, which then
    signals it as the device's interrupt handler would."""

    def __init__(self, export: socket.socket) -> None:
        self._export = export

    def set_irqs(self, index: int, flags: int, start: int, fds: Sequence[int]) -> None:
        if flags == TRIGGER_EVENTFDS:
            send_message(self._export, {"index": index, "start": start}, list(fds))


def run_lender(transport: socket.socket, export: socket.socket) -> None:
    reactor = Reactor()
    relay = LenderRelay(reactor)
    channel = relay.open_channel(transport)
    setup = FixedIrqSetup(IrqSetup(IrqIndex.MSIX, VECTORS))
    relay.add_device(FDID, setup, ExportingHost(export), channel)
    signal.signal(signal.SIGTERM, lambda *_: reactor.stop())
    reactor.run()
    relay.close()
    reactor.close()


# --- measurements ---------------------------------------------------------------------------


def ping_pong(signal_fds: list[int], wait_fds: list[EventFd], n: int) -> list[int]:
    """Latency in ns from signalling signal_fds[v] to wait_fds[v] being readable."""
    polls = []
    for efd in wait_fds:
        p = select.poll()
        p.register(efd.fileno(), select.POLLIN)
        polls.append(p)
    out = [0] * n
    clock = time.perf_counter_ns
    write = os.eventfd_write
    for i in range(n):
        v = i % len(signal_fds)
        t0 = clock()
        write(signal_fds[v], 1)
        if not polls[v].poll(2000):
            raise SystemExit(f"interrupt {i} on vector {v} was not delivered within 2 s")
        out[i] = clock() - t0
        wait_fds[v].drain()
    return out


def throughput(
    signal_fds: list[int], wait_fds: list[EventFd], seconds: float
) -> tuple[float, int, float]:
    """Interrupts/s delivered while one thread signals as fast as it can; also the number of
    VM wake-ups it took (coalescing) and how long delivery lagged after signalling stopped.
    Checks that every interrupt arrived."""
    ep = select.epoll()
    for efd in wait_fds:
        ep.register(efd.fileno(), select.EPOLLIN)
    got = 0
    wakeups = 0
    done = threading.Event()
    sent = [0]

    def reader() -> None:
        nonlocal got, wakeups
        while not (done.is_set() and got >= sent[0]):
            events = ep.poll(0.5)
            if events:
                wakeups += 1
            for fd, _ in events:
                got += os.eventfd_read(fd)

    t = threading.Thread(target=reader)
    t.start()
    write = os.eventfd_write
    k = len(signal_fds)
    start = time.perf_counter()
    end = start + seconds
    i = 0
    while True:
        for fd in signal_fds:
            write(fd, 1)
        i += k
        if i % 1024 == 0 and time.perf_counter() >= end:
            break
    sent[0] = i
    stopped = time.perf_counter()
    done.set()
    t.join(30)
    elapsed = time.perf_counter() - start
    lag = time.perf_counter() - stopped
    ep.close()
    if got != i:
        raise SystemExit(f"throughput run lost interrupts: sent {i}, delivered {got}")
    return got / elapsed, wakeups, lag


def forwarder(pairs: list[tuple[EventFd, EventFd]]) -> Callable[[], None]:
    """The baseline hop: a thread moving counts from each A to its B. Returns a stopper."""
    ep = select.epoll()
    stop = EventFd()
    ep.register(stop.fileno(), select.EPOLLIN)
    by_fd = {a.fileno(): b for a, b in pairs}
    for fd in by_fd:
        ep.register(fd, select.EPOLLIN)

    def loop() -> None:
        while True:
            for fd, _ in ep.poll():
                if fd == stop.fileno():
                    return
                try:
                    n = os.eventfd_read(fd)
                except BlockingIOError:
                    continue
                by_fd[fd].signal(n)

    t = threading.Thread(target=loop, daemon=True)
    t.start()

    def stopper() -> None:
        stop.signal()
        t.join()
        ep.close()
        stop.close()

    return stopper


def percentiles(ns: list[int]) -> tuple[float, float, float]:
    q = statistics.quantiles(ns, n=1000, method="inclusive")
    return q[499] / 1000, q[989] / 1000, q[998] / 1000


# --- transport candidates -------------------------------------------------------------------


def transport_hop(kind: str, n: int) -> float:
    """Median one-way ns of a 12-byte message parent -> child -> parent, halved."""
    if kind in ("seqpacket", "dgram"):
        typ = socket.SOCK_SEQPACKET if kind == "seqpacket" else socket.SOCK_DGRAM
        a, b = socket.socketpair(socket.AF_UNIX, typ)
        send_a, recv_a = (lambda: a.send(b"x" * 12)), (lambda: a.recv(64))
        child = lambda: [b.send(b.recv(64)) for _ in range(n)]  # noqa: E731
    elif kind == "pipe":
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
        send_a, recv_a = (lambda: os.write(w1, b"x" * 12)), (lambda: os.read(r2, 64))
        child = lambda: [os.write(w2, os.read(r1, 64)) for _ in range(n)]  # noqa: E731
    else:  # shared memory slot + eventfd doorbell each way (what an NTB ring looks like)
        import mmap

        shm = mmap.mmap(-1, 4096)
        d1 = os.eventfd(0)
        d2 = os.eventfd(0)

        def send_a() -> None:
            shm[0:12] = b"x" * 12
            os.eventfd_write(d1, 1)

        def recv_a() -> bytes:
            os.eventfd_read(d2)
            return shm[64:76]

        def child() -> None:
            for _ in range(n):
                os.eventfd_read(d1)
                shm[64:76] = shm[0:12]
                os.eventfd_write(d2, 1)

    pid = os.fork()
    if pid == 0:
        try:
            child()
        finally:
            os._exit(0)
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        send_a()
        recv_a()
        samples.append(time.perf_counter_ns() - t0)
    os.waitpid(pid, 0)
    return statistics.median(samples) / 2


# --- main -----------------------------------------------------------------------------------


def start_relay(workdir: Path) -> tuple[subprocess.Popen[bytes], Path]:
    sock = workdir / "relay.sock"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from vmlend.cli import main; main()",
            "relay",
            "--socket",
            str(sock),
        ],
        stderr=subprocess.DEVNULL,
    )
    end = time.monotonic() + 10
    while not sock.exists():
        if time.monotonic() > end or proc.poll() is not None:
            raise SystemExit("the relay daemon did not start")
        time.sleep(0.01)
    return proc, sock


def fork_lender() -> tuple[int, socket.socket, socket.socket]:
    """Fork the lender process (``run_lender``) before any thread exists: (its pid, the
    transport end for the daemon, the end on which it sends its eventfds)."""
    t_lender, t_daemon = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    e_parent, e_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        t_daemon.close()
        e_parent.close()
        try:
            run_lender(t_lender, e_child)
        finally:
            os._exit(0)
    t_lender.close()
    e_child.close()
    return pid, t_daemon, e_parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--latency", type=int, default=100_000, help="interrupts timed one by one")
    ap.add_argument("--seconds", type=float, default=3.0, help="length of each throughput run")
    ap.add_argument("--hops", type=int, default=20_000, help="round trips per transport")
    args = ap.parse_args()

    # Fork the lender before any thread exists.
    lender_pid, t_daemon, e_parent = fork_lender()

    with TemporaryDirectory(prefix="bench-irq-") as tmp:
        daemon, sock = start_relay(Path(tmp))
        try:
            with RelayClient(sock) as vmm:
                vmm.attach([FDID], t_daemon)
                t_daemon.close()
                vm = [EventFd() for _ in range(VECTORS)]
                vmm.set_triggers(FDID, IrqIndex.MSIX, [e.fileno() for e in vm])
                msg, lender_fds = recv_message(e_parent)
                assert msg is not None and len(lender_fds) == VECTORS
                ping_pong(lender_fds, vm, 2000)  # warm-up
                relay_lat = ping_pong(lender_fds, vm, args.latency)
                relay_rate, relay_wakes, relay_lag = throughput(lender_fds, vm, args.seconds)
                stats = vmm.status()["devices"][0]
        finally:
            os.kill(lender_pid, signal.SIGTERM)
            os.waitpid(lender_pid, 0)
            os.kill(daemon.pid, signal.SIGTERM)
            daemon.wait(10)

    pairs = [(EventFd(), EventFd()) for _ in range(VECTORS)]
    stop = forwarder(pairs)
    a_fds = [a.fileno() for a, _ in pairs]
    b_efds = [b for _, b in pairs]
    ping_pong(a_fds, b_efds, 2000)
    fwd_lat = ping_pong(a_fds, b_efds, args.latency)
    fwd_rate, fwd_wakes, fwd_lag = throughput(a_fds, b_efds, args.seconds)
    stop()
    floor_lat = ping_pong([b.fileno() for b in b_efds], b_efds, args.latency)

    hops = {k: transport_hop(k, args.hops) for k in ("seqpacket", "dgram", "pipe", "shm+eventfd")}

    r50, r99, r999 = percentiles(relay_lat)
    f50, f99, f999 = percentiles(fwd_lat)
    n50, n99, n999 = percentiles(floor_lat)
    print(f"interrupt relay, {args.latency} interrupts timed over {VECTORS} vectors")
    print(f"{'':22}{'floor':>10}{'forward':>10}{'relay':>10}{'relay/forward':>15}")
    for name, n, f, r in (
        ("latency p50 (us)", n50, f50, r50),
        ("latency p99 (us)", n99, f99, r99),
        ("latency p99.9 (us)", n999, f999, r999),
    ):
        print(f"{name:22}{n:10.1f}{f:10.1f}{r:10.1f}{r / f:14.2f}x")
    print(
        f"{'interrupts/s':22}{'':>10}{fwd_rate:10.0f}{relay_rate:10.0f}"
        f"{relay_rate / fwd_rate:14.2f}x"
    )
    print(
        f"{'  VM wake-ups':22}{'':>10}{fwd_wakes:10d}{relay_wakes:10d}"
        f"   (eventfd counts coalesce; every interrupt was counted)"
    )
    print(
        f"{'  drain after stop (ms)':22}{'':>10}{fwd_lag * 1000:10.1f}{relay_lag * 1000:10.1f}"
        "   (how far delivery lagged behind the signalling thread)"
    )
    print(f"relay delivered {stats['delivered']} interrupts in all, held {stats['held']}")
    print("one-way hop between two processes, median (us):")
    base = hops["seqpacket"]
    for k, v in hops.items():
        print(f"  {k:14}{v / 1000:8.2f}   {v / base:5.2f}x seqpacket")


if __name__ == "__main__":
    main()
