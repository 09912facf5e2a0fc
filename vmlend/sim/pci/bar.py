"""The memory behind a function's BARs, with the MSI-X table and PBA where the spec puts them.

Ordinary BAR memory is a sparse byte store (only pages written take space), so a 32 GiB GPU BAR
costs nothing until used. The MSI-X table (16-byte entries: address low, address high, data,
vector control) and the pending-bit array (one bit per vector, 64-bit words) are register
blocks with their own rules: entries start masked, only bit 0 of vector control is writable,
the low two address bits are zero, and the PBA is read-only to software (the device sets it).

Listeners see every software write after it took effect: ``fn(bar, offset, size, value)``.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from vmlend.sim.pci import regs
from vmlend.topology.model import BarKind, BarSpec, MsixSpec

BarListener = Callable[[int, int, int, int], None]

_PAGE = 4096


class MsixEntry(msgspec.Struct, frozen=True):
    """One MSI-X table entry as software programmed it."""

    address: int
    data: int
    masked: bool


class BarMemory:
    """Memory BARs of one function. Registers are accessed with sizes 1, 2, 4 or 8; DMA from
    peers moves arbitrary byte strings with ``read_bytes``/``write_bytes``."""

    def __init__(self, bars: tuple[BarSpec, ...] | list[BarSpec], msix: MsixSpec | None) -> None:
        self._bars = {b.index: b for b in bars if b.kind is not BarKind.IO}
        self._msix = msix
        self._pages: dict[tuple[int, int], bytearray] = {}
        self._listeners: list[BarListener] = []
        self._table = bytearray()
        self._pba = bytearray()
        if msix is not None:
            for bir in (msix.table_bar, msix.pba_bar):
                if bir not in self._bars:
                    raise ValueError(f"MSI-X structure in BAR {bir}, which is not a memory BAR")
        self.reset()

    def reset(self) -> None:
        """Power-on contents: memory zero, every MSI-X vector masked, nothing pending."""
        self._pages.clear()
        if self._msix is None:
            return
        n = self._msix.vectors
        self._table = bytearray(regs.MSIX_ENTRY_SIZE * n)
        for v in range(n):
            self._table[v * regs.MSIX_ENTRY_SIZE + regs.MSIX_ENTRY_VECTOR_CTRL] = (
                regs.MSIX_ENTRY_CTRL_MASKBIT
            )
        self._pba = bytearray(8 * ((n + 63) // 64))

    # --- layout ------------------------------------------------------------------------------
    @property
    def bars(self) -> dict[int, BarSpec]:
        return dict(self._bars)

    def size(self, bar: int) -> int:
        return self._spec(bar).size

    def _spec(self, bar: int) -> BarSpec:
        spec = self._bars.get(bar)
        if spec is None:
            raise ValueError(f"BAR {bar} is not a memory BAR of this function")
        return spec

    def _region(self, bar: int, offset: int) -> tuple[bytearray, int, bool] | None:
        """(block, offset in block, writable) when ``offset`` of ``bar`` is in the MSI-X table
        or PBA."""
        m = self._msix
        if m is None:
            return None
        if bar == m.table_bar and m.table_offset <= offset < m.table_offset + len(self._table):
            return self._table, offset - m.table_offset, True
        if bar == m.pba_bar and m.pba_offset <= offset < m.pba_offset + len(self._pba):
            return self._pba, offset - m.pba_offset, False
        return None

    # --- register access (CPU MMIO) --------------------------------------------------------
    def _check(self, bar: int, offset: int, size: int) -> None:
        if size not in (1, 2, 4, 8):
            raise ValueError(f"MMIO access size must be 1, 2, 4 or 8, got {size}")
        limit = self._spec(bar).size
        if offset < 0 or offset + size > limit:
            raise ValueError(f"BAR {bar} offset {offset:#x}+{size} is outside its {limit} bytes")

    def read(self, bar: int, offset: int, size: int) -> int:
        self._check(bar, offset, size)
        return int.from_bytes(self.read_bytes(bar, offset, size), "little")

    def write(self, bar: int, offset: int, size: int, value: int) -> None:
        self._check(bar, offset, size)
        value &= (1 << (8 * size)) - 1
        self._store(bar, offset, value.to_bytes(size, "little"))
        for fn in list(self._listeners):
            fn(bar, offset, size, value)

    def add_listener(self, fn: BarListener) -> Callable[[], None]:
        """Call ``fn(bar, offset, size, value)`` after every write; returns a remover."""
        self._listeners.append(fn)

        def remove() -> None:
            if fn in self._listeners:
                self._listeners.remove(fn)

        return remove

    # --- bulk access (peer-to-peer DMA) -------------------------------------------------------
    def read_bytes(self, bar: int, offset: int, length: int) -> bytes:
        limit = self._spec(bar).size
        if offset < 0 or offset + length > limit:
            raise ValueError(f"BAR {bar} range {offset:#x}+{length} is outside its {limit} bytes")
        out = bytearray()
        for at, n in self._page_chunks(offset, length):
            if self._touches_region(bar, at, n):
                for i in range(at, at + n):
                    region = self._region(bar, i)
                    if region is not None:
                        out.append(region[0][region[1]])
                    else:
                        out += self._page_bytes(bar, i, 1)
            else:
                out += self._page_bytes(bar, at, n)
        return bytes(out)

    def _page_bytes(self, bar: int, at: int, n: int) -> bytes:
        page = self._pages.get((bar, at // _PAGE))
        if page is None:
            return bytes(n)
        rel = at % _PAGE
        return bytes(page[rel : rel + n])

    @staticmethod
    def _page_chunks(offset: int, length: int) -> list[tuple[int, int]]:
        out = []
        at, end = offset, offset + length
        while at < end:
            n = min(end, (at // _PAGE + 1) * _PAGE) - at
            out.append((at, n))
            at += n
        return out

    def _touches_region(self, bar: int, at: int, n: int) -> bool:
        m = self._msix
        if m is None:
            return False
        for b, start, length in (
            (m.table_bar, m.table_offset, len(self._table)),
            (m.pba_bar, m.pba_offset, len(self._pba)),
        ):
            if b == bar and at < start + length and start < at + n:
                return True
        return False

    def write_bytes(self, bar: int, offset: int, data: bytes) -> None:
        """A peer's DMA write into the BAR (listeners are not told: they watch CPU writes)."""
        limit = self._spec(bar).size
        if offset < 0 or offset + len(data) > limit:
            raise ValueError(
                f"BAR {bar} range {offset:#x}+{len(data)} is outside its {limit} bytes"
            )
        self._store(bar, offset, data)

    def _store(self, bar: int, offset: int, data: bytes) -> None:
        pos = 0
        for at, n in self._page_chunks(offset, len(data)):
            chunk = data[pos : pos + n]
            pos += n
            if self._touches_region(bar, at, n):
                for i, byte in enumerate(chunk):
                    region = self._region(bar, at + i)
                    if region is None:
                        self._put_page(bar, at + i, bytes([byte]))
                    elif region[2]:
                        region[0][region[1]] = byte & self._table_wmask(region[1])
                    # the PBA is read-only to software: writes are dropped
            else:
                self._put_page(bar, at, chunk)

    def _put_page(self, bar: int, at: int, chunk: bytes) -> None:
        key = (bar, at // _PAGE)
        page = self._pages.get(key)
        if page is None:
            if not any(chunk):
                return  # unwritten memory reads zero anyway
            page = self._pages[key] = bytearray(_PAGE)
        rel = at % _PAGE
        page[rel : rel + len(chunk)] = chunk

    @staticmethod
    def _table_wmask(rel: int) -> int:
        field = rel % regs.MSIX_ENTRY_SIZE
        if field == regs.MSIX_ENTRY_LOWER_ADDR:
            return 0xFC  # message address is dword aligned
        if regs.MSIX_ENTRY_VECTOR_CTRL <= field < regs.MSIX_ENTRY_SIZE:
            return regs.MSIX_ENTRY_CTRL_MASKBIT if field == regs.MSIX_ENTRY_VECTOR_CTRL else 0
        return 0xFF

    # --- MSI-X helpers --------------------------------------------------------------------------
    def msix_entry(self, vector: int) -> MsixEntry:
        """Table entry ``vector`` decoded."""
        self._check_vector(vector)
        base = vector * regs.MSIX_ENTRY_SIZE
        word = self._table[base : base + regs.MSIX_ENTRY_SIZE]
        lo = int.from_bytes(word[0:4], "little")
        hi = int.from_bytes(word[4:8], "little")
        data = int.from_bytes(word[8:12], "little")
        ctrl = int.from_bytes(word[12:16], "little")
        return MsixEntry(
            address=hi << 32 | lo, data=data, masked=bool(ctrl & regs.MSIX_ENTRY_CTRL_MASKBIT)
        )

    def msix_pending(self, vector: int) -> bool:
        self._check_vector(vector)
        return bool(self._pba[vector // 8] >> (vector % 8) & 1)

    def set_msix_pending(self, vector: int, pending: bool) -> None:
        """The device sets a vector's pending bit (masked when it fired) or clears it."""
        self._check_vector(vector)
        bit = 1 << (vector % 8)
        if pending:
            self._pba[vector // 8] |= bit
        else:
            self._pba[vector // 8] &= ~bit & 0xFF

    def _check_vector(self, vector: int) -> None:
        if self._msix is None:
            raise ValueError("this function has no MSI-X capability")
        if not 0 <= vector < self._msix.vectors:
            raise ValueError(f"MSI-X vector {vector} out of range 0..{self._msix.vectors - 1}")
