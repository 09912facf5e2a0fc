"""Which way a live migration moves a VM's remote devices (docs/migration.md): *hot* (they stay
plugged and keep their state; only their mappings follow the VM's memory) or *unplugged*
(unplug, migrate, plug back at the same guest addresses).

Hot needs all of: a hypervisor that lets vmlend act at the switch-over
(``Hypervisor.hot_migration``), a backend that can re-point a borrowed device
(``fabric.base.Repoints``), and a driver for every device's kind that can quiesce it
(``lending.quiesce``). A VM some of whose devices cannot quiesce moves *mixed*: those go
unplugged and are plugged back, the others stay plugged, one line per device saying which.
Otherwise (no device can quiesce, or the hypervisor or backend cannot) the VM moves unplugged,
said in one line naming why. Pure: the caller supplies what it found.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from vmlend.lending.quiesce import cannot_quiesce
from vmlend.topology.model import format_fdid

HOT = "hot"
UNPLUG = "unplug"
#: Some devices hot, the others (which cannot quiesce) unplugged and plugged back.
MIXED = "mixed"


class LiveMode(msgspec.Struct, frozen=True):
    """The way chosen, and the line that says so (mixed: one more line per device)."""

    mode: str
    line: str
    #: Mixed: the devices that go unplugged (the others stay plugged).
    unplugged: tuple[int, ...] = ()
    #: Mixed: one line per device, saying which way it goes.
    lines: tuple[str, ...] = ()

    @property
    def hot(self) -> bool:
        """The hand-over of a hot move runs (for all the devices, or for some: mixed)."""
        return self.mode in (HOT, MIXED)

    def device_mode(self, fdid: int) -> str:
        """How device ``fdid`` moves."""
        if self.mode == MIXED:
            return UNPLUG if fdid in self.unplugged else HOT
        return self.mode


def choose_mode(
    vm: str,
    kinds: Mapping[int, str],
    *,
    hypervisor: str | None,
    backend: str | None,
    unplug: bool = False,
) -> LiveMode:
    """How VM ``vm`` with remote devices ``kinds`` (fdid -> device kind) moves.
    ``hypervisor``: why the source's hypervisor cannot act at the switch-over (None: it can);
    ``backend``: why the fabric cannot re-point a device (None: it can); ``unplug``: asked
    for the unplugged way."""
    unplugged = f"VM {vm!r} moves with its devices unplugged"
    if unplug:
        return LiveMode(UNPLUG, f"--unplug: {unplugged}")
    if hypervisor is not None:
        return LiveMode(UNPLUG, f"{hypervisor}: {unplugged}")
    if backend is not None:
        return LiveMode(UNPLUG, f"{backend}: {unplugged}")
    if not kinds:
        return LiveMode(HOT, f"VM {vm!r} has no remote devices: only its memory moves")
    stuck = cannot_quiesce(dict(kinds))
    if stuck and len(stuck) < len(kinds):
        lines = tuple(
            f"device {format_fdid(f)} ({k}) cannot quiesce: unplugged, plugged back on arrival"
            if f in stuck
            else f"device {format_fdid(f)} ({k}): stays plugged; its mappings follow the VM"
            for f, k in sorted(kinds.items())
        )
        return LiveMode(
            MIXED,
            f"moving VM {vm!r} mixed: {len(kinds) - len(stuck)} of its {len(kinds)} devices"
            " stay plugged",
            tuple(sorted(stuck)),
            lines,
        )
    if stuck:
        named = ", ".join(f"{format_fdid(f)} ({k})" for f, k in stuck.items())
        if len(stuck) == 1:
            return LiveMode(UNPLUG, f"device {named} cannot quiesce: {unplugged}")
        return LiveMode(UNPLUG, f"devices {named} cannot quiesce: {unplugged}")
    devices = ", ".join(f"{format_fdid(f)} ({k})" for f, k in sorted(kinds.items()))
    return LiveMode(
        HOT, f"moving VM {vm!r} hot: its devices {devices} stay plugged; their mappings follow it"
    )
