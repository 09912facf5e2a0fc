"""Simulator costs side by side: mapping a guest with 4 KiB / 2 MiB / 1 GiB backing (page-table
entries and time), and resolving a DMA on the same lender vs across the NTB.

Prints ratios from one run; asserts nothing about time.
"""

from __future__ import annotations

import time

from vmlend.sim.hardware import SimHardware
from vmlend.sim.hostmem import FRAME, HUGE_1G, HUGE_2M
from vmlend.sim.pci import regs
from vmlend.topology.model import GiB, GuestRange, MiB
from vmlend.topology.parse import load_topology

GUEST = [GuestRange(0, 1 * GiB), GuestRange(4 * GiB, 5 * GiB)]  # 2 GiB, q35-like split
BORROWER_IOVA = 0x40_0000_0000


def map_guest(backing: int) -> tuple[float, dict[int, int], SimHardware]:
    hw = SimHardware.from_topology(load_topology())
    t0 = time.perf_counter()
    guest = hw.create_guest("gamma", "web", GUEST, backing=backing)
    hw.borrow(0x12, "gamma", "web")
    dom = hw.vm_domain("gamma", "web")
    window = hw.adapter("alpha:0")
    for i, r in enumerate(GUEST):
        iova = BORROWER_IOVA + i * window.segment_size
        window.map_segment(i, "gamma", iova)
        for f in guest.pin(r.start, r.size):
            dom.map(iova + f.gpa - r.start, f.phys, f.size)
        hw.lender_domain(0x12).map(r.start, window.segment_base(i), r.size)
    return time.perf_counter() - t0, dom.entries(), hw


def per_call(fn, n: int = 20000) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main() -> None:
    results = {}
    for name, backing in (("4KiB", FRAME), ("2MiB", HUGE_2M), ("1GiB", HUGE_1G)):
        seconds, entries, hw = map_guest(backing)
        results[name] = (seconds, entries, hw)
        total = sum(entries.values())
        print(
            f"map 2 GiB guest, {name} backing: {seconds * 1e3:8.1f} ms, {total:7d} PTEs {entries}"
        )
    base = results["1GiB"][0]
    for name in ("4KiB", "2MiB"):
        print(f"  time ratio {name}/1GiB: {results[name][0] / base:8.1f}x")

    hw = results["2MiB"][2]
    hw.device(0x12).config.write(regs.COMMAND, 2, regs.COMMAND_MEMORY | regs.COMMAND_MASTER)
    gpu = hw.device(0x10)
    gpu.config.write(regs.COMMAND, 2, regs.COMMAND_MEMORY | regs.COMMAND_MASTER)
    hw.lender_domain(0x10).map(0, hw.device(0x11).bar_range(1)[0], 1 * GiB)
    remote = per_call(lambda: hw.resolve_dma(0x12, 0x1234_5000))
    local = per_call(lambda: hw.resolve_dma(0x10, 0x1234_5000))
    print(f"resolve across the NTB: {remote * 1e6:6.2f} us, same lender P2P: {local * 1e6:6.2f} us")
    print(f"  ratio remote/local: {remote / local:.2f}x")
    data = bytes(1 * MiB)
    t0 = time.perf_counter()
    hw.dma_write(0x12, 0x100_0000, data)
    dt = time.perf_counter() - t0
    print(f"dma_write 1 MiB across the NTB: {dt * 1e3:.1f} ms ({len(data) / dt / 1e6:.0f} MB/s)")


if __name__ == "__main__":
    main()
