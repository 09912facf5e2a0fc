"""Live migration of a VM with remote devices between simulated nodes, against cold migration.

For 0 to 3 remote devices (all lent by alpha), a VM moves gamma -> beta and back ``ROUNDS``
times through
``vmlend.ops.live_migrate`` (what ``vmlend migrate --live`` runs), with vmlend's real hook run
as a subprocess per call as libvirtd runs it. Printed per device count:

- downtime: the VM's vCPUs stopped (the simulated switch-over; libvirt reports its own);
- blackout: per device, from the start of its unplug on the source to the end of its hot-plug
  on the destination (median over devices and rounds);
- the whole live migration, and a cold migration (shut down, move, start) of the same VM, whose
  whole duration is the VM's downtime.

The simulated guest lets go of a device at once and QEMU's memory copy is two file writes, so
the figures are vmlend's own cost (hook runs, registry transactions, XML), not a real guest's.
Asserts nothing."""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, new_domain
from vmlend.hypervisor import LiveMigration
from vmlend.ops.live_migrate import live_migrate
from vmlend.ops.migrate import migrate
from vmlend.sim.hypervisor.node import SimHypervisor
from vmlend.topology.model import MiB
from vmlend.wiring.fabric import default_topology_text, init_fabric, open_fabric
from vmlend.wiring.hypervisor import hook_command, open_hypervisor

ROUNDS = 3
DEVICES = (0x10, 0x11, 0x12)  # alpha lends them; gamma and beta borrow


def hv(state: Path, node: str) -> SimHypervisor:
    h = open_hypervisor(
        f"sim:///{node}", state_dir=state.parent, hook_command=hook_command(state, node)
    )
    assert isinstance(h, SimHypervisor)
    return h


def one_count(n: int) -> tuple[float, float, float, float]:
    """(median downtime, median blackout, median live total, median cold total), seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state.db"
        text, source = default_topology_text()
        init_fabric(state, text, source, node="gamma", hostname="bench-host")
        spec = DomainSpec(
            name="vm1",
            memory_bytes=256 * MiB,
            virt_type="qemu",
            uuid=uuid.uuid4(),
            devices=[DeviceRequest(f) for f in DEVICES[:n]],
        )
        hv(state, "gamma").define(new_domain(spec, templates=TemplateSet()).to_bytes())
        hv(state, "gamma").start("vm1")
        downtimes: list[float] = []
        blackouts: list[float] = []
        totals: list[float] = []
        here, there = "gamma", "beta"
        for _ in range(ROUNDS * 2):
            with open_fabric(state, here) as f, open_fabric(state, there) as g:
                t0 = time.perf_counter()
                res = live_migrate(
                    hv(state, here),
                    hv(state, there),
                    f,
                    g,
                    "vm1",
                    there,
                    how=LiveMigration(persistent=True, undefine_source=True),
                    state_dir=state.parent,
                )
                totals.append(time.perf_counter() - t0)
            downtimes.append(res.downtime or 0.0)
            blackouts += [b for b in res.blackout.values() if b is not None]
            here, there = there, here
        colds: list[float] = []
        for _ in range(ROUNDS * 2):
            with open_fabric(state, here) as f:
                t0 = time.perf_counter()
                migrate(hv(state, here), hv(state, there), f, "vm1", there, start=True)
                colds.append(time.perf_counter() - t0)
            here, there = there, here
    med = statistics.median
    return med(downtimes), med(blackouts) if blackouts else 0.0, med(totals), med(colds)


def main() -> None:
    print(
        f"{'devices':>7} {'downtime ms':>12} {'blackout ms':>12} {'live total ms':>14}"
        f" {'cold total ms':>14} {'cold/live downtime':>19}"
    )
    for n in range(len(DEVICES) + 1):
        down, black, live, cold = one_count(n)
        ratio = f"{cold / down:.0f}x" if down else "-"
        print(
            f"{n:>7} {down * 1000:>12.1f} {black * 1000:>12.1f} {live * 1000:>14.1f}"
            f" {cold * 1000:>14.1f} {ratio:>19}"
        )
    print(
        f"(median of {ROUNDS * 2} moves each; blackout per device; a cold move's downtime is all"
        " of it)"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
