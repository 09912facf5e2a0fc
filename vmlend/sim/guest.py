"""A guest's RAM: guest-physical ranges backed by host pages of the node it runs on.

Modelled on QEMU: the guest's RAM is one memory block whose pages are backed by host pages of
``backing`` size (4 KiB, or 2 MiB / 1 GiB hugepages), and the guest-physical ``ranges`` are
windows onto consecutive parts of that block (low RAM first, then high RAM at 4 GiB). So with
1 GiB hugepages and a low-RAM end that is not 1 GiB aligned, one host page backs the top of low
RAM and the bottom of high RAM, exactly as on a real host.

Memory exists only while the guest runs, and a backing page is allocated the first time it is
touched (pinned, read or written): that is what makes "pin to probe the layout" meaningful.
"""

from __future__ import annotations

import bisect
import itertools
import logging

import msgspec

from vmlend.errors import ConfigError, PinError
from vmlend.sim.dirtylog import DirtyLog
from vmlend.sim.hostmem import FRAME, HUGE_2M, PAGE_SIZES, HostMemory
from vmlend.topology.model import GuestRange

log = logging.getLogger(__name__)


class Frame(msgspec.Struct, frozen=True):
    """A pinned piece of guest RAM: [gpa, gpa+size) lives at host physical [phys, phys+size).

    Each piece lies within one backing page, so it is physically contiguous."""

    gpa: int
    phys: int
    size: int


class SimGuest:
    """The RAM of VM ``vm`` on node ``node``."""

    def __init__(
        self,
        node: str,
        vm: str,
        ranges: list[GuestRange],
        memory: HostMemory,
        *,
        backing: int = HUGE_2M,
    ) -> None:
        if backing not in PAGE_SIZES:
            raise ConfigError(f"guest backing page size {backing:#x} is not 4KiB, 2MiB or 1GiB")
        ordered = sorted(ranges, key=lambda r: r.start)
        for r in ordered:
            if r.size <= 0 or r.start % FRAME or r.end % FRAME:
                raise ConfigError(
                    f"guest {vm}: RAM range {r.start:#x}-{r.end:#x} is not 4KiB-sized"
                )
        for a, b in itertools.pairwise(ordered):
            if b.start < a.end:
                raise ConfigError(f"guest {vm}: RAM ranges {a.start:#x} and {b.start:#x} overlap")
        self.node = node
        self.vm = vm
        self.ranges = ordered
        self.backing = backing
        self.memory = memory
        self.running = False
        self._starts = [r.start for r in ordered]
        self._block_base: list[int] = []  # offset of each range inside the RAM block
        off = 0
        for r in ordered:
            self._block_base.append(off)
            off += r.size
        self._pages: dict[int, int] = {}  # backing page index -> host physical base
        self._pins: dict[int, int] = {}  # backing page index -> pin count
        #: 4 KiB guest page numbers the vCPUs wrote since the log was last taken (None: not
        #: logging): KVM's dirty log, what a live migration copies again
        self._dirty = DirtyLog()

    def __repr__(self) -> str:
        return f"SimGuest({self.node}/{self.vm}, {self.size:#x} bytes)"

    @property
    def size(self) -> int:
        return sum(r.size for r in self.ranges)

    @property
    def owner(self) -> str:
        """The owner tag its host pages carry (what a DMA target reports)."""
        return self.vm

    # --- life ----------------------------------------------------------------------------------
    def start(self) -> None:
        """The guest runs: its memory may now be allocated (on first touch)."""
        self.running = True

    def stop(self) -> None:
        """The guest is gone: its host pages go back to the node. Refused while pinned (the DMA
        windows must be torn down first, as VFIO unmaps before QEMU frees guest RAM)."""
        if self._pins:
            pinned = len(self._pins) * self.backing
            raise PinError(self.vm, 0, f"{pinned:#x} bytes are still pinned; unpin them first")
        for base in self._pages.values():
            self.memory.free(base)
        self._pages.clear()
        self.running = False

    # --- address arithmetic ----------------------------------------------------------------
    def _range_index(self, gpa: int) -> int | None:
        i = bisect.bisect_right(self._starts, gpa) - 1
        if i >= 0 and gpa < self.ranges[i].end:
            return i
        return None

    def is_ram(self, gpa: int) -> bool:
        return self._range_index(gpa) is not None

    def _block_offset(self, gpa: int) -> int:
        i = self._range_index(gpa)
        if i is None:
            raise PinError(self.vm, gpa, "not guest RAM")
        return self._block_base[i] + gpa - self.ranges[i].start

    def _page(self, index: int) -> int:
        base = self._pages.get(index)
        if base is None:
            base = self._pages[index] = self.memory.alloc(self.backing, owner=self.owner)
        return base

    def _pieces(self, gpa: int, size: int) -> list[tuple[int, int, int]]:
        """(gpa, backing page index, length) pieces of [gpa, gpa+size), each within one range
        and one backing page. PinError if any byte is not RAM."""
        out: list[tuple[int, int, int]] = []
        at, end = gpa, gpa + size
        while at < end:
            i = self._range_index(at)
            if i is None:
                raise PinError(self.vm, at, "not guest RAM")
            off = self._block_base[i] + at - self.ranges[i].start
            n = min(end, self.ranges[i].end) - at
            n = min(n, self.backing - off % self.backing)
            out.append((at, off // self.backing, n))
            at += n
        return out

    def _require_running(self, gpa: int) -> None:
        if not self.running:
            raise PinError(self.vm, gpa, "guest memory is not allocated (the guest is not running)")

    # --- the pin oracle (vfio_pin_pages) -----------------------------------------------------
    def can_pin(self, gpa: int) -> bool:
        """Would pinning the page at ``gpa`` succeed? Allocates nothing (a cheap probe)."""
        return self.running and self.is_ram(gpa)

    def pin(self, start: int, size: int) -> list[Frame]:
        """Pin [start, start+size) (4 KiB aligned): allocate what is untouched and return the
        host pieces. All or nothing: ``PinError`` naming the first address that is not RAM."""
        if start % FRAME or size % FRAME or size <= 0:
            raise PinError(self.vm, start, f"range {start:#x}+{size:#x} is not 4KiB aligned")
        self._require_running(start)
        pieces = self._pieces(start, size)
        frames: list[Frame] = []
        try:
            for gpa, index, n in pieces:
                base = self._page(index)
                self._pins[index] = self._pins.get(index, 0) + 1
                off = self._block_offset(gpa) % self.backing
                frames.append(Frame(gpa, base + off, n))
        except Exception:
            if frames:  # the host ran out of pages part way: undo, all or nothing
                self.unpin(start, frames[-1].gpa + frames[-1].size - start)
            raise
        return frames

    def unpin(self, start: int, size: int) -> None:
        """Drop one pin of each backing page in [start, start+size)."""
        for _, index, _ in self._pieces(start, size):
            count = self._pins.get(index, 0)
            if count <= 1:
                self._pins.pop(index, None)
            else:
                self._pins[index] = count - 1

    @property
    def pinned_bytes(self) -> int:
        return len(self._pins) * self.backing

    # --- guest CPU view --------------------------------------------------------------------------
    def host_address(self, gpa: int) -> int:
        """Host physical address of ``gpa`` (touching the page, so it exists afterwards)."""
        self._require_running(gpa)
        off = self._block_offset(gpa)
        return self._page(off // self.backing) + off % self.backing

    def backed(self, gpa: int) -> int | None:
        """Host physical address of ``gpa`` if its page exists already, without touching it."""
        i = self._range_index(gpa)
        if i is None:
            return None
        off = self._block_base[i] + gpa - self.ranges[i].start
        base = self._pages.get(off // self.backing)
        return None if base is None else base + off % self.backing

    def read(self, gpa: int, length: int) -> bytes:
        self._require_running(gpa)
        out = bytearray()
        for at, _, n in self._pieces(gpa, length):
            out += self.memory.read(self.host_address(at), n)
        return bytes(out)

    def write(self, gpa: int, data: bytes) -> None:
        """The guest's vCPUs write ``data`` at ``gpa`` (logged when the dirty log is on)."""
        self._require_running(gpa)
        if data:
            self._dirty.mark(range(gpa // FRAME, (gpa + len(data) - 1) // FRAME + 1))
        self._store(gpa, data)

    def load(self, gpa: int, data: bytes) -> None:
        """Put ``data`` at ``gpa`` from outside the guest (an incoming migration's copy): not
        a vCPU write, so not logged."""
        self._require_running(gpa)
        self._store(gpa, data)

    # --- dirty log (KVM_GET_DIRTY_LOG) ---------------------------------------------------------
    def start_dirty_log(self) -> None:
        self._dirty.start()

    def take_dirty(self) -> set[int]:
        """4 KiB guest page numbers the vCPUs wrote since the last take (the log goes on)."""
        return self._dirty.take()

    def stop_dirty_log(self) -> set[int]:
        return self._dirty.stop()

    def stored_pages(self) -> list[int]:
        """4 KiB guest page numbers holding anything but zeros (what a first migration pass
        sends; QEMU skips zero pages the same way), ascending."""
        by_base = {base: index for index, base in self._pages.items()}
        out: list[int] = []
        for base, index in sorted(by_base.items()):
            for frame in self.memory.stored_frames(base, self.backing):
                out.append(self._gpa_of(index * self.backing + frame - base) // FRAME)
        return sorted(p for p in out if p >= 0)

    def _gpa_of(self, block_offset: int) -> int:
        """The guest-physical address of RAM block offset ``block_offset`` (-1: past the end)."""
        i = bisect.bisect_right(self._block_base, block_offset) - 1
        if i < 0 or block_offset - self._block_base[i] >= self.ranges[i].size:
            return -1
        return self.ranges[i].start + block_offset - self._block_base[i]

    def _store(self, gpa: int, data: bytes) -> None:
        pos = 0
        for at, _, n in self._pieces(gpa, len(data)):
            self.memory.write(self.host_address(at), data[pos : pos + n])
            pos += n
