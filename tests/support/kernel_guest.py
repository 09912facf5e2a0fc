"""Helpers for tests/kernel, which run in the kernel tier's guest against the real sysfs."""

from __future__ import annotations

from pathlib import Path

import msgspec

from vmlend.hostenv import HostEnv
from vmlend.kernel.mdev import MdevBus, MdevDevice, MdevParent
from vmlend.kernel.udev import Uevent, UeventSource

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


class MttyAsSmartio:
    """Test-only: the real kernel's mtty parent under the SmartIO driver's names.

    The SmartIO driver is not in this kernel; the kernel backend finds its parents as
    ``smartio-<fdid>`` with the one type ``smartio-lend`` (docs/smartio-contract.md section 4).
    This stands in for ``SmartioFabric.bus``: every read and write goes to the real mdev core
    through a plain ``MdevBus`` on ``/`` (its checks unchanged); only the parent's and the
    type's names are translated, ``mtty`` <-> ``smartio-<fdid>`` and ``mtty-2`` <->
    ``smartio-lend``. The SmartIO class attributes come from a fixture tree (FakeSmartio)."""

    def __init__(self, fdid: int) -> None:
        from vmlend.kernel.driver import MDEV_TYPE, device_name

        self.kernel = MdevBus(REAL)
        self.name, self.type_id = device_name(fdid), MDEV_TYPE
        self.unreadable = self.kernel.unreadable

    def _ours(self, parent: str, type_id: str) -> tuple[str, str]:
        if parent == self.name:
            return MTTY, MTTY2 if type_id == self.type_id else type_id
        return parent, type_id

    def _theirs(self, dev: MdevDevice | None) -> MdevDevice | None:
        if dev is not None and (dev.parent, dev.type_id) == (MTTY, MTTY2):
            return msgspec.structs.replace(dev, parent=self.name, type_id=self.type_id)
        return dev

    def parent_names(self) -> list[str]:
        return sorted(self.name if n == MTTY else n for n in self.kernel.parent_names())

    def parent(self, name: str) -> MdevParent:
        parent = self.kernel.parent(self._ours(name, "")[0])
        if name != self.name:
            return parent
        t = parent.type(MTTY2)
        return MdevParent(
            name=self.name,
            types=(msgspec.structs.replace(t, parent=self.name, type_id=self.type_id),),
        )

    def device(self, uuid: str) -> MdevDevice | None:
        return self._theirs(self.kernel.device(uuid))

    def devices(self) -> list[MdevDevice]:
        return [d for d in map(self._theirs, self.kernel.devices()) if d is not None]

    def create(self, parent: str, type_id: str, uuid: str) -> MdevDevice:
        made = self._theirs(self.kernel.create(*self._ours(parent, type_id), uuid))
        assert made is not None
        return made

    def remove(self, uuid: str) -> bool:
        return self.kernel.remove(uuid)


class MttyEventsAsSmartio:
    """Test-only: live uevents with the mtty parent's name given as ``smartio-<fdid>``, for a
    watcher over ``MttyAsSmartio`` (the companion of that adapter, for events)."""

    def __init__(self, source: UeventSource, fdid: int) -> None:
        from vmlend.kernel.driver import device_name

        self.source, self.name = source, device_name(fdid)
        self.events: list[Uevent] = []

    def fileno(self) -> int:
        return self.source.fileno()

    def receive(self) -> Uevent | None:
        ev = self.source.receive()
        if ev is not None and ev.sys_name == MTTY and ev.subsystem != "module":
            ev = msgspec.structs.replace(ev, sys_name=self.name)
        if ev is not None:
            self.events.append(ev)
        return ev
