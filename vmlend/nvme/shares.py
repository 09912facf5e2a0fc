"""Who gets what of a shared NVMe controller (pure): queue ids, MSI-X vectors, LBA extents
and DMA address spaces, per share (one VM's virtual controller).

Doorbell pages. Doorbells of consecutive queue ids are ``4 << DSTRD`` bytes apart, so one
4 KiB page holds the doorbells of ``4096 / (2 * stride)`` queue ids (512 with DSTRD = 0). When
the controller's BAR has doorbell pages to spare, each share gets a page of its own (mode
``page``): guest queue id ``g`` is real queue id ``page * per_page + g``, so the guest's doorbell
page maps 1:1 onto that real page and its writes reach the drive with no software in between,
and only its own queue ids. The first queue id of the page stands for the guest's admin queue:
it is never created, and writes to its doorbells are reported by the drive (stray doorbell) and
handed to the emulated admin queue. When there is a single doorbell page (queue ids of several
shares would share it), the guest's doorbell page is trapped (mode ``trap``): one software step
per doorbell write, which forwards only to the share's own queue ids.

Paths. A share of ``paths=2`` (``vmlend nvme reserve --paths 2``) also has a backup queue pair
for each of its queue pairs, reached through another adapter of the VM's host: real queue ids
``qid_base + queue_pairs + g``, vectors after its primary ones, and a second address space
``backup_asid`` (its DMA windows through the other adapter). ``span`` is what it takes of the
queue ids and vectors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from vmlend.errors import CmbFullError, ConfigError, ResourceExhaustedError
from vmlend.nvme import cmb, spec

PAGE_MODE = "page"
TRAP_MODE = "trap"


class Geometry(msgspec.Struct, frozen=True):
    """What the shared controller offers."""

    queue_pairs: int  # I/O queue ids 1..queue_pairs
    dstrd: int
    vectors: int  # MSI-X vectors; 0 is the manager's admin queue
    blocks: int  # namespace 1
    name: str = "nvme"
    #: Bytes of lender memory the manager keeps as the drive's controller memory buffer for
    #: its shares' submission queues (``vmlend.nvme.cmb``); 0: queues in guest RAM only.
    cmb_bytes: int = 0
    entries: int = 1024  # the largest queue (CAP.MQES + 1): what a CMB extent is sized for

    @property
    def per_page(self) -> int:
        return spec.PAGE // (2 * (4 << self.dstrd))

    @property
    def doorbell_pages(self) -> int:
        return -(-(self.queue_pairs + 1) // self.per_page)

    @property
    def mode(self) -> str:
        return PAGE_MODE if self.doorbell_pages > 1 else TRAP_MODE


class Share(msgspec.Struct, frozen=True):
    """One VM's share. Real queue id of guest queue ``g`` (1..queue_pairs) is ``qid_base + g``;
    real vector of guest vector ``v`` (1..queue_pairs; 0 is its emulated admin queue) is
    ``vector_base + v - 1``; its LBA 0 is ``lba_offset``; its DMA is tagged ``asid``."""

    name: str
    queue_pairs: int
    blocks: int
    lba_offset: int
    asid: int
    qid_base: int
    vector_base: int
    mode: str
    page: int | None = None  # doorbell page index (page mode)
    paths: int = 1  # 2: a backup queue pair per queue pair, through another adapter
    backup_asid: int = 0  # the backup path's address space (paths == 2)
    #: Its extent of the drive's controller memory buffer (offset, bytes), if it has one.
    cmb_offset: int | None = None
    cmb_bytes: int = 0

    @property
    def cmb_extent(self) -> tuple[int, int] | None:
        """(offset, bytes) of its extent of the drive's CMB; None: its queues are in RAM."""
        return None if self.cmb_offset is None else (self.cmb_offset, self.cmb_bytes)

    @property
    def span(self) -> int:
        """Queue ids (and MSI-X vectors) the share takes: its queue pairs on every path."""
        return self.queue_pairs * self.paths

    @property
    def asids(self) -> tuple[int, ...]:
        """Its address spaces: the primary path's, then the backup's."""
        return (self.asid, self.backup_asid) if self.paths > 1 else (self.asid,)

    def backup_qid(self, guest_qid: int) -> int:
        """Real queue id of the backup pair of guest queue ``guest_qid``."""
        if self.paths < 2:
            raise ValueError(f"{self.name} has no backup path")
        return self.real_qid(guest_qid) + self.queue_pairs

    def backup_vector(self, guest_vector: int) -> int:
        if self.paths < 2:
            raise ValueError(f"{self.name} has no backup path")
        return self.real_vector(guest_vector) + self.queue_pairs

    def backup_guest_vector(self, real_vector: int) -> int | None:
        """The guest vector whose backup pair raises ``real_vector``, None when none does."""
        if self.paths < 2:
            return None
        return self.guest_vector(real_vector - self.queue_pairs)

    def real_qid(self, guest_qid: int) -> int:
        if not 1 <= guest_qid <= self.queue_pairs:
            raise ValueError(f"{self.name} has queue ids 1..{self.queue_pairs}, not {guest_qid}")
        return self.qid_base + guest_qid

    def guest_qid(self, real_qid: int) -> int | None:
        g = real_qid - self.qid_base
        return g if 1 <= g <= self.queue_pairs else None

    def real_vector(self, guest_vector: int) -> int:
        if not 1 <= guest_vector <= self.queue_pairs:
            raise ValueError(f"{self.name} has vectors 1..{self.queue_pairs}, not {guest_vector}")
        return self.vector_base + guest_vector - 1

    def guest_vector(self, real_vector: int) -> int | None:
        v = real_vector - self.vector_base + 1
        return v if 1 <= v <= self.queue_pairs else None

    def doorbell_page_offset(self, dstrd: int) -> int | None:
        """BAR0 offset of the real doorbell page this share's guest page maps onto."""
        if self.page is None:
            return None
        return spec.DOORBELL_BASE + self.page * spec.PAGE

    def record(self) -> dict[str, object]:
        """Every field, for the registry (``from_record`` reads it back)."""
        return {
            "name": self.name,
            "queue_pairs": self.queue_pairs,
            "blocks": self.blocks,
            "lba_offset": self.lba_offset,
            "asid": self.asid,
            "qid_base": self.qid_base,
            "vector_base": self.vector_base,
            "mode": self.mode,
            "page": self.page,
            "paths": self.paths,
            "backup_asid": self.backup_asid,
            "cmb_offset": self.cmb_offset,
            "cmb_bytes": self.cmb_bytes,
        }

    @classmethod
    def from_record(cls, data: Mapping[str, Any]) -> Share:
        page = data.get("page")
        cmb_offset = data.get("cmb_offset")  # records from before CMB extents have none
        return cls(
            str(data["name"]),
            int(data["queue_pairs"]),
            int(data["blocks"]),
            int(data["lba_offset"]),
            int(data["asid"]),
            int(data["qid_base"]),
            int(data["vector_base"]),
            str(data["mode"]),
            None if page is None else int(page),
            int(data.get("paths", 1)),  # records from before backup paths have one
            int(data.get("backup_asid", 0)),
            None if cmb_offset is None else int(cmb_offset),
            int(data.get("cmb_bytes", 0)),
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "queue_pairs": self.queue_pairs,
            "lba_offset": self.lba_offset,
            "blocks": self.blocks,
            "asid": self.asid,
            "qids": [self.qid_base + 1, self.qid_base + self.queue_pairs],
            "vectors": [self.vector_base, self.vector_base + self.queue_pairs - 1],
            "doorbells": self.mode,
            "paths": self.paths,
            "cmb": None
            if self.cmb_offset is None
            else {"offset": self.cmb_offset, "bytes": self.cmb_bytes},
        }


def _first_fit(taken: list[tuple[int, int]], need: int, lo: int, hi: int) -> int | None:
    """Start of the first gap of ``need`` in [lo, hi) between ``taken`` (start, length)."""
    at = lo
    for start, length in sorted(taken):
        if start - at >= need:
            return at
        at = max(at, start + length)
    return at if hi - at >= need else None


def _overlap(a: int, alen: int, b: int, blen: int) -> bool:
    return a < b + blen and b < a + alen


def _extents_overlap(a: tuple[int, int] | None, b: tuple[int, int] | None) -> bool:
    return a is not None and b is not None and _overlap(a[0], a[1], b[0], b[1])


class ShareBook:
    """Allocations of one controller among its shares."""

    def __init__(self, geometry: Geometry, shares: list[Share] | None = None) -> None:
        self.geometry = geometry
        self.shares: dict[str, Share] = {s.name: s for s in shares or []}

    def free_queue_pairs(self) -> int:
        g = self.geometry
        if g.mode == PAGE_MODE:
            pages = g.doorbell_pages - 1 - len(self.shares)
            return max(0, min(pages * (g.per_page - 1), g.queue_pairs - len(self.shares)))
        return g.queue_pairs - sum(s.span for s in self.shares.values())

    def allocate(self, name: str, queue_pairs: int, blocks: int, paths: int = 1) -> Share:
        """A share of ``queue_pairs`` queue pairs and ``blocks`` blocks on ``paths`` paths (2:
        a backup queue pair for each); ``ResourceExhaustedError`` (nothing allocated) when the
        controller has not that much left."""
        g = self.geometry
        if name in self.shares:
            raise ConfigError(f"{g.name} already has a share named {name!r}")
        if queue_pairs < 1 or blocks < 1:
            raise ConfigError(
                f"a share needs at least one queue pair and one block, got "
                f"{queue_pairs} and {blocks}"
            )
        if paths not in (1, 2):
            raise ConfigError(f"a share has 1 or 2 paths (a primary and a backup), not {paths}")
        span = queue_pairs * paths
        shares = list(self.shares.values())
        page: int | None = None
        if g.mode == PAGE_MODE:
            if span > g.per_page - 1:
                raise ResourceExhaustedError(
                    "queue pairs per doorbell page", g.name, span, g.per_page - 1
                )
            used = {s.page for s in shares}
            page = next(
                (
                    p
                    for p in range(1, g.doorbell_pages)
                    if p not in used and p * g.per_page + span <= g.queue_pairs
                ),
                None,
            )
            if page is None:
                raise ResourceExhaustedError(
                    "NVMe queue pairs", g.name, span, self.free_queue_pairs()
                )
            qid_base = page * g.per_page
        else:
            taken = [(s.qid_base + 1, s.span) for s in shares]
            start = _first_fit(taken, span, 1, g.queue_pairs + 1)
            if start is None:
                raise ResourceExhaustedError(
                    "NVMe queue pairs", g.name, span, self.free_queue_pairs()
                )
            qid_base = start - 1
        vtaken = [(s.vector_base, s.span) for s in shares]
        vbase = _first_fit(vtaken, span, 1, g.vectors)
        if vbase is None:
            free = g.vectors - 1 - sum(s.span for s in shares)
            raise ResourceExhaustedError("NVMe MSI-X vectors", g.name, span, free)
        ltaken = [(s.lba_offset, s.blocks) for s in shares]
        lba = _first_fit(ltaken, blocks, 0, g.blocks)
        if lba is None:
            free = g.blocks - sum(s.blocks for s in shares)
            raise ResourceExhaustedError("NVMe LBA space", g.name, blocks, free, "blocks")
        used_asids = {a for s in shares for a in s.asids}
        free_asids = (a for a in range(1, 2 * len(shares) + 3) if a not in used_asids)
        asid = next(free_asids)
        backup = next(free_asids) if paths > 1 else 0
        extent = self._cmb_extent(queue_pairs, paths)
        share = Share(
            name,
            queue_pairs,
            blocks,
            lba,
            asid,
            qid_base,
            vbase,
            g.mode,
            page,
            paths,
            backup,
            None if extent is None else extent[0],
            0 if extent is None else extent[1],
        )
        self.shares[name] = share
        return share

    def _cmb_extent(self, queue_pairs: int, paths: int) -> tuple[int, int] | None:
        """The share's extent of the CMB (None: the drive has none, or the share has two
        paths, whose relay keeps its queues on the VM's host); ``CmbFullError`` when no gap
        is large enough."""
        g = self.geometry
        if not g.cmb_bytes or paths > 1:
            return None
        need = cmb.extent_bytes(queue_pairs, g.entries)
        taken = [e for s in self.shares.values() if (e := s.cmb_extent) is not None]
        at = cmb.place_extent(taken, need, g.cmb_bytes)
        if at is None:
            raise CmbFullError(g.name, need, cmb.largest_free(taken, g.cmb_bytes), g.cmb_bytes)
        return at, need

    def adopt(self, share: Share) -> Share:
        """Take a share decided elsewhere (the registry's reserve), refusing overlaps."""
        g = self.geometry
        if share.name in self.shares or share.mode != g.mode or share.paths not in (1, 2):
            raise ConfigError(f"share {share.name!r} does not fit {g.name}")
        for other in self.shares.values():
            clash = (
                _overlap(share.qid_base + 1, share.span, other.qid_base + 1, other.span)
                or (share.page is not None and share.page == other.page)
                or _overlap(share.vector_base, share.span, other.vector_base, other.span)
                or _overlap(share.lba_offset, share.blocks, other.lba_offset, other.blocks)
                or bool(set(share.asids) & set(other.asids))
                or _extents_overlap(share.cmb_extent, other.cmb_extent)
            )
            if clash:
                raise ConfigError(f"share {share.name!r} overlaps {other.name!r} on {g.name}")
        if (
            share.qid_base + share.span > g.queue_pairs
            or share.lba_offset + share.blocks > g.blocks
            or (share.cmb_offset is not None and share.cmb_offset + share.cmb_bytes > g.cmb_bytes)
        ):
            raise ConfigError(f"share {share.name!r} is beyond what {g.name} has")
        self.shares[share.name] = share
        return share

    def release(self, name: str) -> Share | None:
        return self.shares.pop(name, None)

    def by_admin_slot(self, qid: int) -> Share | None:
        """The page-mode share whose guest admin doorbells are real queue id ``qid``'s."""
        for s in self.shares.values():
            if s.mode == PAGE_MODE and s.qid_base == qid:
                return s
        return None

    def by_real_vector(self, vector: int) -> Share | None:
        for s in self.shares.values():
            if s.guest_vector(vector) is not None or s.backup_guest_vector(vector) is not None:
                return s
        return None
