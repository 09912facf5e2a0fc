"""Helpers for tests/kernel, which run in the kernel tier's guest against the real sysfs."""

from __future__ import annotations

from pathlib import Path

from vmlend.hostenv import HostEnv
from vmlend.kernel.mdev import MdevBus

#: The real host root inside the guest.
REAL = HostEnv(Path("/"))
#: The kernel's sample parent and its two types (one and two serial ports per child; the
#: driver has 24 ports in all).
MTTY = "mtty"
MTTY1 = "mtty-1"
MTTY2 = "mtty-2"
MTTY_DIR = Path("/sys/devices/virtual/mtty/mtty")


def remove_all_mdevs() -> None:
    """Remove every mdev child the kernel has (through the real sysfs)."""
    bus = MdevBus(REAL)
    for dev in bus.devices():
        bus.remove(dev.uuid)
    assert bus.devices() == []


def available(type_id: str) -> int:
    return MdevBus(REAL).parent(MTTY).type(type_id).available_instances
