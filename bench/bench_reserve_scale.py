"""Reserve CPU as the fabric grows, side by side in one run (issue 38 point 3; prints times
and ratios; asserts nothing).

1. CPU per reserve (this process's CPU, ``time.process_time``: vmlend's own work, not
   etcd's) on generated one-switch fabrics of 64 and 1,024 nodes with 17 devices each
   (``fabric_topology``), on SQLite and on a private etcd: one VM reserves a device of a
   different lender each time and releases it (the release is not counted). Goal: 1,024
   nodes within 1.2x of 64.
2. Filling the 1,024-node fabric: VMS VMs with two remote devices each, reserved one after
   the other through one open fabric (a scheduler's view: reserve takes any holder node);
   CPU per admitted reserve of the first 100 vs the last 100. Refusals (for want of LUT
   entries or window segments) are counted apart. Goal: last/first within 1.2x.

``VMLEND_BENCH_VMS`` sets the VM count of part 2 (default 8,000, the issue's);
``VMLEND_BENCH_REGISTRIES`` which registries to measure (default ``sqlite,etcd``). The etcd
is started with ``--max-request-bytes=32MiB``: a 1,024-node topology record (its TOML and
compiled form) is several MB, over etcd's default 1.5 MiB.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.* helpers

from tests.support.etcd_daemon import EtcdServer, host_lease
from tests.support.simfabric import fabric_topology
from vmlend.errors import ResourceExhaustedError, WindowExhaustedError
from vmlend.sim.backend import SimFabric
from vmlend.topology.model import GiB, Holder
from vmlend.wiring.fabric import init_fabric, open_fabric

SIZES = (64, 1024)
PER_NODE = 17
RESERVES = 400
ROUNDS = 10
VMS = int(os.environ.get("VMLEND_BENCH_VMS", "8000"))
REGISTRIES = os.environ.get("VMLEND_BENCH_REGISTRIES", "sqlite,etcd").split(",")
WINDOW = 100
ms = 1e3


def _fdid(node: int, i: int) -> int:
    return (node + 1) * 0x100 + i


def _open(location: object, node: str) -> SimFabric:
    f = open_fabric(location, node)  # type: ignore[arg-type]
    assert isinstance(f, SimFabric)
    return f


def reserve_cpu(at: Callable[[str], object]) -> dict[int, tuple[float, float]]:
    """Per fabric size, the mean CPU and wall time of one reserve. The sizes take turns, a
    batch each per round, so that drift of the shared machine falls on both alike."""
    fabrics: dict[int, tuple[SimFabric, Holder, int]] = {}
    for nodes in SIZES:
        location = at(f"size{nodes}")
        init_fabric(location, fabric_topology(nodes, PER_NODE), "generated.toml")  # type: ignore[arg-type]
        me = nodes // 2
        f = _open(location, f"n{me}")
        holder = Holder(f"n{me}", "bench")
        f.reserve(_fdid(0, 0), holder, guest_ram=GiB)  # the topology decoded, the state warm
        f.release(_fdid(0, 0), holder)
        fabrics[nodes] = (f, holder, me)
    cpu = dict.fromkeys(SIZES, 0.0)
    wall = dict.fromkeys(SIZES, 0.0)
    batch = RESERVES // ROUNDS
    for r in range(ROUNDS):
        for nodes, (f, holder, me) in fabrics.items():
            for k in range(r * batch, (r + 1) * batch):
                lender = (me + 1 + k * 7) % nodes
                lender = lender if lender != me else (lender + 1) % nodes
                fdid = _fdid(lender, k % PER_NODE)
                c, w = time.process_time(), time.perf_counter()
                f.reserve(fdid, holder, guest_ram=GiB)
                cpu[nodes] += time.process_time() - c
                wall[nodes] += time.perf_counter() - w
                f.release(fdid, holder)
    for f, _holder, _me in fabrics.values():
        f.close()
    n = batch * ROUNDS
    return {nodes: (cpu[nodes] / n, wall[nodes] / n) for nodes in SIZES}


def fill(location: object, nodes: int, vms: int) -> tuple[list[float], int, float]:
    """``vms`` two-device VMs, each on the node half the fabric away from its devices'
    lender: CPU of each admitted reserve, the refusals, the run's wall time."""
    init_fabric(location, fabric_topology(nodes, PER_NODE), "generated.toml")  # type: ignore[arg-type]
    f = _open(location, "n0")
    # one-time costs out of the first 100 (etcd decodes the topology's capacities once): a
    # device no VM below takes, reserved and released
    spare, probe = _fdid(nodes - 1, PER_NODE - 1), Holder("n0", "warm-up")
    f.reserve(spare, probe, guest_ram=GiB)
    f.release(spare, probe)
    admitted: list[float] = []
    refused = 0
    start = time.perf_counter()
    for vm in range(vms):
        first = 2 * vm
        lender = (first // PER_NODE) % nodes
        holder = Holder(f"n{(lender + nodes // 2) % nodes}", f"vm{vm}")
        for dev in (first, first + 1):
            fdid = _fdid((dev // PER_NODE) % nodes, dev % PER_NODE)
            c = time.process_time()
            try:
                f.reserve(fdid, holder, guest_ram=GiB)
            except (ResourceExhaustedError, WindowExhaustedError):
                refused += 1
                continue
            admitted.append(time.process_time() - c)
    took = time.perf_counter() - start
    f.close()
    return admitted, refused, took


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        server: EtcdServer | None = None
        locations: list[tuple[str, object]] = []
        if "sqlite" in REGISTRIES:
            locations.append(("SQLite", None))
        if "etcd" in REGISTRIES:
            server = EtcdServer(root / "etcd", extra_args=("--max-request-bytes=33554432",))
            server.start()
            host_lease(server, root / "host", ttl=3600)
            os.environ["VMLEND_ROOT"] = str(root / "host")
            locations.append(("etcd", server))
        try:
            for name, where in locations:

                def at(label: str, where: object = where) -> object:
                    if isinstance(where, EtcdServer):
                        return where.url(label)
                    return root / f"{label}.db"

                cpu = reserve_cpu(at)
                (c64, w64), (c1k, w1k) = cpu[SIZES[0]], cpu[SIZES[1]]
                print(
                    f"{name:6} reserve CPU {SIZES[0]} nodes {c64 * ms:6.3f} ms,"
                    f" {SIZES[1]} nodes {c1k * ms:6.3f} ms: {c1k / c64:5.2f}x (goal <= 1.2x);"
                    f" wall {w64 * ms:6.3f} vs {w1k * ms:6.3f} ms, {w1k / w64:5.2f}x"
                )
                lat, refused, took = fill(at("fill"), SIZES[1], VMS)
                first = statistics.mean(lat[:WINDOW])
                last = statistics.mean(lat[-WINDOW:])
                print(
                    f"{name:6} {VMS} two-device VMs on {SIZES[1]} nodes: {len(lat)} reserves"
                    f" admitted, {refused} refused for want of adapter resources,"
                    f" {took:6.1f} s; CPU per admitted reserve, first {WINDOW}"
                    f" {first * ms:6.3f} ms, last {WINDOW} {last * ms:6.3f} ms:"
                    f" {last / first:5.2f}x (goal <= 1.2x)"
                )
        finally:
            if server is not None:
                server.stop()


if __name__ == "__main__":
    main()
