"""The borrower's view of a device's BARs: a CPU's MMIO from a node to a device, hop by hop.

A guest's register and doorbell writes to a borrowed device leave the borrower's CPU through
the borrower's NTB adapter, cross the route's cables, and enter the lender through the
lender's adapter, where the lender's decoders answer with the BAR: the same route the device's
DMA takes the other way (``DmaResolver``), so a dead cable stops both. Stages, each with the
name a ``DmaFault.hop`` carries when it refuses:

``bar``          the device has no such BAR, or the access leaves it
``link-down``    a cable of the route is down: the adapter answers a read with all ones and
                 drops a write, as for DMA (``read`` and ``write`` do so; ``resolve`` names it)
``ntb-segment``  the segment of the borrower's window that maps the BAR (its BAR window) is
                 not translated (a reset lost it) or translates elsewhere: a master abort
``no-target``    the node does not hold the device (no current borrow, no shared drive's
                 crossing into it, and the caller named no route), the device is fenced, or
                 its memory decoding is off (command bit 1): the access ends in a master
                 abort, a read of all ones and a dropped write

The route is the one the device's crossing into the node takes now (``SimHardware.crossing``:
an exclusive borrow's path, a shared drive's crossing, each moved by a re-route), unless the
caller names one (a two-path share's backup; ``FabricError`` when it does not join the node
and the lender). A CPU's MMIO is carried by the LUT entries the
adapters reserve for the CPUs (``ntb``), so no requester entry is looked up. An exclusive
borrow's access is carried by its BAR window (``SimHardware.bar_windows``: whole segments of
the borrower's adapter, made at the hardware borrow, moved by a re-route, removed when the
borrow ends; what admission claims as ``window-bars``): the ``borrower-adapter`` hop names
the window address. A share's page-mode doorbell write passes its own window first
(``VmNvmeShare.page_write``); a trap's forward and a relay's take no window (not modelled).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import msgspec

from vmlend.errors import DmaFault, FabricError, NoPathError
from vmlend.sim.pci import regs
from vmlend.sim.resolver import Hop

if TYPE_CHECKING:
    from vmlend.sim.hardware import SimHardware
    from vmlend.topology.paths import NtbPath


class MmioTarget(msgspec.Struct, frozen=True):
    """Where a CPU access lands: BAR ``bar`` of ``fdid`` at ``offset``, through ``adapter``
    of the accessing node (None: the node is the device's lender)."""

    fdid: int
    bar: int
    offset: int
    adapter: str | None
    hops: tuple[Hop, ...]

    def describe(self) -> str:
        return " | ".join(str(h) for h in self.hops)


class MmioStats(msgspec.Struct):
    """What CPU MMIO did, per borrower adapter ("" for the lender's own CPU): writes
    delivered, writes dropped at a dead cable, writes nothing decoded (master aborts)."""

    delivered: Counter[str] = msgspec.field(default_factory=Counter)
    dropped: Counter[str] = msgspec.field(default_factory=Counter)
    aborted: Counter[str] = msgspec.field(default_factory=Counter)


class MmioResolver:
    """Resolves CPU accesses to device BARs over a ``SimHardware``."""

    def __init__(self, hardware: SimHardware) -> None:
        self.hw = hardware
        self.stats = MmioStats()

    def resolve(
        self,
        node: str,
        fdid: int,
        bar: int,
        offset: int,
        size: int,
        *,
        path: NtbPath | None = None,
    ) -> MmioTarget:
        """The target of an access of ``size`` bytes by ``node``'s CPU to BAR ``bar`` of
        ``fdid`` at ``offset``, over ``path`` (lender to ``node``; default: the device's
        crossing into ``node``); ``DmaFault`` naming the stage that refused."""
        dev = self.hw.device(fdid)
        bars = dev.bars.bars
        if bar not in bars:
            raise DmaFault("bar", offset, f"device {fdid:#x} has no BAR {bar}")
        if offset < 0 or size <= 0 or offset + size > bars[bar].size:
            raise DmaFault(
                "bar",
                offset,
                f"{size} bytes at {offset:#x} leave BAR {bar} of device {fdid:#x} "
                f"({bars[bar].size:#x} bytes)",
            )
        phys = dev.bar_phys[bar] + offset
        hops = [Hop("cpu", node, phys, f"BAR {bar} of {fdid:#x} +{offset:#x}")]
        adapter = None
        if node != dev.lender:
            if path is None and not self._holds(fdid, node):
                # no window of the node's adapter maps the BAR: nothing would carry it
                raise DmaFault(
                    "no-target",
                    phys,
                    f"{node} does not hold device {fdid:#x} (no borrow, no share crossing into"
                    f" it): its CPU's access reaches no BAR; borrow the device on {node} first",
                )
            route = path if path is not None else self._crossing(fdid, node, phys)
            if route.dst.node != node or route.src.node != dev.lender:
                raise FabricError(
                    f"route {route.describe()} does not join {node} and {dev.lender}, the "
                    f"lender of {fdid:#x}: name a route from the lender to {node}"
                )
            adapter = route.dst.ref
            borrow = self.hw.borrowed(fdid)
            window = None
            if borrow is not None and borrow.node == node and borrow.path == route:
                window = self._window(fdid, bar, offset, adapter, phys)
            hops.append(Hop("borrower-adapter", node, phys if window is None else window, adapter))
            dead = self.hw.dead_links(route)
            if dead:
                raise DmaFault(
                    "link-down",
                    phys,
                    f"link {', '.join(dead)} of {route.describe()} is down: reads return all"
                    " ones, writes are dropped",
                )
            if window is not None:
                self._translate(fdid, bar, adapter, window, phys)
            hops.append(Hop("lender-adapter", dev.lender, phys, route.src.ref))
        if self.hw.fenced(fdid) is not None:
            raise DmaFault("no-target", phys, f"{phys:#x} is a BAR of fenced device {fdid:#x}")
        if not dev.config.command & regs.COMMAND_MEMORY:
            raise DmaFault(
                "no-target",
                phys,
                f"{phys:#x} on {dev.lender} is BAR {bar} of device {fdid:#x}, whose memory "
                "decoding is off (command bit 1)",
            )
        hops.append(Hop("bar", dev.lender, phys, f"{fdid:#x}"))
        return MmioTarget(fdid, bar, offset, adapter, tuple(hops))

    def _window(self, fdid: int, bar: int, offset: int, adapter: str, phys: int) -> int:
        """The address in ``adapter``'s window where the borrower's CPU reaches ``offset`` of
        the borrowed ``fdid``'s BAR ``bar``; ``no-target`` when no window of it maps the
        BAR (nothing in the borrower decodes the access)."""
        found = self.hw.bar_window_address(fdid, bar, offset)
        if found is None or found[0] != adapter:
            raise DmaFault(
                "no-target",
                phys,
                f"no segment of {adapter} maps BAR {bar} of {fdid:#x}: the borrower's access"
                " decodes to nothing",
            )
        return found[1]

    def _translate(self, fdid: int, bar: int, adapter: str, window: int, phys: int) -> None:
        """The window's segment carries the access to the BAR: ``ntb-segment`` when it is
        not translated (a reset lost it) or translates elsewhere."""
        node, remote = self.hw.adapter(adapter).translate(window)
        if (node, remote) != (self.hw.device(fdid).lender, phys):
            raise DmaFault(
                "ntb-segment",
                window,
                f"{adapter} translates {window:#x} to {node}:{remote:#x}, not BAR {bar} of"
                f" {fdid:#x}",
            )

    def _holds(self, fdid: int, node: str) -> bool:
        """``node`` may reach ``fdid``'s BARs: it borrows the device now, or a shared drive
        has a crossing into it (its shares' doorbells)."""
        borrow = self.hw.borrowed(fdid)
        if borrow is not None and borrow.node == node:
            return True
        return any(c.node == node for c in self.hw.share_crossings(fdid))

    def _crossing(self, fdid: int, node: str, phys: int) -> NtbPath:
        """The route of ``fdid``'s crossing into ``node``; ``link-down`` when there is none
        and every route is dead (nothing could carry the access)."""
        try:
            route = self.hw.crossing(fdid, node)
        except NoPathError:
            raise DmaFault(
                "link-down", phys, f"no live route joins {node} and {self.hw.device(fdid).lender}"
            ) from None
        assert route is not None  # node is not the lender
        return route

    def _through(self, node: str, path: NtbPath | None, fdid: int) -> str:
        """The borrower adapter an access would leave by (for the counters)."""
        if node == self.hw.device(fdid).lender:
            return ""
        if path is not None:
            return path.dst.ref
        try:
            route = self.hw.crossing(fdid, node)
        except NoPathError:
            return ""
        return route.dst.ref if route is not None else ""

    def write(
        self,
        node: str,
        fdid: int,
        bar: int,
        offset: int,
        size: int,
        value: int,
        *,
        path: NtbPath | None = None,
    ) -> MmioTarget | None:
        """``node``'s CPU writes ``value`` into the BAR; None when a dead cable dropped it or
        nothing decoded it (an access outside the BAR is raised: the caller's bug)."""
        try:
            target = self.resolve(node, fdid, bar, offset, size, path=path)
        except DmaFault as fault:
            if fault.hop == "bar":
                raise
            lost = self.stats.dropped if fault.hop == "link-down" else self.stats.aborted
            lost[self._through(node, path, fdid)] += 1
            return None
        self.hw.device(fdid).bars.write(bar, offset, size, value)
        self.stats.delivered[target.adapter or ""] += 1
        return target

    def read(
        self,
        node: str,
        fdid: int,
        bar: int,
        offset: int,
        size: int,
        *,
        path: NtbPath | None = None,
    ) -> int:
        """What ``node``'s CPU reads from the BAR: all ones across a dead cable or where
        nothing decodes it."""
        try:
            self.resolve(node, fdid, bar, offset, size, path=path)
        except DmaFault as fault:
            if fault.hop == "bar":
                raise
            return (1 << 8 * size) - 1
        return self.hw.device(fdid).bars.read(bar, offset, size)
