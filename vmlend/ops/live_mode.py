"""Which way a live migration moves a VM's remote devices (docs/migration.md): *hot* (they stay
plugged and keep their state; only their mappings follow the VM's memory) or *unplugged*
(unplug, migrate, plug back at the same guest addresses).

Hot needs all of: a hypervisor that lets vmlend act at the switch-over
(``Hypervisor.hot_migration``), a backend that can re-point a borrowed device
(``fabric.base.Repoints``), and a driver for every device's kind that can quiesce it
(``lending.quiesce``). A VM some of whose devices cannot quiesce moves *mixed*: those go
unplugged and are plugged back, the others stay plugged, one line per device saying which;
so do the devices that must move unplugged for a reason of their own (an NVMe share of two
paths: its relay rings live in the source host's memory).
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
    unplugged: Mapping[int, str] | None = None,
) -> LiveMode:
    """How VM ``vm`` with remote devices ``kinds`` (fdid -> device kind) moves.
    ``hypervisor``: why the source's hypervisor cannot act at the switch-over (None: it can);
    ``backend``: why the fabric cannot re-point a device (None: it can); ``unplug``: asked
    for the unplugged way; ``unplugged``: devices that cannot stay plugged whatever their
    kind, each with why."""
    all_out = f"VM {vm!r} moves with its devices unplugged"
    if unplug:
        return LiveMode(UNPLUG, f"--unplug: {all_out}")
    if hypervisor is not None:
        return LiveMode(UNPLUG, f"{hypervisor}: {all_out}")
    if backend is not None:
        return LiveMode(UNPLUG, f"{backend}: {all_out}")
    if not kinds:
        return LiveMode(HOT, f"VM {vm!r} has no remote devices: only its memory moves")
    why = {f: "cannot quiesce" for f in cannot_quiesce(dict(kinds))}
    why |= {f: w for f, w in (unplugged or {}).items() if f in kinds}
    stuck = {f: kinds[f] for f in sorted(why)}
    if stuck and len(stuck) < len(kinds):
        lines = tuple(
            f"device {format_fdid(f)} ({k}) {why[f]}: unplugged, plugged back on arrival"
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
        if len(set(why.values())) == 1:
            named = ", ".join(f"{format_fdid(f)} ({k})" for f, k in stuck.items())
            which = "device" if len(stuck) == 1 else "devices"
            return LiveMode(UNPLUG, f"{which} {named} {next(iter(why.values()))}: {all_out}")
        named = "; ".join(f"{format_fdid(f)} ({k}) {why[f]}" for f, k in stuck.items())
        return LiveMode(UNPLUG, f"devices {named}: {all_out}")
    devices = ", ".join(f"{format_fdid(f)} ({k})" for f, k in sorted(kinds.items()))
    return LiveMode(
        HOT, f"moving VM {vm!r} hot: its devices {devices} stay plugged; their mappings follow it"
    )
