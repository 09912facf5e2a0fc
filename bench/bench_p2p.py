"""Peer-to-peer costs side by side: planning for 4 / 8 / 16 devices (pure), mapping a whole VM
on the simulated hardware vs moving one BAR (only the difference is applied), and resolving a
same-lender vs a cross-lender P2P DMA.

Prints ratios from one run; asserts nothing about time.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from vmlend.p2p import GuestBar, PeerBar, PeerDevice, plan_p2p
from vmlend.sim.hardware import SimHardware
from vmlend.sim.p2pmap import P2PMapper
from vmlend.sim.pci import regs
from vmlend.topology.model import BarKind, GiB, GuestRange, MiB
from vmlend.topology.parse import load_topology

RAM = [GuestRange(0, 2 * GiB), GuestRange(4 * GiB, 8 * GiB)]
HI = 0x80_0000_0000
PLACES = {
    0x10: {0: (0xC000_0000, 16 * MiB), 1: (HI, 32 * GiB), 3: (HI + 32 * GiB, 32 * MiB)},
    0x11: {0: (0xC100_0000, 16 * MiB), 1: (HI + 64 * GiB, 32 * GiB), 3: (HI + 96 * GiB, 32 * MiB)},
    0x20: {
        0: (0xC200_0000, 16 * MiB),
        1: (HI + 128 * GiB, 32 * GiB),
        3: (HI + 160 * GiB, 32 * MiB),
    },
    0x21: {0: (0xC400_0000, 1 * MiB), 3: (0xC410_0000, 16 * 1024)},
}


def timed(fn: Callable[[], object], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def plan_cost(count: int) -> tuple[float, int]:
    topo = load_topology()
    devices, bars = [], []
    for i in range(count):
        lender = "alpha" if i % 2 else "beta"
        devices.append(
            PeerDevice(0x100 + i, lender, (PeerBar(0, 16 * MiB, BarKind.MEM32, 0x8000_0000),))
        )
        bars.append(GuestBar(0x100 + i, 0, 0xC000_0000 + i * 16 * MiB, 16 * MiB))
    maps = len(plan_p2p(topo, "gamma", devices, bars, RAM).maps)
    return timed(lambda: plan_p2p(topo, "gamma", devices, bars, RAM), 200), maps


def vm() -> tuple[SimHardware, P2PMapper]:
    hw = SimHardware.from_topology(load_topology())
    hw.create_guest("gamma", "web", RAM)
    for f in PLACES:
        hw.borrow(f, "gamma", "web")
        hw.device(f).config.write(regs.COMMAND, 2, regs.COMMAND_MEMORY | regs.COMMAND_MASTER)
    return hw, P2PMapper(hw, "gamma", "web")


def program_all(p2p: P2PMapper) -> None:
    for f, bars in PLACES.items():
        for index, (gpa, size) in bars.items():
            p2p.program_bar(f, index, gpa, size)


def main() -> None:
    base = None
    for count in (4, 8, 16):
        seconds, maps = plan_cost(count)
        base = base or seconds
        print(
            f"plan {count:2d} devices: {maps:4d} maps, {seconds * 1e6:8.1f} us "
            f"({seconds / base:5.1f}x the 4-device plan)"
        )

    runs = []
    for _ in range(20):
        hw, p2p = vm()
        t0 = time.perf_counter()
        program_all(p2p)
        runs.append(time.perf_counter() - t0)
    whole = min(runs)
    places = itertools.cycle([HI + 256 * GiB, HI + 128 * GiB])  # back and forth
    move = timed(lambda: p2p.program_bar(0x20, 1, next(places), 32 * GiB), 200)
    print(f"map a whole VM ({len(p2p.maps())} maps, 11 BAR writes): {whole * 1e3:8.2f} ms")
    print(f"move one 32 GiB BAR (re-plan, apply the difference): {move * 1e3:8.2f} ms")
    print(f"  ratio whole VM / one move: {whole / move:5.1f}x")

    same = timed(lambda: hw.resolve_dma(0x10, PLACES[0x11][1][0] + 0x1000, write=True), 20000)
    cross = timed(lambda: hw.resolve_dma(0x10, PLACES[0x21][0][0] + 0x1000, write=True), 20000)
    print(
        f"resolve P2P DMA same lender: {same * 1e6:6.2f} us, "
        f"to the other lender: {cross * 1e6:6.2f} us"
    )
    print(f"  ratio other/same lender: {cross / same:5.1f}x")


if __name__ == "__main__":
    main()
