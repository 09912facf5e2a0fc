"""Kernel-backend costs, side by side in one run, over the fake sysfs of the tests:

- a VM's device cycle (reserve, ensure parent, create mdev, remove mdev, release) on the
  simulated backend and on the SmartIO backend (same registry work plus the sysfs reads and
  writes), so the ratio is what the kernel side adds;
- the udev watcher reacting to one event versus a full ``discover()`` reconcile, for a host with
  many parents (what an event saves over rescanning).

The fake's emulated store handlers (mkdir, symlinks on the temp filesystem) are timed apart, so
what remains is vmlend's own sysfs reading and bookkeeping; a real kernel's store handlers cost
something else entirely. Prints times and ratios; asserts nothing.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.support.fake_sysfs

from tests.support.fake_sysfs import FakeSmartio, FakeSysfs, FakeType, populate_smartio
from vmlend.kernel.backend import SmartioFabric
from vmlend.kernel.mdev import MdevBus
from vmlend.kernel.udev import ParentWatcher, Uevent, WantedMdev
from vmlend.registry import open_registry
from vmlend.sim.backend import SimFabric
from vmlend.topology.model import GiB, Holder
from vmlend.wiring.fabric import default_topology_text, init_fabric

N = 100
PARENTS = 64
HOLDER = Holder("gamma", "bench", "11111111-1111-1111-1111-111111111111")
UUID = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001"


def _per_op(fn: Callable[[], object], n: int = N) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


class TimedWriter:
    """Passes writes to the fake kernel and adds up the time they take."""

    def __init__(self, inner: FakeSysfs) -> None:
        self.inner = inner
        self.spent = 0.0

    def write(self, path: Path, text: str) -> None:
        start = time.perf_counter()
        try:
            self.inner.write(path, text)
        finally:
            self.spent += time.perf_counter() - start


def _cycle(f: SimFabric | SmartioFabric) -> None:
    f.reserve(0x12, HOLDER, guest_ram=4 * GiB)
    f.ensure_mdev_parent(0x12)
    f.create_mdev(0x12, UUID, HOLDER)
    f.remove_mdev(UUID)
    f.release(0x12, HOLDER)


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        state = root / "state.db"
        init_fabric(state, *default_topology_text(), node="gamma")

        with SimFabric(open_registry(state)) as sim:
            t_sim = _per_op(lambda: _cycle(sim))

        fake = FakeSysfs(root / "host")
        with SimFabric(open_registry(state)) as sim:
            populate_smartio(FakeSmartio(fake, node_id=12), sim.topology())
        writer = TimedWriter(fake)
        with SmartioFabric(open_registry(state), fake.env, writer=writer) as kernel:
            t_kernel = _per_op(lambda: _cycle(kernel))
        t_emulated = writer.spent / N
        t_reads = t_kernel - t_emulated - t_sim

        many = FakeSysfs(root / "many")
        wanted = []
        for i in range(PARENTS):
            many.add_parent(f"smartio-{i:x}", [FakeType("smartio-lend")], announce=False)
            uuid = f"83b8f4f2-509f-382f-3c1e-{i:012x}"
            wanted.append(WantedMdev(uuid, f"smartio-{i:x}", "smartio-lend"))
        watcher = ParentWatcher(MdevBus(many.env, many), lambda: wanted)
        t_discover = _per_op(watcher.discover, 20)  # after the first, every child is present
        event = Uevent("change", "smartio-0", "pci", {"MDEV_STATE": "registered"})
        t_event = _per_op(lambda: watcher.handle(event))

    ms = 1e3
    print(f"VM device cycle, sim backend            {t_sim * ms:8.3f} ms")
    print(f"VM device cycle, smartio (fake sysfs)   {t_kernel * ms:8.3f} ms")
    print(f"  of which the fake kernel's writes     {t_emulated * ms:8.3f} ms")
    print(f"  of which vmlend's sysfs reads (rest)  {t_reads * ms:8.3f} ms")
    print(f"ratio smartio/sim                       {t_kernel / t_sim:8.2f}x")
    print(f"ratio smartio minus fake writes/sim     {(t_kernel - t_emulated) / t_sim:8.2f}x")
    print(f"watcher discover(), {PARENTS} parents         {t_discover * ms:8.3f} ms")
    print(f"watcher handle(one event)               {t_event * ms:8.3f} ms")
    print(f"ratio discover/event                    {t_discover / t_event:8.2f}x")


if __name__ == "__main__":
    main()
