"""Live migration of a VM with remote devices between simulated nodes, against cold migration.

For 0 to 3 remote devices (all lent by alpha), a VM moves gamma -> beta and back ``ROUNDS``
times through
``vmlend.ops.live_migrate`` (what ``vmlend migrate --live --unplug`` runs), with vmlend's real
hook run as a subprocess per call as libvirtd runs it. Printed per device count:

- downtime: the VM's vCPUs stopped (the simulated switch-over; libvirt reports its own);
- blackout: per device, from the start of its unplug on the source to the end of its hot-plug
  on the destination (median over devices and rounds);
- the whole live migration, and a cold migration (shut down, move, start) of the same VM, whose
  whole duration is the VM's downtime.

The simulated guest lets go of a device at once and QEMU's memory copy is two file writes, so
the figures are vmlend's own cost (hook runs, registry transactions, XML), not a real guest's.
The same moves the way ``vmlend migrate --live`` takes by default for these devices (hot,
``vmlend.ops.hot_move``): per device the blackout from its quiesce at the switch-over (the
hand-over transaction inside it) to the guest running on the destination, and the VM's
downtime as the simulated node measures it.
Then the same VM moves *hot* (``vmlend.sim.hotmig``, the simulated hardware in this process):
its devices stay plugged and busy (each GPU copies a page, the NVMe drive has a command in
flight and one queued) during the pre-copy; printed side by side with the cold move's time of
the same device count: each device's blackout (quiesce request to the first command it accepts
on the destination), the VM's downtime (pause to resume: the measured switch-over work plus the
stop-and-copy of the last dirty pages at ``BANDWIDTH``), pre-copy rounds and the pages the
devices' DMA dirtied. The goal: blackout <= downtime + 50 ms and <= 0.1x the cold move.

Asserts nothing."""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from vmlend.domain import DeviceRequest, DomainSpec, TemplateSet, new_domain, read_domain
from vmlend.hook.actionlog import NullLog
from vmlend.hook.ops import HookOps
from vmlend.hypervisor import LiveMigration
from vmlend.ops.live_migrate import live_migrate
from vmlend.ops.migrate import migrate
from vmlend.registry import open_registry
from vmlend.sim.backend import SimFabric
from vmlend.sim.devqueue import DeviceQueue
from vmlend.sim.dmawin import RegistryWindowLedger
from vmlend.sim.hardware import SimHardware
from vmlend.sim.hotmig import DEFAULT_BANDWIDTH, HotMigration, hot_migrate
from vmlend.sim.hypervisor.node import SimHypervisor
from vmlend.sim.simvm import SimVm
from vmlend.topology.model import MiB
from vmlend.topology.parse import load_topology
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


def one_count(n: int, *, unplug: bool, cold: bool = True) -> tuple[float, float, float, float]:
    """(median downtime, median blackout, median live total, median cold total; 0 without
    ``cold``), seconds. ``unplug``: the unplugged way, else the one the CLI picks (hot for
    these devices)."""
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
                    unplug=unplug,
                )
                totals.append(time.perf_counter() - t0)
            downtimes.append(res.downtime or 0.0)
            blackouts += [b for b in res.blackout.values() if b is not None]
            here, there = there, here
        colds: list[float] = [0.0]
        for _ in range(ROUNDS * 2 if cold else 0):
            with open_fabric(state, here) as f:
                t0 = time.perf_counter()
                migrate(hv(state, here), hv(state, there), f, "vm1", there, start=True)
                colds.append(time.perf_counter() - t0)
            here, there = there, here
    med = statistics.median
    return med(downtimes), med(blackouts) if blackouts else 0.0, med(totals), med(colds)


BANDWIDTH = DEFAULT_BANDWIDTH  # the stop-and-copy's (10 Gbit/s)


def _spec(n: int) -> DomainSpec:
    return DomainSpec(
        name="vm1",
        memory_bytes=256 * MiB,
        virt_type="qemu",
        uuid=uuid.UUID(int=n + 1),
        devices=[DeviceRequest(f) for f in DEVICES[:n]],
    )


def hot_count(n: int) -> list[HotMigration]:
    """``ROUNDS * 2`` hot moves gamma <-> beta of a VM with ``n`` busy devices."""
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state.db"
        text, source = default_topology_text()
        init_fabric(state, text, source, node="gamma", hostname="bench-host")
        hw = SimHardware.from_topology(load_topology(), seed=1)
        registry = open_registry(state)
        fabrics = {nd: SimFabric(open_registry(state), nd, hardware=hw) for nd in ("gamma", "beta")}
        xml = new_domain(_spec(n), templates=TemplateSet()).to_bytes()
        HookOps(fabrics["gamma"], NullLog()).prepare(read_domain(xml))
        vm = SimVm(xml, hardware=hw, fabric=fabrics["gamma"], ledger=RegistryWindowLedger(registry))
        for f in vm.devices():
            vm.enable_device(f)
        vm.guest.write(0, b"x" * (4 * MiB))  # some memory in use
        queues = {f: DeviceQueue(hw, f) for f in vm.devices()}
        out: list[HotMigration] = []
        there = "beta"
        for _ in range(ROUNDS * 2):

            def busy(round_: int) -> None:
                if round_ != 1:
                    return
                for i, (fdid, q) in enumerate(sorted(queues.items())):
                    q.submit(0x0100_0000 + i * 0x10_0000, b"d" * 4096)
                    q.fetch()
                    if hw.device(fdid).spec.kind == "gpu":
                        q.complete()  # the GPU's copy lands during the pre-copy
                    else:
                        q.submit(0x0180_0000 + i * 0x10_0000, b"q" * 512)  # queued, not fetched
                vm.guest.write(0x10_0000, b"c" * (64 * 4096))

            out.append(
                hot_migrate(
                    vm, fabrics[there], registry, queues=queues, workload=busy, bandwidth=BANDWIDTH
                )
            )
            for q in queues.values():
                q.fetch()
                q.complete()
            there = "gamma" if there == "beta" else "beta"
        vm.stop()
        for fab in fabrics.values():
            fab.close()
        registry.close()
    return out


def main() -> None:
    print("unplugged (vmlend migrate --live --unplug):")
    print(
        f"{'devices':>7} {'downtime ms':>12} {'blackout ms':>12} {'live total ms':>14}"
        f" {'cold total ms':>14} {'cold/live downtime':>19}"
    )
    colds: dict[int, float] = {}
    for n in range(len(DEVICES) + 1):
        down, black, live, cold = one_count(n, unplug=True)
        colds[n] = cold
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
    print()
    print("hot through the CLI (vmlend migrate --live on sim:/// nodes: hooks, hand-over, no")
    print("simulated hardware in the process, the switch-over's memory copy two file writes):")
    print(
        f"{'devices':>7} {'downtime ms':>12} {'blackout ms':>12} {'live total ms':>14}"
        f" {'blackout/cold':>14}"
    )
    for n in range(1, len(DEVICES) + 1):
        down, black, live, _cold = one_count(n, unplug=False, cold=False)
        print(
            f"{n:>7} {down * 1000:>12.1f} {black * 1000:>12.1f} {live * 1000:>14.1f}"
            f" {black / colds[n]:>13.4f}x"
        )
    print(f"(median of {ROUNDS * 2} moves each; blackout: quiesce to the guest running there)")
    sys.stdout.flush()
    print()
    gbit = BANDWIDTH * 8 / 1e9
    print(f"hot: the devices stay plugged and busy; stop-and-copy at {gbit:g} Gbit/s")
    print(
        f"{'devices':>7} {'blackout ms':>12} {'downtime ms':>12} {'cold move ms':>13}"
        f" {'rounds':>7} {'dma pages':>10} {'blackout/cold':>14} {'goal':>5}"
    )
    for n in range(1, len(DEVICES) + 1):
        moves = hot_count(n)
        cold = colds[n]
        med = statistics.median
        black = med([b for m in moves for b in m.blackout.values()])
        down = med([m.downtime for m in moves])
        rounds = med([len(m.rounds) for m in moves])
        dma = med([m.dma_pages for m in moves])
        ok = black <= down + 0.050 and black <= 0.1 * cold
        print(
            f"{n:>7} {black * 1000:>12.2f} {down * 1000:>12.2f} {cold * 1000:>13.1f}"
            f" {rounds:>7g} {dma:>10g} {black / cold:>13.4f}x {'met' if ok else 'MISSED':>5}"
        )
    print(
        f"(median of {ROUNDS * 2} hot moves each; blackout: quiesce request to the first command"
        " accepted on the destination)"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
