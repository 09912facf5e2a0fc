"""VFIO_DEVICE_SET_IRQS vocabulary (uapi vfio.h) and the lender's view of the host kernel.

``IrqHost`` is what the lender side calls where a real lender calls the ioctl on the physical
device's VFIO fd; ``VfioIrqHost`` is that ioctl on a real VFIO device file (the kernel tier runs
it on an mdev), ``SimIrqHost`` plays the kernel's vfio-pci for a simulated device.
"""

from __future__ import annotations

import fcntl
import logging
import os
import select
import struct
from collections.abc import Callable, Sequence
from typing import Protocol

from vmlend.errors import RelayError
from vmlend.irq.relay import Reactor
from vmlend.irq.vectors import IrqIndex

log = logging.getLogger(__name__)

DATA_NONE = 1
DATA_BOOL = 2
DATA_EVENTFD = 4
ACTION_MASK = 8
ACTION_UNMASK = 16
ACTION_TRIGGER = 32
DATA_MASK = DATA_NONE | DATA_BOOL | DATA_EVENTFD
ACTION_MASK_BITS = ACTION_MASK | ACTION_UNMASK | ACTION_TRIGGER

TRIGGER_EVENTFDS = DATA_EVENTFD | ACTION_TRIGGER
UNMASK_EVENTFD = DATA_EVENTFD | ACTION_UNMASK
DISABLE = DATA_NONE | ACTION_TRIGGER  # with count 0: tear the whole index down


# Vectors per index: INTx has one line, MSI up to 32 messages, MSI-X up to 2048 entries.
MAX_VECTORS = {IrqIndex.INTX: 1, IrqIndex.MSI: 32, IrqIndex.MSIX: 2048}


def check_flags(index: int, flags: int, count: int, nfds: int, start: int = 0) -> None:
    """Refuse what VFIO would refuse, with a message naming the request."""
    if index not in tuple(IrqIndex):
        raise RelayError(f"SET_IRQS: unsupported irq index {index} (INTX=0, MSI=1, MSIX=2)")
    limit = MAX_VECTORS[IrqIndex(index)]
    if start < 0 or count < 0 or start + count > limit:
        raise RelayError(
            f"SET_IRQS: vectors {start}..{start + count - 1} are outside"
            f" {IrqIndex(index).name}'s 0..{limit - 1}"
        )
    data, action = flags & DATA_MASK, flags & ACTION_MASK_BITS
    if bin(data).count("1") != 1 or bin(action).count("1") != 1:
        raise RelayError(f"SET_IRQS: flags {flags:#x} need exactly one DATA_* and one ACTION_*")
    if action == ACTION_UNMASK and data == DATA_EVENTFD and (index != IrqIndex.INTX or count != 1):
        raise RelayError("SET_IRQS: an unmask eventfd exists only for INTx, start 0, count 1")
    if data == DATA_EVENTFD and nfds != count:
        raise RelayError(f"SET_IRQS: count {count} but {nfds} eventfds")
    if (data, action) not in (
        (DATA_EVENTFD, ACTION_TRIGGER),
        (DATA_EVENTFD, ACTION_UNMASK),
        (DATA_NONE, ACTION_TRIGGER),
        (DATA_NONE, ACTION_UNMASK),
    ):
        raise RelayError(f"SET_IRQS: flags {flags:#x} are not supported by the relay")
    if data == DATA_NONE and action == ACTION_TRIGGER and count != 0:
        raise RelayError("SET_IRQS: DATA_NONE|ACTION_TRIGGER is only supported with count 0")


class IrqHost(Protocol):
    """The physical device's interrupts on the lender (``VFIO_DEVICE_SET_IRQS``)."""

    def set_irqs(self, index: int, flags: int, start: int, fds: Sequence[int]) -> None: ...


#: ``_IO(VFIO_TYPE, VFIO_BASE + 10)``: VFIO_TYPE is ';', VFIO_BASE 100 (uapi vfio.h).
VFIO_DEVICE_SET_IRQS = (ord(";") << 8) | 110
#: ``struct vfio_irq_set`` without its data: argsz, flags, index, start, count.
_IRQ_SET = struct.Struct("=5I")


class VfioIrqHost:
    """``VFIO_DEVICE_SET_IRQS`` on an open VFIO device file (``device_fd``, not owned): what a
    lender's relay asks of the physical device's interrupts. The kernel takes its own reference
    to each eventfd, so the caller may close its descriptors once the call returned."""

    def __init__(self, device_fd: int) -> None:
        self._fd = device_fd

    def set_irqs(self, index: int, flags: int, start: int, fds: Sequence[int]) -> None:
        check_flags(index, flags, len(fds), len(fds), start)
        data = struct.pack(f"={len(fds)}i", *fds) if flags & DATA_EVENTFD else b""
        request = _IRQ_SET.pack(_IRQ_SET.size + len(data), flags, index, start, len(fds))
        # a mutable buffer: fcntl copies an immutable one through a 1,024-byte stack buffer,
        # too small past 251 vectors (MSI-X has up to 2,048)
        buf = bytearray(request + data)
        try:
            fcntl.ioctl(self._fd, VFIO_DEVICE_SET_IRQS, buf, True)
        except OSError as e:
            raise RelayError(
                f"VFIO_DEVICE_SET_IRQS {IrqIndex(index).name} flags {flags:#x} start {start}"
                f" count {len(fds)}: {e.strerror or e}"
            ) from None


class InterruptSource(Protocol):
    def on_interrupt(self, fn: Callable[[int], None]) -> Callable[[], None]: ...


class SimIrqHost:
    """The kernel's vfio-pci interrupt handling for a simulated device.

    Like the kernel it keeps its own reference to each eventfd (a dup), so a user closing its
    descriptor never leaves a dangling number here. INTx is level-triggered: it is signalled and
    masked; raises while masked are remembered and signalled once the unmask eventfd fires.
    The kernel's virqfd that waits on the unmask eventfd is a thread here, started with the
    first unmask eventfd and stopped by ``close``.
    """

    def __init__(self, device: InterruptSource) -> None:
        # One lock for the host and its virqfd thread, so the two can never deadlock.
        self._watcher = Reactor()
        self._started = False
        self._lock = self._watcher.lock
        self._triggers: dict[int, dict[int, int]] = {i: {} for i in IrqIndex}
        self._unmask_fd: int | None = None
        self._intx_masked = False
        self._intx_pending = False
        self.dropped = 0
        self._remove = device.on_interrupt(self._on_interrupt)

    def _active(self) -> int | None:
        for index, triggers in self._triggers.items():
            if triggers:
                return index
        return None

    def set_irqs(self, index: int, flags: int, start: int, fds: Sequence[int]) -> None:
        check_flags(index, flags, len(fds), len(fds), start)
        with self._lock:
            if flags == DISABLE:
                self._clear(index)
            elif flags == TRIGGER_EVENTFDS:
                active = self._active()
                if active is not None and active != index:
                    raise RelayError(f"SET_IRQS: index {active} is active; disable it first")
                for i, fd in enumerate(fds):
                    old = self._triggers[index].pop(start + i, None)
                    if old is not None:
                        os.close(old)
                    if fd >= 0:
                        self._triggers[index][start + i] = os.dup(fd)
            elif flags == UNMASK_EVENTFD:
                self._drop_unmask_fd()
                if fds[0] >= 0:
                    self._unmask_fd = fd = os.dup(fds[0])
                    if not self._started:
                        self._started = True
                        self._watcher.start("sim-vfio-unmask")
                    self._watcher.register(fd, select.EPOLLIN, lambda _ev: self._service(fd))
            elif flags == DATA_NONE | ACTION_UNMASK:
                self._unmask_locked()

    def _clear(self, index: int) -> None:
        for fd in self._triggers[index].values():
            os.close(fd)
        self._triggers[index].clear()
        if index == IrqIndex.INTX:
            self._drop_unmask_fd()
            self._intx_masked = self._intx_pending = False

    def _drop_unmask_fd(self) -> None:
        if self._unmask_fd is not None:
            self._watcher.unregister(self._unmask_fd)
            os.close(self._unmask_fd)
            self._unmask_fd = None

    def _on_interrupt(self, vector: int) -> None:
        with self._lock:
            index = self._active()
            fd = None if index is None else self._triggers[index].get(vector)
            if fd is None:
                # The kernel drops an interrupt nobody asked for; count it for diagnosis.
                self.dropped += 1
                return
            if index == IrqIndex.INTX:
                if self._intx_masked:
                    self._intx_pending = True
                    return
                self._intx_masked = True
            os.eventfd_write(fd, 1)

    def _unmask_locked(self) -> None:
        self._intx_masked = False
        if self._intx_pending:
            self._intx_pending = False
            fd = self._triggers[IrqIndex.INTX].get(0)
            if fd is not None:
                self._intx_masked = True
                os.eventfd_write(fd, 1)

    def _service(self, fd: int) -> None:
        with self._lock:
            if fd != self._unmask_fd:
                return
            try:
                os.eventfd_read(fd)
            except BlockingIOError:
                return
            self._unmask_locked()

    def close(self) -> None:
        self._remove()
        with self._lock:
            for index in IrqIndex:
                self._clear(index)
        self._watcher.close()
