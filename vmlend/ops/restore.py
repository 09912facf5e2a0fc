"""A running VM keeps what it uses: the repair the hook's ``reconnect`` (libvirtd restarted
while the VM runs) and ``vmlend reconcile --fix`` share. Imports little: the hook runs it."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from vmlend.domain.metadata import VmlendDevice
from vmlend.errors import VmlendError
from vmlend.fabric.base import Fabric
from vmlend.lending.devices import UndoJournal, acquire_device
from vmlend.lending.shares import acquire_share
from vmlend.topology.model import DEFAULT_INTERRUPTS, GuestRam, Holder, InterruptPath, format_fdid


def restore_running(
    fabric: Fabric,
    holder: Holder,
    devices: Iterable[VmlendDevice],
    guest_ram: GuestRam | int,
    record: Callable[[str], None] = lambda _m: None,
    interrupts_of: Callable[[VmlendDevice], InterruptPath] | None = None,
) -> list[str]:
    """A running VM keeps what it uses: make sure each device is held by it and has its mdev.
    Idempotent; nothing is rolled back (the guest keeps whatever it has). Returns the
    problems, one line per device that could not be restored. ``interrupts_of``: the path
    each device's MSI/MSI-X ask for (``DomainXMLInfo.interrupts_of``; default: the device's own,
    else the NTB)."""
    problems: list[str] = []
    for dev in devices:
        try:
            if dev.share is not None:  # a queue-level NVMe share: its own claim and mdev type
                acquire_share(
                    fabric,
                    holder,
                    dev.fdid,
                    dev.mdev,
                    dev.share,
                    UndoJournal(),
                    record,
                    guest_ram=guest_ram,
                )
                continue
            acquire_device(
                fabric,
                holder,
                dev.fdid,
                dev.mdev,
                UndoJournal(),
                guest_ram=guest_ram,
                interrupts=(
                    interrupts_of(dev)
                    if interrupts_of is not None
                    else dev.interrupts or DEFAULT_INTERRUPTS
                ),
                record=record,
            )
        except VmlendError as e:
            fd = format_fdid(dev.fdid)
            problems.append(f"device {fd}: {e}")
            record(f"device {fd}: PROBLEM: {e}")
    return problems
