"""Pin probe vs linear page walk: probes and wall time against guest size (1 GiB .. 4 TiB).

Both run side by side in one process over the same synthetic pin oracle (a q35 guest, Intel
vCPU, RAM from its computed layout). Probe counts are exact for every size: the binary probe is
run, and the linear walk's count is one probe per page plus one failing probe per start (checked
against real walks where those are timed). The linear walk is *timed* only up to
--measure-up-to GiB; beyond that its time is extrapolated from the measured cost per probe and
marked with '~'. Run: .venv/bin/python bench/bench_probe.py [--measure-up-to 8]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from vmlend.memory.layout import PAGE, CpuVendor, MemoryConfig, compute_layout
from vmlend.memory.probe import linear_walk, probe_layout
from vmlend.topology.model import GiB


def make_oracle(size: int) -> tuple[Callable[[int], bool], int, object]:
    layout = compute_layout(MemoryConfig("q35", size, cpu_vendor=CpuVendor.INTEL))
    ranges = [(r.start, r.end) for r in layout.ranges()]

    def can_pin(gpa: int) -> bool:
        return any(start <= gpa < end for start, end in ranges)

    # one probe per page, plus the failing probe that ends the walk from each of its 2 starts
    linear_count = sum((end - start) // PAGE for start, end in ranges) + 2
    return can_pin, linear_count, layout


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    if seconds < 3600:
        return f"{seconds:.1f} s"
    return f"{seconds / 3600:.1f} h"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure-up-to", type=int, default=8, metavar="GiB")
    args = parser.parse_args()

    sizes = [GiB << i for i in range(13)]  # 1 GiB .. 4 TiB
    per_probe = None
    print(
        f"{'guest':>8} {'probes':>7} {'probe time':>11} {'linear probes':>14} "
        f"{'linear time':>12} {'probe ratio':>12} {'time ratio':>11}"
    )
    for size in sizes:
        can_pin, linear_count, layout = make_oracle(size)
        t0 = time.perf_counter()
        result = probe_layout(can_pin, layout)  # type: ignore[arg-type]
        probe_time = time.perf_counter() - t0
        if size <= args.measure_up_to * GiB:
            t0 = time.perf_counter()
            walk = linear_walk(can_pin)
            linear_time = time.perf_counter() - t0
            assert walk.probes == linear_count, (walk.probes, linear_count)
            assert walk.ranges == result.ranges
            per_probe = linear_time / walk.probes
            shown = fmt_time(linear_time)
        else:
            assert per_probe is not None
            linear_time = per_probe * linear_count
            shown = "~" + fmt_time(linear_time)
        label = f"{size // GiB} GiB" if size < 1024 * GiB else f"{size // (1024 * GiB)} TiB"
        print(
            f"{label:>8} {result.probes:>7} {fmt_time(probe_time):>11} {linear_count:>14,} "
            f"{shown:>12} {linear_count / result.probes:>11,.0f}x "
            f"{linear_time / probe_time:>10,.0f}x"
        )
    assert per_probe is not None
    print(
        f"\nlinear walk timed up to {args.measure_up_to} GiB; '~' = extrapolated at "
        f"{per_probe * 1e9:.0f} ns per probe (this synthetic oracle; a real pin costs more)"
    )


if __name__ == "__main__":
    main()
