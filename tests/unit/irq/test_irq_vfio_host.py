"""``VfioIrqHost``: the ``VFIO_DEVICE_SET_IRQS`` request it makes (``struct vfio_irq_set``),
and what it refuses before the kernel sees anything. The kernel's own answer to it is the
kernel tier's (tests/kernel/test_irq_relay_kernel.py)."""

from __future__ import annotations

import errno
import struct

import pytest

from vmlend.errors import RelayError
from vmlend.irq import vfio
from vmlend.irq.vectors import IrqIndex
from vmlend.irq.vfio import DISABLE, TRIGGER_EVENTFDS, VFIO_DEVICE_SET_IRQS, VfioIrqHost


@pytest.fixture
def calls(monkeypatch):
    made: list[tuple[int, int, bytes]] = []

    def ioctl(fd: int, request: int, arg: bytearray, mutate: bool = False) -> int:
        made.append((fd, request, bytes(arg)))
        return 0

    monkeypatch.setattr(vfio.fcntl, "ioctl", ioctl)
    return made


def test_eventfds_go_as_a_vfio_irq_set_with_their_descriptors(calls):
    VfioIrqHost(7).set_irqs(IrqIndex.MSI, TRIGGER_EVENTFDS, 2, [11, -1, 13])
    ((fd, request, arg),) = calls
    assert (fd, request) == (7, 0x3B6E) and VFIO_DEVICE_SET_IRQS == 0x3B6E
    # argsz, flags, index, start, count, then one s32 per vector (-1 de-assigns)
    assert arg == struct.pack("=5I3i", 32, TRIGGER_EVENTFDS, 1, 2, 3, 11, -1, 13)


def test_a_disable_carries_no_data(calls):
    VfioIrqHost(7).set_irqs(IrqIndex.INTX, DISABLE, 0, [])
    assert [arg for _fd, _r, arg in calls] == [struct.pack("=5I", 20, DISABLE, 0, 0, 0)]


def test_what_vfio_would_refuse_never_reaches_the_kernel(calls):
    with pytest.raises(RelayError, match=r"outside MSI's 0\.\.31"):
        VfioIrqHost(7).set_irqs(IrqIndex.MSI, TRIGGER_EVENTFDS, 31, [11, 12])
    assert calls == []


def test_the_kernels_refusal_names_the_request(monkeypatch):
    def refuse(fd: int, request: int, arg: bytearray, mutate: bool = False) -> int:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(vfio.fcntl, "ioctl", refuse)
    with pytest.raises(RelayError) as e:
        VfioIrqHost(7).set_irqs(IrqIndex.INTX, TRIGGER_EVENTFDS, 0, [9])
    assert str(e.value) == (
        "VFIO_DEVICE_SET_IRQS INTX flags 0x24 start 0 count 1: Invalid argument"
    )


def test_every_msix_vector_fits_one_request():
    """2,048 descriptors (MSI-X's most) make an 8,212-byte request: past fcntl's 1,024-byte
    limit for an immutable argument, which raised a bare ValueError at 252. Sent to a file
    that is no VFIO device, the kernel's ENOTTY comes back as the relay's error."""
    import os

    fd = os.open("/dev/null", os.O_RDONLY)
    try:
        with pytest.raises(RelayError, match="count 2048"):
            VfioIrqHost(fd).set_irqs(IrqIndex.MSIX, TRIGGER_EVENTFDS, 0, [-1] * 2048)
    finally:
        os.close(fd)
