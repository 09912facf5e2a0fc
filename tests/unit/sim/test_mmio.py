"""The borrower's view of a device's BARs (issue 40, point 1): a CPU's MMIO to a borrowed
device leaves by the borrower's adapter and enters by the lender's, over the route of the
device's crossing, so a dead cable drops a register write (and reads all ones) exactly as it
drops the device's DMA; a re-route moves the MMIO with the DMA."""

from __future__ import annotations

import pytest

from tests.support.simcluster import domain_xml
from vmlend.errors import DmaFault, FabricError
from vmlend.sim.hardware import SimHardware
from vmlend.sim.pci import regs
from vmlend.topology.model import GiB
from vmlend.topology.parse import load_topology

DEV = 0x12  # on alpha; gamma reaches it by gamma:0 (cheapest) or gamma:1
REG = 0x100  # plain BAR0 memory (the MSI-X table is at 0x2000)
PRIMARY = "mxs824/gamma:0"
LENDER = "mxs824/alpha:0"


@pytest.fixture
def hw():
    hw = SimHardware.from_topology(load_topology(), seed=3)
    hw.create_guest("gamma", "web", [])
    hw.borrow(DEV, "gamma", "web")
    dev = hw.device(DEV)
    dev.config.write(regs.COMMAND, 2, dev.config.read(regs.COMMAND, 2) | regs.COMMAND_MEMORY)
    return hw


def test_a_borrowers_write_crosses_its_adapter_and_the_lenders(hw):
    target = hw.mmio.resolve("gamma", DEV, 0, REG, 4)
    assert [h.stage for h in target.hops] == ["cpu", "borrower-adapter", "lender-adapter", "bar"]
    assert [h.node for h in target.hops] == ["gamma", "gamma", "alpha", "alpha"]
    assert target.adapter == "gamma:0" and target.hops[2].detail == "alpha:0"
    assert target.hops[-1].address == hw.device(DEV).bar_phys[0] + REG
    assert hw.mmio_write("gamma", DEV, 0, REG, 4, 0x1234_5678) == target
    assert hw.device(DEV).bars.read(0, REG, 4) == 0x1234_5678
    assert hw.mmio_read("gamma", DEV, 0, REG, 4) == 0x1234_5678
    assert hw.mmio.stats.delivered["gamma:0"] == 1


def test_a_dead_cable_drops_the_write_and_reads_all_ones(hw):
    hw.mmio_write("gamma", DEV, 0, REG, 4, 7)
    hw.link_down(PRIMARY)
    with pytest.raises(DmaFault) as fault:
        hw.mmio.resolve("gamma", DEV, 0, REG, 4)
    assert fault.value.hop == "link-down" and PRIMARY in fault.value.why
    assert hw.mmio_write("gamma", DEV, 0, REG, 4, 9) is None
    assert hw.device(DEV).bars.read(0, REG, 4) == 7  # never arrived
    assert hw.mmio_read("gamma", DEV, 0, REG, 4) == 0xFFFF_FFFF
    assert hw.mmio.stats.dropped["gamma:0"] == 1 and not hw.mmio.stats.aborted


def test_a_reroute_moves_the_mmio_with_the_dma(hw):
    hw.link_down(PRIMARY)
    hw.reroute(DEV)
    target = hw.mmio_write("gamma", DEV, 0, REG, 4, 5)
    assert target is not None and target.adapter == "gamma:1"
    assert hw.device(DEV).bars.read(0, REG, 4) == 5
    hw.link_down(LENDER)  # the lender's only cable: no route left
    assert hw.mmio_write("gamma", DEV, 0, REG, 4, 6) is None
    assert hw.device(DEV).bars.read(0, REG, 4) == 5
    hw.link_up(LENDER)
    assert hw.mmio_write("gamma", DEV, 0, REG, 4, 6) is not None


def test_the_lenders_own_cpu_crosses_nothing(hw):
    hw.link_down(LENDER)
    target = hw.mmio_write("alpha", DEV, 0, REG, 4, 3)
    assert target is not None and target.adapter is None
    assert [h.stage for h in target.hops] == ["cpu", "bar"]
    assert hw.mmio.stats.delivered[""] == 1


def test_memory_decoding_off_or_a_fence_is_a_master_abort(hw):
    dev = hw.device(DEV)
    dev.config.write(regs.COMMAND, 2, dev.config.read(regs.COMMAND, 2) & ~regs.COMMAND_MEMORY)
    with pytest.raises(DmaFault) as fault:
        hw.mmio.resolve("gamma", DEV, 0, REG, 4)
    assert fault.value.hop == "no-target" and "memory decoding" in fault.value.why
    assert hw.mmio_write("gamma", DEV, 0, REG, 4, 1) is None
    assert hw.mmio_read("gamma", DEV, 0, REG, 2) == 0xFFFF
    assert hw.mmio.stats.aborted["gamma:0"] == 1 and not hw.mmio.stats.dropped


@pytest.mark.parametrize(
    ("bar", "offset", "size", "why"),
    [
        (2, 0, 4, "has no BAR 2"),
        (0, 16384 - 2, 4, "leave BAR 0"),
        (0, -4, 4, "leave BAR 0"),
        (0, 0, 0, "leave BAR 0"),
    ],
)
def test_an_access_outside_the_bars_is_refused(hw, bar, offset, size, why):
    with pytest.raises(DmaFault) as fault:
        hw.mmio_write("gamma", DEV, bar, offset, size, 1)
    assert fault.value.hop == "bar" and why in fault.value.why
    with pytest.raises(DmaFault):
        hw.mmio_read("gamma", DEV, bar, offset, size)


def test_a_named_route_must_join_the_node_and_the_lender(hw):
    beta = hw.route("alpha", "beta")
    with pytest.raises(FabricError, match="does not join gamma and alpha"):
        hw.mmio_write("gamma", DEV, 0, REG, 4, 1, path=beta)
    assert hw.device(DEV).bars.read(0, REG, 4) == 0
    backup = next(p for p in hw.routes("alpha", "gamma") if p.dst.ref == "gamma:1")
    target = hw.mmio_write("gamma", DEV, 0, REG, 4, 1, path=backup)
    assert target is not None and target.adapter == "gamma:1"


def test_a_guests_register_write_is_lost_at_a_dead_cable(cluster):
    vm = cluster.start(domain_xml("web", 1 * GiB, fdids=(DEV,)))
    vm.enable_device(DEV)
    bar0 = next(b.address for b in vm.bars(DEV) if b.index == 0)
    vm.mmio_write(bar0 + REG, 4, 0xAB)
    assert cluster.hw.device(DEV).bars.read(0, REG, 4) == 0xAB
    cluster.hw.link_down(LENDER)  # no other route from alpha
    vm.mmio_write(bar0 + REG, 4, 0xCD)
    assert cluster.hw.device(DEV).bars.read(0, REG, 4) == 0xAB
    assert vm.mmio_read(bar0 + REG, 4) == 0xFFFF_FFFF
    cluster.hw.link_up(LENDER)
    vm.mmio_write(bar0 + REG, 4, 0xCD)
    assert vm.mmio_read(bar0 + REG, 4) == 0xCD


def test_a_node_that_does_not_hold_the_device_reaches_no_bar(hw):
    """beta neither borrows the device (gamma does) nor has a share crossing into it: its
    CPU's write is a master abort over live cables too, and reads all ones."""
    hw.mmio_write("gamma", DEV, 0, REG, 4, 7)
    with pytest.raises(DmaFault) as fault:
        hw.mmio.resolve("beta", DEV, 0, REG, 4)
    assert fault.value.hop == "no-target" and "beta does not hold device 0x12" in fault.value.why
    assert hw.mmio_write("beta", DEV, 0, REG, 4, 1) is None
    assert hw.mmio_read("beta", DEV, 0, REG, 4) == 0xFFFF_FFFF
    assert hw.device(DEV).bars.read(0, REG, 4) == 7  # never arrived
    assert hw.mmio.stats.aborted and not hw.mmio.stats.dropped
    # the borrow moves to beta: now beta's writes arrive, and gamma's do not
    hw.give_back(DEV, "gamma", "web")
    hw.create_guest("beta", "db", [])
    hw.borrow(DEV, "beta", "db")
    dev = hw.device(DEV)
    dev.config.write(regs.COMMAND, 2, dev.config.read(regs.COMMAND, 2) | regs.COMMAND_MEMORY)
    assert hw.mmio_write("beta", DEV, 0, REG, 4, 2) is not None
    assert hw.mmio_write("gamma", DEV, 0, REG, 4, 3) is None
    assert hw.device(DEV).bars.read(0, REG, 4) == 2


def test_with_no_live_route_the_holders_write_is_dropped(hw):
    hw.link_down(LENDER)  # the lender's only cable: no route carries gamma's access
    with pytest.raises(DmaFault) as fault:
        hw.mmio.resolve("gamma", DEV, 0, REG, 4)
    assert fault.value.hop == "link-down"
    assert hw.mmio_write("gamma", DEV, 0, REG, 4, 1) is None
    assert hw.mmio_read("gamma", DEV, 0, REG, 4) == 0xFFFF_FFFF
    assert hw.device(DEV).bars.read(0, REG, 4) == 0
