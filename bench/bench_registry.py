"""Shared-state costs, side by side in one run: opening the state (vetting included), listing
the devices, an admission dry-run (read only) and a reserve+release cycle (two write
transactions, each committed durably). Prints times and ratios; asserts nothing."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from vmlend.sim.backend import SimFabric
from vmlend.topology.model import GiB, Holder
from vmlend.wiring.fabric import default_topology_text, init_fabric, open_fabric

N = 200


def _per_op(fn, n: int = N) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def _cycle(f: SimFabric) -> None:
    h = Holder("gamma", "bench")
    f.reserve(0x10, h, guest_ram=16 * GiB)
    f.release(0x10, h)


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "state.db"
        text, source = default_topology_text()
        init_fabric(path, text, source, node="gamma")

        def open_close() -> None:
            f = open_fabric(path)
            assert isinstance(f, SimFabric)
            f.close()

        t_open = _per_op(open_close, 50)
        f = open_fabric(path)
        assert isinstance(f, SimFabric)
        t_list = _per_op(f.devices)
        t_admit = _per_op(lambda: f.admission(0x10, "gamma", 16 * GiB))
        t_cycle = _per_op(lambda: _cycle(f))
        f.close()
    ms = 1e3
    print(f"open state (vet + read topology)  {t_open * ms:8.3f} ms")
    print(f"devices() listing                 {t_list * ms:8.3f} ms")
    print(f"admission dry-run                 {t_admit * ms:8.3f} ms")
    print(f"reserve+release                   {t_cycle * ms:8.3f} ms")
    print(f"ratio reserve+release/admission   {t_cycle / t_admit:8.2f}x")
    print(f"ratio open/listing                {t_open / t_list:8.2f}x")


if __name__ == "__main__":
    main()
