"""The relay end to end in one process: device -> lender eventfds -> transport -> VM eventfds.

Both sides run their own reactor thread and talk over a real SOCK_SEQPACKET socket pair.
"""

from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.support.fdcheck import fd_snapshot, leaked
from tests.support.irq_devices import (
    intx_disable,
    make_device,
    msi_disable,
    msi_enable,
    msi_mask,
    msix_flags,
    msix_mask,
    msix_program,
)
from vmlend.errors import RelayError
from vmlend.irq.borrower import BorrowerRelay
from vmlend.irq.eventfd import EventFd
from vmlend.irq.lender import LenderDevice, LenderRelay
from vmlend.irq.relay import Reactor
from vmlend.irq.vectors import ConfigIrqWatcher, IrqIndex
from vmlend.irq.vfio import DISABLE, TRIGGER_EVENTFDS, UNMASK_EVENTFD, SimIrqHost
from vmlend.sim.pci import regs

FDID = 0x42


def wait_until(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        time.sleep(0.001)


def read_within(efd: EventFd, timeout: float = 2.0) -> int:
    """What the VM reads when the eventfd fires (0 if it does not fire in time)."""
    r, _, _ = select.select([efd], [], [], timeout)
    return efd.drain() if r else 0


@dataclass
class Rig:
    dev: Any
    lender: LenderRelay
    borrower: BorrowerRelay
    host: SimIrqHost
    watcher: ConfigIrqWatcher
    ldev: LenderDevice
    reactors: tuple[Reactor, Reactor]
    vm: dict[tuple[int, int], EventFd]

    def vm_irqfds(self, index: int, count: int) -> list[EventFd]:
        """Register VM eventfds like a VMM (the relay gets its own copies)."""
        fds = [EventFd() for _ in range(count)]
        self.borrower.set_irqs(FDID, index, TRIGGER_EVENTFDS, 0, [os.dup(e.fileno()) for e in fds])
        for v, e in enumerate(fds):
            self.vm[(index, v)] = e
        return fds

    def close(self) -> None:
        self.lender.close()
        self.borrower.close()
        self.watcher.close()
        self.host.close()
        for r in self.reactors:
            r.close()
        for e in self.vm.values():
            e.close()


def make_rig(dev: Any) -> Rig:
    lr, br = Reactor(), Reactor()
    lr.start("lender")
    br.start("borrower")
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lender, borrower = LenderRelay(lr), BorrowerRelay(br)
    borrower.attach([FDID], b)
    channel = lender.open_channel(a)
    host = SimIrqHost(dev)
    watcher = ConfigIrqWatcher.for_device(dev)
    ldev = lender.add_device(FDID, watcher, host, channel)
    return Rig(dev, lender, borrower, host, watcher, ldev, (lr, br), {})


@pytest.fixture
def msix_rig() -> Iterator[Rig]:
    dev = make_device(msix_entries=8)
    for v in range(8):
        msix_program(dev.bars, v)
    rig = make_rig(dev)
    rig.vm_irqfds(IrqIndex.MSIX, 8)
    msix_flags(dev.config, enable=True)
    yield rig
    rig.close()


def test_burst_of_100k_across_8_vectors_arrives_exactly(msix_rig):
    rig = msix_rig
    raised = [0] * 8
    for i in range(100_000):
        v = (i * 7 + i // 13) % 8  # uneven spread
        rig.dev.raise_interrupt(v)
        raised[v] += 1
    got = [0] * 8

    def drained() -> bool:
        for v in range(8):
            got[v] += rig.vm[(IrqIndex.MSIX, v)].drain()
        return sum(got) >= 100_000

    wait_until(drained, timeout=20)
    time.sleep(0.05)
    drained()
    assert got == raised
    assert rig.host.dropped == 0


def test_masked_vector_is_pending_and_delivered_on_unmask(msix_rig):
    rig = msix_rig
    vm2 = rig.vm[(IrqIndex.MSIX, 2)]
    msix_mask(rig.dev.bars, 2, True)
    for _ in range(3):
        rig.dev.raise_interrupt(2)
    rig.dev.raise_interrupt(5)
    assert read_within(rig.vm[(IrqIndex.MSIX, 5)]) == 1
    wait_until(lambda: rig.dev.bars.msix_pending(2))
    assert read_within(vm2, 0.05) == 0
    msix_mask(rig.dev.bars, 2, False)
    assert read_within(vm2) == 3
    assert not rig.dev.bars.msix_pending(2)


def test_function_mask_holds_every_vector(msix_rig):
    rig = msix_rig
    msix_flags(rig.dev.config, enable=True, maskall=True)
    for v in range(8):
        rig.dev.raise_interrupt(v)
    wait_until(lambda: all(rig.dev.bars.msix_pending(v) for v in range(8)))
    assert all(read_within(rig.vm[(IrqIndex.MSIX, v)], 0) == 0 for v in range(8))
    msix_flags(rig.dev.config, enable=True, maskall=False)
    assert [read_within(rig.vm[(IrqIndex.MSIX, v)]) for v in range(8)] == [1] * 8


def test_msi_multi_vector_setup_and_teardown():
    dev = make_device(msi_vectors=4, msi64=True)
    intx_disable(dev.config, True)
    rig = make_rig(dev)
    try:
        assert rig.ldev.setup.index is None and rig.ldev.trigger_fds() == {}
        vm = rig.vm_irqfds(IrqIndex.MSI, 4)
        msi_enable(dev.config, 4, address=0x1_0000_1000)
        assert sorted(rig.ldev.trigger_fds()) == [0, 1, 2, 3]
        msi_mask(dev.config, 0b0100)
        dev.raise_interrupt(2)
        dev.raise_interrupt(3)
        assert read_within(vm[3]) == 1
        assert read_within(vm[2], 0.05) == 0
        msi_mask(dev.config, 0)
        assert read_within(vm[2]) == 1
        msi_disable(dev.config)
        assert rig.ldev.trigger_fds() == {}
        dev.raise_interrupt(1)  # nobody enabled it: the (simulated) kernel drops it
        assert rig.host.dropped == 1 and read_within(vm[1], 0.05) == 0
    finally:
        rig.close()


def test_interrupts_raised_before_disable_are_still_delivered(msix_rig):
    rig = msix_rig
    msix_mask(rig.dev.bars, 1, True)
    rig.dev.raise_interrupt(1)
    rig.dev.raise_interrupt(1)
    msix_flags(rig.dev.config, enable=False)
    assert read_within(rig.vm[(IrqIndex.MSIX, 1)]) == 2


def test_intx_is_level_triggered_until_resample():
    dev = make_device()
    rig = make_rig(dev)
    try:
        (trigger,) = rig.vm_irqfds(IrqIndex.INTX, 1)
        resample = EventFd()
        rig.borrower.set_irqs(FDID, IrqIndex.INTX, UNMASK_EVENTFD, 0, [os.dup(resample.fileno())])
        dev.raise_interrupt(0)
        dev.raise_interrupt(0)
        assert read_within(trigger) == 1
        assert read_within(trigger, 0.05) == 0  # still asserted, not re-signalled
        resample.signal()  # the guest handled it (KVM's resampler fires)
        assert read_within(trigger) == 1  # re-armed and still asserted: signalled again
        resample.signal()
        assert read_within(trigger, 0.05) == 0  # nothing asserted since
        dev.raise_interrupt(0)
        assert read_within(trigger) == 1
        intx_disable(dev.config, True)
        assert rig.ldev.trigger_fds() == {}
        resample.close()
    finally:
        rig.close()


def test_interrupts_wait_for_the_vmm_to_assign_an_irqfd():
    dev = make_device(msix_entries=2)
    rig = make_rig(dev)
    try:
        for v in range(2):
            msix_program(dev.bars, v)
        msix_flags(dev.config, enable=True)
        dev.raise_interrupt(1)
        wait_until(lambda: rig.borrower.status()[0]["held"] == 1)
        _, vm1 = rig.vm_irqfds(IrqIndex.MSIX, 2)
        assert read_within(vm1) == 1
        rig.borrower.set_irqs(FDID, IrqIndex.MSIX, TRIGGER_EVENTFDS, 1, [-1])  # de-assign
        assert [v["vector"] for v in rig.borrower.status()[0]["vectors"]] == [0]
        rig.borrower.set_irqs(FDID, IrqIndex.MSIX, DISABLE, 0, [])
        assert rig.borrower.status()[0]["vectors"] == []
    finally:
        rig.close()


def test_teardown_leaves_no_open_descriptors():
    before = fd_snapshot()
    dev = make_device(msix_entries=8)
    rig = make_rig(dev)
    rig.vm_irqfds(IrqIndex.MSIX, 8)
    resample = EventFd()
    rig.borrower.set_irqs(FDID, IrqIndex.INTX, UNMASK_EVENTFD, 0, [os.dup(resample.fileno())])
    msix_program(dev.bars, 3)
    msix_flags(dev.config, enable=True)
    dev.raise_interrupt(3)
    assert read_within(rig.vm[(IrqIndex.MSIX, 3)]) == 1
    msix_flags(dev.config, enable=False)  # back to INTx: new lender fds
    intx_disable(dev.config, True)
    msix_flags(dev.config, enable=True)
    assert leaked(before)  # the set-up really opened descriptors
    resample.close()
    rig.close()
    assert not leaked(before)


def test_borrower_that_disappears_does_not_block_the_lender(msix_rig):
    rig = msix_rig
    # The borrower stops reading: the lender keeps going and coalesces what it cannot send.
    rig.reactors[1].stop()
    for _ in range(50_000):
        rig.dev.raise_interrupt(0)
    # Its loop reads every interrupt although the socket is full (a send waiting for the
    # borrower would stall it there); what it cannot send waits, coalesced, nothing dropped.
    channel = next(iter(rig.lender._channels))
    wait_until(lambda: rig.ldev.raised == 50_000, timeout=30)
    assert channel.dropped == 0
    # Now it goes away altogether: the lender sees the hang-up and only counts drops.
    rig.borrower.close()
    wait_until(lambda: not rig.lender._channels or not next(iter(rig.lender._channels)).alive)
    for _ in range(1000):
        rig.dev.raise_interrupt(1)
    channel = next(iter(rig.lender._channels))
    wait_until(lambda: channel.dropped >= 1000)
    # The lender still follows the guest.
    msix_flags(rig.dev.config, enable=False)
    assert rig.ldev.setup.index == IrqIndex.INTX


def test_bad_set_irqs_requests_are_refused_and_close_what_they_were_given(msix_rig):
    rig = msix_rig
    before = fd_snapshot()
    e = EventFd()
    with pytest.raises(RelayError, match="unmask eventfd exists only for INTx"):
        rig.borrower.set_irqs(FDID, IrqIndex.MSIX, UNMASK_EVENTFD, 0, [os.dup(e.fileno())])
    with pytest.raises(RelayError, match="not attached"):
        rig.borrower.set_irqs(0x99, IrqIndex.MSI, TRIGGER_EVENTFDS, 0, [os.dup(e.fileno())])
    with pytest.raises(RelayError, match="index 7"):
        rig.borrower.set_irqs(FDID, 7, TRIGGER_EVENTFDS, 0, [os.dup(e.fileno())])
    with pytest.raises(RelayError, match=r"vectors 2047\.\.2048 are outside MSIX's 0\.\.2047"):
        rig.borrower.set_irqs(FDID, IrqIndex.MSIX, TRIGGER_EVENTFDS, 2047, [-1, -1])
    r, w = os.pipe()
    with pytest.raises(RelayError, match="is not an eventfd"):
        rig.borrower.set_irqs(FDID, IrqIndex.MSIX, TRIGGER_EVENTFDS, 0, [os.dup(e.fileno()), r])
    os.close(w)
    with pytest.raises(RelayError, match="exactly one DATA"):
        rig.borrower.set_irqs(FDID, IrqIndex.MSI, 0, 0, [])
    e.close()
    assert not leaked(before)
    with pytest.raises(RelayError, match="already attached"):
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        a.close()
        rig.borrower.attach([FDID], b)


def test_function_level_reset_tears_vectors_down(msix_rig):
    rig = msix_rig
    assert rig.ldev.setup.index == IrqIndex.MSIX
    rig.dev.reset()  # no guest config write: the watcher learns it from the reset
    assert rig.ldev.setup.index == IrqIndex.INTX
    assert sorted(rig.ldev.trigger_fds()) == [0]


def test_stalled_borrower_catches_up_with_exact_counts(msix_rig):
    rig = msix_rig
    rig.reactors[1].stop()  # stops reading: the socket fills, the lender coalesces
    for i in range(60_000):
        rig.dev.raise_interrupt(i % 8)
    channel = next(iter(rig.lender._channels))
    reactor = Reactor()  # a new borrower loop takes over the same relay state
    borrower_fd = next(iter(rig.borrower._channels))._fd
    handler = rig.reactors[1]._handlers[borrower_fd]
    reactor.register(borrower_fd, select.EPOLLIN, handler)
    reactor.start("borrower-2")
    got = [0] * 8

    def drained() -> bool:
        for v in range(8):
            got[v] += rig.vm[(IrqIndex.MSIX, v)].drain()
        return sum(got) >= 60_000

    try:
        wait_until(drained, timeout=20)
        assert got == [7500] * 8 and channel.dropped == 0
    finally:
        reactor.unregister(borrower_fd)
        reactor.close()


def test_no_message_interrupt_while_bus_master_is_off(msix_rig):
    # MSI-X is a memory write by the device: with Bus Master off it cannot be sent
    dev = msix_rig.dev
    vm0 = msix_rig.vm[(IrqIndex.MSIX, 0)]
    command = dev.config.read(regs.COMMAND, 2)
    dev.config.write(regs.COMMAND, 2, command & ~regs.COMMAND_MASTER)
    assert dev.raise_interrupt(0) == 0
    assert dev.blocked_messages == 1
    assert read_within(vm0, 0.2) == 0
    dev.config.write(regs.COMMAND, 2, command)
    assert dev.raise_interrupt(0) == 1
    assert read_within(vm0) == 1


def test_intx_does_not_need_bus_master():
    dev = make_device(pin=1)
    rig = make_rig(dev)
    try:
        (vm0,) = rig.vm_irqfds(IrqIndex.INTX, 1)
        command = dev.config.read(regs.COMMAND, 2)
        dev.config.write(regs.COMMAND, 2, command & ~regs.COMMAND_MASTER)
        assert dev.raise_interrupt(0) == 1  # a wire, not a memory write
        assert read_within(vm0) == 1 and dev.blocked_messages == 0
    finally:
        rig.close()
