"""Enabled vectors as decoded from real config-space and MSI-X table writes."""

from __future__ import annotations

from typing import Any

import pytest

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
from vmlend.irq.gate import VectorGate
from vmlend.irq.vectors import DISABLED, ConfigIrqWatcher, IrqIndex


def watch(dev: Any) -> tuple[ConfigIrqWatcher, list]:
    w = ConfigIrqWatcher(dev.config, dev.bars)
    seen: list = []
    w.subscribe(seen.append)
    return w, seen


def test_intx_follows_interrupt_disable_and_pin():
    dev = make_device()
    w, seen = watch(dev)
    assert w.current().index == IrqIndex.INTX and w.current().count == 1
    intx_disable(dev.config, True)
    assert w.current() == DISABLED
    intx_disable(dev.config, False)
    assert [s.index for s in seen] == [None, IrqIndex.INTX]

    nopin = make_device(pin=0)
    assert ConfigIrqWatcher(nopin.config, nopin.bars).current() == DISABLED


@pytest.mark.parametrize("wide", [False, True])
def test_msi_32_and_64_bit_forms(wide):
    dev = make_device(msi_vectors=8, msi64=wide)
    intx_disable(dev.config, True)
    w, _ = watch(dev)
    address = 0x1_2345_6000 if wide else 0xFEE0_1000
    msi_enable(dev.config, 4, address=address, data=0x40)
    s = w.current()
    assert (s.index, s.count, s.maskable) == (IrqIndex.MSI, 4, True)
    assert [m.address for m in s.messages] == [address] * 4
    assert [m.data for m in s.messages] == [0x40, 0x41, 0x42, 0x43]
    # The mask register sits at +12 (32-bit form) or +16 (64-bit form).
    msi_mask(dev.config, 0b1010)
    assert w.current().masked == {1, 3}
    msi_disable(dev.config)
    assert w.current() == DISABLED


def test_msi_single_vector_and_mask_bits_beyond_count_ignored():
    dev = make_device(msi_vectors=1, msi64=False)
    w, _ = watch(dev)
    msi_enable(dev.config, 1)
    msi_mask(dev.config, 0xFFFF_FFFE)
    assert (w.current().count, w.current().masked) == (1, frozenset())


def test_msix_table_masks_and_function_mask():
    dev = make_device(msix_entries=8)
    w, seen = watch(dev)
    for v in range(8):
        msix_program(dev.bars, v, masked=(v == 3))
    assert w.current().index == IrqIndex.INTX  # not enabled yet: INTx still is
    msix_flags(dev.config, enable=True)
    s = w.current()
    assert (s.index, s.count, s.masked) == (IrqIndex.MSIX, 8, {3})
    assert s.messages[5].data == 0x4005
    msix_mask(dev.bars, 3, False)
    msix_mask(dev.bars, 6, True)
    assert w.current().masked == {6}
    msix_flags(dev.config, enable=True, maskall=True)
    assert w.current().masked == set(range(8)) and w.current().function_masked
    msix_flags(dev.config, enable=True, maskall=False)
    assert w.current().masked == {6}
    msix_flags(dev.config, enable=False)
    assert w.current().index == IrqIndex.INTX
    assert seen[-1].index == IrqIndex.INTX


def test_msix_wins_over_msi():
    dev = make_device(msi_vectors=4, msix_entries=2)
    w, _ = watch(dev)
    msi_enable(dev.config, 2)
    msix_flags(dev.config, enable=True)
    assert (w.current().index, w.current().count) == (IrqIndex.MSIX, 2)


def test_unrelated_writes_do_not_notify_and_close_unsubscribes():
    dev = make_device(msix_entries=4)
    w, seen = watch(dev)
    dev.config.write(0x0C, 1, 0x10)  # cache line size
    dev.bars.write(2, 0x3000, 4, 1)  # outside the table
    assert seen == []
    w.close()
    msix_flags(dev.config, enable=True)
    msix_mask(dev.bars, 1, True)
    assert seen == []


def test_pending_bit_goes_to_the_pba():
    dev = make_device(msix_entries=4)
    w, _ = watch(dev)
    msix_flags(dev.config, enable=True)
    w.set_pending(2, True)
    assert dev.bars.msix_pending(2) and not dev.bars.msix_pending(1)
    w.set_pending(2, False)
    assert not dev.bars.msix_pending(2)


def test_gate_holds_masked_and_releases_on_unmask():
    g = VectorGate(4, frozenset({1}))
    assert g.admit(0, 3) == 3
    assert g.admit(1, 2) == 0 and g.admit(1, 5) == 0
    assert g.is_pending(1) and g.pending() == {1: 7}
    assert g.set_masked(frozenset({1, 2})) == {}
    assert g.set_masked(frozenset()) == {1: 7}
    assert not g.is_pending(1)
    g.set_masked(frozenset({0}))
    g.admit(0, 1)
    assert g.take_all() == {0: 1} and g.pending() == {}


def test_delivery_follows_decode_order_when_two_writers_interleave():
    # Forced interleaving: writer 1 masks vector 0; while its setup is being delivered, writer 2
    # (another thread) unmasks it. The subscriber must end with writer 2's setup (nothing
    # masked), as the guest left the table, never with writer 1's stale mask.
    import threading

    dev = make_device(msix_entries=4)
    for v in range(4):
        msix_program(dev.bars, v)
    msix_flags(dev.config, enable=True)
    w = ConfigIrqWatcher(dev.config, dev.bars)
    seen: list[frozenset[int]] = []
    second = threading.Thread(target=msix_mask, args=(dev.bars, 0, False))

    def subscriber(setup) -> None:
        if not seen and not second.is_alive() and setup.masked == {0}:
            # the first delivery is in progress: the second writer runs to its end now
            second.start()
            second.join(timeout=10)
            assert not second.is_alive(), "the second writer must not wait for the first"
        seen.append(setup.masked)

    w.subscribe(subscriber)
    msix_mask(dev.bars, 0, True)
    assert w.current().masked == frozenset()
    assert seen == [{0}, frozenset()]  # decode order, the guest's last word last
    w.close()
