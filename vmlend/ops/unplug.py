"""Waiting for the guest to let go of a hot-removed hostdev."""

from __future__ import annotations

import time
from collections.abc import Callable
from uuid import UUID

import msgspec

from vmlend.domain import DomainDocument
from vmlend.domain.model import DomainXML
from vmlend.errors import DetachTimeoutError
from vmlend.hypervisor import Hypervisor


class DetachWait(msgspec.Struct, frozen=True):
    """How long a live detach waits for the guest to let go of the hostdev: libvirt's live
    detach returns once it asked QEMU, which unplugs only when the guest acknowledges (a guest
    without an OS never does; docs/testing.md). ``clock`` and ``sleep`` are injectable for tests."""

    timeout: float = 10.0
    interval: float = 0.2
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep

    def __post_init__(self) -> None:
        if self.timeout < 0 or self.interval <= 0:
            raise ValueError(f"bad detach wait: timeout {self.timeout}, interval {self.interval}")


def live_has_hostdev(hv: Hypervisor, name: str, mdev: UUID | str) -> bool:
    """Whether the running domain's XML still has an mdev hostdev with UUID ``mdev``."""
    doc = DomainDocument.parse(hv.xml(name), source=f"live XML of {name}")
    return any(str(h.uuid) == str(mdev) for h in DomainXML(doc.root).mdev_hostdevs())


def wait_unplugged(
    hv: Hypervisor, name: str, fdid: int, mdev: UUID | str, wait: DetachWait
) -> None:
    """Return once the hostdev of ``mdev`` has left the live XML; ``DetachTimeoutError`` when
    it is still there after ``wait.timeout`` (the caller must then keep the device held)."""
    deadline = wait.clock() + wait.timeout
    while live_has_hostdev(hv, name, mdev):
        if wait.clock() >= deadline:
            raise DetachTimeoutError(name, fdid, str(mdev), wait.timeout)
        wait.sleep(wait.interval)
