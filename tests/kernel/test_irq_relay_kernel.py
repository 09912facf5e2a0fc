"""Interrupts for real: a device's interrupts, raised by the kernel, reach a VMM's eventfds
through ``vmlend relay`` (docs/interrupts.md).

The interrupting device is the stand-in's mdev child, mtty's emulated serial card: it offers INTx
and MSI with one vector each and raises an interrupt when its UART's interrupt enable register
is written with THRI while its transmit FIFO is empty (mtty.c, ``handle_bar_write``). The
stand-in module needs no trigger of its own for it.

The relay's two sides run as on two hosts, in one guest:

- the **lender** side (``LenderRelay``, in the test's process) opens the mdev through VFIO, as
  a lender's relay opens the physical device, and registers its eventfds with the kernel
  through ``VfioIrqHost``: a real ``VFIO_DEVICE_SET_IRQS`` (DATA_EVENTFD|ACTION_TRIGGER);
- the **borrower** side is a ``vmlend relay`` daemon of the test's own, given the transport's
  other end (a unix SOCK_SEQPACKET pair: the NTB's shared memory and doorbell in a cluster);
- the **VMM** registers its eventfds with the daemon, with the same SET_IRQS request, and
  counts what arrives there.

No VM runs: the VMM's eventfds are the test's. Every interrupt the kernel signals is counted
once, at the VMM's eventfd; for INTx, the VMM's resample eventfd (KVM's irqfd resampler, fired
when the guest handled the level interrupt) travels back to the lender as an unmask."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.kernel_guest import LEND, REAL, STUB
from tests.support.libvirt_daemon import wait_for
from tests.support.vfio_user import VfioDevice
from vmlend.errors import RelayError
from vmlend.irq.client import RelayClient
from vmlend.irq.eventfd import EventFd
from vmlend.irq.lender import LenderRelay
from vmlend.irq.relay import Reactor
from vmlend.irq.vectors import FixedIrqSetup, IrqIndex, IrqSetup
from vmlend.irq.vfio import TRIGGER_EVENTFDS, VfioIrqHost
from vmlend.kernel.mdev import MdevBus

FDID = 0x12
U1 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa7001"
#: mtty's port 0 is BAR 0 (an I/O BAR of 8 bytes): its UART's interrupt enable register, and
#: the bit that interrupts while nothing waits to be sent.
BAR0, UART_IER, UART_IER_THRI = 0, 1, 0x02
#: Interrupts raised per test.
RAISED = 200


def relay_client(path: Path, daemon: subprocess.Popen[bytes], log: Path) -> RelayClient:
    """A client of the daemon once it answers (it binds its socket under a private name and
    renames it: a socket at ``path`` accepts)."""

    def listening() -> bool:
        assert daemon.poll() is None, log.read_text()
        return path.is_socket()

    wait_for(listening, 300, f"the relay's socket {path}", 0.1)
    return RelayClient(path, timeout=60)


@pytest.mark.daemon
@pytest.mark.parametrize("index", [IrqIndex.MSI, IrqIndex.INTX], ids=["msi", "intx"])
def test_the_relay_delivers_the_interrupts_a_vfio_device_raises_to_the_vmms_eventfds(
    index, tmp_path, fabric_devices, capsys
):
    STUB.command("borrow", f"{FDID:#x}")
    MdevBus(REAL).create(f"smartio-{FDID:x}", LEND, U1)
    path = tmp_path / "relay.sock"
    log = tmp_path / "relay.log"
    env = {k: v for k, v in os.environ.items() if k != "VMLEND_RELAY_SOCKET"}
    with log.open("wb") as out:
        daemon = subprocess.Popen(
            [str(Path(sys.executable).parent / "vmlend"), "relay", "--socket", str(path)],
            env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    reactor = Reactor()
    lender = LenderRelay(reactor)
    vmm = EventFd()
    resample = EventFd()
    try:
        client = relay_client(path, daemon, log)
        # The transport: one end to the borrower's daemon, the other to the lender's relay.
        lender_end, borrower_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        client.attach([FDID], borrower_end)
        borrower_end.close()
        channel = lender.open_channel(lender_end)
        # The VMM's eventfds, registered with the borrower's relay as with VFIO.
        client.set_triggers(FDID, index, [vmm.fileno()])
        if index == IrqIndex.INTX:
            client.set_resample(FDID, resample.fileno())
        reactor.start("lender-relay")

        with VfioDevice(U1) as dev:
            assert dev.irq_count(index) == 1  # mtty: one INTx line, one MSI message
            # The lender's eventfds, registered with the kernel: VFIO_DEVICE_SET_IRQS.
            ldev = lender.add_device(
                FDID, FixedIrqSetup(IrqSetup(index=index, count=1)), VfioIrqHost(dev.fd), channel
            )
            t0 = time.monotonic()
            for _ in range(RAISED):
                dev.write(BAR0, UART_IER, bytes([UART_IER_THRI]))
            raised = time.monotonic() - t0
            counted = 0

            def all_counted() -> bool:
                nonlocal counted
                counted += vmm.drain()
                return counted >= RAISED

            t0 = time.monotonic()
            wait_for(all_counted, 300, f"{RAISED} interrupts at the VMM's eventfd", 0.05)
            arrived = time.monotonic() - t0
            # Each one the kernel signalled was relayed once: none lost, none made up.
            assert counted == RAISED
            with reactor.lock:
                assert ldev.raised == RAISED and ldev.pending() == {}
            (status,) = client.status()["devices"]
            assert (status["fdid"], status["delivered"], status["held"]) == (FDID, RAISED, 0)
            assert [(v["index"], v["vector"]) for v in status["vectors"]] == [(index.name, 0)]
            if index == IrqIndex.INTX:
                # The guest handled the level interrupt: KVM fires the resampler, the relay
                # sends the unmask to the lender, which re-arms the line at VFIO (ACTION_UNMASK).
                resample.signal()
                wait_for(
                    lambda: client.status()["devices"][0]["unmasks"] == 1,
                    300, "the resample's unmask", 0.05,
                )  # fmt: skip
            # The lender lets the device go (DATA_NONE|ACTION_TRIGGER, count 0) before VFIO.
            lender.remove_device(FDID)
        assert vmm.drain() == 0  # nothing after the count
        client.release(FDID)
        assert client.status()["devices"] == []
        client.close()
    finally:
        with contextlib.suppress(RelayError):  # a failed test may leave the device closed
            lender.close()
        reactor.close()
        vmm.close()
        resample.close()
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
        code = daemon.wait(60)
    assert code == 0, log.read_text()
    assert not path.exists()  # the daemon removed its socket
    assert MdevBus(REAL).remove(U1)  # VFIO let it go
    with capsys.disabled():
        print(f"\n  {index.name}: {RAISED} register writes {raised:.2f} s, all counted at the"
              f" VMM's eventfd {arrived:.2f} s later")  # fmt: skip


def test_a_set_irqs_the_kernel_refuses_is_a_relay_error(tmp_path, fabric_devices):
    """A descriptor that is no eventfd, past the relay's own checks: the kernel's refusal
    (mtty: ``eventfd_ctx_fdget``'s EINVAL) comes back as ``RelayError``, naming the request."""
    STUB.command("borrow", f"{FDID:#x}")
    MdevBus(REAL).create(f"smartio-{FDID:x}", LEND, U1)
    r, w = os.pipe()
    try:
        refused = r"VFIO_DEVICE_SET_IRQS INTX flags 0x24 .*Invalid"
        with VfioDevice(U1) as dev, pytest.raises(RelayError, match=refused):
            VfioIrqHost(dev.fd).set_irqs(IrqIndex.INTX, TRIGGER_EVENTFDS, 0, [r])
    finally:
        os.close(r)
        os.close(w)
    assert MdevBus(REAL).remove(U1)
