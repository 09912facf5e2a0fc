"""A node's RAM: 4 KiB frames, a frame allocator and the bytes of every page written.

The allocator behaves like a long-running host's buddy allocator rather than a bump pointer:
4 KiB frames come out of 2 MiB blocks in shuffled order (so consecutive allocations are not
physically contiguous), 2 MiB pages come from shuffled 1 GiB blocks, and 1 GiB pages are handed
out while whole free gigabytes remain. The shuffle is seeded, so a run is reproducible.

Contents are stored per 4 KiB frame only once written; everything else reads as zero. That
keeps a 512 GiB node cheap while a DMA write can still be checked byte for byte.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable

from vmlend.errors import ResourceExhaustedError
from vmlend.topology.model import GiB, MiB

log = logging.getLogger(__name__)

FRAME = 4096
HUGE_2M = 2 * MiB
HUGE_1G = 1 * GiB
PAGE_SIZES = (FRAME, HUGE_2M, HUGE_1G)

_NAMES = {FRAME: "4 KiB frames", HUGE_2M: "2 MiB pages", HUGE_1G: "1 GiB pages"}


class HostMemory:
    """RAM of one node over the physical ``ranges`` [start, end)."""

    def __init__(self, node: str, ranges: Iterable[tuple[int, int]], seed: int = 0) -> None:
        self.node = node
        self.ranges = sorted(ranges)
        self._rng = random.Random(f"{seed}:{node}")
        self._free_1g: list[int] = []
        self._free_2m: list[int] = []
        self._loose: list[int] = []  # 4 KiB frames in range tails too small for a 2 MiB block
        self._open: dict[int, list[int]] = {}  # split 2 MiB block -> its free frames
        self._frames_out: dict[int, int] = {}  # split 2 MiB block -> frames allocated from it
        self._with_free: list[int] = []  # split blocks that still have free frames
        self._blocks_out: dict[int, int] = {}  # split 1 GiB block -> 2 MiB pieces out
        self._allocated: dict[int, tuple[int, str]] = {}  # base -> (size, owner)
        self._pages: dict[int, bytearray] = {}  # frame number -> contents
        for start, end in self.ranges:
            self._carve(start, end)
        self._rng.shuffle(self._free_1g)
        self._rng.shuffle(self._free_2m)

    def _carve(self, start: int, end: int) -> None:
        at = start
        while at < end:
            for size, pool in ((HUGE_1G, self._free_1g), (HUGE_2M, self._free_2m)):
                if at % size == 0 and at + size <= end:
                    pool.append(at)
                    at += size
                    break
            else:
                if at + FRAME > end:
                    return  # a sub-page tail is unusable
                self._loose.append(at)
                at += FRAME

    # --- sizes ---------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return sum(end - start for start, end in self.ranges)

    @property
    def allocated_bytes(self) -> int:
        return sum(size for size, _ in self._allocated.values())

    def contains(self, addr: int, length: int = 1) -> bool:
        """True when [addr, addr+length) is RAM of this node."""
        return any(s <= addr and addr + length <= e for s, e in self.ranges)

    def available(self, page_size: int) -> int:
        """How many pages of ``page_size`` could be allocated right now."""
        gigs = len(self._free_1g)
        if page_size == HUGE_1G:
            return gigs
        blocks = len(self._free_2m) + gigs * (HUGE_1G // HUGE_2M)
        if page_size == HUGE_2M:
            return blocks
        frames = sum(len(f) for f in self._open.values()) + len(self._loose)
        return frames + blocks * (HUGE_2M // FRAME)

    # --- allocation ----------------------------------------------------------------------------
    def alloc(self, page_size: int = FRAME, owner: str = "") -> int:
        """One naturally aligned page of ``page_size`` (4 KiB, 2 MiB or 1 GiB); returns its
        physical base. ``ResourceExhaustedError`` when no such page is free."""
        if page_size == FRAME:
            base = self._alloc_frame()
        elif page_size == HUGE_2M:
            base = self._alloc_2m()
        elif page_size == HUGE_1G:
            base = self._alloc_1g()
        else:
            raise ValueError(f"page size {page_size:#x} is not 4 KiB, 2 MiB or 1 GiB")
        self._allocated[base] = (page_size, owner)
        return base

    def _exhausted(self, page_size: int) -> ResourceExhaustedError:
        return ResourceExhaustedError(_NAMES[page_size], f"node {self.node} RAM", 1, 0, "pages")

    def _alloc_1g(self) -> int:
        if not self._free_1g:
            raise self._exhausted(HUGE_1G)
        return self._free_1g.pop()

    def _alloc_2m(self) -> int:
        if not self._free_2m:
            if not self._free_1g:
                raise self._exhausted(HUGE_2M)
            giga = self._free_1g.pop()
            pieces = list(range(giga, giga + HUGE_1G, HUGE_2M))
            self._rng.shuffle(pieces)
            self._free_2m.extend(pieces)
            self._blocks_out[giga] = 0
        base = self._free_2m.pop()
        giga = base - base % HUGE_1G
        if giga in self._blocks_out:
            self._blocks_out[giga] += 1
        return base

    def _alloc_frame(self) -> int:
        if self._with_free:
            block = self._with_free[-1]
            frames = self._open[block]
            self._frames_out[block] += 1
            frame = frames.pop()
            if not frames:
                self._with_free.pop()
            return frame
        try:
            block = self._alloc_2m()
        except ResourceExhaustedError:
            if not self._loose:
                raise self._exhausted(FRAME) from None
            return self._loose.pop()
        frames = list(range(block, block + HUGE_2M, FRAME))
        self._rng.shuffle(frames)
        self._open[block] = frames
        self._frames_out[block] = 1
        self._with_free.append(block)
        return frames.pop()

    def free(self, base: int) -> None:
        """Return a page from ``alloc``; its contents are forgotten. Whole blocks coalesce."""
        entry = self._allocated.pop(base, None)
        if entry is None:
            raise ValueError(f"{self.node}: {base:#x} is not an allocated page")
        size, _ = entry
        self._forget(base, size)
        if size == HUGE_1G:
            self._free_1g.append(base)
        elif size == HUGE_2M:
            self._give_2m(base)
        else:
            block = base - base % HUGE_2M
            if block not in self._open:
                self._loose.append(base)
                return
            if not self._open[block]:
                self._with_free.append(block)
            self._open[block].append(base)
            self._frames_out[block] -= 1
            if self._frames_out[block] == 0:
                del self._open[block]
                self._with_free.remove(block)
                del self._frames_out[block]
                self._give_2m(block)

    def _give_2m(self, block: int) -> None:
        giga = block - block % HUGE_1G
        self._free_2m.append(block)
        if giga in self._blocks_out:
            self._blocks_out[giga] -= 1
            if self._blocks_out[giga] == 0:  # every piece is back: the gigabyte is whole again
                del self._blocks_out[giga]
                self._free_2m = [b for b in self._free_2m if not giga <= b < giga + HUGE_1G]
                self._free_1g.append(giga)

    def _forget(self, base: int, size: int) -> None:
        if len(self._pages) < size // FRAME:
            for frame in [f for f in self._pages if base <= f * FRAME < base + size]:
                del self._pages[frame]
        else:
            for frame in range(base // FRAME, (base + size) // FRAME):
                self._pages.pop(frame, None)

    def owner_of(self, addr: int) -> str | None:
        """The owner tag of the allocated page holding ``addr``; None when free."""
        for size in PAGE_SIZES:
            entry = self._allocated.get(addr - addr % size)
            if entry is not None and entry[0] == size:
                return entry[1]
        return None

    # --- contents ------------------------------------------------------------------------------
    def _check(self, addr: int, length: int) -> None:
        if length < 0 or not self.contains(addr, max(length, 1)):
            raise ValueError(f"{self.node}: {addr:#x}+{length:#x} is not RAM")

    def read(self, addr: int, length: int) -> bytes:
        self._check(addr, length)
        out = bytearray()
        at, end = addr, addr + length
        while at < end:
            n = min(end, (at // FRAME + 1) * FRAME) - at
            page = self._pages.get(at // FRAME)
            rel = at % FRAME
            out += page[rel : rel + n] if page is not None else bytes(n)
            at += n
        return bytes(out)

    def write(self, addr: int, data: bytes) -> None:
        self._check(addr, len(data))
        at, pos = addr, 0
        while pos < len(data):
            n = min(len(data) - pos, FRAME - at % FRAME)
            chunk = data[pos : pos + n]
            page = self._pages.get(at // FRAME)
            if page is None:
                if not any(chunk):
                    at, pos = at + n, pos + n
                    continue
                page = self._pages[at // FRAME] = bytearray(FRAME)
            page[at % FRAME : at % FRAME + n] = chunk
            at, pos = at + n, pos + n

    def stored_frames(self, base: int, size: int) -> list[int]:
        """Addresses of the 4 KiB frames in [base, base+size) that hold written contents
        (every other frame there reads as zero), ascending."""
        first, end = base // FRAME, (base + size) // FRAME
        if len(self._pages) < end - first:
            return sorted(f * FRAME for f in self._pages if first <= f < end)
        return [f * FRAME for f in range(first, end) if f in self._pages]

    @property
    def pages_stored(self) -> int:
        """Frames holding written contents (for tests and memory accounting)."""
        return len(self._pages)


class FramedRange:
    """A range of addresses from ``base`` backed by 4 KiB frames of ``memory`` that need not
    be contiguous (``frames[i]`` backs ``base + i * FRAME``), read and written across them.
    The frames are the owner's to allocate, map and free."""

    def __init__(self, memory: HostMemory, what: str, base: int = 0) -> None:
        self.memory = memory
        self.what = what  # for errors: "the manager's memory"
        self.base = base
        self.frames: list[int] = []

    def _pieces(self, address: int, length: int) -> list[tuple[int, int, int]]:
        """(physical address, offset in the caller's bytes, length) for each frame touched."""
        out, at, end = [], address, address + length
        while at < end:
            index = (at - self.base) // FRAME
            if not 0 <= index < len(self.frames):
                raise ValueError(f"{at:#x} is outside {self.what}")
            n = min(end - at, FRAME - at % FRAME)
            out.append((self.frames[index] + at % FRAME, at - address, n))
            at += n
        return out

    def read(self, address: int, length: int) -> bytes:
        return b"".join(self.memory.read(p, n) for p, _, n in self._pieces(address, length))

    def write(self, address: int, data: bytes) -> None:
        for phys, pos, n in self._pieces(address, len(data)):
            self.memory.write(phys, data[pos : pos + n])


class OwnedFrames(FramedRange):
    """A ``FramedRange`` of ``size`` bytes (whole frames) that allocates its own frames of
    ``memory`` for ``owner`` and frees them at ``close``; a failed allocation frees what it
    took."""

    def __init__(self, memory: HostMemory, size: int, owner: str, what: str) -> None:
        super().__init__(memory, what)
        try:
            for _ in range(-(-size // FRAME)):
                self.frames.append(memory.alloc(FRAME, owner=owner))
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        for frame in self.frames:
            self.memory.free(frame)
        self.frames = []
