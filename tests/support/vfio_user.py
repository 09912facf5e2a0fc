"""A VFIO user in Python, as a VMM opens a device (uapi linux/vfio.h, the group and container
interface: the kernel tier's 6.1 has no VFIO device cdev): a container with the type1 IOMMU, the
mdev's IOMMU group set on it, the device's file from the group. Enough to ask for region and
interrupt information and to write the device's registers; interrupts are registered with
``vmlend.irq.vfio.VfioIrqHost`` on ``VfioDevice.fd``."""

from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path
from types import TracebackType

from tests.support.kernel_guest import REAL
from vmlend.kernel.mdev import MdevBus


def _io(nr: int) -> int:
    """``_IO(VFIO_TYPE, VFIO_BASE + nr)``."""
    return (ord(";") << 8) | (100 + nr)


GET_API_VERSION = _io(0)
CHECK_EXTENSION = _io(1)
SET_IOMMU = _io(2)
GROUP_GET_STATUS = _io(3)
GROUP_SET_CONTAINER = _io(4)
GROUP_GET_DEVICE_FD = _io(6)
DEVICE_GET_INFO = _io(7)
DEVICE_GET_REGION_INFO = _io(8)
DEVICE_GET_IRQ_INFO = _io(9)
API_VERSION = 0
TYPE1V2_IOMMU = 3
GROUP_FLAGS_VIABLE = 1
IRQ_INFO_EVENTFD = 1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ioctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)
_libc.ioctl.restype = ctypes.c_int


def ioctl(fd: int, request: int, arg: ctypes.Array[ctypes.c_char] | int | None = None) -> int:
    """ioctl(2) with its return value (Python's ``fcntl.ioctl`` drops it for a buffer)."""
    pointer = ctypes.addressof(arg) if isinstance(arg, ctypes.Array) else arg
    ret = _libc.ioctl(fd, request, pointer)
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"ioctl {request:#x}: {os.strerror(err)}")
    return ret


def _call(fd: int, request: int, layout: struct.Struct, *fields: int) -> tuple[int, ...]:
    """An ioctl on a struct that starts with its own ``argsz``: the struct as filled in."""
    buf = ctypes.create_string_buffer(layout.pack(layout.size, *fields), layout.size)
    ioctl(fd, request, buf)
    return layout.unpack(buf.raw)


GROUP_STATUS = struct.Struct("=II")  # argsz, flags
REGION_INFO = struct.Struct("=IIIIQQ")  # argsz, flags, index, cap_offset, size, offset
IRQ_INFO = struct.Struct("=IIII")  # argsz, flags, index, count
DEVICE_INFO = struct.Struct("=IIII")  # argsz, flags, num_regions, num_irqs


class VfioDevice:
    """mdev ``uuid`` opened through VFIO (its group on a container of its own)."""

    def __init__(self, uuid: str) -> None:
        dev = MdevBus(REAL).device(uuid)
        assert dev is not None, f"no mdev {uuid}"
        self.container = self.group = self.fd = -1
        try:
            self.container = os.open("/dev/vfio/vfio", os.O_RDWR | os.O_CLOEXEC)
            assert ioctl(self.container, GET_API_VERSION) == API_VERSION
            assert ioctl(self.container, CHECK_EXTENSION, TYPE1V2_IOMMU) == 1
            self.group = os.open(Path("/dev/vfio") / str(dev.iommu_group), os.O_RDWR | os.O_CLOEXEC)
            _argsz, flags = _call(self.group, GROUP_GET_STATUS, GROUP_STATUS, 0)
            assert flags & GROUP_FLAGS_VIABLE, f"group {dev.iommu_group} is not viable"
            fd = ctypes.create_string_buffer(struct.pack("=i", self.container), 4)
            ioctl(self.group, GROUP_SET_CONTAINER, fd)
            ioctl(self.container, SET_IOMMU, TYPE1V2_IOMMU)
            name = ctypes.create_string_buffer(uuid.encode())
            self.fd = ioctl(self.group, GROUP_GET_DEVICE_FD, name)
            # First, as a VMM does: mtty answers the region, interrupt and SET_IRQS requests
            # from what it said here (before it, every interrupt index is EINVAL).
            _argsz, _flags, self.regions, self.irqs = _call(
                self.fd, DEVICE_GET_INFO, DEVICE_INFO, 0, 0, 0
            )
        except BaseException:
            self.close()
            raise

    def region(self, index: int) -> tuple[int, int]:
        """Region ``index``'s (size, offset in the device file)."""
        info = _call(self.fd, DEVICE_GET_REGION_INFO, REGION_INFO, 0, index, 0, 0, 0)
        *_head, size, offset = info
        return size, offset

    def irq_count(self, index: int) -> int:
        """How many vectors interrupt ``index`` has (0: none), and it takes eventfds."""
        _argsz, flags, _index, count = _call(self.fd, DEVICE_GET_IRQ_INFO, IRQ_INFO, 0, index, 0)
        assert flags & IRQ_INFO_EVENTFD
        return count

    def write(self, region: int, offset: int, data: bytes) -> None:
        """Write ``data`` at ``offset`` of region ``region`` (a BAR: the device's registers)."""
        size, base = self.region(region)
        assert offset + len(data) <= size
        assert os.pwrite(self.fd, data, base + offset) == len(data)

    def read(self, region: int, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` of region ``region`` (7: the config space)."""
        length, base = self.region(region)
        assert offset + size <= length
        return os.pread(self.fd, size, base + offset)

    def close(self) -> None:
        """The device, then the group (which leaves its container), then the container."""
        for name in ("fd", "group", "container"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    def __enter__(self) -> VfioDevice:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
