"""A node's physical address map: where RAM is, and where MMIO (BARs, NTB windows) is placed.

Laid out like an x86 server: up to 2 GiB of RAM at 0, the 32-bit PCI hole from 2 GiB to the
firmware/APIC area just below 4 GiB, the rest of RAM from 4 GiB, and 64-bit MMIO from the next
1 TiB boundary above RAM. BARs and NTB windows are placed naturally aligned (a BAR's base is a
multiple of its size), largest first so they pack. I/O BARs get port numbers from 0x1000.
"""

from __future__ import annotations

import bisect

import msgspec

from vmlend.errors import ResourceExhaustedError
from vmlend.topology.model import AdapterSpec, BarKind, DeviceSpec, GiB, TiB

LOW_RAM_MAX = 2 * GiB
MMIO32_BASE = 2 * GiB
MMIO32_END = 0xFC00_0000  # above: IOAPIC, LAPIC, firmware flash
HIGH_RAM_BASE = 4 * GiB
MMIO64_ALIGN = 1 * TiB
IO_PORT_BASE = 0x1000
IO_PORT_END = 0x10000


class Region(msgspec.Struct, frozen=True):
    """Something that decodes [start, end) of a node's physical address space."""

    start: int
    end: int
    kind: str  # "ram", "bar", "ntb", "irq" (an MSI target, ``msitarget``)
    owner: str  # "ram", "fdid:0x10/bar1", adapter ref
    fdid: int | None = None
    bar: int | None = None
    adapter: str | None = None

    @property
    def size(self) -> int:
        return self.end - self.start


def ram_ranges(ram: int) -> list[tuple[int, int]]:
    """Physical RAM ranges [start, end) of a node with ``ram`` bytes."""
    low = min(ram, LOW_RAM_MAX)
    out = [(0, low)]
    if ram > low:
        out.append((HIGH_RAM_BASE, HIGH_RAM_BASE + ram - low))
    return out


def _align_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


class AddressMap:
    """The decoded regions of one node; ``place`` hands out MMIO ranges."""

    def __init__(self, node: str, ram: int) -> None:
        self.node = node
        self._starts: list[int] = []
        self._regions: list[Region] = []
        for start, end in ram_ranges(ram):
            self._add(Region(start, end, "ram", "ram"))
        ram_end = max(end for _, end in ram_ranges(ram))
        self.mmio64_base = _align_up(ram_end, MMIO64_ALIGN)
        self._next32 = MMIO32_BASE
        self._next64 = self.mmio64_base
        self._next_io = IO_PORT_BASE

    def _add(self, region: Region) -> None:
        i = bisect.bisect_left(self._starts, region.start)
        self._starts.insert(i, region.start)
        self._regions.insert(i, region)

    def place(self, size: int, *, below_4g: bool) -> int:
        """A naturally aligned free MMIO base for ``size`` bytes (callers register it with
        ``add``). Sizes must be powers of two (BARs and NTB windows are)."""
        if below_4g:
            base = _align_up(self._next32, size)
            if base + size > MMIO32_END:
                raise ResourceExhaustedError(
                    "32-bit MMIO space", self.node, size, max(0, MMIO32_END - base), "bytes"
                )
            self._next32 = base + size
            return base
        base = _align_up(self._next64, size)
        self._next64 = base + size
        return base

    def place_io(self, size: int) -> int:
        base = _align_up(self._next_io, size)
        if base + size > IO_PORT_END:
            raise ResourceExhaustedError("I/O port space", self.node, size, 0, "ports")
        self._next_io = base + size
        return base

    def add(self, region: Region) -> None:
        hit = self.find(region.start) or self.find(region.end - 1)
        if hit is not None:
            raise ValueError(f"{self.node}: {region.owner} overlaps {hit.owner}")
        self._add(region)

    def find(self, addr: int) -> Region | None:
        """The region decoding ``addr``, or None (nothing answers: a master abort)."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i >= 0 and self._regions[i].start <= addr < self._regions[i].end:
            return self._regions[i]
        return None

    def regions(self) -> list[Region]:
        return list(self._regions)


class MmioPlan(msgspec.Struct, frozen=True):
    """Where a node's firmware put things: NTB windows by adapter ref, BARs by fdid and index
    (I/O BARs: port numbers)."""

    windows: dict[str, int]
    bars: dict[int, dict[int, int]]


def plan_mmio(amap: AddressMap, adapters: list[AdapterSpec], devices: list[DeviceSpec]) -> MmioPlan:
    """Place every NTB window and BAR of one node and register them in ``amap``.

    64-bit MMIO holds the windows and 64-bit BARs, 32-bit MMIO the 32-bit BARs, each largest
    first (natural alignment then packs without gaps); ties go by fdid and BAR index, so the
    layout is deterministic."""
    # (size, fdid, adapter ref, bar index): windows have no fdid, BARs no ref
    wide = [(a.window_size, -1, a.ref, -1) for a in adapters]
    narrow: list[tuple[int, int, str, int]] = []
    ports: list[tuple[int, int, str, int]] = []
    for d in devices:
        for b in d.bars:
            pool = {BarKind.MEM64: wide, BarKind.MEM32: narrow, BarKind.IO: ports}[b.kind]
            pool.append((b.size, d.fdid, "", b.index))
    windows: dict[str, int] = {}
    bars: dict[int, dict[int, int]] = {d.fdid: {} for d in devices}

    def order(item: tuple[int, int, str, int]) -> tuple[int, int, str, int]:
        return (-item[0], item[1], item[2], item[3])

    for size, fdid, ref, index in sorted(wide, key=order):
        base = amap.place(size, below_4g=False)
        if ref:
            windows[ref] = base
            amap.add(Region(base, base + size, "ntb", ref, adapter=ref))
        else:
            bars[fdid][index] = base
    for size, fdid, _, index in sorted(narrow, key=order):
        bars[fdid][index] = amap.place(size, below_4g=True)
    for size, fdid, _, index in sorted(ports, key=order):
        bars[fdid][index] = amap.place_io(size)
    for d in devices:
        for b in d.bars:
            if b.kind is not BarKind.IO:
                start = bars[d.fdid][b.index]
                owner = f"fdid:{d.fdid:#x}/bar{b.index}"
                amap.add(Region(start, start + b.size, "bar", owner, fdid=d.fdid, bar=b.index))
    return MmioPlan(windows, bars)
